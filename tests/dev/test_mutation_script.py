"""scripts/mutation.py (dev/shimdev/envs/mutation.py): mutmut's results read back into scores, the
environment its forked workers need, and the mutation venv it runs in."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from shimdev.envs import mutation, runner

REPO = mutation.REPO


def _meta(directory, source, codes):
    path = directory / (source + ".meta")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"exit_code_by_key": codes, "durations_by_key": {}}))


def test_results_are_read_per_file_and_only_killed_counts(tmp_path):
    _meta(tmp_path, "npu_shim/core/a.py", {"a.x_f__mutmut_1": 1, "a.x_f__mutmut_2": 0, "a.x_f__mutmut_3": -24,
                                          "a.x_f__mutmut_4": 33, "a.x_f__mutmut_5": 3})
    _meta(tmp_path, "npu_shim/runtime/__init__.py", {})  # nothing to mutate: no row
    _meta(tmp_path, "npu_shim/runtime/b.py", {"b.x_g__mutmut_1": 1, "b.x_g__mutmut_2": None, "b.x_g__mutmut_3": 99})
    results = mutation.read_results(tmp_path)
    assert "npu_shim/runtime/__init__.py" not in mutation.score(results)
    assert results.pop("npu_shim/runtime/__init__.py") == {}
    assert results == {
        "npu_shim/core/a.py": {"a.x_f__mutmut_1": "killed", "a.x_f__mutmut_2": "survived",
                               "a.x_f__mutmut_3": "timeout", "a.x_f__mutmut_4": "no tests",
                               "a.x_f__mutmut_5": "killed"},
        "npu_shim/runtime/b.py": {"b.x_g__mutmut_1": "killed", "b.x_g__mutmut_2": "not checked",
                                  "b.x_g__mutmut_3": "suspicious"}}
    table = mutation.score(results)
    assert table["npu_shim/core/a.py"] == (2, 5, {"killed": 2, "survived": 1, "timeout": 1, "no tests": 1})
    assert table["all"] == (3, 8, {"killed": 3, "survived": 1, "timeout": 1, "no tests": 1, "not checked": 1,
                                   "suspicious": 1})
    lines = mutation.render(table).splitlines()
    assert lines[0].split() == ["file", "killed", "mutants", "score", "not", "killed"]
    assert lines[1].split() == ["npu_shim/core/a.py", "2", "5", "40.0%", "1", "no", "tests,", "1", "survived,",
                                "1", "timeout"]
    assert lines[-1].split()[:4] == ["all", "3", "8", "37.5%"]


def test_a_forked_worker_runs_torch_on_one_thread():
    env = mutation.environment()
    assert env["OMP_NUM_THREADS"] == "1" and env["PATH"] == os.environ["PATH"]


def _report(tmp_path, mutants):
    return subprocess.run([sys.executable, os.path.join(REPO, "scripts", "mutation.py"), "--report",
                           "--mutants", str(mutants)], cwd=str(tmp_path), capture_output=True, text=True,
                          env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))


def test_the_report_reads_a_run_and_says_when_there_is_none(tmp_path):
    mutants = tmp_path / "mutants"
    proc = _report(tmp_path, mutants)
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "no mutmut results under %s\n" % mutants, "")
    _meta(mutants, "npu_shim/core/a.py", {"a.x_f__mutmut_1": 1, "a.x_f__mutmut_2": 0})
    proc = _report(tmp_path, mutants)
    assert proc.returncode == 0 and proc.stderr == ""
    assert [line.split()[:4] for line in proc.stdout.splitlines()[1:]] == [
        ["npu_shim/core/a.py", "1", "2", "50.0%"], ["all", "1", "2", "50.0%"]]


def test_the_mutation_venv_is_the_runner_pins_and_mutmut():
    assert runner.MUTMUT_PIN.startswith("mutmut==")
    assert runner._venv_dir("mutation", runner.RUNNER_PINS + (runner.MUTMUT_PIN,)) != runner.runner_dir()
    assert runner.runner_dir().name.startswith("test-runner-")
    # The runner venv's directory is named by its pins alone, as before the mutation venv existed.
    assert runner.runner_dir() == runner._venv_dir("test-runner", runner.RUNNER_PINS)


def test_stats_are_cleared_in_a_started_program_and_mutant_names_pass():
    """The line the mutation venv's .pth runs at start-up (dev/shimdev/envs/runner.py)."""
    name = "npu_shim.core.config.x_mib__mutmut_3"
    for value, seen in (("stats", None), (name, name), ("", "")):
        code = runner._STATS_ONLY_IN_THE_TEST_PROCESS + 'print(repr(os.environ.get("MUTANT_UNDER_TEST")))'
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env=dict(os.environ, MUTANT_UNDER_TEST=value)).stdout
        assert out.strip() == repr(seen), value
