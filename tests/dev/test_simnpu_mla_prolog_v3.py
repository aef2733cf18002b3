"""``torch_npu.npu_mla_prolog_v3`` in the simulation: the op sglang 0.5.20+'s mlaprolog path calls
(``NPUFusedMLAPreprocess.forward_mlaprolog``), where 0.5.9 - 0.5.19 call the CANN custom-ops
package's ``torch.ops.custom.npu_mla_prolog_v3``.  Held to the real torch-npu 2.13.0 wheel: the
name torch_npu binds, the schema libtorch_npu.so registers, the parameters of the wheel's meta
function; then the op through ``torch_npu`` as 0.5.20 calls it, its shape checks, and the op in an
NPU graph (recorded at capture, run at replay)."""
from __future__ import annotations

import ast
import inspect

import pytest
import torch

from shimdev.simnpu import _ops
from tests.dev.test_simnpu_graphs import run

PAGE = 4
T, HIDDEN, Q_LORA, HEADS, NOPE, ROPE, KV_LORA = 2, 8, 4, 2, 3, 2, 4


def _schema_parameters(schema):
    """(name, default or None) of each argument of a schema string, in order."""
    out = []
    for arg in schema[1:schema.index(") ->")].split(", "):
        if arg == "*":
            continue
        decl, _, default = arg.partition("=")
        out.append((decl.split()[-1], default or None))
    return out


def test_torch_npu_binds_the_op_under_that_name_with_the_wheel_s_schema(wheel):
    """torch_npu/utils/custom_ops.py binds ``torch_npu.npu_mla_prolog_v3`` to
    ``torch.ops.npu.npu_mla_prolog_v3``; libtorch_npu.so registers the schema the simulation
    defines, whose arguments (names, order, defaults) are the wheel's meta function's."""
    binds = (wheel / "torch_npu" / "utils" / "custom_ops.py").read_text()
    assert "torch_npu.npu_mla_prolog_v3 = torch.ops.npu.npu_mla_prolog_v3\n" in binds
    schema = _ops.NPU_SCHEMAS["npu_mla_prolog_v3"]
    assert schema == _ops.NPU_MLA_PROLOG_V3
    assert ("npu_mla_prolog_v3" + schema).encode() in (wheel / "torch_npu" / "lib" / "libtorch_npu.so").read_bytes()
    meta = ast.parse((wheel / "torch_npu" / "op_plugin" / "meta" / "_meta_registrations.py").read_text())
    fn = next(n for n in ast.walk(meta) if isinstance(n, ast.FunctionDef) and n.name == "npu_mla_prolog_v3_forward")
    names = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
    assert names == [name for name, _ in _schema_parameters(schema)]
    defaults = {a.arg: ast.literal_eval(d) for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is not None}
    for name, default in _schema_parameters(schema):
        if default is not None and default != "None":
            assert ast.literal_eval(default) == defaults[name], name
    # the Python stand-in takes exactly these parameters (the dtype ones too)
    assert list(inspect.signature(_ops.npu_mla_prolog_v3).parameters) == names


def _operands(quant_mode=1, **change):
    torch.manual_seed(4)
    args = dict(
        token_x=torch.randn(T, HIDDEN).bfloat16(), weight_dq=torch.randn(HIDDEN, Q_LORA).bfloat16(),
        weight_uq_qr=(torch.randint(-4, 4, (Q_LORA, HEADS * (NOPE + ROPE)), dtype=torch.int8) if quant_mode
                      else torch.randn(Q_LORA, HEADS * (NOPE + ROPE)).bfloat16()),
        weight_uk=torch.randn(HEADS, NOPE, KV_LORA).bfloat16(),
        weight_dkv_kr=torch.randn(HIDDEN, KV_LORA + ROPE).bfloat16(), rmsnorm_gamma_cq=torch.ones(Q_LORA).bfloat16(),
        rmsnorm_gamma_ckv=torch.ones(KV_LORA).bfloat16(), rope_sin=torch.randn(T, ROPE).bfloat16(),
        rope_cos=torch.randn(T, ROPE).bfloat16(), kv_cache=torch.zeros(3, PAGE, 1, KV_LORA).bfloat16(),
        kr_cache=torch.zeros(3, PAGE, 1, ROPE).bfloat16(), cache_index=torch.tensor([5, 9]),
        query_norm_flag=True, weight_quant_mode=quant_mode)
    if quant_mode:
        args["dequant_scale_w_uq_qr"] = torch.rand(1, HEADS * (NOPE + ROPE))
    args.update(change)
    return args


def test_the_outputs_are_shaped_as_the_meta_function_makes_them():
    """0.5.20's W8A8 call (mode 1, ``query_norm_flag``): the query ``[T, N, kv_lora]``, its rope
    part ``[T, N, rope]``, an empty ``dequant_scale_q_nope`` (CANN >= 8.5), the INT8 query norm
    ``[T, q_lora]`` and its per-token float32 scale ``[T, 1]`` (0.5.20 views it as ``[T]``).
    Mode 0 (bf16 q_b_proj): the norm in W_uq_qr's dtype, its scale empty; without the flag both
    are empty."""
    q, q_pe, scale_q_nope, norm, norm_scale = _ops.npu_mla_prolog_v3(**_operands())
    assert q.shape == (T, HEADS, KV_LORA) and q_pe.shape == (T, HEADS, ROPE)
    assert scale_q_nope.numel() == 0
    assert norm.shape == (T, Q_LORA) and norm.dtype == torch.int8
    assert norm_scale.shape == (T, 1) and norm_scale.dtype == torch.float32
    _, _, _, norm, norm_scale = _ops.npu_mla_prolog_v3(**_operands(quant_mode=0))
    assert norm.shape == (T, Q_LORA) and norm.dtype == torch.bfloat16 and norm_scale.numel() == 0
    _, _, _, norm, norm_scale = _ops.npu_mla_prolog_v3(**_operands(query_norm_flag=False))
    assert norm.numel() == 0 and norm.dtype == torch.int8 and norm_scale.numel() == 0


@pytest.mark.parametrize("change, message", [
    (dict(weight_uk=torch.randn(HEADS * NOPE, KV_LORA)), "weight_uk dim num should be 3"),
    (dict(token_x=torch.randn(1, T, HIDDEN), rope_sin=torch.randn(T, ROPE)),
     "when token_x dim num is 3, rope_sin dim num should be 3"),
    (dict(kv_cache=None), "kv_cache should not be None"),
    (dict(weight_dq=torch.randn(HIDDEN + 1, Q_LORA)), r"weight_dq has shape \(9, 4\)"),
    (dict(weight_dkv_kr=torch.randn(HIDDEN, KV_LORA)), "weight_dkv_kr has shape"),
    (dict(rope_cos=torch.randn(T + 1, ROPE)), "rope_cos has shape"),
    (dict(rmsnorm_gamma_ckv=torch.ones(KV_LORA + 1)), "rmsnorm_gamma_ckv has shape"),
    (dict(cache_index=torch.tensor([5])), "one cache_index per token"),
    (dict(kr_cache=torch.zeros(3, PAGE, 1, ROPE + 1)), "kr_cache .* last dim should be 2"),
    (dict(dequant_scale_w_uq_qr=None), "weight_quant_mode 1 takes a per-channel dequant_scale_w_uq_qr"),
])
def test_operands_that_disagree_are_refused_by_name(change, message):
    with pytest.raises(RuntimeError, match=message):
        _ops.npu_mla_prolog_v3(**_operands(**change))


@pytest.mark.parametrize("change", [dict(token_x_dtype=1), dict(kv_cache_dtype=1), dict(ckvkr_repo_mode=1),
                                    dict(weight_quant_mode=3), dict(cache_mode="PA_NZ"),
                                    dict(token_x=torch.randn(1, T, HIDDEN), rope_sin=torch.randn(1, T, ROPE))])
def test_what_sglang_s_bf16_and_w8a8_paths_never_pass_is_not_simulated(change):
    with pytest.raises(NotImplementedError, match="simnpu"):
        _ops.npu_mla_prolog_v3(**_operands(**change))


def test_both_namespaces_are_declared_to_the_sanitizer_with_their_own_schema():
    npu, custom = _ops.kernel("npu_mla_prolog_v3", "npu").declared, _ops.kernel("npu_mla_prolog_v3", "custom").declared
    for declared in (npu, custom):
        assert declared.writes("kv_cache") and declared.writes("kr_cache") and not declared.writes("token_x")
    assert [a.name for a in npu.schema.arguments][-5:] == ["token_x_dtype", "weight_dq_dtype", "weight_uq_qr_dtype",
                                                          "weight_dkv_kr_dtype", "kv_cache_dtype"]
    assert [a.name for a in custom.schema.arguments][-1] == "kc_scale"
    assert (npu.source, custom.source) == (_ops.SOURCES["npu"], _ops.SOURCES["custom"])


def test_torch_npu_s_op_is_0_5_20_s_call_equal_to_the_custom_op_and_replays_in_a_graph():
    """In a server's simulated NPU: ``torch_npu.npu_mla_prolog_v3`` is ``torch.ops.npu``'s op and
    parses 0.5.20's keywords; it computes what ``torch.ops.custom``'s does.  Captured in an NPU
    graph it is recorded, not run (the caches untouched at capture); each replay after new
    hidden states and slots are copied in writes the caches and outputs the eager call does."""
    out = run("""
    torch.manual_seed(5)
    t, hidden, q_lora, heads, nope, rope, kv_lora, page = 2, 8, 4, 2, 3, 2, 4, 4
    dev = dict(device="npu")
    w = dict(weight_dq=torch.randn(hidden, q_lora, **dev).bfloat16(),
             weight_uq_qr=torch.randint(-4, 4, (q_lora, heads * (nope + rope)), dtype=torch.int8, **dev),
             weight_uk=torch.randn(heads, nope, kv_lora, **dev).bfloat16(),
             weight_dkv_kr=torch.randn(hidden, kv_lora + rope, **dev).bfloat16(),
             rmsnorm_gamma_cq=torch.ones(q_lora, **dev).bfloat16(),
             rmsnorm_gamma_ckv=torch.ones(kv_lora, **dev).bfloat16(),
             rope_sin=torch.randn(t, rope, **dev).bfloat16(), rope_cos=torch.randn(t, rope, **dev).bfloat16())
    scale = torch.rand(1, heads * (nope + rope), **dev)
    x = torch.randn(t, hidden, **dev).bfloat16()
    slots = torch.tensor([1, 6], **dev)
    def caches():
        return (torch.zeros(4, page, 1, kv_lora, **dev).bfloat16(),
                torch.zeros(4, page, 1, rope, **dev).bfloat16())

    def call(op, x, kv, kr, slots):
        return op(token_x=x, kv_cache=kv, kr_cache=kr, cache_index=slots, dequant_scale_w_uq_qr=scale,
                  rmsnorm_epsilon_cq=1e-6, rmsnorm_epsilon_ckv=1e-6, cache_mode="PA_BSND", query_norm_flag=True,
                  weight_quant_mode=1, **w)

    rows = {"bound": torch_npu.npu_mla_prolog_v3 is torch.ops.npu.npu_mla_prolog_v3}
    kv1, kr1 = caches()
    kv2, kr2 = caches()
    a = call(torch_npu.npu_mla_prolog_v3, x, kv1, kr1, slots)
    b = call(torch.ops.custom.npu_mla_prolog_v3, x, kv2, kr2, slots)
    rows["same_as_custom"] = (all(torch.equal(p, q) for p, q in zip(a, b))
                              and torch.equal(kv1, kv2) and torch.equal(kr1, kr2))

    kv, kr = caches()
    static_x, static_slots = x.clone(), slots.clone()
    s = torch.npu.Stream()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, pool=torch.npu.graph_pool_handle(), stream=s):
        outs = call(torch_npu.npu_mla_prolog_v3, static_x, kv, kr, static_slots)
    rows["caches_untouched_at_capture"] = bool(kv.abs().sum() == 0 and kr.abs().sum() == 0)
    rows["replays"] = []
    for new_slots in ([3, 12], [0, 7]):
        new_x = torch.randn(t, hidden, **dev).bfloat16()
        static_x.copy_(new_x)
        static_slots.copy_(torch.tensor(new_slots, **dev))
        g.replay()
        ekv, ekr = caches()
        want = call(torch_npu.npu_mla_prolog_v3, new_x, ekv, ekr, torch.tensor(new_slots, **dev))
        rows["replays"].append(all(torch.equal(o, e) for o, e in zip(outs, want))
                               and torch.equal(kv.view(-1, kv_lora)[new_slots], ekv.view(-1, kv_lora)[new_slots])
                               and torch.equal(kr.view(-1, rope)[new_slots], ekr.view(-1, rope)[new_slots]))
    print(json.dumps(rows))
    """)
    assert out == {"bound": True, "same_as_custom": True, "caches_untouched_at_capture": True,
                   "replays": [True, True]}, out
