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
    from shimdev.envs import sglang_envs

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


# -- in this process: a wrapt of the test's own -----------------------------------------------------
#
# The tests below lay out wrapt packages in tmp_path (the image's, or a bundle's builds) whose
# modules are Python files standing in for wrapt's: ``_wrappers.py`` for its C extension (the file
# name is all the loader looks at), ``__wrapt__.py`` for 2.x's chooser, ``wrappers.py`` for 1.x's.
# Their ``__init__.py`` raises: the loader must never run it.

import locale  # noqa: E402 - this part's own imports
import sys  # noqa: E402 - the in-process tests below import after the subprocess helpers above
import types  # noqa: E402 - the in-process tests below import after the subprocess helpers above

from npu_shim import _paths  # noqa: E402 - the in-process tests below import after the subprocess helpers above
from npu_shim.source import reading  # noqa: E402 - the in-process tests below import after the subprocess helpers above

PRIVATE = wrapt_loader.PRIVATE_NAME
FACTS = ("cpython", (3, 11), "x86_64", (2, 36))
NOT_A_BUNDLE = ", and this npu-shim is not a bundle (build one with 'python -m npu_shim bundle DIR')"

WRAPPERS = """
class FunctionWrapper:
    def __init__(self, wrapped, wrapper):
        self.__wrapped__, self._self_wrapper = wrapped, wrapper

    def __call__(self, *args, **kwargs):
        return self._self_wrapper(self.__wrapped__, None, args, kwargs)


class BoundFunctionWrapper(FunctionWrapper):
    pass
"""
# wrapt 2.x's C extension imports "wrapt.exceptions" by its absolute name while it initialises.
EXTENSION_2X = """
import sys
SEEN = (sys.modules.get("wrapt"), sys.modules.get("wrapt.exceptions"))
import wrapt.exceptions
""" + WRAPPERS
EXTENSION_1X = """
import sys
SEEN = (sys.modules.get("wrapt"), sys.modules.get("wrapt.exceptions"))
""" + WRAPPERS
BROKEN_EXTENSION = "raise ImportError('built for another Python')\n"


def fake_wrapt(directory, version=("2", "5", "2"), extension=EXTENSION_2X, major=2):
    """A wrapt package in ``directory``: 2.x (exceptions, __wrapt__) or 1.x (wrappers only), with
    ``extension`` as its C extension (None: none built)."""
    directory.mkdir(parents=True)
    (directory / "__init__.py").write_text("__version_info__ = %r\nraise AssertionError('__init__ ran')\n"
                                           % (tuple(version),))
    if major == 2:
        (directory / "exceptions.py").write_text("class WrapperNotInitializedError(ValueError):\n    pass\n")
        (directory / "__wrapt__.py").write_text(WRAPPERS)
    else:
        (directory / "wrappers.py").write_text(WRAPPERS)
    if extension is not None:
        (directory / "_wrappers.py").write_text(extension)
    return str(directory)


def _privately_loaded():
    return sorted(n for n in sys.modules if n == PRIVATE or n.startswith(PRIVATE + "."))


@pytest.fixture
def clean_modules(monkeypatch):
    """No wrapt in sys.modules (neither the application's nor the shim's private one) and nothing
    loaded yet; what the process had is put back afterwards."""
    def ours():
        return [n for n in sys.modules if n in ("wrapt", "wrapt.exceptions") or n == PRIVATE
                or n.startswith(PRIVATE + ".")]

    saved = {name: sys.modules.pop(name) for name in ours()}
    monkeypatch.setattr(wrapt_loader, "_LOADED", None)
    monkeypatch.delenv("WRAPT_DISABLE_EXTENSIONS", raising=False)
    yield
    for name in ours():
        del sys.modules[name]
    sys.modules.update(saved)


@pytest.fixture
def image(tmp_path, monkeypatch):
    """``image(path or None)``: the directory the image's ``import wrapt`` would use."""
    def use(path):
        monkeypatch.setattr(reading, "find_package_dir", lambda name: path if name == "wrapt" else None)
        return path
    return use


@pytest.fixture
def bundle(tmp_path, monkeypatch):
    """``bundle(build, ...)``: a shim package dir whose _vendor holds those builds (none: not a
    bundle); this platform is ``FACTS``."""
    package = tmp_path / "shim" / "npu_shim"
    package.mkdir(parents=True)
    monkeypatch.setattr(_paths, "PACKAGE_DIR", str(package))
    monkeypatch.setattr(wrapt_loader, "platform_facts", lambda: FACTS)

    def make(*builds, **kwargs):
        return [fake_wrapt(package / "_vendor" / "wrapt" / build / "wrapt", **kwargs) for build in builds]
    return make


@pytest.fixture
def c_locale():
    """LC_CTYPE=C for the test: ``open()`` without an encoding then reads ASCII only."""
    saved = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")
    yield
    locale.setlocale(locale.LC_CTYPE, saved)


def test_origin_describes_each_source():
    assert wrapt_loader.Origin("missing", note="no wrapt").describe() == "missing (no wrapt)"
    assert wrapt_loader.Origin("image", "2.5.2", "/w").describe() == "image 2.5.2"
    assert wrapt_loader.Origin("image", None, "/w", note="old").describe() == "image ? (old)"
    bundled = wrapt_loader.Origin("bundle", "2.5.2", "/b/w", "py3-none-any", "no C build")
    assert bundled.describe() == "bundle 2.5.2 [py3-none-any] (no C build)"
    assert bundled.as_dict() == {"source": "bundle", "version": "2.5.2", "path": "/b/w", "build": "py3-none-any",
                                 "note": "no C build", "text": "bundle 2.5.2 [py3-none-any] (no C build)"}
    assert wrapt_loader.Origin("image").as_dict() == {"source": "image", "version": None, "path": None,
                                                      "build": None, "note": None, "text": "image ?"}


def test_the_bundle_keeps_its_wrapt_builds_in_the_package_vendor_dir(monkeypatch, tmp_path):
    """Where ``python -m npu_shim bundle`` puts them (npu_shim/cli/bundle.py)."""
    import npu_shim

    assert wrapt_loader.vendor_dir() == os.path.join(os.path.dirname(npu_shim.__file__), "_vendor", "wrapt")
    monkeypatch.setattr(_paths, "PACKAGE_DIR", str(tmp_path))
    assert wrapt_loader.vendor_dir() == os.path.join(str(tmp_path), "_vendor", "wrapt")


def test_bundled_builds_are_the_folders_holding_a_wrapt_package(bundle, tmp_path):
    bundle("py3-none-any", "cp39-x86_64-glibc2.5", "cp311-x86_64-glibc2.5")
    vendor = tmp_path / "shim" / "npu_shim" / "_vendor" / "wrapt"
    (vendor / "cp312-x86_64-glibc2.5" / "wrapt").mkdir(parents=True)  # an interrupted copy: no __init__
    (vendor / "MANIFEST").write_text("")
    expected = ["cp311-x86_64-glibc2.5", "cp39-x86_64-glibc2.5", "py3-none-any"]
    assert wrapt_loader.bundled_builds() == expected
    assert wrapt_loader.bundled_builds(str(vendor)) == expected
    assert wrapt_loader.bundled_builds(str(tmp_path / "none")) == []


def test_wrapt_version_is_read_as_utf8_whatever_the_locale(tmp_path, c_locale):
    (tmp_path / "__init__.py").write_text("# wrapt \u2014 the module\n__version_info__ = ('1', '17', '3')\n",
                                          encoding="utf-8")
    assert wrapt_loader.version_of(str(tmp_path)) == (1, 17, 3)


@pytest.mark.parametrize("text, version", [
    ("__version_info__ = (1, 14, 1)\n", (1, 14, 1)),
    ("__version__ = '2.5.2'\n__version_info__ = ('2', '5', '2', 'rc1', '4')\n", (2, 5, 2)),
    ("__version_info__ = ()\n", None),
    ("__version__ = '2.5.2'\n", None),
    ("version = __version_info__ = (1, 14)\n", None),  # not the assignment wrapt writes
])
def test_wrapt_version_is_its_first_three_numbers_or_none(tmp_path, text, version):
    (tmp_path / "__init__.py").write_text(text)
    assert wrapt_loader.version_of(str(tmp_path)) == version


def test_the_image_wrapt_is_found_without_importing_it(tmp_path, image):
    image(fake_wrapt(tmp_path / "image" / "wrapt", version=("1", "17", "3")))
    assert wrapt_loader.find_image_wrapt() == (str(tmp_path / "image" / "wrapt"), (1, 17, 3))
    image(None)
    assert wrapt_loader.find_image_wrapt() is None


def test_this_interpreter_and_its_glibc(monkeypatch):
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "AArch64")
    python = tuple(sys.version_info[:2])
    for confstr, glibc in ((lambda name: "glibc 2.36" if name == "CS_GNU_LIBC_VERSION" else None, (2, 36)),
                           (lambda name: None, None), (lambda name: "musl", None)):
        monkeypatch.setattr(os, "confstr", confstr)
        assert wrapt_loader.platform_facts() == (sys.implementation.name, python, "aarch64", glibc)
    for error in (ValueError, OSError):
        def unknown(name, error=error):
            raise error("unknown name")
        monkeypatch.setattr(os, "confstr", unknown)
        assert wrapt_loader.platform_facts() == (sys.implementation.name, python, "aarch64", None)
    monkeypatch.delattr(os, "confstr")
    assert wrapt_loader.platform_facts()[3] is None


def test_select_build_names_what_it_lacks():
    assert wrapt_loader.select_build(BUILDS, "cpython", (3, 11), "x86_64", None) == (
        "py3-none-any", "no C build for cpython 3.11 on x86_64 without glibc: pure-Python wrapt")
    assert wrapt_loader.select_build(BUILDS, "cpython", (3, 12), "x86_64", (2, 36)) == (
        "py3-none-any", "no C build for cpython 3.12 on x86_64 with glibc 2.36: pure-Python wrapt")
    assert wrapt_loader.select_build(["cp311-x86_64-glibc2.5"], "cpython", (3, 12), "aarch64", (2, 17)) == (
        None, "no C build for cpython 3.12 on aarch64 with glibc 2.17 and no pure-Python build")


def test_select_build_knows_other_names_of_the_machines():
    assert wrapt_loader.select_build(BUILDS, "cpython", (3, 11), "amd64", (2, 36)) == ("cp311-x86_64-glibc2.5", None)


def test_select_build_passes_over_folders_that_are_not_builds():
    builds = ["cp311-aarch64-musl1.2", "README", "cp311-x86_64-glibc2.5"]
    assert wrapt_loader.select_build(builds, "cpython", (3, 11), "x86_64", (2, 36)) == ("cp311-x86_64-glibc2.5", None)


def test_select_build_does_not_depend_on_the_order_of_the_listing():
    builds = ["cp311-x86_64-glibc2.5", "cp311-x86_64-glibc2.17"]
    chosen = {wrapt_loader.select_build(order, *FACTS) for order in (builds, builds[::-1])}
    assert chosen == {("cp311-x86_64-glibc2.17", None)}


# -- locate(): which wrapt, decided without importing ----------------------------------------------

def test_locate_prefers_a_new_enough_image_wrapt(tmp_path, image, bundle):
    bundle("py3-none-any")
    for version in (("2", "5", "2"), ("1", "14")):
        path = image(fake_wrapt(tmp_path / "-".join(version) / "wrapt", version=version))
        origin = wrapt_loader.locate()
        assert origin.as_dict() == {"source": "image", "version": ".".join(version), "path": path, "build": None,
                                    "note": None, "text": "image %s" % ".".join(version)}


def test_locate_without_image_wrapt_or_bundle_says_how_to_get_one(tmp_path, image, bundle):
    image(None)
    assert wrapt_loader.locate().describe() == "missing (wrapt is not installed in this image%s)" % NOT_A_BUNDLE
    old = image(fake_wrapt(tmp_path / "old" / "wrapt", version=("1", "13", "2")))
    assert wrapt_loader.locate().describe() == (
        "missing (the image's wrapt 1.13.2 at %s is older than 1.14%s)" % (old, NOT_A_BUNDLE))
    unknown = image(fake_wrapt(tmp_path / "unknown" / "wrapt", version=()))
    assert wrapt_loader.locate().describe() == (
        "missing (the image's wrapt of unknown version at %s is older than 1.14%s)" % (unknown, NOT_A_BUNDLE))


def test_locate_takes_the_bundle_build_for_this_platform(tmp_path, image, bundle):
    image(None)
    paths = bundle("cp311-x86_64-glibc2.5", "py3-none-any", version=("2", "5", "1"))
    assert wrapt_loader.locate().as_dict() == {
        "source": "bundle", "version": "2.5.1", "path": paths[0], "build": "cp311-x86_64-glibc2.5", "note": None,
        "text": "bundle 2.5.1 [cp311-x86_64-glibc2.5]"}
    old = image(fake_wrapt(tmp_path / "old" / "wrapt", version=("1", "12", "0")))
    origin = wrapt_loader.locate()
    assert (origin.source, origin.path, origin.note) == (
        "bundle", paths[0], "the image's wrapt 1.12.0 at %s is older than 1.14" % old)


def test_locate_falls_back_to_the_pure_python_build_and_says_why(tmp_path, image, bundle):
    image(None)
    paths = bundle("cp39-x86_64-glibc2.5", "py3-none-any")
    assert wrapt_loader.locate().as_dict() == {
        "source": "bundle", "version": "2.5.2", "path": paths[1], "build": "py3-none-any",
        "note": "no C build for cpython 3.11 on x86_64 with glibc 2.36: pure-Python wrapt",
        "text": "bundle 2.5.2 [py3-none-any] (no C build for cpython 3.11 on x86_64 with glibc 2.36: "
                "pure-Python wrapt)"}
    old = image(fake_wrapt(tmp_path / "old" / "wrapt", version=("1", "12", "0")))
    assert wrapt_loader.locate().note == ("the image's wrapt 1.12.0 at %s is older than 1.14; no C build for "
                                          "cpython 3.11 on x86_64 with glibc 2.36: pure-Python wrapt" % old)


def test_locate_with_no_usable_bundle_build_lists_the_builds(image, bundle):
    image(None)
    bundle("cp39-x86_64-glibc2.5", "cp311-aarch64-glibc2.17")
    assert wrapt_loader.locate().as_dict() == {
        "source": "missing", "version": None, "path": None, "build": None,
        "note": "no C build for cpython 3.11 on x86_64 with glibc 2.36 and no pure-Python build; the bundle has "
                "cp311-aarch64-glibc2.17, cp39-x86_64-glibc2.5",
        "text": "missing (no C build for cpython 3.11 on x86_64 with glibc 2.36 and no pure-Python build; the "
                "bundle has cp311-aarch64-glibc2.17, cp39-x86_64-glibc2.5)"}


# -- load(): only the wrappers, under the private name ---------------------------------------------

def test_load_takes_the_image_wrapt_c_extension_alone(tmp_path, image, bundle, clean_modules):
    path = image(fake_wrapt(tmp_path / "image" / "wrapt"))
    assert wrapt_loader.loaded_origin() is None
    module = wrapt_loader.load()
    assert module is sys.modules[PRIVATE] and module.__path__ == [path]
    assert module.__file__ == os.path.join(path, "__init__.py")
    extension = sys.modules[PRIVATE + "._wrappers"]
    assert (module.FunctionWrapper, module.BoundFunctionWrapper) == (
        extension.FunctionWrapper, extension.BoundFunctionWrapper)
    assert _privately_loaded() == [PRIVATE, PRIVATE + "._wrappers", PRIVATE + ".exceptions"]
    # wrapt 2.x's extension was served the private package as "wrapt" while it initialised, only then
    assert extension.SEEN == (module, sys.modules[PRIVATE + ".exceptions"])
    assert "wrapt" not in sys.modules and "wrapt.exceptions" not in sys.modules
    wrapped = module.FunctionWrapper(lambda x: x + 1, lambda f, instance, args, kwargs: 10 * f(*args, **kwargs))
    assert wrapped(1) == 20
    assert wrapt_loader.loaded_origin().as_dict() == {
        "source": "image", "version": "2.5.2", "path": path, "build": None, "note": None, "text": "image 2.5.2"}


def test_load_is_done_once(tmp_path, image, bundle, clean_modules, monkeypatch):
    image(fake_wrapt(tmp_path / "image" / "wrapt"))
    module = wrapt_loader.load()
    origin = wrapt_loader.loaded_origin()
    monkeypatch.setattr(wrapt_loader, "locate", lambda: pytest.fail("located again"))
    assert wrapt_loader.load() is module and wrapt_loader.loaded_origin() is origin


def test_load_without_wrapt_raises_the_reason(image, bundle, clean_modules):
    image(None)
    with pytest.raises(wrapt_loader.WraptUnavailable) as raised:
        wrapt_loader.load()
    assert str(raised.value) == "wrapt is not available: wrapt is not installed in this image%s" % NOT_A_BUNDLE
    assert isinstance(raised.value, ImportError)
    assert wrapt_loader.loaded_origin() is None and _privately_loaded() == []


def test_load_uses_the_wrapt_the_application_imported_from_the_same_place(tmp_path, image, bundle,
                                                                         clean_modules):
    path = image(fake_wrapt(tmp_path / "image" / "wrapt"))
    os.symlink(path, str(tmp_path / "linked"))
    application = types.ModuleType("wrapt")
    application.__file__ = str(tmp_path / "linked" / "__init__.py")  # the same directory, by another name
    sys.modules["wrapt"] = application
    assert wrapt_loader.load() is application
    assert _privately_loaded() == [] and wrapt_loader.loaded_origin().describe() == "image 2.5.2"


@pytest.mark.parametrize("where", ["elsewhere", "namespace", "none"])
def test_an_application_wrapt_from_elsewhere_is_left_alone(tmp_path, image, bundle, clean_modules, where):
    path = image(fake_wrapt(tmp_path / "image" / "wrapt"))
    application = types.ModuleType("wrapt")
    if where == "elsewhere":
        fake_wrapt(tmp_path / "other" / "wrapt")
        application.__file__ = str(tmp_path / "other" / "wrapt" / "__init__.py")
    elif where == "namespace":
        application.__file__ = None
    if where != "none":
        sys.modules["wrapt"] = application
    assert wrapt_loader._already_imported(path) is None
    module = wrapt_loader.load()
    assert module is sys.modules[PRIVATE] and module is not application
    assert sys.modules.get("wrapt") is (None if where == "none" else application)


def test_an_application_wrapt_is_not_served_to_the_extension_nor_removed(tmp_path, image, bundle, clean_modules):
    """Only the names the process lacks are served for that moment."""
    image(fake_wrapt(tmp_path / "image" / "wrapt"))
    application = types.ModuleType("wrapt")
    sys.modules["wrapt"] = application
    module = wrapt_loader.load()
    assert sys.modules[PRIVATE + "._wrappers"].SEEN == (application, sys.modules[PRIVATE + ".exceptions"])
    assert sys.modules["wrapt"] is application and "wrapt.exceptions" not in sys.modules
    assert module.FunctionWrapper.__module__ == PRIVATE + "._wrappers"


def test_with_extensions_switched_off_the_python_wrappers_are_loaded(tmp_path, image, bundle, clean_modules,
                                                                     monkeypatch):
    path = image(fake_wrapt(tmp_path / "image" / "wrapt"))
    monkeypatch.setenv("WRAPT_DISABLE_EXTENSIONS", "1")
    assert wrapt_loader._c_wrappers(path) is None
    module = wrapt_loader.load()
    assert module.FunctionWrapper.__module__ == PRIVATE + ".__wrapt__"
    assert module.BoundFunctionWrapper is sys.modules[PRIVATE + ".__wrapt__"].BoundFunctionWrapper
    assert _privately_loaded() == [PRIVATE, PRIVATE + ".__wrapt__", PRIVATE + ".exceptions"]
    assert wrapt_loader.loaded_origin().note == "C extension not loaded: pure-Python wrappers"


def test_an_empty_wrapt_disable_extensions_leaves_them_on(tmp_path, clean_modules, monkeypatch):
    path = fake_wrapt(tmp_path / "wrapt")
    monkeypatch.setenv("WRAPT_DISABLE_EXTENSIONS", "")
    wrapt_loader._load_private(path)
    assert _privately_loaded() == [PRIVATE, PRIVATE + "._wrappers", PRIVATE + ".exceptions"]


def test_an_extension_that_does_not_import_gives_way_to_the_python_wrappers(tmp_path, image, bundle,
                                                                          clean_modules):
    path = image(fake_wrapt(tmp_path / "image" / "wrapt", extension=BROKEN_EXTENSION))
    assert wrapt_loader._c_wrappers(path) is None and PRIVATE + "._wrappers" not in sys.modules
    module = wrapt_loader.load()
    assert module.FunctionWrapper.__module__ == PRIVATE + ".__wrapt__"
    assert _privately_loaded() == [PRIVATE, PRIVATE + ".__wrapt__", PRIVATE + ".exceptions"]
    assert wrapt_loader.loaded_origin().describe() == "image 2.5.2 (C extension not loaded: pure-Python wrappers)"


def test_an_image_wrapt_built_without_extension_is_not_noted(tmp_path, image, bundle, clean_modules):
    """A pure-Python install of wrapt is what its owner chose: nothing to say."""
    path = image(fake_wrapt(tmp_path / "image" / "wrapt", extension=None))
    assert wrapt_loader._c_wrappers(path) is None
    wrapt_loader.load()
    assert _privately_loaded() == [PRIVATE, PRIVATE + ".__wrapt__", PRIVATE + ".exceptions"]
    assert wrapt_loader.loaded_origin().describe() == "image 2.5.2"


def test_wrapt_1x_has_its_wrappers_and_nothing_served(tmp_path, clean_modules):
    for name, extension, core in (("c", EXTENSION_1X, "._wrappers"), ("py", None, ".wrappers")):
        path = fake_wrapt(tmp_path / name / "wrapt", version=("1", "14", "1"), extension=extension, major=1)
        module = wrapt_loader._load_private(path)
        assert module.FunctionWrapper is sys.modules[PRIVATE + core].FunctionWrapper
        assert module.BoundFunctionWrapper is sys.modules[PRIVATE + core].BoundFunctionWrapper
        assert _privately_loaded() == [PRIVATE, PRIVATE + core]
        if extension:
            assert sys.modules[PRIVATE + core].SEEN == (None, None)
        assert "wrapt" not in sys.modules
        for loaded in _privately_loaded():
            del sys.modules[loaded]


def test_the_pure_python_bundle_build_is_noted(image, bundle, clean_modules):
    image(None)
    bundle("py3-none-any", extension=None)
    module = wrapt_loader.load()
    assert module.FunctionWrapper.__module__ == PRIVATE + ".__wrapt__"
    assert wrapt_loader.loaded_origin().note == ("no C build for cpython 3.11 on x86_64 with glibc 2.36: "
                                                 "pure-Python wrapt; C extension not loaded: pure-Python wrappers")


def test_a_bundle_c_build_is_loaded_and_not_noted(image, bundle, clean_modules):
    image(None)
    bundle("cp311-x86_64-glibc2.5")
    module = wrapt_loader.load()
    assert module.FunctionWrapper.__module__ == PRIVATE + "._wrappers"
    assert wrapt_loader.loaded_origin().describe() == "bundle 2.5.2 [cp311-x86_64-glibc2.5]"


@pytest.mark.parametrize("broken", [ImportError, RuntimeError])
def test_a_failed_private_load_leaves_nothing_behind(tmp_path, clean_modules, broken):
    path = fake_wrapt(tmp_path / "wrapt", extension=None)
    (tmp_path / "wrapt" / "__wrapt__.py").write_text("raise %s('half a wrapt')\n" % broken.__name__)
    with pytest.raises(broken, match="^half a wrapt$"):
        wrapt_loader._load_private(path)
    assert _privately_loaded() == [] and "wrapt" not in sys.modules and "wrapt.exceptions" not in sys.modules


def test_an_extension_is_a_file_named_wrappers_dot_something(tmp_path):
    (tmp_path / "_wrappers.cpython-311-x86_64-linux-gnu.so").write_text("")
    assert wrapt_loader._has_extension(str(tmp_path)) is True
    (tmp_path / "_wrappers.cpython-311-x86_64-linux-gnu.so").unlink()
    (tmp_path / "_wrappersx.so").write_text("")
    (tmp_path / "wrappers.py").write_text("")
    assert wrapt_loader._has_extension(str(tmp_path)) is False
    assert wrapt_loader._has_extension(str(tmp_path / "missing")) is False


def test_a_failing_exceptions_module_leaves_nothing_served(tmp_path, clean_modules):
    """An error other than a missing module while wrapt 2.x's exceptions load: that error, and no
    name served under ``wrapt``."""
    path = fake_wrapt(tmp_path / "wrapt")
    (tmp_path / "wrapt" / "exceptions.py").write_text("raise RuntimeError('broken exceptions')\n")
    with pytest.raises(RuntimeError, match="^broken exceptions$"):
        wrapt_loader._load_private(path)
    assert _privately_loaded() == [] and "wrapt" not in sys.modules and "wrapt.exceptions" not in sys.modules


def test_a_bundle_wrapt_is_always_the_private_copy(image, bundle, clean_modules):
    """Only the image's wrapt is shared with the application: a bundle's build is the shim's own,
    even where the application's ``wrapt`` came from the same files (its C extension then loaded
    privately, as the note says)."""
    image(None)
    path, = bundle("cp311-x86_64-glibc2.5")
    application = types.ModuleType("wrapt")
    application.__file__ = os.path.join(path, "__init__.py")
    sys.modules["wrapt"] = application
    module = wrapt_loader.load()
    assert module is sys.modules[PRIVATE] and module.FunctionWrapper.__module__ == PRIVATE + "._wrappers"
    assert wrapt_loader.loaded_origin().describe() == "bundle 2.5.2 [cp311-x86_64-glibc2.5]"
    assert sys.modules["wrapt"] is application
