"""Mutation testing of the shim's own code, run by hand (not in CI): ``python3 scripts/mutation.py``.

Mutants are made here with the standard library's ``ast`` (no mutation tool to install):

* ``binop``     an arithmetic / bitwise operator swapped (``+`` <-> ``-``, ``*`` <-> ``/``, ...);
* ``compare``   a comparison flipped (``==`` <-> ``!=``, ``is`` <-> ``is not``, ``in`` <-> ``not
  in``) or moved across its boundary (``<`` <-> ``<=``, ``>`` <-> ``>=``);
* ``boolop``    ``and`` <-> ``or``;
* ``not``       a condition negated (``if x`` -> ``if not x``; ``not x`` -> ``x``; ``-x`` -> ``x``);
* ``constant``  a number n -> n + 1, ``True`` <-> ``False``, a string s -> ``"XX" s "XX"``
  (docstrings left alone);
* ``return``    ``return x`` -> ``return None`` (x not a constant: those are mutated as constants);
* ``remove``    a statement (a call, an assignment, a raise, ...) replaced by ``pass``.

``%``-formatting of a string literal is not mutated as an operator (the string itself is); nor are
annotations, f-strings, ``import`` statements and docstrings.  Each mutant is the original text
with one node's span replaced, re-parsed and checked to be exactly the intended tree (a mutant
that does not parse to it is dropped), so the rest of the file -- comments, line numbers -- is
untouched where the replacement fits on the node's own lines.

A run takes a seeded sample (``--seed 1 --sample 120`` by default; stratified: every module gets
its share of the sample by its number of mutants, at least ``MIN_PER_MODULE``), copies the
working tree into a temporary directory once, and for each mutant writes it there, runs the test
files that mirror the module (``MODULES``; ``--tests``, ``--whole-suite``) with ``-x -q -p
no:cacheprovider`` under a per-mutant timeout, puts the original back and classifies the mutant
``killed`` (a test failed or the module no longer imports), ``survived`` (every test passed) or
``timeout`` (counted as detected).  The real files are never written.
"""
from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MIN_PER_MODULE = 4
DEFAULT_SEED = 1
DEFAULT_SAMPLE = 120
QUICK_SAMPLE = 12

# module -> the test files that mirror it (run for each of its mutants), and, for a module only
# partly under test here, the defs whose code is mutated ("Class" = every method, "Class.method").
MODULES = {
    "npu_shim/core/framework.py": {"tests": ["tests/core/test_framework.py"]},
    "npu_shim/runtime/targets.py": {"tests": ["tests/runtime/test_targets.py", "tests/runtime/test_reliability.py"]},
    "npu_shim/runtime/activation.py": {"tests": ["tests/runtime/test_activation.py",
                                                 "tests/runtime/test_reliability.py", "tests/test_bootstrap.py"]},
    "npu_shim/runtime/finder.py": {"tests": ["tests/runtime/test_finder.py", "tests/runtime/test_reliability.py"]},
    "npu_shim/source/inherited.py": {"tests": ["tests/source/test_inherited.py"]},
    "npu_shim/core/config.py": {"tests": ["tests/core/test_config.py", "tests/core/test_framework.py",
                                     "tests/test_hostile_inputs.py"]},
    "npu_shim/reporting/record_writer.py": {"tests": [
        "tests/reporting/test_record_writer.py", "tests/reporting/test_state_records.py"]},
    "npu_shim/reporting/state_record.py": {"tests": [
        "tests/reporting/test_state_record.py", "tests/reporting/test_record_writer.py"]},
    "npu_shim/reporting/safe_dir.py": {"tests": [
        "tests/reporting/test_record_writer.py", "tests/cli/test_running_records.py"]},
    "npu_shim/cli/running_records.py": {"tests": [
        "tests/cli/test_running_records.py", "tests/reporting/test_state_records.py"]},
    # the release / guard / accounting code of the MLA patch
    "npu_shim/runtime/tensor_release.py": {
        "tests": ["tests/patches/test_mla_weight_release.py"],
        "scope": ["_find_released", "_guard_torch_function", "_guard_repr", "guarded_class",
                  "is_released", "storage_holders", "_base_chain", "_chain_refs",
                  "_base_held_elsewhere", "free_weight", "shares_storage", "exclusive"]},
    "npu_shim/patches/_impl/mla_weight_release.py": {
        "tests": ["tests/patches/test_mla_weight_release.py"],
        "scope": ["free_weight", "MlaWeightReleaseState.free_allowed", "MlaWeightReleaseState._account",
                  "MlaWeightReleaseState._note_guarded", "MlaWeightReleaseState.released_weights",
                  "MlaWeightReleaseState.free_qkv_a", "MlaWeightReleaseState.free_w_kc",
                  "MlaWeightReleaseState._free"]},
    # zbal's heap size and its set-up (full mode, the lazy GVA heap of mix mode)
    "npu_shim/patches/_impl/zbal.py": {
        "tests": ["tests/patches/test_zbal.py"],
        "scope": ["configured_mib", "_ip_port_kwargs", "_call_zbal_init", "gva_size_mib",
                  "ZbalState.init_for_rank", "ZbalState.lazy_init_due", "ZbalState.lazy_init",
                  "ZbalState.model_runner_initialize",
                  "ZbalState.model_runner_init_device_graphs"]},
}

_BINOPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
           ast.FloorDiv: ast.Div, ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult, ast.LShift: ast.RShift,
           ast.RShift: ast.LShift, ast.BitOr: ast.BitAnd, ast.BitAnd: ast.BitOr,
           ast.BitXor: ast.BitOr}
_COMPARES = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.LtE, ast.LtE: ast.Lt,
             ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
             ast.In: ast.NotIn, ast.NotIn: ast.In}
_REMOVABLE = (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Raise, ast.Delete,
              ast.Assert, ast.If, ast.For, ast.While, ast.With, ast.Try)  # (return: "return")


class Mutant:
    """One mutation of one file: ``text`` is the whole mutated source."""

    def __init__(self, path, index, line, kind, before, after, text):
        self.path = path      # relative to the repository, e.g. npu_shim/core/framework.py
        self.index = index    # its place among the file's mutants (stable for a given source)
        self.line = line
        self.kind = kind
        self.before = before  # the node's source, one line, shortened
        self.after = after    # what replaces it
        self.text = text

    @property
    def id(self):
        return "%s#%d" % (self.path, self.index)

    def describe(self):
        return "%s:%d %s: `%s` -> `%s`" % (self.path, self.line, self.kind, self.before, self.after)

    def as_dict(self):
        return {"id": self.id, "path": self.path, "line": self.line, "kind": self.kind,
                "before": self.before, "after": self.after}


def _short(text, limit=90):
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


# -- finding the mutation points ------------------------------------------------------------------

def _docstrings(tree):
    """ids of the docstring expressions of the module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                found.add(id(body[0]))
    return found


def _scope_lines(tree, scope):
    """[(first, last)] line ranges of the defs named in ``scope`` ("name" or "Class.name")."""
    ranges = []
    found = set()

    def visit(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qualname = prefix + node.name
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if qualname in scope:
                    ranges.append((first, node.end_lineno))
                    found.add(qualname)
                elif isinstance(node, ast.ClassDef):
                    visit(node.body, qualname + ".")

    visit(tree.body, "")
    missing = [name for name in scope if name not in found]
    if missing:
        raise ValueError("no def named %s" % ", ".join(missing))
    return ranges


def _skipped_subtrees(tree):
    """ids of nodes whose whole subtree is never mutated: annotations, f-strings, imports,
    ``if __name__ == "__main__"`` blocks."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.JoinedStr, ast.Global, ast.Nonlocal)):
            skip.add(id(node))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.returns is not None:
                skip.add(id(node.returns))
            args = node.args
            for arg in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
                if arg is not None and arg.annotation is not None:
                    skip.add(id(arg.annotation))
        elif isinstance(node, ast.AnnAssign):
            skip.add(id(node.annotation))
        elif isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and \
                isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__":
            skip.add(id(node))
    return skip


def _points(tree, scope=None):
    """(node, kind, replacement) for every mutation of ``tree``: ``replacement`` is a new node to
    put where ``node`` is."""
    docstrings = _docstrings(tree)
    skipped = _skipped_subtrees(tree)
    ranges = _scope_lines(tree, scope) if scope else None

    def in_scope(node):
        line = getattr(node, "lineno", None)
        if line is None:
            return False
        return ranges is None or any(first <= line <= last for first, last in ranges)

    points = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if id(node) in skipped or id(node) in docstrings:
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))
        if not in_scope(node):
            continue
        points.extend(_mutations(node))
    return points


def _mutations(node):
    """(node to replace, kind, replacement) for the mutations of one node."""
    found = []
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        formatting = isinstance(node.op, ast.Mod) and isinstance(node.left, (ast.Constant, ast.JoinedStr)) \
            and isinstance(getattr(node.left, "value", ""), str)
        if not formatting:
            new = copy.deepcopy(node)
            new.op = _BINOPS[type(node.op)]()
            found.append(("binop", new))
    elif isinstance(node, ast.AugAssign) and type(node.op) in _BINOPS:
        new = copy.deepcopy(node)
        new.op = _BINOPS[type(node.op)]()
        found.append(("binop", new))
    elif isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in _COMPARES:
                new = copy.deepcopy(node)
                new.ops[i] = _COMPARES[type(op)]()
                found.append(("compare", new))
    elif isinstance(node, ast.BoolOp):
        new = copy.deepcopy(node)
        new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        found.append(("boolop", new))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        found.append(("not", copy.deepcopy(node.operand)))
    elif isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool):
            found.append(("constant", ast.Constant(value=not value)))
        elif isinstance(value, (int, float)):
            found.append(("constant", ast.Constant(value=value + 1)))
        elif isinstance(value, str):
            found.append(("constant", ast.Constant(value="XX" + value + "XX")))
    found = [(node, kind, new) for kind, new in found]
    if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)) and \
            not isinstance(node.test, ast.Compare) and \
            not (isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not)):
        # the test alone is replaced (the statement's body keeps its text)
        found.append((node.test, "not", ast.UnaryOp(op=ast.Not(), operand=copy.deepcopy(node.test))))
    if isinstance(node, ast.Return) and node.value is not None and not isinstance(node.value, ast.Constant):
        # (a constant returned is mutated as a constant: False -> True, not False -> None)
        found.append((node, "return", ast.Return(value=ast.Constant(value=None))))
    if isinstance(node, _REMOVABLE):
        found.append((node, "remove", ast.Pass()))
    return found


# -- writing a mutant -----------------------------------------------------------------------------

def _replace(unit, target, new):
    """A deep copy of ``unit`` with the node at ``target``'s place in it replaced by ``new``."""
    order = {id(n): i for i, n in enumerate(ast.walk(unit))}
    clone = copy.deepcopy(unit)
    nodes = list(ast.walk(clone))
    wanted = nodes[order[id(target)]]
    if wanted is clone:
        return new
    for parent in nodes:
        for field, value in ast.iter_fields(parent):
            if value is wanted:
                setattr(parent, field, new)
                return clone
            if isinstance(value, list):
                for i, item in enumerate(value):
                    if item is wanted:
                        value[i] = new
                        return clone
    raise LookupError("node not found in its tree")


def _units(tree):
    """{id(node): the smallest def, or top-level statement, that holds it}: the part of the tree a
    mutant of that node is checked on."""
    units = {}

    def visit(node, unit):
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) or node is tree else unit
            units[id(child)] = inner
            visit(child, inner)

    visit(tree, None)
    return units


def _same_place(tree, unit):
    """The node of ``tree`` where ``unit`` (a statement of the original) starts, or None."""
    for node in ast.walk(tree):
        if type(node) is type(unit) and getattr(node, "lineno", None) == unit.lineno and \
                node.col_offset == unit.col_offset:
            return node
    return None


def _offsets(data):
    """Byte offset of the start of each line (1-based lines: index 0 unused)."""
    starts = [0, 0]
    for i, byte in enumerate(data):
        if byte == 0x0A:
            starts.append(i + 1)
    return starts


def _render(data, starts, node, new):
    """Candidate texts (bytes) for ``node``'s span replaced by ``new``, best first: where it fits,
    padded to the node's own number of lines (the lines after it keep their numbers)."""
    begin = starts[node.lineno] + node.col_offset
    end = starts[node.end_lineno] + node.end_col_offset
    extra = node.end_lineno - node.lineno
    code = ast.unparse(new)
    if "\n" in code:  # a compound statement: its body indented under the node's first line
        indent = data[starts[node.lineno]:begin].decode("utf-8")
        indent = indent if not indent.strip() else " " * len(indent)
        code = code.replace("\n", "\n" + indent)
    pad = "\n" * max(0, extra - code.count("\n"))
    if isinstance(node, ast.stmt):
        pieces = [code + pad, code] if pad else [code]
    else:
        pieces = ["(" + code + pad + ")", code] if pad else [code, "(" + code + ")"]
    return [data[:begin] + piece.encode("utf-8") + data[end:] for piece in pieces]


def generate(source, path="<source>", scope=None):
    """Every mutant of ``source`` (str) that parses to exactly its intended tree, in source order."""
    data = source.encode("utf-8")
    tree = ast.parse(data)
    starts = _offsets(data)
    units = _units(tree)
    statements = len(tree.body)
    mutants = []
    for node, kind, new in _points(tree, scope):
        unit = units[id(node)]
        expected = ast.dump(_replace(unit, node, new))
        for candidate in _render(data, starts, node, new):
            try:
                parsed = ast.parse(candidate)
            except SyntaxError:
                continue
            # The text outside the node's span is the original's: the mutant is right when the
            # statement or def around the node is exactly the intended one, at the same place.
            if unit is node:
                place = parsed.body[tree.body.index(node)] if len(parsed.body) == statements else None
            else:
                place = _same_place(parsed, unit)
            if len(parsed.body) != statements or place is None or ast.dump(place) != expected:
                continue
            text = candidate.decode("utf-8")
            if text != source:
                before = ast.get_source_segment(source, node) or ast.unparse(node)
                mutants.append(Mutant(path, len(mutants), node.lineno, kind, _short(before),
                                      _short(ast.unparse(new)), text))
            break
    return mutants


def module_mutants(path, repo=REPO):
    spec = MODULES.get(path, {})
    source = (Path(repo) / path).read_text(encoding="utf-8")
    return generate(source, path, spec.get("scope"))


# -- sampling -------------------------------------------------------------------------------------

def allocate(counts, sample, minimum=MIN_PER_MODULE):
    """{module: how many of its mutants to run}: at least ``minimum`` each (or all it has), the
    rest shared by the number of mutants left (largest remainder); deterministic."""
    counts = dict(counts)
    total = sum(counts.values())
    if sample >= total:
        return counts
    minimum = min(minimum, sample // max(1, len(counts)))  # a sample smaller than the minimums
    share = {m: min(c, minimum) for m, c in counts.items()}
    left = sample - sum(share.values())
    if left <= 0:
        return share
    spare = {m: counts[m] - share[m] for m in counts}
    pool = sum(spare.values())
    exact = {m: left * spare[m] / pool for m in counts}
    for m in counts:
        share[m] += int(exact[m])
    rest = left - sum(int(v) for v in exact.values())
    for m in sorted(counts, key=lambda m: (-(exact[m] - int(exact[m])), m))[:rest]:
        share[m] += 1
    return share


def sample(mutants_by_module, size, seed=DEFAULT_SEED):
    """The mutants to run: per module a sample drawn by ``random.Random("<seed>:<module>")``, in
    module order then source order.  The same seed, size and sources give the same sample."""
    counts = {m: len(v) for m, v in mutants_by_module.items()}
    share = allocate(counts, size)
    chosen = []
    for module, mutants in mutants_by_module.items():
        picked = random.Random("%s:%s" % (seed, module)).sample(range(len(mutants)), share[module])
        chosen += [mutants[i] for i in sorted(picked)]
    return chosen


# -- running --------------------------------------------------------------------------------------

def survivors_of(report, mutants_by_module):
    """The mutants an earlier report lists as survived, found again by their place and change
    (their index may have moved since); one that no longer exists is left out."""
    wanted = {(r["path"], r["line"], r["kind"], r["before"], r["after"])
              for r in report["mutants"] if r["status"] == "survived"}
    return [m for mutants in mutants_by_module.values() for m in mutants
            if (m.path, m.line, m.kind, m.before, m.after) in wanted]


def runner_python():
    """The test runner's venv (built by scripts/run_tests.py) when it exists, else this python."""
    from shimdev import runner

    python = runner.runner_dir() / "bin" / "python"
    return str(python) if python.exists() else sys.executable


def copy_tree(repo, dest):
    """The working tree's files (tracked, and untracked ones git does not ignore) copied to
    ``dest``; links stay links."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=str(repo), check=True, capture_output=True).stdout
    for name in sorted(set(n for n in listed.decode().split("\0") if n)):
        source = Path(repo) / name
        if not os.path.lexists(str(source)):
            continue  # deleted in the working tree
        target = Path(dest) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            os.symlink(os.readlink(str(source)), str(target))
        else:
            shutil.copy2(str(source), str(target))


def test_env():
    """As scripts/run_tests.py runs pytest: no PYTHONPATH, none of the caller's switches; and no
    bytecode written (a mutant and its original may have the same size and mtime second)."""
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONPATH" and (k == "NPU_SHIM_CACHE" or not k.startswith(("NPU_SHIM_", "SGLANG_")))}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def run_tests(python, root, tests, timeout, basetemp):
    """(status, seconds, tail): "passed", "failed", "error" (collection / usage / no tests) or
    "timeout"; the process group is killed on timeout."""
    command = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
               "--basetemp", str(basetemp)] + list(tests)
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=str(root), env=test_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return "timeout", time.monotonic() - started, _tail(out)
    seconds = time.monotonic() - started
    status = {0: "passed", 1: "failed"}.get(proc.returncode, "error")
    if proc.returncode == 2 and "error" in (out or "").lower():
        status = "failed"  # interrupted by a collection error: the mutant broke an import
    return status, seconds, _tail(out)


def _tail(out, lines=6):
    kept = [line for line in (out or "").splitlines() if line.startswith(("FAILED", "ERROR"))]
    return "\n".join(kept[:2] or (out or "").strip().splitlines()[-lines:])


def score(counts):
    detected = counts.get("killed", 0) + counts.get("timeout", 0)
    judged = detected + counts.get("survived", 0)
    return round(100.0 * detected / judged, 1) if judged else None


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 scripts/mutation.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--sample", type=int, default=DEFAULT_SAMPLE, help="mutants to run in all")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: --sample %d" % QUICK_SAMPLE)
    parser.add_argument("--modules", default=None,
                        help="comma-separated paths out of MODULES (default: all)")
    parser.add_argument("--tests", action="append", default=[], metavar="[MODULE=]FILES",
                        help="test files (comma-separated) to run instead of the mirrors, for every "
                             "module or, with MODULE=, for that one (repeatable)")
    parser.add_argument("--whole-suite", action="store_true", help="run all of tests/ for each mutant")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per mutant (default: 3x the unmutated run of its tests + 30)")
    parser.add_argument("--python", default=None, help="interpreter with pytest (default: the runner venv)")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    parser.add_argument("--list", action="store_true", help="print the sample, run nothing")
    parser.add_argument("--rerun", default=None, metavar="REPORT",
                        help="instead of a sample: the survivors of an earlier --out report (after "
                             "adding tests for them)")
    args = parser.parse_args(argv)
    size = QUICK_SAMPLE if args.quick else args.sample

    modules = list(MODULES) if not args.modules else [m.strip() for m in args.modules.split(",")]
    unknown = [m for m in modules if m not in MODULES]
    if unknown:
        parser.error("not in MODULES: %s" % ", ".join(unknown))
    tests = {m: list(MODULES[m]["tests"]) for m in modules}
    for item in args.tests:
        module, _, files = item.rpartition("=")
        for m in ([module] if module else modules):
            if m not in tests:
                parser.error("--tests: %s is not a module being mutated" % m)
            tests[m] = [f for f in files.split(",") if f]
    if args.whole_suite:
        tests = {m: ["tests"] for m in modules}

    generated = {}
    for m in modules:
        generated[m] = module_mutants(m)
    chosen = sample(generated, size, args.seed)
    if args.rerun:
        chosen = survivors_of(json.loads(Path(args.rerun).read_text(encoding="utf-8")), generated)
    total = sum(len(v) for v in generated.values())
    if args.rerun:
        print("%d mutants in %d modules; the %d survivors of %s" % (total, len(modules), len(chosen), args.rerun),
              flush=True)
    else:
        print("%d mutants in %d modules; sample of %d (seed %d)" % (total, len(modules), len(chosen), args.seed),
              flush=True)
    if args.list:
        for mutant in chosen:
            print("  " + mutant.describe())
        return 0

    python = args.python or runner_python()
    started = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="npu-shim-mutation-") as tmp:
        root = Path(tmp) / "repo"
        copy_tree(REPO, root)
        basetemp = Path(tmp) / "basetemp"
        baseline = {}
        for m in modules:
            if not any(x.path == m for x in chosen):
                continue
            key = tuple(tests[m])
            if key not in baseline:
                status, seconds, tail = run_tests(python, root, key, 3600, basetemp)
                baseline[key] = (status, seconds)
                print("baseline %s: %s in %.0f s" % (" ".join(key), status, seconds), flush=True)
                if status != "passed":
                    print(tail, flush=True)
        for n, mutant in enumerate(chosen, 1):
            key = tuple(tests[mutant.path])
            base_status, base_seconds = baseline[key]
            entry = dict(mutant.as_dict(), tests=list(key))
            if base_status != "passed":
                entry.update(status="not run", detail="its tests fail without a mutant")
            else:
                target = root / mutant.path
                original = target.read_bytes()
                timeout = args.timeout or 3 * base_seconds + 30
                try:
                    target.write_text(mutant.text, encoding="utf-8")
                    status, seconds, tail = run_tests(python, root, key, timeout, basetemp)
                finally:
                    target.write_bytes(original)
                verdict = {"failed": "killed", "passed": "survived"}.get(status, status)
                entry.update(status=verdict, seconds=round(seconds, 1),
                             detail=tail if verdict == "killed" else (tail.splitlines() or [""])[-1])
            results.append(entry)
            print("[%d/%d] %-8s %s (%s s)" % (n, len(chosen), entry["status"], mutant.describe(),
                                               entry.get("seconds", "-")), flush=True)

    per_module = {}
    for m in modules:
        mine = [r for r in results if r["path"] == m]
        counts = {s: sum(1 for r in mine if r["status"] == s)
                  for s in ("killed", "survived", "timeout", "error", "not run")}
        per_module[m] = dict(counts, mutants=len(generated[m]), sampled=len(mine), score=score(counts),
                             tests=tests[m])
    overall = {s: sum(v[s] for v in per_module.values())
               for s in ("killed", "survived", "timeout", "error", "not run", "sampled")}
    overall["score"] = score(overall)
    report = {"seed": args.seed, "sample": size, "whole_suite": args.whole_suite, "python": python,
              "seconds": round(time.monotonic() - started), "modules": per_module, "overall": overall,
              "mutants": results}

    print("\n%-42s %7s %7s %7s %8s %7s %6s" % ("module", "mutants", "sampled", "killed", "survived",
                                               "timeout", "score"))
    for m, row in per_module.items():
        print("%-42s %7d %7d %7d %8d %7d %5s%%" % (m, row["mutants"], row["sampled"], row["killed"],
                                                  row["survived"], row["timeout"], row["score"]))
    print("%-42s %7s %7d %7d %8d %7d %5s%%" % ("overall", "", overall["sampled"], overall["killed"],
                                              overall["survived"], overall["timeout"], overall["score"]))
    survivors = [r for r in results if r["status"] == "survived"]
    if survivors:
        print("\nsurvivors:")
        for r in survivors:
            print("  %s:%d %s: `%s` -> `%s`" % (r["path"], r["line"], r["kind"], r["before"], r["after"]))
    odd = [r for r in results if r["status"] in ("error", "not run")]
    for r in odd:
        print("  %s %s:%d (%s)" % (r["status"], r["path"], r["line"], r.get("detail", "")))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        print("\nreport: %s" % args.out)
    return 0
