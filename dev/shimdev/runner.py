"""The test runner's venv: torch (CPU), wrapt, pytest, hypothesis -- built once in the cache per
set of ``RUNNER_PINS`` (``CACHE/venvs/test-runner-<digest>``).  Used by the test command
(scripts/run_tests.py) and by the benchmarks (scripts/bench.py re-runs itself there), so both run
on the same interpreter and packages."""

import hashlib
import json
import subprocess
import sys

from shimdev import sglang_envs

RUNNER_PINS = (sglang_envs.TORCH_PIN, "wrapt==2.5.2", "pytest==9.2.0", "pytest-mock==3.17.0",
               "pytest-xdist==3.8.0", "numpy==2.4.6",  # numpy: torch warns at import without it
               "hypothesis==6.168.3")  # the property tests of the parsers of untrusted input


def _digest():
    return hashlib.sha256(json.dumps([RUNNER_PINS, sys.version_info[:2]]).encode()).hexdigest()[:16]


def venv_dir():
    """Where the runner venv of these pins lives: named by their digest, as the release layers
    are, so that checkouts with other pins (another branch's) each keep their own instead of
    rebuilding one shared venv under each other's running tests."""
    return sglang_envs.cache_dir() / "venvs" / ("test-runner-" + _digest())


def runner_python(log=print):
    """The runner venv's python, built when missing (raises sglang_envs.EnvError when it cannot
    be built)."""
    venv = venv_dir()
    python = venv / "bin" / "python"
    stamp = venv / "npu-shim-stamp.json"
    digest = _digest()

    def current():
        try:
            return python.exists() and json.loads(stamp.read_text())["pins_hash"] == digest
        except (OSError, ValueError, KeyError):
            return False

    if current():
        return python
    with sglang_envs.file_lock("venv-" + venv.name):
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
