"""The simulated ``torch.npu`` namespace (also ``torch_npu.npu``): device, memory, streams, events.

Held to torch-npu 2.13.0 (tests/dev/test_simnpu_conformance.py checks names and parameters against the
wheel): what initialises the device, what refuses an allocator swap and what a stream accepts
follow its Python layer (``torch_npu/npu/utils.py``, ``memory.py``, ``streams.py``, ``__init__.py``)
and, where that calls into C++, Ascend/pytorch's sources as named at each place.

``torch.Generator(device="npu")`` makes an NPU generator (``install_generators``): torch asks the
PrivateUse1 hooks torch_npu registers in C++, which Python cannot register.

Everything is synchronous CPU work; streams and events only *record* what was asked of them in
``simnpu.EVENTS`` so tests can assert ordering ("side-1 waited for main before ...").
"""
from __future__ import annotations

import collections
import ctypes
import itertools
import os
import re
import sys
import threading
import types
import warnings

from . import _api
from ._log import log

MIB = 1 << 20
#: c10::DeviceType::PrivateUse1, the device type torch_npu's streams carry.
PRIVATEUSE1 = 20
#: Keywords ``_NPUStreamBase.__new__`` parses (torch_npu/csrc/npu/Stream.cpp, THNPStream_pynew).
STREAM_KEYWORDS = ("priority", "is_sync_launch", "stream_id", "device_index", "device_type", "stream_ptr")


class _State:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.device_count = int(os.environ.get("SIMNPU_DEVICE_COUNT", 1))
        self.device = 0
        self.total_mib = int(os.environ.get("SIMNPU_TOTAL_MIB", 65536))
        free = os.environ.get("SIMNPU_FREE_MIB")
        self.free_mib = int(free) if free is not None else self.total_mib
        self.allocator_backend = "native"
        self.allocator = None  # the pluggable allocator made current, if any
        self.npu_allocations = 0  # allocations seen on "npu" under record_allocations()
        self.live_npu_bytes = 0  # bytes of the npu tensors alive now on the native allocator
        self.pluggable_bytes = 0  # ... in zbal's heap (simzbal reads it)
        self.heap_active = False  # zbal's heap is bootstrapped (simzbal sets it)
        self.initialized = False  # torch_npu.npu._lazy_init() has run
        self.stream_ids = itertools.count(1)
        self.event_ids = itertools.count(1)
        self.main_streams: dict[int, Stream] = {}
        self.streams: dict = {}  # name -> Stream, and its npu_stream -> name (for graph pool filters)
        self.stream_ptrs: dict = {}
        self.tls = threading.local()
        self.graph_pool_bytes = 0  # what the native allocator's graph pools hold (_graphs.py)
        self.task_queue = None  # set_task_queue_enable's level; None: TASK_QUEUE_ENABLE's
        self.seed = 67280421310721  # the default generator's seed (c10's default_rng_seed_val)
        self.stream_uses: dict = {}  # storage data_ptr -> streams record_stream named


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

def _lazy_init() -> None:
    """torch_npu.npu._lazy_init(): from here on the native allocator is initialised, so it can no
    longer be swapped (NPUCachingAllocator is set up by the C++ init it runs)."""
    STATE.initialized = True


def _get_device_index(device, optional: bool = False) -> int:
    """torch_npu/npu/utils.py ``_get_device_index``: an int as it is; a str or torch.device of type
    npu; an npu ``device`` context; with ``optional`` no index means the current device, found
    through ``torch.npu.current_device()``, which initialises the device."""
    import torch

    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "npu":
            raise ValueError("Expected a npu device, but got: {}".format(device))
        if device.index is not None:
            return device.index
    if isinstance(device, _device_ctx):
        return device.idx
    if optional and (device is None or isinstance(device, torch.device)):
        return current_device()
    raise ValueError("Expected a torch.device with a specified index or an integer, but got:{}".format(device))


def _check_index(device_id: int) -> None:
    if device_id < 0 or device_id >= device_count():
        raise AssertionError("Invalid device id")


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return STATE.initialized


def _is_in_bad_fork() -> bool:
    # torch.manual_seed asks this before seeding the privateuse1 device through manual_seed_all
    return False


def init():
    _lazy_init()


def device_count() -> int:
    return STATE.device_count


def current_device():
    _lazy_init()
    return STATE.device


def set_device(device):
    # the C++ binding (torch_npu/csrc/npu/Module.cpp, THNPModule_setDevice_wrap) runs the lazy init
    device_id = _get_device_index(device, optional=True)
    if device_id >= 0:
        _lazy_init()
        STATE.device = device_id
        log("set_device", device_id)


def get_device_name(device_name=None):
    _check_index(_get_device_index(device_name, optional=True))
    return "Ascend910_sim"


def get_device_capability(device=None):
    """None unless TORCH_NPU_DEVICE_CAPABILITY reads "major.minor", with torch_npu's warning."""
    value = os.getenv("TORCH_NPU_DEVICE_CAPABILITY")
    if not value:
        warnings.warn("You can set the device capability via the environment variable "
                      "TORCH_NPU_DEVICE_CAPABILITY.")
        return None
    match = re.match(r"^(\d+)\.(\d+)$", value)
    if not match:
        warnings.warn("torch.npu.get_device_capability can't parse TORCH_NPU_DEVICE_CAPABILITY "
                      "environment variable: %s." % value)
        return None
    return int(match.group(1)), int(match.group(2))


def synchronize(device=None):
    _lazy_init()
    _graphs().check_call("torch.npu.synchronize()")
    with _device_ctx(device):
        log("synchronize", STATE.device)


def empty_cache():
    # torch_npu/npu/memory.py: nothing to release before the device is initialised
    if is_initialized():
        log("empty_cache")


def mem_get_info(device=None):
    """(free_bytes, total_bytes), driven by ``simnpu.set_memory`` / ``SIMNPU_*_MIB``."""
    if device is None:
        device = current_device()
    _check_index(_get_device_index(device, optional=True))
    _lazy_init()
    _graphs().check_call("torch.npu.mem_get_info()")
    free = max(0, STATE.free_mib * MIB - STATE.live_npu_bytes - STATE.graph_pool_bytes)
    return free, STATE.total_mib * MIB


def memory_stats(device=None):
    # the simulation keeps no allocator statistics: every figure reads as before any allocation
    return collections.OrderedDict(memory_stats_as_nested_dict(device))


def memory_stats_as_nested_dict(device=None):
    if not is_initialized():
        return {}
    _get_device_index(device, optional=True)
    return {}


def memory_allocated(device=None):
    return memory_stats(device=device).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device=None):
    return memory_stats(device=device).get("allocated_bytes.all.peak", 0)


def memory_reserved(device=None):
    return memory_stats(device=device).get("reserved_bytes.all.current", 0)


def max_memory_reserved(device=None):
    return memory_stats(device=device).get("reserved_bytes.all.peak", 0)


def reset_peak_memory_stats(device=None):
    _get_device_index(device, optional=True)


def manual_seed(seed):
    # queued by torch_npu until the device is initialised; refused in a capture unless unchanged
    _graphs().check_seed(seed)
    STATE.seed = int(seed)


def manual_seed_all(seed):
    _graphs().check_seed(seed)
    STATE.seed = int(seed)


def _graphs():
    from . import _graphs

    return _graphs


class _device_ctx:
    """``torch.npu.device(dev)`` (torch_npu/npu/utils.py ``device``): a negative index is a no-op;
    None means the current device, which looking up initialises; entering it initialises too."""

    def __init__(self, device):
        self.idx = _get_device_index(device, optional=True)
        self.prev_idx = -1

    def __enter__(self):
        if self.idx < 0:
            return
        self.prev_idx = STATE.device
        STATE.device = self.idx
        _lazy_init()

    def __exit__(self, *args):
        if self.idx < 0:
            return False
        STATE.device = self.prev_idx if self.prev_idx != -1 else 0
        return False


_device_ctx.__name__ = _device_ctx.__qualname__ = "device"
device = _device_ctx


# ------------------------------------------------------------------------------ streams

class Stream:
    """torch_npu.npu.Stream: ``Stream(device=None, priority=0, **kwargs)``, only the keywords the
    C++ base parses.  Streams are named "main" (the default stream of device 0), then "side-1",
    "side-2", ... (``simnpu.stream_name``)."""

    def __new__(cls, device=None, priority=0, **kwargs):
        unknown = [k for k in kwargs if k not in STREAM_KEYWORDS]
        if unknown:
            raise TypeError("'%s' is an invalid keyword argument for this function" % unknown[0])
        with _device_ctx(device):
            self = object.__new__(cls)
            self._sim_init(STATE.device, "side-%d" % next(STATE.stream_ids))
        log("stream_create", self._sim_name)
        return self

    def _sim_init(self, device_index, name):
        self._sim_device_index = device_index
        self._sim_name = name
        STATE.streams[name] = self
        STATE.stream_ptrs[id(self)] = name

    @property
    def device(self):
        import torch

        return torch.device("npu", self._sim_device_index)

    @property
    def device_index(self):
        return self._sim_device_index

    @property
    def device_type(self):
        return PRIVATEUSE1

    @property
    def stream_id(self):
        return id(self)

    @property
    def npu_stream(self):
        return id(self)

    @property
    def priority(self):
        # torch_npu/csrc/npu/Stream.cpp, THNPStream_get_priority
        raise RuntimeError("NPU dose not support Stream.get_priority() currently.")

    def wait_event(self, event):
        # torch_npu/npu/streams.py: the event waits; a Stream given here has no wait() and raises
        event.wait(self)

    def wait_stream(self, stream):
        # torch_npu: self.wait_event(stream.record_event()); recorded as one step
        stream.record_event  # noqa: B018 - what the real call needs of its argument
        log("wait_stream", self._sim_name, stream._sim_name)
        _graphs().on_stream_edge("wait_stream", self._sim_name, stream._sim_name)

    def record_event(self, event=None):
        if event is None:
            event = Event()
        event.record(self)
        return event

    def query(self):
        _graphs().check_call("Stream.query() (%s)" % self._sim_name)
        return True

    def synchronize(self):
        _graphs().check_call("Stream.synchronize() (%s)" % self._sim_name)
        log("stream_sync", self._sim_name)

    def set_data_preprocess_stream(self, is_data_preprocess_stream=False):
        pass

    def __repr__(self) -> str:
        return f"<simnpu Stream {self._sim_name}>"

    def __eq__(self, other) -> bool:
        return isinstance(other, Stream) and other._sim_name == self._sim_name

    def __hash__(self) -> int:
        return hash(self._sim_name)


def note_stream_use(tensor, stream) -> None:
    """``tensor.record_stream(stream)``: the block now has a use on ``stream`` (its free waits for
    that stream's work; in a capture the native allocator defers it, ``_graphs.defer_free``)."""
    try:
        key = tensor.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - a tensor without a plain storage
        return
    STATE.stream_uses.setdefault(key, set()).add(stream._sim_name)


def stream_name(stream) -> str:
    """The simulation's name of a stream ("main", "side-1", ...)."""
    return stream._sim_name


def _main_stream(idx: int) -> Stream:
    s = STATE.main_streams.get(idx)
    if s is None:
        s = object.__new__(Stream)
        s._sim_init(idx, "main" if idx == 0 else f"main-{idx}")
        STATE.main_streams[idx] = s
    return s


def _stack() -> list:
    st = getattr(STATE.tls, "stack", None)
    if st is None:
        st = STATE.tls.stack = []
    return st


def current_stream_name() -> str:
    """The name of the stream code runs on now, without torch_npu's lazy init (a test's question
    must not initialise the device)."""
    st = _stack()
    return stream_name(st[-1]) if st else stream_name(_main_stream(STATE.device))


def current_stream(device=None):
    _lazy_init()
    st = _stack()
    return st[-1] if st else _main_stream(_get_device_index(device, optional=True))


def default_stream(device=None):
    _lazy_init()
    return _main_stream(_get_device_index(device, optional=True))


def set_stream(stream):
    if stream is None:
        return
    st = _stack()
    if st:
        st[-1] = stream
    else:
        st.append(stream)
    log("set_stream", stream._sim_name)


class StreamContext:
    """``with torch.npu.stream(s):`` -- code inside runs "on" ``s``; creating it looks up the
    current device, which initialises the device (torch_npu/npu/utils.py)."""

    def __init__(self, stream_ctx):
        self.stream = stream_ctx
        self.idx = _get_device_index(None, True)

    def __enter__(self):
        if self.stream is not None:
            _stack().append(self.stream)
            log("stream_enter", self.stream._sim_name)
        return self.stream

    def __exit__(self, exec_type, exec_value, traceback):
        if self.stream is not None:
            _stack().pop()
            log("stream_exit", self.stream._sim_name)
        return False


def stream(stream):
    return StreamContext(stream)


class Event:
    """torch_npu.npu.Event(enable_timing=False, blocking=False, interprocess=False); events are
    named "ev-1", "ev-2", ..."""

    def __new__(cls, enable_timing=False, blocking=False, interprocess=False):
        self = object.__new__(cls)
        self._sim_name = f"ev-{next(STATE.event_ids)}"
        self._sim_recorded_on = None
        return self

    def record(self, stream=None):
        if stream is None:
            stream = current_stream()
        self._sim_recorded_on = stream._sim_name
        log("event_record", self._sim_name, stream._sim_name)
        _graphs().on_stream_edge("event_record", self._sim_name, stream._sim_name)

    def wait(self, stream=None):
        if stream is None:
            stream = current_stream()
        _graphs().on_stream_edge("wait_event", stream._sim_name, self._sim_name)  # joins first
        log("wait_event", stream._sim_name, self._sim_name)

    def query(self):
        _graphs().check_call("Event.query() (%s)" % self._sim_name)
        return True

    def elapsed_time(self, end_event):
        return 0.0

    def synchronize(self):
        _graphs().check_call("Event.synchronize() (%s)" % self._sim_name)
        log("event_sync", self._sim_name)

    @property
    def npu_event(self):
        return id(self)

    def __repr__(self) -> str:
        return f"<simnpu Event {self._sim_name}>"


# ------------------------------------------------------------------------------ allocator

#: The setters of the C++ ``_NPUPluggableAllocator`` (torch_npu/csrc/npu/Module.cpp,
#: RegisterNpuPluggableAllocator; each a string of the 2.13.0 wheel's libtorch_npu.so).
ALLOCATOR_SETTERS = (
    "set_init_fn", "set_reset_fn", "set_memory_fraction_fn", "set_base_alloc_fn", "set_record_stream_fn",
    "set_erase_stream_fn", "set_get_device_stats_fn", "set_reset_peak_status_fn",
    "set_begin_allocate_to_pool", "set_end_allocate_to_pool_fn", "set_release_pool",
)


class _PluggableAllocator:
    """What ``torch_npu._C._npu_customAllocator`` returns.  createCustomAllocator
    (torch_npu/csrc/npu/NPUPluggableAllocator.cpp) initialises it as it makes it, so once it is
    current no allocator can replace it."""

    initialized = True

    def __init__(self, path, alloc_fn_name, free_fn_name):
        self.path, self.alloc_fn_name, self.free_fn_name = path, alloc_fn_name, free_fn_name
        self.functions = {}

    def __getattr__(self, name):
        if name not in ALLOCATOR_SETTERS:
            raise AttributeError("'_NPUPluggableAllocator' object has no attribute %r" % name)

        def setter(func_ptr):
            if not isinstance(func_ptr, int):
                raise TypeError("%s(): incompatible function arguments: a function pointer (int) "
                                "is expected, got %r" % (name, func_ptr))
            self.functions[name] = func_ptr
            log("allocator_fn", name)
        return setter


class _NPUAllocator:
    def __init__(self, allocator):
        self._allocator = allocator

    def allocator(self):
        return self._allocator


class NPUPluggableAllocator(_NPUAllocator):
    """Opens the library and looks up both functions with ctypes, as torch_npu does."""

    def __init__(self, path_to_so_file, alloc_fn_name, free_fn_name):
        allocator = ctypes.CDLL(path_to_so_file)
        alloc_fn = ctypes.cast(getattr(allocator, alloc_fn_name), ctypes.c_void_p).value
        free_fn = ctypes.cast(getattr(allocator, free_fn_name), ctypes.c_void_p).value
        if alloc_fn is None:
            raise RuntimeError("alloc_fn is None")
        if free_fn is None:
            raise RuntimeError("free_fn is None")
        self._allocator = _PluggableAllocator(str(path_to_so_file), alloc_fn_name, free_fn_name)

    def __repr__(self) -> str:
        a = self._allocator
        return f"<simnpu NPUPluggableAllocator {a.path} {a.alloc_fn_name}/{a.free_fn_name}>"


def _current_allocator_initialized() -> bool:
    if STATE.allocator is not None:
        return STATE.allocator.initialized
    return STATE.initialized or bool(STATE.npu_allocations)


def change_current_allocator(allocator):
    """torch_npu's changeCurrentAllocator (NPUPluggableAllocator.cpp) refuses while the current
    allocator is initialised: the native one once the device is (``set_device``, a stream, a
    memory query, an allocation ...), a pluggable one always -- a second swap never works."""
    handle = allocator.allocator()
    if _current_allocator_initialized():
        raise RuntimeError("Can't swap an already initialized allocator")
    log("change_allocator", handle.path, handle.alloc_fn_name, handle.free_fn_name)
    STATE.allocator = handle
    STATE.allocator_backend = "pluggable"


def get_allocator_backend():
    """"native" until change_current_allocator(), then "pluggable" (the C++ allocator's name())."""
    return STATE.allocator_backend


# ------------------------------------------------------------------------------ generators

def _npu_generator_class(torch, base):
    class NPUGenerator(base):
        """What ``torch.Generator(device="npu")`` makes: torch_npu's NPUGeneratorImpl stands here as
        a CPU generator (the npu tensors it draws for are CPU tensors) on the npu device.  Its
        seed and offset follow NPUGeneratorImpl.cpp where a capture is concerned."""

        @property
        def device(self):
            return torch.device("npu", self._sim_device_index)

        def manual_seed(self, seed):
            # NPUGeneratorImpl::set_current_seed: in a capture only the seed it has
            if _graphs().capture_status() is not None and int(seed) != self.initial_seed():
                raise RuntimeError(_graphs().MSG_SEED)
            base.manual_seed(self, seed)
            return self

        def clone_state(self):
            # NPUGeneratorImpl::clone_impl: assertNotCapturing, then a generator on a copy of the state
            _graphs().assert_not_capturing(_graphs().MSG_CLONE_GENERATOR)
            clone = _new_npu_generator(NPUGenerator, base, self._sim_device_index, check=False)
            clone.set_state(self.get_state())
            return clone

        def __repr__(self):
            return "<simnpu Generator npu:%d>" % self._sim_device_index

    return NPUGenerator


def _new_npu_generator(cls, base, index, check=True):
    """``createNPUGenerator(index)`` (NPUGeneratorImpl.cpp): -1 is the current device, an index
    outside the devices is refused; the NPUGeneratorImpl constructor refuses while the current
    stream is captured (``assertNotCapturing``); the seed is c10's default."""
    if index is None or index == -1:
        index = STATE.device
    if not 0 <= index < device_count():
        raise RuntimeError(_graphs().MSG_GENERATOR_DEVICE)
    if check:
        _graphs().assert_not_capturing(_graphs().MSG_NEW_GENERATOR)
    generator = base.__new__(cls, "cpu")
    generator._sim_device_index = index
    return generator


def install_generators(torch) -> None:
    """``torch.Generator(device="npu")`` as torch_npu answers it (torch asks the PrivateUse1 hooks
    torch_npu registers in C++ for ``getNewGenerator``; none can be registered from Python, so
    ``torch.Generator`` is answered here): an npu device makes an ``NPUGenerator``, anything else
    the generator torch makes; ``isinstance(g, torch.Generator)`` holds for every generator."""
    base = torch._C.Generator
    if getattr(torch.Generator, "__simnpu__", False):
        return
    npu_generator = _npu_generator_class(torch, base)

    class _GeneratorType(type(base)):
        def __instancecheck__(cls, instance):
            return isinstance(instance, base)

        def __subclasscheck__(cls, subclass):
            return issubclass(subclass, base)

    class Generator(base, metaclass=_GeneratorType):
        __simnpu__ = True

        def __new__(cls, device=None):
            where = device
            if isinstance(where, str):
                where = torch.device(where)
            if isinstance(where, torch.device) and where.type == "npu":
                return _new_npu_generator(npu_generator, base, where.index)
            return base() if device is None else base(device)

    Generator.__module__, Generator.__qualname__, Generator.__doc__ = "torch", "Generator", base.__doc__
    torch.Generator = Generator


# ------------------------------------------------------------------------------ the modules

class _Config:
    """``torch.npu.config`` (torch_npu/npu/npu_config.py ``_npuConfig``): options are set, never
    read back -- reading one raises AttributeError there too."""

    def __setattr__(self, name, value):
        pass  # torch_npu hands the option to its C++ side; nothing here reads it


class _ApiModule(types.ModuleType):
    """A module answering only the real module's names: what the simulation implements, and an
    inert stub for the rest (``_api`` lists them); any other name raises AttributeError."""

    def __getattr__(self, name):
        if name.startswith("__") or name not in self.__dict__.get("_sim_names", ()):
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        import importlib

        return importlib.import_module(f"{self.__name__}.{name}")  # an inert stub module


def _make_module(name: str, attrs: dict, real_names) -> types.ModuleType:
    m = _ApiModule(name)
    m.__path__ = []
    m.__dict__.update(attrs)
    m.__dict__["_sim_names"] = frozenset(real_names)
    m.__dict__["__simnpu__"] = True
    return m


#: What the simulated ``torch.npu`` implements (every name is one of torch_npu.npu's; the private
#: ones are those torch itself calls on a device module).
NPU_NAMES = ("_lazy_init", "_is_in_bad_fork",
    "is_available", "is_initialized", "init", "device_count", "current_device", "set_device",
    "get_device_name", "get_device_capability", "synchronize", "empty_cache", "mem_get_info",
    "memory_stats", "memory_stats_as_nested_dict", "memory_allocated", "max_memory_allocated",
    "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats", "manual_seed",
    "manual_seed_all", "device", "Stream", "Event", "current_stream", "default_stream", "set_stream",
    "stream", "StreamContext", "get_allocator_backend", "NPUPluggableAllocator", "change_current_allocator",
    # NPU graphs (_graphs.py)
    "NPUGraph", "graph", "graph_pool_handle", "is_current_stream_capturing", "MemPool", "ExternalEvent",
    "graph_task_group_begin", "graph_task_group_end", "graph_task_update_begin", "graph_task_update_end",
    "get_task_queue_enable", "set_task_queue_enable", "host_empty_cache",
)
#: What the simulated ``torch.npu.graphs`` implements (_graphs.py).
GRAPHS_NAMES = ("NPUGraph", "graph", "graph_pool_handle", "is_current_stream_capturing",
                "graph_task_group_begin", "graph_task_group_end", "graph_task_update_begin",
                "graph_task_update_end", "_GraphDispatchMode")
#: What the simulated ``torch.npu.memory`` implements.
MEMORY_NAMES = (
    "get_allocator_backend", "NPUPluggableAllocator", "change_current_allocator", "empty_cache",
    "memory_stats", "memory_stats_as_nested_dict", "memory_allocated", "max_memory_allocated",
    "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats", "is_initialized",
    "MemPool", "host_empty_cache",
)


def build_npu_module() -> types.ModuleType:
    """A fresh ``torch.npu`` namespace (the same object is installed as ``torch_npu.npu``)."""
    from . import _graphs

    me = sys.modules[__name__]

    def find(n):
        return getattr(me, n) if hasattr(me, n) else getattr(_graphs, n)

    npu = _make_module("torch_npu.npu", {n: find(n) for n in NPU_NAMES}, _api.NPU)
    npu.memory = _make_module("torch_npu.npu.memory", {n: find(n) for n in MEMORY_NAMES},
                              _api.MEMORY)
    npu.graphs = _make_module("torch_npu.npu.graphs", {n: getattr(_graphs, n) for n in GRAPHS_NAMES},
                              _api.GRAPHS)
    npu.config = _Config()
    import torch

    install_generators(torch)
    return npu
