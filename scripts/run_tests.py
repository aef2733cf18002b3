"""The test command: everything the suite needs, then the suite.  `python3 scripts/run_tests.py`

1. a runner venv (``CACHE/venvs/test-runner``): torch==2.13.0 (CPU), wrapt, pytest, pytest-mock,
   pytest-xdist;
2. the sglang wheels of every supported release and their extracted sources (static matrix), and
   the layered environments of the import matrix (scripts/sglang_envs.py: one base venv with
   torch and no wrapt, per release a thin sglang layer and a dependency layer, a wrapt layer, the
   editable install; all cached, content-addressed: a changed pin builds a new layer).  A layer
   that cannot be built stops the run (exit 1) -- nothing is skipped;
3. pytest over tests/ in the runner venv.  Exits non-zero on any failure, and also when pytest
   collected no test (its exit code 5).

Extra arguments go to pytest (e.g. ``-k zbal``).  ``NPU_SHIM_CACHE`` moves the cache.
"""

import hashlib
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import sglang_envs  # noqa: E402

RUNNER_PINS = (sglang_envs.TORCH_PIN, "wrapt==2.5.2", "pytest==9.2.0", "pytest-mock==3.17.0",
               "pytest-xdist==3.8.0", "numpy==2.4.6")  # numpy: torch warns at import without it
PYTEST_NO_TESTS = 5


def log(message):
    print("[run_tests] %s" % message, flush=True)


def runner_python():
    """The runner venv's python, built when missing or when RUNNER_PINS changed."""
    venv = sglang_envs.cache_dir() / "venvs" / "test-runner"
    python = venv / "bin" / "python"
    stamp = venv / "npu-shim-stamp.json"
    digest = hashlib.sha256(json.dumps([RUNNER_PINS, sys.version_info[:2]]).encode()).hexdigest()[:16]

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
        sglang_envs._run([sys.executable, "-m", "venv", str(venv)], "creating the runner venv")
        cons = str(sglang_envs._constraints_file())
        sglang_envs._run(sglang_envs._pip(python, "install", "-c", cons, *RUNNER_PINS),
                         "installing the runner venv")
        stamp.write_text(json.dumps({"pins_hash": digest, "pins": RUNNER_PINS}))
    return python


def prepare():
    started = time.monotonic()
    python = runner_python()
    log("runner venv ready (%.0fs)" % (time.monotonic() - started))
    for version in sglang_envs.ALL_RELEASES:
        sglang_envs.ensure_sources(version)
    log("sources of %d releases ready (%.0fs)" % (len(sglang_envs.ALL_RELEASES), time.monotonic() - started))
    envs = sglang_envs.ensure_all(log=log)
    log("layered environments of %d releases + the editable install ready (%.0fs)"
        % (len(envs) - 1, time.monotonic() - started))
    return python


def main(argv):
    started = time.monotonic()
    try:
        python = prepare()
    except sglang_envs.EnvError as exc:
        log("error: %s" % exc)
        return 1
    # The suite sets every switch it tests; switches exported in the caller's shell must not leak in.
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONPATH" and (k == "NPU_SHIM_CACHE" or not k.startswith(("NPU_SHIM_", "SGLANG_")))}
    command = [str(python), "-m", "pytest", "-n", "2", "-q", "-ra", "tests"] + list(argv)
    log(" ".join(command))
    code = subprocess.call(command, cwd=REPO, env=env)
    log("pytest exit code %d after %.0fs in all" % (code, time.monotonic() - started))
    if code == PYTEST_NO_TESTS:
        log("error: pytest ran no test")
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
