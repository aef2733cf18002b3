"""live: what applying asks of the loaded code agrees with what deciding read from the source.

(The source side, and every answer read fast or whole: test_codeview.py.)
"""

import ast
import sys
import types
import uuid

import pytest

from npu_shim.core.framework import SourceError
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


def _decided_and_loaded(tmp_path, text):
    """(the SourceView deciding reads, the def ``f`` of sglang/srt/a.py as the import loads it)."""
    package = tmp_path / "sglang"
    (package / "srt").mkdir(parents=True)
    path = package / "srt" / "a.py"
    path.write_text(text)
    loaded = {}
    exec(compile(path.read_text(), str(path), "exec"), loaded)  # as the import would load it
    return codeview.SourceView(str(package)), loaded["f"], path


def test_a_file_written_after_deciding_read_it_is_read_again_when_applying(tmp_path):
    """The def deciding fingerprinted, its file written since: applying reads the loaded def
    again, and sees what is there now."""
    view, _loaded, path = _decided_and_loaded(tmp_path, "def f(x):\n    return x + 1\n")
    decided = view.function("sglang.srt.a", "f").fingerprint
    path.write_text("def f(x):\n    return x + 2\n")
    loaded = {}
    exec(compile(path.read_text(), str(path), "exec"), loaded)
    assert reading.live_fingerprint(loaded["f"]) != decided
    assert reading.live_fingerprint(loaded["f"]) == codeview.SourceView(view.package_dir).function(
        "sglang.srt.a", "f").fingerprint


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
    """Applying never needs codeview (deciding's module): this module, which applying uses, must
    not import it at module level."""
    import ast

    tree = ast.parse(open(reading.__file__).read())
    top = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    names = {alias.name for node in top for alias in node.names} | {
        node.module for node in top if isinstance(node, ast.ImportFrom)}
    assert not names & {"codeview", "npu_shim.source.codeview"}


# -- the fingerprint is a fixed function of the code ----------------------------------------------

PINNED_DEF = '''\
@decorator(1, key="v")
async def f(a, b=None, *rest, c: int = 2, **more) -> "T":
    """Doc."""
    x = [a, b, (c, 1.5)]
    if not x:
        return {"k": None}
    await g(*rest, key=b"x", **more)
    return f"{a!r:>3}" + x[0]
'''


@pytest.mark.parametrize("text, fingerprint", [
    ("def f(a):\n    return a + 1\n", "8e64ac8a1783043d"),
    (PINNED_DEF, "a313918a2ae9101e"),
])
def test_a_fingerprint_is_the_same_value_in_every_shim_and_python(text, fingerprint, monkeypatch):
    """Patches ship the fingerprints of the sglang defs they were written against (their pins):
    a def's fingerprint is a fixed value, not only one this process computes the same way twice --
    in a fresh process too, whose cache of each AST class's fields starts empty."""
    monkeypatch.setattr(reading, "_FIELDS", {})
    node = ast.parse(text).body[0]
    assert reading.fingerprint_node(node) == fingerprint
    assert ModuleSource("m.py", text).function("f").fingerprint == fingerprint


# -- reading a file -----------------------------------------------------------------------------------

def test_a_file_is_decoded_as_the_import_system_decodes_it(tmp_path):
    path = tmp_path / "latin.py"
    path.write_bytes(b"# -*- coding: latin-1 -*-\nNAME = '\xe9'\n")
    assert reading.read_source(str(path)) == "# -*- coding: latin-1 -*-\nNAME = '\u00e9'\n"
    path.write_bytes(b"\xef\xbb\xbfA = 1\r\nB = 2\r\n")  # BOM, CRLF
    assert reading.read_source(str(path)) == "A = 1\nB = 2\n"


@pytest.mark.parametrize("data, reason", [
    (b"A = '\xff\xfe'\n", "invalid or missing encoding declaration"),
    (b"# coding: no-such-codec\nA = 1\n", "unknown encoding"),
])
def test_a_file_that_does_not_decode_says_which_and_why_on_one_line(tmp_path, data, reason):
    path = tmp_path / "bad.py"
    path.write_bytes(data)
    with pytest.raises(SourceError) as raised:
        reading.read_source(str(path))
    message = str(raised.value)
    assert message.startswith("cannot decode %s: " % path) and reason in message and "\n" not in message


def test_a_decode_reason_is_cut_to_120_characters(tmp_path):
    path = tmp_path / "long.py"
    path.write_bytes(b"# coding: " + b"x" * 300 + b"\nA = 1\n")
    with pytest.raises(SourceError) as raised:
        reading.read_source(str(path))
    reason = str(raised.value)[len("cannot decode %s: " % path):]
    assert len(reason) == 120 and reason.endswith("...") and reason.startswith("unknown encoding")


@pytest.mark.parametrize("text, message", [
    ("def target(:\n    pass\n", "cannot parse broken.py line 1: SyntaxError: invalid syntax"),
    ("A = 1\nB = (\n", "cannot parse broken.py line 2: SyntaxError: '(' was never closed"),
    ("A = 1\0\n", "cannot parse broken.py: SyntaxError: source code string cannot contain null bytes"),
])
def test_a_file_that_does_not_parse_says_where_and_why(text, message):
    """The line where Python has one (the parser's own message, not its repr), none where not."""
    with pytest.raises(SourceError) as raised:
        reading.parse_source(text, "broken.py")
    assert str(raised.value) == message


def test_a_parse_error_without_a_line_says_the_error_itself_cut_to_120_characters(monkeypatch):
    """Older Pythons raise ValueError for a null byte: no line number, no ``msg``."""
    def refuse(text, filename):
        raise ValueError("source code string cannot contain null bytes " + "x" * 200)

    monkeypatch.setattr(reading, "ast", types.SimpleNamespace(parse=refuse))  # reading's name only
    with pytest.raises(SourceError) as raised:
        reading.parse_source("A = 1\n", "nul.py")
    reason = str(raised.value).split("cannot parse nul.py: ValueError: ", 1)[1]
    assert len(reason) == 120 and reason.startswith("source code string cannot contain null bytes xxx")
    assert reason.endswith("...")


def test_a_parse_reason_is_cut_to_120_characters():
    with pytest.raises(SourceError) as raised:
        reading.parse_source("x = 1\n" + "(" * 300 + "\n", "deep.py")
    reason = str(raised.value).split(": SyntaxError: ", 1)[1]
    assert len(reason) <= 120


# -- the loaded code, through its wrappers ----------------------------------------------------------

def test_live_fingerprint_leaves_linecache_as_it_found_it(tmp_path, monkeypatch):
    """Every sglang process checks its targets: the lines ``inspect`` reads are not kept in
    ``linecache``, and lines something else had cached stay there."""
    import importlib
    import linecache
    import uuid

    monkeypatch.syspath_prepend(str(tmp_path))
    cached, uncached = ("%s_%s" % (kind, uuid.uuid4().hex) for kind in ("cached", "uncached"))  # per run
    (tmp_path / (cached + ".py")).write_text("def first(a):\n    return a\n")
    (tmp_path / (uncached + ".py")).write_text("def second(a):\n    return a\n")
    first = importlib.import_module(cached).first
    second = importlib.import_module(uncached).second
    linecache.checkcache()
    linecache.getlines(first.__code__.co_filename)
    linecache.cache.pop(second.__code__.co_filename, None)
    reading.live_fingerprint(first)
    reading.live_fingerprint(second)
    assert first.__code__.co_filename in linecache.cache
    assert second.__code__.co_filename not in linecache.cache


def test_a_wrapped_function_is_checked_as_the_def_it_wraps():
    import functools

    def inner(a, b=1, *, c):
        return a

    @functools.wraps(inner)
    def outer(*args, **kwargs):
        return inner(*args, **kwargs)

    @functools.wraps(outer)
    def outermost(*args, **kwargs):
        return outer(*args, **kwargs)

    assert reading.unwrap(outermost) is inner
    assert reading.live_params(outermost, False) == ("a", "b", "c")
    assert reading.live_fingerprint(outermost) == reading.live_fingerprint(inner)
    assert reading.live_fingerprint(outermost) != reading.live_fingerprint(reading.unwrap)


def test_unwrap_stops_at_a_wrapper_cycle():
    """A ``__wrapped__`` chain that comes back to itself ends at the first object met again (each
    object is asked a bounded number of times)."""
    asked = []

    class Loop:
        @property
        def __wrapped__(self):
            asked.append(self)
            assert len(asked) < 10, "unwrap went round the cycle"
            return partner if self is first else first

    first, partner = Loop(), Loop()
    assert reading.unwrap(first) is first
    del asked[:]
    assert reading.unwrap(partner) is partner
    assert reading.unwrap(len) is len  # nothing wrapped


# -- where a package is, and its version ------------------------------------------------------------

def test_an_imported_package_is_where_it_was_imported_from(monkeypatch, tmp_path):
    import types

    package = types.ModuleType("imported_only_pkg")
    package.__path__ = [str(tmp_path / "first"), str(tmp_path / "second")]
    monkeypatch.setitem(sys.modules, "imported_only_pkg", package)
    assert reading.find_package_dir("imported_only_pkg") == str(tmp_path / "first")


def test_a_module_that_is_no_package_has_no_package_dir(monkeypatch, tmp_path):
    import types

    (tmp_path / "plain_module_here.py").write_text("A = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert reading.find_package_dir("plain_module_here") is None  # found, but a module
    monkeypatch.setitem(sys.modules, "plain_module_here", types.ModuleType("plain_module_here"))
    assert reading.find_package_dir("plain_module_here") is None  # imported, no __path__
    assert reading.find_package_dir("no_such_package_anywhere") is None


def test_a_broken_or_old_finder_is_passed_over(monkeypatch, tmp_path):
    """A finder that raises, one without ``find_spec`` (the old protocol) and the shim's watcher are
    skipped; the finders after them are asked as the import system asks them: ``(name, None)``."""
    (tmp_path / "findme").mkdir()
    (tmp_path / "findme" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    asked = []

    class Broken:
        def find_spec(self, name, path, target=None):
            asked.append(("broken", name, path))
            raise RuntimeError("broken finder")

    class Old:
        def find_module(self, name, path=None):
            raise AssertionError("the old protocol is not used")

    class Strict:
        def find_spec(self, name, path, target=None):  # ``path`` has no default, as in importlib's own
            asked.append(("strict", name, path))
            return None

    monkeypatch.setattr(sys, "meta_path", [Broken(), Old(), Strict()] + sys.meta_path)
    assert reading.find_package_dir("findme") == str(tmp_path / "findme")
    assert asked == [("broken", "findme", None), ("strict", "findme", None)]


def _version_files(tmp_path, **files):
    for name, text in files.items():
        (tmp_path / (name + ".py")).write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(tmp_path)


@pytest.mark.parametrize("files, version", [
    ({"_version": "__version__ = version = '0.5.11'\n", "version": "__version__ = '0.0.0.dev0'\n"}, "0.5.11"),
    ({"version": "__version__ = \"0.4.1\"\n"}, "0.4.1"),  # an older tree: the literal in version.py
    ({"_version": "VERSION = (1, 2)\n", "version": "__version__ = '0.4.2'\n"}, "0.4.2"),
    ({"_version": b"__version__ = '\xff'\n", "version": "__version__ = '0.4.3'\n"}, "0.4.3"),  # undecodable
    ({"_version": "__version__ = '0.5 .1'\n", "version": "__version__ = '0.4.4'\n"}, None),  # no PEP 440 text
    ({}, None),
])
def test_the_version_is_read_from_the_first_file_that_names_one(tmp_path, files, version):
    assert reading.read_version(_version_files(tmp_path, **files)) == version


def test_an_installed_package_s_version_is_its_distribution_s_before_its_files(tmp_path):
    from importlib import metadata

    package_dir = _version_files(tmp_path, _version="__version__ = '7.7.7'\n")
    assert reading.module_version(["no-such-dist-anywhere", "pytest"], package_dir) == metadata.version("pytest")
    assert reading.module_version(["no-such-dist-anywhere"], package_dir) == "7.7.7"
    assert reading.module_version([], str(tmp_path / "absent")) is None


def test_the_loaded_code_of_something_with_no_source_raises_what_the_check_reports():
    """``Target.check_loaded`` turns TypeError / OSError into "cannot read the loaded code";
    an object with no ``__code__`` must raise one of those, not an AttributeError."""
    import functools

    with pytest.raises(TypeError):
        reading.live_fingerprint(functools.partial(print))


def test_the_loaded_code_whose_file_is_gone_raises_oserror(tmp_path, monkeypatch):
    import importlib
    import linecache

    name = "gone_%s" % uuid.uuid4().hex  # a new name each run: no import cache can answer for it
    (tmp_path / (name + ".py")).write_text("def f(a):\n    return a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    monkeypatch.delitem(sys.modules, name)
    (tmp_path / (name + ".py")).unlink()
    linecache.cache.pop(module.f.__code__.co_filename, None)
    with pytest.raises(OSError):
        reading.live_fingerprint(module.f)


def test_a_method_indented_with_a_tab_has_the_fingerprint_its_source_has(tmp_path, monkeypatch):
    import importlib

    text = "class C:\n\tdef m(self, a):\n\t\treturn a + 1\n"
    name = "tabbed_%s" % uuid.uuid4().hex  # a new name each run: no import cache can answer for it
    (tmp_path / (name + ".py")).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    monkeypatch.delitem(sys.modules, name)
    assert reading.live_fingerprint(module.C.m) == ModuleSource(name + ".py", text).function("C.m").fingerprint
