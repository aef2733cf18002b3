"""The shim's state in sglang's own Prometheus metrics (``--enable-metrics``): what a running
server says of the shim outside its processes.

sglang serves ``/metrics`` from the launcher over the multiprocess directory it sets up
(``PROMETHEUS_MULTIPROC_DIR``): every process writes its own values there, the scrape reads them
all.  The shim writes beside them, in each process where sglang itself makes a metrics collector
(the launcher's tokenizer manager, each scheduler; npu_shim/runtime/metrics_hook.py calls
``start``), so it never imports ``prometheus_client`` before sglang has configured it, and no
server or thread of its own is started:

* ``npu_shim_patch_state{patch, state}``: every state of every patch the process decided, 1 for
  the one it is in and 0 for the others (all 0 once ``uninstall()`` ran);
* ``npu_shim_patch_detail{patch, detail}``: each number a patch's details hold (a heap's size,
  the bytes a patch released; a nested group such as ``counts`` under its members' own names);
  docs/operations.md lists them.

Each is a ``liveall`` gauge, one sample per process labelled with its ``pid``, kept by
prometheus_client in ``gauge_liveall_<pid>.db``; sglang's own gauges use other files.  Values
are written when they change (``publish``: a decision, an application, a detail that is not a
count) and when sglang's scheduler logs its own stats (the count details: never per forward).

The directory is where a root process writes: before writing anything ``start`` checks it as the
shim always checked a directory it writes to (``directory_problem``); one that another user could
redirect a file in gets nothing from the shim and one WARNING line.  It then deletes the shim's
files that no live process owns (``sweep``): sglang never marks a process dead, so a dead
process's states -- or a dead run's, under a pid reused by a fresh container -- would be served as
current; a process deletes its own file at a clean exit too.
"""

import atexit
import os
import re
import stat
import sys

from npu_shim.core.framework import STATES
from npu_shim.reporting import log, procinfo

_gauges = None   # {"state", "detail"} once ``start`` ran here; {} where nothing is published
_source = None   # () -> {patch: {"state", "details", ...}}
_shown = []      # the patches whose states this process has written, in order
FILE = re.compile(r"gauge_liveall_([0-9]+)\.db\Z")
#: A file of a live pid older than its process by more than this is a dead run's (the boot time
#: the kernel gives is rounded to seconds, and clocks move).
STALE_MARGIN_S = 5.0
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW


def multiproc_dir(environ=None):
    """The directory prometheus_client writes to (its two names), or None (one process only)."""
    environ = os.environ if environ is None else environ
    return environ.get("PROMETHEUS_MULTIPROC_DIR") or environ.get("prometheus_multiproc_dir") or None


def directory_problem(path):
    """Why ``path`` is no place for a root process's files, or None: every directory from ``/``
    belongs to root or this user and is writable by nobody else unless sticky (``/tmp``); the
    directory itself belongs to this user and is writable by nobody else; none is a symlink
    (each is opened with ``O_NOFOLLOW`` from its parent's descriptor and checked on it)."""
    euid = os.geteuid()
    if not os.path.isabs(path):
        return "is not an absolute path"
    fd = os.open("/", DIR_FLAGS)
    walked = ""
    try:
        for name in [part for part in os.path.normpath(path).split("/") if part]:
            st = os.fstat(fd)
            if st.st_uid not in (0, euid):
                return "is below %s, which belongs to uid %d" % (walked or "/", st.st_uid)
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
                return "is below %s, which others may write to" % (walked or "/")
            walked += "/" + name
            try:
                child = os.open(name, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                return "does not exist (no %s)" % walked
            except OSError as exc:
                return "is a symlink or no directory at %s (%s)" % (walked, os.strerror(exc.errno))
            os.close(fd)
            fd = child
        st = os.fstat(fd)
        if st.st_uid != euid:
            return "belongs to uid %d" % st.st_uid
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return "may be written to by %s" % ("others" if st.st_mode & stat.S_IWOTH else "its group")
        return None
    finally:
        os.close(fd)


def _boot_time():
    try:
        with open("/proc/stat", "rb") as handle:
            for line in handle:
                if line.startswith(b"btime "):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _owner_gone(pid, mtime, boot):
    """Whether no live process wrote the file of ``pid`` last modified at ``mtime``: the pid is
    dead, or its process started after that."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False  # another user's live process
    ticks = procinfo.start_ticks(pid)
    if ticks is None or boot is None:
        return False
    return mtime < boot + ticks / os.sysconf("SC_CLK_TCK") - STALE_MARGIN_S


def sweep(path):
    """Delete the shim's files (``gauge_liveall_<pid>.db``) that no live process owns, this
    process's included: nothing here has opened its own yet (sglang has no ``liveall`` gauge), so
    one that exists is a dead run's under the same pid.  The names deleted."""
    me, boot, gone = os.getpid(), _boot_time(), []
    fd = os.open(path, DIR_FLAGS)
    try:
        for name in os.listdir(fd):
            match = FILE.match(name)
            if not match:
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                pid = int(match.group(1))
                if pid == me or not stat.S_ISREG(st.st_mode) or _owner_gone(pid, st.st_mtime, boot):
                    os.unlink(name, dir_fd=fd)
                    gone.append(name)
            except FileNotFoundError:
                continue  # another process of the server swept it first
    finally:
        os.close(fd)
    return gone


def _forget_own_file(path, pid):
    """At a clean exit: this process's file goes (not in a forked child that exits)."""
    if os.getpid() == pid:
        try:
            os.unlink(os.path.join(path, "gauge_liveall_%d.db" % pid))
        except OSError:
            pass


def _refusal(path, problem):
    """One WARNING line (``log.MAX_LINE`` characters at most: the path comes last, so that a long
    one cuts only itself, never what to do)."""
    log.warning_once("metrics:dir", "npu-shim writes no metrics into PROMETHEUS_MULTIPROC_DIR: it %s; "
                     "sglang's own files go there too (prometheus_client): use a directory only this "
                     "user can write (mkdir -m 0700) or unset it: %s" % (problem, path))


def _usable_dir():
    """True where the shim may write: one process (no directory), or a directory that passes
    ``directory_problem`` (then swept, and this process's file deleted at exit)."""
    path = multiproc_dir()
    if path is None:
        return True
    try:
        problem = directory_problem(path)
    except OSError as exc:
        problem = "cannot be checked (%s)" % exc
    if problem:
        _refusal(path, problem)
        return False
    gone = sweep(path)
    if gone:
        log.debug("metrics: deleted %d file(s) of processes gone: %s" % (len(gone), ", ".join(gone[:8])))
    atexit.register(_forget_own_file, path, os.getpid())
    return True


def start(source):
    """sglang made its metrics collector in this process: make the shim's gauges and publish.
    ``source()`` gives ``{patch: {"state", "details", ...}}``.  Never raises."""
    global _gauges, _source
    _source = source
    if _gauges is None:
        _gauges = {}
        try:
            if _usable_dir():
                from prometheus_client import Gauge

                _gauges = {
                    "state": Gauge("npu_shim_patch_state", "npu-shim: 1 for the state each patch is "
                                   "in, 0 for the others", ["patch", "state"], multiprocess_mode="liveall"),
                    "detail": Gauge("npu_shim_patch_detail", "npu-shim: a number of a patch's details",
                                    ["patch", "detail"], multiprocess_mode="liveall"),
                }
        except Exception as exc:  # noqa: BLE001 - sglang's metrics go on without the shim's
            log.error_once("metrics:start", "the shim's metrics are not published: %r" % (exc,))
    publish()


def numbers(details):
    """(name, number) of ``details``: its numbers, and those of a nested group (``counts``)
    under their own names; text, flags and lists are not published."""
    for key, value in (details or {}).items():
        for name, number in (value.items() if isinstance(value, dict) else ((key, value),)):
            if isinstance(number, (int, float)) and not isinstance(number, bool):
                yield str(name), number


def publish():
    """Write the current values (only once ``start`` ran in this process); never raises.  Every
    state of each patch is written, 0 or 1: a patch that changed state, or that ``uninstall()``
    took away, reads 0 in the states it left."""
    if not _gauges or _source is None or "prometheus_client" not in sys.modules:
        return
    try:
        records = _source() or {}
        for name in records:
            if name not in _shown:
                _shown.append(name)
        for name in _shown:
            current = (records.get(name) or {}).get("state")
            for state in STATES:
                _gauges["state"].labels(patch=name, state=state).set(1 if state == current else 0)
            for key, value in numbers((records.get(name) or {}).get("details")):
                _gauges["detail"].labels(patch=name, detail=key).set(value)
    except Exception:  # noqa: BLE001 - never into the application
        pass
