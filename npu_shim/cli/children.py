"""The processes a command starts (``check``'s and ``selftest``'s children, ``bundle``'s pip and
interpreters), and the signals that end a command while they run.

* Each child starts in a session of its own, so it leads its own process group: killing the group
  takes whatever the child started too (sglang's imports may spawn helpers; pip spawns its own),
  and a terminal's Ctrl-C reaches only the command, whose clean-up then kills the group.
* A stop signal that comes while ``Popen`` runs waits until it is done: raised inside its
  constructor, it would leave the caller without the child to kill (an orphaned pip, before this).
  The child starts with no signal blocked.
* A child's output is read as bytes and decoded here, what is not UTF-8 shown as ``\\xNN``: a
  module that writes one stray byte must not cost the report.
* A ``check`` or ``selftest`` child reports on one line of its stdout, a mark and a JSON object
  (``write_report``), which its command finds there whatever else the child printed
  (``find_report``).
* ``check`` and ``selftest`` children run with the interpreter flags that change what a server
  process does (``-O``, ``-S``, ``-I`` ...): they stand for a server started as this command was.

Imports nothing at load time beyond ``os``, ``signal`` and ``sys`` (``check`` loads it before it
has verified the bundle it runs from).
"""

import os
import signal
import sys

# The signals that end a process by default, besides Ctrl-C (SIGINT: Python's KeyboardInterrupt),
# that a kill, a terminal (Ctrl-\: SIGQUIT), a closed ssh session, a batch system, a timer or a
# resource limit send: each stops the command with its children.  Not SIGKILL (it cannot be
# caught), nor the faults of the process itself (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT, SIGTRAP,
# SIGSYS), nor SIGPIPE and SIGXFSZ (Python ignores them: the write fails instead).
STOP_SIGNALS = tuple(getattr(signal, name) for name in (
    "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGVTALRM", "SIGPROF", "SIGXCPU",
    "SIGIO", "SIGPWR", "SIGSTKFLT") if hasattr(signal, name))


class Stopped(BaseException):
    """A stop signal arrived: raised from its handler, so that every clean-up runs as it does for
    Ctrl-C (a BaseException, as KeyboardInterrupt: no ``except Exception`` swallows it)."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self):
        return signal.Signals(self.signum).name


def exit_status(exc):
    """The exit status a shell reports for a process ended by the signal behind ``exc``."""
    return 128 + (exc.signum if isinstance(exc, Stopped) else signal.SIGINT)


def signal_name(exc):
    return exc.name if isinstance(exc, Stopped) else "SIGINT"


def _take_over(signums, handler, taken):
    """``handler`` for each of ``signums`` whose handler now is one ``taken(handler)`` accepts;
    returns the function that puts the previous ones back.  Outside the main thread nothing can
    be set: a no-op."""
    previous = {}
    try:
        for signum in signums:
            if taken(signal.getsignal(signum)):
                previous[signum] = signal.signal(signum, handler)
    except ValueError:  # not the main thread
        pass

    def restore():
        for signum, old in previous.items():
            signal.signal(signum, old)
    return restore


def on_stop_signals():
    """Make the stop signals raise ``Stopped`` until the returned function is called (which puts
    the previous handlers back).  A signal this process ignores stays ignored (``nohup`` ignores
    SIGHUP so that a closed session leaves the command running)."""
    def handler(signum, _frame):
        raise Stopped(signum)

    return _take_over(STOP_SIGNALS, handler, lambda old: old == signal.SIG_DFL)


def helper_thread(target):
    """A daemon thread running ``target`` with the stop signals and SIGINT blocked in it: the
    kernel then delivers them to the main thread, whose Python handlers run them at once (a
    signal taken by another thread reaches them only at some later point of the main thread,
    and ``hold_signals`` would not hold it back)."""
    import threading

    def run():
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS) | {signal.SIGINT})
        target()
    return threading.Thread(target=run, daemon=True)


def hold_signals():
    """Hold the stop signals and SIGINT until the returned function is called (they are then
    delivered): what must not stop half-way (a swap of directories) runs in between.  Never
    around starting a child, which would inherit the held mask (``start``)."""
    if not hasattr(signal, "pthread_sigmask"):
        return lambda: None
    held = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS) | {signal.SIGINT})
    return lambda: signal.pthread_sigmask(signal.SIG_SETMASK, held)


# The sys.flags a server's behaviour depends on, and the option that sets each.
_FLAGS = (("no_site", "-S"), ("dont_write_bytecode", "-B"))


def interpreter_flags():
    """This interpreter's options that change what a Python process does at start-up and import:
    ``-O``/``-OO``, ``-S``, ``-B``, and ``-I`` (or ``-E``, ``-s``, ``-P``)."""
    flags = sys.flags
    found = ["-" + "O" * flags.optimize] if flags.optimize else []
    found += [option for name, option in _FLAGS if getattr(flags, name, 0)]
    if flags.isolated:
        return found + ["-I"]
    for name, option in (("ignore_environment", "-E"), ("no_user_site", "-s"), ("safe_path", "-P")):
        if getattr(flags, name, 0):
            found.append(option)
    return found


def python_command(code, *args):
    """``sys.executable`` with this interpreter's flags, running ``code``."""
    return [sys.executable] + interpreter_flags() + ["-c", code] + list(args)


def start(argv, env=None, merge_stderr=False):
    """A ``Popen`` of ``argv`` in its own session, stdin empty, stdout (and stderr, or stderr into
    stdout) as byte pipes.  A stop signal or Ctrl-C that came while it started is delivered before
    this returns, with the child already killed.

    Such a signal is deferred by a handler that notes it, not by blocking it: a child inherits the
    signal mask across ``fork`` and ``exec``, and one started with the stop signals blocked (pip,
    sglang's helpers, whatever they start) could not be stopped by them."""
    import subprocess

    came = []
    # Only a signal whose handler is Python's would raise here (not one ignored or at its default).
    restore = _take_over(STOP_SIGNALS + (signal.SIGINT,), lambda signum, _frame: came.append(signum), callable)
    proc = None
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                                env=env, start_new_session=True)
    finally:
        try:
            restore()
            for signum in came:  # to its own handler now: Stopped or KeyboardInterrupt
                signal.raise_signal(signum)
        except BaseException:
            if proc is not None:
                stop(proc)
            raise
    return proc


def wait(proc, timeout=None):
    """Wait until the child has exited, without reaping it (``subprocess.TimeoutExpired`` after
    ``timeout`` seconds).  Unreaped, it keeps its pid, so that ``stop`` can kill its group by that
    number: once reaped, the number could name the group of an unrelated process started since."""
    import subprocess
    import time

    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.002
    while proc.returncode is None:
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return
        except ChildProcessError:
            return  # reaped elsewhere: nothing left to wait for
        if deadline is not None and time.monotonic() >= deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout)
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def stop(proc, close=True):
    """Kill the child's process group (the child and whatever it started that is still in it),
    reap the child and close its pipes (``close=False``: a reader thread still drains them; they
    end, as every writer is gone).  The group is killed only while the child is unreaped (``wait``
    leaves it so): its pid then names that group and no other."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # no process left in the group
    proc.wait()
    for pipe in (proc.stdout, proc.stderr) if close else ():
        if pipe is not None:
            pipe.close()


def decode(data):
    """A child's bytes as text: UTF-8, anything else as ``\\xNN`` escapes (never an error)."""
    return (data or b"").decode("utf-8", "backslashreplace")


def run(argv, timeout, env=None, merge_stderr=False):
    """(exit status, stdout, stderr) of ``argv`` run to its end, its process group killed on every
    way out (the child done, ``timeout`` passed: ``subprocess.TimeoutExpired``, a signal)."""
    readers = []
    proc = start(argv, env=env, merge_stderr=merge_stderr)
    try:  # at once: a signal that comes while the readers are made must find the child killed
        pipes = [pipe for pipe in (proc.stdout, proc.stderr) if pipe is not None]
        read = {pipe: [] for pipe in pipes}
        readers = [helper_thread(lambda pipe=pipe: read[pipe].append(pipe.read())) for pipe in pipes]
        for reader in readers:
            reader.start()
        wait(proc, timeout)
    finally:
        stop(proc, close=False)  # the group's last writers gone: the readers see the end
        for reader in readers:
            if reader.ident is not None:
                reader.join(5)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    return (proc.returncode, decode(b"".join(read[proc.stdout])),
            decode(b"".join(read[proc.stderr])) if proc.stderr is not None else "")


def write_report(mark, report):
    """In a child: its report to the command that started it, ``mark`` and the JSON object on one
    line of stdout of its own (after a newline: a module it imported may have left one unended)."""
    import json

    sys.stdout.write("\n" + mark + json.dumps(report, default=str) + "\n")
    sys.stdout.flush()


def last_words(*outputs):
    """What a child that gave no report last said, in one line: the last line of the first output
    with any (a traceback's last line is its exception)."""
    for text in outputs:
        lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
        if lines:
            from npu_shim.reporting.log import one_line

            return one_line(lines[-1])
    return "(nothing)"


def find_report(out, mark, keys=()):
    """(the report: the JSON object with ``keys`` on the last line of ``out`` that starts with
    ``mark``, None), or (None, why not).  A child's output holds whatever a module it imported
    printed too, and the child may die half-way through its own line."""
    for line in reversed(out.splitlines()):
        if line.startswith(mark):
            try:
                import json

                report = json.loads(line[len(mark):])
            except (ValueError, RecursionError):
                report = None
            if not isinstance(report, dict) or not all(key in report for key in keys):
                return None, "with a malformed report line"
            return report, None
    return None, "without a report"


def stoppable(command, body, gone):
    """``body()``'s exit status, with the stop signals raising (``on_stop_signals``) so that the
    clean-up of every child runs, as for Ctrl-C; stopped: one line saying so (``gone``:
    what the clean-up removed) and 128 + the signal, as a shell reports it."""
    restore = on_stop_signals()
    try:
        return body()
    except (Stopped, KeyboardInterrupt) as exc:
        hold_signals()  # to the exit: a second signal must not cut this line short
        sys.stderr.write("npu-shim %s: stopped by %s; %s\n" % (command, signal_name(exc), gone))
        sys.stderr.flush()
        return exit_status(exc)
    finally:
        restore()
