"""codeview: what a module's source answers (parsed once, whole, with ``ast``): functions and
methods with their parameters and first lines, module-level names looked up through if/try blocks,
and nothing that only a docstring, a string or a function body mentions.
"""

import textwrap

import pytest

from npu_shim.core.framework import SourceError
from npu_shim.source import codeview
from npu_shim.source.codeview import ModuleSource

HOSTILE = textwrap.dedent('''\
    """Module docstring with an example at column 0:
    def in_docstring(x):
        return x
    """
    import os as operating_system
    from typing import (
        Any,
    )

    LIMIT: int = 3
    value = dict(
    keyword_at_column_0=1)


    def simple(a, b=2, *args, c, **kwargs):
        return a


    def plain(a, b=2, *args, c, **kwargs):
        """Docstring with a line at column 0:
    still the docstring
        """
        return [
    1, 2]


    @decorator
    @other.attr(1)
    def decorated(a):
        return a


    @decorator(
        1,
        )
    def multi_line_decorator(a):
        return a


    def black_signature(
        a,
        b,
    ) -> int:
        # a comment at column 0 follows, inside the body
    # like this
        return a


    if operating_system.name == "nt":
        def conditional():
            return 1
    else:
        def conditional():
            return 2


    def twice():
        return 1


    def twice():
        return 2


    async def coroutine(x):
        return x


    def one_liner(a, b=1): return a  # its body on its header's line


    class Scheduler(
        Base,
        Mixin,
    ):
        """Class docstring."""

        def __init__(self, a, *, b):
            self.a = a

        @staticmethod
        def helper(x):
            return x

        @property
        def size(self):
            return 1

        @size.setter
        def size(self, value):
            pass

        if True:
            def only_in_if(self):
                pass

        def last(self):
            text = """
    column 0 inside a string
    """
            return text


    try:
        class Guarded:
            def method(self):
                pass
    except ImportError:
        pass


    try:
        from fast import thing
        use_fast = True
    # a comment at column 0 between the blocks
    except ImportError:
        use_fast = False
    else:
        checked: bool = True
    finally:
        pass
    try:
        split_handler = 1
    except (ImportError,
    RuntimeError):
        pass
    if operating_system.name == "posix":
        platform_only = 1
    elif operating_system.name == "nt":
        def windows_only():
            in_function = 1
    EXAMPLE = """
    try:
        in_string_only = 1
    except ImportError:
        pass
    """
    values = [
    1]
    if True:
        after_a_bracket = 1
    ''')


def module():
    return ModuleSource("hostile.py", HOSTILE)


def test_functions_and_methods_with_their_parameters():
    source = module()
    want = {
        "simple": ("a", "b", "*args", "c", "**kwargs"),
        "plain": ("a", "b", "*args", "c", "**kwargs"),
        "decorated": ("a",),
        "multi_line_decorator": ("a",),
        "black_signature": ("a", "b"),
        "conditional": (),
        "twice": (),
        "coroutine": ("x",),
        "one_liner": ("a", "b"),
        "windows_only": (),
        "Scheduler.__init__": ("a", "b"),   # self left out
        "Scheduler.helper": ("x",),         # a staticmethod keeps its first parameter
        "Scheduler.size": ("value",),       # the later def (the setter) wins
        "Scheduler.only_in_if": None,       # a def inside an if in a class body is not looked for
        "Scheduler.last": (),
        "Guarded.method": (),
        "in_docstring": None, "in_function": None, "absent": None, "Scheduler.absent": None,
        "Absent.__init__": None, "keyword_at_column_0": None,
    }
    got = {name: (lambda info: None if info is None else info.params)(source.function(name)) for name in want}
    assert got == want


def test_a_def_shadowed_by_a_later_one_is_the_later_one():
    """``conditional`` and ``twice`` are defined twice: the module answers with the last def, as
    the loaded module would hold it (its first line, its body's fingerprint)."""
    source = module()
    lines = HOSTILE.splitlines()
    info = source.function("twice")
    assert lines[info.first_line - 1] == "def twice():" and lines[info.first_line] == "    return 2"
    assert info.fingerprint != ModuleSource("one.py", "def twice():\n    return 1\n").function("twice").fingerprint
    assert info.fingerprint == ModuleSource("two.py", "def twice():\n    return 2\n").function("twice").fingerprint


def test_a_decorated_def_starts_at_its_first_decorator():
    source = module()
    lines = HOSTILE.splitlines()
    assert lines[source.function("decorated").first_line - 1] == "@decorator"
    assert lines[source.function("multi_line_decorator").first_line - 1] == "@decorator("


def test_the_fingerprint_ignores_comments_and_layout_not_the_code():
    base = ModuleSource("a.py", "def f(a):\n    return a + 1\n").function("f").fingerprint
    laid_out = ModuleSource("b.py", "# c\ndef f(\n    a,\n):\n    return (a\n            + 1)  # c\n")
    changed = ModuleSource("c.py", "def f(a):\n    return a + 2\n")
    assert laid_out.function("f").fingerprint == base
    assert changed.function("f").fingerprint != base


@pytest.mark.parametrize("name, present", [
    ("plain", True), ("LIMIT", True), ("value", True), ("operating_system", True), ("typing", False),
    ("Any", True), ("Scheduler", True), ("Guarded", True), ("conditional", True), ("use_fast", True),
    ("thing", True), ("checked", True), ("platform_only", True), ("windows_only", True),
    ("split_handler", True), ("after_a_bracket", True), ("Scheduler.size", True), ("Guarded.method", True),
    ("keyword_at_column_0", False), ("in_docstring", False), ("absent", False), ("Scheduler.absent", False),
    ("Scheduler.only_in_if", False), ("docstring", False), ("in_function", False), ("in_string_only", False),
])
def test_has_finds_module_level_names_through_if_and_try_blocks(name, present):
    assert module().has(name) is present


def test_the_module_is_parsed_once():
    source = module()
    source.function("plain")
    parsed = source._whole
    assert source.has("LIMIT") and source.function("Scheduler.last") is not None
    assert source._whole is parsed


def test_a_broken_def_says_why():
    text = "def target(:\n    pass\n"
    with pytest.raises(SourceError, match="cannot parse broken.py line 1"):
        ModuleSource("broken.py", text).function("target")


def test_a_view_answers_none_for_a_module_the_release_does_not_have(tmp_path):
    package = tmp_path / "sglang"
    (package / "srt").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "srt" / "x.py").write_text("def f(a):\n    pass\n")
    view = codeview.SourceView(str(package), version="0")
    assert view.function("sglang.srt.x", "f").params == ("a",)
    assert view.module("sglang.srt.y") is None and view.function("sglang.srt.y", "f") is None
    assert view.has("sglang.srt.x", "f") and not view.has("sglang.srt.y", "f")
    with pytest.raises(ValueError) as raised:
        view.module("other.x")
    assert str(raised.value) == "not an sglang module: other.x"


def test_a_package_module_is_read_from_its_init_file(tmp_path):
    package = tmp_path / "sglang"
    (package / "srt" / "layers").mkdir(parents=True)
    (package / "srt" / "layers" / "__init__.py").write_text("def g(b):\n    pass\n")
    view = codeview.SourceView(str(package), version="0")
    assert view.has("sglang.srt.layers", "g") and view.function("sglang.srt.layers", "g").params == ("b",)
    assert view.module("sglang.srt") is None  # a directory without __init__.py is no module here


def test_a_function_s_repr_names_it_with_its_parameters():
    assert repr(module().function("Scheduler.__init__")) == "FunctionInfo(Scheduler.__init__(a, b))"
    assert repr(module().function("twice")) == "FunctionInfo(twice())"


def test_contains_answers_whether_the_module_text_matches():
    """Probes on code (a call a release makes, not a name it defines) read the module's text."""
    module = ModuleSource("m.py", "def f():\n    return process_shared_expert(x)\n")
    assert module.contains(r"process_shared_expert\(") is True
    assert module.contains(r"forward_deepep\(") is False


def test_an_imported_module_is_known_by_the_name_it_binds():
    module = ModuleSource("m.py", "import os.path\nimport json.decoder as decoding\nfrom a.b import c as d\n")
    assert module.has("os") and not module.has("os.path")
    assert module.has("decoding") and not module.has("json")
    assert module.has("d")


def test_a_view_given_its_version_keeps_it(tmp_path):
    """A version given (an edited copy of a release's tree names another, or none) is believed
    over the package's own files."""
    (tmp_path / "version.py").write_text('__version__ = "0.5.9"\n')
    assert codeview.SourceView(str(tmp_path)).version == "0.5.9"
    assert codeview.SourceView(str(tmp_path), version="0.5.11").version == "0.5.11"
