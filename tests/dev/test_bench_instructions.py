"""The benches' instruction counts (shimdev.bench.bench_rows.instructions_side_by_side, which
scripts/bench_shim_cost.py and bench_drop_in.py use): what a count reads from valgrind, and that an arm
that fails leaves no other arm's valgrind running (a stand-in ``valgrind`` on PATH; nothing timed)."""
import os
import stat

import pytest

from shimdev.bench import bench_rows

FAKE = """#!/bin/sh
# a stand-in valgrind: "$4" is the command's first word (after the three options)
echo $$ > "$PIDS/$4"
case "$4" in
  ok) echo "==1== I   refs:      1,234,567" >&2 ;;
  bad) while [ ! -f "$PIDS/slow" ]; do sleep 0.05; done; echo "bad arm" >&2; exit 3 ;;
  slow) exec sleep 600 ;;
esac
"""


@pytest.fixture
def fake_valgrind(tmp_path, monkeypatch):
    bin_dir, pids = tmp_path / "bin", tmp_path / "pids"
    bin_dir.mkdir()
    pids.mkdir()
    script = bin_dir / "valgrind"
    script.write_text(FAKE)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", "%s%s%s" % (bin_dir, os.pathsep, os.environ["PATH"]))
    env = dict(os.environ, PIDS=str(pids))
    return pids, env


def test_a_count_is_read_from_valgrinds_summary(fake_valgrind):
    _, env = fake_valgrind
    assert bench_rows.instructions_side_by_side({"a": (["ok"], env), "b": (["ok"], env)}) == {
        "a": 1234567, "b": 1234567}


def test_an_arm_that_fails_leaves_no_other_arm_running(fake_valgrind):
    pids, env = fake_valgrind
    with pytest.raises(RuntimeError, match="bad under valgrind failed \\(3\\): bad arm"):
        bench_rows.instructions_side_by_side({"bad": (["bad"], env), "slow": (["slow"], env)})
    pid = int((pids / "slow").read_text())  # written before the bad arm failed
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
