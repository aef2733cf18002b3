"""NPU graphs in the simulated NPU, held to torch-npu 2.13.0 (``torch_npu/npu/graphs.py``; the C++
behind it is Ascend/pytorch's ``NPUGraph.cpp``, ``NPUCachingAllocator``, ``NPUPluggableAllocator.cpp``).

**Capture records, replay re-runs.**  While a capture is live, a ``TorchDispatchMode`` on the
capturing thread sees every aten / torch_npu op.  An op on device tensors (a storage placed on the
npu, made in a capture, or an ``npu`` factory) is *recorded* with its arguments and its output
tensors, and not run: its fresh outputs are new tensors in the graph's pool filled with a poison
(NaN for floats, 0 for integers and bools) -- a captured output read before ``replay`` is visibly
not computed -- and what it writes in place (``Tensor(a!)``, or ``out`` where the registered
schema does not say so) is left untouched.  The op runs once on copies of what it writes, only to
learn the shapes of its outputs (with every other mode, the stream sanitizer's included, off).
View ops run (they compute nothing); ops on host tensors only run as they would on the host.
``replay`` re-runs the recorded ops in order on the same storages, writing into the captured
outputs; nothing of the caller's Python runs again.  Each op runs "on" the stream it was captured
on (the capture stream stands for the stream ``replay`` is called on), and the event edges
recorded inside the graph are logged again at each replay, so the stream sanitizer follows what
the graph's streams do.

**Update.**  With ``auto_dispatch_capture=True`` the graph's ``_GraphDispatchMode`` handles the ops
of ``_NPU_GRAPH_OP_HANDLERS`` as torch_npu's does: an ``ExternalEvent`` wait and reset on the
capture stream, the handler's ``prepare_capture`` (``npu_fused_infer_attention_score`` becomes its
``.out`` with the max workspace and the inferred outputs), the op inside a task group.
``update(cpu_update_input=[...])`` re-issues each recorded op with the new values on the mode's
``update_stream`` between ``graph_task_update_begin`` / ``_end`` -- which replaces the task's
arguments in the graph -- and records the event.  A replay reaching a handled task waits (in the
replaying thread, up to ``SIMNPU_EXTERNAL_EVENT_TIMEOUT`` seconds, default 60) for that record, as
the device waits on the external event; a replay nobody updates fails there naming the op.

**Refusals** (each raises ``RuntimeError``).  The wheel's messages where torch_npu checks: capture on
the default stream, a second capture into one graph, ``TASK_QUEUE_ENABLE=2``, a capture ended on
another stream, a replay / ``pool()`` before capture, ``update`` without ``auto_dispatch_capture``,
``manual_seed`` of another seed, a new NPU generator (``torch.Generator(device="npu")``) or a
generator's ``clone_state()`` while the current stream is captured (``assert_not_capturing``), work
on a stream that never joined the capture, ``MemPool()`` under a pluggable allocator.  Where the
refusal is CANN's (its text is not in the wheel) an error naming the operation: ``synchronize``
(device, stream, event), stream / event ``query``,
``mem_get_info``, device-to-host copies (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``,
an op handing a number to the host) on the capturing thread; the same calls from any other thread
while a ``"global"`` capture is live (``"thread_local"``: the capturing thread only;
``"relaxed"``: none of those from other threads); a side stream with work not joined back into
the capture stream at ``capture_end`` (CUDA's ``cudaErrorStreamCaptureUnjoined``; no NPU rule was
found -- a guess); an op declared aclop (``declare_aclop``; none of sglang's NPU path is one) with
the wheel's message.  Not modelled: aten ops issued from another thread during a capture (the
recorder sees the capturing thread's ops only).

**Memory.**  Pool ids as torch_npu makes them: ``graph_pool_handle()`` and ``MemPool`` are
``(0, n)``, a capture without a pool makes ``(n, 0)``; a pool is created or increfed by the first
``capture_begin`` into it and shared by every graph captured into it.  Under the native allocator
what a capture allocates is held in the pool until the last graph using it is reset (or
collected), and ``mem_get_info`` counts it as used.  The simulation keeps every block a capture
allocated (the replay writes into it): a device's caching allocator may hand a block an earlier
capture freed into the same pool to a later capture, so a shared pool's figure here is an upper
bound of the device's.  A block with stream uses (``record_stream``) freed while a capture is
underway is given back only when the capture ends (the native allocator defers it); any other
free is at once.  Under a pluggable allocator the allocation is the pluggable allocator's (zbal's
heap once bootstrapped, as ``_server._track`` counts it), held by the graph until reset; its
``begin_allocate_to_pool`` / ``end_allocate_to_pool`` / ``release_pool`` hooks are called when set,
nothing otherwise (``NPUPluggableAllocator.cpp``).  The
call a hook gets (a C function of the library the allocator was made from)::

    void begin_allocate_to_pool(int device, MempoolId_t pool, bool (*filter)(void *stream));
    void end_allocate_to_pool(int device, MempoolId_t pool);
    void release_pool(int device, MempoolId_t pool);

with ``typedef struct { unsigned long long first, second; } MempoolId_t`` passed by value (torch_npu
passes its ``std::pair<unsigned long long, unsigned long long>`` by value, the same two registers)
and, where torch_npu hands a ``std::function<bool(aclrtStream)>`` (by reference: a pointer), a C
function pointer answering whether a stream belongs to the capture.

Every graph action is logged to ``simnpu.EVENTS``: ``("capture_begin", graph_id, stream, pool)``,
``("capture_allocations", graph_id, pool, {stream: bytes})`` (what the capture allocated into its
pool, by the stream it was allocated on; logged just before ``capture_end``),
``("capture_end", graph_id, stream, pool)``, ``("replay", graph_id, stream, pool)``,
``("graph_update", graph_id, records)``, ``("graph_reset", graph_id, pool)``,
``("pool_hook", name, device, pool)`` (a pluggable allocator's hook called),
``("deferred_free", graph_id, blocks, nbytes)`` (frees deferred by the capture, done at its end),
``("pool_release", pool, nbytes)`` (a native pool's memory given back).
"""
from __future__ import annotations

import ctypes
import itertools
import os
import re
import threading

from . import _device
from ._log import log

#: torch_npu's messages (strings of libtorch_npu.so or its Python files; the conformance test
#: finds each one in the wheel).
MSG_DEFAULT_STREAM = ("NPU graphs must be captured on a non-default stream. (However, after capture, "
                      "it's ok to replay them on the default stream.)")
MSG_ALREADY_CAPTURED = ("This NPUGraph instance already owns a captured graph. To capture a new graph, "
                        "create a new instance.")
MSG_TASK_QUEUE = "Do not support TASK_QUEUE_ENABLE = 2 during NPU graph capture, please export TASK_QUEUE_ENABLE=1/0."
MSG_END_STREAM = "Capture must end on the same stream it began on."
MSG_REPLAY = "Called NPUGraph::replay without a preceding successful capture."
MSG_POOL = "Called NPUGraph::pool() without a preceding successful capture."
MSG_UNJOINED = ("get_currently_capturing_graph() can be used only between capture_begin() and capture_end(). "
                "Did you use a stream without making it depend upon the original stream used for capture?")
MSG_SEED = ("NPUGeneratorImpl::set_current_seed can be called during stream capture only if new seed is "
            "the same as the original seed.")
#: ``c10_npu::assertNotCapturing(attempt)`` (NPUGraphsUtils.h): ``attempt`` + this + the status.
MSG_NOT_CAPTURING = (" during NPU graph capture. If you need this call to be captured, please file an issue. "
                     "Current npuStreamCaptureStatus: ")
CAPTURE_STATUS_ACTIVE = "npuStreamCaptureStatusActive"
#: The attempts NPUGeneratorImpl.cpp names: its constructor (every new generator:
#: ``torch.Generator(device="npu")`` through ``createNPUGenerator``, a device's default generator
#: made first) and ``clone_impl`` (``Generator.clone_state()``).  The compiler builds both strings
#: from 16-byte constants and an immediate (the conformance test finds those pieces).
MSG_NEW_GENERATOR = "Cannot construct a new NPUGeneratorImpl"
MSG_CLONE_GENERATOR = "Cannot call NPUGeneratorImpl::clone_impl while in capture mode"
MSG_GENERATOR_DEVICE = "The device_index is invalid."
MSG_UPDATE = ("The current graph configuration does not support update,"
              "Try to capture by setting auto_dispatch_capture=True during capture")
MSG_MEMPOOL = ("pluggable does not yet support createOrIncrefPool. If you need it, please file an issue "
               "describing your use case.")
MSG_ACLOP = "Cannot run aclop operators during NPU graph capture. Current working aclop is "
MSG_CAPTURE_MODE = "Invalid GraphCaptureMode value: "
MSG_TASK_QUEUE_VALUE = "TASK_QUEUE_ENABLE should be 0, 1 or 2, but got "
MSG_SET_TASK_QUEUE = "mode must be 0, 1, or 2, but got {}."

CAPTURE_MODES = ("global", "thread_local", "relaxed")

_lock = threading.RLock()
_uid = itertools.count(1)    # user-created pools: (0, uid)
_uuid = itertools.count(1)   # pools a capture makes: (uuid, 0)
_graph_ids = itertools.count(1)


#: Ops that run through CANN's aclop path rather than aclnn (``declare_aclop``): torch_npu refuses
#: them in a capture (``NPUGraphsUtils.h``).  None of the ops sglang's NPU path calls is one.
ACLOP: set = set()


def declare_aclop(name: str) -> None:
    """``name`` (``"namespace::op"``) stands for an aclop operator: refused in a capture."""
    ACLOP.add(name)


class _Live:
    """The capture underway (at most one in the process, as in torch_npu)."""

    live = None


# ------------------------------------------------------------------------------ TASK_QUEUE_ENABLE

def _env_task_queue() -> int:
    """``TASK_QUEUE_ENABLE`` as torch_npu's OptionsManager reads it (default 1; anything but 0, 1
    or 2 is refused); ``ASCEND_LAUNCH_BLOCKING=1`` makes the effective level 0 (utils.py's
    ``set_task_queue_enable`` docstring)."""
    raw = os.environ.get("TASK_QUEUE_ENABLE", "1").strip() or "1"
    if raw not in ("0", "1", "2"):
        raise RuntimeError(MSG_TASK_QUEUE_VALUE + raw)
    return 0 if os.environ.get("ASCEND_LAUNCH_BLOCKING") == "1" else int(raw)


class _CaptureTaskQueue:
    #: NPUGraph::capture_begin reads the level into a function-local ``static const`` at the
    #: process's first capture (NPUGraph.cpp): later changes of the variable, and
    #: ``set_task_queue_enable``, do not reach the check.
    level = None


def _capture_task_queue() -> int:
    if _CaptureTaskQueue.level is None:
        _CaptureTaskQueue.level = _env_task_queue()
    return _CaptureTaskQueue.level


def get_task_queue_enable():
    level = _device.STATE.task_queue
    if os.environ.get("ASCEND_LAUNCH_BLOCKING") == "1":
        return 0
    return _env_task_queue() if level is None else level


def set_task_queue_enable(mode):
    if isinstance(mode, str):
        mode = int(mode)
    if mode not in (0, 1, 2):
        raise RuntimeError(MSG_SET_TASK_QUEUE.format(mode))
    _device.STATE.task_queue = mode


# ------------------------------------------------------------------------------ pools

class _PoolId(ctypes.Structure):
    _fields_ = [("first", ctypes.c_ulonglong), ("second", ctypes.c_ulonglong)]


_FILTER = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)


class _Pool:
    """A private pool: its id, how many graphs / MemPools use it, the storages it holds."""

    def __init__(self, pool_id):
        self.id = pool_id
        self.use_count = 0
        self.held = {}  # storage data_ptr -> (storage, nbytes, field)

    def nbytes(self, field=None):
        return sum(n for _, n, f in self.held.values() if field is None or f == field)


POOLS: dict = {}


def pool_of(pool_id):
    return POOLS.get(tuple(pool_id))


def _incref(pool_id):
    pool = POOLS.get(pool_id)
    if pool is None:
        pool = POOLS[pool_id] = _Pool(pool_id)
    pool.use_count += 1
    return pool


def _release(pool_id):
    """releasePool: one user fewer; the last one gives the pool's memory back."""
    pool = POOLS.get(pool_id)
    if pool is None:
        return
    pool.use_count -= 1
    if pool.use_count > 0:
        return
    del POOLS[pool_id]
    state = _device.STATE
    native = 0
    for data_ptr, (_, nbytes, field) in pool.held.items():
        setattr(state, field, getattr(state, field) - nbytes)
        GRAPH_STORAGES.pop(data_ptr, None)
        native += nbytes if field == "graph_pool_bytes" else 0
    pool.held.clear()
    log("pool_release", pool_id, native)


#: data_ptr -> nbytes of every storage a capture allocated (device memory, held by a pool).
GRAPH_STORAGES: dict = {}


def pools() -> dict:
    """{pool id: {"use_count": n, <counter>: bytes, ...}}: what each live pool holds, by the counter
    it is in -- ``graph_pool_bytes`` (the native allocator's graph pool), ``pluggable_bytes`` (the
    pluggable allocator's heap) or ``live_npu_bytes`` (the pluggable allocator before its heap)."""
    out = {}
    for pool_id, pool in POOLS.items():
        row = {"use_count": pool.use_count}
        for _, nbytes, field in pool.held.values():
            row[field] = row.get(field, 0) + nbytes
        out[pool_id] = row
    return out


def _allocation_field():
    """Which counter a capture-time allocation lands in: the native allocator's graph pool, or the
    pluggable allocator's own memory (zbal's heap once it is bootstrapped)."""
    state = _device.STATE
    if state.allocator is None:
        return "graph_pool_bytes"
    return "pluggable_bytes" if state.heap_active else "live_npu_bytes"


def _hold(storage) -> None:
    """A storage allocated inside the live capture: the capture's pool holds it."""
    live = _Live.live
    key = storage.data_ptr()
    if live is None or key in GRAPH_STORAGES or not storage.nbytes():
        return
    nbytes = storage.nbytes()
    field = _allocation_field()
    pool = POOLS[live.pool]
    pool.held[key] = (storage, nbytes, field)
    GRAPH_STORAGES[key] = nbytes
    stream = _device.current_stream_name()
    live.allocated[stream] = live.allocated.get(stream, 0) + nbytes
    state = _device.STATE
    setattr(state, field, getattr(state, field) + nbytes)


def takes_placement(storage) -> bool:
    """``_server._track``: a storage placed on the npu by the capturing thread while a capture is
    live is the capture's (held by its pool), not a plain device allocation."""
    live = _Live.live
    if live is None or threading.get_ident() != live.thread:
        return False
    _hold(storage)
    return True


def is_device(tensor) -> bool:
    """Whether a tensor stands for device memory: placed on the npu (``_server``), allocated in a
    capture, or tagged by ``record_allocations``."""
    if str(getattr(tensor, "_simnpu_device", "")).startswith("npu"):
        return True
    try:
        key = tensor.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - sparse / opaque tensors hold no plain storage
        return False
    if key in GRAPH_STORAGES:
        return True
    from . import _server

    return key in _server._tracked


def _call_hook(name, pool_id, *extra):
    """A pluggable allocator's pool hook, if set (NPUPluggableAllocator.cpp): called with the
    device, the pool id and (begin only) the stream filter."""
    allocator = _device.STATE.allocator
    if allocator is None:
        return
    address = allocator.functions.get(name)
    if address is None:
        return
    device = _device.STATE.device
    log("pool_hook", name, device, tuple(pool_id))
    if not address:
        return
    argtypes = [ctypes.c_int, _PoolId] + ([_FILTER] if extra else [])
    fn = ctypes.CFUNCTYPE(None, *argtypes)(address)
    fn(device, _PoolId(*pool_id), *extra)


_DEFERRED: list = []  # (nbytes, give back) of frees waiting for the capture's end


def defer_free(key, nbytes, give_back) -> bool:
    """The native allocator's free of a block with stream uses while a capture is underway: the
    block is not given back until the capture ends ("It's forbidden to npuEventQuery an event
    recorded during NPU graph capture", NPUCachingAllocator.cpp).  A block no other stream used
    is freed at once (a plain free has no capture check)."""
    uses = _device.STATE.stream_uses.pop(key, None)
    if not uses or _Live.live is None or _device.STATE.allocator is not None:
        return False
    _DEFERRED.append((nbytes, give_back))
    return True


def _free_deferred(graph_id) -> None:
    done, _DEFERRED[:] = list(_DEFERRED), []
    for _, give_back in done:
        give_back()
    if done:
        log("deferred_free", graph_id, len(done), sum(n for n, _ in done))


# ------------------------------------------------------------------------------ refusals

def live_capture():
    """The capture underway, or None."""
    return _Live.live


def log_device_resizes() -> None:
    """Server mode: each ``UntypedStorage.resize_`` of a storage on the npu (how sglang and a
    weight release free memory a tensor object keeps) is logged, in order with the graph events,
    as ``("storage_resize", bytes_before, bytes_after, graph_id_or_None)`` -- the id of the capture
    live at the time on any thread."""
    import torch

    from . import _server

    real = torch.UntypedStorage.resize_

    def resize_(storage, size):
        key = storage.data_ptr()
        before = storage.nbytes()
        on_device = key in GRAPH_STORAGES or key in _server._tracked
        out = real(storage, size)
        if on_device:
            live = _Live.live
            log("storage_resize", before, storage.nbytes(), None if live is None else live.graph._sim_id)
        return out

    resize_.__wrapped__ = real
    torch.UntypedStorage.resize_ = resize_


def _describe(live):
    return "graph %d's capture on %s (%s mode)" % (live.graph._sim_id, live.stream_name, live.mode)


def check_call(what: str, *, host_copy: bool = False) -> None:
    """Refuse ``what`` (a synchronising call, a query, a device-to-host copy) while a capture is
    live where CANN refuses it: on the capturing thread; from another thread while a "global"
    capture is live (a device-to-host copy only on the capturing thread's captured streams)."""
    live = _Live.live
    if live is None:
        return
    here = threading.get_ident() == live.thread
    if here:
        if _device.current_stream_name() not in live.members and not host_copy:
            return  # the capturing thread's work outside the capture's streams is eager
        raise RuntimeError("simnpu: %s during %s: CANN does not let a captured stream %s (the call "
                           "cannot be captured and invalidates the capture)"
                           % (what, _describe(live), "hand data to the host" if host_copy else "synchronise"))
    if live.mode == "global" and not host_copy:
        raise RuntimeError("simnpu: %s from thread %r during %s: a \"global\" capture refuses unsafe "
                           "calls from every thread (aclmdlRICaptureMode global)"
                           % (what, threading.current_thread().name, _describe(live)))


def captured_edge(event) -> bool:
    """Whether a logged stream edge is one being captured (the capturing thread, a capture
    stream): it happens at replay, not now."""
    live = _Live.live
    if live is None or threading.get_ident() != live.thread:
        return False
    kind = event[0]
    if kind == "event_record":
        return event[2] in live.members
    if kind in ("wait_event", "wait_stream"):
        return event[1] in live.members or (kind == "wait_stream" and event[2] in live.members)
    return False


def check_seed(seed) -> None:
    live = _Live.live
    if live is not None and int(seed) != getattr(_device.STATE, "seed", int(seed)):
        raise RuntimeError(MSG_SEED)


def capture_status():
    """``c10_npu::currentStreamCaptureStatus()``: the status of the calling thread's current
    stream -- ``CAPTURE_STATUS_ACTIVE`` on a stream a live capture holds (the capturing thread's),
    None otherwise (another thread's current stream is not captured)."""
    live = _Live.live
    if live is None or threading.get_ident() != live.thread:
        return None
    return CAPTURE_STATUS_ACTIVE if _device.current_stream_name() in live.members else None


def assert_not_capturing(attempt: str) -> None:
    """``c10_npu::assertNotCapturing(attempt)``: refused while the current stream is captured."""
    status = capture_status()
    if status is not None:
        raise RuntimeError(attempt + MSG_NOT_CAPTURING + status)


# ------------------------------------------------------------------------------ streams and events

def on_stream_edge(kind, *names) -> None:
    """An event record / wait or ``wait_stream`` on the capturing thread: a stream that waits on
    work of the capture joins it; the edge is part of the graph."""
    live = _Live.live
    if live is None or threading.get_ident() != live.thread:
        return
    with _lock:
        if kind == "event_record":
            event, stream = names
            if stream in live.members:
                live.recorded[event] = stream
                live.timeline.append(("log", "event_record", event, stream))
                if stream != live.stream_name:
                    live.dirty[stream] = True
        elif kind == "wait_event":
            stream, event = names
            source = live.recorded.get(event)
            if source is not None:
                live.members.add(stream)
                live.timeline.append(("log", "wait_event", stream, event))
                if stream == live.stream_name:
                    live.dirty.pop(source, None)
        elif kind == "wait_stream":
            waiter, waited = names
            if waited in live.members:
                live.members.add(waiter)
                live.timeline.append(("log", "wait_stream", waiter, waited))
                if waiter == live.stream_name:
                    live.dirty.pop(waited, None)


class ExternalEvent:
    """torch_npu.npu.ExternalEvent: an event a stream may wait on before it is recorded; ``reset``
    clears the record.  Waited and reset inside a capture, it is a node of the graph: each replay
    waits there until the event is recorded again (``update`` records it)."""

    def __new__(cls):
        self = object.__new__(cls)
        self._sim_name = "xev-%d" % next(_device.STATE.event_ids)
        self._sim_cond = threading.Condition()
        self._sim_recorded = False
        self._sim_recorded_on = None
        return self

    def record(self, stream=None):
        if stream is None:
            stream = _device.current_stream()
        with self._sim_cond:
            self._sim_recorded = True
            self._sim_recorded_on = stream._sim_name
            self._sim_cond.notify_all()
        log("event_record", self._sim_name, stream._sim_name)

    def wait(self, stream=None):
        if stream is None:
            stream = _device.current_stream()
        live = _Live.live
        if live is not None and threading.get_ident() == live.thread and stream._sim_name in live.members:
            live.timeline.append(("ext_wait", self, stream._sim_name))
            return
        log("wait_event", stream._sim_name, self._sim_name)

    def reset(self, stream=None):
        if stream is None:
            stream = _device.current_stream()
        live = _Live.live
        if live is not None and threading.get_ident() == live.thread and stream._sim_name in live.members:
            live.timeline.append(("ext_reset", self, stream._sim_name))
            return
        with self._sim_cond:
            self._sim_recorded = False

    def _sim_await(self, what):
        timeout = float(os.environ.get("SIMNPU_EXTERNAL_EVENT_TIMEOUT", "60"))
        with self._sim_cond:
            if not self._sim_cond.wait_for(lambda: self._sim_recorded, timeout=timeout):
                raise RuntimeError("simnpu: replay waited %.0f s on the external event before %s, which "
                                   "nothing recorded: call NPUGraph.update(...) for each replay (on a "
                                   "device the stream would wait for ever)" % (timeout, what))

    @property
    def npu_event(self):
        return id(self)

    def __repr__(self):
        return "<simnpu ExternalEvent %s>" % self._sim_name


# ------------------------------------------------------------------------------ the recorder

_tls = threading.local()

#: Factories that only allocate (nothing to compute, nothing to re-run at replay).
_EMPTY = {"empty.memory_format", "empty_strided.default", "empty.default", "empty_like.default",
          "new_empty.default", "new_empty_strided.default"}


def _poison(tensor):

    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    else:
        tensor.zero_()


class _Entry:
    """One recorded op: its stream, the op, its arguments, and where its fresh outputs live."""

    __slots__ = ("stream", "func", "args", "kwargs", "fresh", "task", "outputs")

    def __init__(self, stream, func, args, kwargs, fresh):
        self.stream, self.func, self.args, self.kwargs, self.fresh = stream, func, args, kwargs, fresh
        self.task = None
        self.outputs = None


def _written(func):
    """Names of the arguments ``func`` writes: marked ``(a!)``, or listed in _ops.WRITES_UNANNOTATED."""
    from . import _ops

    names = {a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    return names | set(_ops.WRITES_UNANNOTATED.get(func.__name__, ()))


def _is_view(func):
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns) \
        and not any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def _bind(func, args, kwargs):
    """{argument name: value} of one call."""
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def _is_work(func, value) -> bool:
    """The ``Work`` a c10d collective op returns (a TorchBind object): HCCL collectives are captured
    into NPU graphs; the simulation's stand in (Gloo on the CPU tensors) run at capture and at each
    replay, every rank replaying in step."""
    import torch

    return getattr(func, "namespace", None) == "c10d" and isinstance(value, torch.ScriptObject)


def _recorder_class():
    import torch
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    class Recorder(TorchDispatchMode):
        """The capturing thread's ops while a capture is live (see the module docstring)."""

        def __init__(self, live):
            super().__init__()
            self.live = live

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            live = self.live
            graph_mode = live.graph.graph_dispatch_mode
            if live.graph.auto_dispatch_capture and graph_mode._sim_entered \
                    and graph_mode.handles(func, args, kwargs):
                return graph_mode._capture_op(func, args, kwargs, self.record)
            return self.record(func, args, kwargs)

        def record(self, func, args, kwargs):
            live = self.live
            tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            factory = getattr(_tls, "npu_factory", 0) > 0 and not tensors
            if not factory and not any(is_device(t) for t in tensors):
                return func(*args, **kwargs)  # host work: runs as on the host
            if _is_view(func):
                return func(*args, **kwargs)
            stream = _device.current_stream_name()
            if stream not in live.members:
                raise RuntimeError(MSG_UNJOINED + " (simnpu: %s on %s during %s)"
                                   % (func.__name__, stream, _describe(live)))
            if func._schema.name in ACLOP:
                raise RuntimeError(MSG_ACLOP + func._schema.name)
            if func.__name__ in _EMPTY:
                with _disable_current_modes():
                    out = func(*args, **kwargs)
                for t in pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        _hold(t.untyped_storage())
                return out
            written = _written(func)
            bound = _bind(func, args, kwargs)
            clones = {}  # id(clone) -> original
            names = [a.name for a in func._schema.arguments]

            def shadow(value):
                if isinstance(value, torch.Tensor):
                    c = value.clone()
                    clones[c.untyped_storage().data_ptr()] = value
                    return c
                if isinstance(value, (list, tuple)):
                    return type(value)(shadow(v) for v in value)
                return value

            with _disable_current_modes(), torch.no_grad():
                # the copies are the simulation's own: no launch for the modes below (the sanitizer)
                run_args = [shadow(v) if names[i] in written else v for i, v in enumerate(args)]
                run_kwargs = {k: shadow(v) if k in written else v for k, v in kwargs.items()}
                result = func(*run_args, **run_kwargs)
            leaves, spec = pytree.tree_flatten(result)
            fresh = []
            outputs = []
            for index, leaf in enumerate(leaves):
                if not isinstance(leaf, torch.Tensor):
                    if leaf is None or _is_work(func, leaf):
                        # a collective's Work (c10d): the capture's run of it is complete; the
                        # caller's wait() returns at once, each replay runs it again and waits
                        outputs.append(leaf)
                        continue
                    raise RuntimeError("simnpu: %s hands a %s to the host during %s: a device-to-host "
                                       "read cannot be captured" % (func.__name__, type(leaf).__name__,
                                                                    _describe(live)))
                original = clones.get(leaf.untyped_storage().data_ptr())
                if original is None:
                    for value in bound.values():
                        for t in pytree.tree_leaves(value):
                            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == \
                                    leaf.untyped_storage().data_ptr():
                                original = leaf  # an alias of an argument it returns as is
                if original is not None:
                    outputs.append(original if original is not leaf else leaf)
                    continue
                with _disable_current_modes():
                    target = torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype)
                    _poison(target)
                _hold(target.untyped_storage())
                fresh.append((index, target))
                outputs.append(target)
            entry = _Entry(stream, func, tuple(args), dict(kwargs), fresh)
            entry.outputs = pytree.tree_unflatten(outputs, spec)
            live.timeline.append(("op", entry))
            if live.task is not None:
                live.task.entries.append(entry)
                entry.task = live.task
            if stream != live.stream_name:
                live.dirty[stream] = True
            return entry.outputs

    return Recorder


def _function_mode_class():
    import torch
    from torch.overrides import TorchFunctionMode

    host_reads = {torch.Tensor.item: "Tensor.item()", torch.Tensor.tolist: "Tensor.tolist()",
                  torch.Tensor.numpy: "Tensor.numpy()", torch.Tensor.cpu: "Tensor.cpu()"}

    class CaptureCalls(TorchFunctionMode):
        """The capturing thread's torch calls: device-to-host reads refused; an ``npu`` factory
        marked for the recorder (its dispatch no longer says npu in the simulation)."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            what = host_reads.get(func)
            if what is None and getattr(func, "__name__", "") == "to":
                target = kwargs.get("device", args[1] if len(args) > 1 else None)
                if isinstance(target, (str, torch.device)) and str(target).startswith("cpu"):
                    what = "Tensor.to(cpu)"
                    if isinstance(target, torch.device) and _server_mode():
                        # npu tensors stand on the cpu here: a torch.device is another device
                        # tensor's ``.device`` (sglang's ``x.to(k.device)``), a no-op on a device
                        what = None
            if what is not None and args and isinstance(args[0], torch.Tensor) and is_device(args[0]):
                check_call("a device-to-host copy (%s)" % what, host_copy=True)
            device = kwargs.get("device")
            npu = device is not None and str(device).startswith("npu")
            if not npu and getattr(func, "__name__", "") == "to" and len(args) > 1:
                npu = str(args[1]).startswith("npu")
            if not npu:
                return func(*args, **kwargs)
            _tls.npu_factory = getattr(_tls, "npu_factory", 0) + 1
            try:
                return func(*args, **kwargs)
            finally:
                _tls.npu_factory -= 1

    return CaptureCalls


def _server_mode():
    from . import _server

    return _server._installed


_CLASSES = {}


def _mode(kind, *args):
    if kind not in _CLASSES:
        _CLASSES[kind] = _recorder_class() if kind == "recorder" else _function_mode_class()
    return _CLASSES[kind](*args)


class _Capture:
    def __init__(self, graph, stream, mode, pool):
        self.graph, self.stream, self.mode, self.pool = graph, stream, mode, pool
        self.stream_name = stream._sim_name
        self.thread = threading.get_ident()
        self.members = {self.stream_name}
        self.recorded = {}   # event name -> stream it was recorded on inside the capture
        self.dirty = {}      # side stream -> it has work not yet joined back
        self.timeline = []
        self.task = None
        self.modes = []
        self.allocated = {}  # stream -> bytes the capture allocated on it (all into the pool)


class _TaskGroup:
    """What ``graph_task_group_end`` returns: the recorded ops of one task group."""

    def __init__(self, graph):
        self.graph = graph
        self.entries = []


# ------------------------------------------------------------------------------ task groups

def graph_task_group_begin(stream):
    live = _Live.live
    if live is None or stream._sim_name not in live.members:
        raise RuntimeError("simnpu: graph_task_group_begin on %s, which is not capturing" % stream._sim_name)
    live.task = _TaskGroup(live.graph)


def graph_task_group_end(stream):
    live = _Live.live
    if live is None or live.task is None:
        raise RuntimeError("simnpu: graph_task_group_end on %s without graph_task_group_begin" % stream._sim_name)
    task, live.task = live.task, None
    return task


def graph_task_update_begin(stream, handle):
    if getattr(_tls, "updating", None) is not None:
        raise RuntimeError("simnpu: graph_task_update_begin inside another task update")
    _tls.updating = handle
    _tls.update_mode = _mode_updater(handle)
    _tls.update_mode.__enter__()


def graph_task_update_end(stream):
    mode = getattr(_tls, "update_mode", None)
    if mode is None:
        raise RuntimeError("simnpu: graph_task_update_end without graph_task_update_begin")
    _tls.update_mode, _tls.updating = None, None
    mode.__exit__(None, None, None)


def _mode_updater(handle):
    from torch.utils._python_dispatch import TorchDispatchMode

    class TaskUpdate(TorchDispatchMode):
        """Between ``graph_task_update_begin`` and ``_end``: an op issued replaces the task's op in
        the graph (its new arguments); nothing runs now."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            for entry in handle.entries:
                if entry.func is func:
                    entry.args, entry.kwargs = tuple(args), dict(kwargs)
                    return entry.outputs  # what the captured op gave; nothing runs now
            raise RuntimeError("simnpu: task update issues %s, the task recorded %s"
                               % (func.__name__, [e.func.__name__ for e in handle.entries]))

    return TaskUpdate()


# ------------------------------------------------------------------------------ NPUGraph

class NPUGraph:
    """torch_npu.npu.NPUGraph (see the module docstring)."""

    def __new__(cls):
        self = object.__new__(cls)
        self._sim_id = next(_graph_ids)
        self._sim_pool = None
        self._sim_timeline = None
        self._sim_capturing = False
        self._sim_failing = False
        self._sim_replay_lock = threading.Lock()
        return self

    def __init__(self):
        self.graph_dispatch_mode = _GraphDispatchMode()
        self.auto_dispatch_capture = False

    def capture_begin(self, pool=None, capture_error_mode="global"):
        if capture_error_mode not in CAPTURE_MODES:
            raise RuntimeError(MSG_CAPTURE_MODE + str(capture_error_mode))
        if _capture_task_queue() == 2:
            raise RuntimeError(MSG_TASK_QUEUE)
        if self._sim_timeline is not None or self._sim_capturing:
            raise RuntimeError(MSG_ALREADY_CAPTURED)
        stream = _device.current_stream()
        if stream == _device.default_stream():
            raise RuntimeError(MSG_DEFAULT_STREAM)
        with _lock:
            if _Live.live is not None:
                raise RuntimeError("simnpu: capture_begin of graph %d during %s: one capture at a time"
                                   % (self._sim_id, _describe(_Live.live)))
            if pool is not None and tuple(pool) != (0, 0):
                pool_id = (int(pool[0]), int(pool[1]))
            else:
                pool_id = (next(_uuid), 0)
            _incref(pool_id)
            self._sim_pool = pool_id
            live = _Capture(self, stream, capture_error_mode, pool_id)
            _Live.live = live
            self._sim_capturing = True
        log("capture_begin", self._sim_id, live.stream_name, pool_id)
        live.filter = _FILTER(lambda ptr, members=live.members: _device.STATE.stream_ptrs.get(ptr) in members)
        _call_hook("set_begin_allocate_to_pool", pool_id, live.filter)
        live.modes = [_mode("recorder", live), _mode("calls")]
        for mode in live.modes:
            mode.__enter__()

    def capture_end(self):
        live = _Live.live
        if live is None or live.graph is not self:
            raise RuntimeError("simnpu: capture_end of graph %d, which is not capturing" % self._sim_id)
        if _device.current_stream_name() != live.stream_name:
            raise RuntimeError(MSG_END_STREAM)
        try:
            unjoined = sorted(s for s, dirty in live.dirty.items() if dirty)
            if unjoined and not self._sim_failing:
                raise RuntimeError("simnpu: capture_end of graph %d with work on %s not joined back into the "
                                   "capture stream %s (record an event there and wait for it on %s)"
                                   % (self._sim_id, ", ".join(unjoined), live.stream_name, live.stream_name))
        finally:
            for mode in reversed(live.modes):
                mode.__exit__(None, None, None)
            with _lock:
                _Live.live = None
                self._sim_capturing = False
            _call_hook("set_end_allocate_to_pool_fn", live.pool)
            _free_deferred(self._sim_id)
        self._sim_timeline = live.timeline
        self._sim_capture_stream = live.stream_name
        log("capture_allocations", self._sim_id, live.pool, dict(sorted(live.allocated.items())))
        log("capture_end", self._sim_id, live.stream_name, live.pool)

    def replay(self):
        if self._sim_timeline is None:
            raise RuntimeError(MSG_REPLAY)
        check_call("NPUGraph.replay() (of graph %d)" % self._sim_id)
        import torch

        stream = _device.current_stream()
        log("replay", self._sim_id, stream._sim_name, self._sim_pool)
        stack = _device._stack()
        with self._sim_replay_lock, torch.no_grad():
            for item in self._sim_timeline:
                kind = item[0]
                if kind == "op":
                    entry = item[1]
                    stack.append(self._sim_stream(entry.stream, stream))
                    try:
                        result = entry.func(*entry.args, **entry.kwargs)
                        from torch.utils import _pytree as pytree

                        leaves = pytree.tree_leaves(result)
                        for leaf in leaves:
                            if _is_work(entry.func, leaf):
                                leaf.wait()  # the collective is done before the next op reads it
                        for index, target in entry.fresh:
                            target.copy_(leaves[index])
                    finally:
                        stack.pop()
                elif kind == "log":
                    names = [self._sim_stream_name(n, stream) for n in item[2:]]
                    log(item[1], *names)
                elif kind == "ext_wait":
                    event, on = item[1], self._sim_stream_name(item[2], stream)
                    event._sim_await(self._sim_next_op(item))
                    log("wait_event", on, event._sim_name)
                elif kind == "ext_reset":
                    with item[1]._sim_cond:
                        item[1]._sim_recorded = False

    def _sim_next_op(self, item):
        timeline = self._sim_timeline
        for later in timeline[timeline.index(item) + 1:]:
            if later[0] == "op":
                return later[1].func.__name__
        return "the end of the graph"

    def _sim_stream_name(self, name, stream):
        return stream._sim_name if name == self._sim_capture_stream else name

    def _sim_stream(self, name, stream):
        if name == self._sim_capture_stream:
            return stream
        found = _device.STATE.streams.get(name)
        if found is None:
            found = object.__new__(_device.Stream)
            found._sim_init(stream._sim_device_index, name)
        return found

    def reset(self):
        if self._sim_capturing:
            raise RuntimeError("simnpu: reset of graph %d during its capture" % self._sim_id)
        pool, self._sim_pool = self._sim_pool, None
        self._sim_timeline = None
        if pool is None:
            return
        self.graph_dispatch_mode.graph_dispatch_records = []
        log("graph_reset", self._sim_id, pool)
        _call_hook("set_release_pool", pool)
        _release(pool)

    def pool(self):
        if self._sim_timeline is None:
            raise RuntimeError(MSG_POOL)
        return self._sim_pool

    def update(self, cpu_update_input):
        if not self.auto_dispatch_capture:
            raise RuntimeError(MSG_UPDATE)
        log("graph_update", self._sim_id, len(self.graph_dispatch_mode.graph_dispatch_records))
        self.graph_dispatch_mode.update_capture_record(cpu_update_input)

    def __del__(self):
        try:
            # a graph of before simnpu.reset() holds nothing any more: no event for it
            if getattr(self, "_sim_pool", None) in POOLS and not self._sim_capturing:
                self.reset()
        except Exception:  # noqa: BLE001 - a destructor at interpreter exit
            pass

    def __repr__(self):
        return "<simnpu NPUGraph %d>" % self._sim_id


class graph:
    """torch_npu.npu.graph: ``__enter__`` synchronises, empties the caches, enters the capture
    stream and (``auto_dispatch_capture``) the graph's dispatch mode, then ``capture_begin``
    (graphs.py ``graph.__enter__``)."""

    default_capture_stream = None

    def __init__(self, npu_graph, pool=None, stream=None, auto_dispatch_capture=False,
                 capture_error_mode: str = "global"):
        if self.__class__.default_capture_stream is None:
            self.__class__.default_capture_stream = _device.Stream()
        self.pool = () if pool is None else (pool,)
        self.capture_stream = stream if stream is not None else self.__class__.default_capture_stream
        if self.capture_stream is None:
            raise RuntimeError("capture stream is None")
        self.stream_ctx = _device.stream(self.capture_stream)
        self.npu_graph = npu_graph
        self.capture_error_mode = capture_error_mode
        self.npu_graph.auto_dispatch_capture = auto_dispatch_capture

    def __enter__(self):
        _device.current_device()
        _device.synchronize()
        _device.empty_cache()
        host_empty_cache()
        self.stream_ctx.__enter__()
        if self.npu_graph.auto_dispatch_capture:
            self.npu_graph.graph_dispatch_mode.__enter__()
        self.npu_graph.capture_begin(*self.pool, capture_error_mode=self.capture_error_mode)

    def __exit__(self, exc_type, exc_value, traceback):
        self.npu_graph._sim_failing = exc_type is not None
        try:
            self.npu_graph.capture_end()
        finally:
            self.npu_graph._sim_failing = False
            if self.npu_graph.auto_dispatch_capture:
                self.npu_graph.graph_dispatch_mode.__exit__(exc_type, exc_value, traceback)
            self.stream_ctx.__exit__(exc_type, exc_value, traceback)


def host_empty_cache():
    log("host_empty_cache")


def graph_pool_handle():
    """``(0, n)``: a user pool id; no pool exists until a capture uses it (c10_npu's
    graph_pool_handle tail-calls MemPool::graph_pool_handle(true))."""
    return (0, next(_uid))


def is_current_stream_capturing():
    """Whether the current stream of this thread is capturing (no device initialisation)."""
    live = _Live.live
    return bool(live is not None and threading.get_ident() == live.thread
                and _device.current_stream_name() in live.members)


class MemPool:
    """torch_npu.npu.MemPool: a user pool ``(0, n)``, created with one use (createOrIncrefPool); the
    pluggable allocator does not implement that (the NPUAllocator base refuses)."""

    def __init__(self, allocator=None, use_on_oom: bool = False, no_split: bool = False):
        if _device.STATE.allocator is not None or allocator is not None:
            raise RuntimeError(MSG_MEMPOOL)
        self._sim_id = (0, next(_uid))
        _incref(self._sim_id)

    @property
    def id(self):
        return self._sim_id

    def use_count(self) -> int:
        pool = POOLS.get(self._sim_id)
        return pool.use_count if pool is not None else 0


# ------------------------------------------------------------------------------ dispatch mode

class _Handler:
    """torch_npu's NpuGraphOpHandler: update specs walked by ``update_args``."""

    UPDATE_SPECS: dict = {}

    @classmethod
    def should_handle(cls, func, args, kwargs):
        return True

    @classmethod
    def prepare_capture(cls, func, args, kwargs):
        return func, args, kwargs

    @classmethod
    def postprocess_result(cls, result, kwargs):
        return result

    @classmethod
    def update_args(cls, record, update_input):
        for loc, idx_or_name, key in cls.UPDATE_SPECS.get(record.op_cache_entry.__name__, []):
            if key not in update_input:
                continue
            if loc == "arg":
                if len(record.args) > idx_or_name:
                    record.args[idx_or_name] = update_input[key]
            elif loc == "kwarg":
                record.kwargs[idx_or_name] = update_input[key]


class _SimpleGraphHandler(_Handler):
    """simple_handler.py (the paged attention; ``npu_multi_head_latent_attention.out`` is not an
    op of the simulation)."""

    UPDATE_SPECS = {"_npu_paged_attention.default": [("arg", 7, "context_lens")]}


class _IFAv1DefaultHandler(_Handler):
    """ifa_handler.py: ``.default`` gets the max workspace and its outputs and becomes ``.out``."""

    UPDATE_SPECS = {name: [("arg", 5, "actual_seq_lengths"), ("arg", 6, "actual_seq_lengths_kv")]
                    for name in ("npu_fused_infer_attention_score", "npu_fused_infer_attention_score.default",
                                 "npu_fused_infer_attention_score.out")}

    @classmethod
    def prepare_capture(cls, func, args, kwargs):
        import torch

        func_out = torch.ops.npu.npu_fused_infer_attention_score.out
        if func is func_out:
            return func, args, kwargs
        workspace = torch.ops.npu._npu_fused_infer_attention_score_get_max_workspace(*args, **kwargs)
        keys = ["input_layout", "quant_scale2", "block_table", "num_heads", "num_key_value_heads",
                "softmax_lse_flag", "query_rope"]
        output, softmax_lse = torch.ops.npu._npu_fused_infer_attention_score_infer_output(
            args[0], args[2], **{k: kwargs[k] for k in keys if k in kwargs})
        kwargs = dict(kwargs, workspace=workspace, out=[output, softmax_lse])
        return func_out, args, kwargs

    @classmethod
    def postprocess_result(cls, result, kwargs):
        return kwargs["out"]


#: torch_npu's registry (``_npugraph_handlers``), for the ops the simulation defines.
_NPU_GRAPH_OP_HANDLERS = {
    "_npu_paged_attention.default": _SimpleGraphHandler,
    "npu_fused_infer_attention_score": _IFAv1DefaultHandler,
    "npu_fused_infer_attention_score.default": _IFAv1DefaultHandler,
    "npu_fused_infer_attention_score.out": _IFAv1DefaultHandler,
}


class _GraphDispatchRecord:
    def __init__(self, event, handle, kwargs, args, op_cache_entry):
        self.event, self.handle, self.kwargs, self.args = event, handle, kwargs, args
        self.op_cache_entry = op_cache_entry


def _dispatch_mode_base():
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


class _GraphDispatchMode:
    """torch_npu's ``_GraphDispatchMode`` (graphs.py): entered by ``graph.__enter__`` with
    ``auto_dispatch_capture``; the capture's recorder hands it the ops it handles."""

    tensor_schema_name: dict = {}
    update_stream = None

    def __new__(cls):
        if cls.update_stream is None:
            cls.update_stream = _device.Stream()
        return object.__new__(cls)

    def __init__(self):
        self.graph_dispatch_records = []
        self._sim_entered = False

    def __enter__(self):
        self._sim_entered = True
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        self._sim_entered = False
        return False

    @classmethod
    def update_schema(cls, name, schema):
        if name in cls.tensor_schema_name:
            return
        cls.tensor_schema_name[name] = re.findall(r'Tensor(?:\(a!\)|\?)?\s+(\w+)', schema)

    @staticmethod
    def handles(func, args, kwargs):
        handler = _NPU_GRAPH_OP_HANDLERS.get(func.__name__)
        return handler is not None and handler.should_handle(func, args, kwargs)

    def _capture_op(self, func, args, kwargs, record):
        """graphs.py ``__torch_dispatch__`` for a handled op, the op itself recorded by ``record``."""
        handler = _NPU_GRAPH_OP_HANDLERS[func.__name__]
        stream = _device.current_stream()
        event = ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        import torch
        from torch.utils import _pytree as pytree

        given = {id(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        actual_func, args, kwargs = handler.prepare_capture(func, args, dict(kwargs))
        for t in pytree.tree_leaves((args, kwargs)):  # the workspace and outputs it made: the pool's
            if isinstance(t, torch.Tensor) and id(t) not in given:
                _hold(t.untyped_storage())
        self.update_schema(str(actual_func.__name__), str(actual_func._schema))
        graph_task_group_begin(stream)
        result = record(actual_func, args, kwargs)
        handle = graph_task_group_end(stream)
        self.graph_dispatch_records.append(
            _GraphDispatchRecord(event, handle, dict(kwargs), list(args), actual_func))
        return handler.postprocess_result(result, kwargs)

    def update_capture_record(self, cpu_update_input):
        if len(cpu_update_input) == 1:
            cpu_update_input = [cpu_update_input[0].copy() for _ in range(len(self.graph_dispatch_records))]
        if len(cpu_update_input) != len(self.graph_dispatch_records):
            raise RuntimeError(
                f"Currently, there are {len(self.graph_dispatch_records)} "
                f"operators that need to be updated by capture, and there "
                f"are only {len(cpu_update_input)} elements in the incoming "
                f"cpu_update_input list")
        with _device.stream(self.update_stream):
            for record, update_input in zip(self.graph_dispatch_records, cpu_update_input):
                graph_task_update_begin(self.update_stream, record.handle)
                try:
                    for key in update_input:
                        if key in record.kwargs:
                            record.kwargs[key] = update_input[key]
                    handler = _NPU_GRAPH_OP_HANDLERS.get(record.op_cache_entry.__name__)
                    if handler is None:
                        raise RuntimeError(f"No handler for recorded op: {record.op_cache_entry.__name__}.")
                    handler.update_args(record, update_input)
                    record.op_cache_entry(*record.args, **record.kwargs)
                finally:
                    graph_task_update_end(self.update_stream)
                record.event.record(self.update_stream)


# ------------------------------------------------------------------------------ reset

def reset_state() -> None:
    """simnpu.reset(): no capture, no pools (what a capture held is dropped)."""
    _Live.live = None
    _CaptureTaskQueue.level = None
    _DEFERRED.clear()
    POOLS.clear()
    GRAPH_STORAGES.clear()
    graph.default_capture_stream = None
    _GraphDispatchMode.update_stream = None
