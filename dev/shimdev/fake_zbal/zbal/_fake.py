"""State and recording of the fake zbal (not part of the real API; tests drive it).

``FAKE``  -- knobs: ``init_result`` (zbal_init's return), ``mix`` (is_mix_alloc), ``heap_total`` /
``heap_free`` (bytes, for mem_get_info), ``memfabric_lib_path`` (used when
``MEMFABRIC_HYBRID_LIBRARY_PATH`` is unset; None -> zbal_init fails like the real one without the
memfabric_hybrid package), and what happened: ``initialized``, ``ip_port``, ``backend_registered``.
``CALLS`` -- every public call as ``(name, {param: value, ...})`` with defaults applied; the same is
appended to ``simnpu.EVENTS`` as ``("zbal", name, bound_kwargs)``.
"""
from __future__ import annotations

import functools
import inspect

try:
    from shimdev.simnpu import log as _simnpu_log
except ImportError:  # pragma: no cover - simnpu not on sys.path
    def _simnpu_log(*event):
        pass

GiB = 1 << 30
CALLS: list = []


class _Fake:
    def __init__(self):
        self.reset()

    def reset(self):
        self.init_result = True
        self.mix = False
        self.heap_total = 60 * GiB
        self.heap_free = 60 * GiB
        self.memfabric_lib_path = "/usr/local/memfabric_hybrid/lib"
        self.initialized = False
        self.ip_port = None
        self.version = "1.2.0"
        self.backend_registered = getattr(self, "backend_registered", None)
        CALLS.clear()


FAKE = _Fake()


def reset_fake():
    """Restore FAKE's knobs and clear CALLS (keeps the backend registration)."""
    FAKE.reset()


def recorded(fn):
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = dict(bound.arguments)
        except TypeError:
            arguments = {"args": args, "kwargs": kwargs}
        arguments.pop("self", None)
        name = fn.__qualname__
        CALLS.append((name, arguments))
        _simnpu_log("zbal", name, arguments)
        return fn(*args, **kwargs)

    return wrapper
