"""The state record's writer (npu_shim/reporting/record_writer.py, npu_shim/reporting/safe_dir.py)
against an attacker with a shell on the node and against a clumsy operator: real processes, real
users (root and ``nobody``), real PID namespaces.  The suite runs as root, as servers do."""

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
from test_bootstrap import REPO, run, tree  # noqa: F401 - ``tree`` is a fixture

from npu_shim.reporting import procinfo, safe_dir, record_writer

NOBODY = 65534
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
FAST = ("from npu_shim.reporting import record_writer, state_record; record_writer.INTERVAL_S = 0.05; "
        "record_writer.HEARTBEAT_S = 0.5\n")


def as_nobody():
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


@pytest.fixture
def shared_tmp():
    """A directory under /tmp that ``nobody`` can reach (pytest's own tmp_path is root's 0700)."""
    if os.geteuid() != 0:
        pytest.fail("these tests play root against another user: run the suite as root, as CI does")
    path = tempfile.mkdtemp(prefix="npu-shim-test-", dir="/tmp")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def files(dir_):
    return sorted(os.listdir(dir_))


def write_in_child(state_dir, code="", env=None, user=None, python=None):
    """A fresh interpreter (as root, or as ``user``) that writes its record with the shim's writer."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_SHIM_")}
    full_env.update({"PYTHONPATH": REPO, "NPU_SHIM_STATE_DIR": state_dir, "PYTHONDONTWRITEBYTECODE": "1"})
    full_env.update(env or {})
    script = FAST + "import os\nstate_record.write()\n" + textwrap.dedent(code)
    return subprocess.run([python or sys.executable, "-c", script], env=full_env, capture_output=True,
                          text=True, timeout=60, preexec_fn=as_nobody if user == NOBODY else None)


# -- the directory: who may own it and what is on the way ------------------------------------------

def test_a_state_dir_another_user_created_first_is_refused_and_a_victim_file_keeps_its_mode(shared_tmp, tree):
    # /dev/shm lets anyone create /dev/shm/npu-shim first; the old writer then wrote there as root
    # and chmod-ed its temporary file by path, so a swapped-in symlink made any file 0644.
    sticky = os.path.join(shared_tmp, "shm")
    os.mkdir(sticky)
    os.chmod(sticky, 0o1777)
    state_dir = os.path.join(sticky, "npu-shim")
    victim = os.path.join(shared_tmp, "root-only")
    with open(victim, "w") as handle:
        handle.write("secret")
    os.chmod(victim, 0o600)
    attacker = subprocess.Popen([SYSTEM_PYTHON, "-I", "-S", "-c", textwrap.dedent("""
        import os, sys, time
        state, victim = sys.argv[1], sys.argv[2]
        os.mkdir(state, 0o777)
        os.chmod(state, 0o777)
        print("ready", flush=True)
        deadline = time.time() + 20
        while time.time() < deadline and not os.path.exists(state + "/stop"):
            for name in os.listdir(state):
                if name.endswith(".tmp"):
                    try:  # swap the writer's temporary file for a symlink to the victim
                        os.rename(state + "/" + name, state + "/moved")
                        os.symlink(victim, state + "/" + name)
                    except OSError:
                        pass
    """), state_dir, victim], stdout=subprocess.PIPE, text=True, preexec_fn=as_nobody)
    try:
        assert attacker.stdout.readline().strip() == "ready"
        proc = run(tree, FAST + textwrap.dedent("""
            import time
            from sglang.srt.utils import common
            for _ in range(200):
                state_record.write(force=True)
        """), env={"NPU_SHIM_STATE_DIR": state_dir})
    finally:
        open(os.path.join(state_dir, "stop"), "w").close()
        attacker.wait(timeout=30)
    assert stat.S_IMODE(os.stat(victim).st_mode) == 0o600
    errors = [line for line in proc.stderr.splitlines() if "cannot write the state record" in line]
    assert len(errors) == 1, proc.stderr
    assert ("it belongs to uid %d, not uid 0; use your own directory, or share one: install -d -m 1777 DIR"
            % NOBODY in errors[0])
    assert not [n for n in files(state_dir) if n.endswith(".json")]


def test_the_temporary_file_is_made_readable_through_its_descriptor_never_by_path(tmp_path, monkeypatch):
    def no_chmod_by_path(*args, **kwargs):
        raise AssertionError("chmod by path: a symlink swapped in would be followed")

    monkeypatch.setattr(os, "chmod", no_chmod_by_path)
    monkeypatch.setattr(os, "lchmod", no_chmod_by_path, raising=False)
    os.umask(0o077)  # a strict umask: the record is still readable by a non-root operator
    try:
        with safe_dir.open_for_writing(str(tmp_path / "state")) as handle:
            handle.replace_file("r.json", b"{}", ".npu-shim-", ".tmp")
    finally:
        os.umask(0o022)
    assert stat.S_IMODE(os.stat(tmp_path / "state" / "r.json").st_mode) == 0o644
    assert files(tmp_path / "state") == ["r.json"]


@pytest.mark.parametrize("setup, message", [
    ("symlink", "/base/state is a symlink or not a directory (not followed)"),
    ("symlink-on-the-way", "/base/link is a symlink or not a directory (not followed)"),
    ("file", "/base/state is a symlink or not a directory (not followed)"),
    ("group-writable", ": it is writable by others; use your own directory"),
    ("world-writable-parent", "/base is writable by others, not sticky; use your own directory"),
    ("parent-of-another-user", "/base belongs to uid %d (not root, not uid 0)" % NOBODY),
    ("shared-dir-of-another-user", ": it belongs to uid %d (not root, not uid 0)" % NOBODY),
])
def test_unsafe_state_dirs_are_refused_with_one_line_saying_why(shared_tmp, setup, message):
    base = os.path.join(shared_tmp, "base")
    os.mkdir(base)
    target = os.path.join(base, "state")
    elsewhere = os.path.join(shared_tmp, "elsewhere")
    os.mkdir(elsewhere)
    if setup == "symlink":
        os.symlink(elsewhere, target)
    elif setup == "symlink-on-the-way":
        os.symlink(elsewhere, os.path.join(base, "link"))
        target = os.path.join(base, "link", "state")
    elif setup == "file":
        open(target, "w").close()
    elif setup == "group-writable":
        os.mkdir(target)
        os.chmod(target, 0o775)
    elif setup == "world-writable-parent":
        os.chmod(base, 0o777)
    elif setup == "parent-of-another-user":
        os.chown(base, NOBODY, NOBODY)
    elif setup == "shared-dir-of-another-user":
        os.mkdir(target)
        os.chmod(target, 0o1777)
        os.chown(target, NOBODY, NOBODY)
    proc = write_in_child(target, "print(sorted(os.listdir(%r)))" % elsewhere, env=None)
    errors = [line for line in proc.stderr.splitlines() if "cannot write the state record" in line]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.returncode == 0
    assert files(elsewhere) == []  # nothing written through a symlink


@pytest.mark.parametrize("what", ["folder", "symlink", "file"])
def test_root_takes_back_its_user_dir_that_another_user_made_first(shared_tmp, what):
    """``uid-0`` made in a shared directory by another user before root's first write (a folder of
    theirs, a symlink, a file): before the fix root's processes refused it, so no record of root's
    server was ever written."""
    shared = os.path.join(shared_tmp, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o1777)
    squat = os.path.join(shared, "uid-0")
    if what == "folder":
        os.mkdir(squat)
    elif what == "symlink":
        os.symlink(shared_tmp, squat)
    else:
        open(squat, "w").close()
    os.chown(squat, NOBODY, NOBODY, follow_symlinks=False)
    proc = write_in_child(shared, "print(os.getpid())")
    assert "cannot write the state record" not in proc.stderr and proc.returncode == 0, proc.stderr
    st = os.stat(squat)
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o755
    assert files(squat) == [record_writer.record_name(procinfo.host(), procinfo.pid_namespace(), int(proc.stdout))]
    aside = [name for name in files(shared) if name != "uid-0"]
    assert len(aside) == 1 and aside[0].startswith(".squatted-uid-0-by-uid-%d-" % NOBODY)


def test_another_user_s_user_dir_made_first_is_still_refused_to_that_user(shared_tmp):
    """Only root and the shared directory's owner take theirs back: a user whose ``uid-N/`` a third
    user made is refused with one line, as before."""
    shared = os.path.join(shared_tmp, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o1777)
    os.mkdir(os.path.join(shared, "uid-%d" % NOBODY))
    os.chown(os.path.join(shared, "uid-%d" % NOBODY), 12345, 12345)
    copy = os.path.join(shared_tmp, "shim")
    shutil.copytree(os.path.join(REPO, "npu_shim"), os.path.join(copy, "npu_shim"),
                    ignore=shutil.ignore_patterns("__pycache__", "_vendor"))
    proc = write_in_child(shared, env={"PYTHONPATH": copy}, user=NOBODY, python=SYSTEM_PYTHON)
    errors = [line for line in proc.stderr.splitlines() if "cannot write the state record" in line]
    assert len(errors) == 1, proc.stderr
    assert ": its uid-%d/ belongs to uid 12345, not uid %d" % (NOBODY, NOBODY) in errors[0], proc.stderr
    assert files(shared) == ["uid-%d" % NOBODY]


def test_a_sticky_shared_dir_gives_each_user_a_subdirectory_and_status_reads_both(shared_tmp):
    shared = os.path.join(shared_tmp, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o1777)
    # another user's server on the same node (a copy of the shim it can read: root's tree may not be)
    copy = os.path.join(shared_tmp, "shim")
    shutil.copytree(os.path.join(REPO, "npu_shim"), os.path.join(copy, "npu_shim"),
                    ignore=shutil.ignore_patterns("__pycache__", "_vendor"))
    keep = "import time; print('up', flush=True); time.sleep(30)\n"
    env = {"PYTHONPATH": copy}
    theirs = subprocess.Popen([SYSTEM_PYTHON, "-c", FAST + "state_record.write()\n" + keep],
                              env=dict(env, NPU_SHIM_STATE_DIR=shared, PATH=os.environ["PATH"]),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=as_nobody)
    ours = subprocess.Popen([sys.executable, "-c", FAST + "state_record.write()\n" + keep],
                            env=dict(os.environ, PYTHONPATH=REPO, NPU_SHIM_STATE_DIR=shared),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert theirs.stdout.readline().strip() == "up", theirs.stderr.read()
        assert ours.stdout.readline().strip() == "up", ours.stderr.read()
        assert files(shared) == ["uid-0", "uid-%d" % NOBODY]
        for uid in (0, NOBODY):
            st = os.stat(os.path.join(shared, "uid-%d" % uid))
            assert st.st_uid == uid and stat.S_IMODE(st.st_mode) == 0o755
        info = json.loads(subprocess.run(
            [sys.executable, "-m", "npu_shim", "status", "--running", shared, "--json"],
            env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=60).stdout)
        # root counts its own; the other user's record is shown, not counted
        assert (info["live"], info["other"], info["suspect"]) == (1, 1, 0), info
        assert sorted((p["uid"], p["status"]) for p in info["processes"]) == [(0, "live"), (NOBODY, "other")]
        # that user counts its own and root's
        info = json.loads(subprocess.run(
            [SYSTEM_PYTHON, "-m", "npu_shim", "status", "--running", shared, "--json"],
            env=dict(env, PATH=os.environ["PATH"]), capture_output=True, text=True, timeout=60,
            preexec_fn=as_nobody).stdout)
        assert (info["live"], info["other"], info["suspect"]) == (2, 0, 0), info
    finally:
        for proc in (theirs, ours):
            proc.kill()
            proc.wait()


# -- what a record holds -------------------------------------------------------------------------------

def test_the_record_keeps_no_command_line_argument(tree):
    state_dir = tree / "state"
    script = tree / "launch_server.py"
    script.write_text("from sglang.srt.utils import common\n")
    run(tree, "import runpy, sys; sys.argv = [%r, '--api-key', 'sk-very-secret', '--port', '30000']; "
              "runpy.run_path(%r, run_name='__main__')" % (str(script), str(script)),
        env={"NPU_SHIM_STATE_DIR": str(state_dir)})
    (name,) = files(state_dir)
    data = (state_dir / name).read_text()
    assert "sk-very-secret" not in data and "--api-key" not in data and "30000" not in data
    record = json.loads(data)
    assert record["program"] == "launch_server.py" and "argv" not in record
    assert record["format"] == 2 and record["heartbeat_s"] == record_writer.HEARTBEAT_S
    assert record["uid"] == os.geteuid() and record["boot_id"] == procinfo.boot_id()


def test_records_of_two_pid_namespaces_with_one_hostname_both_live(tmp_path):
    # Two containers with host networking and their own PID namespaces: both servers are pid 1.
    state_dir = str(tmp_path / "state")
    code = FAST + "state_record.write()\nimport os, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)\n"
    env = dict(os.environ, PYTHONPATH=REPO, NPU_SHIM_STATE_DIR=state_dir)
    procs = [subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable,
                               "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["1", "1"], [p.stderr.read() for p in procs]
        names = files(state_dir)
        assert len(names) == 2 and all(n.endswith("-1.json") for n in names), names
        records = [json.load(open(os.path.join(state_dir, n))) for n in names]
        assert len({r["pid_ns"] for r in records}) == 2 and {r["host"] for r in records} == {procinfo.host()}

        def status():
            out = subprocess.run([sys.executable, "-m", "npu_shim", "status", "--running", state_dir, "--json"],
                                 env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=60)
            return json.loads(out.stdout)

        time.sleep(1.0)  # past a heartbeat: the records are rewritten while their processes run
        info = status()
        assert info["live"] == 2 and info["stale"] == 0, info
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        deadline = time.time() + 20
        while time.time() < deadline:
            info = status()
            if info["stale"] == 1:
                break
            time.sleep(0.2)
        assert info["live"] == 1 and info["stale"] == 1, info
        (stale,) = [p for p in info["processes"] if p["status"] == "stale"]
        assert stale["why"].startswith("no heartbeat for")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


# -- retries, forks, leftovers -------------------------------------------------------------------------

def test_a_failed_first_write_is_retried_until_it_succeeds(tree):
    blocker = tree / "full"
    blocker.write_text("a file where the directory should be: no record can be written")
    state_dir = blocker.parent / "full" / "state"
    proc = run(tree, FAST + textwrap.dedent("""
        import os, time
        from sglang.srt.utils import common
        assert not os.path.exists(%r)
        os.unlink(%r)        # the space came back
        deadline = time.time() + 10
        while not os.path.isdir(%r) or not os.listdir(%r):
            assert time.time() < deadline, "no record after the directory became writable"
            time.sleep(0.05)
        print("written")
    """ % (str(state_dir), str(blocker), str(state_dir), str(state_dir))),
        env={"NPU_SHIM_STATE_DIR": str(state_dir)})
    assert proc.stdout.strip().endswith("written")
    assert len([line for line in proc.stderr.splitlines() if "cannot write the state record" in line]) == 1
    assert "is written to NPU_SHIM_STATE_DIR=%s again" % state_dir in proc.stderr
    (name,) = files(state_dir)
    assert json.load(open(state_dir / name))["patches"]["demo"]["state"] == "applied"


def test_a_forked_child_writes_its_own_record_while_it_runs(tree):
    state_dir = tree / "state"
    proc = run(tree, FAST + textwrap.dedent("""
        import json, os, time
        from sglang.srt.utils import common
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.read(read, 1)     # runs until the parent has looked
            os._exit(0)          # no atexit: the record must already be there
        deadline = time.time() + 10
        while not any(n.endswith("-%d.json" % pid) for n in os.listdir(os.environ["NPU_SHIM_STATE_DIR"])):
            assert time.time() < deadline, "the forked child wrote no record while it ran"
            time.sleep(0.05)
        os.write(write, b"x")
        os.waitpid(pid, 0)
        print(json.dumps(pid))
    """), env={"NPU_SHIM_STATE_DIR": str(state_dir)})
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    (record,) = [json.load(open(state_dir / n)) for n in files(state_dir) if n.endswith("-%d.json" % child)]
    assert record["pid"] == child and record["ppid"] != child
    assert record["patches"]["demo"]["state"] == "applied"


def test_temporary_files_of_killed_writers_are_removed_once_old(tmp_path):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    old = time.time() - 2 * record_writer.TEMP_MAX_AGE_S
    names = {".npu-shim-h-1-1-aaaa.tmp": old, ".h-2.abcd.tmp": old,  # ours, and npu-shim 0.2.2's
             ".npu-shim-h-3-3-bbbb.tmp": time.time(),  # a write in progress: kept
             ".npu-shim-not-ours.tmp": old}
    for name, mtime in names.items():
        (state_dir / name).write_text("{half")
        os.utime(state_dir / name, (mtime, mtime))
    os.chown(state_dir / ".npu-shim-not-ours.tmp", NOBODY, NOBODY)
    proc = write_in_child(str(state_dir))
    assert proc.returncode == 0, proc.stderr
    left = files(state_dir)
    assert ".npu-shim-h-3-3-bbbb.tmp" in left and ".npu-shim-not-ours.tmp" in left
    assert ".npu-shim-h-1-1-aaaa.tmp" not in left and ".h-2.abcd.tmp" not in left
    assert len([n for n in left if n.endswith(".json")]) == 1


def test_killed_writers_leave_no_temporary_file_behind_after_the_next_writer(tmp_path):
    state_dir = tmp_path / "state"
    for _ in range(5):
        proc = subprocess.Popen([sys.executable, "-c", FAST + textwrap.dedent("""
            import os
            state_record.write()
            print("up", flush=True)
            while True:
                state_record.write(force=True)
        """)], env=dict(os.environ, PYTHONPATH=REPO, NPU_SHIM_STATE_DIR=str(state_dir)),
            stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "up"
        time.sleep(0.05)
        proc.kill()
        proc.wait()
    leftovers = [n for n in files(state_dir) if n.endswith(".tmp")]
    old = time.time() - 2 * record_writer.TEMP_MAX_AGE_S
    for name in leftovers:
        os.utime(state_dir / name, (old, old))
    write_in_child(str(state_dir))
    assert [n for n in files(state_dir) if n.endswith(".tmp")] == []


def test_an_oversized_record_is_refused_by_the_writer_with_one_line(tmp_path):
    proc = write_in_child(str(tmp_path / "state"), textwrap.dedent("""
        state_record.attach(lambda: {"p": {"state": "applied", "reason": "r", "details": {"x": "y" * 300000}}})
        print(state_record.write())
    """))
    assert proc.stdout.strip() == "False"
    assert re.search(r"the record would be \d+ bytes, over the 262144 readers accept", proc.stderr), proc.stderr


def test_a_fork_while_the_writer_holds_its_lock_cannot_stall_the_child(tmp_path):
    proc = write_in_child(str(tmp_path / "state"), """
        import signal
        record_writer._W.lock.acquire()          # as the writer thread may hold it when fork() comes
        pid = os.fork()
        if pid == 0:
            signal.alarm(10)                 # a lock inherited held would hang here
            os._exit(0 if state_record.write(force=True) else 3)
        record_writer._W.lock.release()
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    """)
    assert proc.stdout.strip() == "0", proc.stdout + proc.stderr


def test_a_failed_rename_leaves_no_temporary_file(tmp_path):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    proc = write_in_child(str(state_dir), """
        from npu_shim.reporting import procinfo
        path = os.path.join(os.environ["NPU_SHIM_STATE_DIR"],
                            record_writer.record_name(procinfo.host(), procinfo.pid_namespace(), os.getpid()))
        os.unlink(path)
        os.mkdir(path)       # the record's name taken by a directory: the rename fails
        print(state_record.write(force=True))
    """)
    assert proc.stdout.strip() == "False", proc.stdout + proc.stderr
    assert [n for n in files(state_dir) if n.endswith(".tmp")] == [], files(state_dir)
    assert "cannot write the state record" in proc.stderr and "Is a directory" in proc.stderr


def test_touch_wakes_the_writer_before_its_interval(tmp_path):
    proc = write_in_child(str(tmp_path / "state"), """
        import json, time
        from npu_shim.reporting import procinfo
        record_writer.INTERVAL_S = record_writer.HEARTBEAT_S = 60.0   # only touch() can bring the change in time
        details = {}
        state_record.attach(lambda: {"p": {"state": "applied", "reason": "r", "details": dict(details)}})
        state_record.write()
        path = os.path.join(os.environ["NPU_SHIM_STATE_DIR"],
                            record_writer.record_name(procinfo.host(), procinfo.pid_namespace(), os.getpid()))
        time.sleep(0.2)     # the writer thread is waiting out its interval now
        details["n"] = 1
        record_writer.touch()
        deadline = time.time() + 10
        while json.load(open(path))["patches"]["p"]["details"] != {"n": 1}:
            assert time.time() < deadline, "touch() did not wake the writer"
            time.sleep(0.02)
        print("woken")
    """)
    assert proc.stdout.strip() == "woken", proc.stdout + proc.stderr


def test_the_exit_writes_the_final_figures(tmp_path):
    state_dir = tmp_path / "state"
    proc = write_in_child(str(state_dir), """
        record_writer.INTERVAL_S = record_writer.HEARTBEAT_S = 60.0   # only the exit can write them in time
        details = {}
        state_record.attach(lambda: {"p": {"state": "applied", "reason": "r", "details": dict(details)}})
        state_record.write()
        details["final"] = 1
    """)
    assert proc.returncode == 0, proc.stderr
    (name,) = files(state_dir)
    assert json.load(open(state_dir / name))["patches"]["p"]["details"] == {"final": 1}


def test_a_nan_in_the_details_is_never_written_as_non_strict_json(tmp_path):
    state_dir = tmp_path / "state"
    proc = write_in_child(str(state_dir), """
        state_record.attach(lambda: {"p": {"state": "applied", "reason": "r", "details": {"x": float("nan")}}})
        print(state_record.write(force=True))
    """)
    assert proc.stdout.strip() == "False"
    assert "cannot write the state record" in proc.stderr and "Out of range float values" in proc.stderr
    (name,) = files(state_dir)
    assert "NaN" not in (state_dir / name).read_text()
