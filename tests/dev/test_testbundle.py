"""The tests' shared bundle (shimdev.envs.testbundle): built once under its lock, by the test command
beside the suite or else by the first test that needs it; a test that asks while it is built
waits for it, and a failed build is built again and its words given."""
import os
import shutil
import stat
import threading
import time

import pytest

from shimdev.envs import testbundle

#: Stands in for the runner's python: ``python -m npu_shim bundle OUT --force`` writes OUT/MANIFEST
#: (or fails where FAIL names a file that exists), and counts its runs.
FAKE = """#!/bin/sh
echo run >> "{runs}"
if [ -e "{fail}" ]; then echo "no wrapt wheel for cp313" >&2; exit 2; fi
sleep 1
mkdir -p "$4" && echo files > "$4/MANIFEST"
"""


def _fake_python(tmp_path):
    path = tmp_path / "python"
    path.write_text(FAKE.format(runs=tmp_path / "runs", fail=tmp_path / "fail"))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path), lambda: len((tmp_path / "runs").read_text().split()) if (tmp_path / "runs").exists() else 0


@pytest.fixture
def _removed_after():
    made = []
    yield made.append
    for path in made:
        shutil.rmtree(str(path))


def test_a_test_that_asks_while_the_command_builds_waits_and_takes_that_bundle(tmp_path, _removed_after):
    python, runs = _fake_python(tmp_path)
    shared, lock = testbundle.reserve()
    _removed_after(shared)
    assert stat.S_IMODE(os.stat(str(shared)).st_mode) == 0o700
    asked = {}
    waiting = threading.Thread(target=lambda: asked.update(result=testbundle.ensure(python, shared)))
    waiting.start()
    time.sleep(0.5)
    assert waiting.is_alive() and runs() == 0  # the lock is held: it waits, builds nothing
    built = testbundle.ensure(python, shared, held=lock)
    waiting.join(30)
    out = shared / "npu-shim-bundle" / "npu-shim"
    assert built == asked["result"] == (out, None)
    assert (out / "MANIFEST").is_file() and runs() == 1


def test_a_failed_build_says_why_and_the_next_one_builds_again(tmp_path, _removed_after):
    python, runs = _fake_python(tmp_path)
    (tmp_path / "fail").write_text("")
    shared, lock = testbundle.reserve()
    _removed_after(shared)
    out, error = testbundle.ensure(python, shared, held=lock)
    assert error.startswith("python -m npu_shim bundle failed:") and "no wrapt wheel for cp313" in error
    (tmp_path / "fail").unlink()
    assert testbundle.ensure(python, shared) == (out, None)
    assert runs() == 2 and (out / "MANIFEST").is_file()
