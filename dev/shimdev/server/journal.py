"""``SIMNPU_JOURNAL_DIR=<dir>``: each process of a test server appends the simulated NPU's events
that tell its story -- zbal's native calls (bootstrap, the graph-pool hooks), the allocator swap
and its ``set_*`` hooks, and every graph event (capture, replay, update, pool) -- to
``<dir>/journal-<pid>.jsonl``, one JSON line each, in the order they happened, with the device
counters at that moment (``live_npu_bytes``: device memory; ``pluggable_bytes``: zbal's heap;
``graph_pool_bytes``: the native allocator's graph pools) and
whether a capture was live on the thread that logged it.  ``SIMNPU_JOURNAL_KINDS=a,b``: events of
those kinds too (``stream_create,wait_stream``: where streams are made, forked and joined).  A test
reads the order of events across a server's processes from outside (``read``)."""
from __future__ import annotations

import json
import os
import threading

#: Events kept: first item exactly one of these, or containing one of GRAPH_WORDS.
KINDS = frozenset({"zbal", "change_allocator", "allocator_fn", "set_device"})
GRAPH_WORDS = ("capture", "graph", "replay", "pool")


def wanted(event) -> bool:
    kind = str(event[0]) if event else ""
    return kind in KINDS or any(word in kind for word in GRAPH_WORDS)


def _capturing() -> bool:
    import torch

    probe = getattr(getattr(torch, "npu", None), "is_current_stream_capturing", None)
    try:
        return bool(probe()) if callable(probe) else False
    except Exception:  # noqa: BLE001 - a probe that cannot answer is no capture to report
        return False


def start(directory: str) -> None:
    """Listen to the simulated NPU's event log for this process's life."""
    from shimdev import simnpu
    from shimdev.simnpu._device import STATE as DEVICE

    path = os.path.join(directory, "journal-%d.jsonl" % os.getpid())
    lock = threading.Lock()
    extra = frozenset(k for k in os.environ.get("SIMNPU_JOURNAL_KINDS", "").split(",") if k)

    def listener(event):
        if not (wanted(event) or (event and event[0] in extra)):
            return
        line = json.dumps({"pid": os.getpid(), "thread": threading.current_thread().name,
                           "event": list(event), "live_npu_bytes": DEVICE.live_npu_bytes,
                           "pluggable_bytes": DEVICE.pluggable_bytes,
                           "graph_pool_bytes": getattr(DEVICE, "graph_pool_bytes", 0),
                           "capturing": _capturing()},
                          default=repr)
        with lock, open(path, "a") as fh:
            fh.write(line + "\n")

    simnpu._log.LISTENERS.append(listener)


def read(directory) -> dict:
    """{pid: [entry, ...]} of every journal in ``directory``, each process's in order."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("journal-") and name.endswith(".jsonl"):
            with open(os.path.join(directory, name)) as fh:
                entries = [json.loads(line) for line in fh if line.strip()]
            if entries:
                out[entries[0]["pid"]] = entries
    return out
