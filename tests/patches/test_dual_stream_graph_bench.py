"""scripts/bench_dual_stream.py's graph mode (dev/shimdev/bench/graph_bench.py) and the steps of
scripts/device_check.sh that run it: on the simulated NPU the graphs are really captured and
replayed (the code path a device runs; nothing is timed there), on plain CPU torch graph mode says
it did not measure, and the report's crossover and verdict from stand-in figures.
"""
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from npu_shim.patches._selftest import _synthetic_moe
from shimdev.bench import graph_bench

REPO = Path(__file__).resolve().parents[2]
TINY = ["--hidden", "16", "--shared-inter", "16", "--expert-inter", "8", "--experts", "4", "--topk", "2",
        "--samples", "1", "--reps", "1"]


def _script(*args, timeout=240):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_dual_stream.py")] + list(args),
                          capture_output=True, text=True, timeout=timeout, cwd=str(REPO),
                          env=dict(os.environ, NPU_SHIM_ENABLED="0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {m.group(1): m.group(2) for m in re.finditer(r"^([a-z ()]+):\s+(.*)$", proc.stdout, re.M)}, proc.stdout


def test_graph_mode_on_the_simulated_npu_captures_and_replays_every_arm_at_every_size():
    """The dry run's path: eager and graph over two sizes on the simulated NPU -- four arms captured
    per size and replayed (the simulation's own event log counts them), outputs equal; every
    figure flagged as meaningless, no crossover claimed."""
    lines, out = _script("--graph", "--simnpu", "--sizes", "8,4", *TINY)
    sizes = re.findall(r"^size:\s+(\d+) tokens \| eager: serial [\d.]+, overlapped [\d.]+, ideal [\d.]+ ms, saving "
                       r"n/a \| graph: serial [\d.]+, overlapped [\d.]+, ideal [\d.]+ ms, saving n/a$", out, re.M)
    assert sizes == ["4", "8"], out
    assert "DIFFER" not in out
    assert lines["note"].startswith(graph_bench.SIMULATED)
    captured, replays = map(int, re.search(r"(\d+) graphs captured, (\d+) replays", lines["note"]).groups())
    assert captured == 4 * 2 and replays >= captured  # serial, overlapped, shared, routed at each size
    assert lines["crossover (graph)"] == lines["crossover (eager)"] == "not measured: " + graph_bench.SIMULATED
    assert lines["ok"] == "None" and lines["how"].startswith("npu:0 (simulated NPU)")


def test_mla_replay_on_the_simulated_npu_runs_no_python_in_the_replays():
    lines, _ = _script("--mla-replay", "--simnpu")
    assert lines["what"] == graph_bench.MLA_WHAT
    assert "Python calls during the replays: 0; outputs equal: True" in lines["measured"]
    assert re.search(r"; 2 graphs captured, 6 replays\)$", lines["measured"]), lines["measured"]
    assert lines["ok"] == "None"


def test_graph_mode_on_plain_cpu_says_it_did_not_measure(capsys):
    assert graph_bench.main(["--graph", "--device", "cpu", "--sizes", "4"] + TINY) == 0
    out = capsys.readouterr().out
    why = "no device graphs (torch.cpu has no CUDAGraph or NPUGraph with graph())"
    assert re.search(r"^size:\s+4 tokens \| eager: .* \| graph: not measured: %s$" % re.escape(why), out, re.M), out
    assert "crossover (graph): not measured: %s" % why in out
    assert "crossover (eager): not measured: CPU smoke run" in out and out.rstrip().endswith("ok:       None")
    assert graph_bench.main(["--mla-replay", "--device", "cpu"]) == 0
    assert "measured: not measured: %s" % why in capsys.readouterr().out
    from shimdev.bench.dual_stream_bench import find_device

    device, no_device = find_device()
    if device is None:  # no device at all: the same words, and why
        assert graph_bench.main(["--graph", "--sizes", "4"]) == 0
        assert capsys.readouterr().out == "what:     %s\nnot measured: no device graphs (%s)\n" % (
            graph_bench.WHAT, no_device)
        assert graph_bench.main(["--mla-replay"]) == 0
        assert "measured: not measured: no device graphs (%s)" % no_device in capsys.readouterr().out


def test_command_line_refusals(capsys):
    assert graph_bench.wants(["--graph"]) and graph_bench.wants(["--mla-replay"])
    assert not graph_bench.wants(["--tokens", "4"])
    with pytest.raises(SystemExit, match="positive token counts"):
        graph_bench.main(["--graph", "--device", "cpu", "--sizes", "0,4"])
    with pytest.raises(SystemExit, match="comma-separated"):
        graph_bench.main(["--graph", "--device", "cpu", "--sizes", "4;8"])
    with pytest.raises(SystemExit):
        graph_bench.main(["--graph", "--mla-replay", "--device", "cpu"])
    assert "one of --graph or --mla-replay" in capsys.readouterr().err


class _Graphs:
    """A device module that has graphs (``graph_support`` finds them); never captured here."""
    __name__ = "stand-in"

    class CUDAGraph:
        pass

    @staticmethod
    def graph(*args, **kwargs):
        raise AssertionError("not captured in this test")


def _result(serial, overlapped, equal=True):
    return _synthetic_moe.summarise(dict(serial=serial, serial_again=serial, overlapped=overlapped,
                                         shared=overlapped * 0.9, routed=overlapped * 0.9,
                                         ideal=overlapped * 0.9, equal=equal,
                                         params=dict(_synthetic_moe.DEFAULTS, routed="masked")))


def test_the_report_puts_eager_beside_graph_with_each_crossover_and_the_target(monkeypatch):
    eager = {512: (1.0, 1.2), 2048: (2.0, 1.9), 8192: (8.0, 8.5)}   # wins at 2048 only: never
    graph = {512: (1.0, 0.9), 2048: (2.0, 1.82), 8192: (8.0, 7.3)}  # always; 8192 saves 7.3 vs ideal 6.57: 52 %
    monkeypatch.setattr(_synthetic_moe, "measure", lambda device, device_module, **p: _result(*eager[p["tokens"]]))
    monkeypatch.setattr(_synthetic_moe, "measure_graph",
                        lambda device, device_module, **p: _result(*graph[p["tokens"]]))
    lines, rows = graph_bench.graph_report("cuda", _Graphs, "GPU", False, [512, 2048, 8192])
    text = dict(lines)
    assert [row["tokens"] for row in rows] == [512, 2048, 8192]
    assert text["crossover (eager)"] == ("never: two streams lose at 8192 tokens, the largest measured "
                                         "(512-8192 tokens); they win at 2048 only")
    assert text["crossover (graph)"] == "always: two streams win at every size measured (512-8192 tokens)"
    sizes = [value for key, value in lines if key == "size"]
    assert sizes[0] == ("512 tokens | eager: serial 1.000, overlapped 1.200, ideal 1.080 ms, saving n/a | "
                        "graph: serial 1.000, overlapped 0.900, ideal 0.810 ms, saving 53 %")
    assert text["ok"] is False  # the best graph saving is under 90 %
    graph[2048] = (2.0, 0.95)   # ideal 0.855: 91 % of the saving
    assert dict(graph_bench.graph_report("cuda", _Graphs, "GPU", False, [512, 2048, 8192])[0])["ok"] is True
    graph[2048] = (2.0, 0.95, False)  # a replay that differs is never ok
    assert dict(graph_bench.graph_report("cuda", _Graphs, "GPU", False, [512, 2048, 8192])[0])["ok"] is False


def test_per_expert_routing_is_timed_eager_and_named_as_not_capturable(monkeypatch):
    real = _synthetic_moe.measure_graph
    monkeypatch.setattr(_synthetic_moe, "measure", lambda device, device_module, **p: _result(1.0, 0.9))
    monkeypatch.setattr(_synthetic_moe, "measure_graph", lambda *a, **p: pytest.fail("per-expert captured"))
    lines, rows = graph_bench.graph_report("cuda", _Graphs, "GPU", False, [512], routed="per-expert")
    text = dict(lines)
    assert text["crossover (graph)"].startswith("not measured: per-expert routing reads the host per expert")
    assert text["crossover (eager)"].startswith("always") and text["ok"] is None
    with pytest.raises(ValueError, match="cannot be captured"):
        real("cpu", routed="per-expert")


# -- scripts/device_check.sh ---------------------------------------------------------------------------

FAKE_PYTHON = r'''#!/bin/sh
# A stand-in for the device machine's python: logs each command line, prints canned output.
echo "$*" >> "$CALLS"
case "$*" in
  *"npu_shim selftest"*) echo "dual_stream_experts: ok: ...; crossover on this NPU: graph replay from 2048 tokens" ;;
  *"--graph"*) echo "size:     512 tokens | eager: x | graph: y"
               echo "crossover (eager): never: canned"
               echo "crossover (graph): from 2048 tokens: canned"
               echo "ok:       False" ;;
  *"--mla-replay"*) echo "measured: replay through the function it replaces 10.0 us, through the shim's 10.0 us"
                    echo "ok:       True" ;;
esac
exit 0
'''


@pytest.mark.parametrize("dry", [False, True])
def test_device_check_runs_eager_and_graph_and_prints_the_crossover(tmp_path, dry):
    """The shell plumbing with a stand-in python: the overlap and sweep steps run --graph over the
    same sizes (the dry run on the simulated NPU), the MLA replay step runs, and the summary prints
    each crossover."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    calls = tmp_path / "calls.txt"
    env = dict(os.environ, PYTHON=str(fake), CALLS=str(calls), OUT=str(tmp_path / "out"),
               BUNDLE=str(tmp_path / "no-bundle"))
    proc = subprocess.run(["bash", str(REPO / "scripts" / "device_check.sh")] + (["--dry-run"] if dry else []),
                          capture_output=True, text=True, timeout=120, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    ran = calls.read_text().splitlines()
    graph_runs = [line for line in ran if "--graph" in line]
    sizes = "16,32" if dry else "512,2048,8192"
    where = "--simnpu " if dry else ""
    assert graph_runs[0].startswith("scripts/bench_dual_stream.py --graph %s--sizes %s" % (where, sizes))
    assert graph_runs[1].startswith("scripts/bench_dual_stream.py --graph %s--routed per-expert --sizes %s"
                                    % (where, sizes))
    assert graph_runs[2].startswith("scripts/bench_dual_stream.py --graph %s--routed masked --sizes %s"
                                    % (where, "16" if dry else "1024,4096,8192"))
    assert "scripts/bench_dual_stream.py --mla-replay" + (" --simnpu" if dry else "") in ran
    summary = proc.stdout[proc.stdout.index("== summary"):]
    assert "overlap crossover (graph): from 2048 tokens: canned" in summary
    assert "sweep crossover (eager): never: canned" in summary
    assert "selftest dual_stream_experts: ok: ...; crossover on this NPU: graph replay from 2048 tokens" in summary
    assert "mla_replay: exit 0" in summary and "sweep: 2 sizes measured" in summary
    assert ("DRY RUN: nothing above was measured on a device" in summary) == dry
