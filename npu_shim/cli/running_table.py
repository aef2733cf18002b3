"""``status --running``'s table: one row per process, one column per patch, from what
npu_shim/cli/running_records.py read and judged (``analyse``)."""

import sys
import time

from npu_shim.core.framework import Details
from npu_shim.reporting import procinfo
from npu_shim.reporting.terminal import printable

def role_text(record):
    role = record.get("role") or {}
    label = procinfo.role_label(role)
    if role.get("role") == "scheduler" and label and not label.startswith("scheduler"):
        label = "scheduler " + label
    return label or "unknown"


def state_text(record, name, patches=None):
    """A table cell: the patch's state, and the details its patch says are worth a column
    (``Report.running``; ``patches``: {name: Patch}, the registered ones by default)."""
    if record.get("shim_enabled") is False:
        return "off"
    entry = (record.get("patches") or {}).get(name)
    if not isinstance(entry, dict):
        return "-"
    text = entry.get("state") or "?"
    patch = (registered_patches() if patches is None else patches).get(name)
    extra = patch.report.running(Details(entry.get("details"))) if patch is not None else []
    return text + ("(%s)" % ", ".join(extra) if extra else "")


def registered_patches():
    """{name: Patch} of the registered patches (loaded once per command)."""
    if not _PATCHES:
        from npu_shim.core.loading import load_all

        _PATCHES.update((patch.name, patch) for patch in load_all())
    return _PATCHES


_PATCHES = {}


def _age(updated, now):
    if updated is None:
        return "?"
    return "%ds ago" % max(0, now - updated) if now >= updated else "in %ds (clock ahead)" % (updated - now)


def print_table(info, out=None):
    write = (out or sys.stdout).write

    def out_line(text):
        write(printable(text) + "\n")

    out_line("npu-shim status --running: %s -- %d live process(es), %d stale%s%s"
             % (info["dir"], info["live"], info["stale"],
                ", %d suspect" % info["suspect"] if info.get("suspect") else "",
                ", %d of other users" % info["other"] if info.get("other") else ""))
    if not info["processes"]:
        out_line("  no state records (set NPU_SHIM_STATE_DIR to this directory in the server's "
                 "environment)")
    headers = ["host", "pid", "role", "shim", "sglang"] + [printable(n[:40]) for n in info["patches"]] + ["updated"]
    rows = []
    now = time.time()
    for p in sorted(info["processes"], key=lambda r: (r["host"], r["pid"], r["file"])):
        flag = {"stale": " STALE (%s)", "suspect": " SUSPECT (%s)", "other": " OTHER USER (%s)"}.get(p["status"])
        rows.append([p["host"][:64], str(p["pid"]), role_text(p)[:40], str(p.get("shim"))[:20],
                     str(p.get("sglang"))[:20]] + [state_text(p, n)[:60] for n in info["patches"]]
                    + [_age(p.get("updated"), now) + (flag % p["why"] if flag else "")])
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    for row in [headers] + rows:
        out_line("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    for bad in info["unreadable"]:
        out_line("  unreadable: %s (%s)" % (bad["file"], bad["error"]))
    for problem in info["problems"]:
        if problem["kind"] == "failed":
            out_line("PROBLEM: %s failed in pid %s on %s: %s"
                     % (problem["patch"], problem["pid"], problem["host"], problem["reason"]))
        else:
            out_line("PROBLEM: processes of sglang %s disagree on %s: %s" % (
                problem["sglang"], problem["patch"],
                "; ".join("%s in pid %s" % (s, ", ".join(map(str, pids)))
                          for s, pids in sorted(problem["states"].items()))))
    if info.get("suspect"):
        out_line("WARNING: %d record(s) are not what they say (SUSPECT above): not counted; look "
                 "at who can write to %s" % (info["suspect"], info["dir"]))
    if not info["problems"] and info["live"]:
        out_line("ok: no failed patch, every live process agrees")

