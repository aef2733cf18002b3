"""The wrapt a bundle carries (``python -m npu_shim bundle``, npu_shim/cli/bundle.py): its wheels
downloaded from PyPI through pip (``pip download --only-binary``: nothing is built from source),
one per CPython x machine and the pure-Python one, and the ``wrapt/`` package taken out of each.

Imports re, subprocess and zipfile inside its functions only."""

import os
import sys

from npu_shim.cli.bundle_target import BundleError
from npu_shim.cli.bundle_verify import shown

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
# The command that runs pip.  tests/cli/test_bundle.py replaces it (in its wrapper process, never
# through the environment) with a stand-in that waits, to stop a build while "pip" runs.
_PIP = (sys.executable, "-m", "pip")


def oldest_glibc(wheel_name):
    """The lowest glibc any of a wheel file's manylinux tags needs, e.g. (2, 5)."""
    import re

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
    import subprocess

    from npu_shim.cli import children

    command = list(_PIP) + ["download", "-q", "--disable-pip-version-check", "--no-deps",
                            "--only-binary=:all:", "-d", dest] + args
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # pip must not run with the shim active
    try:
        # pip in its own process group, killed with it on every way out (a stop signal included)
        returncode, out, _err = children.run(command, _PIP_TIMEOUT_S, env=env, merge_stderr=True)
    except subprocess.TimeoutExpired:
        raise BundleError("%s: pip timed out after %ds" % (what, _PIP_TIMEOUT_S)) from None
    except OSError as exc:
        raise BundleError("%s: cannot run pip: %s" % (what, exc.strerror or exc)) from None
    if returncode != 0:
        tail = "\n".join(out.strip().splitlines()[-5:])
        raise BundleError("%s failed: %s\n%s" % (what, " ".join(command), tail))
    wheels = [name for name in os.listdir(dest) if name.endswith(".whl")]
    if len(wheels) != 1:
        raise BundleError("%s: expected one wheel in %s, found %s" % (what, dest, wheels or "none"))
    return os.path.join(dest, wheels[0])


def _mkdirs_below(top, path):
    """``os.makedirs(path)`` where ``top``'s parent must exist already: a staging directory that
    vanished (its parent re-pointed) fails here instead of being made again somewhere else."""
    if not os.path.isdir(os.path.dirname(top)):
        raise BundleError("the staging directory %s is gone" % shown(top))
    os.makedirs(path)


def download_wrapt(workdir, version, pythons, machines):
    """{build folder name: wheel path} for every C build plus the pure-Python one."""
    wheels = {}
    for python in pythons:
        abi = "cp" + python.replace(".", "")
        for machine in machines:
            dest = os.path.join(workdir, "%s-%s" % (abi, machine))
            _mkdirs_below(workdir, dest)
            args = ["--python-version", python, "--implementation", "cp", "--abi", abi]
            for platform in MANYLINUX[machine]:
                args += ["--platform", platform]
            wheel = _pip_download(args + ["wrapt==%s" % version], dest,
                                  "wrapt %s for CPython %s on %s" % (version, python, machine))
            glibc = oldest_glibc(os.path.basename(wheel))
            wheels["%s-%s-glibc%d.%d" % (abi, machine, glibc[0], glibc[1])] = wheel
    dest = os.path.join(workdir, "pure")
    _mkdirs_below(workdir, dest)
    wheels["py3-none-any"] = _pip_download(["--platform", "any", "wrapt==%s" % version], dest,
                                           "wrapt %s pure-Python wheel" % version)
    return wheels


def extract_package(wheel, dest):
    """Extract the ``wrapt/`` package of a wheel (not its stubs or dist-info) into dest/wrapt."""
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.namelist() if m.startswith("wrapt/") and not m.endswith(".c")]
        if "wrapt/__init__.py" not in members:
            raise BundleError("%s holds no wrapt package" % wheel)
        archive.extractall(dest, members)
