"""The per-process state record an operator asks for with ``NPU_SHIM_STATE_DIR``.

Each process that imports sglang keeps one JSON file, ``<host>-<pid namespace>-<pid>.json``
(``python -m npu_shim status --running`` gathers them): who wrote it (pid, user, host, boot id, PID
namespace, start time), its role (npu_shim/reporting/procinfo.py), shim / sglang / Python versions, the main
module (never the command line's arguments: they may carry an API key) and every patch's state,
reason and details.  Nothing is written while the variable is unset.

The directory is trusted only as far as the kernel guarantees it (npu_shim/reporting/safe_dir.py): every
directory on the way must belong to root or this user and be writable by nobody else unless it is
sticky, the last one must belong to this user, and nothing is followed through a symlink.  A
sticky directory writable by others (``install -d -m 1777 /dev/shm/npu-shim``: one directory
shared by several users) gets one subdirectory per user, ``uid-<uid>/``.  Every operation is
relative to a directory descriptor opened that way, so nothing can be swapped in between a check
and a write.

When it is written (always the whole record, atomically: a temporary file created exclusively in
the same directory, its mode set through its descriptor, then renamed over the record):
* synchronously when the patches are decided, when a patch changes state, when a module's targets
  are applied, when a wrapper calls ``touch(now=True)`` (a patch that set something up), and at
  exit (``atexit``: the final figures);
* by one daemon thread per process, armed with the first attempt (so a failed first write is
  retried), that wakes every ``INTERVAL_S`` seconds or at once on ``touch()``, rewrites the record
  when something in it changed, and at least every ``HEARTBEAT_S`` seconds in any case: readers
  that cannot see the process (another host, another PID namespace) tell a live record from a
  dead one by that heartbeat;
* in a ``fork()``ed child at once, by its own thread (the parent's record is not the child's).
Temporary files a killed writer left are removed once they are older than ``TEMP_MAX_AGE_S``.
A directory that cannot be written to is said once, in one ERROR line; nothing is ever raised into
the application.
"""

import atexit
import json
import os
import threading
import time

from npu_shim.core import config
from npu_shim.reporting import log, procinfo

FORMAT = 2
INTERVAL_S = 5.0
HEARTBEAT_S = 30.0
MAX_RECORD_BYTES = 256 * 1024  # the reader's cap on one record too (npu_shim/cli/running_records.py)
TEMP_PREFIX = ".npu-shim-"
TEMP_SUFFIX = ".tmp"
TEMP_MAX_AGE_S = 60.0


class _Writer:
    def __init__(self):
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.thread_pid = None
        self.last = None          # the JSON last written (without "updated")
        self.last_pid = None
        self.last_time = 0.0      # time.monotonic() of that write
        self.swept_pid = None     # the process that swept the directory's leftovers
        self.failing = False
        self.atexit_registered = False
        self.attached = None      # state_record.ATTACHED, handed in with the first write


_W = _Writer()


def _after_fork_in_child():
    # A lock held by the writer thread at fork time would stay held forever in the child.
    _W.lock = threading.Lock()
    _W.wake = threading.Event()
    had_record = _W.last_pid is not None or _W.thread_pid is not None
    _W.thread_pid = None
    _W.last = None
    _W.last_pid = None
    if had_record and directory() is not None:
        # The child is another process: it gets its own record while it runs, written by its own
        # thread (not here, so that fork() costs the parent's thread nothing).
        _W.wake.set()
        try:
            _ensure_thread()
        except Exception:  # noqa: BLE001 - never into the application
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def directory():
    """NPU_SHIM_STATE_DIR, or None (unset or invalid: an invalid value is reported once, at
    activation, with the other variables)."""
    try:
        return config.STATE_DIR.read() or None
    except config.ConfigError:
        return None


def record_name(host, pid_ns, pid):
    """The file name of a process's record: host, PID namespace and pid name one process."""
    from npu_shim.reporting import safe_dir  # only where records are written or read

    return "%s-%s-%d.json" % (safe_dir.safe_name(host), pid_ns if pid_ns is not None else "x", pid)


def build():
    """The record as a dict (``updated`` left out), or None when the patches' details could not be
    read consistently this time (a wrapper kept mutating one in another thread: try later)."""
    import platform

    from npu_shim._version import __version__

    attached = _W.attached
    patches = {}
    if attached is not None and attached.source is not None:
        for _attempt in range(3):  # a wrapper may be mutating a details dict in another thread
            try:
                patches = json.loads(json.dumps(attached.source(), default=str))
                break
            except RuntimeError:  # "dictionary changed size during iteration"
                continue
        else:
            return None
    return {
        "format": FORMAT,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "uid": os.geteuid(),
        "host": procinfo.host(),
        "boot_id": procinfo.boot_id(),
        "pid_ns": procinfo.pid_namespace(),
        "start_ticks": procinfo.start_ticks(),
        "role": procinfo.role(),
        "shim": __version__,
        "shim_enabled": attached.shim_enabled if attached is not None else True,
        "sglang": procinfo.sglang_version(),
        "sglang_path": attached.sglang_path if attached is not None else None,
        "python": platform.python_version(),
        "program": procinfo.main_module(),
        "heartbeat_s": HEARTBEAT_S,
        "patches": patches,
    }


def write(force=False, attached=None):
    """Write the record now if the directory is set and (or ``force``) it changed, or its
    heartbeat is due; ``attached``: what the runtime handed state_record (kept for the writer's
    thread and the exit).  Never raises."""
    if attached is not None:
        _W.attached = attached
    dir_ = directory()
    if dir_ is None:
        return False
    try:
        _ensure_thread()  # armed whatever this attempt gives: a failed write is retried by it
        with _W.lock:
            record = build()
            if record is None:
                return False
            text = json.dumps(record, default=str)  # what changed is compared; the file is strict
            beat_due = time.monotonic() - _W.last_time >= HEARTBEAT_S
            if not force and not beat_due and text == _W.last and _W.last_pid == os.getpid():
                return False
            now = time.time()
            record["updated"] = now
            record["updated_iso"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
            data = (json.dumps(record, indent=1, default=str, allow_nan=False)
                    + "\n").encode("utf-8")
            if len(data) > MAX_RECORD_BYTES:
                raise ValueError("the record would be %d bytes, over the %d readers accept"
                                 % (len(data), MAX_RECORD_BYTES))
            from npu_shim.reporting import safe_dir

            with safe_dir.open_for_writing(dir_) as handle:
                if _W.swept_pid != os.getpid():
                    _W.swept_pid = os.getpid()
                    handle.sweep(TEMP_SUFFIX, TEMP_MAX_AGE_S)
                handle.replace_file(record_name(record["host"], record["pid_ns"], record["pid"]),
                                    data, TEMP_PREFIX, TEMP_SUFFIX)
            _W.last, _W.last_pid, _W.last_time = text, os.getpid(), time.monotonic()
            if _W.failing:
                _W.failing = False
                log.info("the state record is written to %s=%s again" % (config.STATE_DIR.name, dir_))
    except Exception as exc:  # noqa: BLE001 - never into the application
        _W.failing = True
        log.error_once("record_writer", "cannot write the state record to %s=%s: %s (retried every "
                       "%gs; said once)" % (config.STATE_DIR.name, dir_, _why(exc), INTERVAL_S))
        return False
    return True


def _why(exc):
    from npu_shim.reporting import safe_dir

    if isinstance(exc, OSError) and exc.strerror and not isinstance(exc, safe_dir.UnsafeDirectory):
        return exc.strerror  # the path is already on the line
    return str(exc.args[-1] if isinstance(exc, safe_dir.UnsafeDirectory) else exc)


def touch(now=False):
    """Something in a record changed: rewrite it soon (from the writer thread), or ``now``
    (the runtime calls state_record.touch)."""
    if _W.thread_pid is None and not now:
        return  # nothing written yet in this process: the first write is synchronous
    if now:
        write()
    else:
        _W.wake.set()


def _ensure_thread():
    if _W.thread_pid == os.getpid():
        return
    _W.thread_pid = os.getpid()
    if not _W.atexit_registered:
        _W.atexit_registered = True
        atexit.register(_final)
    thread = threading.Thread(target=_loop, name="npu-shim-state", daemon=True)
    thread.start()


def _loop():
    pid = os.getpid()
    while _W.thread_pid == pid:
        _W.wake.wait(INTERVAL_S)
        _W.wake.clear()
        try:
            write()
        except Exception:  # noqa: BLE001 - write() never raises; belt and braces for a thread
            pass


def _final():
    try:
        write()
    except Exception:  # noqa: BLE001 - at exit: the process's own exit must not fail over its record
        pass
