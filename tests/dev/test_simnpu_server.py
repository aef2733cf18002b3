"""The simulated NPU's server mode (simnpu/_server.py, _ops/) and the stub traps a real server
met (../shared/docs/real-sglang-server-on-cpu.md).  Each runs in a process of its own: server mode
changes torch for the process's life."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from shimdev import DEV


from shimdev.envs import realsglang
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


def test_the_moe_ops_compute_the_reference_math_and_are_one_launch_each_reading_their_inputs():
    """The GLM-4 MoE path's ops (simnpu/_ops/) against a dense MoE computed here, the sanitizer
    seeing each as one kernel (its inner torch ops are not launches) that writes none of its
    inputs (each schema marks no argument written), and DeepEP's dispatch/combine (_deepep.py)
    giving back what a dense MoE gives."""
    out = run("""
        import json, torch
        from shimdev import simnpu
        from shimdev.simnpu import _deepep
        simnpu.install(server=True)
        import torch_npu
        torch.manual_seed(0)
        n, E, k, H, I = 6, 8, 2, 16, 8
        logits, bias = torch.randn(n, E), torch.randn(E) * 0.1
        x = torch.randn(n, H, dtype=torch.bfloat16)
        w13 = torch.randn(E, H, 2 * I, dtype=torch.bfloat16) / 4
        w2 = torch.randn(E, I, H, dtype=torch.bfloat16) / 4
        inputs = [logits, bias, x, w13, w2]
        before = [t.clone() for t in inputs]
        launches = []
        with simnpu.sanitize() as san:
            def one(fn, *args, **kwargs):
                start = san.launches
                result = fn(*args, **kwargs)
                launches.append(san.launches - start)
                return result
            w, ids, normed = one(torch_npu.npu_moe_gating_top_k, logits, k=k, bias=bias, k_group=1,
                                 group_count=1, group_select_mode=1, renorm=0, norm_type=1,
                                 routed_scaling_factor=1.0, eps=1e-20)
            row_idx = torch.arange(n * k, dtype=torch.int32).view(k, n).t().contiguous()
            ex, erow, eexp = one(torch_npu.npu_moe_init_routing, x, row_idx=row_idx,
                                 expert_idx=ids, active_num=n)
            tok = one(torch_npu.npu_moe_compute_expert_tokens, eexp, E).to(torch.int64)
            h = one(torch_npu.npu_grouped_matmul, x=[ex], weight=[w13], split_item=2,
                    group_list_type=0, group_type=0, group_list=tok, output_dtype=torch.bfloat16)[0]
            h = one(torch_npu.npu_swiglu, h)
            h = one(torch_npu.npu_grouped_matmul, x=[h], weight=[w2], split_item=2,
                    group_list_type=0, group_type=0, group_list=tok, output_dtype=torch.bfloat16)[0]
            y = one(torch_npu.npu_moe_finalize_routing, h, skip1=None, skip2=None, bias=None,
                    scales=w.to(h.dtype), expanded_src_to_dst_row=erow, export_for_source_row=ids)
        # the dense reference: sigmoid scores, top-k by biased score, weights renormalised
        score = torch.sigmoid(logits)
        ref_ids = (score + bias).topk(k, dim=-1).indices
        ref_w = score.gather(1, ref_ids)
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
        def expert(e, rows):
            a = (rows.float() @ w13[e].float()).to(torch.bfloat16)
            a = (torch.nn.functional.silu(a[:, :I].float()) * a[:, I:].float()).to(torch.bfloat16)
            return (a.float() @ w2[e].float()).to(torch.bfloat16)
        ref = torch.zeros(n, H)
        for i in range(n):
            for j in range(k):
                ref[i] += ref_w[i, j].to(torch.bfloat16).float() * expert(int(ref_ids[i, j]), x[i:i + 1])[0].float()
        # v2 routing (per-expert counts) then grouped matmul: each expert's rows, in another order
        ex2, _, counts, _ = torch_npu.npu_moe_init_routing_v2(
            x, ids, active_num=n, expert_num=E, expert_tokens_num_type=1, expert_tokens_num_flag=True)
        # DeepEP, one rank: dispatch -> the same experts -> combine
        class Group:
            def rank(self): return 0
            def size(self): return 1
        buf = _deepep.Buffer(Group(), low_latency_mode=True)
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, ids.long(), 128, E, use_fp8=False)
        hd = torch_npu.npu_grouped_matmul(x=[recv], weight=[w13], split_item=2, group_list_type=1,
                                          group_type=0, group_list=count.long(), output_dtype=torch.bfloat16)[0]
        hd = torch_npu.npu_grouped_matmul(x=[torch_npu.npu_swiglu(hd)], weight=[w2], split_item=2,
                                          group_list_type=1, group_type=0, group_list=count.long(),
                                          output_dtype=torch.bfloat16)[0]
        yd, _, _ = buf.low_latency_combine(hd, ids.long(), w, handle)
        refused = {}
        for name, call in {
            "k_mismatch": lambda: torch_npu.npu_grouped_matmul(x=[x], weight=[w2], split_item=2,
                group_list_type=0, group_type=0, group_list=tok),
            "int8_x": lambda: torch_npu.npu_grouped_matmul(x=[ex.to(torch.int8)], weight=[w13],
                split_item=2, group_list_type=0, group_type=0, group_list=tok),
            "one_rank_config": lambda: _deepep.Buffer.get_dispatch_config(1),
        }.items():
            try:
                call()
            except Exception as e:
                refused[name] = str(e)
        print(json.dumps({
            "ids": torch.equal(ids.long().sort(-1).values, ref_ids.sort(-1).values),
            "weights": torch.allclose(w.gather(1, ids.long().argsort(-1)),
                                      ref_w.gather(1, ref_ids.argsort(-1)), atol=1e-6),
            "moe": (y.float() - ref).abs().max().item(), "deepep": (yd.float() - ref).abs().max().item(),
            "v2_counts": counts.tolist() == torch.bincount(ids.flatten().long(), minlength=E).tolist(),
            "v2_rows": sorted(map(tuple, ex2.float().tolist())) == sorted(map(tuple, ex.float().tolist())),
            "launches": launches, "unchanged": all(torch.equal(a, b) for a, b in zip(inputs, before)),
            "reports": [str(r) for r in san.reports], "refused": refused}))
    """)
    assert out["ids"] and out["weights"] and out["v2_counts"] and out["v2_rows"]
    assert out["moe"] < 0.05 and out["deepep"] < 0.05, out  # bf16 rounding of the weighted sum
    assert out["launches"] == [1] * 7 and out["unchanged"] and out["reports"] == []
    assert out["refused"]["k_mismatch"].startswith("Dim 1 value of x[0] should be equal")
    assert "no quantisation argument" in out["refused"]["int8_x"]
    assert out["refused"]["one_rank_config"] == "Unsupported number of EP ranks: 1"


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
    print(json.dumps({"ok": ok, "heap": total, "sum": t.item(), "world": simzbal.STATE.world}), flush=True)
    # Both ranks leave together: a rank whose peer exited first can abort in gloo's threads
    # ("terminate called without an active exception") at its own exit.
    dist.barrier()
    dist.destroy_process_group()
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


def test_swiglu_quant_covers_the_rows_of_its_group_list():
    """sgl-kernel-npu's swiglu_quant stand-in (0.5.10's bf16 DeepEP experts): swiglu of the rows
    the group list covers, cumulative (type 0) or counts (type 1); int8 with a scale per row when
    quantising."""
    import torch

    from shimdev.simnpu import _ops

    torch.manual_seed(0)
    x = torch.randn(6, 8, dtype=torch.bfloat16)
    ref = (torch.nn.functional.silu(x[:, :4].float()) * x[:, 4:].float()).to(torch.bfloat16)
    for group_list, kind in ((torch.tensor([2, 5], dtype=torch.int64), 0),
                             (torch.tensor([2, 3], dtype=torch.int32), 1)):
        out, _ = _ops.swiglu_quant(x, group_list, kind, need_quant=False)
        assert torch.equal(out[:5], ref[:5]) and not out[5].any()
    q, scale = _ops.swiglu_quant(x, torch.tensor([6]), 1)
    assert q.dtype == torch.int8
    assert torch.allclose(q.float() * scale[:, None], ref.float(), atol=scale.max().item())
    with pytest.raises(ValueError, match="group_list_type must be 0 or 1"):
        _ops.swiglu_quant(x, torch.tensor([6]), 2)


@pytest.mark.parametrize("version, refused", [("0.5.8", False), ("0.5.9", True), ("0.5.10", False)])
def test_the_deepep_bf16_experts_of_each_release_meet_the_grouped_matmul_as_on_a_device(version, refused):
    """Why the real GLM-4 MoE server runs 0.5.8 (docs/dual-stream-experts.md): each release's own
    ``process_weights_after_loading`` (UnquantizedFusedMoEMethod) then its own DeepEP bf16 expert
    function, on the simulated ops: 0.5.9 transposes the weights at load time and still permutes
    them for ``npu_grouped_matmul``, whose K then disagrees -- refused with the device's message;
    0.5.8 (no load-time transpose) and 0.5.10 (no permute) compute the experts."""
    out = realsglang.run_in_release(version, """
        import json, torch
        from shimdev import simnpu
        simnpu.install(release=%r, server=True)
        from shimdev import simnpu as _s
        from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod  # first, as sglang
        import sglang.srt.hardware_backend.npu.quantization.fused_moe_method_npu as m
        torch.manual_seed(0)
        E, H, I, rows = 4, 64, 48, 5
        layer = torch.nn.Module()
        layer.w13_weight = torch.nn.Parameter(torch.randn(E, 2 * I, H, dtype=torch.bfloat16) / 8, requires_grad=False)
        layer.w2_weight = torch.nn.Parameter(torch.randn(E, H, I, dtype=torch.bfloat16) / 8, requires_grad=False)
        layer.num_local_experts, layer.num_experts = E, E
        method = UnquantizedFusedMoEMethod()  # the default MoE runner: not flashinfer, not triton
        method.process_weights_after_loading(layer)
        x = torch.randn(rows, H, dtype=torch.bfloat16)
        counts = torch.tensor([2, 0, 3, 0], dtype=torch.int64)
        try:
            y = m.npu_fused_moe_without_routing_weights_bf16(layer, x, 1, counts, torch.bfloat16)
            emit({"shape": list(y.shape)})
        except RuntimeError as e:
            emit({"refused": str(e)})
    """ % version, install_sim=False)
    if refused:
        assert out["refused"].startswith("Dim 1 value of x[0] should be equal with dim 1 value of weight[0]"), out
    else:
        assert out == {"shape": [5, 64]}, out


# -- what an EAGLE / NextN speculative server calls on NPU (tests/test_real_server_moe.py's draft) --

def test_alloc_extend_kernel_places_each_token_as_the_triton_kernel_does():
    """sgl-kernel-npu's alloc_extend_kernel stand-in against the rule its triton kernel implements:
    a request's new token at position p goes on in its old partial page (last_loc + 1 + ...) while
    p is inside it, else into the free pages handed out in request order -- the speculative draft's
    case (prefix 4, one more token, page 128) included, which 0.5.8's own naive copy gets wrong."""
    import random

    import torch

    from shimdev.simnpu import _ops

    rng = random.Random(0)
    cases = [(128, [4], [5]), (128, [0], [1]), (4, [3, 8], [9, 13])]
    for _ in range(200):
        page, bs = rng.choice([1, 4, 16, 128]), rng.randint(1, 4)
        pre = [rng.randint(0, 300) for _ in range(bs)]
        cases.append((page, pre, [p + rng.randint(1, 300) for p in pre]))
    for page, pre, seq in cases:
        last = [(1000 + i) * page + (p - 1) % page if p else -1 for i, p in enumerate(pre)]
        free = torch.randperm(5000)[:2000] + 1
        out = torch.full((sum(seq) - sum(pre),), -7, dtype=torch.int64)
        _ops._alloc_extend_kernel(torch.tensor(pre), torch.tensor(seq), torch.tensor(last), free, out,
                                  8, page, 1024)
        expected, next_page = [], 0
        for p0, s0, last_loc in zip(pre, seq, last):
            old_end = -(-p0 // page) * page  # the end of the old partial page
            own = []
            for pos in range(p0, s0):
                if pos < old_end:
                    expected.append(last_loc + 1 + pos - p0)
                else:
                    k = pos // page - old_end // page
                    while len(own) <= k:
                        own.append(int(free[next_page]))
                        next_page += 1
                    expected.append(own[k] * page + pos % page)
        assert out.tolist() == expected, (page, pre, seq)


def test_fused_infer_attention_score_is_right_down_causal_attention_over_the_paged_cache():
    """forward_mtp's call: TND queries (cumulative lengths), a [blocks, page, H_kv * D] cache read
    through the block table, sparse_mode 3 -- each request's queries are its last tokens."""
    import torch

    from shimdev.simnpu import _ops

    torch.manual_seed(0)
    heads, kv_heads, dim, page = 4, 2, 8, 4
    k_cache, v_cache = torch.randn(4, page, kv_heads * dim), torch.randn(4, page, kv_heads * dim)
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    q = torch.randn(5, heads, dim)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    out, _ = _ops.npu_fused_infer_attention_score(
        q, k_cache, v_cache, block_table=table, block_size=page, num_heads=heads, num_key_value_heads=kv_heads,
        input_layout="TND", atten_mask=mask, scale=0.3, actual_seq_lengths=[2, 5], actual_seq_lengths_kv=[6, 8],
        sparse_mode=3)
    for b, (start, end, total) in enumerate(((0, 2, 6), (2, 5, 8))):
        slots = torch.cat([torch.arange(page) + int(blk) * page for blk in table[b]])[:total]
        k = k_cache.reshape(-1, kv_heads, dim)[slots].repeat_interleave(2, dim=1)
        v = v_cache.reshape(-1, kv_heads, dim)[slots].repeat_interleave(2, dim=1)
        for i in range(end - start):
            seen = total - (end - start) + i + 1
            w = (torch.einsum("hd,mhd->hm", q[start + i], k[:seen]) * 0.3).softmax(-1)
            assert torch.allclose(out[start + i], torch.einsum("hm,mhd->hd", w, v[:seen]), atol=1e-5), (b, i)
    with pytest.raises(NotImplementedError, match="input_layout='BSND'"):
        _ops.npu_fused_infer_attention_score(q, k_cache, v_cache, block_table=table, input_layout="BSND",
                                             sparse_mode=3, atten_mask=mask)
    # a request with no keys (a graph warm-up's padded target-verify batch): its rows are 0
    # (tests/dev/test_simnpu_moe_graph.py: a query that sees no key of a request that has some)
    out, _ = _ops.npu_fused_infer_attention_score(
        q, k_cache, v_cache, block_table=table, block_size=page, num_heads=heads, num_key_value_heads=kv_heads,
        input_layout="TND", atten_mask=mask, scale=0.3, actual_seq_lengths=[2, 5], actual_seq_lengths_kv=[0, 8],
        sparse_mode=3)
    assert not out[:2].any() and out[2:].abs().sum() > 0


def test_the_draft_tree_and_greedy_verify_of_a_top_1_chain():
    """build_tree_kernel_efficient and verify_tree_greedy as EAGLE top-1 uses them (one step, two
    tokens per request): positions seq_len, seq_len + 1; the chain's retrieval lists; the verify
    accepts the draft token where the target predicted it, and ends with the target's token."""
    import torch

    from shimdev.simnpu import _ops

    bs, n, seq_lens = 2, 2, torch.tensor([5, 7])
    tree_mask = torch.ones(int(seq_lens.sum()) * n + bs * n * n, dtype=torch.bool)
    positions = torch.empty(bs * n, dtype=torch.int64)
    index, nxt, sib = (torch.full((bs, n), -1) for _ in range(3))
    _ops.build_tree_kernel_efficient(torch.zeros(bs, 1, dtype=torch.int64), torch.zeros(bs, 1, dtype=torch.int64),
                                     seq_lens, tree_mask, positions, index, nxt, sib, 1, 1, n, 0)
    assert positions.tolist() == [5, 6, 7, 8]
    assert index.tolist() == [[0, 1], [2, 3]] and nxt.tolist() == [[1, -1], [1, -1]] and sib.eq(-1).all()
    # request 0's rows: [prefix 5 | draft 2] per draft token, the second seeing the first
    assert tree_mask[:14].tolist() == [True] * 5 + [True, False] + [True] * 5 + [True, True]
    candidates = torch.tensor([[10, 20], [30, 40]])
    target = torch.tensor([[20, 21], [41, 42]])  # request 0's draft (20) is right, request 1's (40) is not
    predicts = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, n), -1, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    _ops.verify_tree_greedy(predicts, accept_index, accept_num, candidates, index, nxt, sib, target)
    assert accept_num.tolist() == [1, 0]
    assert accept_index.tolist() == [[0, 1], [2, -1]]
    assert predicts.tolist() == [20, 21, 41, 0]
