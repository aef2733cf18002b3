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
    assert main.name == "main" and sim.current_stream_name() == "main"
    side = torch.get_device_module().Stream()
    assert side.name == "side-1"
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
    assert torch.npu.memory.mem_get_info() == (1024 << 20, 32768 << 20)
    sim.set_memory(total_mib=49152)
    assert torch.npu.mem_get_info() == (49152 << 20, 49152 << 20)
    with pytest.raises(ValueError):
        sim.set_memory(free_mib=10 ** 9)


def test_memory_from_env_in_subprocess():
    from pathlib import Path

    from shimdev import DEV

    code = ("from shimdev import simnpu; import torch; simnpu.install(); f, t = torch.npu.mem_get_info(); "
            "print(f >> 20, t >> 20)")
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(DEV),
                         "SIMNPU_TOTAL_MIB": "98304", "SIMNPU_FREE_MIB": "4096", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["4096", "98304"]


def test_allocator_switch_recorded(simnpu_clean):
    sim = simnpu_clean
    import torch_npu

    assert torch.npu.memory.get_allocator_backend() == "native"
    alloc = torch_npu.npu.memory.NPUPluggableAllocator("/x/lib.so", "my_malloc", "my_free")
    alloc.allocator().set_init_fn(0)  # accepted and ignored
    torch_npu.npu.memory.change_current_allocator(alloc)
    assert torch.npu.memory.get_allocator_backend() == "pluggable"
    assert sim.events("change_allocator") == [("change_allocator", "/x/lib.so", "my_malloc", "my_free")]


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
        torch_npu.npu.memory.change_current_allocator(
            torch_npu.npu.memory.NPUPluggableAllocator("/x.so", "m", "f"))


def test_allocator_switched_before_first_allocation_is_assertable(simnpu_clean):
    sim = simnpu_clean
    import torch_npu

    with sim.record_allocations():
        torch_npu.npu.memory.change_current_allocator(
            torch_npu.npu.memory.NPUPluggableAllocator("/z.so", "m", "f"))
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
        triton.runtime.driver.active  # noqa: B018
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
    lambda npu: npu.current_stream(), lambda npu: npu.Stream(), lambda npu: npu.empty_cache(),
    lambda npu: npu.init(),
])
def test_allocator_cannot_be_switched_once_the_device_is_initialised(simnpu_clean, first_call):
    """As torch_npu: any device call initialises the device, not only the first allocation."""
    import torch_npu

    npu = torch_npu.npu
    assert npu.is_available() and npu.device_count() == 1  # these do not initialise
    assert not npu.is_initialized()
    first_call(npu)
    assert npu.is_initialized()
    with pytest.raises(RuntimeError, match="already initialized"):
        npu.memory.change_current_allocator(npu.memory.NPUPluggableAllocator("/z.so", "m", "f"))
