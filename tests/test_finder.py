"""finder: the shim's one meta-path finder -- it hands wrapt's finder only the modules with a hook
waiting, and ignores every other import (reloads: test_reliability.py)."""

import importlib

from npu_shim import runtime
from test_bootstrap import last_json, run, tree  # noqa: F401 - ``tree`` is a fixture


def test_wrapts_import_finder_is_asked_only_about_modules_with_a_hook_waiting(tree):
    """The shim's private wrapt: its ImportHookFinder stays out of sys.meta_path (it takes a lock
    on every import); the shim's finder hands it the hooked modules, whose hooks still fire."""
    proc = run(tree, """
        import json, sys
        import sglang
        asked = []
        from npu_shim import runtime
        hook_finder = runtime._FINDER.hook_finder
        find_spec = hook_finder.find_spec
        hook_finder.find_spec = lambda name, *rest: asked.append(name) or find_spec(name, *rest)
        import colorsys
        from sglang.srt.utils import common
        from npu_shim import _bootstrap
        print(json.dumps({"finders": [type(f).__name__ for f in sys.meta_path
                                      if "ImportHookFinder" in type(f).__name__
                                      or type(f).__module__.startswith(("npu_shim", "sitecustomize"))],
                          "through_watcher": _bootstrap._WATCHER.then == runtime._FINDER.find_spec,
                          "wrapt": type(hook_finder).__module__, "asked": sorted(set(asked)),
                          "value": common.get_npu_memory_capacity()}))
    """)
    out = last_json(proc)
    # One finder of the shim's: the start-up watcher, which hands imports to the shim's finder;
    # no wrapt finder.
    assert out["finders"] == ["SglangImportWatcher"] and out["through_watcher"] is True
    assert out["wrapt"] == "npu_shim._wrapt.importer" and out["asked"] == ["sglang.srt.utils.common"]
    assert out["value"] == 1001  # the demo patch applied through the hook


def test_the_shim_finder_ignores_imports_and_unhooked_modules():
    watcher = runtime._FINDER
    assert watcher.find_spec("json", None, None) is None
    assert watcher.find_spec("json", None, importlib.import_module("json")) is None
