"""The test command: everything the suite needs, then the suite.  `python3 scripts/run_tests.py`

0. what this machine lacks of what the tests need (the CPythons 3.9-3.13, a C compiler:
   dev/shimdev/envs/machine.py), said in one line with how to get it; the tests that need it fail;
1. a runner venv (``CACHE/venvs/test-runner-<pins>``, dev/shimdev/envs/runner.py): torch==2.13.0 (CPU),
   wrapt, pytest, pytest-mock, pytest-xdist, hypothesis, ruff, and the clients the real-server tests talk
   with (openai, prometheus-client);
2. the sglang wheels of every supported release and their extracted sources (static matrix), and
   the layered environments of the import matrix (dev/shimdev/envs/sglang_envs.py: one base venv with
   torch and no wrapt, per release a thin sglang layer and a dependency layer, a wrapt layer, the
   editable install; all cached, content-addressed: a changed pin builds a new layer).  A layer
   that cannot be built stops the run (exit 1) -- nothing is skipped;
3. ruff over the checkout (dev/shimdev/envs/lint.py, configured in pyproject.toml): its findings fail the
   run, after the suite has run;
4. pytest over tests/ in the runner venv, two xdist workers: ``--dist loadgroup`` gives each
   ``xdist_group`` (the real-server tests of one release or job, sharing its servers) to one
   worker, the groups of most tests first, then the single tests in collection order (the
   ungrouped server tests collected first: tests/conftest.py).  On a whole run the bundle the
   tests share is built beside the first of them (dev/shimdev/envs/testbundle.py).  The run ends with
   what it cost: CPU seconds and sglang server starts per worker (dev/shimdev/envs/suitecost.py).
   Exits non-zero on any failure, and also when pytest collected no test (its exit code 5).  The
   deploy tests (tests/test_deploy.py) set up their container engine themselves
   (dev/shimdev/envs/containers.py: podman from apt-get where missing, its images cached under the
   cache dir), started here beside step 2; one that cannot be set up fails those tests.

Extra arguments go to pytest (e.g. ``-k zbal``, or ``tests/reporting/test_log.py`` to run that file
alone).  ``NPU_SHIM_CACHE`` moves the cache.
"""

import os
import shutil
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "dev"), REPO]  # shimdev (dev/shimdev/__init__.py), npu_shim

from shimdev.envs import containers, lint, machine, runner, sglang_envs  # noqa: E402 - after dev/ is put on sys.path
from shimdev.envs import testbundle  # noqa: E402 - after dev/ is put on sys.path

PYTEST_NO_TESTS = 5


def log(message):
    print("[run_tests] %s" % message, flush=True)


def runner_python():
    """The runner venv's python (shimdev.envs.runner; built when missing)."""
    return runner.runner_python(log=log)


def start_containers(started):
    """The deploy tests' engine and images, set up beside the release environments (on a cold
    machine apt, a root file system and an import take long enough to be worth overlapping); a
    failure is reported by those tests."""
    def work():
        error = containers.prepare(log=log)
        if error:
            log("container engine not ready (tests/test_deploy.py will fail): %s" % error)
        else:
            log("container engine and images ready (%.0fs)" % (time.monotonic() - started))

    thread = threading.Thread(target=work, name="containers")
    thread.start()
    return thread


def start_bundle(python, env):
    """The tests' bundle, built beside the suite (its lock held from now: a test that asks sooner
    waits); returns its directory and the thread building it."""
    shared, lock = testbundle.reserve()

    def work():
        _, error = testbundle.ensure(str(python), shared, env, held=lock)
        if error:
            log("the tests' bundle could not be built (the tests that need it build it again): %s"
                % error.strip().splitlines()[-1])

    thread = threading.Thread(target=work, name="bundle")
    thread.start()
    return shared, thread


def prepare():
    started = time.monotonic()
    gaps = machine.missing()
    if gaps:  # the tests that need it fail with the same words; the others still run
        log("this machine lacks what some tests need: %s" % gaps)
    engine = start_containers(started)
    python = runner_python()
    log("runner venv ready (%.0fs)" % (time.monotonic() - started))
    for version in sglang_envs.ALL_RELEASES:
        sglang_envs.ensure_sources(version)
    log("sources of %d releases ready (%.0fs)" % (len(sglang_envs.ALL_RELEASES), time.monotonic() - started))
    envs = sglang_envs.ensure_all(log=log)
    log("layered environments of %d releases + the editable install ready (%.0fs)"
        % (len(envs) - 1, time.monotonic() - started))
    engine.join()
    return python


def main(argv):
    started = time.monotonic()
    try:
        python = prepare()
    except sglang_envs.EnvError as exc:
        log("error: %s" % exc)
        return 1
    linted = lint.check(python, REPO, log=log)
    # The suite sets every switch it tests; switches exported in the caller's shell must not leak in.
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONPATH" and (k == "NPU_SHIM_CACHE" or not k.startswith(("NPU_SHIM_", "SGLANG_")))}
    # loadgroup: the real-server tests of one release (xdist_group) share its servers on one worker
    # the whole suite unless the arguments name test files or folders of their own
    chosen = [a for a in argv if not a.startswith("-") and a.split("::")[0].startswith("tests")]
    command = ([str(python), "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q", "-ra",
                "--durations=25"]
               + ([] if chosen else ["tests"]) + list(argv))
    log(" ".join(command))
    if chosen:  # the tests chosen build the bundle if they need it
        code = subprocess.call(command, cwd=REPO, env=env)
    else:
        shared, bundle = start_bundle(python, env)
        try:
            code = subprocess.call(command, cwd=REPO, env=dict(env, **{testbundle.ENV: str(shared)}))
        finally:
            bundle.join()
            shutil.rmtree(str(shared), ignore_errors=True)
    log("pytest exit code %d after %.0fs in all" % (code, time.monotonic() - started))
    if code == PYTEST_NO_TESTS:
        log("error: pytest ran no test")
        return 1
    if not linted:
        log("error: the lint failed (its line above the tests'), whatever the tests did")
        return code or 1
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
