"""What the shim did in running processes: state records (NPU_SHIM_STATE_DIR), ``status --running``,
process-tagged and JSON logs.  Process-level behaviour runs in fresh interpreters against the fake
sglang tree of tests/test_bootstrap.py; tests/patches/test_zbal_real.py has the real-release case.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

from test_bootstrap import REPO, TAG, last_json, run, tree  # noqa: F401 - ``tree`` is a fixture

import npu_shim
from npu_shim.cli import running_records
from npu_shim.reporting import procinfo, record_writer

# A process that looks like sglang's scheduler TP3 of DP0 (sglang sets this title itself).
AS_SCHEDULER = """
import sys, types
sys.modules["setproctitle"] = types.SimpleNamespace(getproctitle=lambda: "sglang::scheduler_DP0_TP3")
"""


def records(dir_):
    return {name: json.load(open(os.path.join(dir_, name))) for name in os.listdir(dir_)}


def status_running(*args, env=None):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_SHIM_")}
    full_env.update({"PYTHONPATH": REPO}, **(env or {}))
    return subprocess.run([sys.executable, "-m", "npu_shim", "status", "--running"] + list(args),
                          capture_output=True, text=True, env=full_env, timeout=60)


# -- the state record ---------------------------------------------------------------------------------

def test_no_state_dir_writes_nothing_and_starts_no_thread(tree):
    proc = run(tree, """
        import json, threading
        from sglang.srt.utils import common
        print(json.dumps(sorted(t.name for t in threading.enumerate())))
    """)
    assert last_json(proc) == ["MainThread"]
    assert [p.name for p in tree.iterdir() if p.name not in ("pkgs", "image", "marker")] == []


def test_state_record_has_role_versions_states_and_follows_details_and_state_changes(tree):
    state_dir = tree / "state"
    proc = run(tree, AS_SCHEDULER + textwrap.dedent("""
        import json, os, socket, time
        import npu_shim
        from npu_shim.reporting import record_writer
        from npu_shim.runtime import activation
        record_writer.INTERVAL_S = 0.05
        from sglang.srt.utils import common
        from npu_shim.reporting import procinfo
        path = os.path.join(os.environ["NPU_SHIM_STATE_DIR"],
                            record_writer.record_name(socket.gethostname(), procinfo.pid_namespace(), os.getpid()))
        first = json.load(open(path))
        activation.RUNTIME.record("demo").details["calls"] = 7   # a wrapper's live details: no call into the shim
        deadline = time.time() + 10
        while json.load(open(path))["patches"]["demo"]["details"].get("calls") != 7 and time.time() < deadline:
            time.sleep(0.02)
        second = json.load(open(path))
        npu_shim.uninstall()                      # a state change is written at once
        third = json.load(open(path))
        print(json.dumps({"first": first, "second": second, "third": third, "pid": os.getpid(),
                          "files": sorted(os.listdir(os.environ["NPU_SHIM_STATE_DIR"]))}))
    """), env={"NPU_SHIM_STATE_DIR": str(state_dir)})
    out = last_json(proc)
    first = out["first"]
    assert first["pid"] == out["pid"] and first["host"] == procinfo.host()
    assert first["shim"] == npu_shim.__version__ and first["sglang"] == "0.5.9" and first["shim_enabled"] is True
    assert first["python"].count(".") == 2 and first["sglang_path"].endswith("sglang")
    assert first["role"] == {"role": "scheduler", "source": "process title", "dp_rank": 0, "tp_rank": 3}
    assert first["patches"]["demo"]["state"] == "applied"
    assert first["patches"]["demo"]["reason"].startswith("backport of sgl-project/sglang#1")
    assert first["patches"]["demo"]["details"] == {}
    assert out["second"]["patches"]["demo"]["details"] == {"calls": 7}
    assert out["second"]["updated"] >= first["updated"]
    assert out["third"]["patches"] == {}
    # one file per process, no temporary file left behind; the exit rewrote it (atexit), unchanged
    assert out["files"] == [record_writer.record_name(procinfo.host(), procinfo.pid_namespace(), out["pid"])]
    final = records(str(state_dir))[out["files"][0]]
    assert final["patches"] == {}
    # the summary line carries the role the process title gives
    assert re.search(r"\[npu-shim %s sglang 0\.5\.9 pid [0-9]+ dp 0 tp 3\] demo=applied"
                     % re.escape(npu_shim.__version__), proc.stderr), proc.stderr


def test_a_failing_patch_is_in_the_record_at_once(tree):
    state_dir = tree / "state"
    run(tree, "import sglang.srt.utils", env={"NPU_SHIM_STATE_DIR": str(state_dir),
                                             "DEMO_PATCH_TARGETS_RAISE": "1"})
    (record,) = records(str(state_dir)).values()
    assert record["patches"]["demo"]["state"] == "failed"
    assert "boom while listing targets" in record["patches"]["demo"]["reason"]


def test_unwritable_state_dir_is_one_error_line_and_the_application_runs_on(tree):
    blocker = tree / "not-a-dir"
    blocker.write_text("a file where the directory should be")
    proc = run(tree, """
        from npu_shim.reporting import record_writer
        record_writer.INTERVAL_S = 0.05
        from sglang.srt.utils import common
        import time
        from npu_shim.runtime import activation
        activation.RUNTIME.record("demo").details["x"] = 1
        time.sleep(0.3)
        print(common.get_npu_memory_capacity())
    """, env={"NPU_SHIM_STATE_DIR": str(blocker / "state")})
    assert proc.stdout.strip() == "1001"
    errors = [line for line in proc.stderr.splitlines() if "cannot write the state record" in line]
    assert len(errors) == 1 and "NPU_SHIM_STATE_DIR=" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_relative_state_dir_is_an_invalid_variable(tree):
    proc = run(tree, "import sglang.srt.utils", env={"NPU_SHIM_STATE_DIR": "state"})
    assert "NPU_SHIM_STATE_DIR='state' is invalid: expected an absolute directory path" in proc.stderr
    assert not (tree / "state").exists()


def test_shim_off_process_keeps_a_record_saying_so(tree):
    state_dir = tree / "state"
    run(tree, "import sglang.srt.utils", env={"NPU_SHIM_STATE_DIR": str(state_dir), "NPU_SHIM_ENABLED": "0"})
    (record,) = records(str(state_dir)).values()
    assert record["shim_enabled"] is False and record["patches"] == {} and record["sglang"] == "0.5.9"


def test_spawned_children_write_their_own_records(tree):
    state_dir = tree / "state"
    script = tree / "image" / "spawn_main.py"
    script.write_text(textwrap.dedent("""
        import json, multiprocessing as mp

        def child(queue):
            from sglang.srt.utils import common
            queue.put(common.get_npu_memory_capacity())

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            procs = [ctx.Process(target=child, args=(queue,)) for _ in range(2)]
            for p in procs: p.start()
            values = [queue.get(timeout=60) for _ in procs]
            for p in procs: p.join()
            print(json.dumps({"values": values, "pids": [p.pid for p in procs]}))
    """))
    proc = run(tree, "import runpy; runpy.run_path(%r, run_name='__main__')" % str(script),
               env={"NPU_SHIM_STATE_DIR": str(state_dir)})
    out = last_json(proc)
    assert out["values"] == [1001, 1001]
    by_pid = {r["pid"]: r for r in records(str(state_dir)).values()}
    assert set(out["pids"]) <= set(by_pid)
    assert all(by_pid[pid]["patches"]["demo"]["state"] == "applied" for pid in out["pids"])


# -- status --running ---------------------------------------------------------------------------------

def _record(pid, states, host=None, sglang="0.5.11", enabled=True, role=None, **extra):
    record = {"format": 1, "pid": pid, "host": host or procinfo.host(), "shim": npu_shim.__version__,
              "start_ticks": procinfo.start_ticks(pid),
              "shim_enabled": enabled, "sglang": sglang, "python": "3.11.7",
              "role": role or {"role": "unknown", "source": "test"}, "updated": 0,
              "patches": {name: {"state": state, "reason": "r-" + state, "details": {}}
                          for name, state in states.items()}}
    record.update(extra)
    return record


def _write(dir_, record):
    with open(os.path.join(dir_, "%s-%d.json" % (record["host"], record["pid"])), "w") as handle:
        json.dump(record, handle)


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_status_running_agreeing_processes_exit_0_with_one_row_each(tmp_path):
    states = {"zbal": "applied", "mla_weight_release": "applied", "dual_stream_experts": "upstream"}
    me = os.getpid()
    _write(tmp_path, _record(me, states, role={"role": "scheduler", "tp_rank": 3, "tp_size": 16,
                                                "source": "Scheduler.__init__"}))
    parent = _record(os.getppid(), states, role={"role": "http_server", "source": "t"})
    parent["patches"]["zbal"]["details"] = {"mode": "full", "gva_mib": 49152}
    _write(tmp_path, parent)
    # a detokenizer that never imported a target module: no state, not a disagreement
    _write(tmp_path, _record(1, {}, host="other-host", role={"role": "detokenizer", "source": "t"}))
    proc = status_running(str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 live process(es), 0 stale" in proc.stdout
    assert re.search(r"%d\s+scheduler tp 3/16\s+%s\s+0\.5\.11\s+applied\s+applied\s+upstream"
                     % (me, re.escape(npu_shim.__version__)), proc.stdout), proc.stdout
    assert "applied(full, 49152 MiB)" in proc.stdout and "detokenizer" in proc.stdout
    assert "ok: no failed patch, every live process agrees" in proc.stdout


def test_status_running_disagreement_failed_and_stale(tmp_path):
    on = {"zbal": "applied", "mla_weight_release": "applied"}
    _write(tmp_path, _record(os.getpid(), on))
    _write(tmp_path, _record(os.getppid(), dict(on, zbal="inactive")))
    _write(tmp_path, _record(_dead_pid(), dict(on, mla_weight_release="failed")))  # stale: not counted
    _write(tmp_path, _record(7, dict(on, zbal="inactive"), host="h2", sglang="0.5.9"))  # other version
    (tmp_path / ".x-1.abc.tmp").write_text("{half")  # a write in progress is not a record
    (tmp_path / "broken.json").write_text("{half")
    proc = status_running(str(tmp_path), "--json")
    assert proc.returncode == 4, proc.stdout + proc.stderr
    info = json.loads(proc.stdout)
    assert info["exit"] == 4 and info["live"] == 3 and info["stale"] == 1
    assert info["problems"] == [{"kind": "disagree", "patch": "zbal", "sglang": "0.5.11",
                                 "states": {"applied": [os.getpid()], "inactive": [os.getppid()]}}]
    assert [u["file"] for u in info["unreadable"]] == ["broken.json"]
    text = status_running(str(tmp_path))
    assert text.returncode == 4
    assert "STALE (pid " in text.stdout and " is not running)" in text.stdout
    assert "PROBLEM: processes of sglang 0.5.11 disagree on zbal: applied in pid %d; inactive in pid %d" % (
        os.getpid(), os.getppid()) in text.stdout
    # a failed patch in a live process is a problem even when every process agrees
    for name in os.listdir(tmp_path):
        os.unlink(os.path.join(tmp_path, name))
    _write(tmp_path, _record(os.getpid(), {"zbal": "failed"}))
    proc = status_running(env={"NPU_SHIM_STATE_DIR": str(tmp_path)})
    assert proc.returncode == 4 and "PROBLEM: zbal failed in pid %d" % os.getpid() in proc.stdout


def test_status_running_shim_off_in_one_process_disagrees(tmp_path):
    _write(tmp_path, _record(os.getpid(), {"zbal": "applied"}))
    _write(tmp_path, _record(os.getppid(), {}, enabled=False))
    info = running_records.analyse(str(tmp_path))
    assert info["problems"] == [{"kind": "disagree", "patch": "zbal", "sglang": "0.5.11",
                                 "states": {"applied": [os.getpid()], "disabled": [os.getppid()]}}]


def test_status_running_without_records_or_dir(tmp_path):
    assert status_running(str(tmp_path)).returncode == 5
    assert status_running(str(tmp_path / "missing")).returncode == 5
    _write(tmp_path, _record(_dead_pid(), {"zbal": "applied"}))  # only stale records: nothing live
    assert status_running(str(tmp_path)).returncode == 5
    proc = status_running()
    assert proc.returncode == 64 and "NPU_SHIM_STATE_DIR" in proc.stderr


def test_role_from_sglang_process_titles():
    assert procinfo.role_from_title("sglang::scheduler_DP1_PP0_ATTN_CP0_TP3_EP3") == {
        "role": "scheduler", "source": "process title", "dp_rank": 1, "pp_rank": 0,
        "attn_cp_rank": 0, "tp_rank": 3, "ep_rank": 3}
    assert procinfo.role_from_title("sglang::scheduler") == {"role": "scheduler", "source": "process title"}
    assert procinfo.role_from_title("sglang::detokenizer")["role"] == "detokenizer"
    assert procinfo.role_from_title("sglang::data_parallel_controller")["role"] == "data_parallel_controller"
    assert procinfo.role_from_title("sglang::tokenizer_worker:812")["role"] == "tokenizer_worker"
    assert procinfo.role_from_title("python -m sglang.launch_server") is None
    assert procinfo.role_label({"role": "scheduler", "tp_rank": 3, "tp_size": 16, "pp_rank": 0,
                                "pp_size": 1}) == "tp 3/16"
    assert procinfo.role_label({"role": "scheduler", "tp_rank": 3, "pp_rank": 1, "pp_size": 2}) == "pp 1/2 tp 3"
    assert procinfo.role_label({"role": "detokenizer"}) == "detokenizer"
    assert procinfo.role_label({"role": "unknown"}) == ""


# -- logs ---------------------------------------------------------------------------------------------

def test_json_log_format_is_one_object_per_line_with_process_fields(tree):
    proc = run(tree, AS_SCHEDULER + "import sglang.srt.utils.common",
               env={"NPU_SHIM_LOG_FORMAT": "json", "DEMO_PATCH_TARGETS_RAISE": "1"})
    lines = [json.loads(line) for line in proc.stderr.strip().splitlines()]
    summary, failure = lines
    for line in lines:
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["ts"])
        assert line["shim"] == npu_shim.__version__ and line["sglang"] == "0.5.9" and isinstance(line["pid"], int)
        assert line["role"] == "scheduler" and line["tp_rank"] == 3 and line["host"] == procinfo.host()
    assert summary["level"] == "INFO" and summary["event"] == "summary"
    assert summary["states"] == {"demo": "failed"} and summary["message"] == "demo=failed"
    assert failure["level"] == "ERROR" and failure["message"].startswith("demo: failed (deciding raised")


def test_bad_log_format_falls_back_to_text_and_says_so(tree):
    proc = run(tree, "import sglang.srt.utils", env={"NPU_SHIM_LOG_FORMAT": "yaml"})
    assert "NPU_SHIM_LOG_FORMAT='yaml' is invalid: expected one of text, json (using text)" in proc.stderr
    assert re.search(TAG + " demo=applied", proc.stderr), proc.stderr


def test_reasons_are_at_debug(tree):
    proc = run(tree, "import sglang.srt.utils", env={"NPU_SHIM_LOG_LEVEL": "DEBUG"})
    lines = proc.stderr.strip().splitlines()
    assert re.fullmatch(TAG + " demo=applied", lines[0]), lines
    assert re.fullmatch(TAG + re.escape(" demo: applied (backport of sgl-project/sglang#1; upstream "
                                        "since 0.5.99)"), lines[1]), lines


def test_an_exited_process_not_yet_reaped_is_stale():
    import time

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 30
    while not procinfo.is_zombie(child.pid) and time.time() < deadline:
        time.sleep(0.02)
    try:
        assert running_records.is_stale(_record(child.pid, {}))  # a zombie: exited, its parent not told yet
        assert not running_records.is_stale(_record(os.getpid(), {}, start_ticks=procinfo.start_ticks()))
        assert running_records.is_stale(_record(os.getpid(), {}, start_ticks=1))  # the pid was reused
        assert not running_records.is_stale(_record(child.pid, {}, host="elsewhere"))  # cannot be checked
    finally:
        child.wait()


def test_a_record_is_never_written_without_its_patches(tmp_path, monkeypatch):
    from npu_shim.reporting import record_writer, state_record

    monkeypatch.setenv("NPU_SHIM_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(record_writer._W, "thread_pid", os.getpid())  # no writer thread in this test
    saved = state_record.ATTACHED.source

    def busy():
        raise RuntimeError("dictionary changed size during iteration")

    try:
        state_record.attach(busy)
        assert state_record.write() is False and os.listdir(tmp_path) == []
        state_record.attach(lambda: {"p": {"state": "applied", "reason": "r", "details": {"n": 1}}})
        assert state_record.write() is True and state_record.write() is False  # unchanged: not rewritten
        (name,) = os.listdir(tmp_path)
        assert json.load(open(tmp_path / name))["patches"]["p"]["details"] == {"n": 1}
    finally:
        state_record.ATTACHED.source, record_writer._W.last = saved, None
