"""What the test command needs of a machine (dev/shimdev/envs/machine.py): the CPythons 3.9-3.13 are
found through ``PYENV_ROOT`` and the ``PATH`` whatever ``HOME`` is, and what is missing is said in
one line with how to get it."""

import json
import os
import subprocess
import sys

import pytest

from shimdev import DEV, REPO
from shimdev.envs import machine
from test_drop_in import cpython

ASK = "import json; from shimdev.envs import machine; print(json.dumps([machine.cpython(v) for v in machine.PYTHONS]))"


def ask(env, code=ASK):
    """``code`` run in a fresh runner python with ``env`` only (and dev/ on its path)."""
    proc = subprocess.run([sys.executable, "-c", code], env=dict(env, PYTHONPATH=str(DEV)),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.fixture
def real():
    """{version: this machine's CPython}: each one a test here needs (missing: the test fails)."""
    return {version: cpython(version) for version in machine.PYTHONS}


def test_another_home_finds_every_cpython_through_pyenv_root(real, tmp_path):
    root = tmp_path / "pyenv"
    for version, python in real.items():
        folder = root / "versions" / (version + ".99") / "bin"
        folder.mkdir(parents=True)
        (folder / "python3").symlink_to(python)
    (tmp_path / "home").mkdir()
    found = ask({"HOME": str(tmp_path / "home"), "PYENV_ROOT": str(root), "PATH": "/usr/bin:/bin"})
    assert found == [str(root / "versions" / (v + ".99") / "bin" / "python3") for v in machine.PYTHONS]


def test_another_home_without_pyenv_finds_every_cpython_on_the_path(real, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for version, python in real.items():
        (bin_dir / ("python" + version)).symlink_to(python)
    (tmp_path / "home").mkdir()
    found = ask({"HOME": str(tmp_path / "home"), "PATH": "%s:/usr/bin:/bin" % bin_dir})
    assert found == [str(bin_dir / ("python" + v)) for v in machine.PYTHONS]


def test_a_program_named_python3_x_that_is_not_that_cpython_is_passed_over(real, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3.9").symlink_to(real["3.10"])  # another version under the name
    shim = bin_dir / "python3.10"  # a pyenv shim of a version that is not selected
    shim.write_text("#!/bin/sh\necho 'pyenv: python3.10: command not found' >&2\nexit 127\n")
    shim.chmod(0o755)
    (tmp_path / "home").mkdir()
    found = ask({"HOME": str(tmp_path / "home"), "PATH": str(bin_dir)})
    assert found == [None] * len(machine.PYTHONS)


def test_what_is_missing_is_one_line_that_says_how_to_get_it(tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "empty").mkdir()
    line = ask({"HOME": str(tmp_path / "home"), "PATH": str(tmp_path / "empty"), "CC": "no-such-cc"},
               "import json; from shimdev.envs import machine; print(json.dumps(machine.missing()))")
    assert "\n" not in line
    assert line.startswith("CPython 3.9, 3.10, 3.11, 3.12, 3.13 not found (looked in %s/.pyenv/versions/3.X.* "
                           "and for python3.X on PATH): install with `pyenv install 3.9 3.10 3.11 3.12 3.13`"
                           % (tmp_path / "home"))
    assert line.endswith("; no C compiler 'no-such-cc' (the zbal layer's native stand-in is built with it): "
                         "`apt-get install gcc`, or set CC")


def test_the_drop_in_tests_run_with_another_home_through_pyenv_root(real, tmp_path):
    """The drop-in tests' interpreters (test_drop_in.cpython) under another HOME: the 3.9 and 3.10
    cases of a test that runs them, in a pytest of their own."""
    root = tmp_path / "pyenv"
    for version in ("3.9", "3.10"):
        folder = root / "versions" / (version + ".99") / "bin"
        folder.mkdir(parents=True)
        (folder / "python3").symlink_to(real[version])
    (tmp_path / "home").mkdir()
    env = {"HOME": str(tmp_path / "home"), "PYENV_ROOT": str(root), "PATH": "/usr/bin:/bin"}
    if os.environ.get("NPU_SHIM_CACHE"):
        env["NPU_SHIM_CACHE"] = os.environ["NPU_SHIM_CACHE"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "tests/runtime/test_finder.py::"
                           "test_a_namespace_package_without_a_loader_in_its_spec_runs_its_hooks"],
                          cwd=str(REPO), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
