"""The simulated NPU's stream sanitizer (dev/shimdev/simnpu/_sanitizer.py), in this process.

Seeded bugs, each in the shim's own dual-stream body (``DualStreamExpertsState._forward_deepep_dual_stream``
on a small pure-torch MoE block) or in a few lines of stream code, must each be reported with the
right kind; the same code without the bug must report nothing.  Then the happens-before edges one by
one, the record_stream rule, storage resizes as frees, the declared stand-in kernels, and that the
sanitizer leaves torch and the device as it found them.
"""
from __future__ import annotations

import types

import pytest
import torch

from npu_shim.patches import dual_stream_experts as ds
from shimdev.bench import csan_check, dual_stream_bench
from shimdev.beds import dual_stream_kernels, mla_kernels
from shimdev.simnpu import _sanitizer

SMALL = dict(dual_stream_bench.DEFAULTS, tokens=6, hidden=8, shared_inter=8, experts=4, topk=2,
             expert_inter=4)
BATCH = types.SimpleNamespace(num_token_non_padded=None)


@pytest.fixture
def npu(simnpu_clean):
    return torch.npu


@pytest.fixture
def block():
    return dual_stream_bench.build_block("cpu", torch.float32, SMALL)


def moe_layer(process, block, hidden):
    """One MoE layer through the backport's dual-stream body (0.5.9's forward_deepep order)."""
    return process._forward_deepep_dual_stream(dual_stream_bench._serial_forward, block, hidden, BATCH)


def two_layers(process, block, npu):
    """Two layers on the main stream: the first output read by the main stream, then freed."""
    hidden = torch.randn(SMALL["tokens"], SMALL["hidden"])
    with torch.no_grad():
        out = moe_layer(process, block, hidden)
        nxt = out + hidden  # the residual add of the decoder layer, on the main stream
        del out
        return moe_layer(process, block, nxt)


def kinds(san):
    return san.kinds()


# -- the shim's dual-stream body: correct, and with each bug seeded ---------------------------------

def test_the_backports_dual_stream_body_reports_nothing(npu, block):
    process = ds.DualStreamExpertsState()
    with _sanitizer.sanitize() as san:
        two_layers(process, block, npu)
    san.assert_clean()
    assert san.launches > 20  # the ops were seen at all


def test_a_removed_wait_share_stream_is_reported(npu, block, monkeypatch):
    process = ds.DualStreamExpertsState()
    monkeypatch.setattr(process, "wait_share_stream", lambda: None)
    with _sanitizer.sanitize() as san:
        two_layers(process, block, npu)
    assert "write-after-write" in kinds(san), san.reports
    (race,) = [r for r in san.reports if r.kind == "write-after-write"]
    # both call sites: the shared experts' output written on the side stream, add_ on main
    assert race.streams == ("side-1", "main") and race.ops[1] == "add_", race
    assert "_synthetic_moe.py" in race.sites[0] and "dual_stream_experts.py" in race.sites[1], race


def test_a_wait_moved_after_add_is_reported(npu, block, monkeypatch):
    process = ds.DualStreamExpertsState()
    real_wait = process.wait_share_stream
    monkeypatch.setattr(process, "wait_share_stream", lambda: None)
    with _sanitizer.sanitize() as san:
        with torch.no_grad():
            moe_layer(process, block, torch.randn(SMALL["tokens"], SMALL["hidden"]))
        real_wait()  # the main stream does wait for the side stream, but only after add_
    assert kinds(san) == ["write-after-write"], san.reports


def test_an_in_place_write_to_hidden_states_on_the_main_stream_is_reported(npu, block):
    """sglang#10352's bug: the routed experts update hidden_states in place while the shared
    experts on the side stream still read it."""
    block.experts = InPlaceExperts(block.experts)
    with _sanitizer.sanitize() as san:
        with torch.no_grad():
            moe_layer(ds.DualStreamExpertsState(), block, torch.randn(SMALL["tokens"], SMALL["hidden"]))
    assert "write-after-read" in kinds(san), san.reports
    (race,) = [r for r in san.reports if r.kind == "write-after-read"]
    assert race.streams == ("side-1", "main") and race.ops[1] == "copy_", race


class InPlaceExperts(torch.nn.Module):
    """Routed experts that write their output over their input, as a fused MoE with
    ``inplace=True`` does."""

    should_fuse_routed_scaling_factor_in_topk = False

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states, topk_output):
        return hidden_states.copy_(self.inner(hidden_states=hidden_states, topk_output=topk_output))


def test_a_side_stream_that_does_not_wait_for_main_is_reported(npu, block, monkeypatch):
    process = ds.DualStreamExpertsState()
    side = npu.Stream()

    def no_wait(hidden_states, forward_func):
        with npu.stream(side):
            return forward_func(hidden_states)

    monkeypatch.setattr(process, "process_shared_expert", no_wait)
    monkeypatch.setattr(process, "wait_share_stream", lambda: npu.current_stream().wait_stream(side))
    with _sanitizer.sanitize() as san:
        with torch.no_grad():
            hidden = torch.randn(SMALL["tokens"], SMALL["hidden"]) * 2  # written on main
            moe_layer(process, block, hidden)
    assert kinds(san) == ["read-after-write"], san.reports


# -- a block reused across streams (the record_stream rule) ---------------------------------------

def _shared_output_used_on_main_then_freed(npu, side, record=False, wait=False):
    main = npu.current_stream()
    hidden = torch.randn(4, 4)
    side.wait_stream(main)
    with npu.stream(side):
        out = hidden * 2            # allocated on the side stream
    main.wait_stream(side)
    out.add_(hidden)                # used on main
    if record:
        out.record_stream(main)
    del out                         # freed: back to the side stream's pool
    if wait:
        side.wait_stream(main)


def test_a_block_reused_across_streams_is_reported_and_record_stream_or_a_wait_fixes_it(npu):
    side, other_main = npu.Stream(), npu.Stream()
    for record, wait, expected in ((False, False, ["unsafe-reuse"]), (True, False, []), (False, True, [])):
        with _sanitizer.sanitize() as san:
            _shared_output_used_on_main_then_freed(npu, side, record=record, wait=wait)
            with npu.stream(other_main):  # a second main stream feeds the same side stream
                side.wait_stream(other_main)
                with npu.stream(side):
                    torch.randn(4, 4) * 3   # the side stream's next allocation
        assert kinds(san) == expected, (record, wait, san.reports)
    (reuse,) = _reused(npu, side)
    assert reuse.streams == ("side-1", "main") and reuse.ops == ("mul", "add_", "randn"), reuse
    assert "record_stream(main)" in reuse.message and "freed at" in reuse.message


def _reused(npu, side):
    with _sanitizer.sanitize() as san:
        _shared_output_used_on_main_then_freed(npu, side)
        with npu.stream(side):
            torch.randn(4, 4)
    return san.reports


def test_an_allocation_from_the_other_pool_is_not_handed_the_block(npu):
    side = npu.Stream()
    with _sanitizer.sanitize() as san:
        _shared_output_used_on_main_then_freed(npu, side)
        with npu.stream(side):
            torch.empty(_sanitizer.SMALL_POOL_LIMIT + 1, dtype=torch.uint8)  # the large pool
    assert san.reports == []
    with npu.stream(side):
        pass


def test_a_storage_resized_to_nothing_is_a_free(npu):
    """How sglang releases a weight: ``untyped_storage().resize_(0)`` returns its block to the
    allocator while the tensor object lives on."""
    weight = torch.randn(64)  # allocated before the sanitizer: on the default stream
    side = npu.Stream()
    with _sanitizer.sanitize() as san:
        side.wait_stream(npu.current_stream())
        with npu.stream(side):
            weight * 2              # read on the side stream
        weight.untyped_storage().resize_(0)
        torch.empty(8)              # the main stream's next allocation
    assert kinds(san) == ["unsafe-reuse"], san.reports
    weight = torch.randn(64)
    with _sanitizer.sanitize() as san:
        weight * 2                  # read on the main stream only
        weight.untyped_storage().resize_(0)
        torch.empty(8)
    assert san.reports == []


# -- happens-before edges ---------------------------------------------------------------------------

def _write_on_side_read_on_main(npu, sync):
    side = npu.Stream()
    x = torch.zeros(4)
    side.wait_stream(npu.current_stream())
    with npu.stream(side):
        x.add_(1)
        event = npu.Event()
        event.record()
    sync(side, event)
    return x.sum()


@pytest.mark.parametrize("sync, clean", [
    (lambda side, ev: None, False),
    (lambda side, ev: torch.npu.current_stream().wait_stream(side), True),
    (lambda side, ev: torch.npu.current_stream().wait_event(ev), True),
    (lambda side, ev: ev.wait(), True),
    (lambda side, ev: ev.synchronize(), True),
    (lambda side, ev: side.synchronize(), True),
    (lambda side, ev: torch.npu.synchronize(), True),
    (lambda side, ev: torch.npu.current_stream().wait_event(torch.npu.Event()), False),  # never recorded
], ids=["none", "wait_stream", "wait_event", "event.wait", "event.synchronize", "stream.synchronize",
        "device.synchronize", "unrecorded-event"])
def test_each_synchronisation_orders_the_streams(npu, sync, clean):
    with _sanitizer.sanitize() as san:
        _write_on_side_read_on_main(npu, sync)
    assert kinds(san) == ([] if clean else ["read-after-write"]), san.reports


def test_an_event_recorded_before_the_write_does_not_cover_it(npu):
    side = npu.Stream()
    with _sanitizer.sanitize() as san:
        x = torch.zeros(4)
        side.wait_stream(npu.current_stream())
        event = side.record_event()
        with npu.stream(side):
            x.add_(1)
        npu.current_stream().wait_event(event)
        x.sum()
    assert kinds(san) == ["read-after-write"], san.reports


def test_waiting_on_a_stream_as_if_it_were_an_event_raises_and_makes_no_edge(npu):
    """What sglang's npu_mla_preprocess does on its alt stream path
    (``current_stream().wait_event(m.alt_stream)``): torch-npu's Stream.wait_event calls
    ``event.wait(self)``, which a Stream lacks."""
    side = npu.Stream()
    with _sanitizer.sanitize() as san:
        x = torch.zeros(4)
        side.wait_stream(npu.current_stream())
        with npu.stream(side):
            x.add_(1)
        with pytest.raises(AttributeError, match="wait"):
            npu.current_stream().wait_event(side)
        x.sum()
    assert kinds(san) == ["read-after-write"], san.reports


def test_reports_are_counted_not_repeated(npu):
    side = npu.Stream()
    with _sanitizer.sanitize() as san:
        x = torch.zeros(4)
        side.wait_stream(npu.current_stream())
        for _ in range(3):
            with npu.stream(side):
                x.add_(1)
            x.add_(1)
    (race,) = [r for r in san.reports if r.kind == "write-after-write" and r.streams == ("side-1", "main")]
    assert race.count == 3, san.reports


# -- the declared stand-in kernels -------------------------------------------------------------------

def _declared_calls():
    """One call of each declared stand-in with arguments of the shapes its callers pass."""
    t, h, d = 3, 4, 16
    x = torch.randn(t, (h + 2 * 2) * d)
    sin, cos = torch.randn(t, 8), torch.randn(t, 8)
    w = torch.ones(d)
    cache = torch.randn(8, d)  # cos | sin halves per position
    k = dual_stream_kernels
    yield k.split_qkv_rmsnorm_rope, (x, sin, cos, h * d, 2 * d, d), dict(eps=1e-6, q_weight=w, k_weight=w)
    yield k.split_qkv_rmsnorm_rope_full_head, (x, sin, cos, h * d, 2 * d, d), dict(eps=1e-6, q_weight=w, k_weight=w)
    yield k.npu_rms_norm, (torch.randn(t, d), w), {}
    yield (k.npu_mrope, (torch.arange(t), torch.randn(t, h * d), torch.randn(t, 2 * d), cache, d),
           dict(mrope_section=[0, 0, 0]))
    m = mla_kernels
    yield m.npu_interleave_rope, (torch.randn(t, 1, 1, 8), cos, sin), {}
    yield m.npu_format_cast, (torch.randn(4, 4), 29), {}
    latent, gamma = torch.randn(t, 1, 1, 24), torch.ones(16)
    yield m.npu_kv_rmsnorm_rope_cache, (latent, gamma, cos, sin, torch.arange(t), torch.zeros(8, 8),
                                         torch.zeros(8, 16)), dict(epsilon=1e-6)


def test_every_declared_stand_in_keeps_to_its_real_schema(npu):
    for fn, args, kwargs in _declared_calls():
        with _sanitizer.sanitize() as san:
            fn(*args, **kwargs)
        assert san.reports == [], (fn.__name__, san.reports)
        assert san.launches == 1, (fn.__name__, "one kernel, whatever it runs inside")


def test_an_in_place_real_kernel_writes_here_too(npu):
    """npu_kv_rmsnorm_rope_cache scatters into both caches: a read of a cache on another stream
    races with it, as on a device."""
    side = npu.Stream()
    t, cos, sin = 3, torch.randn(3, 8), torch.randn(3, 8)
    k_cache, ckv_cache = torch.zeros(8, 8), torch.zeros(8, 16)
    with _sanitizer.sanitize() as san:
        side.wait_stream(npu.current_stream())
        with npu.stream(side):
            mla_kernels.npu_kv_rmsnorm_rope_cache(torch.randn(t, 1, 1, 24), torch.ones(16), cos, sin,
                                                   torch.arange(t), k_cache, ckv_cache)
        ckv_cache.sum()  # attention reading the cache on main, no wait
    assert kinds(san) == ["read-after-write"], san.reports
    assert san.reports[0].ops == ("npu_kv_rmsnorm_rope_cache", "sum")


def test_a_stand_in_that_breaks_its_schema_is_reported(npu):
    @_sanitizer.declare_kernel("npu_interleave_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", "a test")
    def writes_its_input(x, cos, sin, **kw):
        return x.mul_(2)  # in place where the real op is functional; returns its input

    with _sanitizer.sanitize() as san:
        writes_its_input(torch.randn(2, 2), torch.randn(2), torch.randn(2))
        writes_its_input(torch.randn(2, 2), torch.randn(2), torch.randn(2), scale=1.0)
    messages = [r.message for r in san.reports]
    assert kinds(san) == ["stand-in-mismatch"], san.reports
    assert any("writes its argument x, which the real op only reads" in m for m in messages), messages
    assert any("returns (output 0) memory of its argument x" in m for m in messages), messages
    assert any("is called with scale" in m for m in messages), messages


def test_a_declared_stand_in_keeps_its_signature_and_source_for_the_kernel_check():
    from npu_shim.patches.dual_stream_experts import loaded_kernel_support
    from npu_shim.source.reading import unwrap

    kernel = dual_stream_kernels.split_qkv_rmsnorm_rope
    problem, partial = loaded_kernel_support(kernel)
    assert problem is None and partial is True
    assert unwrap(kernel) is not kernel and kernel.declared.name == "split_qkv_rmsnorm_rope"


# -- the sanitizer itself ----------------------------------------------------------------------------

def test_sanitizer_restores_torch_and_never_initialises_the_device(npu):
    record, resize = torch.Tensor.record_stream, torch.UntypedStorage.resize_
    assert not npu.is_initialized()
    with _sanitizer.sanitize() as san:
        torch.randn(3).sum()
        with pytest.raises(RuntimeError, match="already running"):
            _sanitizer.Sanitizer().enable()
    assert not npu.is_initialized()  # zbal's allocator switch must still be possible
    assert torch.Tensor.record_stream is record and torch.UntypedStorage.resize_ is resize
    assert _sanitizer.active() is None and san.on_event not in _sanitizer._log.LISTENERS
    with pytest.raises(RuntimeError, match="unknown parameter type"):
        torch.randn(2).record_stream(npu.Stream())  # outside the sanitizer: as before


def test_assert_clean_names_every_report(npu):
    side = npu.Stream()
    with _sanitizer.sanitize() as san:
        x = torch.zeros(2)
        with npu.stream(side):
            x.add_(1)
    with pytest.raises(_sanitizer.SanitizerError, match="1 stream sanitizer report"):
        san.assert_clean()


# -- the CUDA Sanitizer cross-check's cases (scripts/csan_dual_stream.py) ----------------------------

@pytest.mark.parametrize("name", sorted(csan_check.OURS))
def test_the_csan_cross_checks_cases_report_here_what_it_expects(npu, name):
    block, hidden = csan_check.build("cpu")
    with _sanitizer.sanitize() as san, torch.no_grad():
        csan_check.run_case(name, torch.npu, block, hidden)
    assert kinds(san) == csan_check.OURS[name], san.reports


def test_the_csan_cross_check_says_plainly_when_there_is_no_cuda_device(capsys):
    available, why = csan_check.cuda_available()
    if available:  # a machine with a device runs it for real (not from the test suite)
        assert why
        return
    assert csan_check.main([], "unused") == 2
    assert capsys.readouterr().out == "not run: %s (this cross-check needs a CUDA device)\n" % why


def _dsa_calls():
    """One small call of each stand-in of the DSA decode path (simnpu/_ops/) declared to the
    sanitizer, as sglang 0.5.11 calls it."""
    from shimdev.simnpu import _ops

    k = _ops.kernel
    t, heads, dim, rope, kv_lora, page = 3, 2, 8, 4, 8, 4
    cos, sin = torch.randn(t, 1, 1, dim), torch.randn(t, 1, 1, dim)
    yield k("npu_rotary_mul"), (torch.randn(t, heads, 1, dim), cos, sin), {}
    yield k("npu_interleave_rope"), (torch.randn(t, heads, 1, dim), cos, sin), {}
    blocks = dict(block_table=torch.tensor([[0, 1], [2, 3], [1, 0]], dtype=torch.int32),
                  actual_seq_lengths_query=torch.tensor([1, 2, 3], dtype=torch.int32))
    keys = torch.randn(4, page, 1, dim)
    indices, _ = _ops.npu_lightning_indexer(
        torch.randn(t, heads, dim), keys, torch.randn(t, heads), actual_seq_lengths_key=torch.tensor(
            [5, 3, 2], dtype=torch.int32), layout_query="TND", layout_key="PA_BSND", sparse_count=4, **blocks)
    yield k("npu_lightning_indexer"), (torch.randn(t, heads, dim), keys, torch.randn(t, heads)), dict(
        actual_seq_lengths_key=torch.tensor([5, 3, 2], dtype=torch.int32), layout_query="TND",
        layout_key="PA_BSND", sparse_count=4, **blocks)
    latent = torch.randn(4, page, 1, kv_lora)
    yield k("npu_sparse_flash_attention"), (torch.randn(t, heads, kv_lora), latent, latent, indices, 0.5), dict(
        actual_seq_lengths_kv=torch.tensor([5, 3, 2], dtype=torch.int32), query_rope=torch.randn(t, heads, rope),
        key_rope=torch.randn(4, page, 1, rope), layout_query="TND", layout_kv="PA_BSND", attention_mode=2,
        **blocks)
    int8 = dict(dtype=torch.int8)
    yield k("npu_quant_matmul"), (torch.randint(-4, 4, (t, 8), **int8), torch.randint(-4, 4, (8, 6), **int8),
                                  torch.rand(6)), dict(pertoken_scale=torch.rand(t), output_dtype=torch.bfloat16)
    yield k("npu_dynamic_quant"), (torch.randn(t, 8),), {}
    hidden, q_lora = 16, 8
    yield k("npu_mla_prolog_v3"), (
        torch.randn(t, hidden).bfloat16(), torch.randn(hidden, q_lora).bfloat16(),
        torch.randint(-4, 4, (q_lora, heads * (dim + rope)), **int8), torch.randn(heads, dim, kv_lora).bfloat16(),
        torch.randn(hidden, kv_lora + rope).bfloat16(), torch.ones(q_lora).bfloat16(),
        torch.ones(kv_lora).bfloat16(), torch.randn(t, rope).bfloat16(), torch.randn(t, rope).bfloat16(),
        torch.zeros(4, page, 1, kv_lora).bfloat16(), torch.zeros(4, page, 1, rope).bfloat16()), dict(
        cache_index=torch.arange(t), dequant_scale_w_uq_qr=torch.rand(1, heads * (dim + rope)),
        query_norm_flag=True, weight_quant_mode=1)
    yield k("batch_matmul_transpose"), (torch.randn(t, heads, kv_lora), torch.randn(heads, kv_lora, dim),
                                        torch.empty(t, heads, dim)), {}


def _speculative_calls():
    """What an EAGLE / NextN server's verify and draft-extend batches call on NPU (a real 0.5.8
    server runs them: tests/test_real_server_moe.py)."""
    from shimdev.simnpu import _ops

    k = _ops.kernel
    heads, kv_heads, dim, page = 4, 2, 8, 4
    cache = torch.randn(3, page, kv_heads * dim)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    yield k("npu_fused_infer_attention_score"), (torch.randn(4, heads, dim), cache, cache), dict(
        block_table=torch.tensor([[0, 1], [2, 0]], dtype=torch.int32), block_size=page, num_heads=heads,
        num_key_value_heads=kv_heads, input_layout="TND", atten_mask=mask, scale=0.5,
        actual_seq_lengths=[2, 4], actual_seq_lengths_kv=[6, 3], sparse_mode=3)
    bs, n = 2, 2
    yield k("build_tree_kernel_efficient"), (
        torch.zeros(bs, 1, dtype=torch.int64), torch.zeros(bs, n - 1, dtype=torch.int64),
        torch.tensor([5, 7]), torch.ones(12 * n + bs * n * n, dtype=torch.bool),
        torch.empty(bs * n, dtype=torch.int64), torch.full((bs, n), -1), torch.full((bs, n), -1),
        torch.full((bs, n), -1), 1, 1, n, 0), {}


def test_the_dsa_and_speculative_stand_ins_keep_to_their_real_schemas(npu):
    """What sglang's DSA decode path calls (a real 0.5.11 server runs them: tests/test_real_server_mla.py)
    and its NPU speculative decoding (0.5.8: tests/test_real_server_moe.py) is declared with the real
    op's schema: in place only where it says ``(a!)`` -- or, for build_tree_kernel_efficient, whose
    registered string marks nothing, on its five output buffers (``SANITIZER_WRITES``)."""
    from shimdev.simnpu import _ops

    seen = []
    for fn, args, kwargs in [*_dsa_calls(), *_speculative_calls()]:
        seen.append(fn.declared.name.split("::")[-1])
        with _sanitizer.sanitize() as san:
            fn(*args, **kwargs)
        assert san.reports == [], (fn.__name__, san.reports)
        assert san.launches == 1, fn.__name__
    assert sorted(seen) == sorted(list(_ops.DECLARED) + list(_ops.CUSTOM_SCHEMAS)
                                  + list(_ops.SGL_KERNEL_NPU_SCHEMAS))
    prolog = _ops.kernel("npu_mla_prolog_v3").declared
    assert prolog.writes("kv_cache") and prolog.writes("kr_cache") and not prolog.writes("token_x")
    assert _ops.kernel("batch_matmul_transpose").declared.writes("tensor_c")
    tree = _ops.kernel("build_tree_kernel_efficient").declared
    assert [a for a in _ops.SANITIZER_WRITES["build_tree_kernel_efficient"] if not tree.writes(a)] == []
    assert not tree.writes("parent_list") and not tree.writes("selected_index")
