"""``status --running`` (npu_shim/cli/running_records.py) reads a directory anyone may have filled: bounded in time
and memory, never a traceback, never a raw control character on the terminal, strict JSON, and
forged records flagged.  Everything through the CLI, in a real process."""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from test_record_writer import NOBODY, SYSTEM_PYTHON, as_nobody, shared_tmp  # noqa: F401 - a fixture

import npu_shim
from npu_shim.reporting import procinfo, record_writer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 60


def status_running(*args, user=None, python=None, pythonpath=REPO, stdout=subprocess.PIPE):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_SHIM_")}
    env["PYTHONPATH"] = pythonpath
    return subprocess.run([python or sys.executable, "-m", "npu_shim", "status", "--running"] + list(args),
                          stdout=stdout, stderr=subprocess.PIPE, text=True, env=env, timeout=TIMEOUT_S,
                          preexec_fn=as_nobody if user == NOBODY else None)


def strict_json(text):
    def refuse(name):
        raise AssertionError("not strict JSON: %s" % name)

    return json.loads(text, parse_constant=refuse)


def record(pid=None, **fields):
    """A well-formed record of this npu-shim for ``pid`` (this test process by default: live)."""
    pid = os.getpid() if pid is None else pid
    base = {"format": record_writer.FORMAT, "pid": pid, "ppid": 1, "uid": os.geteuid(),
            "host": procinfo.host(), "boot_id": procinfo.boot_id(), "pid_ns": procinfo.pid_namespace(),
            "start_ticks": procinfo.start_ticks(pid), "role": {"role": "scheduler", "tp_rank": 0},
            "shim": npu_shim.__version__, "shim_enabled": True, "sglang": "0.5.11", "python": "3.11.7",
            "program": "sglang.launch_server", "heartbeat_s": record_writer.HEARTBEAT_S,
            "updated": time.time(), "patches": {"zbal": {"state": "applied", "reason": "r", "details": {}}}}
    base.update(fields)
    return base


def put(dir_, rec, name=None, raw=None):
    name = name or record_writer.record_name(rec["host"], rec.get("pid_ns"), rec["pid"])
    with open(os.path.join(str(dir_), name), "w") as handle:
        handle.write(raw if raw is not None else json.dumps(rec))
    return name


# -- files that are not records ------------------------------------------------------------------

def test_a_fifo_a_device_symlink_and_a_huge_record_are_not_read_and_memory_stays_bounded(tmp_path):
    put(tmp_path, record())
    os.mkfifo(tmp_path / "fifo.json")
    os.symlink("/dev/zero", tmp_path / "zero.json")
    with open(tmp_path / "huge.json", "wb") as handle:
        handle.truncate(300 * 1024 * 1024)  # sparse: 300 MB to read, nothing on disk
    # VmHWM, the peak of this process's own memory (ru_maxrss would carry the forking parent's)
    probe = ("import sys; from npu_shim import __main__ as m; code = m.main(['status', "
             "'--running', sys.argv[1], '--json']); sys.stdout.flush(); "
             "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]; "
             "sys.stderr.write('peak_kib=%s\\n' % hwm); "
             "sys.exit(code)")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO), timeout=TIMEOUT_S)
    assert time.monotonic() - started < 30
    assert proc.returncode == 0, proc.stderr
    info = strict_json(proc.stdout)
    errors = {u["file"]: u["error"] for u in info["unreadable"]}
    assert errors == {"fifo.json": "not a regular file (never read)",
                      "zero.json": "a symlink (never followed)",
                      "huge.json": "314572800 bytes, over the 262144 a record may have (not read)"}
    assert info["live"] == 1
    assert int(re.search(r"peak_kib=(\d+)", proc.stderr).group(1)) < 100 * 1024


MALFORMED = {
    "no role": (record(role=None), "live"),
    "role a string": (record(role="scheduler"), "live"),
    "a rank not an int": (record(role={"role": "scheduler", "tp_rank": "3"}), "live"),
    "host a list": (record(host=["a"]), "'host' is not a host name"),
    "patches a list": (record(patches=["zbal"]), "'patches' is not an object"),
    "state a list": (record(patches={"zbal": {"state": ["applied"]}}), "live"),
    "state a dict": (record(patches={"zbal": {"state": {"a": 1}}}), "live"),
    "details a list": (record(patches={"zbal": {"state": "applied", "details": [1]}}), "live"),
    "an entry not an object": (record(patches={"zbal": 3}), "live"),
    "pid 2**70": (record(pid=2 ** 70), "'pid' is not a process id"),
    "pid a bool": (record(pid=True), "'pid' is not a process id"),
    "pid negative": (record(pid=-1), "'pid' is not a process id"),
    "updated -Infinity": (None, "not strict JSON (-Infinity)"),
    "NaN in details": (None, "not strict JSON (NaN)"),
    "a number out of range": (None, "not strict JSON (a number out of range)"),
    "deeply nested": (None, "nested too deeply"),
    "not JSON": (None, "not JSON: "),
    "not UTF-8": (None, "not UTF-8"),
    "a JSON list": (None, "not a state record (not a JSON object)"),
    "gva_mib a string": (record(patches={"zbal": {"state": "applied", "details": {"gva_mib": "x",
                                                                             "mode": ["f"]}}}), "live"),
}
RAW = {
    "updated -Infinity": '{"pid": %d, "host": "h", "updated": -Infinity}',
    "NaN in details": '{"pid": %d, "host": "h", "patches": {"z": {"details": {"x": NaN}}}}',
    "a number out of range": '{"pid": %d, "host": "h", "updated": 1e400}',
    "deeply nested": '{"pid": %d, "host": "h", "x": ' + "[" * 100000 + "]" * 100000 + "}",
    "not JSON": '{"pid": %d, "host":',
    "not UTF-8": None,
    "a JSON list": '[%d]',
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_record_is_one_line_never_a_traceback(tmp_path, case):
    rec, expected = MALFORMED[case]
    if rec is None:
        raw = RAW[case]
        data = raw.replace("%d", str(os.getpid())) if raw else None
        path = tmp_path / "bad.json"
        if data is None:
            path.write_bytes(b'{"pid": 1, "host": "\xff\xfe"}')
        else:
            path.write_text(data)
    else:
        put(tmp_path, rec, name="bad.json" if expected != "live" else None)
    for args in ((), ("--json",)):
        proc = status_running(str(tmp_path), *args)
        assert "Traceback" not in proc.stderr and proc.stderr == "", proc.stderr
        assert proc.returncode in (0, 5), proc.stdout
    info = strict_json(proc.stdout)
    if expected == "live":
        assert info["live"] == 1 and info["unreadable"] == [], info
    else:
        assert info["live"] == 0 and proc.returncode == 5
        (bad,) = info["unreadable"]
        assert bad["file"] == "bad.json" and bad["error"].startswith(expected), bad


def test_more_records_than_the_cap_are_not_all_read(tmp_path):
    for number in range(4100):
        (tmp_path / ("h-x-%d.json" % (number + 10))).write_text("{}")
    proc = status_running(str(tmp_path), "--json")
    info = strict_json(proc.stdout)
    assert len(info["unreadable"]) == 4097 and proc.returncode == 5
    assert info["unreadable"][-1] == {"file": "...", "error": "more than 4096 records: the rest were not read"}


# -- the terminal --------------------------------------------------------------------------------

def test_control_characters_in_records_and_file_names_are_escaped(tmp_path):
    evil = record(host="h\x1b[2J", role={"role": "sched\x07uler"}, sglang="0.5\r\nok: no failed patch",
                  shim="\u202egnp", pid_ns=None, boot_id=None,
                  patches={"zb\x1bal": {"state": "failed", "reason": "boom\x1b]0;owned\x07", "details": {}}})
    put(tmp_path, evil)
    put(tmp_path, record(), name="\x1b]0;title\x07.json")
    proc = status_running(str(tmp_path))
    shown = proc.stdout
    assert proc.returncode == 4 and proc.stderr == ""
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f\u202e]", shown), repr(shown)
    assert not any(line.startswith("ok:") for line in shown.splitlines()), shown
    assert "h\\x1b[2J" in shown and "\\x1b]0;title\\x07.json" in shown and "\\u202egnp" in shown
    assert "0.5\\x0d\\x0aok: no failed" in shown and "sched\\x07uler" in shown
    assert "PROBLEM: zb\\x1bal failed in pid %d on h\\x1b[2J: boom\\x1b]0;owned\\x07" % os.getpid() in shown


def test_json_output_is_strict_and_a_reader_that_goes_away_ends_it_quietly(tmp_path):
    for number in range(1000):
        put(tmp_path, record(pid=os.getpid(), host="host-%d" % number, heartbeat_s=None))
    proc = subprocess.Popen([sys.executable, "-m", "npu_shim", "status", "--running", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=REPO))
    proc.stdout.close()  # ``| head`` that has read what it wanted
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=TIMEOUT_S) == 141
    assert err == "", err
    piped = subprocess.run("%s -m npu_shim status --running %s | head -1" % (sys.executable, tmp_path),
                           shell=True, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO),
                           timeout=TIMEOUT_S)
    assert piped.stderr == "" and piped.stdout.startswith("npu-shim status --running:")


def test_a_directory_the_operator_cannot_read_is_one_line(shared_tmp):
    private = os.path.join(shared_tmp, "private")
    os.mkdir(private, 0o700)
    copy = os.path.join(shared_tmp, "shim")
    shutil.copytree(os.path.join(REPO, "npu_shim"), os.path.join(copy, "npu_shim"),
                    ignore=shutil.ignore_patterns("__pycache__", "_vendor"))
    proc = status_running(private, user=NOBODY, python=SYSTEM_PYTHON, pythonpath=copy)
    assert proc.returncode == 5 and proc.stderr == "", proc.stderr
    assert proc.stdout == "npu-shim status --running: %s: cannot read it: Permission denied\n" % private


@pytest.mark.parametrize("order", [("--running", "DIR", "--json"), ("--json", "--running", "DIR"),
                                   ("--running", "--json", "DIR"), ("DIR", "--json", "--running")])
def test_options_in_any_order(tmp_path, order):
    put(tmp_path, record())
    args = [str(tmp_path) if a == "DIR" else a for a in order]
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("NPU_SHIM_STATE_DIR", None)
    proc = subprocess.run([sys.executable, "-m", "npu_shim", "status"] + args, capture_output=True,
                          text=True, env=env, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert strict_json(proc.stdout)["live"] == 1


def test_a_directory_without_running_is_bad_usage(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "npu_shim", "status", str(tmp_path)], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=REPO), timeout=TIMEOUT_S)
    assert proc.returncode == 64 and "DIR is read only with --running" in proc.stderr


# -- forged records ------------------------------------------------------------------------------

def test_forged_records_are_flagged_and_not_counted(tmp_path):
    mine = put(tmp_path, record())
    # pid 1 runs here, but a record that gives no start time cannot prove it is that process
    put(tmp_path, record(pid=1, start_ticks=None))
    # a second file claiming this process, under a name its writer would not give it
    put(tmp_path, record(patches={"zbal": {"state": "failed", "reason": "forged"}}), name="other-x-1.json")
    # a file of nobody's that says root wrote it
    forged = put(tmp_path, record(pid=os.getppid(), start_ticks=procinfo.start_ticks(os.getppid())))
    os.chown(tmp_path / forged, NOBODY, NOBODY)
    info = strict_json(status_running(str(tmp_path), "--json").stdout)
    by_file = {p["file"]: (p["status"], p["why"]) for p in info["processes"]}
    assert by_file[mine] == ("live", None)
    assert by_file[record_writer.record_name(procinfo.host(), procinfo.pid_namespace(), 1)] == (
        "suspect", "it names running pid 1 but gives no start time to prove it")
    assert by_file["other-x-1.json"][0] == "suspect" and by_file["other-x-1.json"][1].startswith(
        "named other-x-1.json, but its writer would name it ")
    assert by_file[forged] == ("suspect", "the file belongs to uid %d, who owns neither the directory "
                                          "nor is root" % NOBODY)
    assert info["live"] == 1 and info["suspect"] == 3 and info["problems"] == []  # the forged failure ignored
    text = status_running(str(tmp_path)).stdout
    assert "WARNING: 3 record(s) are not what they say (SUSPECT above)" in text
    assert "-- 1 live process(es), 0 stale, 3 suspect\n" in text


def test_a_record_naming_a_process_of_another_user_is_suspect(tmp_path):
    sleeper = subprocess.Popen(["sleep", "30"], preexec_fn=as_nobody)
    try:
        time.sleep(0.1)
        put(tmp_path, record(pid=sleeper.pid, start_ticks=procinfo.start_ticks(sleeper.pid)))
        (proc,) = strict_json(status_running(str(tmp_path), "--json").stdout)["processes"]
        assert proc["status"] == "suspect"
        assert proc["why"] == "pid %d runs as uid %d, not as the uid 0 it names" % (sleeper.pid, NOBODY)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_records_of_other_hosts_go_stale_when_their_heartbeat_stops(tmp_path):
    now = time.time()
    fresh = put(tmp_path, record(pid=7, host="node-2", boot_id="b" * 36, updated=now - 1))
    silent = put(tmp_path, record(pid=8, host="node-2", boot_id="b" * 36,
                                  updated=now - 4 * record_writer.HEARTBEAT_S - 10))
    undated = put(tmp_path, record(pid=9, host="node-2", boot_id="b" * 36, updated=None))
    rebooted = put(tmp_path, record(pid=os.getpid(), boot_id="0" * 36))  # this host, an earlier boot
    info = strict_json(status_running(str(tmp_path), "--json").stdout)
    by_file = {p["file"]: (p["status"], p["why"]) for p in info["processes"]}
    assert by_file[fresh] == ("live", None)
    assert by_file[silent][0] == "stale" and by_file[silent][1].startswith("no heartbeat for ")
    assert by_file[undated] == ("suspect", "no time of its last update")
    assert by_file[rebooted] == ("stale", "written before this host last booted")


def test_an_empty_directory_says_how_records_get_there(tmp_path):
    proc = status_running(str(tmp_path))
    assert proc.returncode == 5
    assert "no state records (set NPU_SHIM_STATE_DIR to this directory in the server's environment)" in proc.stdout


def test_rows_by_host_then_pid_and_a_column_for_a_patch_this_shim_does_not_know(tmp_path):
    put(tmp_path, record(pid=9, host="b-host", heartbeat_s=None))
    put(tmp_path, record(pid=8, host="b-host", heartbeat_s=None))
    put(tmp_path, record(pid=7, host="a-host", heartbeat_s=None,
                         patches={"zbal": {"state": "applied"}, "newer_patch": {"state": "inactive"}}))
    lines = status_running(str(tmp_path)).stdout.splitlines()
    header = lines[1].split()
    assert header[-3:] == ["zbal", "newer_patch", "updated"], header
    assert [line.split()[:2] for line in lines[2:5]] == [["a-host", "7"], ["b-host", "8"], ["b-host", "9"]]
    assert re.search(r" applied\s+inactive\s+\d+s ago$", lines[2]), lines[2]
    assert re.search(r" applied\s+-\s+\d+s ago$", lines[3]), lines[3]


def test_user_directories_and_their_files_must_belong_to_the_user_they_name(shared_tmp):
    shared = os.path.join(shared_tmp, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o1777)
    for uid in (0, NOBODY):
        os.mkdir(os.path.join(shared, "uid-%d" % uid))
    os.chown(os.path.join(shared, "uid-0"), NOBODY, NOBODY)   # made by someone else
    os.chown(os.path.join(shared, "uid-%d" % NOBODY), NOBODY, NOBODY)
    claims_root = put(os.path.join(shared, "uid-0"), record())
    os.chown(os.path.join(shared, "uid-0", claims_root), NOBODY, NOBODY)
    root_file = put(os.path.join(shared, "uid-%d" % NOBODY), record(pid=os.getppid(), uid=0,
                                                                    start_ticks=procinfo.start_ticks(os.getppid())))
    info = strict_json(status_running(shared, "--json").stdout)
    by_file = {p["file"]: (p["status"], p["why"]) for p in info["processes"]}
    assert by_file["uid-0/" + claims_root] == ("suspect", "its directory uid-0/ belongs to uid %d" % NOBODY)
    assert by_file["uid-%d/%s" % (NOBODY, root_file)] == (
        "suspect", "the file belongs to uid 0, not to the owner of uid-%d/" % NOBODY)
    assert info["live"] == 0


def test_what_the_table_and_the_json_say_of_a_failed_patch_the_shim_off_and_each_role(tmp_path):
    put(tmp_path, record(sglang_path="/opt/sglang", role={"role": "detokenizer"},
                         patches={"zbal": {"state": "failed", "reason": "boom"}}))
    put(tmp_path, record(pid=os.getppid(), start_ticks=procinfo.start_ticks(os.getppid()), shim_enabled=False,
                         role={"role": "scheduler", "tp_rank": 2, "tp_size": 4}))
    info = strict_json(status_running(str(tmp_path), "--json").stdout)
    assert {"kind": "failed", "patch": "zbal", "pid": os.getpid(), "host": procinfo.host(),
            "reason": "boom"} in info["problems"]
    assert {p["pid"]: p["sglang_path"] for p in info["processes"]}[os.getpid()] == "/opt/sglang"
    text = status_running(str(tmp_path)).stdout
    mine = [line for line in text.splitlines() if " %d " % os.getpid() in line][0]
    assert " detokenizer " in mine and "scheduler" not in mine and " failed " in mine
    parent = [line for line in text.splitlines() if " %d " % os.getppid() in line][0]
    assert " scheduler tp 2/4 " in parent and re.search(r" off\s+\d+s ago$", parent), parent


def test_a_fifo_given_as_the_directory_fails_at_once(tmp_path):
    os.mkfifo(tmp_path / "not-a-dir")
    proc = status_running(str(tmp_path / "not-a-dir"))
    assert proc.returncode == 5 and proc.stderr == ""
    assert proc.stdout.endswith(": cannot read it: Not a directory\n"), proc.stdout


def test_a_directory_of_another_user_holding_that_users_records_is_trusted(shared_tmp):
    theirs = os.path.join(shared_tmp, "theirs")
    os.mkdir(theirs)
    os.chown(theirs, NOBODY, NOBODY)
    sleeper = subprocess.Popen(["sleep", "30"], preexec_fn=as_nobody)
    try:
        time.sleep(0.1)
        name = put(theirs, record(pid=sleeper.pid, uid=NOBODY, start_ticks=procinfo.start_ticks(sleeper.pid)))
        os.chown(os.path.join(theirs, name), NOBODY, NOBODY)
        (proc,) = strict_json(status_running(theirs, "--json").stdout)["processes"]
        assert (proc["status"], proc["why"]) == ("live", None)
    finally:
        sleeper.kill()
        sleeper.wait()


# -- other users' files in a shared (1777) directory ----------------------------------------------

def _shared_with_root_record(shared_tmp):
    shared = os.path.join(shared_tmp, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o1777)
    os.mkdir(os.path.join(shared, "uid-0"))
    put(os.path.join(shared, "uid-0"), record())
    return shared


def _nobody_owns(path):
    os.chown(path, NOBODY, NOBODY)
    return path


@pytest.mark.parametrize("where", ["beside", "in its own uid dir", "as uid dirs"])
def test_no_number_of_files_another_user_adds_hides_root_s_records(shared_tmp, where):
    """Before the fix the first 4096 entries the listing gave were read, whoever made them: another
    user's 4100 files could push root's record out (exit 5, its server unseen)."""
    shared = _shared_with_root_record(shared_tmp)
    theirs = shared
    if where == "in its own uid dir":
        theirs = os.path.join(shared, "uid-%d" % NOBODY)
        _make_nobody_dir(theirs)
    # Their records name pids other than this process's: one naming it would rightly be listed
    # beside root's (as suspect), which is not what this test is about (CI's worker had pid 1391).
    their_pids = [pid for pid in range(10, 4200) if pid != os.getpid()]
    for number in range(4100):
        if where == "as uid dirs":
            _make_nobody_dir(os.path.join(shared, "uid-%d" % (100000 + number)))
        else:
            _nobody_owns(os.path.join(theirs, put(theirs, record(pid=their_pids[number]), name="a-%05d.json" % number)))
    proc = status_running(shared, "--json")
    info = strict_json(proc.stdout)
    mine = [p for p in info["processes"] if p["pid"] == os.getpid()]
    assert [(p["file"], p["status"]) for p in mine] == [("uid-0/" + record_writer.record_name(
        procinfo.host(), procinfo.pid_namespace(), os.getpid()), "live")]
    assert proc.returncode == 0 and info["live"] == 1, proc.stdout[-2000:]


def _make_nobody_dir(path):
    os.mkdir(path)
    os.chown(path, NOBODY, NOBODY)


def test_another_user_s_own_live_records_cannot_fail_root_s_status(shared_tmp):
    """A record another user may rightly write -- of their own running process, in their own
    ``uid-N/`` -- saying a patch failed and disagreeing with root's server: before the fix it
    counted, and root's ``status --running`` exited 6.  Now it is shown as another user's, not
    counted; that user's own ``status --running`` still counts it."""
    shared = _shared_with_root_record(shared_tmp)
    theirs = os.path.join(shared, "uid-%d" % NOBODY)
    _make_nobody_dir(theirs)
    sleeper = subprocess.Popen(["sleep", "30"], preexec_fn=as_nobody)
    try:
        time.sleep(0.1)
        forged = record(pid=sleeper.pid, uid=NOBODY, start_ticks=procinfo.start_ticks(sleeper.pid),
                        patches={"zbal": {"state": "failed", "reason": "boom", "details": {}}})
        _nobody_owns(os.path.join(theirs, put(theirs, forged)))
        proc = status_running(shared, "--json")
        info = strict_json(proc.stdout)
        assert proc.returncode == 0 and info["problems"] == [], info["problems"]
        status = {p["pid"]: (p["status"], p["why"]) for p in info["processes"]}
        assert status[sleeper.pid] == ("other", "uid %d's: another user's records are not counted" % NOBODY)
        assert status[os.getpid()] == ("live", None)
        text = status_running(shared).stdout
        assert "1 live process(es), 0 stale, 1 of other users" in text and "OTHER USER (uid %d's" % NOBODY in text
    finally:
        sleeper.kill()
        sleeper.wait()


# -- property: whatever a record or a directory holds ----------------------------------------------

import io  # noqa: E402 - the property tests' imports, beside them
import tempfile  # noqa: E402 - the property tests' imports, beside them

from hypothesis import given, strategies as st  # noqa: E402 - the property tests' imports, beside them

from npu_shim.cli import running_records, running_table  # noqa: E402 - the property tests' imports, beside them

RAW_CONTROLS = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\ud800-\udfff]")
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", "applied", "failed", "0.5.11", "\x1b[2J", "\u202e",
                                                         "\udcff", "scheduler", "uid-0"]))
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 70), max_value=1 << 70),
              st.floats(allow_nan=False, allow_infinity=False), TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=20)


def _near_records():
    """Records close to real ones -- each field a real value or anything -- so that the checks
    past the first few fields are reached too."""
    def build(overrides, patches):
        rec = record()
        rec.update(overrides)
        if patches is not None:
            rec["patches"] = patches
        return rec
    fields = st.dictionaries(st.sampled_from(sorted(record())), JSON, max_size=6)
    patches = st.one_of(st.none(), JSON, st.dictionaries(TEXT, st.fixed_dictionaries(
        {"state": TEXT, "reason": st.one_of(st.none(), TEXT), "details": JSON}), max_size=3))
    return st.builds(build, fields, patches)


def _shown_safely(info):
    out = io.StringIO()
    running_table.print_table(info, out)
    text = out.getvalue()
    text.encode("utf-8")  # strict, as a UTF-8 locale's stdout
    assert not RAW_CONTROLS.search(text.replace("\n", "")), repr(text)
    json.dumps(info, default=str, allow_nan=False)  # what --json writes


@given(data=st.one_of(st.binary(max_size=200), JSON.map(lambda v: json.dumps(v).encode()),
                      _near_records().map(lambda r: json.dumps(r).encode("utf-8", "surrogatepass"))))
def test_any_bytes_as_a_record_are_a_record_or_one_reason(data):
    try:
        rec = running_records.validate(running_records.parse(data))
    except running_records.BadRecord as exc:
        assert "\n" not in str(exc)
        return
    assert isinstance(rec["pid"], int) and isinstance(rec["host"], str) and isinstance(rec["patches"], dict)
    facts = {"name": "x.json", "owner": os.geteuid(), "dir_owner": os.geteuid(), "user_dir": None, "trusted": True}
    why = running_records.suspicion(dict(rec, file="x.json"), facts)
    status = ("suspect", why) if why else running_records.judge(rec, running_records.this_process())
    assert status[0] in ("live", "stale", "suspect")
    rec = dict(rec, file="x.json", status=status[0], why=status[1], stale=status[0] == "stale")
    info = {"dir": "/d", "patches": sorted(rec["patches"]), "processes": [rec], "unreadable": [],
            "live": 1, "stale": 0, "suspect": 0, "other": 0, "problems": []}
    _shown_safely(info)


NAMES = st.one_of(st.binary(min_size=1, max_size=30).filter(lambda n: b"/" not in n and b"\0" not in n
                                                             and n not in (b".", b"..")),
                  st.sampled_from([b"uid-0", b"uid-65534", b"a.json", b"\xff.json", b".tmp.json"]))


@given(files=st.lists(st.tuples(NAMES, st.one_of(st.binary(max_size=100), _near_records().map(
    lambda r: json.dumps(r).encode("utf-8", "surrogatepass")))), max_size=8),
       dirs=st.lists(NAMES, max_size=3))
def test_any_directory_reads_as_one_table(files, dirs):
    """``status --running``'s reading of a directory (file names no UTF-8 included, user folders
    with anything in them): one answer, shown safely, never an exception."""
    with tempfile.TemporaryDirectory() as top:
        root = os.fsencode(top)
        for name in dirs:
            path = os.path.join(root, name)
            if not os.path.exists(path):
                os.mkdir(path)
        for name, data in files:
            path = os.path.join(root, name)
            if os.path.isdir(path):
                path = os.path.join(path, b"r.json")
            with open(path, "wb") as handle:
                handle.write(data)
        info = running_records.analyse(top)
        assert info["live"] + info["stale"] + info["suspect"] + info["other"] == len(info["processes"])
        _shown_safely(info)
