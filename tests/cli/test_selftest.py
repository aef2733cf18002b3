"""``python -m npu_shim selftest`` (npu_shim/cli/selftest.py, selftest_child.py, and the patches' own
steps under npu_shim/patches/_selftest/).

End to end on the simulated NPU: sglang 0.5.9's real source (every patch ``applied`` there with
zbal's size and the multi-stream variable set), memfabric-zbal 1.2.0's own Python layer over the
simulated native module, and the simulated NPU in every process through an image sitecustomize
chained by the shim's (as torch_npu is on an Ascend image).  Then the refusals, the exit codes, the
time bound, and the decisions a CUDA machine takes, with stand-in device modules.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import types

import pytest

from npu_shim import __main__ as cli
from npu_shim.cli import check, selftest, selftest_child
from npu_shim.patches._selftest import dual_stream_experts as dual_stream_selftest
from npu_shim.patches._selftest import mla_weight_release as mla_selftest
from npu_shim.patches._selftest import zbal as zbal_selftest
from npu_shim.patches._selftest import _synthetic_moe

from shimdev.envs import realsglang

DEFAULT_ZBAL_MIB = zbal_selftest.OPTIONS[0][2]  # --zbal-mib's default

RELEASE = "0.5.9"
ENV = {"SGLANG_ZBAL_LOCAL_MEM_SIZE": "61440", "SGLANG_NPU_USE_MULTI_STREAM": "1",
       "NPU_SHIM_STRICT": None, "NPU_SHIM_ZBAL": None}
# The image's own sitecustomize: the simulated NPU in every process; knobs for the tests.
IMAGE_SITECUSTOMIZE = """\
import atexit, json, os
from shimdev import simnpu
if os.environ.get("SIM_NO_NPU") == "1":
    simnpu.install_without_npu(release=os.environ.get("SIM_RELEASE"))
else:
    # server mode: npu tensors (on the CPU), which the simulated NPU's graphs record
    simnpu.install(release=os.environ.get("SIM_RELEASE"), server=os.environ.get("SIM_HOST_ONLY") != "1")
if os.environ.get("SIM_ZBAL_MIX") == "1":
    from shimdev import simzbal
    simzbal.STATE.mix = True
if os.environ.get("SIM_ZBAL_LOG"):
    def _dump():
        from shimdev import simzbal
        if simzbal.calls():
            with open(os.environ["SIM_ZBAL_LOG"], "w") as handle:
                json.dump({"bootstraps": simzbal.bootstraps(), "mix": simzbal.STATE.mix}, handle, default=str)
    atexit.register(_dump)
"""


def _command(tmp_path, env=None, release=RELEASE, zbal=True):
    image = tmp_path / "image-site"
    image.mkdir(exist_ok=True)
    (image / "sitecustomize.py").write_text(IMAGE_SITECUSTOMIZE)
    if release is None:
        argv = [str(realsglang.release_python(RELEASE))]
        full = realsglang.release_env(dict(ENV, **(env or {})), zbal=zbal)
    else:
        argv, full = realsglang.release_command(release, dict(ENV, **(env or {})), zbal=zbal)
        full["SIM_RELEASE"] = release
    entries = full["PYTHONPATH"].split(os.pathsep)
    full["PYTHONPATH"] = os.pathsep.join(entries[:1] + [str(image)] + entries[1:])
    return argv, full


def selftest_run(tmp_path, *args, env=None, release=RELEASE, zbal=True):
    argv, full = _command(tmp_path, env, release, zbal)
    started = time.monotonic()
    # A generous bound here: this test machine's cores are shared (the 60 s default is tested below).
    proc = subprocess.run(argv + ["-m", "npu_shim", "selftest", "--timeout", "240"] + list(args), env=full,
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    proc.wall = time.monotonic() - started
    return proc


def progress_lines(stderr):
    return [line[len(selftest.PREFIX):] for line in stderr.splitlines() if line.startswith(selftest.PREFIX)]


# -- end to end on the simulated NPU ----------------------------------------------------------------

def test_full_mode_json_every_applied_patch_passes_within_the_bound(release_venv, tmp_path):
    release_venv(RELEASE)
    log = tmp_path / "zbal.json"
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir(mode=0o700)
    proc = selftest_run(tmp_path, "--json", "--zbal-mib", "512",
                        env={"SIM_ZBAL_LOG": str(log), "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["exit"] == 0 and out["refused"] is None and out["error"] is None
    assert out["seconds"] < 240 and out["options"]["timeout"] == 240
    assert out["device"]["kind"] == "npu" and out["device"]["simulated"] is True
    patches = out["patches"]
    assert list(patches) == ["zbal", "mla_weight_release", "dual_stream_experts"]
    assert {n: (p["state"], p["result"]) for n, p in patches.items()} == {
        n: ("applied", "ok") for n in patches}
    # zbal: full mode through the shim's ZbalState, the chosen heap handed to zbal_init
    z = patches["zbal"]["facts"]
    assert (z["mode"], z["heap_mib"], z["backend"], z["shim_capacity_mib"]) == ("full", 512, "pluggable", 512)
    assert z["shim_free_gib"] == z["zbal_free"] / (1 << 30) and z["problems"] == []
    (boot,) = json.loads(log.read_text())["bootstraps"]
    assert (boot["world_size"], boot["rank_id"], boot["device_id"], boot["device_mem_size"]) == (1, 0, 0, 512 << 20)
    # mla: one layer of each public config, the weights' bytes exactly
    m = patches["mla_weight_release"]["facts"]
    for name, c in mla_selftest.MLA_CONFIGS.items():
        nbytes = 2 * ((c["q_lora"] + c["kv_lora"] + c["rope"]) * c["hidden"] + c["heads"] * c["nope"] * c["kv_lora"])
        assert m[name]["bytes"] == m[name]["released"] == m[name]["allocated_drop"] == nbytes
        assert m[name]["touch_raises"] and m[name]["view_kept"] and m[name]["ok"]
    d = patches["dual_stream_experts"]
    assert [f["tokens"] for f in d["facts"]] == list(dual_stream_selftest.SIMULATED_TOKENS)
    assert all(f["equal"] for f in d["facts"]) and "timings are meaningless" in d["line"]
    # a progress line per step, on stderr (stdout is the JSON)
    steps = progress_lines(proc.stderr)
    assert steps[0].startswith("starting the selftest process") and len(steps) >= 10
    # one line per config or size, and one for the graph part
    assert sum(s.startswith("mla_weight_release: ") for s in steps) == len(mla_selftest.MLA_CONFIGS) + 1
    # dual-stream: each size eager, the graph check, then each size captured for the crossover's sweep
    sizes = len(dual_stream_selftest.SIMULATED_TOKENS)
    assert sum(s.startswith("dual_stream_experts: ") for s in steps) == 2 * sizes + 1
    assert "mla_weight_release: DeepSeek-V3 layer: a released weight inside an NPU graph capture, then capture " \
           "and replay" in steps
    assert any(s.startswith("zbal: full mode") for s in steps)
    assert os.listdir(metrics_dir) == []  # the selftest's processes are no servers: no metrics
    # graphs: captured by default, and each step drove its path through a capture and a replay
    graphs = out["graphs"]
    assert graphs["skipped"] is None and graphs["api"]["usable"] and graphs["api"]["auto_dispatch_capture"]
    assert graphs["verdict"].startswith("sglang captures decode graphs")
    pooled = z["graph"].pop("graph_pool")
    assert z["graph"] == {"captured": True, "replayed": True, "equal": True}
    assert ("captured tensors in zbal's graph pool (ZBAL_ENABLE_GRAPH=1)" if pooled else
            "captured tensors UNPOOLED (ZBAL_ENABLE_GRAPH is not 1") in patches["zbal"]["line"]
    assert m["graph"] == {"refused_at_capture": True, "error": "ReleasedWeightError", "captured": True,
                          "replayed": True, "equal": True}
    assert d["facts"][-1]["graph"]["equal"] is True
    assert "output equal to single-stream eager" in d["line"]
    # the crossover: the graph sweep captured and replayed the four arms at each size, not timed here
    assert d["facts"][-1]["crossover"] == {
        "skipped": "the simulated NPU times nothing (the graph sweep captured and replayed at 4, 8 tokens)",
        "graph_sizes": list(dual_stream_selftest.SIMULATED_TOKENS), "graph_equal": True}
    assert d["line"].endswith("crossover: not measured: the simulated NPU times nothing (the graph sweep captured "
                              "and replayed at 4, 8 tokens)")


def test_mix_mode_text_switch_allocation_then_lazy_heap(release_venv, tmp_path):
    release_venv(RELEASE)
    log = tmp_path / "zbal.json"
    proc = selftest_run(tmp_path, env={"SIM_ZBAL_MIX": "1", "SIM_ZBAL_LOG": str(log)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("npu-shim selftest on npu 0 (simulated NPU), 65536 of 65536 MiB free")
    assert "timings and allocator figures are not" in lines[0]
    rows = {line.split()[0]: line for line in lines if line.startswith("  ") and line.split()[0] in
            ("zbal", "mla_weight_release", "dual_stream_experts")}
    assert len(rows) == 3 and all(row.split()[1:3] == ["ok", "applied"] for row in rows.values())
    assert "mix mode: %d MiB heap, allocator backend pluggable" % DEFAULT_ZBAL_MIB in rows["zbal"]
    assert "timings are meaningless on the simulated NPU" in rows["dual_stream_experts"]
    # the heap: one zbal_init, after the switch and the allocation, of in use + the chosen size
    (boot,) = json.loads(log.read_text())["bootstraps"]
    assert boot["device_mem_size"] == DEFAULT_ZBAL_MIB << 20
    steps = progress_lines(proc.stderr)
    order = [i for i, s in enumerate(steps) if s.startswith(("zbal: mix mode: setting", "zbal: mix mode: lazy"))]
    assert len(order) == 2 and order[0] < order[1]
    assert lines[1].startswith("  graphs: sglang captures decode graphs")
    assert lines[2] == "  capture and replay: each step below drives its path through an NPU graph capture and a replay"
    assert all("graph: " in row for row in rows.values()), rows


def test_a_patch_not_applied_here_is_not_exercised(release_venv, tmp_path):
    release_venv(RELEASE)
    proc = selftest_run(tmp_path, "--json", env={"SGLANG_ZBAL_LOCAL_MEM_SIZE": None,
                                                  "SGLANG_NPU_USE_MULTI_STREAM": None})
    assert proc.returncode == 0, proc.stderr[-3000:]
    patches = json.loads(proc.stdout)["patches"]
    assert (patches["zbal"]["state"], patches["zbal"]["result"], patches["zbal"]["line"]) == (
        "inactive", "skipped", "not applied here")
    assert patches["mla_weight_release"]["result"] == "ok"
    assert "zbal" not in " ".join(progress_lines(proc.stderr))  # no zbal process started


def test_refused_with_one_line_when_the_device_has_too_little_free_memory(release_venv, tmp_path):
    release_venv(RELEASE)
    proc = selftest_run(tmp_path, env={"SIMNPU_FREE_MIB": "1000"})
    assert proc.returncode == cli.EXIT_UNAVAILABLE == 5, proc.stderr[-3000:]
    assert proc.stdout == ("npu-shim selftest: refused: npu 0 has 1000 MiB free of 65536 MiB; the "
                           "selftest needs 2048 MiB (is a server using it?)\n")


def test_no_device_exits_5(release_venv, tmp_path):
    release_venv(RELEASE)
    proc = selftest_run(tmp_path, "--json", env={"SIM_NO_NPU": "1"})
    assert proc.returncode == cli.EXIT_UNAVAILABLE == 5, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["device"]["kind"] is None and out["error"] == "no NPU or CUDA device visible to torch"


def test_patch_option_runs_a_step_without_sglang_and_no_sglang_exits_5(release_venv, tmp_path):
    """What a CUDA machine without sglang does (``--patch dual_stream_experts``), on the simulated
    NPU; without ``--patch`` there is nothing to decide: exit 5, as ``check``."""
    release_venv(RELEASE)
    proc = selftest_run(tmp_path, "--json", "--patch", "dual_stream_experts", release=None, zbal=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    patches = json.loads(proc.stdout)["patches"]
    assert patches["dual_stream_experts"]["forced"] and patches["dual_stream_experts"]["result"] == "ok"
    assert patches["zbal"]["line"] == "not decided here (no target module imported)"
    proc = selftest_run(tmp_path, release=None, zbal=False)
    assert proc.returncode == cli.EXIT_UNAVAILABLE == 5
    assert proc.stdout.startswith("npu-shim selftest: no sglang is importable")


def test_sglang_processes_with_a_device_file_open(tmp_path):
    procs = {11: (b"sglang::scheduler_DP0_TP3\0", ["/dev/davinci3", "/dev/null"]),
             12: (b"python3\0-m\0sglang.launch_server\0--model\0m\0", ["/dev/nvidia0"]),
             13: (b"sglang::detokenizer\0", ["/dev/null"]),  # no device open: not a holder
             14: (b"python3\0-m\0npu_shim\0selftest\0", ["/dev/davinci0"]),
             15: (b"sglang::scheduler_TP1\0", ["/dev/nvidiactl"])}
    for pid, (cmdline, files) in procs.items():
        fd = tmp_path / str(pid) / "fd"
        fd.mkdir(parents=True)
        (tmp_path / str(pid) / "cmdline").write_bytes(cmdline)
        for number, target in enumerate(files):
            os.symlink(target, str(fd / str(number)))
    (tmp_path / "self").mkdir()
    assert selftest.sglang_processes(str(tmp_path)) == [
        (11, "sglang::scheduler_DP0_TP3"), (12, "python3 -m sglang.launch_server --model m")]
    assert selftest.holders(proc=str(tmp_path)) == (
        "2 sglang processes on this host hold the device (pid 11, 12: sglang::scheduler_DP0_TP3)")


def test_a_file_name_on_another_user_s_command_line_is_no_server(tmp_path):
    """``tail -f sglang.launch_server.log`` of a user whose descriptors cannot be read (here: an
    ``fd`` that is no directory, as EACCES is for a non-root selftest): before the fix the words
    matched anywhere in the line and the run was refused."""
    procs = {21: b"tail\0-f\0sglang.launch_server.log\0", 22: b"vim\0/srv/sglang/launch_server.py.bak\0",
             23: b"python3\0-m\0sglang.launch_server\0--port\0 1\0",
             24: b"/usr/bin/python3\0/opt/sglang/launch_server.py\0", 25: b"/venv/bin/sglang\0serve\0"}
    for pid, cmdline in procs.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(cmdline)
        (tmp_path / str(pid) / "fd").write_text("")  # listing it fails: assumed to hold the device
    assert [pid for pid, _line in selftest.sglang_processes(str(tmp_path))] == [23, 24, 25]
    assert not check.is_sglang_server(["grep", "sglang.launch_server", "x.log"])
    assert not check.is_sglang_server(["python3", "-m", "sglang.launch_server_wrapper"])
    assert check.is_sglang_server(["python3", "-msglang.launch_server"])


# -- time bound, failures and exit codes -------------------------------------------------------------

def test_a_child_past_the_bound_is_killed_and_the_run_exits_4(monkeypatch):
    monkeypatch.setattr(selftest, "CHILD_CODE", "import sys, time; sys.stdout.write('%sstep one\\n'); "
                        "sys.stdout.flush(); time.sleep(60)" % selftest_child.PROGRESS)
    monkeypatch.setattr(selftest, "TIMEOUT_S", 2)
    monkeypatch.setattr(selftest, "holders", lambda: None)
    seen = []
    started = time.monotonic()
    result = selftest.run({"zbal_mib": 64, "device_index": 0, "patches": []}, log=seen.append)
    assert time.monotonic() - started < 10
    assert result["exit"] == cli.EXIT_PROBLEM == 4
    assert result["error"] == "did not finish within the 2 s bound (at: step one)"
    assert seen[-1] == "step one"
    result = selftest.run({"zbal_mib": 64, "device_index": 0, "patches": [], "timeout": 1})
    assert result["exit"] == 4 and result["error"].startswith("did not finish within the 1 s bound (at: ")
    assert result["seconds"] < 5


def test_a_child_without_a_report_exits_4_with_its_words(monkeypatch):
    monkeypatch.setattr(selftest, "CHILD_CODE", "import sys; sys.stderr.write('ImportError: nothing\\n'); sys.exit(3)")
    monkeypatch.setattr(selftest, "holders", lambda: None)
    result = selftest.run({"zbal_mib": 64, "device_index": 0, "patches": []})
    assert result["exit"] == cli.EXIT_PROBLEM
    assert result["error"] == "the selftest process exited 3 without a report: ImportError: nothing"


def _report(plan, results, alone_next=(), **device):
    return {"stage": "main", "torch_problem": None, "shim_active": True, "sglang": {"path": "/s"},
            "states": {n: {"state": "applied", "reason": "r"} for n in plan},
            "device": dict({"kind": "npu", "name": "n", "simulated": False, "index": 0}, **device),
            "plan": plan, "results": results, "alone_next": list(alone_next)}


def test_a_failed_step_exits_9_and_a_failed_zbal_process_counts(monkeypatch):
    ok = {"result": "ok", "line": "fine", "facts": {}}
    plan = {"zbal": None, "mla_weight_release": None, "dual_stream_experts": None}
    stages = {"main": (_report(plan, {"mla_weight_release": ok, "dual_stream_experts": ok}, alone_next=["zbal"]), None),
              "zbal": (None, "the selftest process exited 1 without a report: ZbalError: boom")}
    monkeypatch.setattr(selftest, "run_stage", lambda stage, *a: stages[stage])
    monkeypatch.setattr(selftest, "holders", lambda: None)
    result = selftest.run({"zbal_mib": 64, "device_index": 0, "patches": []})
    assert result["exit"] == cli.EXIT_PROBLEM
    assert result["patches"]["zbal"]["result"] == "FAILED" and "ZbalError: boom" in result["patches"]["zbal"]["line"]
    stages["zbal"] = ({"results": {"zbal": ok}}, None)
    assert selftest.run({"zbal_mib": 64, "device_index": 0, "patches": []})["exit"] == 0


@pytest.mark.parametrize("report, code", [
    (dict(_report({}, {}), torch_problem={"kind": "cann", "text": "t"}), 4),
    (dict(_report({}, {}), torch_problem={"kind": "torch", "text": "t"}), 4),
    (dict(_report({}, {}), sglang={"path": None}), 5),
    (dict(_report({}, {}), shim_active=False), 4),
    (_report({"zbal": "no device"}, {}, kind=None, name="no NPU or CUDA device visible to torch"), 5),
    (dict(_report({"zbal": None}, {}), refused="npu 0 has 1 MiB free"), 5),
])
def test_exit_codes(monkeypatch, report, code):
    monkeypatch.setattr(selftest, "run_stage", lambda stage, *a: (report, None))
    monkeypatch.setattr(selftest, "holders", lambda: None)
    for name in list(os.environ):
        if name.startswith(("NPU_SHIM_", "SGLANG_")):
            monkeypatch.delenv(name)
    assert selftest.run({"zbal_mib": 64, "device_index": 0, "patches": []})["exit"] == code


def test_bad_variable_and_bad_usage(monkeypatch, capsys):
    monkeypatch.setattr(selftest, "run_stage", lambda *a: pytest.fail("no child for a bad variable"))
    monkeypatch.setenv("NPU_SHIM_STRICTT", "1")
    assert cli.main(["selftest"]) == cli.EXIT_BAD_ENV
    assert capsys.readouterr().out.startswith("npu-shim selftest: an NPU_SHIM_* or SGLANG_* variable")
    monkeypatch.delenv("NPU_SHIM_STRICTT")
    assert cli.main(["selftest", "--patch", "zbla"]) == cli.EXIT_USAGE
    assert "--patch zbla: no such patch (zbal, mla_weight_release, dual_stream_experts)" in capsys.readouterr().err
    assert cli.main(["selftest", "--zbal-mib", "0"]) == cli.EXIT_USAGE
    assert cli.main(["selftest", "--timeout", "0"]) == cli.EXIT_USAGE


def test_a_bundle_that_does_not_match_its_manifest_starts_no_child(monkeypatch):
    from npu_shim.cli import check

    monkeypatch.setattr(check, "bundle_facts", lambda: {"ok": False, "text": "/b: 1 files differ"})
    monkeypatch.setattr(selftest, "run_stage", lambda *a: pytest.fail("a child was started"))
    result = selftest.run({"zbal_mib": 64, "device_index": 0, "patches": []})
    assert result["exit"] == cli.EXIT_PROBLEM
    assert result["error"].endswith("does not match its MANIFEST (/b: 1 files differ)")


def test_exit_codes_are_distinct_and_documented():
    codes = [v for k, v in vars(cli).items() if k.startswith("EXIT_")]
    assert len(codes) == len(set(codes))
    assert (cli.EXIT_PROBLEM, cli.EXIT_UNAVAILABLE) == (4, 5)
    assert selftest.TIMEOUT_S == 60 and cli.main(["selftest", "--help"]) == 0
    # the one list of exit codes (tests/test_readme.py holds it to the EXIT_* constants)
    doc = open(os.path.join(realsglang.REPO, "docs", "operations.md")).read()
    rows = {int(line.split("|")[1]): line for line in doc.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip().isdigit()}
    for code, words in ((4, "(`selftest`) a step failed on the device"), (5, "(`selftest`) no NPU or CUDA device"),
                        (5, "the device is busy"), (2, "`selftest` then starts nothing")):
        assert words in rows[code], rows[code]


# -- CUDA and the device-agnostic parts, with stand-in device modules --------------------------------

def test_plan_on_cuda_npu_and_without_a_device():
    applied = {n: {"state": "applied"} for n in ("zbal", "mla_weight_release", "dual_stream_experts")}
    assert selftest_child.plan(applied, "cuda") == {
        "zbal": "n/a on cuda", "mla_weight_release": "n/a on cuda", "dual_stream_experts": None}
    assert selftest_child.plan(applied, "npu") == dict.fromkeys(applied)
    assert set(selftest_child.plan(applied, None).values()) == {"no device"}
    inactive = dict(applied, zbal={"state": "inactive"})
    assert selftest_child.plan(inactive, "npu")["zbal"] == "not applied here"
    assert selftest_child.plan({}, "cuda", forced=("dual_stream_experts",)) == {
        "zbal": "not decided here (no target module imported)",
        "mla_weight_release": "not decided here (no target module imported)", "dual_stream_experts": None}
    assert selftest_child.need_mib(["zbal"], {"zbal_mib": 1024}) == 1536
    assert selftest_child.need_mib(["dual_stream_experts"], {"zbal_mib": 1024}) == 2048


def _module(available, name="dev", count=1, simulated=False):
    module = types.SimpleNamespace(is_available=lambda: available, device_count=lambda: count,
                                   get_device_name=lambda index=0: name)
    if simulated:
        module.__simnpu__ = True
    return module


def test_find_device_prefers_the_npu_then_cuda():
    cuda = _module(True, "NVIDIA H200")
    assert selftest_child.find_device(types.SimpleNamespace(npu=None, cuda=cuda)) == ("cuda", "NVIDIA H200", False)
    both = types.SimpleNamespace(npu=_module(True, "Ascend910B3"), cuda=cuda)
    assert selftest_child.find_device(both) == ("npu", "Ascend910B3", False)
    sim = types.SimpleNamespace(npu=_module(True, simulated=True), cuda=_module(False))
    assert selftest_child.find_device(sim) == ("npu", "simulated NPU", True)
    none = types.SimpleNamespace(npu=_module(True, count=0), cuda=_module(False))
    assert selftest_child.find_device(none) == (None, "no NPU or CUDA device visible to torch", False)


class _Event:
    """torch.cuda.Event's timing interface: elapsed_time in ms between two recorded events."""
    clock = [0.0]

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self, stream=None):
        self.at = self.clock[0]

    def synchronize(self):
        assert self.at is not None

    def elapsed_time(self, end):
        return end.at - self.at


def test_sample_ms_reads_device_events_and_falls_back_to_the_wall_clock():
    dm = types.SimpleNamespace(Event=_Event, synchronize=lambda: None)

    def work():
        _Event.clock[0] += 3.0  # 3 ms of device time per call

    assert _synthetic_moe.sample_ms(work, dm, 4) == 3.0
    wall = _synthetic_moe.sample_ms(lambda: time.sleep(0.01), types.SimpleNamespace(synchronize=lambda: None), 2)
    assert 9.0 <= wall < 200.0


def test_summarise_the_share_of_the_ideal_saving():
    r = _synthetic_moe.summarise({"serial": 10.0, "serial_again": 10.0, "overlapped": 7.0, "ideal": 6.0})
    assert (r["serial_median"], r["possible"], r["fraction"]) == (10.0, 4.0, 0.75)
    zero = {"serial": 0.0, "serial_again": 0.0, "overlapped": 0.0, "ideal": 0.0}
    assert _synthetic_moe.summarise(zero)["fraction"] is None


def test_the_synthetic_block_s_two_routed_paths_compute_the_same_sums():
    """``masked`` (every expert over every token, weighted; no host wait) stands in for
    ``per-expert`` (each expert's own tokens) in the device sweep: the same MoE, so the same output
    up to float rounding; any other name is refused before a block is built."""
    import torch

    small = dict(_synthetic_moe.DEFAULTS, tokens=12, hidden=16, shared_inter=24, experts=4, topk=2,
                 expert_inter=8)
    hidden = torch.randn(12, 16, generator=torch.Generator().manual_seed(3))
    batch = types.SimpleNamespace(num_token_non_padded=None)
    out = {}
    for routed in _synthetic_moe.ROUTED:
        # the same seed, so the same weights for both
        block = _synthetic_moe.build_block("cpu", torch.float64, dict(small, routed=routed))
        with torch.no_grad():
            out[routed] = _synthetic_moe.serial_forward(block, hidden.double(), batch)
            routed_part = _synthetic_moe.routed_only(block, hidden.double(), batch)
        assert routed_part.abs().max() > 0  # the routed experts contribute: not a vacuous equality
    torch.testing.assert_close(out["masked"], out["per-expert"], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="routed must be one of per-expert, masked, not 'dense'"):
        _synthetic_moe.build_block("cpu", torch.float64, dict(small, routed="dense"))


def _step(torch, dm, device, **options):
    """What selftest_child hands a patch's ``run(step)`` on a (stand-in) device, index 0."""
    return types.SimpleNamespace(torch=torch, kind=device.split(":")[0], dm=dm, device=device, index=0,
                                 simulated=False, options=options, progress=lambda text: None,
                                 record=lambda: None, graphs="graph capture is an NPU's here")


def test_dual_stream_step_on_a_device_reports_times_and_the_target(monkeypatch):
    import torch

    fake = dict(serial_median=10.0, overlapped=6.4, shared=4.0, routed=6.0, ideal=6.0, possible=4.0,
                fraction=0.9, equal=True)
    monkeypatch.setattr(_synthetic_moe, "measure", lambda device, device_module, **p: dict(fake, tokens=p["tokens"]))
    ok, line, facts = dual_stream_selftest.run(_step(torch, None, "cuda:0"))
    assert ok and [f["tokens"] for f in facts] == list(_synthetic_moe.SELFTEST_TOKENS)
    assert line.startswith("256 tokens: serial 10.000 ms, overlapped 6.400 ms, saving 90 % of the ideal "
                           "(serial - max(shared, routed) = 4.000 ms)")
    assert line.endswith("outputs equal to single-stream: yes; target >= 90 % of the ideal saving: met; "
                         "crossover: not measured: the device is cuda, not an NPU (scripts/device_check.sh "
                         "measures it there)")
    assert facts[-1]["crossover"] == {"skipped": "the device is cuda, not an NPU (scripts/device_check.sh "
                                                 "measures it there)"}
    fake.update(equal=False, fraction=0.5)
    ok, line, _ = dual_stream_selftest.run(_step(torch, None, "cuda:0"))
    assert not ok and "outputs DIFFER" in line and "saving: not met; crossover: not measured" in line


def _timed(serial, overlapped, equal=True):
    return dict(serial=serial, serial_again=serial, overlapped=overlapped, shared=overlapped / 2,
                routed=overlapped / 2, ideal=overlapped / 2, equal=equal)


def test_dual_stream_step_on_an_npu_reports_the_crossover_measured_there(monkeypatch):
    """On an NPU (not simulated) with the graph API the step's line ends with the crossover of
    its own sizes, eager and under graph replay (the graph sweep captures each size, masked)."""
    import torch

    eager = {256: (1.0, 1.5), 1024: (2.0, 1.8), 4096: (8.0, 6.0)}      # wins from 1024
    graph = {256: (0.5, 0.6), 1024: (1.5, 1.6), 4096: (6.0, 4.5)}      # wins from 4096
    seen = []
    monkeypatch.setattr(_synthetic_moe, "measure", lambda device, device_module, **p: _synthetic_moe.summarise(
        dict(_timed(*eager[p["tokens"]]), params=p)))

    def measure_graph(device, device_module, **p):
        seen.append((device, p["tokens"], p["routed"]))
        return _synthetic_moe.summarise(dict(_timed(*graph[p["tokens"]]), params=p))

    monkeypatch.setattr(_synthetic_moe, "measure_graph", measure_graph)
    monkeypatch.setattr(dual_stream_selftest, "_graph_part", lambda step, shape, tokens: {
        "ok": True, "text": "graph: checked", "facts": {}})
    step = dict(vars(_step(torch, None, "npu:0")), graphs=None, graph_device="npu:0")
    ok, line, facts = dual_stream_selftest.run(types.SimpleNamespace(**step))
    assert ok, line
    assert seen == [("npu:0", t, "masked") for t in _synthetic_moe.SELFTEST_TOKENS]
    assert line.endswith(
        "crossover on this NPU: graph replay (masked routed, the production mode) from 4096 tokens: two streams "
        "win from there up to 4096, lose below (256-4096 tokens); eager (per-expert) from 1024 tokens: two streams "
        "win from there up to 4096, lose below (256-4096 tokens); SGLANG_NPU_USE_MULTI_STREAM=1 pays where batches "
        "reach it"), line
    cross = facts[-1]["crossover"]
    assert cross["graph"]["verdict"] == "from" and cross["graph"]["tokens"] == 4096
    assert cross["eager"]["tokens"] == 1024 and cross["left"] == []
    assert cross["graph_sizes"][256] == {"serial_median": 0.5, "overlapped": 0.6,
                                        "fraction": pytest.approx(-0.5), "equal": True}
    # the sweep stops past its budget: what it measured gives the crossover, the rest is named
    seen.clear()
    monkeypatch.setattr(dual_stream_selftest, "CROSSOVER_BUDGET_S", -1.0)
    ok, line, facts = dual_stream_selftest.run(types.SimpleNamespace(**step))
    assert seen == [("npu:0", 256, "masked")]
    assert "graph replay (masked routed, the production mode) never: two streams lose at 256 tokens, the largest " \
           "measured (256 tokens) (not measured past -1 s: 1024, 4096 tokens)" in line
    # a graph sweep that raises: said in the line, the step still judged by its checks
    monkeypatch.setattr(dual_stream_selftest, "CROSSOVER_BUDGET_S", 15.0)
    monkeypatch.setattr(_synthetic_moe, "measure_graph", lambda *a, **p: 1 / 0)
    ok, line, facts = dual_stream_selftest.run(types.SimpleNamespace(**step))
    assert ok and "graph replay (masked routed, the production mode) not measured (the graph sweep raised " \
                  "ZeroDivisionError: division by zero); eager (per-expert) from 1024 tokens" in line
    # an NPU without the graph API: eager only, the graph part says why
    step["graphs"] = "torch_npu's graph API is missing here"
    ok, line, facts = dual_stream_selftest.run(types.SimpleNamespace(**step))
    assert "graph replay (masked routed, the production mode) not measured (torch_npu's graph API is missing " \
           "here); eager (per-expert) from 1024 tokens" in line and "graph" not in facts[-1]["crossover"]


def test_the_crossover_of_a_sweep():
    def pts(*pairs):
        return [dict(tokens=t, serial_median=s, overlapped=o) for t, s, o in pairs]

    always = _synthetic_moe.crossover(pts((512, 2, 1), (2048, 2, 1)))
    assert always == {"verdict": "always", "tokens": 512,
                      "text": "always: two streams win at every size measured (512-2048 tokens)"}
    assert _synthetic_moe.crossover(pts((2048, 1, 2), (512, 2, 1), (8192, 3, 2)))["tokens"] == 8192  # sorted first
    never = _synthetic_moe.crossover(pts((512, 1, 2), (2048, 2, 1), (8192, 1, 1)))  # a tie is no win
    assert never["verdict"] == "never" and never["tokens"] is None
    assert never["text"] == ("never: two streams lose at 8192 tokens, the largest measured (512-8192 tokens); "
                             "they win at 2048 only")
    assert _synthetic_moe.crossover([])["verdict"] == "not measured"


class _StuckAllocator:
    """A device module whose allocator never gives memory back (what the step must catch)."""

    def __init__(self):
        self.calls = []

    def synchronize(self):
        pass

    def memory_allocated(self, index):
        return 1 << 30

    def memory_reserved(self, index):
        return 1 << 30

    def empty_cache(self):
        self.calls.append("empty_cache")


def test_mla_step_fails_when_memory_does_not_drop():
    import torch

    dm = _StuckAllocator()
    ok, line, facts = mla_selftest.run(_step(torch, dm, "cpu"))
    assert not ok and "MISMATCH" in line and dm.calls  # empty_cache before each reserved figure
    configs = [facts[name] for name in mla_selftest.MLA_CONFIGS]
    assert all(f["released"] == f["bytes"] and f["allocated_drop"] == 0 for f in configs)
    assert all(f["touch_raises"] and f["view_kept"] for f in configs)


def test_the_bench_row_and_the_selftest_share_one_measurement():
    from shimdev.bench import dual_stream_bench

    assert dual_stream_bench._synthetic_moe is _synthetic_moe
    assert dual_stream_bench.build_block is _synthetic_moe.build_block
    (row,) = dual_stream_bench.rows("cpu", tokens=8, hidden=16, shared_inter=16, experts=4, topk=2,
                                    expert_inter=8, samples=1, reps=1, warmup=1)
    assert "outputs equal: True" in row["measured"] and row["ok"] is None


class _CudaLike:
    """A stand-in for ``torch.cuda`` on CPU: the stream and event calls the measurement and the
    shim's dual-stream body make, recorded (each name and keyword is torch.cuda's, checked below)."""

    def __init__(self):
        self.calls, self.clock = [], [0.0]
        self.main = self.Stream("main")
        self.stack = [self.main]

    def Stream(self, name=None):  # noqa: N802 - torch.cuda.Stream
        module = self

        class Stream:
            def __init__(self):
                self.name = name or "side-%d" % len([c for c in module.calls if c[0] == "stream"])
                module.calls.append(("stream", self.name))

            def wait_stream(self, other):
                module.calls.append(("wait_stream", self.name, other.name))

        return Stream()

    def current_stream(self):
        return self.stack[-1]

    def stream(self, stream):
        import contextlib

        @contextlib.contextmanager
        def on():
            self.stack.append(stream)
            self.clock[0] += 1.0
            try:
                yield
            finally:
                self.stack.pop()
        return on()

    def Event(self, enable_timing=False):  # noqa: N802 - torch.cuda.Event
        module = self

        class Event:
            def record(self, stream=None):
                self.at = module.clock[0]
                module.calls.append(("record", enable_timing))

            def synchronize(self):
                pass

            def elapsed_time(self, end_event):
                return end_event.at - self.at

        return Event()

    def synchronize(self):
        self.calls.append(("synchronize",))


def test_measure_through_a_cuda_like_module_uses_its_streams_and_timing_events():
    import inspect

    import torch

    for name in ("Stream", "Event", "current_stream", "stream", "synchronize", "mem_get_info",
                 "memory_allocated", "memory_reserved", "empty_cache", "set_device", "get_device_name"):
        assert hasattr(torch.cuda, name), name  # what the selftest calls on torch.cuda exists
    assert "enable_timing" in inspect.signature(torch.cuda.Event.__new__).parameters
    assert list(inspect.signature(torch.cuda.Event.elapsed_time).parameters) == ["self", "end_event"]
    cuda = _CudaLike()
    real_get = torch.get_device_module
    r = _synthetic_moe.measure("cpu", device_module=cuda, tokens=8, hidden=16, shared_inter=16, experts=4,
                              topk=2, expert_inter=8, samples=2, reps=2, warmup=1)
    assert torch.get_device_module is real_get  # put back
    assert r["equal"] is True
    # one side stream, made by the device module; it waits for main, main waits for it
    assert [c for c in cuda.calls if c[0] == "stream"] == [("stream", "main"), ("stream", "side-1")]
    assert ("wait_stream", "side-1", "main") in cuda.calls and ("wait_stream", "main", "side-1") in cuda.calls
    records = [c for c in cuda.calls if c[0] == "record"]
    assert records and all(timing for _, timing in records)  # every event is a timing event
    # the clock moves only where the side stream is entered: the overlapped runs alone show time
    assert r["overlapped"] == 1.0 and r["serial"] == r["shared"] == r["routed"] == 0.0


def test_the_selftest_needs_nothing_from_dev_and_its_parent_no_torch():
    """The shim ships without dev/: its selftest modules import nothing from there; the parent's
    modules import no torch at load (only the children do)."""
    code = ("import sys; from npu_shim.cli import selftest, selftest_child; "
            "from npu_shim.patches._selftest import dual_stream_experts, mla_weight_release, _synthetic_moe, zbal; "
            "print(sorted(n for n in ('torch', 'wrapt', 'shimdev') if n in sys.modules))")
    env = {"PYTHONPATH": str(realsglang.REPO), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd="/", capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    for name in ("cli/selftest.py", "cli/selftest_child.py", "patches/_selftest/_synthetic_moe.py",
                 "patches/_selftest/zbal.py", "patches/_selftest/mla_weight_release.py",
                 "patches/_selftest/dual_stream_experts.py"):
        with open(os.path.join(realsglang.REPO, "npu_shim", name), encoding="utf-8") as handle:
            assert not re.search(r"^\s*(from|import)\s+shimdev", handle.read(), re.M), name


# -- the children: bytes, process groups, malformed reports, options out of range -----------------

STRAY_BYTES = """
import sys
sys.stdout.buffer.write(%r.encode() + b"at \\xff\\n"); sys.stdout.flush()
sys.stderr.buffer.write(b"\\xfe" * 200000); sys.stderr.flush()
sys.stdout.write("\\n" + %r + '{"stage": "main"}\\n')
"""


def test_bytes_that_are_not_utf8_in_the_child_s_output_keep_its_report(monkeypatch):
    """Before the fix the reader thread died on the first byte that is no UTF-8: "exited 0 without
    a report", or a child blocked on a full stderr pipe and called a timeout (exit 4 either way)."""
    monkeypatch.setattr(selftest, "CHILD_CODE", STRAY_BYTES % (selftest_child.PROGRESS, selftest_child.MARK))
    seen = []
    report, error = selftest.run_stage("main", {}, time.monotonic() + 60, seen.append)
    assert (report, error) == ({"stage": "main"}, None)
    assert seen == ["at \\xff"]


def test_a_malformed_report_line_is_one_line_and_exit_4(monkeypatch):
    """Before the fix: a JSONDecodeError traceback."""
    monkeypatch.setattr(selftest, "holders", lambda: None)
    for line in ('{"stage": ', "[1]"):
        monkeypatch.setattr(selftest, "CHILD_CODE", "print(%r)" % (selftest_child.MARK + line))
        result = selftest.run({"zbal_mib": 64, "device_index": 0, "patches": []})
        assert result["exit"] == cli.EXIT_PROBLEM
        assert result["error"].startswith("the selftest process exited 0 with a malformed report line")


GRANDCHILD = """
import os, subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(%r, "w") as handle:
    handle.write(str(grandchild.pid))
sys.stdout.write(%r + "waiting\\n"); sys.stdout.flush()
time.sleep(120)
"""


from test_children import alive as _alive  # noqa: E402 - one /proc reader for the cli tests


def test_a_timed_out_child_is_killed_with_its_own_children(monkeypatch, tmp_path):
    """The child leads its own process group, killed whole: before the fix a timed-out selftest
    left the child's children running."""
    pid_file = tmp_path / "grandchild.pid"
    monkeypatch.setattr(selftest, "CHILD_CODE", GRANDCHILD % (str(pid_file), selftest_child.PROGRESS))
    report, error = selftest.run_stage("main", {}, time.monotonic() + 3, lambda line: None, 3)
    assert report is None and error == "did not finish within the 3 s bound (at: waiting)"
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5  # the group's SIGKILL is sent; the kernel ends it just after
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


@pytest.mark.parametrize("args, words", [
    (["--timeout", str(10 ** 400)], "--timeout at most 86400"),
    (["--timeout", "86401"], "--timeout at most 86400"),
    (["--device-index", str(10 ** 400)], "--device-index one of 0 or more"),
])
def test_numbers_out_of_range_are_usage_errors(monkeypatch, capsys, args, words):
    """``--timeout 10**400``: before the fix an OverflowError traceback."""
    monkeypatch.setattr(selftest, "run_stage", lambda *a: pytest.fail("no child for bad usage"))
    assert cli.main(["selftest"] + args) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


def test_a_device_index_past_the_devices_is_a_usage_error(monkeypatch):
    """``--device-index 5`` on a one-device node: the child says so in its report (before the fix a
    traceback from the child's memory query, exit 4)."""
    class Torch:
        class npu:
            __simnpu__ = True

            @staticmethod
            def device_count():
                return 1

            @staticmethod
            def mem_get_info(index):
                raise AssertionError("asked about device %d" % index)

        @classmethod
        def get_device_module(cls, kind):
            return cls.npu

    monkeypatch.setattr(selftest_child, "find_device", lambda torch: ("npu", "simulated NPU", True))
    from npu_shim.cli import check

    monkeypatch.setattr(check, "import_target_modules", lambda: {})
    monkeypatch.setitem(sys.modules, "torch", Torch)
    from npu_shim.runtime import activation

    monkeypatch.setattr(activation, "RUNTIME", types.SimpleNamespace(  # the runtime as zbal's decision left it
        states=lambda: {"zbal": {"state": "applied", "reason": "r"}}))
    watcher = types.SimpleNamespace(activates_the_shim=lambda: True)  # armed at start-up, sglang seen
    report = selftest_child.stage_main({"device_index": 5, "patches": ["zbal"], "zbal_mib": 64}, watcher)
    assert report["bad_index"] == "--device-index 5: torch sees 1 npu device here (0)"
    monkeypatch.setattr(selftest, "run_stage", lambda *a: (dict(_report({"zbal": None}, {}), bad_index="b"), None))
    monkeypatch.setattr(selftest, "holders", lambda: None)
    result = selftest.run({"zbal_mib": 64, "device_index": 5, "patches": []})
    assert (result["exit"], result["error"]) == (cli.EXIT_USAGE, "b")


NO_TORCH = "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n"


def test_a_python_without_torch_is_one_line_and_exit_4(tmp_path):
    """Before the fix the child's ModuleNotFoundError traceback, then exit 4 (``check`` answers the
    same Python in one line).  ``torch`` here is a package whose import fails as a missing one."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(NO_TORCH)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPU_SHIM_", "SGLANG_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), REPO_ROOT])
    proc = subprocess.run([sys.executable, "-m", "npu_shim", "selftest"], env=env, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == cli.EXIT_PROBLEM, proc.stdout + proc.stderr
    assert proc.stdout.startswith(selftest.PREFIX + "torch is not installed in this Python (")
    assert proc.stdout.count("\n") == 1 and "Traceback" not in proc.stdout + proc.stderr


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_sigterm_ends_selftest_with_its_children_gone(tmp_path):
    """SIGTERM to the command: one line, exit 143, and the child's process group is gone."""
    import signal

    script = tmp_path / "wrapper.py"
    script.write_text(
        "import sys\nfrom npu_shim.cli import selftest\n"
        "selftest.holders = lambda: None\n"
        "selftest.CHILD_CODE = %r\n"
        "from npu_shim.__main__ import main\nsys.exit(main(['selftest']))\n"
        % (GRANDCHILD % (str(tmp_path / "grandchild.pid"), selftest_child.PROGRESS)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPU_SHIM_", "SGLANG_"))}
    env["PYTHONPATH"] = REPO_ROOT
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    line = ""
    while "waiting" not in line and time.monotonic() < deadline:
        line = proc.stderr.readline()
    assert "waiting" in line
    child = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == proc.pid]
    assert child
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err
    assert err.splitlines()[-1] == "npu-shim selftest: stopped by SIGTERM; its child process groups are gone"
    assert "Traceback" not in err
    assert not _alive(child[0]) and not _alive(int((tmp_path / "grandchild.pid").read_text()))


def _ppid(pid):
    try:
        with open("/proc/%d/stat" % pid) as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


# -- property: whatever another process's command line is -------------------------------------------

from hypothesis import given, strategies as st  # noqa: E402 - the property tests' imports, beside them


@given(argv=st.lists(st.one_of(st.text(max_size=30), st.sampled_from(
    ["-m", "sglang.launch_server", "sglang.launch_server.log", "sglang", "serve", "tail", "-f",
     "sglang::scheduler_TP0", "/opt/sglang/launch_server.py"])), max_size=6),
       data=st.binary(max_size=120))
def test_any_command_line_is_read_without_an_exception(argv, data, tmp_path_factory):
    """A /proc entry's cmdline is anything its process wrote into its own argv."""
    assert check.is_sglang_server(argv) in (True, False)
    if not any(a == "-m" for a in argv) and not any("launch_server.py" in a or a.startswith("sglang::")
                                                    or a == "-msglang.launch_server" or
                                                    os.path.basename(a) == "sglang" for a in argv):
        assert not check.is_sglang_server(argv)
    proc = tmp_path_factory.mktemp("proc")
    (proc / "7").mkdir()
    (proc / "7" / "cmdline").write_bytes(data)
    (proc / "7" / "fd").write_text("")
    found = selftest.sglang_processes(str(proc))
    assert found in ([], [(7, found[0][1] if found else None)])


def test_a_stop_signal_while_the_stage_readers_are_made_finds_the_child_killed():
    """Before the fix ``run_stage`` made its reader threads between starting the child and its
    ``try``: a signal there left the selftest child running on the device."""
    from test_children import sigterm_while_a_child_starts

    call = "from npu_shim.cli import selftest; selftest.run_stage('main', {}, 1e12, print)"
    assert sigterm_while_a_child_starts("readers", call) == {"caught": ["SIGTERM", 143], "child": -signal.SIGKILL}


# -- the steps through an NPU graph capture and a replay ---------------------------------------------

class _NpuLike(_CudaLike):
    """``_CudaLike`` with torch_npu's graph API: a capture records the aten ops run while it is
    live (a dispatch mode) on the capture stream, ``replay`` runs them again on the same tensors
    and runs no Python of the caller's -- what a replay does.  A host read (``item``,
    ``nonzero``) while capturing is refused, as CANN refuses it."""

    HOST_READS = ("aten._local_scalar_dense", "aten.nonzero")

    def __init__(self):
        super().__init__()
        self.capturing = False
        self.graphs = []

    def graph_pool_handle(self):
        self.calls.append(("graph_pool_handle",))
        return (0, 1)

    def is_current_stream_capturing(self):
        return self.capturing

    def NPUGraph(self):  # noqa: N802 - torch.npu.NPUGraph
        module = self

        class NPUGraph:
            def __init__(self):
                self.ops, self.reset_calls = None, 0
                module.graphs.append(self)

            def replay(self):
                import torch

                assert self.ops is not None, "Called NPUGraph::replay without a preceding successful capture."
                module.calls.append(("replay",))
                for func, args, kwargs, out in self.ops:
                    result = func(*args, **kwargs)
                    outs = out if isinstance(out, (tuple, list)) else (out,)
                    results = result if isinstance(result, (tuple, list)) else (result,)
                    for old, new in zip(outs, results):
                        if isinstance(old, torch.Tensor) and new is not old:
                            old.copy_(new)

            def reset(self):
                self.reset_calls += 1

        return NPUGraph()

    def graph(self, npu_graph, pool=None, stream=None, auto_dispatch_capture=False, capture_error_mode="global"):
        import contextlib

        from torch.utils._python_dispatch import TorchDispatchMode

        module = self

        class Recorder(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if str(func).startswith(module.HOST_READS):
                    raise RuntimeError("host read during capture: %s" % func)
                out = func(*args, **kwargs)
                npu_graph.ops.append((func, args, kwargs, out))
                return out

        @contextlib.contextmanager
        def capture():
            assert stream is not None and stream is not module.main, "captured on the default stream"
            module.calls.append(("capture_begin", pool, auto_dispatch_capture))
            npu_graph.ops = []
            module.capturing = True
            module.stack.append(stream)
            try:
                with Recorder():
                    yield
            finally:
                module.stack.pop()
                module.capturing = False
                module.calls.append(("capture_end",))

        return capture()


def _graph_step(torch, dm, graphs=None):
    return types.SimpleNamespace(torch=torch, kind="npu", dm=dm, device="cpu", index=0, simulated=True,
                                 options={}, progress=lambda text: None, record=lambda: None, graphs=graphs,
                                 graph_device="cpu")


def test_the_npu_stand_in_replays_what_it_captured_and_nothing_else():
    """The stand-in the graph tests below stand on: a replay recomputes the captured ops on the
    refreshed inputs, and Python run during the capture is not run again."""
    import torch

    from npu_shim.patches._selftest import _graphs

    dm, ran = _NpuLike(), []

    def fn(x):
        ran.append(1)
        return x * 2 + 1

    equal, facts = _graphs.capture_and_replay(_graph_step(torch, dm), fn, [torch.ones(4)], [torch.full((4,), 3.0)])
    assert equal and facts == {"captured": True, "replayed": True, "equal": True}
    assert len(ran) == 4  # two warm-ups, the capture, the eager reference: the replay ran none
    assert [c[0] for c in dm.calls if c[0] in ("graph_pool_handle", "capture_begin", "capture_end", "replay")] == [
        "graph_pool_handle", "capture_begin", "capture_end", "replay"]
    assert ("capture_begin", (0, 1), True) in dm.calls and dm.graphs[0].reset_calls == 1
    # what Python decided while capturing is what the replay does: here a count of the calls
    calls = []

    def counted(x):
        calls.append(1)
        return x + len(calls)

    equal, _ = _graphs.capture_and_replay(_graph_step(torch, dm), counted, [torch.ones(4)], [torch.ones(4)])
    assert not equal and len(calls) == 4


def test_a_refusal_inside_a_capture_ends_it_and_resets_the_graph():
    import torch

    from npu_shim.patches._selftest import _graphs

    dm = _NpuLike()
    refused, facts = _graphs.refused_at_capture(_graph_step(torch, dm), lambda x: x.sum().item(), [torch.ones(4)],
                                                RuntimeError)
    assert refused and facts == {"refused_at_capture": True, "error": "RuntimeError"}
    assert dm.calls[-2:] == [("capture_end",), ("synchronize",)] and dm.graphs[0].reset_calls == 1
    refused, facts = _graphs.refused_at_capture(_graph_step(torch, dm), lambda x: x * 2, [torch.ones(4)], RuntimeError)
    assert not refused and facts["error"] is None


def test_dual_stream_step_captures_its_side_stream_and_replays_equal_to_single_stream():
    import torch

    dm = _NpuLike()
    ok, line, facts = dual_stream_selftest.run(_graph_step(torch, dm))
    assert ok, line
    assert facts[-1]["graph"] == {"captured": True, "replayed": True, "equal": True,
                                  "tokens": dual_stream_selftest.SIMULATED_TOKENS[-1]}
    assert "graph: %d tokens captured and replayed, output equal to single-stream eager" % (
        dual_stream_selftest.SIMULATED_TOKENS[-1]) in line
    # the side stream was made inside the capture (the capture stream is a new main) and joined both ways
    begin = dm.calls.index(("capture_begin", (0, 1), True))
    end = dm.calls.index(("capture_end",))
    inside = dm.calls[begin:end]
    (made,) = [c[1] for c in inside if c[0] == "stream"][-1:]
    assert any(c[0] == "wait_stream" and c[1] == made for c in inside)   # the side stream waits for main
    assert any(c[0] == "wait_stream" and c[2] == made for c in inside)   # main waits for the side stream
    # the crossover's graph sweep ran too (each arm captured and replayed at each size), untimed here
    sizes = list(dual_stream_selftest.SIMULATED_TOKENS)
    assert facts[-1]["crossover"] == {
        "skipped": "the simulated NPU times nothing (the graph sweep captured and replayed at 4, 8 tokens)",
        "graph_sizes": sizes, "graph_equal": True}
    assert line.endswith("crossover: not measured: the simulated NPU times nothing (the graph sweep captured and "
                         "replayed at 4, 8 tokens)")
    assert sum(1 for c in dm.calls if c == ("capture_begin", None, False)) == 4 * len(sizes)


def test_dual_stream_step_fails_when_a_graph_replay_of_the_sweep_differs(monkeypatch):
    import torch

    real = _synthetic_moe.measure_graph
    monkeypatch.setattr(_synthetic_moe, "measure_graph", lambda *a, **p: dict(real(*a, **p), equal=False))
    ok, line, facts = dual_stream_selftest.run(_graph_step(torch, _NpuLike()))
    assert not ok and facts[-1]["crossover"]["graph_equal"] is False


def test_dual_stream_graph_part_fails_the_step_when_the_replay_differs(monkeypatch):
    import torch

    monkeypatch.setattr(_synthetic_moe, "graph_check", lambda step, **p: (False, {"equal": False}))
    ok, line, facts = dual_stream_selftest.run(_graph_step(torch, _NpuLike()))
    assert not ok and "output DIFFERS from single-stream eager" in line


def test_steps_say_why_graphs_were_not_exercised():
    import torch

    step = _graph_step(torch, _NpuLike(), graphs="torch_npu's graph API is missing here (none present of x)")
    ok, line, facts = dual_stream_selftest.run(step)
    assert ok and line.count("graphs: not exercised (torch_npu's graph API is missing here") == 1
    assert facts[-1]["graph"] == {"skipped": step.graphs}
    ok, line, facts = mla_selftest.run(step)
    assert ok and "graphs: not exercised" in line and facts["graph"] == {"skipped": step.graphs}


def test_mla_step_refuses_a_released_weight_inside_a_capture_and_replays_a_kept_one():
    import torch

    dm = _NpuLike()
    ok, line, facts = mla_selftest.run(_graph_step(torch, dm))
    assert ok, line
    assert facts["graph"] == {"refused_at_capture": True, "error": "ReleasedWeightError", "captured": True,
                              "replayed": True, "equal": True}
    assert "graph: a released weight refused inside a capture; the kept qkv_a weight's projection captured " \
           "and replayed, output equal to eager" in line
    assert [c[0] for c in dm.calls if c[0] in ("capture_begin", "capture_end", "replay")] == [
        "capture_begin", "capture_end", "capture_begin", "capture_end", "replay"]


def test_mla_graph_part_fails_when_a_released_weight_is_not_refused(monkeypatch):
    import torch

    from npu_shim.patches._selftest import _graphs

    monkeypatch.setattr(_graphs, "refused_at_capture", lambda *a: (False, {"refused_at_capture": False}))
    ok, line, _ = mla_selftest.run(_graph_step(torch, _NpuLike()))
    assert not ok and "a released weight NOT refused inside a capture" in line


@pytest.mark.parametrize("kind, dm, words", [
    ("cuda", object(), "graph capture is an NPU's here; the device is cuda"),
    ("npu", types.SimpleNamespace(graph=lambda *a: None),
     "torch_npu's graph API is missing here (graph present of graph, NPUGraph, graph_pool_handle, "
     "is_current_stream_capturing)"),
    ("npu", _NpuLike(), None)])
def test_graphs_are_driven_where_the_device_is_an_npu_with_the_graph_api(kind, dm, words):
    import inspect

    assert "auto_dispatch_capture" in inspect.signature(_NpuLike.graph).parameters
    if isinstance(dm, _NpuLike):  # an instance's bound methods are no classes: as torch_npu, graph is one
        dm = types.SimpleNamespace(graph=type("graph", (), {"__init__": lambda self, g, pool=None, stream=None,
                                                                       auto_dispatch_capture=False: None,
                                                             "__enter__": lambda self: self,
                                                             "__exit__": lambda self, *e: False}),
                                   NPUGraph=type("NPUGraph", (), {"replay": lambda self: None}),
                                   graph_pool_handle=dm.graph_pool_handle,
                                   is_current_stream_capturing=dm.is_current_stream_capturing)
    assert selftest_child.graphs_skipped(kind, dm) == words


def test_the_selftest_output_says_whether_graphs_are_captured_and_exercised():
    lines = []
    result = {"refused": None, "error": None, "seconds": 1.0, "device": {"kind": "npu", "index": 0, "name": "x"},
              "patches": {}, "graphs": {"text": "sglang captures decode graphs ...", "skipped": None}}
    selftest.print_result(result, lines.append)
    text = "".join(lines)
    assert "  graphs: sglang captures decode graphs ...\n  capture and replay: each step below drives its path " \
           "through an NPU graph capture and a replay\n" in text
    result["graphs"]["skipped"] = "no device"
    lines.clear()
    selftest.print_result(result, lines.append)
    assert "  capture and replay: not exercised (no device)\n" in "".join(lines)
