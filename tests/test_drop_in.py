"""Drop-in on an image that has only what sglang's own NPU image has: no wrapt, read-only mounts,
``PYTHONDONTWRITEBYTECODE=1``, any CPython 3.9-3.13; a pip-installed shim; children of a process
that called ``install()``.

Each case runs fresh interpreters -- bare venvs without wrapt (``python -m venv --without-pip``)
of every CPython pyenv has here -- against the minimal ``sglang`` tree and demo patch of
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

from npu_shim.cli import bundle
from npu_shim.runtime import activation, installer, wrapt_loader
from test_bootstrap import DEMO_PATCH
from test_bootstrap import tree as bootstrap_tree  # noqa: F401 - a fixture

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHONS = ("3.9", "3.10", "3.11", "3.12", "3.13")

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


def pyenv_python(version):
    found = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/%s.*/bin/python3" % version)))
    if not found:
        pytest.fail("CPython %s is not installed under ~/.pyenv (this machine kind has 3.9-3.13)"
                    % version, pytrace=False)
    return found[-1]


@pytest.fixture(scope="module")
def bare_venvs(tmp_path_factory):
    """{version: python of a venv with nothing installed} -- no wrapt, as on an Ascend image."""
    root = tmp_path_factory.mktemp("bare")
    cache = {}

    def get(version="3.11"):
        if version not in cache:
            venv = root / version
            subprocess.run([pyenv_python(version), "-m", "venv", "--without-pip", str(venv)],
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


def snapshot(root):
    """Every path under root with its size and mtime."""
    found = {}
    for folder, _dirs, names in os.walk(str(root)):
        for name in names + _dirs:
            path = os.path.join(folder, name)
            stat = os.lstat(path)
            found[os.path.relpath(path, str(root))] = (stat.st_size, stat.st_mtime_ns)
    return found


def run(python, tree, code, first, env=None, readonly=None, check=True, after=()):
    """``code`` in a fresh ``python``; PYTHONPATH = first, the image dir, the fake sglang, after
    (stands for the image's site-packages).  ``readonly``: a directory mounted read-only for the
    process and its children."""
    paths = [str(p) for p in ([first] if first else [])] + [str(tree / "image"), str(tree / "pkgs")]
    paths += [str(p) for p in after]
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("NPU_SHIM_", "SGLANG_", "DEMO_", "PYTHON"))}
    full_env.update({"PYTHONPATH": os.pathsep.join(paths), "CHAIN_MARKER": str(tree / "marker"),
                     "PYTHONDONTWRITEBYTECODE": "1"})
    full_env.update(env or {})
    command = [python, "-c", textwrap.dedent(code)]
    if readonly:
        mount = ("mount --bind {0} {0} && mount -o remount,ro,bind {0} && exec \"$@\""
                 .format(readonly))
        command = ["unshare", "-m", "sh", "-c", mount, "sh"] + command
    proc = subprocess.run(command, cwd=str(tree), env=full_env, capture_output=True, text=True,
                          timeout=180)
    if check and proc.returncode != 0:
        raise AssertionError("exit %d\nstdout:\n%s\nstderr:\n%s" % (proc.returncode, proc.stdout, proc.stderr))
    return proc


def last_json(proc):
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- choosing the wrapt build -----------------------------------------------------------------------

BUILDS = ["cp39-x86_64-glibc2.5", "cp311-x86_64-glibc2.5", "cp311-aarch64-glibc2.17",
          "cp313-aarch64-glibc2.17", "py3-none-any"]


@pytest.mark.parametrize("facts, expected", [
    (("cpython", (3, 11), "x86_64", (2, 36)), "cp311-x86_64-glibc2.5"),
    (("cpython", (3, 11), "aarch64", (2, 35)), "cp311-aarch64-glibc2.17"),
    (("cpython", (3, 11), "arm64", (2, 35)), "cp311-aarch64-glibc2.17"),
    (("cpython", (3, 9), "x86_64", (2, 17)), "cp39-x86_64-glibc2.5"),
    (("cpython", (3, 13), "aarch64", (2, 17)), "cp313-aarch64-glibc2.17"),
    (("cpython", (3, 13), "aarch64", (2, 12)), "py3-none-any"),   # glibc older than the wheel's
    (("cpython", (3, 9), "aarch64", (2, 35)), "py3-none-any"),    # no C build for this pair
    (("cpython", (3, 14), "x86_64", (2, 36)), "py3-none-any"),    # a Python the bundle predates
    (("cpython", (3, 11), "x86_64", None), "py3-none-any"),       # musl: no manylinux wheel runs
    (("pypy", (3, 10), "x86_64", (2, 36)), "py3-none-any"),
])
def test_select_build_per_python_and_platform(facts, expected):
    build, note = wrapt_loader.select_build(BUILDS, *facts)
    assert build == expected
    if expected == "py3-none-any":
        assert note.startswith("no C build for %s %d.%d" % (facts[0], facts[1][0], facts[1][1]))
        assert note.endswith(": pure-Python wrapt")
    else:
        assert note is None


def test_select_build_without_any_usable_build():
    build, note = wrapt_loader.select_build(["cp311-x86_64-glibc2.5"], "cpython", (3, 12), "x86_64", (2, 36))
    assert build is None and note.endswith("and no pure-Python build")


@pytest.mark.parametrize("name, glibc", [
    ("wrapt-2.5.2-cp311-cp311-manylinux1_x86_64.manylinux_2_28_x86_64.manylinux_2_5_x86_64.whl", (2, 5)),
    ("wrapt-2.5.2-cp312-cp312-manylinux2014_aarch64.manylinux_2_17_aarch64.manylinux_2_28_aarch64.whl", (2, 17)),
    ("x-1-cp311-cp311-manylinux_2_34_x86_64.whl", (2, 34)),
])
def test_oldest_glibc_of_a_wheel(name, glibc):
    assert bundle.oldest_glibc(name) == glibc


def test_wrapt_version_is_read_from_source_of_1x_and_2x(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "__init__.py").write_text("__version_info__ = ('1', '14', '1')\n")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "__init__.py").write_text('__version_info__ = ("2", "5", "2")\n')
    assert wrapt_loader.version_of(str(tmp_path / "old")) == (1, 14, 1)
    assert wrapt_loader.version_of(str(tmp_path / "new")) == (2, 5, 2)
    assert wrapt_loader.version_of(str(tmp_path / "none")) is None


# -- loading only what the shim uses ---------------------------------------------------------------

_PRIVATE_LOAD = """
import json, sys
%s
from npu_shim.runtime import wrapt_loader
w = wrapt_loader.load()
calls = []
def original(x):
    return x + 1
wrapped = w.FunctionWrapper(original, lambda f, inst, args, kwargs: calls.append(args) or f(*args, **kwargs))
hooked = []
w.register_post_import_hook(lambda module: hooked.append(module.__name__), "colorsys")
import colorsys
loaded = sorted(n for n in sys.modules if n.startswith(("wrapt", "npu_shim._wrapt")))
try:
    import wrapt  # what the application gets afterwards
    app = [wrapt.__version__, hasattr(wrapt, "decorator"), hasattr(wrapt, "ObjectProxy")]
except ImportError:
    app = None
print(json.dumps({"result": wrapped(1), "calls": calls, "hooked": hooked, "loaded": loaded,
                  "same_as_app": w is sys.modules.get("wrapt"), "app": app,
                  "origin": wrapt_loader.loaded_origin().describe()}))
"""


def _load_wrapt_beside(python, version, before):
    """_PRIVATE_LOAD's report from ``python`` with the image's wrapt ``version`` on PYTHONPATH,
    after the application's own ``before``."""
    from shimdev import sglang_envs

    layer = str(sglang_envs.ensure_wrapt(version))
    env = dict({k: v for k, v in os.environ.items() if not k.startswith(("NPU_SHIM_", "PYTHON"))},
               PYTHONPATH=os.pathsep.join([REPO, layer]), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([python, "-c", _PRIVATE_LOAD % before], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("version, loaded", [
    ("2.5.2", ["npu_shim._wrapt", "npu_shim._wrapt.__wrapt__", "npu_shim._wrapt._wrappers",
               "npu_shim._wrapt.exceptions", "npu_shim._wrapt.importer", "npu_shim._wrapt.wrappers"]),
    ("1.14.1", ["npu_shim._wrapt", "npu_shim._wrapt._wrappers", "npu_shim._wrapt.arguments",
                "npu_shim._wrapt.decorators",
                "npu_shim._wrapt.importer", "npu_shim._wrapt.wrappers"]),
])
def test_only_the_wrappers_and_the_import_hooks_are_loaded_and_the_application_keeps_its_wrapt(
        version, loaded, bare_venvs):
    """The image's wrapt, loaded privately without its __init__ (whose decorators, proxies, locks
    and caches are ~60 % of wrapt's memory); the C extension still loads; the application's own
    ``import wrapt`` afterwards gets the whole image wrapt."""
    out = _load_wrapt_beside(bare_venvs("3.11"), version, before="")
    assert out["result"] == 2 and out["calls"] == [[1]] and out["hooked"] == ["colorsys"]
    assert out["loaded"] == loaded  # and no "wrapt" among them: nothing was imported under its name
    assert out["same_as_app"] is False
    assert out["app"] == [version, True, True]
    assert out["origin"] == "image %s" % version


def test_a_wrapt_the_application_already_imported_is_used_as_it_is(bare_venvs):
    out = _load_wrapt_beside(bare_venvs("3.11"), "2.5.2", before="import wrapt")
    assert out["result"] == 2 and out["hooked"] == ["colorsys"] and out["same_as_app"] is True
    assert not [name for name in out["loaded"] if name.startswith("npu_shim._wrapt")]


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
    assert bundle.verify(str(built_bundle)) == []
    sums = subprocess.run(["sha256sum", "--strict", "-c", "SHA256SUMS"], cwd=str(built_bundle),
                          capture_output=True, text=True)
    assert sums.returncode == 0, sums.stdout[-2000:]
    with tarfile.open(str(built_bundle) + ".tar.gz") as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {f["path"] for f in manifest["files"]} <= names


def test_bundle_verify_names_a_changed_file(built_bundle, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(str(built_bundle), str(copy))
    (copy / "npu_shim" / "core" / "config.py").write_text("# edited\n")
    os.remove(str(copy / "sitecustomize.py"))
    assert sorted(bundle.verify(str(copy))) == ["npu_shim/core/config.py: changed", "sitecustomize.py: missing"]


def test_bundle_refuses_a_non_empty_target_and_leaves_it_alone(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("mine")
    proc = subprocess.run([sys.executable, "-m", "npu_shim", "bundle", str(out)], cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True)
    assert proc.returncode == 1
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
    subprocess.run([pyenv_python("3.11"), "-m", "venv", str(venv)], check=True, capture_output=True,
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


# -- check: the truth from a real process ------------------------------------------------------------

def _check(python, tree, first, env=None, *args):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("NPU_SHIM_", "SGLANG_", "PYTHON"))}
    full_env.update({"PYTHONPATH": os.pathsep.join([str(first), str(tree / "image"), str(tree / "pkgs")]),
                     "CHAIN_MARKER": str(tree / "marker"), "PYTHONDONTWRITEBYTECODE": "1"})
    full_env.update(env or {})
    return subprocess.run([python, "-m", "npu_shim", "check"] + list(args), cwd=str(tree),
                          env=full_env, capture_output=True, text=True, timeout=120)


def test_patch_facts_in_an_image_without_their_packages():
    """What ``check`` shows for zbal and dual_stream_experts where neither memfabric-zbal nor
    sgl-kernel-npu is installed (this interpreter)."""
    from npu_shim.patches import dual_stream_experts, zbal as zbal_patch

    report = dict(zbal_patch.PATCH.check_facts(), **dual_stream_experts.PATCH.check_facts())
    assert report["zbal"]["found"] is False and report["kernel"]["ok"] is False
    assert (report["zbal"]["label"], report["kernel"]["label"]) == ("zbal", "sgl_kernel_npu")


def test_check_reports_what_happened_in_a_real_process(bare_venvs, built_bundle, tree):
    proc = _check(bare_venvs("3.11"), tree, built_bundle, None, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["shim_active"] and report["sitecustomize"] == str(built_bundle / "sitecustomize.py")
    assert report["states"]["demo"]["state"] == "applied"
    assert report["wrapped"] == {"sglang.srt.utils.common:get_npu_memory_capacity": True,
                                 "sglang.srt.utils.common:Scheduler.__init__": True}
    assert report["wrapt"]["source"] == "bundle" and report["wrapt"]["build"] == "cp311-x86_64-glibc2.5"
    assert report["bundle"] == {"is_bundle": True, "ok": True, "problems": [],
                                "text": "%s: files match its MANIFEST" % built_bundle}
    assert report["sglang"] == {"path": str(tree / "pkgs" / "sglang"), "version": "0.5.9"}
    # Only the registered patches say something about the image (here: the demo patch, nothing);
    # zbal's and dual_stream_experts' own facts: test_patch_facts_in_an_image_without_their_packages.
    assert report["patch_facts"] == []
    assert report["npu"]["npu_available"] is False
    assert report["seconds"] < 60
    text = _check(bare_venvs("3.11"), tree, built_bundle).stdout
    assert "  wrapt: bundle %s [cp311-x86_64-glibc2.5]\n" % bundle.WRAPT_VERSION in text
    assert "wrapped: sglang.srt.utils.common:get_npu_memory_capacity" in text


def test_check_fails_where_the_shim_is_not_active_or_wrapt_is_missing(bare_venvs, tree):
    proc = _check(bare_venvs("3.11"), tree, REPO, None, "--json")
    report = json.loads(proc.stdout)
    assert proc.returncode == 0  # active, but no wrapt: every patch says so, as it would in a server
    assert report["states"]["demo"]["state"] == "failed" and report["wrapt"]["source"] == "missing"
    assert report["wrapped"] == {}  # nothing could be wrapped
    strict = _check(bare_venvs("3.11"), tree, REPO, {"NPU_SHIM_STRICT": "1"})
    assert strict.returncode == 3
    off = _check(bare_venvs("3.11"), tree, REPO, {"NPU_SHIM_ENABLED": "0"})
    assert off.returncode == 4
    assert "shim active at start-up: NO" in off.stdout


def test_check_fails_on_a_bundle_whose_files_changed(bare_venvs, built_bundle, tree, tmp_path):
    copy = tmp_path / "npu-shim"
    shutil.copytree(str(built_bundle), str(copy))
    with open(str(copy / "npu_shim" / "ops" / "log.py"), "a") as handle:
        handle.write("\n# edited in place\n")
    proc = _check(bare_venvs("3.11"), tree, copy)
    assert proc.returncode == 4
    assert "1 files differ from its MANIFEST: npu_shim/ops/log.py: changed" in proc.stdout


@pytest.mark.parametrize("how", ["tar -xzf", "cp -r"])
def test_unpacked_or_copied_bundle_starts_from_its_pyc(how, bare_venvs, built_bundle, tree, tmp_path):
    """The .pyc are checked-hash: valid after a tar extraction and after a copy that lost every
    mtime, so no process compiles the shim (and none could write a .pyc on a read-only mount)."""
    dest = tmp_path / "shim"
    dest.mkdir()
    if how == "tar -xzf":
        subprocess.run(["tar", "-xzf", str(built_bundle) + ".tar.gz", "-C", str(dest)], check=True)
        root = dest / built_bundle.name
    else:
        root = dest / "npu-shim"
        subprocess.run(["cp", "-r", str(built_bundle), str(root)], check=True)  # new mtimes
    assert bundle.verify(str(root)) == []
    proc = run(bare_venvs("3.11"), tree, REPORT, root, env={"PYTHONVERBOSE": "1"}, readonly=root)
    out = last_json(proc)
    assert out["state"] == "applied" and out["origin"]["source"] == "bundle" and out["c_ext"]
    def loaded_from_pyc(module):
        folder, name = os.path.split(module)
        pyc = os.path.join(str(root), folder, "__pycache__", name + ".cpython-311.pyc")
        return "code object from '%s'" % pyc in proc.stderr

    for module in ("sitecustomize", "npu_shim/__init__", "npu_shim/runtime/activation",
                   "npu_shim/runtime/wrapt_loader"):
        assert loaded_from_pyc(module), module
    assert "matches %s" % os.path.join(str(root), "sitecustomize.py") in proc.stderr
    # sitecustomize.py is the bootstrap itself: the file is not loaded a second time by its own name.
    assert not loaded_from_pyc("npu_shim/_bootstrap")
    assert "npu_shim/_bootstrap.py" not in proc.stderr


# -- the zbal package check uses ----------------------------------------------------------------------

def test_zbal_api_check_accepts_the_real_wheel_and_names_what_a_package_lacks(tmp_path):
    import zipfile

    from shimdev import realsglang
    from npu_shim.patches import zbal as zbal_patch

    with zipfile.ZipFile(str(realsglang.sglang_envs.ensure_zbal_wheel())) as wheel:
        wheel.extractall(str(tmp_path / "real"), [n for n in wheel.namelist() if n.startswith("zbal/")])
    real = str(tmp_path / "real" / "zbal")
    assert zbal_patch.api_problems(real) == []
    broken = tmp_path / "broken"
    shutil.copytree(real, str(broken))
    init = (broken / "__init__.py").read_text().replace("from .zbal_module import mem_get_info\n", "")
    (broken / "__init__.py").write_text(init)
    module = (broken / "zbal_module.py").read_text().replace("              ip_port: str = \"\"):", "):")
    (broken / "zbal_module.py").write_text(module)
    os.remove(str(broken / "zbal_buffer.py"))
    assert zbal_patch.api_problems(str(broken)) == [
        "__init__.py has no mem_get_info", "zbal_buffer.py unreadable (FileNotFoundError)",
        "zbal_init has no parameter ip_port"]
