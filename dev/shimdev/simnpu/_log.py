"""The one ordered event log shared by the simulated NPU and zbal's simulated native side."""
from __future__ import annotations

import threading

#: Ordered list of tuples; the first item names the event (see simnpu/__init__.py).
EVENTS: list[tuple] = []
#: Callables given each event as it is logged (the stream sanitizer follows the streams this way).
LISTENERS: list = []
_lock = threading.Lock()


def log(*event) -> None:
    with _lock:
        EVENTS.append(tuple(event))
    for listener in list(LISTENERS):
        listener(event)


def clear_events() -> None:
    with _lock:
        EVENTS.clear()
