"""simnpu: a simulated Ascend NPU on CPU torch, for npu-shim's tests.

Call ``simnpu.install(release=...)`` before the first sglang import.  Afterwards:

* ``torch.npu`` (== ``torch_npu.npu``) exists, ``is_available()`` is True, memory is driven by
  ``set_memory()`` or the env vars ``SIMNPU_TOTAL_MIB`` / ``SIMNPU_FREE_MIB`` (read by install());
* ``torch.device("npu:0")`` is valid (``torch.utils.rename_privateuse1_backend("npu")``);
  ``torch.get_device_module("npu")`` is ``torch.npu``; ``torch.get_device_module()`` (no argument)
  is wrapped to return ``torch.npu`` too -- torch 2.13 resolves the no-argument form through
  ``torch._C._get_accelerator()``, which only knows C++-registered backends and so says "cpu";
* the stub packages a release imports (``torch_npu``, ``torchair``, ``sgl_kernel_npu``, ``triton``,
  ``torchvision``, and ``sgl_kernel`` / ``acl`` where needed) are importable;
* every stream / event / device / allocator action is appended to ``EVENTS`` (one ordered log,
  shared with zbal's simulated native side, shimdev.simzbal):

  ``("set_device", i)``, ``("synchronize", i)``, ``("empty_cache",)``,
  ``("stream_create", name)``, ``("stream_enter", name)``, ``("stream_exit", name)``,
  ``("set_stream", name)``, ``("wait_stream", waiter, waited)``, ``("wait_event", stream, ev)``,
  ``("event_record", ev, stream)``, ``("event_sync", ev)``, ``("stream_sync", name)``,
  ``("change_allocator", so_path, malloc_name, free_name)``, ``("allocator_fn", set_name)`` (a
  ``set_*_fn`` call on the pluggable allocator), ``("alloc", shape, device)``,
  ``("zbal", native_fn_name, fields)`` (the simulated native zbal, shimdev.simzbal);
  NPU graphs (``_graphs.py``): ``("capture_begin", graph_id, stream, pool)``,
  ``("capture_end", graph_id, stream, pool)``, ``("replay", graph_id, stream, pool)``,
  ``("graph_update", graph_id, records)``, ``("graph_reset", graph_id, pool)``,
  ``("pool_hook", set_name, device, pool)``, ``("pool_release", pool, native_bytes)``,
  ``("host_empty_cache",)``.

NPU graphs (``torch.npu.NPUGraph``, ``torch.npu.graph``, ``graph_pool_handle``,
``is_current_stream_capturing``, ``MemPool``, ``ExternalEvent``, ``_GraphDispatchMode``) record the
capturing thread's device ops and replay them on the same storages; a capture refuses what torch_npu
and CANN refuse (``_graphs.py``).

Streams are named "main" (default stream of device 0), then "side-1", "side-2", ... (``stream_name(s)``);
events "ev-1", ...  Nothing here runs asynchronously; nothing is timed.  ``with simnpu.sanitize() as
san:`` follows what the streams may do at the same time on a device and reports data races and
unsafe block reuse (``_sanitizer.py``); ``declare_kernel(schema, source)`` gives a stand-in kernel
the reads and writes of the real op it stands for.  The namespace is held to torch-npu 2.13.0
(``_device.py``; tests/dev/test_simnpu_conformance.py): it initialises the device, refuses allocator
swaps and rejects stream arguments where torch_npu does.
"""
from __future__ import annotations

import contextlib
import os
import sys

from . import _device, _graphs, _stubs
from ._device import STATE, mem_get_info, set_memory, stream_name
from ._log import EVENTS, clear_events, log
from ._stubs import STUB_IMPORTS, StubValue
from ._sanitizer import active as active_sanitizer, declare_kernel, sanitize

__all__ = [
    "install", "installed", "reset", "set_memory", "mem_get_info", "EVENTS", "clear_events",
    "events", "current_stream_name", "record_allocations", "add_stub", "remove_stub",
    "stubbed_roots", "STUB_IMPORTS", "StubValue", "allocator_backend", "stream_name", "sanitize",
    "declare_kernel", "active_sanitizer", "graph_pools",
]

_INSTALLED: dict | None = None


def installed() -> dict | None:
    """None before install(); else {"release", "stubs", "absent"}."""
    return _INSTALLED


def install(release: str | None = None, *, total_mib: int | None = None,
            free_mib: int | None = None, stubs=None, absent=None, server: bool = False) -> None:
    """Put the simulated NPU in place (before sglang is imported).

    release   -- sglang release whose stub set to use (None: the newest layout).
    total_mib -- device memory; default ``$SIMNPU_TOTAL_MIB`` or 65536.
    free_mib  -- free memory; default ``$SIMNPU_FREE_MIB`` or total.
    stubs     -- iterable of root package names to stub instead of the release's set.
    absent    -- dotted names that must NOT exist (default: the release's, e.g.
                 ``sgl_kernel_npu.norm.split_qkv_rmsnorm_rope`` before 0.5.10).
    server    -- also what a whole server process needs (``_server.py``): npu tensors on the
                 CPU, an ``hccl`` backend, torch_npu's operators of the dense path.
    Calling it again re-installs (resets state, keeps the torch registration).
    """
    global _INSTALLED
    if "sglang" in sys.modules and _INSTALLED is None:
        raise RuntimeError("simnpu.install() must run before the first sglang import")
    import torch

    STATE.reset()
    _graphs.reset_state()
    if total_mib is None:
        total_mib = int(os.environ.get("SIMNPU_TOTAL_MIB", 65536))
    if free_mib is None and os.environ.get("SIMNPU_FREE_MIB") is not None:
        free_mib = int(os.environ["SIMNPU_FREE_MIB"])
    set_memory(total_mib=total_mib, free_mib=free_mib)

    f = _install_stubs(release, stubs, absent)

    npu = getattr(torch, "npu", None)
    if npu is None or not getattr(npu, "__simnpu__", False):
        npu = _device.build_npu_module()
        try:
            torch.utils.rename_privateuse1_backend("npu")
        except RuntimeError:
            pass  # already renamed (to npu) in this process
        if hasattr(torch, "npu"):
            delattr(torch, "npu")
        torch._register_device_module("npu", npu)  # sets torch.npu and sys.modules["torch.npu"]
        _wrap_get_device_module(torch)
    sys.modules["torch.npu"] = npu
    sys.modules["torch.npu.memory"] = npu.memory
    sys.modules["torch_npu.npu"] = npu
    sys.modules["torch_npu.npu.memory"] = npu.memory
    sys.modules["torch.npu.graphs"] = npu.graphs
    sys.modules["torch_npu.npu.graphs"] = npu.graphs
    f.overrides.setdefault("torch_npu", {})["npu"] = npu
    tn = sys.modules.get("torch_npu")
    if tn is not None:
        tn.npu = npu
    if server:
        from . import _server

        _server.install()
    _INSTALLED = {"release": release, "stubs": sorted(f.roots), "absent": sorted(f.absent),
                  "total_mib": STATE.total_mib, "free_mib": STATE.free_mib}
    clear_events()


def _install_stubs(release, stubs=None, absent=None):
    f = _stubs.finder()
    f.roots = set(stubs) if stubs is not None else _stubs.roots_for(release)
    f.absent = set(absent) if absent is not None else _stubs.absent_for(release)
    for root in f.roots:
        f.overrides.setdefault(root, {})["__version__"] = _stubs.VERSIONS.get(root, "0")
    f.overrides.setdefault("triton.runtime", {})["driver"] = _stubs._RaisingDriver()
    # triton without a GPU backend: no backend is registered (torch's has_triton() reads this
    # dict), and inductor's isinstance(x, triton.language.dtype) needs a class.
    f.overrides.setdefault("triton.backends", {})["backends"] = {}
    f.overrides.setdefault("triton.language", {})["dtype"] = _stubs.auto_class("triton.language", "dtype")
    return f


NPU_ROOTS = ("torch_npu", "torchair", "sgl_kernel_npu")


def install_without_npu(release: str | None = None) -> None:
    """A machine without an NPU: the packages sglang imports that this CPU test bed lacks
    (triton, ...) are stubbed as ``install`` does, but there is no ``torch.npu`` nor torch_npu."""
    if "sglang" in sys.modules:
        raise RuntimeError("simnpu.install_without_npu() must run before the first sglang import")
    _install_stubs(release, stubs=_stubs.roots_for(release) - set(NPU_ROOTS))


def _wrap_get_device_module(torch) -> None:
    orig = torch.get_device_module
    if getattr(orig, "__simnpu__", False):
        return

    def get_device_module(device=None):
        if device is None:
            return torch.npu
        return orig(device)

    get_device_module.__simnpu__ = True
    get_device_module.__wrapped__ = orig
    get_device_module.__doc__ = orig.__doc__
    torch.get_device_module = get_device_module


def reset() -> None:
    """Clear EVENTS and restore memory / allocator / stream state to what install() set
    (stubs added/removed with add_stub/remove_stub stay as they are)."""
    STATE.reset()
    _graphs.reset_state()
    if _INSTALLED is not None:
        set_memory(total_mib=_INSTALLED["total_mib"], free_mib=_INSTALLED["free_mib"])
    clear_events()


def events(kind: str | None = None) -> list[tuple]:
    """A copy of EVENTS, optionally only those whose first item is ``kind``."""
    return [e for e in EVENTS if kind is None or e[0] == kind]


def graph_pools() -> dict:
    """What each live NPU graph pool holds (``_graphs.pools``)."""
    return _graphs.pools()


def current_stream_name() -> str:
    """Name of the stream code is running on now ("main", "side-1", ...)."""
    return _device.current_stream_name()


def allocator_backend() -> str:
    return STATE.allocator_backend


def stubbed_roots() -> set[str]:
    return set(_stubs.finder().roots)


def add_stub(dotted: str, **attrs) -> None:
    """Make ``dotted`` (a module under a stubbed root) exist, with the given attributes.

    ``simnpu.add_stub("sgl_kernel_npu.norm.split_qkv_rmsnorm_rope", split_qkv_rmsnorm_rope=ref)``
    """
    f = _stubs.finder()
    root = dotted.split(".")[0]
    f.roots.add(root)
    f.absent = {a for a in f.absent if not (a == dotted or dotted.startswith(a + ".")
                                             or a.startswith(dotted + "."))}
    f.overrides.setdefault(dotted, {}).update(attrs)
    mod = sys.modules.get(dotted)
    if mod is not None:
        mod.__dict__.update(attrs)


def remove_stub(dotted: str) -> None:
    """Make ``dotted`` (module or attribute) absent from now on."""
    f = _stubs.finder()
    f.absent.add(dotted)
    f.overrides.pop(dotted, None)
    for name in [n for n in sys.modules if n == dotted or n.startswith(dotted + ".")]:
        del sys.modules[name]
    parent, _, leaf = dotted.rpartition(".")
    pmod = sys.modules.get(parent)
    if pmod is not None:
        pmod.__dict__.pop(leaf, None)


# ------------------------------------------------------------------------------ allocations

_FACTORIES = {
    "empty", "zeros", "ones", "full", "rand", "randn", "randint", "randperm", "arange", "tensor",
    "as_tensor", "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
    "randint_like", "empty_strided", "eye", "linspace", "logspace", "new_empty", "new_zeros",
    "new_ones", "new_full", "new_tensor", "new_empty_strided", "to", "clone",
}
_LIKE = {"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
         "randint_like", "new_empty", "new_zeros", "new_ones", "new_full", "new_tensor",
         "new_empty_strided", "clone"}


def _norm_device(dev) -> str | None:
    import torch

    if dev is None:
        return None
    if isinstance(dev, int):
        return f"npu:{dev}"
    if isinstance(dev, str):
        dev = torch.device(dev)
    if isinstance(dev, torch.device):
        if dev.type == "npu":
            return f"npu:{dev.index if dev.index is not None else STATE.device}"
        return dev.type if dev.index is None else f"{dev.type}:{dev.index}"
    return None


def _tensor_device(t) -> str:
    return getattr(t, "_simnpu_device", None) or str(t.device)


@contextlib.contextmanager
def record_allocations(redirect: bool = True):
    """Append ``("alloc", shape, device)`` to EVENTS for each tensor factory call inside.

    ``redirect=True``: factories asked for an ``npu`` device make the tensor on CPU instead (tagged
    ``t._simnpu_device = "npu:N"``; ``*_like``/``new_*``/``clone`` of a tagged tensor count as npu).
    While any npu allocation has been seen, ``change_current_allocator`` refuses, like torch_npu.
    """
    import torch
    from torch.overrides import TorchFunctionMode

    class _Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            name = getattr(func, "__name__", "")
            if name not in _FACTORIES:
                return func(*args, **kwargs)
            dev = None
            if name == "to":
                cand = kwargs.get("device")
                if cand is None and len(args) > 1 and isinstance(args[1], (str, torch.device)):
                    cand = args[1]
                dev = _norm_device(cand)
                if dev is None:  # dtype-only .to(): not an allocation on another device
                    return func(*args, **kwargs)
                if redirect and dev.startswith("npu"):
                    if "device" in kwargs:
                        kwargs["device"] = "cpu"
                    else:
                        args = (args[0], "cpu", *args[2:])
            else:
                dev = _norm_device(kwargs.get("device"))
                if dev is None and name in _LIKE and args and isinstance(args[0], torch.Tensor):
                    dev = _tensor_device(args[0])
                if dev is None:
                    dev = str(torch.get_default_device())
                if redirect and dev.startswith("npu") and "device" in kwargs:
                    kwargs["device"] = "cpu"
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                if dev.startswith("npu"):
                    STATE.npu_allocations += 1
                    try:
                        out._simnpu_device = dev
                    except Exception:  # noqa: BLE001 - some tensor subclasses refuse attrs
                        pass
                log("alloc", tuple(out.shape), dev)
            return out

    with _Mode():
        yield
