"""finder: the shim's one meta-path finder and its own post-import hooks -- a hooked module's
hooks run after its code, every other import is ignored, no wrapt import hook is loaded (reloads:
test_reliability.py)."""

import importlib
import sys

import pytest

from npu_shim.runtime import activation, finder
from test_bootstrap import last_json, run, tree  # noqa: F401 - ``tree`` is a fixture


def test_only_modules_with_a_hook_waiting_are_looked_up_and_no_wrapt_import_hook_is_loaded(tree):
    """The shim's finder owns the post-import hooks: no wrapt ImportHookFinder in sys.meta_path
    (wrapt's takes a lock on every import), no wrapt importer module loaded; the shim's finder
    looks up only the hooked modules, whose hooks still fire."""
    proc = run(tree, """
        import json, sys
        import sglang
        asked = []
        from npu_shim.runtime import activation
        shim = activation.RUNTIME.finder
        find_elsewhere = shim._find_elsewhere
        shim._find_elsewhere = lambda name, *rest: asked.append(name) or find_elsewhere(name, *rest)
        waiting = shim.waiting()
        import colorsys
        from sglang.srt.utils import common
        from npu_shim import _bootstrap
        print(json.dumps({"finders": [type(f).__name__ for f in sys.meta_path
                                      if "ImportHookFinder" in type(f).__name__
                                      or type(f).__module__.startswith(("npu_shim", "sitecustomize"))],
                          "through_watcher": _bootstrap.WATCHER.then == activation.RUNTIME.finder.find_spec,
                          "importers": sorted(m for m in sys.modules if "wrapt" in m and "importer" in m),
                          "waiting": waiting, "left": shim.waiting(), "asked": sorted(set(asked)),
                          "value": common.get_npu_memory_capacity()}))
    """)
    out = last_json(proc)
    # One finder of the shim's: the start-up watcher, which hands imports to the shim's finder;
    # no wrapt finder, no wrapt importer.
    assert out["finders"] == ["SglangImportWatcher"] and out["through_watcher"] is True
    assert out["importers"] == [] and out["asked"] == ["sglang.srt.utils.common"]
    assert out["waiting"] == ["sglang.srt.utils.common"] and out["left"] == []
    assert out["value"] == 1001  # the demo patch applied through the hook


def test_the_shim_finder_ignores_imports_and_unhooked_modules():
    watcher = activation.RUNTIME.finder
    assert watcher.find_spec("json", None, None) is None
    assert watcher.find_spec("json", None, importlib.import_module("json")) is None


def test_an_application_that_imported_wrapt_first_keeps_wrapts_own_finder(tree):
    """The application imported wrapt before sglang and registered its own post-import hook: the
    shim reuses that module for its wrappers only, wrapt's own ImportHookFinder stays in
    sys.meta_path and serves the application's hooks (and none of the shim's); the shim's hooks
    are its finder's, and it still re-applies after a reload."""
    proc = run(tree, """
        import importlib, json, sys
        import wrapt
        fired = []
        wrapt.register_post_import_hook(lambda module: fired.append(module.__name__), "colorsys")
        import sglang
        from npu_shim.runtime import activation, wrapt_loader
        from sglang.srt.utils import common
        import colorsys
        patched = common.get_npu_memory_capacity()
        importlib.reload(common)
        print(json.dumps({
            "wrapt_hooks": sorted(m for m in wrapt.importer._post_import_hooks if m.startswith("sglang")),
            "loaded": wrapt_loader.load() is wrapt, "origin": wrapt_loader.loaded_origin().source,
            "private": sorted(m for m in sys.modules if m.startswith("npu_shim._wrapt")),
            "wrapt_finders": [type(f).__module__ for f in sys.meta_path
                              if type(f).__name__ == "ImportHookFinder"],
            "fired": fired, "patched": patched, "after_reload": common.get_npu_memory_capacity(),
            "state": activation.RUNTIME.states()["demo"]["state"]}))
    """)
    assert last_json(proc) == {
        "wrapt_hooks": [], "loaded": True, "origin": "image",
        "private": [], "wrapt_finders": ["wrapt.importer"], "fired": ["colorsys"],
        "patched": 1001, "after_reload": 1001, "state": "applied"}
    assert "activation failed" not in proc.stderr, proc.stderr


# -- its place in sys.meta_path ----------------------------------------------------------------------

@pytest.fixture
def own_meta_path(monkeypatch):
    """sys.meta_path as a copy (restored afterwards), the start-up watcher not fired."""
    from npu_shim import _bootstrap

    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(_bootstrap.WATCHER, "fired", False)
    monkeypatch.setattr(_bootstrap.WATCHER, "then", None)
    return sys.meta_path


class Nobody:
    """A finder some other package puts in front later: it finds nothing."""

    def find_spec(self, fullname, path=None, target=None):
        return None


def test_without_the_watcher_the_finder_goes_first_once_and_leaves_entirely(own_meta_path):
    shim = finder.ShimFinder(lambda name: False, lambda module: None)
    shim.install()
    assert own_meta_path[0] is shim
    shim.install()
    assert own_meta_path.count(shim) == 1
    # Another finder inserted in front later: the shim's stays where it is (a list the import
    # system may be walking is not reordered) and is not added a second time.
    other = Nobody()
    own_meta_path.insert(0, other)
    shim.install()
    assert own_meta_path[:2] == [other, shim] and own_meta_path.count(shim) == 1
    own_meta_path.append(shim)  # however it got there twice, uninstall removes every copy
    shim.uninstall()
    assert shim not in own_meta_path and own_meta_path[0] is other


def test_once_the_watcher_fired_the_finder_answers_through_it(own_meta_path):
    from npu_shim import _bootstrap

    shim = finder.ShimFinder(lambda name: False, lambda module: None)
    before = list(own_meta_path)
    _bootstrap.WATCHER.fired = True
    if _bootstrap.WATCHER not in own_meta_path:
        own_meta_path.append(_bootstrap.WATCHER)
        before.append(_bootstrap.WATCHER)
    shim.install(_bootstrap.WATCHER)
    assert own_meta_path == before and _bootstrap.WATCHER.then == shim.find_spec
    shim.uninstall(_bootstrap.WATCHER)
    assert _bootstrap.WATCHER.then is None
    # fired, but no longer in sys.meta_path (uninstall() removed it): the finder goes first
    own_meta_path.remove(_bootstrap.WATCHER)
    shim.install(_bootstrap.WATCHER)
    assert own_meta_path[0] is shim and _bootstrap.WATCHER.then is None


def test_a_finder_in_front_does_not_stop_reloads_being_reapplied(tree):
    """install() after sglang was imported: the shim's finder goes to the front of sys.meta_path;
    a finder inserted before it later is asked first, and the shim's still sees the reload."""
    proc = run(tree, """
        import importlib, json, sys
        from sglang.srt.utils import common
        import npu_shim
        from npu_shim.runtime import activation
        npu_shim.install()
        first = sys.meta_path.index(activation.RUNTIME.finder)
        class Nobody:
            def find_spec(self, fullname, path=None, target=None):
                return None
        sys.meta_path.insert(0, Nobody())
        importlib.reload(common)
        print(json.dumps({"first": first, "now": sys.meta_path.index(activation.RUNTIME.finder),
                          "value": common.get_npu_memory_capacity(),
                          "state": activation.RUNTIME.states()["demo"]["state"]}))
    """, shim=False)
    assert last_json(proc) == {"first": 0, "now": 1, "value": 1001, "state": "applied"}
