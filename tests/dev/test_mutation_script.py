"""scripts/mutation.py (dev/shimdev/mutation.py): the mutants it makes and the sample it draws.
Nothing is mutated or run here; the run itself is by hand (docs/reliability.md)."""
from __future__ import annotations

import ast
import os

import pytest

from shimdev import mutation

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY = '''"""A module docstring."""
import os

LIMIT = 3


def f(a, b):
    """f's docstring."""
    if a < b and not a:
        return a + 1   # a comment
    values = [a, "s", True]
    total = 0
    for v in values:
        total += 1
    if values:
        raise ValueError("bad %s" % a)
    return -total if b is None else b


def g(x: int = 0) -> str:
    assert x
    return str(x)
'''


def test_mutants_are_valid_python_that_differs_from_the_original():
    mutants = mutation.generate(TINY, "tiny.py")
    original = ast.dump(ast.parse(TINY))
    assert len(mutants) > 20
    assert {m.kind for m in mutants} == {"binop", "compare", "boolop", "not", "constant", "return",
                                         "remove"}
    for m in mutants:
        assert m.text != TINY, m.describe()
        tree = ast.parse(m.text)  # valid Python
        assert ast.dump(tree) != original, m.describe()
        # one change in place: the docstrings, the comment, the line count and the import stay
        assert ast.get_docstring(tree) == "A module docstring."
        assert m.text.count("\n") == TINY.count("\n") and "# a comment" in m.text
        assert "import os" in m.text
        changed = [i + 1 for i, (a, b) in enumerate(zip(m.text.splitlines(), TINY.splitlines())) if a != b]
        assert changed and changed[0] == m.line, m.describe()
    assert [m.index for m in mutants] == list(range(len(mutants)))
    assert len({m.text for m in mutants}) == len(mutants)


def test_the_mutations_are_the_intended_ones():
    described = {(m.line, m.kind, m.before, m.after) for m in mutation.generate(TINY, "tiny.py")}
    for expected in [(4, "constant", "3", "4"), (9, "compare", "a < b", "a <= b"),
                     (9, "boolop", "a < b and not a", "a < b or not a"), (9, "not", "not a", "a"),
                     (10, "binop", "a + 1", "a - 1"), (10, "return", "return a + 1", "return None"),
                     (11, "constant", '"s"', "'XXsXX'"), (11, "constant", "True", "False"),
                     (14, "binop", "total += 1", "total -= 1"), (15, "not", "values", "not values"),
                     (17, "compare", "b is None", "b is not None"), (17, "not", "-total", "total"),
                     (12, "remove", "total = 0", "pass"), (21, "not", "x", "not x"),
                     (15, "remove", "if values:\n        raise ValueError(\"bad %s\" % a)", "pass")]:
        line, kind, before, after = expected
        assert (line, kind, mutation._short(before), mutation._short(after)) in described, expected
    # neither annotations, the import, the docstrings nor %-formatting as an operator
    assert not any(m.before in ("int", "str", "import os") or "docstring" in m.before for m in
                   mutation.generate(TINY, "tiny.py"))
    assert not any(m.kind == "binop" and "%" in m.before for m in mutation.generate(TINY, "tiny.py"))


def test_a_scope_limits_the_mutants_to_the_named_defs():
    mutants = mutation.generate(TINY, "tiny.py", scope=["g"])
    assert mutants and all(20 <= m.line <= 22 for m in mutants)
    with pytest.raises(ValueError, match="no def named nothing"):
        mutation.generate(TINY, "tiny.py", scope=["g", "nothing"])


def test_the_seed_makes_the_sample_deterministic():
    by_module = {"a.py": mutation.generate(TINY, "a.py"), "b.py": mutation.generate(TINY, "b.py", ["g"])}
    first = [m.id for m in mutation.sample(by_module, 10, seed=1)]
    assert first == [m.id for m in mutation.sample(by_module, 10, seed=1)]
    assert first != [m.id for m in mutation.sample(by_module, 10, seed=2)]
    assert len(first) == len(set(first)) == 10
    assert sum(1 for i in first if i.startswith("b.py")) >= min(mutation.MIN_PER_MODULE, len(by_module["b.py"]))


def test_the_sample_is_shared_by_size_with_a_minimum_per_module():
    # 4 each (b: all 3 it has), the other 9 by what is left: a 96 -> 6.08, c 46 -> 2.92 (+1)
    assert mutation.allocate({"a": 100, "b": 3, "c": 50}, 20) == {"a": 10, "b": 3, "c": 7}
    assert sum(mutation.allocate({"a": 7, "b": 13, "c": 29}, 17).values()) == 17
    assert mutation.allocate({"a": 5, "b": 2}, 100) == {"a": 5, "b": 2}
    assert mutation.allocate({"a": 50, "b": 50, "c": 10}, 2) == {"a": 1, "b": 1, "c": 0}


def test_every_module_in_the_list_has_its_scope_and_its_test_files():
    for path, spec in mutation.MODULES.items():
        with open(os.path.join(REPO, path), encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
        if spec.get("scope"):
            assert mutation._scope_lines(tree, spec["scope"]), path
        for test in spec["tests"]:
            assert os.path.isfile(os.path.join(REPO, test)), (path, test)


def test_list_prints_the_sample_and_runs_nothing(capsys):
    assert mutation.main(["--list", "--sample", "3", "--modules", "npu_shim/runtime/finder.py"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("mutants in 1 modules; sample of 3 (seed 1)")
    assert len(out) == 4 and all(line.startswith("  npu_shim/runtime/finder.py:") for line in out[1:])
