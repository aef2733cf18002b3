"""Drop-in on an image that has only what sglang's own NPU image has: no wrapt, read-only mounts,
``PYTHONDONTWRITEBYTECODE=1``, any CPython 3.9-3.13; a pip-installed shim; children of a process
that called ``install()``.

Each case runs fresh interpreters -- bare venvs without wrapt (``python -m venv --without-pip``)
of every CPython 3.9-3.13 this machine has (pyenv's under ``PYENV_ROOT``, or ``python3.X`` on
``PATH``: dev/shimdev/envs/machine.py) -- against the minimal ``sglang`` tree and demo patch of
tests/test_bootstrap.py.  The real releases get the same treatment in tests/test_drop_in_real.py.
"""

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap

import pytest

from npu_shim.cli import bundle, bundle_verify
from npu_shim.runtime import installer
from shimdev.envs import machine
from test_bootstrap import DEMO_PATCH, IMAGE_SITECUSTOMIZE, last_json, run_python
from test_bootstrap import tree as bootstrap_tree  # noqa: F401 - a fixture

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHONS = machine.PYTHONS

# The demo patch, made "explicitly requested" (like zbal with a size) when DEMO_MUST_HONOUR is set.
DEMO_PATCH_MUST_HONOUR = DEMO_PATCH.replace(
    "    def probe(self, view):",
    "    def must_honour(self, environ):\n"
    "        return bool(environ.get('DEMO_MUST_HONOUR'))\n\n"
    "    def probe(self, view):")

# What a process reports: the demo patch's state, where wrapt came from, what `import wrapt` gives.
REPORT = """
import json, sys
import npu_shim
from sglang.srt.utils import get_npu_memory_capacity
from npu_shim.runtime import wrapt_loader
origin = wrapt_loader.loaded_origin()
state = npu_shim.states().get("demo", {})
try:
    import wrapt
    app_wrapt = wrapt.__version__
except ImportError:
    app_wrapt = None
print(json.dumps({"value": get_npu_memory_capacity(), "state": state.get("state"),
                  "reason": state.get("reason"), "origin": origin.as_dict() if origin else None,
                  "app_wrapt": app_wrapt, "python": "%d.%d" % sys.version_info[:2],
                  "c_ext": "npu_shim._wrapt._wrappers" in sys.modules}))
"""


def cpython(version):
    """The executable of CPython ``version`` on this machine (pyenv's under PYENV_ROOT, or
    python3.X on PATH: shimdev.envs.machine); a test that needs a missing one fails saying how to get it."""
    found = machine.cpython(version)
    if found is None:
        pytest.fail(machine.how_to_get(version), pytrace=False)
    return found


@pytest.fixture(scope="module")
def bare_venvs(tmp_path_factory):
    """{version: python of a venv with nothing installed} -- no wrapt, as on an Ascend image."""
    root = tmp_path_factory.mktemp("bare")
    cache = {}

    def get(version="3.11"):
        if version not in cache:
            venv = root / version
            subprocess.run([cpython(version), "-m", "venv", "--without-pip", str(venv)],
                           check=True, capture_output=True, timeout=120)
            cache[version] = str(venv / "bin" / "python")
            probe = subprocess.run([cache[version], "-c", "import wrapt"], capture_output=True)
            assert probe.returncode != 0, "a bare venv must not see a wrapt"
        return cache[version]

    return get


@pytest.fixture
def tree(bootstrap_tree):
    """test_bootstrap's fake sglang tree, its demo patch "explicitly requested" on DEMO_MUST_HONOUR."""
    (bootstrap_tree / "image" / "demo.py").write_text(DEMO_PATCH_MUST_HONOUR)
    return bootstrap_tree


def snapshot(root, facts=lambda stat: (stat.st_size, stat.st_mtime_ns)):
    """Every path under root, links not followed, with ``facts`` of its lstat (size and mtime)."""
    found = {}
    for folder, _dirs, names in os.walk(str(root)):
        for name in names + _dirs:
            path = os.path.join(folder, name)
            found[os.path.relpath(path, str(root))] = facts(os.lstat(path))
    return found


def run(python, tree, code, first, env=None, readonly=None, check=True, after=()):
    """``code`` in a fresh ``python``; PYTHONPATH = first, the image dir, the fake sglang, after
    (stands for the image's site-packages).  ``readonly``: a directory mounted read-only for the
    process and its children."""
    paths = [str(p) for p in ([first] if first else [])] + [str(tree / "image"), str(tree / "pkgs")]
    paths += [str(p) for p in after]
    command = [python, "-c", textwrap.dedent(code)]
    if readonly:
        mount = ("mount --bind {0} {0} && mount -o remount,ro,bind {0} && exec \"$@\""
                 .format(readonly))
        command = ["unshare", "-m", "sh", "-c", mount, "sh"] + command
    return run_python(command, tree, paths, env, check, drop=("NPU_SHIM_", "SGLANG_", "DEMO_", "PYTHON"),
                      timeout=180)


# -- the bundle ------------------------------------------------------------------------------------

def test_bundle_holds_every_build_pyc_and_a_manifest_that_verifies(built_bundle):
    manifest = json.loads((built_bundle / "MANIFEST").read_text())
    expected = {"py3-none-any"} | {"cp%s-%s" % (v.replace(".", ""), m)
                                   for v in PYTHONS for m in ("x86_64", "aarch64")}
    assert {"-".join(b.split("-")[:2]) if b != "py3-none-any" else b
            for b in manifest["wrapt"]["builds"]} == expected
    assert sorted(manifest["pyc"]) == sorted("cpython-%s" % v for v in PYTHONS)
    assert manifest["wrapt"]["version"] == bundle.WRAPT_VERSION
    for version in PYTHONS:
        tag = "cpython-%s.pyc" % version.replace(".", "")
        assert (built_bundle / "__pycache__" / ("sitecustomize." + tag)).is_file()
        assert (built_bundle / "npu_shim" / "__pycache__" / ("_bootstrap." + tag)).is_file()
    # Top level: only what may shadow nothing in an image.
    assert sorted(os.listdir(str(built_bundle))) == ["MANIFEST", "SHA256SUMS", "__pycache__",
                                                     "npu_shim", "sitecustomize.py"]
    assert bundle_verify.verify(str(built_bundle)) == []
    sums = subprocess.run(["sha256sum", "--strict", "-c", "SHA256SUMS"], cwd=str(built_bundle),
                          capture_output=True, text=True)
    assert sums.returncode == 0, sums.stdout[-2000:]
    with tarfile.open(str(built_bundle) + ".tar.gz") as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {f["path"] for f in manifest["files"]} <= names


def test_bundle_pyc_checks_no_source_for_sitecustomize_and_checks_the_package_s(built_bundle):
    """Every process on the node loads sitecustomize's .pyc: unchecked-hash (its source is neither
    read nor hashed); the package's are checked-hash.  Both carry their source's hash."""
    import importlib.util

    def flags_and_hash(pyc, source):
        data = pyc.read_bytes()
        ours = ".cpython-%d%d." % sys.version_info[:2] in pyc.name
        # the hash is keyed by the interpreter's magic number: only this one's can be computed here
        expected = importlib.util.source_hash(source.read_bytes()) if ours else data[8:16]
        return int.from_bytes(data[4:8], "little"), data[8:16] == expected

    for version in PYTHONS:
        for level in ("", ".opt-1", ".opt-2"):  # -O and -OO find theirs, unchecked too
            tag = "cpython-%s%s.pyc" % (version.replace(".", ""), level)
            assert flags_and_hash(built_bundle / "__pycache__" / ("sitecustomize." + tag),
                                  built_bundle / "sitecustomize.py") == (0b01, True)
            assert flags_and_hash(built_bundle / "npu_shim" / "__pycache__" / ("_bootstrap." + tag),
                                  built_bundle / "npu_shim" / "_bootstrap.py") == (0b11, True)


@pytest.mark.parametrize("version", PYTHONS)
def test_an_image_sitecustomize_in_a_folder_listed_at_start_up_is_chained(version, built_bundle, tree, tmp_path):
    """As on a Debian image: the image's sitecustomize lies in a folder the interpreter has already
    listed before sitecustomize runs (a .pth file imported a module from it)."""
    venv = tmp_path / "venv"
    subprocess.run([cpython(version), "-m", "venv", "--without-pip", str(venv)],
                   check=True, capture_output=True, timeout=120)
    site_packages = venv / "lib" / ("python" + version) / "site-packages"
    (site_packages / "sitecustomize.py").write_text(IMAGE_SITECUSTOMIZE)
    (site_packages / "listed_early.py").write_text("")
    (site_packages / "listed_early.pth").write_text("import listed_early\n")
    (tree / "image" / "sitecustomize.py").unlink()  # the one in site-packages is the image's
    proc = run(str(venv / "bin" / "python"), tree, """
        import json, sys
        print(json.dumps([sys.modules["npu_shim.chained_sitecustomize"].__file__,
                          "listed_early" in sys.modules]))
    """, built_bundle)
    assert last_json(proc) == [str(site_packages / "sitecustomize.py"), True]
    assert (tree / "marker").read_text() == "ran\n"


def test_bundle_verify_names_a_changed_file(built_bundle, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(str(built_bundle), str(copy))
    (copy / "npu_shim" / "core" / "config.py").write_text("# edited\n")
    os.remove(str(copy / "sitecustomize.py"))
    assert sorted(bundle_verify.verify(str(copy))) == ["npu_shim/core/config.py: changed", "sitecustomize.py: missing"]


def test_bundle_refuses_a_non_empty_target_and_leaves_it_alone(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("mine")
    proc = subprocess.run([sys.executable, "-m", "npu_shim", "bundle", str(out)], cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True)
    assert proc.returncode == 4  # docs/operations.md: a problem found
    assert "exists and is not empty (use --force" in proc.stderr
    assert os.listdir(str(out)) == ["keep"]


@pytest.mark.parametrize("version", PYTHONS)
def test_read_only_bundle_activates_without_wrapt_on_each_python(version, bare_venvs, built_bundle, tree):
    """The image has no wrapt; the bundle is mounted read-only, nothing may be written: the patch
    applies in the process and in a spawned child, with the bundle's C build for this Python."""
    script = tree / "image" / "spawn_main.py"
    script.write_text(textwrap.dedent("""
        import json, multiprocessing as mp, subprocess, sys

        def child(queue):
            import npu_shim
            from sglang.srt.utils import get_npu_memory_capacity
            queue.put([get_npu_memory_capacity(), npu_shim.states()["demo"]["state"]])

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            proc = ctx.Process(target=child, args=(queue,))
            proc.start()
            print(json.dumps(queue.get(timeout=120)))
            proc.join()
    """))
    before = snapshot(built_bundle)
    proc = run(bare_venvs(version), tree, REPORT + "\nimport runpy; runpy.run_path(%r, run_name='__main__')"
               % str(script), built_bundle, readonly=built_bundle)
    lines = proc.stdout.strip().splitlines()
    out, spawned = json.loads(lines[-2]), json.loads(lines[-1])
    assert out["state"] == "applied" and out["value"] == 1001
    assert out["origin"]["source"] == "bundle"
    assert out["origin"]["build"] == "cp%s-x86_64-glibc2.5" % version.replace(".", "")
    assert out["origin"]["note"] is None and out["c_ext"] is True
    assert out["app_wrapt"] is None, "the application must not see a wrapt the image lacks"
    assert spawned == [1001, "applied"]
    assert snapshot(built_bundle) == before


def test_pure_python_fallback_when_the_bundle_has_no_c_build_for_this_python(bare_venvs, built_bundle, tree, tmp_path):
    copy = tmp_path / "npu-shim"
    shutil.copytree(str(built_bundle), str(copy))
    for build in glob.glob(str(copy / "npu_shim" / "_vendor" / "wrapt" / "cp311-*")):
        shutil.rmtree(build)
    out = last_json(run(bare_venvs("3.11"), tree, REPORT, copy, readonly=copy))
    assert out["state"] == "applied" and out["value"] == 1001
    assert out["origin"]["build"] == "py3-none-any" and out["c_ext"] is False
    assert out["origin"]["note"].startswith("no C build for cpython 3.11 on x86_64")


def _wrapt_layer(tmp_path_factory, version, python="3.11"):
    """A directory holding wrapt ``version`` built for CPython ``python`` (the image's own wrapt,
    as its site-packages would hold it)."""
    target = tmp_path_factory.mktemp("wrapt-" + version)
    abi = "cp" + python.replace(".", "")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "--no-deps", "--only-binary=:all:", "--target", str(target),
                    "--python-version", python, "--implementation", "cp", "--abi", abi,
                    "--platform", "manylinux1_x86_64", "--platform", "manylinux2014_x86_64",
                    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux_2_5_x86_64",
                    "wrapt==" + version], check=True, capture_output=True, timeout=600)
    return target


def test_image_wrapt_1_14_is_used_when_present(bare_venvs, built_bundle, tree, tmp_path_factory):
    layer = _wrapt_layer(tmp_path_factory, "1.14.1")
    out = last_json(run(bare_venvs("3.11"), tree, REPORT, built_bundle, after=[layer],
                        readonly=built_bundle))
    assert out["state"] == "applied" and out["value"] == 1001
    assert out["origin"]["source"] == "image" and out["origin"]["version"] == "1.14.1"
    assert out["origin"]["path"] == str(layer / "wrapt")
    assert out["app_wrapt"] == "1.14.1"


def test_image_wrapt_older_than_1_14_is_left_to_the_application(bare_venvs, built_bundle, tree,
                                                                tmp_path_factory):
    # 1.13.3 has no wheel for 3.11: the image here is a CPython 3.10 one.
    layer = _wrapt_layer(tmp_path_factory, "1.13.3", python="3.10")
    out = last_json(run(bare_venvs("3.10"), tree, REPORT, built_bundle, after=[layer],
                        readonly=built_bundle))
    assert out["state"] == "applied" and out["value"] == 1001
    assert out["origin"]["source"] == "bundle" and out["origin"]["version"] == bundle.WRAPT_VERSION
    assert out["origin"]["build"] == "cp310-x86_64-glibc2.5" and out["c_ext"] is True
    assert "the image's wrapt 1.13.3 at %s is older than 1.14" % (layer / "wrapt") in out["origin"]["note"]
    assert out["app_wrapt"] == "1.13.3", "the application still gets the image's own wrapt"


# -- the truth when wrapt is missing ------------------------------------------------------------------

def test_without_wrapt_patches_fail_in_one_line_each_and_sglang_still_imports(bare_venvs, tree):
    proc = run(bare_venvs("3.11"), tree, REPORT, REPO)
    out = last_json(proc)
    assert out["value"] == 1000 and out["state"] == "failed" and out["origin"] is None
    assert out["reason"].startswith("wrapt is not available: wrapt is not installed in this image, "
                                    "and this npu-shim is not a bundle")
    assert "python -m npu_shim bundle DIR" in out["reason"]
    lines = [re.sub(r"^\[npu-shim [^ ]+ sglang [^ ]+ pid [0-9]+\] ", "", line)
             for line in proc.stderr.splitlines() if line.startswith("[npu-shim ")]
    assert lines == ["demo=failed", "demo: failed (%s)" % out["reason"]], proc.stderr


def test_without_wrapt_a_feature_asked_for_explicitly_stops_the_process(bare_venvs, tree):
    proc = run(bare_venvs("3.11"), tree, REPORT, REPO, env={"DEMO_MUST_HONOUR": "1"}, check=False)
    assert proc.returncode == 1
    assert ("npu_shim.core.framework.ShimError: npu-shim: demo was requested but is failed: wrapt is not "
            "available") in proc.stderr
    assert proc.stdout == ""


def test_status_without_wrapt_says_so_and_shows_no_applied(bare_venvs, tree):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("NPU_SHIM_", "SGLANG_", "PYTHON"))}
    full_env["PYTHONPATH"] = os.pathsep.join([REPO, str(tree / "image"), str(tree / "pkgs")])
    full_env["CHAIN_MARKER"] = str(tree / "marker")
    proc = subprocess.run([bare_venvs("3.11"), "-m", "npu_shim", "status", "--json"], cwd=str(tree),
                          env=full_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["wrapt"]["source"] == "missing"
    assert [(p["name"], p["state"]) for p in info["patches"]] == [("demo", "failed")]
    assert info["patches"][0]["reason"].startswith("wrapt is not available: ")
    text = subprocess.run([bare_venvs("3.11"), "-m", "npu_shim", "status"], cwd=str(tree), env=full_env,
                          capture_output=True, text=True, timeout=60).stdout
    assert "  wrapt: missing (wrapt is not installed in this image" in text
    assert "applied" not in text


# -- activation reaches every process ------------------------------------------------------------------

CHILDREN_MAIN = """
import json, multiprocessing as mp, os, subprocess, sys

def child(queue):
    import npu_shim
    from sglang.srt.utils import get_npu_memory_capacity
    queue.put([get_npu_memory_capacity(), npu_shim.states().get("demo", {}).get("state")])

PROBE = ("import json, npu_shim; from sglang.srt.utils import get_npu_memory_capacity; "
         "print(json.dumps([get_npu_memory_capacity(), npu_shim.states().get('demo', {}).get('state')]))")

if __name__ == "__main__":
    import npu_shim
    if not os.environ.get("SKIP_INSTALL"):
        npu_shim.install()   # in the parent only: the children must get it from the environment
    results = {}
    for method in ("spawn", "forkserver"):
        ctx = mp.get_context(method)
        queue = ctx.Queue()
        proc = ctx.Process(target=child, args=(queue,))
        proc.start()
        results[method] = queue.get(timeout=120)
        proc.join()
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    results["subprocess"] = json.loads(out.stdout.strip().splitlines()[-1])
    from sglang.srt.utils import get_npu_memory_capacity
    results["parent"] = [get_npu_memory_capacity(), npu_shim.states().get("demo", {}).get("state")]
    print(json.dumps(results))
"""


def _run_children_main(python, tree, first, after=(), env=None):
    script = tree / "image" / "children_main.py"
    script.write_text(CHILDREN_MAIN)
    return last_json(run(python, tree, "import runpy; runpy.run_path(%r, run_name='__main__')" % str(script),
                         first, after=after, env=env))


def test_install_reaches_spawn_forkserver_and_subprocess_children(tree):
    # The repo is importable but last: its sitecustomize is shadowed, nothing armed the shim at start.
    out = _run_children_main(sys.executable, tree, None, after=[REPO])
    patched = [1001, "applied"]
    assert out == {"spawn": patched, "forkserver": patched, "subprocess": patched, "parent": patched}
    control = _run_children_main(sys.executable, tree, None, after=[REPO], env={"SKIP_INSTALL": "1"})
    unpatched = [1000, None]
    assert control == {"spawn": unpatched, "forkserver": unpatched, "subprocess": unpatched,
                       "parent": unpatched}


def test_reach_children_puts_the_shim_first_without_an_empty_entry():
    root = REPO
    environ = {}
    assert installer.reach_children(environ) == "PYTHONPATH" and environ["PYTHONPATH"] == root
    environ = {"PYTHONPATH": "/a::/b:%s" % root}
    installer.reach_children(environ)
    assert environ["PYTHONPATH"] == os.pathsep.join([root, "/a", "/b"])
    assert installer.reach_children(environ) is None


@pytest.fixture(scope="module")
def pip_installed(tmp_path_factory):
    """A venv where npu-shim is pip-installed from a wheel of this checkout (with its wrapt)."""
    root = tmp_path_factory.mktemp("pipinstall")
    # A copy to build from: pip builds in the source tree, and the checkout may be read-only.
    source = root / "source"
    shutil.copytree(REPO, str(source), ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "tests", "scripts", "build", "*.egg-info"))
    wheels = root / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(source), "-w",
                    str(wheels)], check=True, capture_output=True, timeout=600, cwd=str(root))
    venv = root / "venv"
    subprocess.run([cpython("3.11"), "-m", "venv", str(venv)], check=True, capture_output=True,
                   timeout=300)
    python = str(venv / "bin" / "python")
    wheel = glob.glob(str(wheels / "npu_shim-*.whl"))[0]
    subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", wheel,
                    "wrapt==%s" % bundle.WRAPT_VERSION], check=True, capture_output=True, timeout=600)
    return python


def test_pip_install_activates_with_one_variable(pip_installed, tree):
    site = subprocess.run([pip_installed, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.isfile(os.path.join(site, installer.PTH_NAME))
    on = last_json(run(pip_installed, tree, REPORT, None, env={"NPU_SHIM_ACTIVATE": "1"}))
    assert on["state"] == "applied" and on["value"] == 1001 and on["origin"]["source"] == "image"
    off = last_json(run(pip_installed, tree, REPORT, None))
    assert off["state"] is None and off["value"] == 1000


def test_pip_install_then_install_reaches_children(pip_installed, tree):
    out = _run_children_main(pip_installed, tree, None)
    patched = [1001, "applied"]
    assert out == {"spawn": patched, "forkserver": patched, "subprocess": patched, "parent": patched}
