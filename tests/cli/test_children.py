"""npu_shim/cli/children.py: the children of ``check``, ``selftest`` and ``bundle`` -- their
process groups, waiting without reaping, a stop signal while ``Popen`` runs, bytes, and the
interpreter flags passed on.  (The commands themselves: test_check.py, test_selftest.py,
test_bundle.py, tests/test_every_command.py.)"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from npu_shim.cli import children

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _state(pid):
    try:
        with open("/proc/%d/stat" % pid) as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def alive(pid):
    """The process runs (it exists and is not a zombie); the cli tests' one reader of /proc."""
    return _state(pid) not in (None, "Z")


@pytest.mark.parametrize("flags, expected", [
    ([], []),
    (["-O"], ["-O"]),
    (["-OO", "-S"], ["-OO", "-S"]),
    (["-B", "-s", "-E"], ["-B", "-E", "-s"]),
    (["-I"], ["-I"]),
    (["-P"], ["-P"]),
])
def test_the_flags_that_change_a_server_are_passed_on(flags, expected):
    code = "import sys, json; sys.path.insert(0, %r); from npu_shim.cli import children; " \
           "print(json.dumps(children.interpreter_flags()))" % REPO
    out = subprocess.run([sys.executable] + flags + ["-c", code], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
                         timeout=60, check=True).stdout
    assert sorted(json.loads(out)) == sorted(expected)


def test_wait_leaves_the_child_unreaped_so_its_pid_names_only_its_group():
    """Reaped, the pid could be given to a new process leading a group of its own, which a kill of
    the group by that number would then hit."""
    proc = children.start([sys.executable, "-c", "pass"])
    children.wait(proc, 30)
    assert _state(proc.pid) == "Z" and proc.returncode is None
    children.stop(proc)
    assert proc.returncode == 0 and _state(proc.pid) is None


def test_stop_never_kills_a_group_by_the_number_of_a_reaped_child(monkeypatch):
    proc = children.start([sys.executable, "-c", "pass"])
    proc.wait()
    killed = []
    monkeypatch.setattr(os, "killpg", lambda *args: killed.append(args))
    children.stop(proc)
    assert killed == []


def test_run_kills_what_the_child_left_behind_and_reads_bytes(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "open(%r, 'w').write(str(p.pid))\n"
            "sys.stdout.buffer.write(b'out \\xff\\n'); sys.stderr.buffer.write(b'err \\xfe\\n')\n" % str(pid_file))
    code_, out, err = children.run([sys.executable, "-c", code], 60)
    assert (code_, out, err) == (0, "out \\xff\n", "err \\xfe\n")
    time.sleep(0.1)
    assert _state(int(pid_file.read_text())) in (None, "Z")


def test_run_past_its_timeout_raises_with_the_group_gone(tmp_path):
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        children.run([sys.executable, "-c", "import time; time.sleep(60)"], 0.5)
    assert time.monotonic() - started < 10


# A command as a terminal starts it, every stop signal at its default: the test run itself may
# have been started with some ignored (``nohup``: SIGHUP; a shell's ``&``: SIGINT, SIGQUIT), which a
# command inherits and keeps -- and which it must keep, so its stop tests start it this way.
_DEFAULT_SIGNALS_THEN_EXEC = """
import os, signal, sys
for signum in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM):
    signal.signal(signum, signal.SIG_DFL)
os.execvp(sys.argv[1], sys.argv[1:])
"""


def as_from_a_terminal(argv):
    return [sys.executable, "-I", "-S", "-c", _DEFAULT_SIGNALS_THEN_EXEC] + list(argv)


# In a process of its own (there the main thread is the only one, as in the commands: a thread the
# test runner keeps could take the signal instead; the commands' own threads block it): SIGTERM
# sent to itself at one moment of starting a child -- inside ``Popen``'s constructor once the child
# exists (at "popen"), or while the readers of a started child are made (at "readers") -- while
# ``call`` starts a sleeper (``children.python_command`` is made to give one).  What was caught,
# and how the child ended.
SIGTERM_WHILE_A_CHILD_STARTS = """
import json, os, signal, subprocess, sys
from npu_shim.cli import children
real_init, real_helper_thread = subprocess.Popen.__init__, children.helper_thread
made = []
def init(self, *args, **kwargs):
    real_init(self, *args, **kwargs)
    made.append(self)
    if %(at)r == "popen":
        os.kill(os.getpid(), signal.SIGTERM)
def helper_thread(target):
    if %(at)r == "readers":
        os.kill(os.getpid(), signal.SIGTERM)
    return real_helper_thread(target)
children.on_stop_signals()
subprocess.Popen.__init__ = init
children.helper_thread = helper_thread
children.python_command = lambda *args: [sys.executable, "-c", "import time; time.sleep(60)"]
try:
    %(call)s
    caught = None
except children.Stopped as exc:
    caught = [exc.name, children.exit_status(exc)]
print(json.dumps({"caught": caught, "child": made[0].returncode}))
"""


def sigterm_while_a_child_starts(at, call):
    out = subprocess.run([sys.executable, "-c", SIGTERM_WHILE_A_CHILD_STARTS % {"at": at, "call": call}],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO), timeout=60)
    return json.loads(out.stdout) if out.stdout else out.stderr


def test_a_stop_signal_inside_popen_is_delivered_once_the_child_can_be_killed():
    """SIGTERM arriving while ``Popen``'s constructor runs: noted until ``start`` has the child,
    then ``Stopped`` -- with the child already killed, never orphaned."""
    assert sigterm_while_a_child_starts("popen", "children.start(children.python_command())") == {
        "caught": ["SIGTERM", 143], "child": -signal.SIGKILL}


def _blocked_signals(text):
    mask = int(next(line for line in text.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
    return {signum for signum in range(1, 65) if mask >> (signum - 1) & 1}


def test_a_child_starts_with_no_signal_blocked():
    """Before the fix ``start`` blocked the stop signals around ``Popen`` and every child inherited
    the mask: pip, a check or selftest child and all they started ignored SIGTERM, SIGHUP, SIGINT."""
    code, out, _err = children.run([sys.executable, "-c", "print(open('/proc/self/status').read())"], 60)
    assert code == 0 and _blocked_signals(out) == set()
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == set()  # nor is anything left blocked here


IGNORED_SIGINT_IN_POPEN = """
import json, os, signal, subprocess
from npu_shim.cli import children
real_init = subprocess.Popen.__init__
def init(self, *args, **kwargs):
    real_init(self, *args, **kwargs)
    os.kill(os.getpid(), signal.SIGINT)
signal.signal(signal.SIGINT, signal.SIG_IGN)
subprocess.Popen.__init__ = init
proc = children.start(["sleep", "60"])
alive = proc.poll() is None
children.stop(proc)
print(json.dumps({"alive": alive, "sigint": signal.getsignal(signal.SIGINT) == signal.SIG_IGN}))
"""


def test_a_signal_this_command_ignores_stays_ignored_while_a_child_starts():
    """Started in the background by a shell, a command ignores SIGINT: a Ctrl-C meant for the
    foreground that lands inside ``Popen`` must not stop it."""
    out = subprocess.run([sys.executable, "-c", IGNORED_SIGINT_IN_POPEN], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=REPO), timeout=60)
    assert json.loads(out.stdout) == {"alive": True, "sigint": True}, out.stderr


def test_a_stop_signal_while_the_readers_are_made_finds_the_child_killed():
    """Before the fix ``run`` made its reader threads between ``start`` and its ``try``: a signal
    there left the child running."""
    assert sigterm_while_a_child_starts("readers", "children.run(children.python_command(), 60)") == {
        "caught": ["SIGTERM", 143], "child": -signal.SIGKILL}


def test_helper_threads_leave_the_stop_signals_to_the_main_thread():
    seen = []
    thread = children.helper_thread(lambda: seen.append(signal.pthread_sigmask(signal.SIG_BLOCK, set())))
    thread.start()
    thread.join(10)
    assert set(children.STOP_SIGNALS) | {signal.SIGINT} <= seen[0]
