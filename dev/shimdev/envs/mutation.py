"""Mutation testing of the shim's own code with mutmut 3 (run by hand, not in CI):
``python3 scripts/mutation.py``.

What is mutated and which tests run is mutmut's configuration, ``[tool.mutmut]`` in pyproject.toml;
mutmut makes the mutants, maps each to the tests that reach it and runs them.  This module only
gives mutmut the interpreter it needs (the mutation venv, dev/shimdev/envs/runner.py), the environment
it needs here (below), and reads mutmut's results back into one score per file.
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
from pathlib import Path

from shimdev import REPO
from shimdev.envs import runner


# mutmut's names for its results (mutmut/stats.py ``status_by_exit_code``), by exit code of the
# mutant's test run.  Only ``killed`` counts as killed: a survivor, a mutant no selected test
# reaches, a timeout and a suspicious run all count against the score.
STATUS_BY_EXIT_CODE = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests",
                       34: "skipped", 36: "timeout", 37: "caught by type check",
                       -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout", -11: "segfault",
                       -9: "segfault", None: "not checked"}


def environment():
    """mutmut forks a worker per mutant from a process whose tests already ran torch: forked
    after torch's OpenMP threads started, a worker's first parallel operator waits for threads
    that are not there, and mutmut calls the mutant a timeout.  One thread per process keeps a
    fork safe."""
    return dict(os.environ, OMP_NUM_THREADS="1")


def run_mutmut(args, python=None):
    """``mutmut <args>`` in the repository root (where mutmut writes ``mutants/``); its exit code."""
    python = python or runner.mutation_python()
    return subprocess.run([str(python), "-m", "mutmut"] + list(args), cwd=str(REPO), env=environment()).returncode


def status(exit_code):
    return STATUS_BY_EXIT_CODE.get(exit_code, "suspicious")


def read_results(mutants_dir):
    """{source file: {mutant name: status}} from mutmut's ``.meta`` files under ``mutants_dir``."""
    results = {}
    for meta in sorted(Path(mutants_dir).rglob("*.py.meta")):
        source = str(meta.relative_to(mutants_dir))[:-len(".meta")]
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        results[source] = {name: status(code) for name, code in sorted(codes.items())}
    return results


def score(results):
    """Per file and in all: (killed, mutants, {status: count})."""
    table = {}
    every = collections.Counter()
    for source, statuses in results.items():
        if not statuses:
            continue  # a file with nothing to mutate (an empty __init__.py)
        counts = collections.Counter(statuses.values())
        table[source] = (counts["killed"], sum(counts.values()), dict(counts))
        every.update(counts)
    table["all"] = (every["killed"], sum(every.values()), dict(every))
    return table


def render(table):
    lines = ["%-52s %7s %7s %7s  %s" % ("file", "killed", "mutants", "score", "not killed")]
    for source, (killed, total, counts) in table.items():
        rest = ", ".join("%d %s" % (n, s) for s, n in sorted(counts.items()) if s != "killed")
        lines.append("%-52s %7d %7d %6.1f%%  %s" % (source, killed, total, 100.0 * killed / total if total else 0.0,
                                                    rest or "-"))
    return "\n".join(lines)
