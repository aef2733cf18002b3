"""The test runner's venv: torch (CPU), wrapt, pytest, hypothesis, ruff, and the clients the server
tests talk with (the real ``openai`` client, ``prometheus_client``'s parser) -- built once in the
cache, in a directory named by ``RUNNER_PINS`` (a changed pin builds a new one and never replaces a
venv another test run is using).  Used by the test command (scripts/run_tests.py) and by the
benchmarks (scripts/bench.py re-runs itself there), so both run on the same interpreter and
packages.

The mutation venv (``mutation_python``) is the same pins plus mutmut: mutmut's mutants import
mutmut in every process that imports the mutated code, the test programs the tests start included,
so it has to be in the interpreter itself (scripts/mutation.py)."""

import hashlib
import json
import subprocess
import sys

from shimdev.envs import lint, sglang_envs

RUNNER_PINS = (sglang_envs.TORCH_PIN, "wrapt==2.5.2", "pytest==9.2.0", "pytest-mock==3.17.0",
               "pytest-xdist==3.8.0", "numpy==2.4.6",  # numpy: torch warns at import without it
               "openai==2.6.1", "prometheus-client==0.26.0",
               "hypothesis==6.168.3",  # the property tests of the parsers of untrusted input
               lint.RUFF_PIN)  # the linter the test command runs
MUTMUT_PIN = "mutmut==3.8.1"


def _digest(pins):
    return hashlib.sha256(json.dumps([pins, sys.version_info[:2]]).encode()).hexdigest()[:16]


def runner_dir():
    """Where the runner venv of these pins lives (built or not)."""
    return _venv_dir("test-runner", RUNNER_PINS)


def _venv_dir(name, pins):
    return sglang_envs.cache_dir() / "venvs" / ("%s-%s" % (name, _digest(pins)))


def runner_python(log=print):
    """The runner venv's python, built when missing or when RUNNER_PINS changed (raises
    sglang_envs.EnvError when it cannot be built)."""
    return _venv_python("test-runner", RUNNER_PINS, log)


# mutmut maps tests to the functions they reach by running them once with MUTANT_UNDER_TEST=stats;
# a test program started from another directory inherits that value, and its first call of a
# mutated function looks for mutmut's configuration in its own directory and raises.  The map is
# made from the test process alone (a program's calls are not recorded anyway), so the venv's
# interpreters start with the value cleared.  Mutant names pass through: a test program then
# runs the mutant, as it must for its test to kill it.
_STATS_ONLY_IN_THE_TEST_PROCESS = (
    'import os; os.environ.get("MUTANT_UNDER_TEST") == "stats" and os.environ.pop("MUTANT_UNDER_TEST")\n')


def mutation_python(log=print):
    """The mutation venv's python: RUNNER_PINS and mutmut (built like the runner venv)."""
    def stats_only_in_the_test_process(python):
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        with open(site + "/npu_shim_mutmut_stats.pth", "w") as f:
            f.write(_STATS_ONLY_IN_THE_TEST_PROCESS)

    return _venv_python("mutation", RUNNER_PINS + (MUTMUT_PIN,), log, finish=stats_only_in_the_test_process)


def _venv_python(name, pins, log, finish=None):
    digest = _digest(pins)
    venv = _venv_dir(name, pins)
    python = venv / "bin" / "python"
    stamp = venv / "npu-shim-stamp.json"

    def current():
        try:
            return python.exists() and json.loads(stamp.read_text())["pins_hash"] == digest
        except (OSError, ValueError, KeyError):
            return False

    if current():
        return python
    with sglang_envs.file_lock("venv-" + name):
        if current():
            return python
        log("building the %s venv %s" % (name, venv))
        subprocess.run(["rm", "-rf", str(venv)], check=True)
        sglang_envs.run([sys.executable, "-m", "venv", str(venv)], "creating the %s venv" % name)
        cons = str(sglang_envs.constraints_file())
        sglang_envs.run(sglang_envs.pip(python, "install", "-c", cons, *pins),
                        "installing the %s venv" % name)
        if finish is not None:
            finish(python)
        stamp.write_text(json.dumps({"pins_hash": digest, "pins": pins}))
    return python
