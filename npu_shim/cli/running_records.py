"""``python -m npu_shim status --running [DIR]``: what the shim did in the running processes.

Reads the records every sglang process keeps in ``NPU_SHIM_STATE_DIR`` (npu_shim/reporting/record_writer.py)
and puts them in one table, process x patch.  Everything in the directory is hostile input: at
most ``MAX_RECORDS`` files are read, each a regular file of at most ``record_writer.MAX_RECORD_BYTES``
opened without following a symlink or blocking on a FIFO, parsed as strict JSON (no NaN, no
Infinity, bounded nesting) and checked field by field; a file that fails is listed as unreadable
with the reason, and every text a record carries is escaped before it reaches a terminal.

Each record is *live*, *stale* or *suspect*:
* its process can be seen from here (this host's boot and this PID namespace): stale when the
  pid is gone, has exited and awaits its parent, or belongs to a process started at another time;
* it cannot (another host, another container's PID namespace): stale when its heartbeat stopped,
  no rewrite for ``STALE_BEATS`` heartbeats (the record says its heartbeat interval);
* suspect when it is not what it says: the file's owner is not the user the record names, a user
  directory (``uid-N/``) or its files belong to someone else, the file name is not the one its
  writer gives its own record, or the process it names runs as another user or gives no start time.
Stale and suspect records are shown, never counted.  So are the live records of *other users*
(``other``): in a shared (1777) directory anyone can add records of their own processes, and only
root's, the directory owner's and this reader's count -- another user's cannot fail, hide or stand
in for them.  Those trusted users' ``uid-<N>/`` directories are read first, by name, so that no
number of files added beside them pushes their records past the bound.

Problems (exit code EXIT_PROBLEM):
* a live process has a ``failed`` patch;
* processes *disagree*: among live processes of the same sglang version, one patch has different
  states.  Only processes that decided the patch are compared: a process that never imported any
  module a patch targets (a detokenizer on some releases, a helper process) has no state for it,
  which is not a disagreement.  A process where the shim is off (``NPU_SHIM_ENABLED=0``) counts
  as ``disabled`` for every patch, so a server half on, half off disagrees.  Processes of
  different sglang versions are compared separately (two servers sharing a directory).
"""

import json
import math
import os
import re
import stat
import time

from npu_shim.reporting import procinfo, safe_dir, record_writer
from npu_shim.core.framework import FAILED

OFF = "disabled"  # what a patch reads in a process with the shim off
MAX_RECORDS = 4096
STALE_BEATS = 3
PID_MAX = 1 << 22  # the kernel's PID_MAX_LIMIT
_MAX_TEXT = 300
_OLD_NAME = re.compile(r"(?P<host>.+)-(?P<pid>[0-9]+)\.json\Z")  # npu-shim up to the 0.2.2 release (2026-11-30)


class BadRecord(ValueError):
    pass


# -- reading -------------------------------------------------------------------------------------

def _reject_constant(name):
    raise BadRecord("not strict JSON (%s)" % name)


def _finite_float(text):
    value = float(text)
    if not math.isfinite(value):
        raise BadRecord("not strict JSON (a number out of range)")
    return value


def parse(data):
    """A record's bytes as a dict: strict JSON (no NaN or Infinity), an object at the top."""
    try:
        value = json.loads(data.decode("utf-8"), parse_constant=_reject_constant,
                           parse_float=_finite_float)
    except RecursionError:
        raise BadRecord("nested too deeply") from None
    except UnicodeDecodeError:
        raise BadRecord("not UTF-8") from None
    except BadRecord:
        raise
    except ValueError as exc:
        raise BadRecord("not JSON: %s" % exc) from None
    if not isinstance(value, dict):
        raise BadRecord("not a state record (not a JSON object)")
    return value


def _text(value):
    return value[:_MAX_TEXT] if isinstance(value, str) else None


def _int(value, low=0, high=None):
    if isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high):
        return value
    return None


def _role(value):
    if not isinstance(value, dict) or not isinstance(value.get("role"), str):
        return {"role": "unknown"}
    role = {"role": value["role"][:64]}
    for key, item in value.items():
        if isinstance(key, str) and key.endswith(("_rank", "_size")) and _int(item, 0, 1 << 20) is not None:
            role[key[:16]] = item
    return role


def _patches(value):
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRecord("'patches' is not an object")
    patches = {}
    for name, entry in list(value.items())[:64]:
        if not isinstance(entry, dict):
            patches[name[:64]] = {"state": "?", "reason": None, "details": {}}
            continue
        details = entry.get("details")
        patches[name[:64]] = {"state": _text(entry.get("state")) or "?",
                              "reason": _text(entry.get("reason")),
                              "details": details if isinstance(details, dict) else {}}
    return patches


def validate(raw):
    """The fields ``status --running`` uses, each of its type or None; BadRecord when the record
    cannot name a process (no valid pid or host) or its patches are not an object."""
    pid = _int(raw.get("pid"), 1, PID_MAX)
    if pid is None:
        raise BadRecord("'pid' is not a process id")
    host = _text(raw.get("host"))
    if not host:
        raise BadRecord("'host' is not a host name")
    updated = raw.get("updated")
    heartbeat = raw.get("heartbeat_s")
    return {
        "format": _int(raw.get("format")),
        "pid": pid,
        "ppid": _int(raw.get("ppid")),
        "uid": _int(raw.get("uid")),
        "host": host,
        "boot_id": _text(raw.get("boot_id")),
        "pid_ns": _int(raw.get("pid_ns")),
        "start_ticks": _int(raw.get("start_ticks")),
        "role": _role(raw.get("role")),
        "shim": _text(raw.get("shim")),
        "shim_enabled": raw.get("shim_enabled") is not False,
        "sglang": _text(raw.get("sglang")),
        "sglang_path": _text(raw.get("sglang_path")),
        "python": _text(raw.get("python")),
        "program": _text(raw.get("program")),
        "heartbeat_s": float(heartbeat) if isinstance(heartbeat, (int, float)) and not isinstance(
            heartbeat, bool) and 0 < heartbeat <= 3600 else None,
        "updated": float(updated) if isinstance(updated, (int, float)) and not isinstance(updated, bool) else None,
        "patches": _patches(raw.get("patches")),
    }


def _entries(dir_fd, skip=()):
    """(subdirectory or '', name) of the record files: ``*.json`` in the directory (sub None) and
    its ``uid-<N>/`` subdirectories (real ones only; those in ``skip`` left out), sorted; at most
    MAX_RECORDS + 1 of them, so a directory of millions costs no more than that."""
    found = []
    with os.scandir(dir_fd) as listing:
        for entry in listing:
            name = entry.name
            if name.startswith(".") or name in skip:
                continue  # temporary files of a write in progress
            if name.endswith(".json"):
                found.append(("", name))
            elif name.startswith(safe_dir.USER_DIR_PREFIX) and entry.is_dir(follow_symlinks=False):
                found.append((name, None))
            if len(found) > MAX_RECORDS:
                break
    return sorted(found)


def trusted_uids(top_owner):
    """Whose records count: root's, the directory's owner's and this reader's.  In a shared (1777)
    directory anyone may add files; another user's records are shown, never counted, so that they
    cannot fail, hide or stand in for the ones that count."""
    return {0, top_owner, os.geteuid()}


def load(dir_):
    """[(file name, record dict or None, error or None, file facts)] for the records in ``dir_``.
    Raises OSError when ``dir_`` itself cannot be opened or listed.

    The ``uid-<N>/`` directories of the trusted users (``trusted_uids``) are opened by name and
    read first, up to MAX_RECORDS; the rest of the directory is listed and read after them, up to
    MAX_RECORDS more: no number of files another user adds can push a trusted record out."""
    fd = os.open(dir_, safe_dir.DIR_FLAGS)
    try:
        top_owner = os.fstat(fd).st_uid
        uids = trusted_uids(top_owner)
        trusted = sorted(safe_dir.user_dir_name(uid) for uid in uids)
        found = []
        for sub in trusted:
            if _is_dir_here(fd, sub):
                found.extend(_read_user_dir(fd, sub, MAX_RECORDS - len(found), uids))
        found = _capped(found, "records in the directories of %s" % ", ".join(trusted))
        rest = []
        for sub, name in _entries(fd, skip=trusted):
            if name is not None:
                rest.append(_read_one(fd, name, name, top_owner, None, uids))
            else:
                rest.extend(_read_user_dir(fd, sub, MAX_RECORDS - len(rest), uids))
            if len(rest) >= MAX_RECORDS:
                break
        return found + _capped(rest, "records")
    finally:
        os.close(fd)


def _is_dir_here(fd, name):
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _capped(found, what):
    if len(found) >= MAX_RECORDS:
        del found[MAX_RECORDS:]
        found.append(("...", None, "more than %d %s: the rest were not read" % (MAX_RECORDS, what), {}))
    return found


def _read_user_dir(fd, sub, room, uids):
    """The records of one user's subdirectory ``uid-<N>/`` (at most ``room``, plus one to show
    there are more)."""
    try:
        sub_fd = os.open(sub, safe_dir.DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
    except OSError as exc:
        return [(sub + "/", None, "%s: %s" % (type(exc).__name__, exc.strerror), {})]
    try:
        owner = os.fstat(sub_fd).st_uid
        return [_read_one(sub_fd, inner, sub + "/" + inner, owner, sub, uids)
                for _sub, inner in _entries(sub_fd)[:room + 1] if inner is not None]
    finally:
        os.close(sub_fd)


def _read_one(dir_fd, name, shown, dir_owner, user_dir, uids):
    try:
        data, st = safe_dir.read_regular(dir_fd, name, record_writer.MAX_RECORD_BYTES)
        record = validate(parse(data))
    except OSError as exc:
        return shown, None, "%s: %s" % (type(exc).__name__, exc.strerror or exc), {}
    except ValueError as exc:  # BadRecord, and read_regular's refusals
        return shown, None, str(exc), {}
    facts = {"name": name, "owner": st.st_uid, "dir_owner": dir_owner, "user_dir": user_dir,
             "trusted": st.st_uid in uids}
    return shown, record, None, facts


# -- judging -------------------------------------------------------------------------------------

def suspicion(record, facts):
    """Why a record is not what it says, from its file alone; None when nothing is wrong."""
    owner, uid = facts.get("owner"), record.get("uid")
    user_dir = facts.get("user_dir")
    if user_dir is not None:
        if user_dir != safe_dir.user_dir_name(facts.get("dir_owner")):
            return "its directory %s/ belongs to uid %s" % (user_dir, facts.get("dir_owner"))
        if owner != facts.get("dir_owner"):
            return "the file belongs to uid %s, not to the owner of %s/" % (owner, user_dir)
    elif owner != facts.get("dir_owner") and owner != 0:
        return "the file belongs to uid %s, who owns neither the directory nor is root" % owner
    if uid is not None and owner is not None and uid != owner:
        return "the file belongs to uid %s, the record says it was written by uid %s" % (owner, uid)
    name = facts.get("name")
    if name is not None:
        if record.get("format") is not None and record["format"] >= 2:
            expected = record_writer.record_name(record["host"], record.get("pid_ns"), record["pid"])
        else:
            old = _OLD_NAME.match(name)
            expected = name if old and int(old.group("pid")) == record["pid"] else None
        if name != expected:
            return "named %s, but its writer would name it %s" % (name, expected or "otherwise")
    return None


def visible_here(record, here):
    """Whether this process can see the record's process (same boot of this host, same PID
    namespace); records of npu-shim up to the 0.2.2 release name only the host."""
    if record.get("pid_ns") is None and record.get("boot_id") is None:
        return record["host"] == here["host"]
    return (record.get("boot_id") == here["boot_id"] and record.get("pid_ns") == here["pid_ns"]
            and record["host"] == here["host"])


def judge(record, here, now=None):
    """("live" | "stale" | "suspect", why or None) of a record whose file checked out."""
    if visible_here(record, here):
        pid = record["pid"]
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "stale", "pid %d is not running" % pid
        except PermissionError:
            pass  # it exists, as another user
        except (OSError, OverflowError):
            return "suspect", "pid %d cannot be looked up" % pid
        if procinfo.is_zombie(pid):
            return "stale", "pid %d has exited" % pid
        recorded, started = record.get("start_ticks"), procinfo.start_ticks(pid)
        if recorded is None and started is not None:
            return "suspect", "it names running pid %d but gives no start time to prove it" % pid
        if recorded is not None and started is not None and recorded != started:
            return "stale", "pid %d now belongs to a later process" % pid
        runs_as = procinfo.process_uid(pid)
        if record.get("uid") is not None and runs_as is not None and runs_as != record["uid"]:
            return "suspect", "pid %d runs as uid %d, not as the uid %d it names" % (pid, runs_as, record["uid"])
        return "live", None
    if record.get("boot_id") and record.get("boot_id") != here["boot_id"] and record["host"] == here["host"]:
        return "stale", "written before this host last booted"
    beat = record.get("heartbeat_s")
    if beat is None:
        return "live", None  # npu-shim up to the 0.2.2 release (2026-11-30): no heartbeat to judge by
    updated = record.get("updated")
    now = time.time() if now is None else now
    if updated is None:
        return "suspect", "no time of its last update"
    if now - updated > STALE_BEATS * beat + record_writer.INTERVAL_S:
        return "stale", "no heartbeat for %ds" % (now - updated)
    return "live", None


def this_process():
    return {"host": procinfo.host(), "boot_id": procinfo.boot_id(), "pid_ns": procinfo.pid_namespace()}


def is_stale(record):
    """True when the record's process is known not to run any more."""
    return judge(record, this_process())[0] == "stale"


def patch_states(record):
    """{patch: state} of one record (the shim off: every known patch ``disabled``)."""
    return {name: p.get("state") for name, p in (record.get("patches") or {}).items()}


def analyse(dir_):
    """Everything ``status --running`` prints, as one dict (OSError: ``dir_`` cannot be read)."""
    entries = load(dir_)
    here = this_process()
    processes, unreadable = [], []
    for name, record, error, facts in entries:
        if record is None:
            unreadable.append({"file": name, "error": error})
            continue
        record = dict(record)
        record["file"] = name
        why = suspicion(record, facts)
        status = "suspect" if why else None
        if status is None:
            status, why = judge(record, here)
        if status == "live" and not facts.get("trusted", True):
            status, why = "other", "uid %s's: another user's records are not counted" % facts["owner"]
        record["status"], record["why"] = status, why
        record["stale"] = status == "stale"
        processes.append(record)
    live = [p for p in processes if p["status"] == "live"]
    from npu_shim.patches.registry import known_names

    seen_names = {n for p in processes for n in patch_states(p)}
    names = [n for n in known_names() if n in seen_names]  # registry order, then any other
    names += sorted(seen_names - set(names))
    problems = []
    for p in live:
        for name, state in patch_states(p).items():
            if state == FAILED:
                problems.append({"kind": "failed", "patch": name, "pid": p["pid"], "host": p["host"],
                                 "reason": p["patches"][name]["reason"]})
    by_version = {}
    for p in live:
        by_version.setdefault(p.get("sglang"), []).append(p)
    for version, group in sorted(by_version.items(), key=lambda item: str(item[0])):
        for name in names:
            seen = {}
            for p in group:
                state = OFF if p.get("shim_enabled") is False else patch_states(p).get(name)
                if state is not None:
                    seen.setdefault(state, []).append(p["pid"])
            if len(seen) > 1:
                problems.append({"kind": "disagree", "patch": name, "sglang": version,
                                 "states": {s: sorted(pids) for s, pids in seen.items()}})
    return {"dir": dir_, "patches": names, "processes": processes, "unreadable": unreadable,
            "live": len(live), "stale": sum(p["status"] == "stale" for p in processes),
            "other": sum(p["status"] == "other" for p in processes),
            "suspect": sum(p["status"] == "suspect" for p in processes), "problems": problems}
