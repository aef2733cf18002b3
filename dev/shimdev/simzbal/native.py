"""What the simulated ``zbal.zbal`` extension module holds (zbal_native.c calls ``populate``).

Names and call shapes are those the wheel's Python files use (tests/dev/test_simzbal.py checks that
they import nothing else and that each name is a registered string of the real native module);
the behaviour is driven by ``shimdev.simzbal.STATE``.
"""
from __future__ import annotations

import enum
import os
import sys
import types

from shimdev import simzbal
# DeepEP's Config as sgl-kernel-npu's deep_ep stand-in defines it: the real zbal library registers
# the same class (zbal.zbal.deepep_adaptor looks it up by name, DEEPEP_NAMES).
from shimdev.simnpu._deepep import Config as Config


class ZBALBootstrapType(enum.IntEnum):
    BOOT_BY_MEMFABRIC = 0
    BOOT_BY_BUTT = 1


class ZBALBootstrapOption:
    """A bound C struct: only its fields can be set, as pybind11 allows."""

    __slots__ = tuple(simzbal.BOOTSTRAP_FIELDS)

    def __init__(self):
        for name in self.__slots__:
            setattr(self, name, 0)
        self.ipPort = ""
        self.btType = ZBALBootstrapType.BOOT_BY_MEMFABRIC

    def fields(self):
        return {name: getattr(self, name) for name in self.__slots__}


def zbal_version():
    return simzbal.STATE.version


def zbal_bootstrap(opt):
    """The heap is what the caller asked for (``deviceMemorySize``, bytes), carved out of the
    device: more than the device has fails, as reserving it would on a device.  With
    ``SIMZBAL_RENDEZVOUS=1`` (the server test bed) the ranks of one world really meet at ``ipPort``
    (``rendezvous.py``), as memfabric's config server makes them."""
    from shimdev.simnpu._device import MIB, STATE as DEVICE

    simzbal.record("zbal_bootstrap", opt.fields())
    state = simzbal.STATE
    ok = bool(state.init_result)
    if ok and not 0 < opt.deviceMemorySize <= DEVICE.total_mib * MIB:
        print("[ZBAL] bootstrap failed: %d bytes asked, the device has %d"
              % (opt.deviceMemorySize, DEVICE.total_mib * MIB), file=sys.stderr, flush=True)
        ok = False
    if ok and os.environ.get("SIMZBAL_RENDEZVOUS") == "1":
        from shimdev.simzbal import rendezvous

        try:
            state.world = rendezvous.meet(opt.ipPort, opt.rankId, opt.worldSize)
        except rendezvous.RendezvousError as exc:
            print("[ZBAL] bootstrap failed: %s" % exc, file=sys.stderr, flush=True)
            ok = False
    state.initialized = ok
    DEVICE.heap_active = ok
    state.ip_port = opt.ipPort
    if ok:
        state.heap_total = state.heap_free = int(opt.deviceMemorySize)
    return 0 if ok else -1


def zbal_unbootstrap(flags=0):
    simzbal.record("zbal_unbootstrap", {"flags": flags})
    simzbal.STATE.initialized = False
    return 0


def zbal_comm_destroy_all(flags=0):
    simzbal.record("zbal_comm_destroy_all", {"flags": flags})
    return 0


def zbal_set_logger_level(level):
    simzbal.record("zbal_set_logger_level", {"level": level})


def _gloo():
    from torch.distributed import ProcessGroupGloo

    return ProcessGroupGloo


class ProcessGroupZBAL(_gloo()):
    """The c10d backend class zbal registers for "npu": a real ``torch.distributed`` backend
    (``init_process_group(backend="zbal")`` registers what it returns with the group, which only a
    ``Backend`` passes), its collectives run by Gloo over the CPU tensors that stand for npu ones."""

    class Options:
        def __init__(self):
            self.is_high_priority_stream = False
            self.op_timeout = None
            self.global_ranks_in_group = []
            self.group_id = ""

    def __init__(self, store, rank, size, options=None):
        import datetime

        timeout = getattr(options, "op_timeout", None) or datetime.timedelta(minutes=30)
        super().__init__(store, rank, size, timeout)
        self.zbal_options = options  # Gloo owns "options" (its own, read-only)

    def get_zbal_comm_name(self):
        return "zbal_comm_%d_%d" % (self.rank(), self.size())

    def init_zbal_comm_meta(self):
        return None


# -- zbal.zbal.allocator ---------------------------------------------------------------------------

def get_heap_stats():
    """(used bytes, total bytes) of the heap: zbal.mem_get_info() turns it into (free, total)."""
    from shimdev.simnpu._device import STATE as DEVICE

    state = simzbal.STATE
    simzbal.record("get_heap_stats")
    used = state.heap_total - state.heap_free + DEVICE.pluggable_bytes  # what was placed in it
    return min(used, state.heap_total), state.heap_total


def is_mix_alloc():
    simzbal.record("is_mix_alloc")
    return bool(simzbal.STATE.mix)


def simulate_init(*args):
    simzbal.record("simulate_init", {"args": args})


def record_memory_history(*args):
    simzbal.record("record_memory_history", {"args": args})


def dump_snapshot(*args):
    simzbal.record("dump_snapshot", {"args": args})


# -- the graph-pool hooks (zbal_native.c's zbal_pluggable_*_pool call these) ----------------------

def _device_counters():
    from shimdev.simnpu._device import STATE as DEVICE

    return {"gva_heap": DEVICE.pluggable_bytes, "device": DEVICE.live_npu_bytes}


def pool_source():
    """Which of the real library's allocators takes a pool now: ``zbal_pluggable_begin_allocate_to_
    pool`` routes as ``zbal_pluggable_malloc`` does -- in mix mode (``use_vmm_for_static_memory``)
    to the GVA heap's allocator (``sma_*``) once the GVA space exists, else to zbal's device
    caching allocator (``dma_*``); in full mode to the heap's."""
    from shimdev.simnpu._device import STATE as DEVICE

    state = simzbal.STATE
    return "gva_heap" if not state.mix or (state.initialized and DEVICE.heap_active) else "device"


def _pool_problem(message):
    """The real allocators fail such a call (its message, from the library's strings); a void C
    hook cannot raise, so it is said and kept for the tests."""
    simzbal.STATE.pool_errors.append(message)
    print("[ZBAL] %s" % message, file=sys.stderr, flush=True)


def pool_begin(device, pool, with_filter):
    """A capture begins to allocate to ``pool`` on ``device``: from here until ``pool_end`` the
    bytes placed on the device count as the pool's (in the counter of its source)."""
    state, pool = simzbal.STATE, tuple(pool)
    if device in state.recording:
        _pool_problem("beginAllocateToPool: already recording to mempool_id %s" % (state.recording[device][0],))
        return
    source = pool_source()
    entry = state.pools.setdefault(pool, {"source": source, "captures": 0, "bytes": 0, "released": False})
    entry["captures"] += 1
    entry["released"] = False
    state.recording[device] = (pool, _device_counters())
    simzbal.record("pool_begin", {"device": device, "pool": pool, "filter": bool(with_filter),
                                  "source": source})


def pool_end(device, pool):
    """The capture ended: what it placed and still holds is the pool's."""
    state, pool = simzbal.STATE, tuple(pool)
    if state.recording.get(device, (None,))[0] != pool:
        _pool_problem("endAllocatePool: not currently recording to mempool_id %s" % (pool,))
        return
    _, before = state.recording.pop(device)
    entry = state.pools[pool]
    now = _device_counters()
    grown = {where: now[where] - before[where] for where in now}
    entry["bytes"] += max(0, grown[entry["source"]])
    simzbal.record("pool_end", {"device": device, "pool": pool, "source": entry["source"],
                                "bytes": entry["bytes"], "grown": grown})


def pool_release(device, pool):
    """The graph was reset: the pool's memory goes back to its allocator."""
    state, pool = simzbal.STATE, tuple(pool)
    entry = state.pools.get(pool)
    if entry is None:
        _pool_problem("Could not find pool of id %s" % (pool,))
        return
    entry["released"] = True
    simzbal.record("pool_release", {"device": device, "pool": pool, "bytes": entry["bytes"]})


# -- zbal.zbal.deepep_adaptor ------------------------------------------------------------------------

def _deepep():
    from shimdev.simnpu import _deepep

    return _deepep


class EventHandle:
    def current_stream_wait(self):
        return None


def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
    return num_max_dispatch_tokens_per_rank * hidden * num_ranks * 2 * 2


#: The runtime's kernels, computed by the simulated NPU's DeepEP runtime (simnpu/_deepep.py, one
#: expert-parallel rank); each name is a string the real library registers.
RUNTIME_METHODS = ("get_num_rdma_ranks", "get_dispatch_layout", "intranode_dispatch",
                   "intranode_combine", "clean_low_latency_buffer", "low_latency_dispatch",
                   "low_latency_combine")


_RECORDED: set = set()


class Buffer:
    """The runtime behind zbal_buffer.Buffer: its dispatch/combine kernels in pure torch (one
    rank); anything else it is asked needs a device."""

    def __init__(self, rank, group_size, num_nvl_bytes, num_rdma_bytes, low_latency_mode, group_name):
        simzbal.record("deepep_buffer", {"rank": rank, "group_size": group_size, "group_name": group_name})
        self.rank, self.group_size = rank, group_size
        self._runtime = None
        self._args = (rank, group_size, num_nvl_bytes, num_rdma_bytes, low_latency_mode, group_name)
        print("[simzbal] deepep_adaptor.Buffer: rank %d of %d, group %r" % (rank, group_size, group_name),
              file=sys.stderr, flush=True)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_runtime", "_args"):
            raise AttributeError(name)
        if name in RUNTIME_METHODS:
            if self._runtime is None:  # built on first use: a group of more ranks raises then
                self._runtime = _deepep().Runtime(*self._args)
            method = getattr(self._runtime, name)
            if name not in _RECORDED:  # once per process: a server calls them every layer
                _RECORDED.add(name)
                simzbal.record("deepep_" + name, {"rank": self.rank})
            return method

        def not_simulated(*args, **kwargs):
            raise NotImplementedError("simulated zbal: deepep_adaptor.Buffer.%s needs a device" % name)
        return not_simulated


# -- the module --------------------------------------------------------------------------------------

MODULE_NAMES = ("ZBALBootstrapType", "ZBALBootstrapOption", "zbal_version", "zbal_bootstrap",
                "zbal_unbootstrap", "zbal_comm_destroy_all", "zbal_set_logger_level", "ProcessGroupZBAL")
ALLOCATOR_NAMES = ("get_heap_stats", "is_mix_alloc", "simulate_init", "record_memory_history",
                   "dump_snapshot")
DEEPEP_NAMES = ("Config", "EventHandle", "Buffer", "get_low_latency_rdma_size_hint")


def _submodule(parent, leaf, names):
    """A pybind11-style submodule, registered in sys.modules so ``from zbal.zbal.<leaf> import x``
    works although zbal.zbal is no package."""
    module = types.ModuleType("%s.%s" % (parent.__name__, leaf))
    for name in names:
        setattr(module, name, globals()[name])
    setattr(parent, leaf, module)
    sys.modules[module.__name__] = module
    return module


def populate(module):
    for name in MODULE_NAMES:
        setattr(module, name, globals()[name])
    _submodule(module, "allocator", ALLOCATOR_NAMES)
    _submodule(module, "deepep_adaptor", DEEPEP_NAMES)
