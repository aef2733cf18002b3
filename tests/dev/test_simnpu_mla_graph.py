"""MLA's form of ``npu_fused_infer_attention_score`` (``query_rope`` / ``key_rope``) in the
simulation, as sglang's ascend backend calls it -- BSND in ``forward_decode_graph``, TND in
``forward_mtp`` -- and through the graph-only ``.out`` overload, against the same attention
written out plainly: per request, the latent rows read from the paged cache through the block
table, scores ``(q_nope . c_kv + q_rope . k_rope) * scale`` (right-down causal for TND with
``sparse_mode=3``), softmax, times the latent rows."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from shimdev import DEV
from shimdev.simnpu import _ops
from tests.dev.test_simnpu_graphs import PRELUDE, run

PAGE, BLOCKS = 4, 8
KV_LORA, ROPE, SCALE = 16, 8, 0.3


def caches(seq_lens, tables):
    """Latent and rope rows per request, and the paged caches ``[BLOCKS, PAGE, 1 * D]`` they are in."""
    c_kv, k_rope = torch.zeros(BLOCKS, PAGE, KV_LORA), torch.zeros(BLOCKS, PAGE, ROPE)
    rows = []
    for n, table in zip(seq_lens, tables):
        lat, rope = torch.randn(n, KV_LORA), torch.randn(n, ROPE)
        for i in range(n):
            c_kv[table[i // PAGE], i % PAGE] = lat[i]
            k_rope[table[i // PAGE], i % PAGE] = rope[i]
        rows.append((lat, rope))
    return c_kv, k_rope, rows


def plain(q_nope, q_rope, lat, rope, visible):
    """q ``[n, heads, D]`` over ``lat``/``rope`` ``[m, D]``; query i sees keys ``< visible[i]``."""
    scores = (torch.einsum("nhd,md->nhm", q_nope, lat) + torch.einsum("nhd,md->nhm", q_rope, rope)) * SCALE
    keys = torch.arange(lat.shape[0])
    allowed = keys[None, :] < torch.tensor(visible)[:, None]
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    return torch.einsum("nhm,md->nhd", scores.softmax(-1), lat)


def test_bsnd_decode_with_rope_is_plain_mla_attention_over_each_request_s_pages():
    """forward_decode_graph: BSND ``[B, 1, N, kv_lora]``, heads padded to a power of two, a padded
    batch entry with 0 tokens gets zeros."""
    torch.manual_seed(0)
    seq_lens, heads = [6, 3, 0], 4
    tables = torch.tensor([[3, 5], [1, 0], [0, 0]], dtype=torch.int32)
    c_kv, k_rope, rows = caches(seq_lens, tables.tolist())
    q_nope, q_rope = torch.randn(3, 1, heads, KV_LORA), torch.randn(3, 1, heads, ROPE)
    kw = dict(query_rope=q_rope, key_rope=k_rope, num_heads=heads, num_key_value_heads=1, block_table=tables,
              block_size=PAGE, input_layout="BSND", scale=SCALE, actual_seq_lengths_kv=seq_lens,
              antiquant_mode=0, antiquant_scale=None, sparse_mode=0)
    out, lse = _ops.npu_fused_infer_attention_score(q_nope, c_kv, c_kv, **kw)
    assert out.shape == (3, 1, heads, KV_LORA) and lse.shape == (1,)
    for b in (0, 1):
        lat, rope = rows[b]
        want = plain(q_nope[b], q_rope[b], lat, rope, [seq_lens[b]])
        assert torch.allclose(out[b], want, atol=1e-5), b
    assert torch.equal(out[2], torch.zeros(1, heads, KV_LORA))

    # the graph-only overload, as forward_decode_graph calls it: the max workspace, then .out into
    # torch.empty_like(q_nope) and a one-element lse
    ws = _ops._npu_fused_infer_attention_score_get_max_workspace(q_nope, c_kv, c_kv, **kw)
    o, l1 = torch.empty_like(q_nope), torch.empty(1)
    res = _ops._npu_fused_infer_attention_score_out(q_nope, c_kv, c_kv, workspace=ws, out=[o, l1], **kw)
    assert res[0] is o and torch.equal(o, out)
    inferred, _ = _ops._npu_fused_infer_attention_score_infer_output(
        q_nope, c_kv, input_layout="BSND", block_table=tables, num_heads=heads, num_key_value_heads=1,
        query_rope=q_rope)
    assert inferred.shape == out.shape


def test_tnd_with_rope_is_right_down_causal_mla_attention():
    """forward_mtp: TND ``[T, N, kv_lora]``, cumulative query ends, ``sparse_mode=3`` with the 2048
    x 2048 mask: query i of a request's n sees its keys ``<= kv_len - n + i``."""
    torch.manual_seed(1)
    seq_lens, ends, heads = [7, 5], [2, 4], 2
    tables = torch.tensor([[2, 6], [4, 7]], dtype=torch.int32)
    c_kv, k_rope, rows = caches(seq_lens, tables.tolist())
    q_nope, q_rope = torch.randn(4, heads, KV_LORA), torch.randn(4, heads, ROPE)
    mask = ~torch.ones(2048, 2048, dtype=torch.bool).tril_()
    out, _ = _ops.npu_fused_infer_attention_score(
        q_nope, c_kv, c_kv, query_rope=q_rope, key_rope=k_rope, num_heads=heads, num_key_value_heads=1,
        input_layout="TND", scale=SCALE, block_table=tables, block_size=PAGE, sparse_mode=3, atten_mask=mask,
        actual_seq_lengths=ends, actual_seq_lengths_kv=seq_lens)
    assert out.shape == (4, heads, KV_LORA)
    start = 0
    for b, end in enumerate(ends):
        n, lat_rope = end - start, rows[b]
        visible = [seq_lens[b] - n + i + 1 for i in range(n)]
        want = plain(q_nope[start:end], q_rope[start:end], *lat_rope, visible)
        assert torch.allclose(out[start:end], want, atol=1e-5), b
        start = end


def test_what_sglang_never_passes_with_rope_raises_by_name():
    q, c_kv, k_rope = torch.randn(1, 1, 2, KV_LORA), torch.zeros(BLOCKS, PAGE, KV_LORA), torch.zeros(BLOCKS, PAGE, ROPE)
    table = torch.zeros(1, 2, dtype=torch.int32)
    base = dict(num_heads=2, num_key_value_heads=1, block_table=table, block_size=PAGE, input_layout="BSND",
                actual_seq_lengths_kv=[1])
    with pytest.raises(RuntimeError, match="query_rope and key_rope come together"):
        _ops.npu_fused_infer_attention_score(q, c_kv, c_kv, query_rope=torch.randn(1, 1, 2, ROPE), **base)
    with pytest.raises(NotImplementedError, match="FRACTAL_NZ"):
        _ops.npu_fused_infer_attention_score(q, c_kv.view(BLOCKS, 1, 1, PAGE, KV_LORA), c_kv,
                                             query_rope=torch.randn(1, 1, 2, ROPE), key_rope=k_rope, **base)
    with pytest.raises(NotImplementedError, match="input_layout='BSH'"):
        _ops.npu_fused_infer_attention_score(q.view(1, 1, -1), c_kv, c_kv, query_rope=torch.randn(1, 1, 2 * ROPE),
                                             key_rope=k_rope, **dict(base, input_layout="BSH"))
    with pytest.raises(NotImplementedError, match="BSND with sparse_mode=3"):
        _ops.npu_fused_infer_attention_score(q, c_kv, c_kv, query_rope=torch.randn(1, 1, 2, ROPE),
                                             key_rope=k_rope, **dict(base, sparse_mode=3))


def test_the_bsnd_rope_call_captures_updates_and_replays_as_eager():
    """forward_decode_graph's MLA call in an NPU graph (auto_dispatch_capture, sglang's
    NPUGraphRunner): recorded as ``.out`` once, each replay after an update from a thread with new
    ``actual_seq_lengths_kv`` equals the eager call with those lengths."""
    out = run("""
    heads, kv_lora, rope, page = 4, 16, 8, 4
    ckv = torch.randn(8, page, kv_lora, device="npu")
    kr = torch.randn(8, page, rope, device="npu")
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32, device="npu")
    q = torch.randn(2, 1, heads, kv_lora, device="npu")
    qr = torch.randn(2, 1, heads, rope, device="npu")
    kw = dict(query_rope=qr, key_rope=kr, num_heads=heads, num_key_value_heads=1, block_table=table,
              block_size=page, input_layout="BSND", scale=0.3, antiquant_mode=0, antiquant_scale=None,
              sparse_mode=0)

    def decode(lens):
        ws = torch_npu._npu_fused_infer_attention_score_get_max_workspace(q, ckv, ckv, actual_seq_lengths_kv=lens, **kw)
        o = torch.empty_like(q)
        lse = torch.empty(1, device="npu")
        torch_npu.npu_fused_infer_attention_score.out(q, ckv, ckv, actual_seq_lengths_kv=lens, workspace=ws,
                                                      out=[o, lse], **kw)
        return o * 1

    s = torch.npu.Stream()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, pool=torch.npu.graph_pool_handle(), stream=s, auto_dispatch_capture=True):
        static = decode([5, 3])
    rows = []
    for lens in ([7, 1], [2, 6], [8, 0]):
        t = threading.Thread(target=g.update, kwargs={"cpu_update_input": [{"actual_seq_lengths_kv": lens}]})
        t.start(); g.replay(); t.join()
        with torch.npu.stream(s):
            rows.append([torch.allclose(static, decode(lens), atol=1e-6),
                         bool(static.abs().sum() > 0)])
    records = g.graph_dispatch_mode.graph_dispatch_records
    print(json.dumps({"records": [r.op_cache_entry.__name__ for r in records], "rows": rows}))
    """)
    assert out["records"] == ["npu_fused_infer_attention_score.out"]
    assert out["rows"] == [[True, True]] * 3



def test_a_collective_is_captured_and_reissued_at_each_replay(tmp_path):
    """TP's all-reduce inside a capture (sglang's TP-2 decode graphs; a device captures HCCL's
    collectives): recorded without landing, the Work it gives back waited on; each replay sums
    the ranks' current values into the same tensor again."""
    script = textwrap.dedent("""
    import sys
    import torch.distributed as dist
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method=sys.argv[2], rank=rank, world_size=2)
    x = torch.zeros(4, device="npu")
    s = torch.npu.Stream()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, pool=torch.npu.graph_pool_handle(), stream=s):
        x.fill_(rank + 1)
        dist.all_reduce(x)
        y = x * 10
    at_capture = x.tolist()
    rows = []
    for _ in range(2):
        g.replay()
        rows.append([x.tolist(), y.tolist()])
    print(json.dumps({"capture": at_capture, "replays": rows}))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("TASK_QUEUE_ENABLE", "ASCEND_LAUNCH_BLOCKING")}
    env["PYTHONPATH"] = str(DEV)
    store = "file://%s" % (tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, "-c", PRELUDE + script, str(r), store], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    for stdout, _ in outs:
        got = json.loads(stdout.strip().splitlines()[-1])
        assert got["capture"] == [0.0] * 4  # nothing lands at capture
        assert got["replays"] == [[[3.0] * 4, [30.0] * 4]] * 2


def test_to_another_device_tensor_s_device_is_captured_and_a_host_copy_still_refused():
    """The DSA indexer's ``actual_seq_lengths_kv.to(k.device)`` in a capture: device to device on
    an NPU (a no-op), though npu tensors stand on the cpu in the simulated server; ``.to("cpu")``
    and ``.cpu()`` of a device tensor stay refused."""
    out = run("""
    lens = torch.tensor([3, 5], device="npu")
    k = torch.ones(2, device="npu")
    s = torch.npu.Stream()
    results = {}
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, pool=torch.npu.graph_pool_handle(), stream=s):
        y = lens.to(k.device).to(torch.int32) + 1
    g.replay()
    results["same_device"] = y.tolist()
    for name, fn in (("string", lambda: lens.to("cpu")), ("cpu", lambda: lens.cpu())):
        g2 = torch.npu.NPUGraph()
        def capture():
            with torch.npu.graph(g2, pool=torch.npu.graph_pool_handle(), stream=s):
                fn()
        results[name] = refused(capture)
    print(json.dumps(results))
    """)
    assert out["same_device"] == [4, 6]
    for name in ("string", "cpu"):
        assert out[name] and "device-to-host copy" in out[name], out


def test_a_device_storage_resize_is_logged_with_the_capture_live_at_the_time():
    """The server's order of captures and device resizes (what a weight release inside a capture
    would show), in the events and in the memory snapshot a server process writes."""
    out = run("""
    from shimdev.simnpu import _server
    before = torch.ones(256, device="npu")
    inside = torch.ones(128, device="npu")
    host = torch.ones(64)
    before.untyped_storage().resize_(0)
    host.untyped_storage().resize_(0)            # not device memory: not logged
    s = torch.npu.Stream()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, pool=torch.npu.graph_pool_handle(), stream=s):
        inside.untyped_storage().resize_(0)
    print(json.dumps({"events": _server.memory_snapshot()["graph_events"]}))
    """)
    kinds = [e[0] for e in out["events"]]
    assert kinds == ["storage_resize", "capture_begin", "storage_resize", "capture_end"], out
    assert out["events"][0] == ["storage_resize", 1024, 0, None]
    graph = out["events"][1][1]
    assert out["events"][2] == ["storage_resize", 512, 0, graph]


def test_a_capture_that_reads_a_released_weight_is_refused_as_it_is_captured():
    """mla_weight_release's guard (``tensor_release.free_weight``) answers every torch call on the
    released weight, so an op that would read it inside a capture raises then -- nothing is
    recorded that a replay would run on freed memory; the release's resize happened with no
    capture live."""
    out = run("""
    import sys
    sys.path.insert(0, %r)
    from npu_shim.patches import mla_weight_release as impl
    from npu_shim.runtime import tensor_release
    w = torch.nn.Parameter(torch.ones(8, 8, device="npu"), requires_grad=False)
    x = torch.ones(2, 8, device="npu")
    freed = tensor_release.free_weight(w, "w_kc of layer 0", impl.GUARD, lambda *a: None)
    s = torch.npu.Stream()
    g = torch.npu.NPUGraph()
    error = None
    try:
        with torch.npu.graph(g, pool=torch.npu.graph_pool_handle(), stream=s):
            y = x @ w
    except Exception as exc:
        error = [type(exc).__name__, str(exc)]
    print(json.dumps({"freed": freed, "error": error,
                      "events": [list(e) for e in simnpu.events() if e[0] in
                                 ("capture_begin", "capture_end", "storage_resize")]}))
    """ % str(DEV.parent))
    assert out["freed"] == 256
    assert out["error"][0] == "ReleasedWeightError", out
    assert "w_kc of layer 0" in out["error"][1] and "NPU_SHIM_MLA_WEIGHT_RELEASE=0" in out["error"][1]
    kinds = [e[0] for e in out["events"]]
    assert kinds[0] == "storage_resize" and out["events"][0][3] is None  # released before any capture
    assert kinds[1:] == ["capture_begin", "capture_end"]


def test_sparse_attention_reads_no_index_past_the_request_s_kv_length():
    """An index at or past ``actual_seq_lengths_kv[b]`` selects nothing, as -1 does: the kernel reads
    a request's pages only up to its length (in a DSA decode capture the lengths and the block
    table hold nothing yet, and nothing is read)."""
    torch.manual_seed(3)
    n, heads = 5, 2
    lat, rope = torch.randn(n, KV_LORA), torch.randn(n, ROPE)
    table = torch.tensor([[2, 6]], dtype=torch.int32)
    c_kv, k_rope, _ = torch.zeros(BLOCKS, PAGE, 1, KV_LORA), torch.zeros(BLOCKS, PAGE, 1, ROPE), None
    for i in range(n):
        c_kv[table[0, i // PAGE], i % PAGE, 0], k_rope[table[0, i // PAGE], i % PAGE, 0] = lat[i], rope[i]
    q, q_rope = torch.randn(1, heads, KV_LORA), torch.randn(1, heads, ROPE)
    kw = dict(block_table=table, actual_seq_lengths_query=torch.tensor([1]), query_rope=q_rope, key_rope=k_rope,
              layout_query="TND", layout_kv="PA_BSND", attention_mode=2)
    picks = torch.tensor([[[0, 2, 4, 6, -1]]], dtype=torch.int32)  # 6 is past the request's 5 tokens
    out, _, _ = _ops.npu_sparse_flash_attention(q, c_kv, c_kv, picks, SCALE,
                                                actual_seq_lengths_kv=torch.tensor([n]), **kw)
    sel = torch.tensor([0, 2, 4])
    probs = ((q[0] @ lat[sel].T + q_rope[0] @ rope[sel].T) * SCALE).softmax(-1)
    assert torch.allclose(out[0], probs @ lat[sel], atol=1e-5)
    garbage = torch.full((8, 2), -394322512, dtype=torch.int32)  # a block table nothing filled yet
    none, _, _ = _ops.npu_sparse_flash_attention(q, c_kv, c_kv, torch.zeros(1, 1, 4, dtype=torch.int32), SCALE,
                                                 actual_seq_lengths_kv=torch.tensor([0]),
                                                 **dict(kw, block_table=garbage))
    assert torch.equal(none, torch.zeros_like(none))
