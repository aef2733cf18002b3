"""Who this process is, as far as it can tell: its sglang role and ranks, versions, host.

sglang runs one launcher process (``python -m sglang.launch_server``: tokenizer manager and HTTP
server), one scheduler per TP/PP/DP rank, a detokenizer, and with DP attention a data-parallel
controller -- all spawned children with the same command line.  The role is learned, best source
first:

1. the scheduler's own arguments, seen by the shim's wrapper of ``run_scheduler_process`` before
   its body runs (npu_shim/runtime/role.py calls ``note_scheduler``): role and ranks with their
   sizes, e.g. ``tp 3/16``;
2. the process title sglang sets (``sglang::scheduler_DP0_TP3``, ``sglang::detokenizer``,
   ``sglang::data_parallel_controller``, ``sglang::tokenizer_worker:PID``), read through the
   ``setproctitle`` module sglang itself imported -- ranks without sizes;
3. the target a spawned child was started with (``run_detokenizer_process`` is the detokenizer),
   noted as the child starts it -- before sglang sets the title;
4. the main module: ``sglang.launch_server`` is the launcher/HTTP server -- in the launcher only:
   a spawned child re-imports that module as ``__mp_main__`` without being the launcher;
5. otherwise ``unknown``.  A spawned scheduler decides its patches while ``run_scheduler_process``
   is being unpickled: it is ``unknown`` then, and its summary line waits for 1.

Nothing here imports anything heavy; every answer is computed when asked (titles change).
"""

import os
import re
import socket
import sys

_noted = None  # the role a wrapper told us (note_scheduler)
_TITLE = re.compile(r"sglang::(?P<role>[a-z_]+?)(?:_(?P<ranks>(?:[A-Z_]+[0-9]+_?)+))?(?::\d+)?\Z")
_RANK = re.compile(r"([A-Z_]+?)([0-9]+)")
_MAIN_ROLES = {"sglang.launch_server": "http_server"}
#: The functions sglang starts its other children with (sglang/srt/managers/*.py), by name.
_TARGET_ROLES = {"run_detokenizer_process": "detokenizer",
                 "run_data_parallel_controller_process": "data_parallel_controller"}
_sglang_version = None  # note_sglang_version: the running sglang's, once its source is read


def note_scheduler(source, tp_rank=None, tp_size=None, pp_rank=None, pp_size=None, dp_rank=None,
                   dp_size=None):
    """A scheduler's ranks, from its own arguments (the most reliable source: ``source`` says which
    call's)."""
    global _noted
    role = {"role": "scheduler", "source": source}
    for key, value in (("tp_rank", tp_rank), ("tp_size", tp_size), ("pp_rank", pp_rank),
                       ("pp_size", pp_size), ("dp_rank", dp_rank), ("dp_size", dp_size)):
        if isinstance(value, int) and not isinstance(value, bool):
            role[key] = value
    _noted = (os.getpid(), role)


def note_child_target(target):
    """A spawned child is about to run ``target``: its role, where the target's name says it."""
    global _noted
    name = getattr(target, "__name__", None)
    if name in _TARGET_ROLES and (_noted is None or _noted[0] != os.getpid()):
        _noted = (os.getpid(), {"role": _TARGET_ROLES[name], "source": "process target %s" % name})


def _title():
    module = sys.modules.get("setproctitle")
    try:
        return module.getproctitle() if module is not None else None
    except Exception:  # noqa: BLE001 - the application's setproctitle: a title is optional
        return None


def role_from_title(title):
    """{"role", ranks...} from an sglang process title, or None."""
    match = _TITLE.match((title or "").strip())
    if not match:
        return None
    role = {"role": match.group("role"), "source": "process title"}
    for name, number in _RANK.findall(match.group("ranks") or ""):
        role[name.strip("_").lower() + "_rank"] = int(number)
    return role


def role():
    """This process's role, as a dict: always "role" and "source", ranks where known."""
    if _noted is not None and _noted[0] == os.getpid():
        return dict(_noted[1])
    titled = role_from_title(_title())
    if titled:
        return titled
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None)
    if name in _MAIN_ROLES and getattr(main, "__name__", None) == "__main__":
        return {"role": _MAIN_ROLES[name], "source": "main module %s" % name}
    return {"role": "unknown", "source": "no sglang role seen yet"}


def role_label(info=None):
    """Short text for a log tag: ``tp 3/16``, ``scheduler dp 0 tp 3``, ``detokenizer``, ''
    (unknown)."""
    info = role() if info is None else info
    kind = info.get("role")
    if kind == "unknown":
        return ""
    parts = [] if kind == "scheduler" and "tp_rank" in info else [kind]
    for axis in ("dp", "pp", "tp"):
        rank = info.get(axis + "_rank")
        if rank is None:
            continue
        size = info.get(axis + "_size")
        if axis != "tp" and size == 1:
            continue  # pp 0/1, dp 0/1 say nothing
        parts.append("%s %d%s" % (axis, rank, "/%d" % size if size else ""))
    return " ".join(parts)


def host():
    try:
        return socket.gethostname()
    except Exception:  # noqa: BLE001 - a log line still needs a host
        return "localhost"


def start_ticks(pid=None):
    """The process's start time in clock ticks since boot (Linux ``/proc/PID/stat``), or None: with
    the pid it names one process, even after the pid is reused."""
    try:
        with open("/proc/%s/stat" % (int(pid) if pid else "self"), "rb") as handle:
            data = handle.read(4096)
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, OverflowError, TypeError, IndexError):
        return None


def note_sglang_version(version):
    """The running sglang's version, read from its source (the runtime, or the off line)."""
    global _sglang_version
    _sglang_version = version


def sglang_version():
    return _sglang_version
