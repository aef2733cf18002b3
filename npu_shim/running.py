"""``python -m npu_shim status --running [DIR]``: what the shim did in the running processes.

Reads the records every sglang process keeps in ``NPU_SHIM_STATE_DIR`` (npu_shim/statefile.py)
and puts them in one table, process x patch.  A record is *stale* when it names a process of this
host that no longer runs (its pid is gone, or now belongs to a process started at another time);
stale records are shown, never counted (an exited process its parent has not reaped yet is stale
too).  Records of other hosts (a shared directory) cannot be
checked and count as live.

Problems (exit code EXIT_RUNNING_PROBLEM):
* a live process has a ``failed`` patch;
* processes *disagree*: among live processes of the same sglang version, one patch has different
  states.  Only processes that decided the patch are compared: a process that never imported any
  module a patch targets (a detokenizer on some releases, a helper process) has no state for it,
  which is not a disagreement.  A process where the shim is off (``NPU_SHIM_ENABLED=0``) counts
  as ``disabled`` for every patch, so a server half on, half off disagrees.  Processes of
  different sglang versions are compared separately (two servers sharing a directory).
"""

import json
import os
import sys
import time

from npu_shim import procinfo
from npu_shim.framework import FAILED

OFF = "disabled"  # what a patch reads in a process with the shim off


def load(dir_):
    """[(file name, record dict or None, error or None)] for the records in ``dir_``."""
    found = []
    for name in sorted(os.listdir(dir_)):
        if name.startswith(".") or not name.endswith(".json"):
            continue  # temporary files of a write in progress
        path = os.path.join(dir_, name)
        try:
            with open(path, encoding="utf-8") as handle:
                record = json.load(handle)
            if not isinstance(record, dict) or not isinstance(record.get("pid"), int):
                raise ValueError("not a state record")
            found.append((name, record, None))
        except (OSError, ValueError) as exc:
            found.append((name, None, "%s: %s" % (type(exc).__name__, exc)))
    return found


def is_stale(record, this_host=None):
    """True when the record's process is known not to run any more (this host only)."""
    if record.get("host") != (this_host or procinfo.host()):
        return False
    pid = record["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # it exists, as another user
    except OSError:
        return False
    if procinfo.is_zombie(pid):
        return True  # exited, not yet reaped by its parent
    recorded, now = record.get("start_ticks"), procinfo.start_ticks(pid)
    return recorded is not None and now is not None and recorded != now  # the pid was reused


def patch_states(record):
    """{patch: state} of one record (the shim off: every known patch ``disabled``)."""
    patches = record.get("patches") or {}
    return {name: (p.get("state") if isinstance(p, dict) else None) for name, p in patches.items()}


def analyse(dir_):
    """Everything ``status --running`` prints, as one dict."""
    entries = load(dir_)
    host = procinfo.host()
    processes, unreadable = [], []
    for name, record, error in entries:
        if record is None:
            unreadable.append({"file": name, "error": error})
            continue
        record = dict(record)
        record["file"] = name
        record["stale"] = is_stale(record, host)
        processes.append(record)
    live = [p for p in processes if not p["stale"]]
    from npu_shim.patches import known_names

    seen_names = {n for p in processes for n in patch_states(p)}
    names = [n for n in known_names() if n in seen_names]  # registry order, then any other
    names += sorted(seen_names - set(names))
    problems = []
    for p in live:
        for name, state in patch_states(p).items():
            if state == FAILED:
                problems.append({"kind": "failed", "patch": name, "pid": p["pid"], "host": p.get("host"),
                                 "reason": (p["patches"][name] or {}).get("reason")})
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
            "live": len(live), "stale": len(processes) - len(live), "problems": problems}


def role_text(record):
    role = record.get("role") or {}
    label = procinfo.role_label(role) if isinstance(role, dict) else ""
    if role.get("role") == "scheduler" and label and not label.startswith("scheduler"):
        label = "scheduler " + label
    return label or "unknown"


def state_text(record, name):
    if record.get("shim_enabled") is False:
        return "off"
    entry = (record.get("patches") or {}).get(name)
    if not isinstance(entry, dict):
        return "-"
    text = entry.get("state") or "?"
    details = entry.get("details") or {}
    extra = []
    if details.get("mode"):
        extra.append(str(details["mode"]))
    if isinstance(details.get("gva_mib"), int):
        extra.append("%d MiB" % details["gva_mib"])
    if details.get("released_mib") is not None:
        extra.append("-%s MiB" % details["released_mib"])
    return text + ("(%s)" % ", ".join(extra) if extra else "")


def print_table(info, out=None):
    out = (out or sys.stdout).write
    out("npu-shim status --running: %s -- %d live process(es), %d stale\n"
        % (info["dir"], info["live"], info["stale"]))
    if not info["processes"]:
        out("  no state records (set NPU_SHIM_STATE_DIR to this directory in the server's "
            "environment)\n")
    headers = ["host", "pid", "role", "shim", "sglang"] + info["patches"] + ["updated"]
    rows = []
    now = time.time()
    for p in sorted(info["processes"], key=lambda r: (r.get("host") or "", r["pid"])):
        updated = p.get("updated")
        age = "%ds ago" % max(0, now - updated) if isinstance(updated, (int, float)) else "?"
        rows.append([str(p.get("host")), str(p["pid"]), role_text(p), str(p.get("shim")),
                     str(p.get("sglang"))] + [state_text(p, n) for n in info["patches"]]
                    + [age + (" STALE (not running)" if p["stale"] else "")])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    for row in [headers] + rows:
        out("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() + "\n")
    for bad in info["unreadable"]:
        out("  unreadable: %s (%s)\n" % (bad["file"], bad["error"]))
    for problem in info["problems"]:
        if problem["kind"] == "failed":
            out("PROBLEM: %s failed in pid %s on %s: %s\n"
                % (problem["patch"], problem["pid"], problem["host"], problem["reason"]))
        else:
            out("PROBLEM: processes of sglang %s disagree on %s: %s\n" % (
                problem["sglang"], problem["patch"],
                "; ".join("%s in pid %s" % (s, ", ".join(map(str, pids)))
                          for s, pids in sorted(problem["states"].items()))))
    if not info["problems"] and info["live"]:
        out("ok: no failed patch, every live process agrees\n")
