"""``python -m npu_shim bundle OUT_DIR``: one self-contained directory to mount into an image.

An Ascend sglang image has no wrapt, and its mounts are read-only with ``PYTHONDONTWRITEBYTECODE=1``
set, so the bundle brings what the shim needs and is compiled ahead of time:

    OUT_DIR/sitecustomize.py                 the bootstrap (put OUT_DIR first on PYTHONPATH)
    OUT_DIR/npu_shim/                        the package
    OUT_DIR/npu_shim/_vendor/wrapt/<build>/  wrapt per CPython 3.9-3.13 x (x86_64, aarch64), and
                                             py3-none-any (pure Python) as the fallback
    __pycache__/*.pyc                        checked-hash .pyc for every interpreter given
                                             (valid whatever the files' mtimes become)
    OUT_DIR/MANIFEST                         JSON: versions, builds, interpreters, sha256 per file
    OUT_DIR/SHA256SUMS                       the same hashes for ``sha256sum -c``
    OUT_DIR.tar.gz                           the whole directory

Wheels come from PyPI through pip (``pip download --only-binary``); nothing is built from source.
The directory is assembled beside OUT_DIR and renamed into place only when complete.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile

import npu_shim

WRAPT_VERSION = "2.5.2"
PYTHONS = ("3.9", "3.10", "3.11", "3.12", "3.13")
MACHINES = ("x86_64", "aarch64")
# Oldest first: pip matches a wheel's tags exactly, so every manylinux name wrapt publishes is given.
MANYLINUX = {
    "x86_64": ("manylinux1_x86_64", "manylinux_2_5_x86_64", "manylinux2010_x86_64",
               "manylinux_2_12_x86_64", "manylinux2014_x86_64", "manylinux_2_17_x86_64",
               "manylinux_2_28_x86_64"),
    "aarch64": ("manylinux2014_aarch64", "manylinux_2_17_aarch64", "manylinux_2_28_aarch64"),
}
_LEGACY_GLIBC = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
_PIP_TIMEOUT_S = 600


class BundleError(RuntimeError):
    """The bundle could not be built; nothing was left at OUT_DIR."""


def oldest_glibc(wheel_name):
    """The lowest glibc any of a wheel file's manylinux tags needs, e.g. (2, 5)."""
    platforms = wheel_name[:-len(".whl")].split("-")[-1].split(".")
    found = []
    for tag in platforms:
        match = re.match(r"manylinux_(\d+)_(\d+)_", tag)
        if match:
            found.append((int(match.group(1)), int(match.group(2))))
        elif tag.split("_")[0] in _LEGACY_GLIBC:
            found.append(_LEGACY_GLIBC[tag.split("_")[0]])
    if not found:
        raise BundleError("%s has no manylinux tag" % wheel_name)
    return min(found)


def _pip_download(args, dest, what):
    command = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
               "--no-deps", "--only-binary=:all:", "-d", dest] + args
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # pip must not run with the shim active
    try:
        proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, timeout=_PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise BundleError("%s: pip timed out after %ds" % (what, _PIP_TIMEOUT_S)) from None
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-5:])
        raise BundleError("%s failed: %s\n%s" % (what, " ".join(command), tail))
    wheels = [name for name in os.listdir(dest) if name.endswith(".whl")]
    if len(wheels) != 1:
        raise BundleError("%s: expected one wheel in %s, found %s" % (what, dest, wheels or "none"))
    return os.path.join(dest, wheels[0])


def download_wrapt(workdir, version, pythons, machines):
    """{build folder name: wheel path} for every C build plus the pure-Python one."""
    wheels = {}
    for python in pythons:
        abi = "cp" + python.replace(".", "")
        for machine in machines:
            dest = os.path.join(workdir, "%s-%s" % (abi, machine))
            os.makedirs(dest)
            args = ["--python-version", python, "--implementation", "cp", "--abi", abi]
            for platform in MANYLINUX[machine]:
                args += ["--platform", platform]
            wheel = _pip_download(args + ["wrapt==%s" % version], dest,
                                  "wrapt %s for CPython %s on %s" % (version, python, machine))
            glibc = oldest_glibc(os.path.basename(wheel))
            wheels["%s-%s-glibc%d.%d" % (abi, machine, glibc[0], glibc[1])] = wheel
    dest = os.path.join(workdir, "pure")
    os.makedirs(dest)
    wheels["py3-none-any"] = _pip_download(["--platform", "any", "wrapt==%s" % version], dest,
                                           "wrapt %s pure-Python wheel" % version)
    return wheels


def _extract_package(wheel, dest):
    """Extract the ``wrapt/`` package of a wheel (not its stubs or dist-info) into dest/wrapt."""
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.namelist() if m.startswith("wrapt/") and not m.endswith(".c")]
        if "wrapt/__init__.py" not in members:
            raise BundleError("%s holds no wrapt package" % wheel)
        archive.extractall(dest, members)


def _copy_shim(root):
    """sitecustomize.py and the npu_shim package (sources only) into root."""
    source_package = os.path.dirname(os.path.abspath(npu_shim.__file__))
    source_root = os.path.dirname(source_package)
    bootstrap = os.path.join(source_root, "sitecustomize.py")
    if not os.path.isfile(bootstrap):
        raise BundleError("no sitecustomize.py beside %s: bundle from a checkout of npu-shim"
                          % source_package)
    shutil.copy2(bootstrap, root)
    shutil.copytree(source_package, os.path.join(root, "npu_shim"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "_vendor"))


def interpreters(requested):
    """[(path, "3.11")] for the interpreters to compile .pyc with: those requested, else this one,
    every ``python3.9`` .. ``python3.13`` on PATH and every CPython 3.9-3.13 pyenv has."""
    candidates = list(requested) or [sys.executable] + [
        found for found in (shutil.which("python" + v) for v in PYTHONS) if found] + _pyenv_pythons()
    result, seen = [], set()
    for path in candidates:
        try:
            version = subprocess.run(
                [path, "-c", "import sys; print('%d.%d %s' % (sys.version_info[:2] + "
                             "(sys.implementation.name,)))"],
                capture_output=True, text=True, timeout=60, check=True).stdout.split()
        except (OSError, subprocess.SubprocessError) as exc:
            if requested:
                raise BundleError("cannot run --python %s: %s" % (path, exc)) from None
            continue
        if version[1] != "cpython" or version[0] not in PYTHONS:
            if requested:
                raise BundleError("--python %s is %s %s; the bundle supports CPython %s"
                                  % (path, version[1], version[0], ", ".join(PYTHONS)))
            continue
        if version[0] not in seen:
            seen.add(version[0])
            result.append((path, version[0]))
    return result


def _pyenv_pythons():
    """Interpreters pyenv has installed (its shims on PATH run only the selected ones)."""
    import glob

    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    return sorted(glob.glob(os.path.join(root, "versions", "3.*", "bin", "python3")))


_COMPILE = """\
import compileall, os, py_compile, re, sys
root = sys.argv[1]
tag = "cp%d%d-" % sys.version_info[:2]
vendor = os.path.join(root, "npu_shim", "_vendor", "wrapt")
ok = compileall.compile_file(os.path.join(root, "sitecustomize.py"), quiet=2,
                             invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
skip = re.compile(re.escape(vendor + os.sep) + r"(?!(%s|py3-none-any))" % re.escape(tag))
ok &= compileall.compile_dir(os.path.join(root, "npu_shim"), quiet=2, rx=skip,
                             invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
sys.exit(0 if ok else 1)
"""


def compile_pyc(root, pythons):
    for path, version in pythons:
        proc = subprocess.run([path, "-c", _COMPILE, root], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise BundleError("compiling .pyc with %s (%s) failed:\n%s%s"
                              % (path, version, proc.stdout[-2000:], proc.stderr[-2000:]))


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 16), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(root, wrapt_version, builds, pythons):
    files = []
    for folder, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(folder, name)
            files.append({"path": os.path.relpath(path, root), "size": os.path.getsize(path),
                          "sha256": _sha256(path)})
    manifest = {
        "npu_shim": npu_shim.__version__,
        "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wrapt": {"version": wrapt_version, "builds": sorted(builds)},
        "pyc": ["cpython-%s" % version for _, version in pythons],
        "files": files,
    }
    with open(os.path.join(root, "MANIFEST"), "w") as handle:
        json.dump(manifest, handle, indent=1)
        handle.write("\n")
    with open(os.path.join(root, "SHA256SUMS"), "w") as handle:
        handle.writelines("%s  %s\n" % (f["sha256"], f["path"]) for f in files)
    return manifest


def verify(root):
    """Files of a bundle that differ from its MANIFEST ([] when intact); None if it has none."""
    try:
        with open(os.path.join(root, "MANIFEST")) as handle:
            manifest = json.load(handle)
    except (OSError, ValueError):
        return None
    problems = []
    for entry in manifest["files"]:
        path = os.path.join(root, entry["path"])
        if not os.path.isfile(path):
            problems.append("%s: missing" % entry["path"])
        elif _sha256(path) != entry["sha256"]:
            problems.append("%s: changed" % entry["path"])
    return problems


def build(out_dir, python_paths=(), wrapt_version=WRAPT_VERSION, pythons=PYTHONS,
          machines=MACHINES, force=False, log=print):
    """Build the bundle at ``out_dir`` (and ``out_dir.tar.gz``); returns the manifest."""
    out_dir = os.path.abspath(out_dir.rstrip(os.sep))
    if os.path.exists(out_dir) and os.listdir(out_dir) and not force:
        raise BundleError("%s exists and is not empty (use --force to replace it)" % out_dir)
    compilers = interpreters(python_paths)
    if not compilers:
        raise BundleError("no CPython %s interpreter found to compile .pyc with" % "/".join(PYTHONS))
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".npu-shim-bundle-", dir=parent)
    try:
        root = os.path.join(staging, "bundle")
        os.makedirs(root)
        _copy_shim(root)
        log("downloading wrapt %s for CPython %s on %s, and its pure-Python wheel"
            % (wrapt_version, ", ".join(pythons), ", ".join(machines)))
        wheels = download_wrapt(os.path.join(staging, "wheels"), wrapt_version, pythons, machines)
        vendor = os.path.join(root, "npu_shim", "_vendor", "wrapt")
        for name, wheel in sorted(wheels.items()):
            _extract_package(wheel, os.path.join(vendor, name))
        log("compiling .pyc (checked-hash) with CPython %s" % ", ".join(v for _, v in compilers))
        compile_pyc(root, compilers)
        manifest = write_manifest(root, wrapt_version, wheels, compilers)
        archive = os.path.join(staging, "bundle.tar.gz")
        with tarfile.open(archive, "w:gz") as tar:
            tar.add(root, arcname=os.path.basename(out_dir))
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(root, out_dir)
        os.replace(archive, out_dir + ".tar.gz")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log("bundle: %s (%d files), %s.tar.gz" % (out_dir, len(manifest["files"]), out_dir))
    return manifest
