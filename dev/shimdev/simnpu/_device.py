"""The simulated ``torch.npu`` namespace (also ``torch_npu.npu``): device, memory, streams, events.

Everything is synchronous CPU work; streams and events only *record* what was asked of them in
``simnpu.EVENTS`` so tests can assert ordering ("side-1 waited for main before ...").
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
import sys
import threading
import types

from ._log import log

MIB = 1 << 20


class _State:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.device_count = 1
        self.device = 0
        self.total_mib = int(os.environ.get("SIMNPU_TOTAL_MIB", 65536))
        free = os.environ.get("SIMNPU_FREE_MIB")
        self.free_mib = int(free) if free is not None else self.total_mib
        self.allocator_backend = "native"
        self.allocator = None  # the NPUPluggableAllocator made current, if any
        self.npu_allocations = 0  # allocations seen on "npu" under record_allocations()
        self.initialized = False  # set by the first call that needs the device, as torch_npu does
        self.stream_ids = itertools.count(1)
        self.event_ids = itertools.count(1)
        self.main_streams: dict[int, Stream] = {}
        self.tls = threading.local()


STATE = _State()


def set_memory(total_mib: int | None = None, free_mib: int | None = None) -> None:
    """Drive ``torch.npu.mem_get_info()``; ``free_mib`` defaults to the (new) total."""
    total = int(total_mib) if total_mib is not None else STATE.total_mib
    if free_mib is not None:
        free = int(free_mib)
    else:
        free = total if total_mib is not None else STATE.free_mib
    if not 0 <= free <= total:
        raise ValueError(f"need 0 <= free_mib ({free}) <= total_mib ({total})")
    STATE.total_mib, STATE.free_mib = total, free


# ------------------------------------------------------------------------------ device

def _initialises(func):
    """A call that initialises the device (torch_npu's lazy init): from then on the allocator can
    no longer be switched."""
    @functools.wraps(func)
    def call(*args, **kwargs):
        STATE.initialized = True
        return func(*args, **kwargs)

    return call


def _dev_index(device=None) -> int:
    if device is None:
        return STATE.device
    if isinstance(device, int):
        return device
    idx = getattr(device, "index", None)
    if idx is not None:
        return idx
    if isinstance(device, str) and ":" in device:
        return int(device.split(":", 1)[1])
    return STATE.device


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return STATE.initialized


@_initialises
def init() -> None:
    pass


def device_count() -> int:
    return STATE.device_count


def current_device() -> int:
    return STATE.device


@_initialises
def set_device(device) -> None:
    i = _dev_index(device)
    STATE.device = i
    log("set_device", i)


def get_device_name(device=None) -> str:
    return "Ascend910_sim"


def get_device_capability(device=None):
    return (0, 0)


@_initialises
def synchronize(device=None) -> None:
    log("synchronize", _dev_index(device))


@_initialises
def empty_cache() -> None:
    log("empty_cache")


@_initialises
def mem_get_info(device=None) -> tuple[int, int]:
    """(free_bytes, total_bytes), driven by ``simnpu.set_memory`` / ``SIMNPU_*_MIB``."""
    return STATE.free_mib * MIB, STATE.total_mib * MIB


@_initialises
def memory_allocated(device=None) -> int:
    return 0


@_initialises
def max_memory_allocated(device=None) -> int:
    return 0


@_initialises
def memory_reserved(device=None) -> int:
    return 0


@_initialises
def reset_peak_memory_stats(device=None) -> None:
    pass


def manual_seed(seed) -> None:
    pass


def manual_seed_all(seed) -> None:
    pass


@contextlib.contextmanager
def device(dev):
    prev = STATE.device
    STATE.device = _dev_index(dev)
    try:
        yield
    finally:
        STATE.device = prev


# ------------------------------------------------------------------------------ streams

class Stream:
    """A named stream: "main" (the default stream of the device), then "side-1", "side-2", ..."""

    def __init__(self, device=None, priority: int = 0, *, name: str | None = None, **_kw):
        STATE.initialized = True
        self.device_index = _dev_index(device)
        self.priority = priority
        self.name = name or f"side-{next(STATE.stream_ids)}"
        log("stream_create", self.name)

    @property
    def device(self):
        return f"npu:{self.device_index}"

    def wait_stream(self, stream: "Stream") -> None:
        log("wait_stream", self.name, stream.name)

    def wait_event(self, event: "Event") -> None:
        log("wait_event", self.name, event.name)

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        log("stream_sync", self.name)

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<simnpu Stream {self.name}>"

    def __eq__(self, other) -> bool:
        return isinstance(other, Stream) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


def _main_stream(idx: int) -> Stream:
    s = STATE.main_streams.get(idx)
    if s is None:
        s = Stream.__new__(Stream)
        s.device_index, s.priority = idx, 0
        s.name = "main" if idx == 0 else f"main-{idx}"
        STATE.main_streams[idx] = s
    return s


def _stack() -> list:
    st = getattr(STATE.tls, "stack", None)
    if st is None:
        st = STATE.tls.stack = []
    return st


@_initialises
def current_stream(device=None) -> Stream:
    st = _stack()
    return st[-1] if st else _main_stream(_dev_index(device))


@_initialises
def default_stream(device=None) -> Stream:
    return _main_stream(_dev_index(device))


@_initialises
def set_stream(stream: Stream) -> None:
    st = _stack()
    if st:
        st[-1] = stream
    else:
        st.append(stream)
    log("set_stream", stream.name)


class StreamContext:
    def __init__(self, stream: Stream | None):
        self.stream = stream

    def __enter__(self):
        if self.stream is not None:
            _stack().append(self.stream)
            log("stream_enter", self.stream.name)
        return self.stream

    def __exit__(self, *exc):
        if self.stream is not None:
            _stack().pop()
            log("stream_exit", self.stream.name)
        return False


def stream(s: Stream | None) -> StreamContext:
    """``with torch.npu.stream(s):`` -- code inside runs "on" ``s`` (see current_stream_name)."""
    return StreamContext(s)


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 *, name: str | None = None, **_kw):
        self.name = name or f"ev-{next(STATE.event_ids)}"
        self.recorded_on: str | None = None

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or current_stream()
        self.recorded_on = stream.name
        log("event_record", self.name, stream.name)

    def wait(self, stream: Stream | None = None) -> None:
        stream = stream or current_stream()
        log("wait_event", stream.name, self.name)

    def synchronize(self) -> None:
        log("event_sync", self.name)

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "Event") -> float:
        return 0.0

    def __repr__(self) -> str:
        return f"<simnpu Event {self.name}>"


# ------------------------------------------------------------------------------ allocator

class _AllocatorHandle:
    """What ``NPUPluggableAllocator.allocator()`` returns: accepts (and ignores) the set_*_fn calls."""

    def __getattr__(self, name):
        if name.startswith("set_"):
            return lambda *a, **k: None
        raise AttributeError(name)


class NPUPluggableAllocator:
    def __init__(self, path_to_so_file, alloc_fn_name: str, free_fn_name: str):
        self.path = str(path_to_so_file)
        self.alloc_fn_name = alloc_fn_name
        self.free_fn_name = free_fn_name
        self._handle = _AllocatorHandle()

    def allocator(self):
        return self._handle

    def __repr__(self) -> str:
        return f"<simnpu NPUPluggableAllocator {self.path} {self.alloc_fn_name}/{self.free_fn_name}>"


def change_current_allocator(allocator: NPUPluggableAllocator) -> None:
    """Like torch_npu: refuses once the device is initialised (``set_device``, a stream, a memory
    query, ...) or NPU memory was allocated (seen by record_allocations)."""
    if STATE.initialized or STATE.npu_allocations:
        raise RuntimeError("Can't swap an already initialized allocator")
    log("change_allocator", allocator.path, allocator.alloc_fn_name, allocator.free_fn_name)
    STATE.allocator = allocator
    STATE.allocator_backend = "pluggable"


def get_allocator_backend() -> str:
    """"native" until change_current_allocator(), then "pluggable"."""
    return STATE.allocator_backend


# ------------------------------------------------------------------------------ the modules

def _make_module(name: str, attrs: dict) -> types.ModuleType:
    from ._stubs import StubModule

    # Unknown attributes fall back to auto stubs (torch_npu.npu has hundreds of names).
    m = StubModule(name)
    m.__path__ = []
    m.__dict__.update(attrs)
    m.__dict__["__simnpu__"] = True
    return m


def build_npu_module() -> types.ModuleType:
    """A fresh ``torch.npu`` namespace (the same object is installed as ``torch_npu.npu``)."""
    me = sys.modules[__name__]
    names = [
        "is_available", "is_initialized", "init", "device_count", "current_device", "set_device",
        "get_device_name", "get_device_capability", "synchronize", "empty_cache", "mem_get_info",
        "memory_allocated", "max_memory_allocated", "memory_reserved", "reset_peak_memory_stats",
        "manual_seed", "manual_seed_all", "device", "Stream", "Event", "current_stream",
        "default_stream", "set_stream", "stream", "StreamContext",
    ]
    npu = _make_module("torch_npu.npu", {n: getattr(me, n) for n in names})
    memory = _make_module("torch_npu.npu.memory", {
        "get_allocator_backend": get_allocator_backend,
        "NPUPluggableAllocator": NPUPluggableAllocator,
        "change_current_allocator": change_current_allocator,
        "mem_get_info": mem_get_info,
        "empty_cache": empty_cache,
        "memory_allocated": memory_allocated,
        "max_memory_allocated": max_memory_allocated,
        "memory_reserved": memory_reserved,
    })
    npu.memory = memory
    npu.get_allocator_backend = get_allocator_backend  # torch.cuda has it at top level too
    npu.config = _make_module("torch_npu.npu.config", {"allow_internal_format": False})
    return npu
