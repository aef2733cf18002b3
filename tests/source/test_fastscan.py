"""source/fastscan.py: what it reads from a def's or a name's own lines, and where it declines (the whole
parse then answers; test_codeview.py holds every answer to the whole parse)."""

import pytest

from npu_shim.source import fastscan
from test_codeview import HOSTILE, def_node


@pytest.mark.parametrize("qualname", [
    "simple", "decorated", "black_signature", "coroutine", "one_liner", "Scheduler.__init__",
    "Scheduler.helper",
])
def test_the_usual_shapes_are_read_without_parsing_the_module(qualname):
    assert def_node(HOSTILE, qualname) is not None


@pytest.mark.parametrize("qualname, why", [
    ("multi_line_decorator", "its decorator spans lines"),
    ("conditional", "defined in both branches of an if"),
    ("twice", "defined twice (the last one counts)"),
    ("Scheduler.size", "a property and its setter"),
    ("Scheduler.only_in_if", "inside an if in the class body"),
    ("Guarded.method", "a class inside a try"),
    ("in_docstring", "only inside the module docstring"),
    ("plain", "a line at column 0 inside its docstring and its list"),
    ("Scheduler.last", "a line at column 0 inside a string"),
])
def test_what_cannot_be_told_apart_for_certain_is_left_to_the_whole_parse(qualname, why):
    assert def_node(HOSTILE, qualname) is None, why


def test_tabs_are_left_to_the_whole_parse():
    assert def_node("def f(x):\n\treturn x\n", "f") is None

@pytest.mark.parametrize("name, present", [
    ("use_fast", True), ("checked", True), ("platform_only", True), ("after_a_bracket", True),
    ("in_function", False), ("in_string_only", False), ("absent", False),
    ("split_handler", False),  # a line at column 0 inside the handler's brackets: the whole parse answers
])
def test_a_name_assigned_in_a_module_level_if_or_try_is_found_from_that_statement_alone(name, present):
    assert fastscan.assigned_in_top_block(HOSTILE, name) is present

def test_string_answers_by_bisection_are_the_counts_from_the_start():
    quotes = "'" * 3, '"' * 3
    text = HOSTILE + quotes[0] + "x" + quotes[0] + " " + '"' * 5 + " tail\n"  # four and five in a row
    source = fastscan.Text(text)
    for position in range(len(text) + 1):
        assert source.in_string(position) == any(text.count(q, 0, position) % 2 for q in quotes), position
        assert source.line_at(position) == text.count("\n", 0, position)
