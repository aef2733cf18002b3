"""What a whole sglang server needs of the simulated NPU beyond the namespace (``install(server=True)``).

A server process places tensors on ``npu``, builds an ``hccl`` process group and calls torch_npu's
operators for real; the rest of the simulation only answers the device module.  Here:

* **tensors on ``npu`` live on the CPU**: a torch-function mode, pushed once for the process,
  turns every ``device=npu`` (keyword or a ``.to`` argument) into ``cpu`` -- no kernel exists for an
  ``npu`` tensor here -- and counts the allocation, so that ``change_current_allocator`` refuses
  after the first one as torch_npu does.  ``Tensor.npu()`` / ``Module.npu()`` keep the tensor
  where it is; pinned host memory is plain host memory (no accelerator to pin for);
* **the accelerator**: ``torch._C._get_accelerator()`` answers ``npu`` (torch_npu's C++ hooks);
* **``hccl``**: a ``torch.distributed`` backend (torch_npu registers it from C++) that builds a Gloo
  group, for ``npu`` and for the ``cpu`` tensors that stand for npu ones -- as is every backend
  registered for ``npu`` (zbal's);
* **the operators** (``_ops/``): defined with ``torch.library`` under the schemas torch_npu
  2.13.0 registers, reached as ``torch.ops.npu.*`` / ``torch.ops.atb.*`` and as ``torch_npu.*``
  the way torch_npu binds them; sgl-kernel-npu's triton allocator kernel as a stand-in running
  sglang's own naive allocator;
* ``F.linear`` of an fp32 input and a bf16 weight computes in fp32 (the DSA indexer does it on the
  npu; CPU torch refuses mixed dtypes);
* for the MLA decode server's checks: ``SIMNPU_TRACK_DERIVED=1`` counts storages derived from npu
  tensors as npu memory, and ``SIMNPU_MEMORY_DIR`` makes a process write its counters on SIGUSR2.
* **DeepEP** (``_deepep.py``): sgl-kernel-npu's ``deep_ep.Buffer`` as sglang calls it, its
  dispatch and combine in pure torch for one expert-parallel rank.
"""
from __future__ import annotations

import datetime
import os
import threading

from . import _device, _graphs, _log, _stubs

_lock = threading.Lock()
_installed = False

def _is_npu(device) -> bool:
    import torch

    if isinstance(device, str):
        return device == "npu" or device.startswith("npu:")
    if isinstance(device, torch.device):
        return device.type == "npu"
    return False


def _device_mode():
    import torch
    from torch.overrides import TorchFunctionMode

    class NpuTensorsOnCpu(TorchFunctionMode):
        """``device=npu`` -> ``cpu``; ``pin_memory`` dropped (nothing to pin for).  What is placed
        on the npu is counted until it is freed, so the device's free memory goes down as weights
        and the KV cache arrive, as on a device."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            placed = False
            if kwargs:
                device = kwargs.get("device")
                if device is not None and _is_npu(device):
                    kwargs = dict(kwargs, device="cpu")
                    placed = True
                if kwargs.get("pin_memory"):
                    kwargs = dict(kwargs, pin_memory=False)
            if len(args) > 1 and getattr(func, "__name__", "") == "to" and _is_npu(args[1]):
                args = (args[0], "cpu", *args[2:])
                placed = True
            if func is torch.nn.functional.linear and _mixed_float(args):
                args = _promoted(args)
            out = func(*args, **(kwargs or {}))
            if placed:
                _device.STATE.npu_allocations += 1
                if isinstance(out, torch.Tensor) and out.untyped_storage().nbytes():
                    _track(out.untyped_storage())
            elif _TRACK_DERIVED and _tracked and func not in _LEAVES_THE_DEVICE:
                _track_derived(args, kwargs, out)
            return out

    return NpuTensorsOnCpu()


def _mixed_float(args) -> bool:
    """``F.linear`` of an fp32 input and a bf16/fp16 weight: sglang 0.5.11's DSA indexer does it
    on the npu (``self.weights_proj(x.float())``, a bf16 ``weights_proj``), so torch_npu is taken
    to accept it (sglang's NPU path relies on it; not seen on a device here); CPU torch refuses
    mixed dtypes."""
    import torch

    tensors = [a for a in args[:3] if isinstance(a, torch.Tensor)]
    return (len(tensors) >= 2 and all(t.is_floating_point() for t in tensors)
            and len({t.dtype for t in tensors}) > 1)


def _promoted(args):
    """The float tensors of a mixed-dtype ``F.linear`` in fp32 (the product's accumulation type)."""
    import torch

    return tuple(a.float() if isinstance(a, torch.Tensor) else a for a in args)


_tracked: dict = {}  # storage data pointer -> bytes counted

#: ``SIMNPU_TRACK_DERIVED=1``: a new storage an op makes from npu tensors is on the npu too (as on a
#: device: ``w.transpose(1, 2).contiguous()`` of an npu weight is npu memory), so weights sglang
#: rebuilds after loading (``w_kc`` / ``w_vc`` from ``kv_b_proj``, NZ casts) are counted.  Off by
#: default: every tensor here is a CPU tensor, and only what is placed on the npu by name is
#: counted (the figures the zbal servers' tests pin).
_TRACK_DERIVED = os.environ.get("SIMNPU_TRACK_DERIVED") == "1"


def _leaves_the_device():
    import torch

    return {torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.item}


_LEAVES_THE_DEVICE: set = set()


def _storages(value, out, depth=0):
    import torch

    if isinstance(value, torch.Tensor):
        try:
            storage = value.untyped_storage()
        except Exception:  # noqa: BLE001 - a tensor subclass that refuses (a released weight)
            return
        out.append(storage)
    elif depth < 2 and isinstance(value, (list, tuple)):
        for item in value:
            _storages(item, out, depth + 1)


def _track_derived(args, kwargs, result) -> None:
    """Count the new storages of ``result`` when an input's storage is counted (on the npu), unless
    the call moves it to the host (``.to("cpu")``)."""
    inputs = []
    for value in list(args) + list((kwargs or {}).values()):
        _storages(value, inputs)
    if not any(st.data_ptr() in _tracked for st in inputs):
        return
    if any(isinstance(a, str) and a.startswith("cpu") for a in args[1:]) or \
            str((kwargs or {}).get("device", "")).startswith("cpu"):
        return
    outputs = []
    _storages(result, outputs)
    for st in outputs:
        if st.nbytes() and st.data_ptr() not in _tracked:
            _track(st)


def memory_snapshot() -> dict:
    """The simulated device's counters now (after a collection: what is unreachable is freed)."""
    import gc

    gc.collect()
    return {"pid": os.getpid(), "live_npu_bytes": _device.STATE.live_npu_bytes,
            "pluggable_bytes": _device.STATE.pluggable_bytes, "storages": len(_tracked),
            "graph_pool_bytes": _device.STATE.graph_pool_bytes,
            "graph_pools": {"%d,%d" % k: v for k, v in _graphs.pools().items()},
            "track_derived": _TRACK_DERIVED,
            # the order of captures, replays and device storage resizes (a release in a capture shows)
            "graph_events": [list(e) for e in _log.EVENTS
                             if e[0] in ("capture_begin", "capture_end", "replay", "storage_resize")]}


def _dump_on_signal() -> None:
    """``SIMNPU_MEMORY_DIR``: on SIGUSR2 the process writes ``memory_snapshot()`` to
    ``<dir>/<pid>.json`` (how a test reads a server process's device memory from outside)."""
    import json
    import signal

    directory = os.environ.get("SIMNPU_MEMORY_DIR")
    if not directory or threading.current_thread() is not threading.main_thread():
        return

    def dump(signum, frame):
        path = os.path.join(directory, "%d.json" % os.getpid())
        with open(path + ".tmp", "w") as fh:
            json.dump(memory_snapshot(), fh)
        os.replace(path + ".tmp", path)

    signal.signal(signal.SIGUSR2, dump)


def _track(storage) -> None:
    """Count a storage placed on the npu until it is collected (once, however many tensors view it)."""
    import weakref

    key = storage.data_ptr()
    if key in _tracked:
        return
    from . import _graphs

    if _graphs.takes_placement(storage):  # allocated inside a live capture: the graph's pool's
        return
    # from where the allocator current now takes it: zbal's heap once zbal's pluggable allocator
    # is current and its heap is bootstrapped, else device memory (mix mode before its lazy heap)
    in_heap = _device.STATE.allocator is not None and _device.STATE.heap_active
    field = "pluggable_bytes" if in_heap else "live_npu_bytes"
    nbytes = storage.nbytes()
    _tracked[key] = nbytes
    setattr(_device.STATE, field, getattr(_device.STATE, field) + nbytes)

    def give_back(key=key, nbytes=nbytes, field=field):
        if _tracked.pop(key, None) is not None:
            setattr(_device.STATE, field, getattr(_device.STATE, field) - nbytes)

    def freed(key=key, nbytes=nbytes):
        # a block other streams used, freed while a capture is underway: the native allocator
        # defers the free until the capture ends (_graphs.defer_free)
        if not _graphs.defer_free(key, nbytes, give_back):
            give_back()

    try:
        weakref.finalize(storage, freed)
    except TypeError:  # a storage that takes no weak reference: counted for the process's life
        pass


def _record_stream_takes_simulated_streams(torch) -> None:
    """``tensor.record_stream(s)`` of a simulated stream (sglang's MLA path records its q on the
    alternate stream when capturing): the stream use is noted (``_device.note_stream_use``)."""
    real = torch.Tensor.record_stream

    def record_stream(tensor, stream):
        if isinstance(stream, _device.Stream):
            _device.note_stream_use(tensor, stream)
            return None
        return real(tensor, stream)

    record_stream.__wrapped__ = real
    torch.Tensor.record_stream = record_stream


def _register_hccl():
    import torch.distributed as dist

    if "hccl" in dist.Backend.backend_list:
        return

    def create(store, rank, size, timeout):
        return dist.ProcessGroupGloo(store, rank, size, timeout or datetime.timedelta(minutes=30))

    dist.Backend.register_backend("hccl", create, devices=["npu", "cpu"])


def _npu_backends_take_cpu_tensors() -> None:
    """A backend registered for ``npu`` (zbal's, registered as its package is imported) also
    serves the ``cpu`` tensors that stand for npu ones here."""
    import torch.distributed as dist

    original = dist.Backend.register_backend.__func__

    def register_backend(cls, name, func, extended_api=False, devices=None):
        if devices is not None:
            devices = [devices] if isinstance(devices, str) else list(devices)
            if "npu" in devices and "cpu" not in devices:
                devices.append("cpu")
        return original(cls, name, func, extended_api, devices)

    dist.Backend.register_backend = classmethod(register_backend)


def _answer_accelerator(torch) -> None:
    """``torch._C._get_accelerator()`` (what ``torch.distributed.barrier`` asks) is answered from
    the PrivateUse1 hooks torch_npu registers in C++; none are registered here, so it would raise:
    the device here is the npu, as there."""
    original = torch._C._get_accelerator

    def _get_accelerator(check=False):
        return torch.device("npu", _device.STATE.device)

    _get_accelerator.__wrapped__ = original
    torch._C._get_accelerator = _get_accelerator


def install() -> None:
    """Once per process, after the namespace is in place (``simnpu.install``)."""
    global _installed
    with _lock:
        if _installed:
            return
        import torch

        from . import _ops

        _LEAVES_THE_DEVICE.update(_leaves_the_device())
        _dump_on_signal()
        _device_mode().__enter__()  # for the process: never exited
        torch.Tensor.npu = lambda self, *args, **kwargs: self
        torch.nn.Module.npu = lambda self, *args, **kwargs: self
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
        _record_stream_takes_simulated_streams(torch)
        _graphs.log_device_resizes()
        _answer_accelerator(torch)
        _npu_backends_take_cpu_tensors()
        _register_hccl()
        _ops.define()
        f = _stubs.finder()
        f.overrides.setdefault("torch_npu", {}).update(_ops.torch_npu_names())
        for module, names in _ops.kernel_stand_ins().items():
            f.overrides.setdefault(module, {}).update(names)
        # sgl-kernel-npu's deep_ep (DeepEP on Ascend), which an NPU image ships: sglang's
        # --moe-a2a-backend deepep dispatches and combines through its Buffer (_deepep.py)
        from . import _deepep

        f.roots.add("deep_ep")
        for module, names in _deepep.stand_in_modules().items():
            f.overrides.setdefault(module, {}).update(names)
        _installed = True
