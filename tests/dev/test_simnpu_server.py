"""The simulated NPU's server mode (simnpu/_server.py, _ops.py) and the stub traps a real server
met (../shared/docs/real-sglang-server-on-cpu.md).  Each runs in a process of its own: server mode
changes torch for the process's life."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from shimdev import DEV, realsglang


def run(code, env=None, timeout=180, layers=()):
    path = os.pathsep.join([str(DEV), *map(str, layers)])
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=timeout, env=dict(os.environ, PYTHONPATH=path, **(env or {})))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_has_triton_ends_and_inductor_finds_a_dtype_class():
    """Defect 1: ``"cpu" in triton.backends.backends`` iterated the stub module for ever (the
    scheduler hung until sglang's watchdog); ``triton.language.dtype`` must be a class."""
    out = run("""
        import json
        from shimdev import simnpu
        simnpu.install()
        import triton, triton.language, triton.backends
        from torch.utils._triton import has_triton
        print(json.dumps({"has_triton": has_triton(), "backends": triton.backends.backends,
                          "dtype_is_class": isinstance(triton.language.dtype, type),
                          "in_module": "x" in dir(triton)}))
    """, timeout=60)
    assert out == {"has_triton": False, "backends": {}, "dtype_is_class": True, "in_module": False}


def test_a_stub_module_is_not_iterable():
    from shimdev.simnpu import _stubs

    module = _stubs.StubModule("triton.backends")
    with pytest.raises(TypeError):
        "cpu" in module  # noqa: B015 - a real module raises TypeError too


def test_server_mode_places_npu_tensors_on_the_cpu_and_counts_them():
    out = run("""
        import json, torch
        from shimdev import simnpu
        simnpu.install(server=True)
        free0, total = torch.npu.mem_get_info()
        x = torch.zeros(1 << 20, dtype=torch.uint8, device="npu:0")
        with torch.device("npu"):
            y = torch.empty(1 << 19, dtype=torch.uint8)
        z = torch.ones(4).to("npu")
        free1, _ = torch.npu.mem_get_info()
        del x
        free2, _ = torch.npu.mem_get_info()
        refused = None
        try:
            torch.npu.memory.change_current_allocator(torch.npu.memory.NPUPluggableAllocator(
                "libc.so.6", "malloc", "free"))
        except RuntimeError as e:
            refused = str(e)
        print(json.dumps({"devices": [str(t.device) for t in (y, z)], "used": free0 - free1,
                          "after_free": free0 - free2, "refused": refused,
                          "accelerator": str(torch._C._get_accelerator()),
                          "hccl": "hccl" in torch.distributed.Backend.backend_list}))
    """)
    assert out["devices"] == ["cpu", "cpu"]
    assert out["used"] == (1 << 20) + (1 << 19) + 16 and out["after_free"] == (1 << 19) + 16
    assert out["refused"] == "Can't swap an already initialized allocator"
    assert out["accelerator"] == "npu:0" and out["hccl"]


def test_the_dense_path_ops_compute_the_reference_math():
    out = run("""
        import json, torch
        from shimdev import simnpu
        simnpu.install(server=True)
        import torch_npu
        torch.manual_seed(0)
        x, g = torch.randn(3, 8), torch.randn(8)
        y, rstd = torch_npu.npu_rms_norm(x, g, 1e-6)
        ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g
        s = torch.randn(3, 8)
        y2, _, summed = torch_npu.npu_add_rms_norm(x, s, g, 1e-6)
        a = torch.randn(3, 16)
        sw = torch_npu.npu_swiglu(a)
        bad = None
        try:
            torch_npu.npu_rms_norm(x, g, eps=1e-6)  # the schema's name is epsilon
        except Exception as e:
            bad = type(e).__name__
        # paged cache: write 5 tokens, attend over them
        kc = torch.zeros(2, 4, 1, 2); vc = torch.zeros(2, 4, 1, 2)
        k = torch.randn(5, 1, 2); v = torch.randn(5, 1, 2)
        torch_npu._npu_reshape_and_cache(key=k, value=v, key_cache=kc, value_cache=vc,
                                         slot_indices=torch.arange(5, dtype=torch.int32))
        q = torch.randn(1, 1, 2); out = torch.empty(1, 1, 2)
        torch_npu._npu_paged_attention(query=q, key_cache=kc, value_cache=vc, num_kv_heads=1,
            num_heads=1, scale_value=0.5, block_table=torch.tensor([[0, 1]]),
            context_lens=torch.tensor([5]), out=out)
        w = torch.softmax((q[0] @ k[:, 0].T) * 0.5, -1) @ v[:, 0]
        print(json.dumps({
            "rms": torch.allclose(y, ref, atol=1e-5), "add": torch.allclose(summed, x + s)
                and torch.allclose(y2, torch_npu.npu_rms_norm(x + s, g)[0], atol=1e-5),
            "swiglu": torch.allclose(sw, torch.nn.functional.silu(a[:, :8]) * a[:, 8:], atol=1e-6),
            "bad_keyword": bad, "cache": torch.equal(kc.view(-1, 1, 2)[:5], k),
            "paged": torch.allclose(out[0, 0], w[0], atol=1e-5),
            "is_op": type(torch_npu.npu_rms_norm).__name__}))
    """)
    assert out == {"rms": True, "add": True, "swiglu": True, "bad_keyword": "RuntimeError",
                   "cache": True, "paged": True,
                   "is_op": "OpOverloadPacket"}  # a wrong keyword: what the dispatcher says


def test_an_unknown_triton_kernel_fails_naming_itself():
    out = run("""
        import json
        from shimdev import simnpu
        simnpu.install(server=True)
        import triton
        @triton.jit
        def my_kernel(x):
            pass
        try:
            my_kernel[(1,)](0)
            said = None
        except NotImplementedError as e:
            said = str(e)
        print(json.dumps({"said": said}))
    """)
    assert "my_kernel has no stand-in" in out["said"]


@pytest.fixture(scope="module")
def zbal_layer():
    return realsglang.sglang_envs.ensure_zbal_layer()


_ZBAL_WORLD = """
    import json, os, sys, datetime
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": sys.argv[3]})
    from shimdev import simnpu, simzbal
    simnpu.install(server=True)
    import torch, torch.distributed as dist, zbal
    rank = int(sys.argv[1])
    ok = zbal.zbal_init(2, rank, rank, int(sys.argv[4]) << 20, ip_port=sys.argv[2])
    free, total = zbal.mem_get_info()
    dist.init_process_group(backend="zbal", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    t = torch.tensor([rank + 1.0], device="npu")
    dist.all_reduce(t)
    print(json.dumps({"ok": ok, "heap": total, "sum": t.item(), "world": simzbal.STATE.world}))
"""


def test_a_zbal_world_meets_its_heap_is_the_size_asked_and_its_group_is_a_real_backend(zbal_layer):
    """Defects 2 and 3: ``init_process_group(backend="zbal")`` needs a real Backend; the heap was
    60 GiB whatever zbal_init asked for."""
    from shimdev.server.process import free_port

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(DEV), str(zbal_layer)]),
               SIMZBAL_RENDEZVOUS="1", SIMNPU_DEVICE_COUNT="2", GLOO_SOCKET_IFNAME="lo",
               **realsglang.sglang_envs.zbal_env(zbal_layer))
    url, master = "tcp://127.0.0.1:%d" % free_port(), str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(_ZBAL_WORLD), str(r), url,
                               master, "768"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    got = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert got == [{"ok": True, "heap": 768 << 20, "sum": 3.0, "world": [0, 1]}] * 2


@pytest.mark.parametrize("url, size_mib, said", [
    ("udp://127.0.0.1:1", 256, "malformed bootstrap address"),
    ("tcp://127.0.0.1:1", 1 << 20, "bytes asked, the device has"),
])
def test_a_bootstrap_zbal_cannot_make_fails_as_on_a_device(zbal_layer, url, size_mib, said):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(DEV), str(zbal_layer)]),
               SIMZBAL_RENDEZVOUS="1", SIMNPU_DEVICE_COUNT="2", SIMNPU_TOTAL_MIB="1024",
               **realsglang.sglang_envs.zbal_env(zbal_layer))
    code = ("from shimdev import simnpu; simnpu.install(server=True); import zbal, sys; "
            "print(zbal.zbal_init(2, 1, 1, int(sys.argv[2]) << 20, ip_port=sys.argv[1]))")
    p = subprocess.run([sys.executable, "-c", code, url, str(size_mib)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.stdout.strip().splitlines()[-1] == "False", p.stderr[-2000:]
    assert said in p.stderr
