"""The test runner's venv: torch (CPU), wrapt, pytest, hypothesis, ruff, and the clients the server
tests talk with (the real ``openai`` client, ``prometheus_client``'s parser) -- built once in the
cache, in a directory named by ``RUNNER_PINS`` (a changed pin builds a new one and never replaces a
venv another test run is using).  Used by the test command (scripts/run_tests.py) and by the
benchmarks (scripts/bench.py re-runs itself there), so both run on the same interpreter and
packages."""

import hashlib
import json
import subprocess
import sys

from shimdev import lint, sglang_envs

RUNNER_PINS = (sglang_envs.TORCH_PIN, "wrapt==2.5.2", "pytest==9.2.0", "pytest-mock==3.17.0",
               "pytest-xdist==3.8.0", "numpy==2.4.6",  # numpy: torch warns at import without it
               "openai==2.6.1", "prometheus-client==0.26.0",
               "hypothesis==6.168.3",  # the property tests of the parsers of untrusted input
               lint.RUFF_PIN)  # the linter the test command runs


def _digest():
    return hashlib.sha256(json.dumps([RUNNER_PINS, sys.version_info[:2]]).encode()).hexdigest()[:16]


def runner_dir():
    """Where the runner venv of these pins lives (built or not)."""
    return sglang_envs.cache_dir() / "venvs" / ("test-runner-" + _digest())


def runner_python(log=print):
    """The runner venv's python, built when missing or when RUNNER_PINS changed (raises
    sglang_envs.EnvError when it cannot be built)."""
    digest = _digest()
    venv = runner_dir()
    python = venv / "bin" / "python"
    stamp = venv / "npu-shim-stamp.json"

    def current():
        try:
            return python.exists() and json.loads(stamp.read_text())["pins_hash"] == digest
        except (OSError, ValueError, KeyError):
            return False

    if current():
        return python
    with sglang_envs.file_lock("venv-test-runner"):
        if current():
            return python
        log("building the runner venv %s" % venv)
        subprocess.run(["rm", "-rf", str(venv)], check=True)
        sglang_envs.run([sys.executable, "-m", "venv", str(venv)], "creating the runner venv")
        cons = str(sglang_envs.constraints_file())
        sglang_envs.run(sglang_envs.pip(python, "install", "-c", cons, *RUNNER_PINS),
                        "installing the runner venv")
        stamp.write_text(json.dumps({"pins_hash": digest, "pins": RUNNER_PINS}))
    return python
