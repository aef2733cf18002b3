"""The per-process state record an operator asks for with ``NPU_SHIM_STATE_DIR``.

Each process that imports sglang keeps ``<DIR>/<host>-<pid>.json`` (``python -m npu_shim status
--running`` gathers them): pid, host, role (npu_shim/procinfo.py), shim / sglang / Python versions
and every patch's state, reason and details.  Nothing is written while the variable is unset.

When it is written (always the whole record, atomically: a temporary file in the same directory,
then ``os.replace``, so a reader sees the old or the new record, never half of one):
* synchronously when the patches are decided, when a patch changes state (fails while applying,
  is reverted), when a module's targets are applied, when a wrapper calls ``touch(now=True)``
  (zbal after setting up its heap), and at exit (``atexit``: the final figures);
* by one daemon thread per process (started with the first write) that wakes every
  ``INTERVAL_S`` seconds, or at once on ``touch()``, and rewrites the record only if something in
  it changed -- the details the wrappers keep live (dual-stream path counts, MiB released by MLA,
  the role once sglang sets the process title) reach the file within ``INTERVAL_S`` without any
  cost on their hot paths.
A directory that cannot be written to is said once, in one ERROR line; nothing is ever raised into
the application.
"""

import atexit
import json
import os
import sys
import tempfile
import threading
import time

from npu_shim import config, log, procinfo

FORMAT = 1
INTERVAL_S = 5.0


class _Writer:
    def __init__(self):
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.thread_pid = None
        self.last = None          # the JSON last written (without "updated")
        self.last_pid = None
        self.source = None        # () -> {patch: {"state", "reason", "details"}}, or None
        self.shim_enabled = True
        self.sglang_path = None
        self.atexit_registered = False


_W = _Writer()


def _after_fork_in_child():
    # A lock held by the writer thread at fork time would stay held forever in the child.
    _W.lock = threading.Lock()
    _W.wake = threading.Event()
    _W.thread_pid = None
    _W.last = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def directory():
    """NPU_SHIM_STATE_DIR, or None (unset or invalid: an invalid value is reported once, at
    activation, with the other variables)."""
    try:
        return config.STATE_DIR.read() or None
    except config.ConfigError:
        return None


def path_for(dir_, host=None, pid=None):
    return os.path.join(dir_, "%s-%d.json" % (host or procinfo.host(), pid or os.getpid()))


def attach(source, sglang_path=None, shim_enabled=True):
    """The runtime hands over how to read the patches' records (called once they are decided)."""
    _W.source = source
    _W.sglang_path = sglang_path
    _W.shim_enabled = shim_enabled


def build():
    """The record as a dict (``updated`` left out), or None when the patches' details could not be
    read consistently this time (a wrapper kept mutating one in another thread: try later)."""
    import platform

    from npu_shim import __version__

    patches = {}
    if _W.source is not None:
        for _attempt in range(3):  # a wrapper may be mutating a details dict in another thread
            try:
                patches = json.loads(json.dumps(_W.source(), default=str))
                break
            except RuntimeError:  # "dictionary changed size during iteration"
                continue
        else:
            return None
    return {
        "format": FORMAT,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "host": procinfo.host(),
        "start_ticks": procinfo.start_ticks(),
        "role": procinfo.role(),
        "shim": __version__,
        "shim_enabled": _W.shim_enabled,
        "sglang": procinfo.sglang_version(),
        "sglang_path": _W.sglang_path,
        "python": platform.python_version(),
        "argv": [os.path.basename(sys.argv[0])] + sys.argv[1:4] if sys.argv else [],
        "patches": patches,
    }


def write(force=False):
    """Write the record now if the directory is set and (or ``force``) it changed.  Never raises."""
    dir_ = directory()
    if dir_ is None:
        return False
    try:
        with _W.lock:
            record = build()
            if record is None:
                return False
            text = json.dumps(record, sort_keys=True, default=str)
            if not force and text == _W.last and _W.last_pid == os.getpid():
                return False
            record["updated"] = time.time()
            record["updated_iso"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record["updated"]))
            os.makedirs(dir_, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=dir_, prefix=".%s-%d." % (record["host"], record["pid"]),
                                       suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as handle:
                    json.dump(record, handle, indent=1, sort_keys=True, default=str)
                    handle.write("\n")
                os.chmod(tmp, 0o644)
                os.replace(tmp, path_for(dir_, record["host"], record["pid"]))
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            _W.last, _W.last_pid = text, os.getpid()
    except Exception as exc:  # noqa: BLE001 - never into the application
        log.error_once("statefile", "cannot write the state record to %s=%s: %s (the process runs "
                       "on; no further record is written while this lasts)"
                       % (config.STATE_DIR.name, dir_, exc))
        return False
    _ensure_thread()
    return True


def touch(now=False):
    """Something in a record changed: rewrite it soon (from the writer thread), or ``now``."""
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
    except Exception:  # noqa: BLE001
        pass


def write_off_record(sglang_path=None):
    """A process where the shim is off (NPU_SHIM_ENABLED=0) still says so in its record."""
    attach(None, sglang_path, shim_enabled=False)
    write()
