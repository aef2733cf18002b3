"""A stream sanitizer for the simulated NPU, after PyTorch's CUDA Sanitizer (``torch.cuda._sanitizer``).

The simulated NPU runs every stream synchronously, in program order, so a missing wait never
corrupts a result here.  The sanitizer finds such bugs anyway, by following what the streams *may*
do at the same time on a device::

    with simnpu.sanitize() as san:
        ...                      # code that queues work on simulated streams
    san.assert_clean()           # or look at san.reports

* Kernels.  Every aten op (seen by a ``TorchDispatchMode``) is a kernel launched on the current
  simulated stream.  Which storages it reads and writes comes from the op's schema, as CSAN reads
  it: an argument marked ``Tensor(a!)`` is written, a view argument (``Tensor(a)``) is metadata
  only, a fresh output is allocated and written.  A stand-in for a real NPU kernel, declared with
  ``declare_kernel(schema, source)``, is one launch that reads and writes what the *real* op's
  schema says, whatever pure-torch ops it runs inside; those ops must keep to the schema (a stand-in
  that writes an argument the schema only reads is reported), so an in-place real kernel is
  in-place here too and a functional one is functional.
* Happens-before.  Each stream keeps a vector clock; ``wait_stream``, an event's ``record`` /
  ``wait``, and ``synchronize`` of the device, a stream or an event advance them as on a device.
  They are read from the simulated NPU's event log (``simnpu.EVENTS``) as it is written.
* Races.  Two accesses to one storage from two streams, at least one a write, with no
  happens-before edge between them: read-after-write, write-after-read, write-after-write, each
  reported with both call sites and where the storage was allocated.  An allocation counts as a
  write by the stream it was made on (the block may still hold its last tenant's data in use there).
* The caching allocator, modelled on torch-npu's (its NPUCachingAllocator is CUDA's): a block
  freed on the host goes back to the pool of the stream it was allocated on, and that stream's
  next allocation from the same pool (small or large) may get it at once.  So a block another
  stream used is only safe to free after ``tensor.record_stream(that stream)``, or once its
  allocation stream has waited for that use.  When neither holds and an allocation on the
  allocation stream could be handed the block, it is reported (``unsafe-reuse``) with the
  allocation, the unwaited use, the free and the new allocation.  A free is the storage's death
  (its last tensor gone) or ``untyped_storage().resize_`` to fewer bytes (how sglang releases
  weights).

Tensors that existed before the sanitizer started count as allocated on the device's default
stream (where sglang loads weights).  Storages are whole blocks: two streams writing disjoint
slices of one storage are reported (the allocator hands out whole blocks, so a block is the unit
whose reuse matters).  NPU graphs (``_graphs.py``): nothing a capture records runs, so the sanitizer
sees none of it then (nor the capture's event edges) -- no op on a capturing stream is a launch, the
simulation's own runs of a recorded op (to learn its outputs' shapes) and host work included; each
replay launches the recorded ops on their streams and logs the graph's event edges again, which the
sanitizer follows.  Not modelled:
host-to-device copies' own streams, and the comm streams inside collective libraries.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading
import weakref

from . import _device, _graphs, _log

READ, WRITE = "read", "write"
#: The caching allocator serves requests up to this size from its small pool, larger from the large.
SMALL_POOL_LIMIT = 1 << 20
#: Frames kept per call site (innermost first).
SITE_DEPTH = 4

_ACTIVE: "Sanitizer | None" = None


# ------------------------------------------------------------------------------ call sites

def _skipped_prefixes():
    import torch

    torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    simnpu_dir = os.path.dirname(os.path.abspath(__file__)) + os.sep
    return torch_dir, simnpu_dir


_STDLIB = os.path.dirname(contextlib.__file__) + os.sep


_SKIPPED: tuple = ()


def _site():
    """Where the current op was called from: the innermost frames outside torch, the standard
    library and the simulated NPU itself (a wrapt wrapper's own frames are skipped too)."""
    global _SKIPPED
    if not _SKIPPED:
        _SKIPPED = _skipped_prefixes()
    frames = []
    frame = sys._getframe(1)
    while frame is not None and len(frames) < SITE_DEPTH:
        name = frame.f_code.co_filename
        if not (name.startswith(_SKIPPED) or _in_stdlib(name) or os.sep + "wrapt" + os.sep in name):
            frames.append((name, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return tuple(frames)


def _in_stdlib(name):
    # A system Python may keep installed packages (sglang among them) below its standard library.
    return name.startswith(_STDLIB) and "-packages" + os.sep not in name


def format_site(site, depth=SITE_DEPTH):
    """``file.py:line (function) <- ...`` for the innermost ``depth`` frames."""
    return " <- ".join("%s:%d (%s)" % (os.path.basename(f), line, fn) for f, line, fn in site[:depth]) \
        or "<unknown>"


# ------------------------------------------------------------------------------ records

class Access:
    """One kernel's read or write of one storage."""

    __slots__ = ("kind", "seq", "stream", "op", "arg", "site")

    def __init__(self, kind, seq, stream, op, arg, site):
        self.kind, self.seq, self.stream, self.op, self.arg, self.site = kind, seq, stream, op, arg, site

    def describe(self):
        what = "%s %s" % ("wrote" if self.kind == WRITE else "read", self.op)
        if self.arg:
            what += " (%s)" % self.arg
        return "%s %s at %s" % (self.stream, what, format_site(self.site))


class Block:
    """A storage the sanitizer follows: where it was allocated, and its accesses that matter."""

    def __init__(self, nbytes, stream, site, op):
        self.nbytes = nbytes
        self.stream = stream            # allocation stream: whose pool it returns to
        self.site, self.op = site, op   # where it was allocated (None: before the sanitizer)
        self.write = None               # last write
        self.reads = {}                 # stream -> its last read since the last write
        self.last_use = {}              # stream -> its last access of any kind
        self.recorded = set()           # streams named by record_stream

    def where(self):
        if self.site is None:
            return "allocated before the sanitizer started"
        return "allocated by %s on %s at %s" % (self.op, self.stream, format_site(self.site))


class Report:
    """One finding: ``kind`` is read-after-write, write-after-read, write-after-write,
    unsafe-reuse or stand-in-mismatch; ``streams``, ``ops`` and ``sites`` (strings)
    name who did what where; ``count`` how often the same finding recurred."""

    def __init__(self, kind, message, streams=(), ops=(), sites=()):
        self.kind, self.message = kind, message
        self.streams, self.ops, self.sites = tuple(streams), tuple(ops), tuple(sites)
        self.count = 1

    def key(self):
        return (self.kind, self.streams, self.ops, self.sites)

    def as_dict(self):
        return {"kind": self.kind, "streams": list(self.streams), "ops": list(self.ops),
                "sites": list(self.sites), "count": self.count, "message": self.message}

    def __str__(self):
        return self.message + ("" if self.count == 1 else " (%d times)" % self.count)

    __repr__ = __str__


class SanitizerError(AssertionError):
    """Raised by ``assert_clean``; ``reports`` holds the findings."""

    def __init__(self, reports):
        self.reports = list(reports)
        super().__init__("%d stream sanitizer report(s):\n%s"
                         % (len(self.reports), "\n".join("- %s" % r for r in self.reports)))


# ------------------------------------------------------------------------------ happens-before

class Clocks:
    """Vector clocks per stream and per recorded event, as CSAN's StreamSynchronizations: a
    stream's clock says, for every stream, up to which launch it has waited."""

    def __init__(self):
        self.streams = {}
        self.events = {}
        self.host = {}

    def of(self, stream):
        clock = self.streams.get(stream)
        if clock is None:
            # A stream first seen now runs after what the host has already waited for.
            clock = self.streams[stream] = dict(self.host)
        return clock

    def tick(self, stream, seq):
        self.of(stream)[stream] = seq

    def ordered(self, stream, seq, other):
        """Whether launch ``seq`` of ``other`` happens before what ``stream`` launches now."""
        return stream == other or seq <= self.of(stream).get(other, 0)

    @staticmethod
    def _merge(into, other):
        for stream, seq in other.items():
            if seq > into.get(stream, 0):
                into[stream] = seq

    def wait_stream(self, waiter, waited):
        self._merge(self.of(waiter), self.of(waited))

    def record(self, event, stream):
        self.events[event] = dict(self.of(stream))

    def wait_event(self, stream, event):
        self._merge(self.of(stream), self.events.get(event, {}))

    def host_waits(self, clock):
        """The host waited for ``clock``: so does everything any stream launches from now on."""
        self._merge(self.host, clock)
        for state in self.streams.values():
            self._merge(state, self.host)

    def sync_device(self):
        self.host_waits({s: c.get(s, 0) for s, c in self.streams.items()})


# ------------------------------------------------------------------------------ the sanitizer

def _storage_key(tensor):
    """(key, storage) of a tensor's memory, or None for what holds none (meta, empty, not dense)."""
    import torch

    try:
        with torch._C.DisableTorchFunctionSubclass():
            if tensor.is_meta:
                return None
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0:
                return None
            return storage._cdata, storage
    except Exception:  # noqa: BLE001 - sparse / nested / opaque tensors hold no plain block
        return None


def _tensors(value):
    import torch
    from torch.utils import _pytree as pytree

    return [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


def _stream_name(get):
    """The name of ``get()``'s stream without initialising the simulated device: torch-npu's
    stream queries do, and zbal's allocator switch must still be possible after the sanitizer
    looked."""
    state = _device.STATE
    was = getattr(state, "initialized", None)
    try:
        return _device.stream_name(get())
    finally:
        if was is not None:
            state.initialized = was


def _peek_stream():
    return _stream_name(_device.current_stream)


def _default_stream():
    return _stream_name(_device.default_stream)


def _pool(nbytes):
    return "small" if nbytes <= SMALL_POOL_LIMIT else "large"


class _Freed:
    """A block back in its stream's pool while another stream may still use it."""

    def __init__(self, block, hazards, site):
        self.block, self.hazards, self.site = block, hazards, site


class Sanitizer:
    """The state of one ``sanitize()`` session (see the module docstring)."""

    def __init__(self):
        self.reports = []
        self.clocks = Clocks()
        self.blocks = {}        # storage key -> Block
        self.pools = {}         # stream -> [_Freed]
        self.seq = 0
        self.launches = 0
        self.lock = threading.RLock()
        self._watched = set()   # storage keys with a finalizer
        self._finalizers = []
        self._kernel = None     # the declared stand-in running now: (input keys, keys it wrote)
        self._seen = {}
        self._mode = None
        self._restore = []

    # -- reports
    def report(self, kind, message, streams=(), ops=(), sites=()):
        found = Report(kind, message, streams, ops, sites)
        earlier = self._seen.get(found.key())
        if earlier is not None:
            earlier.count += 1  # the same pair of call sites again (a loop, the next layer)
            return
        self._seen[found.key()] = found
        self.reports.append(found)

    def kinds(self):
        return sorted({r.kind for r in self.reports})

    def assert_clean(self):
        if self.reports:
            raise SanitizerError(self.reports)

    # -- storages
    def _block(self, key, storage):
        """The block of a storage; one never seen so far existed before the sanitizer."""
        block = self.blocks.get(key)
        if block is None:
            block = self.blocks[key] = Block(storage.nbytes(), None, None, None)
            self._watch(key, storage)
        return block

    def _watch(self, key, storage):
        if key not in self._watched:
            self._watched.add(key)
            self._finalizers.append(weakref.finalize(storage, self._storage_died, key))

    def _storage_died(self, key):
        with self.lock:
            self._watched.discard(key)
            block = self.blocks.pop(key, None)
            if block is not None and _ACTIVE is self:
                self._free(block, _site())

    def _owner(self, block):
        return block.stream or _default_stream()

    def _free(self, block, site):
        """The host frees ``block``: back to its allocation stream's pool, with the uses other
        streams made of it that neither record_stream nor a wait of that stream covers."""
        owner = self._owner(block)
        hazards = [a for s, a in block.last_use.items()
                   if s != owner and s not in block.recorded and not self.clocks.ordered(owner, a.seq, s)]
        if hazards:
            self.pools.setdefault(owner, []).append(_Freed(block, hazards, site))

    def _allocate(self, key, storage, stream, op, site):
        """A fresh block on ``stream``: first whether the allocator could hand it a block that
        another stream may still be using."""
        nbytes = storage.nbytes()
        self._check_pool(stream, nbytes, op, site)
        block = self.blocks[key] = Block(nbytes, stream, site, op)
        self._watch(key, storage)
        return block

    def _check_pool(self, stream, nbytes, op, site):
        pool = self.pools.get(stream)
        if not pool:
            return
        for freed in list(pool):
            freed.hazards = [a for a in freed.hazards if not self.clocks.ordered(stream, a.seq, a.stream)]
            if not freed.hazards:
                pool.remove(freed)  # its allocation stream has waited for every use since
            elif _pool(freed.block.nbytes) == _pool(nbytes):
                pool.remove(freed)
                self._report_reuse(freed, stream, op, site)

    def _report_reuse(self, freed, stream, op, site):
        use = freed.hazards[-1]
        self.report(
            "unsafe-reuse",
            "unsafe reuse: a block %s was used by %s (%s), then freed at %s without "
            "record_stream(%s) and before %s waited for that use; the caching allocator can hand it "
            "to %s's allocation by %s at %s while %s may still be using it"
            % (freed.block.where(), use.stream, use.describe(), format_site(freed.site), use.stream,
               self._owner(freed.block), stream, op, format_site(site), use.stream),
            streams=(self._owner(freed.block), use.stream),
            ops=(freed.block.op or "", use.op, op),
            sites=(format_site(freed.block.site or (), 1), format_site(use.site, 1),
                   format_site(freed.site, 1), format_site(site, 1)))

    def resized(self, storage, before, after):
        """``untyped_storage().resize_``: the old bytes are freed, new ones (if any) allocated on
        the current stream."""
        if before == after or _graphs.is_current_stream_capturing():
            return
        with self.lock:
            key = storage._cdata
            block = self.blocks.pop(key, None)
            site = _site()
            if block is not None:
                self._free(block, site)
            if after > 0:
                stream = _peek_stream()
                self._tick(stream)
                self._allocate(key, storage, stream, "UntypedStorage.resize_", site)
                self._access(self.blocks[key], Access(WRITE, self.seq, stream, "UntypedStorage.resize_",
                                                      None, site))

    def record_stream(self, tensor, stream_name):
        found = _storage_key(tensor)
        if found is None:
            return
        with self.lock:
            block = self._block(*found)
            if stream_name != self._owner(block):
                block.recorded.add(stream_name)

    # -- kernels
    def _tick(self, stream):
        self.seq += 1
        self.launches += 1
        self.clocks.tick(stream, self.seq)

    def launch(self, op, accesses, outputs):
        """One kernel on the current stream: ``accesses`` [(kind, tensor, argument name)] of its
        inputs, then its ``outputs`` (tensors); fresh storages among them are allocated here."""
        with self.lock:
            stream = _peek_stream()
            self._tick(stream)
            site = _site()
            touched = {}  # storage key -> (kind, argument name); a write covers a read
            for kind, tensor, arg in accesses:
                found = _storage_key(tensor)
                if found is None:
                    continue
                self._block(*found)
                if kind is not None and touched.get(found[0], (None,))[0] != WRITE:
                    touched[found[0]] = (kind, arg)
            for tensor in outputs:
                found = _storage_key(tensor)
                if found is not None and found[0] not in self.blocks:
                    self._allocate(found[0], found[1], stream, op, site)
                    touched[found[0]] = (WRITE, "output")
            for key, (kind, arg) in touched.items():
                self._access(self.blocks[key], Access(kind, self.seq, stream, op, arg, site))

    def _access(self, block, access):
        if access.kind == READ:
            self._conflict(block, access, block.write)
            block.reads[access.stream] = access
        else:
            previous = list(block.reads.values()) or [block.write]
            for earlier in previous:
                self._conflict(block, access, earlier)
            block.write, block.reads = access, {}
        block.last_use[access.stream] = access

    def _conflict(self, block, access, earlier):
        if earlier is None or self.clocks.ordered(access.stream, earlier.seq, earlier.stream):
            return
        kind = "%s-after-%s" % (access.kind, earlier.kind)
        self.report(
            kind,
            "data race (%s) on a %d-byte block %s: %s, then %s, with no wait between them"
            % (kind, block.nbytes, block.where(), earlier.describe(), access.describe()),
            streams=(earlier.stream, access.stream), ops=(earlier.op, access.op),
            sites=(format_site(earlier.site, 1), format_site(access.site, 1)))

    # -- declared stand-ins
    def run_kernel(self, fn, declared, args, kwargs):
        """A declared stand-in: one launch with the real op's reads and writes; what its inner
        ops wrote must be what the schema lets it write."""
        if self._kernel is not None:
            return fn(*args, **kwargs)  # a stand-in calling another is one kernel
        bound = declared.bind(args, kwargs)
        inputs = {}
        for name, value in bound:
            for tensor in _tensors(value):
                found = _storage_key(tensor)
                if found is not None:
                    inputs[found[0]] = name
        self._kernel = (inputs, set())
        try:
            out = fn(*args, **kwargs)
        finally:
            _, wrote = self._kernel
            self._kernel = None
        self._check_stand_in(declared, bound, inputs, wrote, out)
        accesses = [(WRITE if declared.writes(name) else READ, tensor, name)
                    for name, value in bound for tensor in _tensors(value)]
        self.launch(declared.name, accesses, _tensors(out))
        return out

    def inner_write(self, tensor):
        found = _storage_key(tensor)
        if found is not None and self._kernel is not None:
            self._kernel[1].add(found[0])

    def _check_stand_in(self, declared, bound, inputs, wrote, out):
        for name in declared.unknown(bound):
            self._mismatch(declared, "is called with %s, an argument the real op does not have" % name, name)
        for name in sorted({inputs[k] for k in wrote if k in inputs and not declared.writes(inputs[k])}):
            self._mismatch(declared, "writes its argument %s, which the real op only reads" % name, name)
        for index, value in enumerate(out if isinstance(out, tuple) else (out,)):
            if declared.returns_alias(index):
                continue
            for tensor in _tensors(value):
                found = _storage_key(tensor)
                if found is not None and found[0] in inputs:
                    self._mismatch(declared, "returns (output %d) memory of its argument %s where the "
                                   "real op returns a new tensor" % (index, inputs[found[0]]),
                                   inputs[found[0]])

    def _mismatch(self, declared, what, name):
        self.report("stand-in-mismatch", "the stand-in for %s %s (%s)" % (declared.name, what, declared.source),
                    ops=(declared.name,), sites=(name, what))

    # -- streams, from the simulated NPU's event log
    def on_event(self, event):
        handler = _EVENT_HANDLERS.get(event[0])
        if handler is not None and _graphs.captured_edge(event):
            return  # an edge inside a capture happens at each replay, which logs it again
        if handler is not None:
            with self.lock:
                handler(self, *event[1:])

    def _empty_cache(self):
        # Cached blocks go back to the driver, which synchronises before freeing device memory.
        self.pools.clear()

    # -- on / off
    def enable(self):
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("a stream sanitizer is already running in this process")
        _ACTIVE = self
        _log.LISTENERS.append(self.on_event)
        self._patch_torch()
        self._mode = _Mode(self)
        self._mode.__enter__()

    def disable(self):
        global _ACTIVE
        try:
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
        finally:
            self._mode = None
            for undo in reversed(self._restore):
                undo()
            self._restore = []
            if self.on_event in _log.LISTENERS:
                _log.LISTENERS.remove(self.on_event)
            for finalizer in self._finalizers:
                finalizer.detach()
            self._finalizers = []
            _ACTIVE = None

    def _patch_torch(self):
        """record_stream taking a simulated stream, and storage resizes seen as frees."""
        import torch

        record = torch.Tensor.__dict__.get("record_stream")
        real_record = torch.Tensor.record_stream

        def record_stream(tensor, stream):
            if isinstance(stream, _device.Stream):
                _device.note_stream_use(tensor, stream)
                self.record_stream(tensor, _device.stream_name(stream))
                return None
            return real_record(tensor, stream)

        torch.Tensor.record_stream = record_stream
        self._restore.append(lambda: _put(torch.Tensor, "record_stream", record))

        storage_cls = torch.UntypedStorage
        own = storage_cls.__dict__.get("resize_")
        real_resize = storage_cls.resize_

        def resize_(storage, size):
            before = storage.nbytes()
            out = real_resize(storage, size)
            self.resized(storage, before, storage.nbytes())
            return out

        storage_cls.resize_ = resize_
        self._restore.append(lambda: _put(storage_cls, "resize_", own))


def _put(cls, name, value):
    if value is None:
        if name in cls.__dict__:
            delattr(cls, name)
    else:
        setattr(cls, name, value)


_EVENT_HANDLERS = {
    "stream_create": lambda san, name: san.clocks.of(name),
    "stream_enter": lambda san, name: san.clocks.of(name),
    "set_stream": lambda san, name: san.clocks.of(name),
    "wait_stream": lambda san, waiter, waited: san.clocks.wait_stream(waiter, waited),
    "event_record": lambda san, event, stream: san.clocks.record(event, stream),
    "wait_event": lambda san, stream, event: san.clocks.wait_event(stream, event),
    "stream_sync": lambda san, name: san.clocks.host_waits(san.clocks.of(name)),
    "event_sync": lambda san, event: san.clocks.host_waits(san.clocks.events.get(event, {})),
    "synchronize": lambda san, device: san.clocks.sync_device(),
    "empty_cache": lambda san: san._empty_cache(),
}


def _is_factory(name):
    # As CSAN: new_* and *_like read only their input's metadata.
    base = name.split("::")[-1]
    return base.startswith("new_") or base.endswith("_like")


def _accesses(schema, args, kwargs):
    """[(kind, tensor, argument name)] of an op's inputs, from its schema (CSAN's reading); kind
    None: only its metadata is read (the storage is still known from then on, so that a view of it
    is not taken for a fresh allocation)."""
    factory = _is_factory(schema.name)
    out = []
    positional = schema.arguments[:len(args)]
    named = {a.name: a for a in schema.arguments[len(args):]}
    pairs = list(zip(positional, args)) + [(named[k], v) for k, v in kwargs.items() if k in named]
    for argument, value in pairs:
        alias = argument.alias_info
        if alias is not None and alias.is_write:
            kind = WRITE
        elif factory or alias is not None:
            kind = None  # a view or a factory reads only metadata
        else:
            kind = READ
        out += [(kind, t, argument.name) for t in _tensors(value)]
    return out


def _mode_class():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __init__(self, san):
            super().__init__()
            self.san = san

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if _graphs.is_current_stream_capturing():
                return func(*args, **kwargs)  # recorded, or host work: no launch on a stream now
            san = self.san
            schema = func._schema
            accesses = _accesses(schema, args, kwargs)
            out = func(*args, **kwargs)
            if san._kernel is not None:
                for kind, tensor, _ in accesses:
                    if kind == WRITE:
                        san.inner_write(tensor)
            elif func.__name__ != "record_stream.default":
                san.launch(schema.name.split("::")[-1], accesses, _tensors(out))
            return out

    return Mode


_MODE_CLASS = None


def _Mode(san):  # noqa: N802 - reads like the class it builds
    global _MODE_CLASS
    if _MODE_CLASS is None:
        _MODE_CLASS = _mode_class()
    return _MODE_CLASS(san)


@contextlib.contextmanager
def sanitize():
    """Run the block under a fresh stream sanitizer; yields it (``.reports``, ``.assert_clean()``)."""
    san = Sanitizer()
    san.enable()
    try:
        yield san
    finally:
        san.disable()


def active():
    return _ACTIVE


# ------------------------------------------------------------------------------ declared kernels

class Declared:
    """A stand-in's real op schema: which parameter is which argument, which ones it writes."""

    def __init__(self, schema, source, fn):
        import torch

        self.schema = torch._C.parse_schema(schema)
        self.name = self.schema.name
        self.source = source
        self._aliased_returns = [r.alias_info is not None for r in self.schema.returns]
        self._written = {a.name for a in self.schema.arguments
                         if a.alias_info is not None and a.alias_info.is_write}
        names = [a.name for a in self.schema.arguments]
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(params) > len(names):
            raise TypeError("%s takes more parameters than %s has arguments" % (fn.__name__, self.name))
        # The stand-in's own parameter names map onto the schema's by position.
        self._by_param = {p.name: names[i] for i, p in enumerate(params)}
        self._positional = names[:len(params)]
        self._names = set(names)

    def writes(self, name):
        return name in self._written

    def returns_alias(self, index):
        return index < len(self._aliased_returns) and self._aliased_returns[index]

    def unknown(self, bound):
        return [name for name, _ in bound if name not in self._names]

    def bind(self, args, kwargs):
        """[(schema argument name, value)] of one call (a keyword the schema lacks keeps its name:
        ``unknown`` lists it)."""
        pairs = list(zip(self._positional, args))
        pairs += [(self._by_param.get(key, key), value) for key, value in kwargs.items()]
        return pairs


def declare_kernel(schema, source):
    """Decorate a pure-torch stand-in with the schema of the real NPU op it stands for (``source``
    says where that schema is from).  Without a sanitizer running, the call is the stand-in's own;
    ``__wrapped__`` is the stand-in (its source and signature stay readable)."""
    def decorate(fn):
        declared = Declared(schema, source, fn)

        @functools.wraps(fn)
        def launch(*args, **kwargs):
            san = _ACTIVE
            if san is None or _graphs.is_current_stream_capturing():
                return fn(*args, **kwargs)
            return san.run_kernel(fn, declared, args, kwargs)

        launch.declared = declared
        return launch

    return decorate
