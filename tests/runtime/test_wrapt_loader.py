"""runtime/wrapt_loader.py: which wrapt build a bundle gives this interpreter, and that only the
wrappers are loaded (under a private name; the application keeps its own ``wrapt``; the shim's
post-import hooks are its own: test_finder.py).  The bundle's wrapt in real images: tests/test_drop_in.py."""

import json
import os
import subprocess

import pytest

from npu_shim.cli import bundle_wheels
from npu_shim.runtime import wrapt_loader
from test_drop_in import REPO, bare_venvs  # noqa: F401 - ``bare_venvs`` is a fixture


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
    assert bundle_wheels.oldest_glibc(name) == glibc


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
loaded = sorted(n for n in sys.modules if n.startswith(("wrapt", "npu_shim._wrapt")))
try:
    import wrapt  # what the application gets afterwards
    app = [wrapt.__version__, hasattr(wrapt, "decorator"), hasattr(wrapt, "ObjectProxy")]
except ImportError:
    app = None
print(json.dumps({"result": wrapped(1), "calls": calls, "loaded": loaded,
                  "import_hooks": hasattr(w, "register_post_import_hook"),
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


@pytest.mark.another_python
@pytest.mark.parametrize("version, loaded", [
    ("2.5.2", ["npu_shim._wrapt", "npu_shim._wrapt._wrappers", "npu_shim._wrapt.exceptions"]),
    ("1.14.1", ["npu_shim._wrapt", "npu_shim._wrapt._wrappers"]),
])
def test_only_the_wrappers_are_loaded_and_the_application_keeps_its_wrapt(version, loaded, bare_venvs):
    """The image's wrapt, loaded privately without its __init__ (whose decorators, proxies, locks,
    caches and import hooks are most of wrapt's memory): only its C extension (and the exceptions
    module 2.x's extension imports), not the Python wrappers beside it; the
    application's own ``import wrapt`` afterwards gets the whole image wrapt."""
    out = _load_wrapt_beside(bare_venvs("3.11"), version, before="")
    assert out["result"] == 2 and out["calls"] == [[1]] and out["import_hooks"] is False
    assert out["loaded"] == loaded  # and no "wrapt" among them: nothing was imported under its name
    assert out["same_as_app"] is False
    assert out["app"] == [version, True, True]
    assert out["origin"] == "image %s" % version


@pytest.mark.another_python
def test_a_wrapt_the_application_already_imported_is_used_as_it_is(bare_venvs):
    out = _load_wrapt_beside(bare_venvs("3.11"), "2.5.2", before="import wrapt")
    assert out["result"] == 2 and out["calls"] == [[1]] and out["same_as_app"] is True
    assert not [name for name in out["loaded"] if name.startswith("npu_shim._wrapt")]


@pytest.mark.another_python
def test_with_wrapt_extensions_switched_off_its_python_wrappers_are_loaded(bare_venvs, monkeypatch):
    """``WRAPT_DISABLE_EXTENSIONS`` is wrapt's own switch: honoured as wrapt honours it."""
    monkeypatch.setenv("WRAPT_DISABLE_EXTENSIONS", "1")
    out = _load_wrapt_beside(bare_venvs("3.11"), "2.5.2", before="")
    assert out["result"] == 2 and out["calls"] == [[1]]
    assert out["loaded"] == ["npu_shim._wrapt", "npu_shim._wrapt.__wrapt__",
                             "npu_shim._wrapt.exceptions", "npu_shim._wrapt.wrappers"]
