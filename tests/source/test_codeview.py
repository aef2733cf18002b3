"""codeview: a function read from its own lines is the function the whole-module parse gives.

The fast path (npu_shim/source/fastscan.py: ``locate_def``/``parse_def``, ``may_define``,
``assigned_at_top``, ``assigned_in_top_block``) answers without parsing the module; these tests hold it to the whole
parse: on hand-made hostile sources, on every function of every module the patches read in every
release, and on the decisions themselves.
"""

import os
import textwrap

import pytest

from npu_shim.core import framework
from npu_shim.source import inherited, codeview, fastscan
from npu_shim.source.codeview import ModuleSource
from npu_shim.core.loading import load_all
from shimdev import sglang_envs

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


def whole(text):
    module = ModuleSource("hostile.py", text)
    module.functions  # noqa: B018 - parses the whole module: the reference answers
    return module


def def_node(text, qualname):
    """The node ``fastscan.read_def`` reads from the def's own lines, or None."""
    found = fastscan.read_def(text, qualname)
    return found[0] if found is not None else None


def test_every_function_read_from_its_lines_is_the_one_the_whole_parse_gives():
    reference = whole(HOSTILE)
    fast = 0
    for qualname, info in reference.functions.items():
        node = def_node(HOSTILE, qualname)
        if node is None:
            continue
        fast += 1
        got = ModuleSource("hostile.py", HOSTILE).function(qualname)
        assert (got.params, got.fingerprint) == (info.params, info.fingerprint), qualname
    assert fast >= 6


QUESTIONS = [
    ("function", q) for q in (
        "simple", "plain", "decorated", "multi_line_decorator", "black_signature", "conditional", "twice",
        "coroutine", "one_liner", "Scheduler.__init__", "Scheduler.helper", "Scheduler.size",
        "Scheduler.only_in_if", "Scheduler.last", "Guarded.method", "in_docstring", "absent",
        "Scheduler.absent", "Absent.__init__", "keyword_at_column_0")
] + [
    ("has", q) for q in (
        "plain", "LIMIT", "value", "keyword_at_column_0", "operating_system", "typing", "Any",
        "Scheduler", "Guarded", "conditional", "in_docstring", "absent", "Scheduler.size",
        "Scheduler.absent", "Scheduler.only_in_if", "Guarded.method", "docstring", "use_fast", "thing",
        "checked", "platform_only", "windows_only", "in_function", "in_string_only", "after_a_bracket", "split_handler")
]


@pytest.mark.parametrize("kind, qualname", QUESTIONS)
def test_each_answer_is_the_whole_parse_answer(kind, qualname):
    reference, fresh = whole(HOSTILE), ModuleSource("hostile.py", HOSTILE)
    if kind == "has":
        assert fresh.has(qualname) == reference.has(qualname)
    else:
        want, got = reference.function(qualname), fresh.function(qualname)
        assert (got is None) == (want is None)
        if want is not None:
            assert (got.params, got.fingerprint) == (want.params, want.fingerprint)


def test_a_broken_def_is_read_by_the_whole_parse_which_says_why():
    text = "def target(:\n    pass\n"
    with pytest.raises(codeview.SourceError, match="cannot parse"):
        ModuleSource("broken.py", text).function("target")


# -- the real releases -------------------------------------------------------------------------------

def _decide_every_patch(view):
    for patch in load_all():
        framework.decide(patch, view, environ={}, on_npu=None, assume_triggered=True)


def _forced_whole(monkeypatch):
    monkeypatch.setattr(fastscan, "locate_def", lambda source, qualname: None)
    monkeypatch.setattr(fastscan, "assigned_at_top", lambda text, name: False)
    monkeypatch.setattr(fastscan, "assigned_in_top_block", lambda text, name: False)
    monkeypatch.setattr(ModuleSource, "_may_define", lambda self, name, function: True)


@pytest.mark.parametrize("version", sglang_envs.ALL_RELEASES)
def test_a_release_gives_the_same_answers_read_fast_or_whole(version, monkeypatch):
    """Every answer the patches' decisions ask of the release's source, fast path vs the whole
    parse; and every function of every module read, one by one."""
    package = os.path.join(str(sglang_envs.ensure_sources(version)), "sglang")
    fast = inherited.InheritedView(package)
    _decide_every_patch(fast)
    with monkeypatch.context() as patched:
        _forced_whole(patched)
        reference = inherited.InheritedView(package)
        _decide_every_patch(reference)
    assert fast.answers == reference.answers
    for dotted in fast.files:
        module = SourceViewOf(package).module(dotted)
        if module is None:
            continue
        for qualname, info in whole(module.text).functions.items():
            node = def_node(module.text, qualname)
            if node is not None:
                got = ModuleSource(module.path, module.text).function(qualname)
                assert (got.params, got.fingerprint) == (info.params, info.fingerprint), (dotted, qualname)


def SourceViewOf(package):  # noqa: N802 - reads like the class it builds
    return codeview.SourceView(package, version="")


def test_deciding_on_0_5_11_parses_no_module_whole():
    """What makes deciding cheap: on 0.5.11 (the benchmark's release) every answer comes from the
    fast path -- scheduler.py, model_runner.py, utils/common.py, parallel_state.py, and
    deepep.py, whose ``use_deepep`` is assigned inside a module-level try."""
    package = os.path.join(str(sglang_envs.ensure_sources("0.5.11")), "sglang")
    view = codeview.SourceView(package)
    _decide_every_patch(view)
    parsed_whole = sorted(dotted for dotted, module in view._modules.items()
                          if module is not None and module._whole is not None)
    assert parsed_whole == []
