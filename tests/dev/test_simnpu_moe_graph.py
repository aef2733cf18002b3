"""The shim's dual-stream ``forward_deepep`` (dual_stream_experts) inside an NPU graph, as sglang's
NPUGraphRunner drives a speculative server's ``TARGET_VERIFY`` batch: on the capture stream two
eager warm-ups, then the capture into a pool from ``graph_pool_handle()``, then replays on the
default stream with new hidden states -- the stream sanitizer on from the first warm-up to the
last replay.  The block is the selftest's synthetic GLM-4 MoE block (routed experts "masked": the
per-expert gather waits on the host, which a capture refuses), run through the patch's own wrapper.

Checked: the side stream is made in the first warm-up, outside any capture; inside the capture it
forks from the capture stream and is joined back before ``forward_deepep`` returns; what it
allocates lands in the graph's pool; each replay gives the single-stream result on its new input,
and the sanitizer follows the graph's fork and join at replay and stays silent; the counts are
Python calls (warm-ups and the capture), replays add none.  Seeded races: a side stream never
joined is refused at ``capture_end``; one joined only after the combine passes the capture and is
reported by the sanitizer at the first replay.  And what the captured MoE path needs of the
simulation: a declared stand-in run by the recorder while capturing is no launch for the
sanitizer; a TND attention query that sees no key (a capture's warm-ups) gives zeros; DeepEP's
low-latency dispatch and combine are captured and replayed.  Each case runs in a process of its
own (server mode changes torch for the process's life)."""
from tests.dev.test_simnpu_graphs import run

BED = """
import enum, types
from npu_shim.patches import dual_stream_experts as dsi
from npu_shim.patches._selftest import _synthetic_moe as sm


class ForwardMode(enum.IntEnum):
    EXTEND = 1
    DECODE = 2
    TARGET_VERIFY = 3

    def is_extend(self):
        return self is ForwardMode.EXTEND

    def is_target_verify(self):
        return self is ForwardMode.TARGET_VERIFY


TOKENS, H = 4, 8
p = dict(sm.DEFAULTS, tokens=TOKENS, hidden=H, shared_inter=8, experts=4, topk=2, expert_inter=4,
         routed="masked")
block = sm.build_block("npu", torch.float32, p)
batch = types.SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, num_token_non_padded=None)
state = dsi.DualStreamExpertsState()


def forward(h):
    out = state.forward_deepep_wrapper(sm.serial_forward, block, (h, batch), {})
    simnpu.log("forward_deepep_returned", simnpu.current_stream_name())
    return out


def serial(h):
    return sm.serial_forward(block, h, batch)


def capture(static, late_join=False):
    '''sglang's per-batch-size sequence on its capture stream: two warm-ups, then the capture.'''
    cap = torch.npu.Stream()
    with torch.npu.stream(cap):
        for _ in range(2):
            torch.npu.synchronize()
            forward(static)
        pool = torch.npu.graph_pool_handle()
        graph = torch.npu.NPUGraph()
        with torch.npu.graph(graph, pool=pool, stream=cap, auto_dispatch_capture=True):
            out = forward(static)
            if late_join:
                cap.wait_stream(state.side_streams[cap])
    return cap, pool, graph, out


def edges(events):
    return [list(e) for e in events if e[0] in ("stream_create", "wait_stream", "capture_begin",
                                                "capture_end", "forward_deepep_returned", "replay")]
"""


def test_a_captured_target_verify_forks_and_joins_its_side_stream_into_the_pool_and_replays_cleanly():
    out = run(BED, """
    torch.manual_seed(1)
    static = torch.randn(TOKENS, H, device="npu")
    fresh = [torch.randn(TOKENS, H, device="npu") for _ in range(3)]
    simnpu.clear_events()
    with sm.device_module_named(torch, torch.npu), torch.no_grad(), simnpu.sanitize() as san:
        cap, pool, graph, out = capture(static)
        captured = list(simnpu.EVENTS)
        counts = dict(state.counts)
        equal = []
        simnpu.clear_events()
        for h in fresh:
            static.copy_(h)
            graph.replay()
            equal.append(bool(torch.equal(out, serial(h))))
        replayed = list(simnpu.EVENTS)
    side = state.side_streams[cap]
    print(json.dumps({
        "cap": simnpu.stream_name(cap), "side": simnpu.stream_name(side),
        "captured": edges(captured), "replayed": edges(replayed),
        "allocations": [list(e) for e in captured if e[0] == "capture_allocations"],
        "pool": {str(k): v for k, v in _graphs.pools().items()}, "pool_id": list(pool),
        "counts_after_capture": counts, "counts_after_replays": dict(state.counts),
        "side_stream_count": state.details["side_stream_count"],
        "equal": equal, "reports": [str(r) for r in san.reports], "launches": san.launches}))
    """)
    cap, side = out["cap"], out["side"]
    captured = out["captured"]
    begin = captured.index(["capture_begin", 1, cap, out["pool_id"]])
    # the side stream was made once, in the first warm-up: outside any capture (the others made
    # are the capture stream and torch_npu's own graph streams)
    made = captured.index(["stream_create", side])
    assert captured.count(["stream_create", side]) == 1
    assert made < captured.index(["forward_deepep_returned", cap]) < begin
    # inside the capture: fork, join, then forward_deepep returns -- then the capture ends
    assert captured[begin:] == [
        ["capture_begin", 1, cap, out["pool_id"]],
        ["wait_stream", side, cap],
        ["wait_stream", cap, side],
        ["forward_deepep_returned", cap],
        ["capture_end", 1, cap, out["pool_id"]]]
    # the side stream's allocations (the shared experts' activations and output) are the pool's
    ((_, graph, pool, by_stream),) = out["allocations"]
    assert pool == out["pool_id"] and set(by_stream) == {cap, side} and by_stream[side] > 0, by_stream
    assert out["pool"][str(tuple(pool))]["graph_pool_bytes"] == sum(by_stream.values())
    # each replay: the graph's fork and join on the replaying stream, the single-stream result
    assert out["replayed"] == [["replay", 1, "main", out["pool_id"]], ["wait_stream", side, "main"],
                               ["wait_stream", "main", side]] * 3
    assert out["equal"] == [True, True, True]
    assert out["reports"] == [] and out["launches"] > 0
    # counts are Python calls: two warm-ups and the capture; three replays add nothing
    assert out["counts_after_capture"] == {"dual_stream_python_calls": 3, "dual_stream_verify_python_calls": 3,
                                           "fused_python_calls": 0}
    assert out["counts_after_replays"] == out["counts_after_capture"]
    assert out["side_stream_count"] == 1


def test_a_side_stream_never_joined_is_refused_at_capture_end():
    out = run(BED, """
    state.wait_share_stream = lambda: None   # the seeded race: the main stream never waits
    static = torch.randn(TOKENS, H, device="npu")
    with sm.device_module_named(torch, torch.npu), torch.no_grad():
        print(json.dumps({"refused": refused(lambda: capture(static)),
                          "side": simnpu.stream_name(next(iter(state.side_streams.values())))}))
    """)
    assert out["refused"] is not None and "not joined back" in out["refused"], out
    assert out["side"] in out["refused"]


def test_a_side_stream_joined_after_the_combine_is_reported_by_the_sanitizer_at_replay():
    out = run(BED, """
    state.wait_share_stream = lambda: None   # the seeded race: joined only after forward_deepep
    static = torch.randn(TOKENS, H, device="npu")
    with sm.device_module_named(torch, torch.npu), torch.no_grad():
        cap, pool, graph, out = capture(static, late_join=True)   # the capture itself passes
        with simnpu.sanitize() as san:
            graph.replay()
    side = simnpu.stream_name(state.side_streams[cap])
    print(json.dumps({"side": side, "reports": [(r.kind, list(r.streams), list(r.ops)) for r in san.reports]}))
    """)
    side = out["side"]
    # the combine (add_ on the replaying stream) writes the shared output the side stream wrote
    assert any(kind.endswith("-after-write") and streams == [side, "main"] and "add_" in ops[1]
               for kind, streams, ops in out["reports"]), out["reports"]


# -- what the captured MoE path needed of the simulation ---------------------------------------------

def test_a_declared_stand_in_run_while_capturing_is_no_launch_for_the_sanitizer():
    """The recorder runs a captured op once to learn its outputs' shapes; that run (a declared
    stand-in such as the fused split_qkv_rmsnorm_rope included) happens at replay, not now: an
    eager write on the default stream after the capture races nothing."""
    out = run("""
    from shimdev.beds import dual_stream_kernels as K
    x = torch.randn(2, 64, device="npu")
    sin, cos = torch.randn(2, 1, 1, 8, device="npu"), torch.randn(2, 1, 1, 8, device="npu")
    s = torch.npu.Stream()
    with simnpu.sanitize() as san:
        g = torch.npu.NPUGraph()
        with torch.npu.graph(g, stream=s):
            q, k, v = K.split_qkv_rmsnorm_rope(x, sin, cos, 32, 16, 16, eps=1e-6)
        x.fill_(1.0)                     # eager, on the default stream
    print(json.dumps([str(r) for r in san.reports]))
    """)
    assert out == []


def test_a_tnd_query_that_sees_no_key_gives_zeros():
    """A capture's warm-ups fill the sequence lengths with 0 (sglang's ascend backend): a
    target-verify batch then has more queries than keys; the queries that see none give zeros and
    the others attend as usual (right-down causal)."""
    import torch

    from shimdev.simnpu import _ops

    torch.manual_seed(0)
    heads, dim, page = 2, 8, 4
    cache = torch.randn(4, page, heads * dim)
    q = torch.randn(4, heads, dim)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    kw = dict(input_layout="TND", block_table=table, block_size=page, num_heads=heads, num_key_value_heads=heads,
              scale=0.5, sparse_mode=3, atten_mask=mask, actual_seq_lengths=[2, 4])
    out, _ = _ops.npu_fused_infer_attention_score(q, cache, cache, actual_seq_lengths_kv=[0, 1], **kw)
    assert torch.equal(out[:3], torch.zeros(3, heads, dim))   # request 0: no key; request 1: its first query
    # request 1's second query sees the one key: its value row
    assert torch.allclose(out[3], cache[2, 0].reshape(heads, dim))
    full, _ = _ops.npu_fused_infer_attention_score(q, cache, cache, actual_seq_lengths_kv=[2, 3], **kw)
    assert not torch.equal(full[:2], torch.zeros(2, heads, dim))


def test_the_low_latency_deepep_dispatch_and_combine_are_captured_and_replayed():
    """DeepEP's low-latency path (what decode and target-verify graphs capture) keeps its shapes and
    reads nothing back to the host; a padded token (expert -1) adds nothing."""
    out = run("""
    from shimdev.simnpu import _deepep

    class Group:
        def rank(self): return 0
        def size(self): return 1

    E, H = 4, 8
    buf = _deepep.Buffer(Group(), low_latency_mode=True)
    w = torch.randn(E, H, H, device="npu")

    def moe(x, ids, weights):
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, ids, 16, E, use_fp8=False)
        y = torch_npu.npu_grouped_matmul(x=[recv], weight=[w], split_item=2, group_list_type=1, group_type=0,
                                         group_list=count.long())[0]
        return buf.low_latency_combine(y, ids, weights, handle)[0]

    x = torch.randn(3, H, device="npu")
    ids = torch.tensor([[0, 2], [1, 3], [2, -1]], device="npu")
    weights = torch.rand(3, 2, device="npu")
    s = torch.npu.Stream()
    with torch.npu.stream(s):
        moe(x, ids, weights)
        g = torch.npu.NPUGraph()
        with torch.npu.graph(g, stream=s):
            y = moe(x, ids, weights)
    fresh = torch.randn(3, H, device="npu")
    x.copy_(fresh)
    g.replay()
    ref = torch.stack([sum(weights[t, j] * (fresh[t] @ w[int(ids[t, j])]) for j in range(2) if ids[t, j] >= 0)
                       for t in range(3)])
    print(json.dumps({"replayed": bool(torch.allclose(y, ref, atol=1e-5)),
                      "eager": bool(torch.allclose(moe(fresh, ids, weights), ref, atol=1e-5))}))
    """)
    assert out == {"replayed": True, "eager": True}


def test_swiglu_quant_is_captured_and_a_replay_covers_the_rows_of_its_group_list():
    """sgl-kernel-npu's swiglu_quant, between the two grouped matmuls of the bf16 DeepEP experts
    from sglang 0.5.10 on (0.5.7-0.5.9 call ``npu_swiglu`` there), is inside the decode capture of
    0.5.10's own GLM-4 MoE server: the kernel reads the group list on the device (``tl.load`` /
    ``tl.sum`` in ``_swiglu_quant_kernel``), so nothing reaches the host and the capture goes
    through -- on the capture stream and on a stream forked from it alike.  Each replay covers the
    rows of the group list it finds then, quantised or not; the rows past them are zero."""
    out = run("""
    from shimdev.simnpu import _ops

    x = torch.randn(6, 8, device="npu", dtype=torch.bfloat16)
    counts = torch.tensor([2, 1, 0, 1], dtype=torch.int64, device="npu")     # 4 rows, type 1
    cumsum = torch.tensor([2, 3, 3, 4], dtype=torch.int64, device="npu")     # the same, type 0
    cap, side = torch.npu.Stream(), torch.npu.Stream()
    with torch.npu.stream(cap):
        g = torch.npu.NPUGraph()
        with torch.npu.graph(g, stream=cap):
            plain, _ = _ops.swiglu_quant(x, counts, 1, need_quant=False)
            side.wait_stream(cap)
            with torch.npu.stream(side):
                quant, scale = _ops.swiglu_quant(x, cumsum, 0)
            cap.wait_stream(side)
    poisoned = bool(plain.float().isnan().all())
    runs = []
    for rows in (4, 6, 1):
        fresh = torch.randn(6, 8).to(torch.bfloat16)
        x.copy_(fresh)
        counts.copy_(torch.tensor([rows, 0, 0, 0]))
        cumsum.copy_(torch.tensor([0, rows, rows, rows]))
        g.replay()
        ref = (torch.nn.functional.silu(fresh[:, :4].float()) * fresh[:, 4:].float()).to(torch.bfloat16)
        ref_scale = ref.float().abs().amax(dim=-1) / 127
        runs.append({"plain": bool(torch.equal(plain[:rows], ref[:rows])),
                     "plain_rest_zero": not plain[rows:].float().any(),
                     "scale": bool(torch.allclose(scale[:rows], ref_scale[:rows])),
                     "quant": bool(torch.allclose(quant[:rows].float() * scale[:rows, None], ref[:rows].float(),
                                                  atol=float(scale[:rows].max()))),
                     "quant_rest_zero": not quant[rows:].any() and not scale[rows:].any()})
    print(json.dumps({"poisoned_before_replay": poisoned, "runs": runs}))
    """)
    assert out["poisoned_before_replay"]
    assert out["runs"] == [{"plain": True, "plain_rest_zero": True, "scale": True, "quant": True,
                            "quant_rest_zero": True}] * 3
