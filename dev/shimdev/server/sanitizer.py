"""The stream sanitizer for the whole life of a server process (``SIMNPU_SANITIZE_DIR``).

``run_for_process(directory)`` starts a sanitizer (simnpu/_sanitizer.py) that is never stopped,
and a daemon thread that rewrites ``<directory>/sanitizer-<pid>.json`` every half second (and
at once after a report): the process's title (sglang names its processes, e.g.
``sglang::scheduler``), how many kernels it saw, on which streams, and every report.  A test
reads the file while the server runs; a process killed loses at most its last half second.

The sanitizer follows the thread that started it (a dispatch mode is per thread): in sglang the
scheduler's forward passes run on its main thread.
"""
from __future__ import annotations

import json
import os
import threading

INTERVAL = 0.5


def _title() -> str:
    try:
        with open("/proc/self/cmdline", "rb") as fh:
            return fh.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return "?"


def snapshot(san) -> dict:
    with san.lock:
        return {"pid": os.getpid(), "title": _title(), "launches": san.launches,
                "streams": sorted(san.clocks.streams),
                "reports": [r.as_dict() for r in san.reports]}


def _write(path: str, data: dict) -> None:
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def run_for_process(directory: str):
    from shimdev.simnpu import _sanitizer

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "sanitizer-%d.json" % os.getpid())
    san = _sanitizer.Sanitizer()
    san.enable()
    reported = threading.Event()
    original = san.report

    def report(*args, **kwargs):
        out = original(*args, **kwargs)
        reported.set()
        return out

    san.report = report

    def keep_written():
        while True:
            reported.wait(INTERVAL)
            reported.clear()
            try:
                _write(path, snapshot(san))
            except Exception:  # noqa: BLE001 - a full disk must not take the server down
                pass

    threading.Thread(target=keep_written, name="simnpu-sanitizer-writer", daemon=True).start()
    _write(path, snapshot(san))
    return san
