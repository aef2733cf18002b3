"""live: what applying asks of the loaded code agrees with what deciding read from the source.

(The source side, and every answer read fast or whole: test_codeview.py.)
"""

import os
import sys

from npu_shim.source import codeview, reading
from npu_shim.source.codeview import ModuleSource


# -- the loaded code ---------------------------------------------------------------------------------

def _loaded_functions(module):
    """(function object, whole-parse FunctionInfo) for each def of ``module`` that is the one loaded."""
    import types

    whole_parse = ModuleSource(module.__file__, reading.read_source(module.__file__)).functions
    for qualname, info in whole_parse.items():
        owner = module
        for part in qualname.split("."):
            owner = vars(owner).get(part) if hasattr(owner, "__dict__") else None
        if not isinstance(owner, types.FunctionType) or owner.__qualname__ != qualname:
            continue
        node = info._node
        if (node.decorator_list[0] if node.decorator_list else node).lineno == owner.__code__.co_firstlineno:
            yield owner, info  # not a def shadowed by a later one of the same name


def test_the_loaded_code_has_the_fingerprint_its_source_has():
    """live_fingerprint (apply time, through ``inspect``) must agree with the source (decide time)
    on real modules, methods with multi-line docstrings included."""
    import argparse
    import dataclasses
    import logging

    checked = 0
    for module in (argparse, dataclasses, logging, codeview, reading):
        for function, info in _loaded_functions(module):
            assert reading.live_fingerprint(function) == info.fingerprint, function.__qualname__
            checked += 1
    assert checked > 200


def test_loaded_code_is_checked_from_memory_only_while_its_file_is_the_one_read(tmp_path, monkeypatch):
    """live_fingerprint answers from what deciding read (``remember``) only for the def at that
    line of that file, unchanged since; otherwise it reads the file again."""
    import importlib
    import time

    monkeypatch.setattr(reading, "_KNOWN", {})
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "known_module.py").write_text("def target(a):\n    return a\n")
    target = importlib.import_module("known_module").target
    path = target.__code__.co_filename
    read = reading.live_fingerprint(target)
    reading.remember(path, "target", 2, "remembered", reading.file_identity(path))
    assert reading.live_fingerprint(target) == read  # another line: not that def
    reading.remember(path, "target", 1, "remembered", reading.file_identity(path))
    assert reading.live_fingerprint(target) == "remembered"
    time.sleep(0.01)
    os.utime(path)  # any change of the file changes its ctime
    assert reading.live_fingerprint(target) == read


def test_live_params_read_the_parameters_as_the_source_names_them():
    class Owner:
        def method(self, a, /, b, *rest, c, **more):
            pass

        @staticmethod
        def static(a):
            pass

        @classmethod
        def klass(cls, a):
            pass

    assert reading.live_params(Owner.method, True) == ("a", "b", "*rest", "c", "**more")
    assert reading.live_params(vars(Owner)["static"], True) == ("a",)
    assert reading.live_params(vars(Owner)["klass"], True) == ("a",)


def test_find_package_dir_never_asks_the_shims_own_watcher(monkeypatch, tmp_path):
    from npu_shim import _bootstrap

    (tmp_path / "somepkg").mkdir()
    (tmp_path / "somepkg" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    asked = []
    monkeypatch.setattr(_bootstrap, "_hand_on_to", lambda *args: asked.append(args))
    monkeypatch.setattr(_bootstrap, "_saw_sglang", True)
    monkeypatch.setattr(sys, "meta_path", [_bootstrap.WATCHER] + sys.meta_path)
    assert reading.find_package_dir("somepkg") == str(tmp_path / "somepkg")
    assert asked == []


def test_applying_needs_none_of_the_deciding_modules():
    """Applying never needs codeview or inherited (deciding's modules): this module,
    which applying uses, must not import them at module level."""
    import ast

    tree = ast.parse(open(reading.__file__).read())
    top = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    names = {alias.name for node in top for alias in node.names} | {
        node.module for node in top if isinstance(node, ast.ImportFrom)}
    assert not names & {"codeview", "inherited", "npu_shim.source.codeview", "npu_shim.source.inherited"}
