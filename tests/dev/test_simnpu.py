"""The simulated NPU itself (in this process): device namespace, ordering log, memory driving,
allocator switch and allocation recording, stubs."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import torch


def test_torch_npu_namespace(simnpu_clean):
    assert torch.npu.is_available() is True
    assert torch.npu.device_count() == 1
    import torch_npu

    assert torch_npu.npu is torch.npu
    assert torch.get_device_module() is torch.npu
    assert torch.get_device_module("npu") is torch.npu
    assert torch.get_device_module(torch.device("npu:0")) is torch.npu
    assert torch.get_device_module("cpu") is torch.cpu
    assert str(torch.device("npu:0")) == "npu:0"
    torch.npu.set_device(1)
    assert torch.npu.current_device() == 1
    assert simnpu_clean.events("set_device") == [("set_device", 1)]


def test_stream_ordering_log(simnpu_clean):
    sim = simnpu_clean
    main = torch.npu.current_stream()
    assert sim.stream_name(main) == "main" and sim.current_stream_name() == "main"
    side = torch.get_device_module().Stream()
    assert sim.stream_name(side) == "side-1"
    side.wait_stream(main)
    with torch.npu.stream(side):
        assert sim.current_stream_name() == "side-1"
        ev = torch.npu.Event()
        ev.record()
    assert sim.current_stream_name() == "main"
    main.wait_event(ev)
    ev.wait(side)
    torch.npu.current_stream().wait_stream(side)
    assert [e for e in sim.EVENTS if e[0] != "stream_create"] == [
        ("wait_stream", "side-1", "main"),
        ("stream_enter", "side-1"),
        ("event_record", "ev-1", "side-1"),
        ("stream_exit", "side-1"),
        ("wait_event", "main", "ev-1"),
        ("wait_event", "side-1", "ev-1"),
        ("wait_stream", "main", "side-1"),
    ]
    sim.clear_events()
    assert sim.EVENTS == []


def test_memory_driving(simnpu_clean):
    sim = simnpu_clean
    sim.set_memory(total_mib=32768, free_mib=1024)
    assert torch.npu.mem_get_info() == (1024 << 20, 32768 << 20)
    assert not hasattr(torch.npu.memory, "mem_get_info")  # torch_npu.npu has it, .memory has not
    sim.set_memory(total_mib=49152)
    assert torch.npu.mem_get_info() == (49152 << 20, 49152 << 20)
    with pytest.raises(ValueError):
        sim.set_memory(free_mib=10 ** 9)


def test_memory_from_env_in_subprocess():

    from shimdev import DEV

    code = ("from shimdev import simnpu; import torch; simnpu.install(); f, t = torch.npu.mem_get_info(); "
            "print(f >> 20, t >> 20)")
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(DEV),
                         "SIMNPU_TOTAL_MIB": "98304", "SIMNPU_FREE_MIB": "4096", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["4096", "98304"]


#: A real library with two real functions: NPUPluggableAllocator opens it as torch_npu does.
LIBC, MALLOC, FREE = "libc.so.6", "malloc", "free"


def pluggable(npu, path=LIBC, alloc=MALLOC, free=FREE):
    return npu.memory.NPUPluggableAllocator(path, alloc, free)


def test_allocator_switch_recorded(simnpu_clean):
    sim = simnpu_clean
    import torch_npu

    assert torch.npu.memory.get_allocator_backend() == "native"
    alloc = pluggable(torch_npu.npu)
    torch_npu.npu.memory.change_current_allocator(alloc)
    alloc.allocator().set_init_fn(0)  # zbal sets its hooks after the swap
    assert torch.npu.memory.get_allocator_backend() == "pluggable"
    assert sim.events("change_allocator") == [("change_allocator", LIBC, MALLOC, FREE)]
    assert sim.events("allocator_fn") == [("allocator_fn", "set_init_fn")]


def test_pluggable_allocator_loads_the_library_and_both_symbols(simnpu_clean):
    """torch_npu/npu/memory.py: ctypes.CDLL(path), then getattr of each function name."""
    npu = torch.npu
    with pytest.raises(OSError):
        pluggable(npu, path="/x/lib.so")
    with pytest.raises(AttributeError, match="no_such_malloc"):
        pluggable(npu, alloc="no_such_malloc")
    with pytest.raises(AttributeError, match="no_such_free"):
        pluggable(npu, free="no_such_free")
    handle = pluggable(npu).allocator()
    with pytest.raises(AttributeError):
        handle.set_anything_fn(0)  # only the setters torch_npu's C++ class binds
    with pytest.raises(TypeError):
        handle.set_reset_fn(None)  # a function pointer, as pybind11 converts it
    assert simnpu_clean.events() == []


def test_a_second_allocator_swap_is_refused(simnpu_clean):
    """A pluggable allocator is initialised when created (createCustomAllocator,
    torch_npu/csrc/npu/NPUPluggableAllocator.cpp), so it can never be swapped out again."""
    npu = torch.npu
    npu.memory.change_current_allocator(pluggable(npu))
    assert not npu.is_initialized()
    with pytest.raises(RuntimeError, match="Can't swap an already initialized allocator"):
        npu.memory.change_current_allocator(pluggable(npu))
    assert len(simnpu_clean.events("change_allocator")) == 1


def test_allocation_recording_and_order(simnpu_clean):
    sim = simnpu_clean
    import torch_npu

    with sim.record_allocations():
        a = torch.empty(2, 3, device="npu")
        b = torch.zeros_like(a)
        c = torch.ones(4)
        d = c.to("npu:0")
    assert a.device.type == "cpu" and a._simnpu_device == "npu:0"
    assert sim.events("alloc") == [("alloc", (2, 3), "npu:0"), ("alloc", (2, 3), "npu:0"),
                                   ("alloc", (4,), "cpu"), ("alloc", (4,), "npu:0")]
    assert b.shape == (2, 3) and d.shape == (4,)
    # After an NPU allocation the allocator can no longer be swapped (as in torch_npu).
    with pytest.raises(RuntimeError, match="already initialized"):
        torch_npu.npu.memory.change_current_allocator(pluggable(torch_npu.npu))


def test_allocator_switched_before_first_allocation_is_assertable(simnpu_clean):
    sim = simnpu_clean
    import torch_npu

    with sim.record_allocations():
        torch_npu.npu.memory.change_current_allocator(pluggable(torch_npu.npu))
        torch.empty(8, device="npu")
    kinds = [e[0] for e in sim.EVENTS]
    assert kinds.index("change_allocator") < kinds.index("alloc")


def test_stubs(sim):
    import triton
    import triton.language as tl

    assert triton.language is tl
    assert isinstance(triton.__version__, str)

    @triton.jit
    def kernel(x, BLOCK: tl.constexpr):
        return x

    assert kernel(3, 4) == 3
    assert isinstance(triton.Config | triton.runtime.Autotuner, object)  # real types: A | B works
    with pytest.raises(RuntimeError):
        triton.runtime.driver.active  # noqa: B018 - the read raises
    # absent by default; a test can add it explicitly and remove it again
    if sim.installed()["release"] is None:
        with pytest.raises(ImportError):
            importlib.import_module("sgl_kernel_npu.norm.split_qkv_rmsnorm_rope")

        def ref(*a, **k):
            return "ref"

        sim.add_stub("sgl_kernel_npu.norm.split_qkv_rmsnorm_rope", split_qkv_rmsnorm_rope=ref)
        try:
            from sgl_kernel_npu.norm.split_qkv_rmsnorm_rope import split_qkv_rmsnorm_rope

            assert split_qkv_rmsnorm_rope is ref
        finally:
            sim.remove_stub("sgl_kernel_npu.norm.split_qkv_rmsnorm_rope")
        with pytest.raises(ImportError):
            importlib.import_module("sgl_kernel_npu.norm.split_qkv_rmsnorm_rope")


def test_release_stub_sets():
    from shimdev.simnpu import _stubs

    assert "sgl_kernel" in _stubs.roots_for("0.5.9")
    assert "sgl_kernel" not in _stubs.roots_for("0.5.19")
    assert "acl" in _stubs.roots_for("0.5.23") and "acl" not in _stubs.roots_for("0.5.11")
    assert "sgl_kernel_npu.norm.split_qkv_rmsnorm_rope" in _stubs.absent_for("0.5.9")
    assert _stubs.absent_for("0.5.11") == set()


@pytest.mark.parametrize("first_call", [
    lambda npu: npu.set_device(0), lambda npu: npu.mem_get_info(), lambda npu: npu.synchronize(),
    lambda npu: npu.current_stream(), lambda npu: npu.Stream(), lambda npu: npu.init(),
    lambda npu: npu.current_device(), lambda npu: npu.device(0).__enter__(),
    lambda npu: npu.device(None), lambda npu: npu.stream(None), lambda npu: npu.get_device_name(),
    lambda npu: npu.reset_peak_memory_stats(),
])
def test_allocator_cannot_be_switched_once_the_device_is_initialised(simnpu_clean, first_call):
    """As torch_npu: every call that runs its _lazy_init (torch_npu/npu/utils.py,
    __init__.py) -- a device index looked up included -- makes the swap fail afterwards."""
    import torch_npu

    npu = torch_npu.npu
    assert npu.is_available() and npu.device_count() == 1  # these do not initialise
    assert not npu.is_initialized()
    first_call(npu)
    assert npu.is_initialized()
    with pytest.raises(RuntimeError, match="already initialized"):
        npu.memory.change_current_allocator(pluggable(npu))


@pytest.mark.parametrize("call", [
    lambda npu: npu.empty_cache(), lambda npu: npu.memory_allocated(), lambda npu: npu.max_memory_reserved(),
    lambda npu: npu.manual_seed(0), lambda npu: npu.device(-1).__enter__(), lambda npu: npu.set_device(-1),
    lambda npu: npu.get_device_capability(), lambda npu: npu.Event(),
])
def test_calls_that_leave_the_device_uninitialised(simnpu_clean, call):
    """torch_npu/npu/memory.py: empty_cache() does nothing before initialisation, the statistics
    read 0; seeds are queued; a negative device is a no-op; an event is lazily created."""
    npu = torch.npu
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("ignore")
        call(npu)
    assert not npu.is_initialized()
    assert simnpu_clean.events() == []
    npu.memory.change_current_allocator(pluggable(npu))  # the swap still works


def test_device_capability_only_when_configured(simnpu_clean, monkeypatch):
    monkeypatch.delenv("TORCH_NPU_DEVICE_CAPABILITY", raising=False)
    with pytest.warns(UserWarning, match="TORCH_NPU_DEVICE_CAPABILITY"):
        assert torch.npu.get_device_capability() is None
    monkeypatch.setenv("TORCH_NPU_DEVICE_CAPABILITY", "9.0")
    assert torch.npu.get_device_capability(0) == (9, 0)
    monkeypatch.setenv("TORCH_NPU_DEVICE_CAPABILITY", "nine")
    with pytest.warns(UserWarning):
        assert torch.npu.get_device_capability() is None


def test_stream_and_event_are_what_torch_npu_makes(simnpu_clean):
    s = torch.npu.Stream(device=0, priority=0)
    assert s.device == torch.device("npu", 0) and isinstance(s.device, torch.device)
    with pytest.raises(TypeError, match="'name' is an invalid keyword argument"):
        torch.npu.Stream(name="side")
    with pytest.raises(TypeError):
        torch.npu.Event(name="ev")
    with pytest.raises(RuntimeError, match="get_priority"):
        s.priority  # noqa: B018 - torch_npu's C++ getter refuses
    assert "torch_npu" in __import__("sys").modules and __import__("torch_npu").__version__ == "2.13.0"


def test_wait_event_given_a_stream_raises_as_on_the_real_stack(simnpu_clean):
    """torch_npu/npu/streams.py: Stream.wait_event(event) is event.wait(self); a Stream has no
    wait() (neither torch_npu's Python class nor its C++ base, torch.Stream in torch 2.13)."""
    main, side = torch.npu.current_stream(), torch.npu.Stream()
    with pytest.raises(AttributeError, match="'Stream' object has no attribute 'wait'"):
        main.wait_event(side)
    assert not hasattr(torch.Stream, "wait")  # the real torch 2.13 base class
    ev = side.record_event()
    main.wait_event(ev)
    assert simnpu_clean.events("wait_event") == [("wait_event", "main", "ev-1")]


def test_only_names_of_the_real_module_exist(simnpu_clean):
    npu = torch.npu
    with pytest.raises(AttributeError):
        npu.no_such_function  # noqa: B018 - the read raises
    with pytest.raises(AttributeError):
        npu.memory.mem_get_info  # noqa: B018 - the read raises
    with pytest.raises(AttributeError):
        npu.config.allow_internal_format  # noqa: B018 - written by sglang, never readable
    npu.config.allow_internal_format = True
    assert callable(npu.get_device_properties)  # a real name not simulated: an inert stub


def test_each_operator_is_named_once_in_its_family_module_and_found_from_there():
    """simnpu/_ops/__init__.py imports no op or stand-in by name: ``kernel()`` and ``_ops.<name>``
    find each in the family module that defines it, and a name none defines says where it looked."""
    import ast

    from shimdev.simnpu import _ops

    tree = ast.parse(open(_ops.__file__, encoding="utf-8").read())
    imported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names if node.level == 1 and node.module}  # from its family modules
    assert imported == set(_ops.schemas.__dict__) & imported  # the schema tables it reads itself, nothing else
    assert not any(isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
                   for node in tree.body)
    names = [name for table in (_ops.NPU_SCHEMAS, _ops.ATB_SCHEMAS, _ops.CUSTOM_SCHEMAS, _ops.SGL_KERNEL_NPU_SCHEMAS)
             for name in table]
    for name in names:
        (family,) = [f for f in _ops.FAMILIES
                     if getattr(vars(f).get(name), "__module__", None) == f.__name__]  # where it is defined
        assert getattr(_ops, name) is vars(family)[name] and _ops.lookup(name) is vars(family)[name]
    assert _ops.kernel("npu_rms_norm") is _ops.dense.npu_rms_norm
    assert _ops._rms is _ops.dense._rms and _ops.NPU_MLA_PROLOG_V3 is _ops.schemas.NPU_MLA_PROLOG_V3
    assert not hasattr(_ops, "math")  # a family's imported module is no op
    with pytest.raises(AttributeError, match="simnpu._ops has no op or table 'npu_nothing' \\(in none of schemas"):
        _ops.npu_nothing  # noqa: B018 - the attribute read is the test
    with pytest.raises(KeyError):
        _ops.kernel("npu_nothing")
