"""Simulated Ascend MLA kernels and a synthetic MLA attention layer, for the mla_weight_release tests.

Only what sglang's NPU MLA path calls on the device is simulated, in pure torch on CPU, and every
call is recorded in ``CALLS`` (name, {argument: shape or value}) so a test can see which tensors a
kernel really read:

* ``torch.ops.custom.npu_mla_prolog_v3`` (0.5.9 - 0.5.19 ``forward_mlaprolog``): q = rmsnorm(x @ W_dq)
  @ dequant(W_uq_qr); q_nope absorbed through ``weight_uk``; ckv = x @ W_dkv_kr, normed and written
  to the caches at ``cache_index``.  Returns (q_nope, q_pe, dequant_scale_q_nope, qr, dequant_q_norm).
* ``torch_npu.npu_format_cast`` (ND -> NZ): a copy with its own memory, as on a device;
* ``torch.ops.npu.npu_interleave_rope`` and ``torch.ops.npu.npu_kv_rmsnorm_rope_cache`` (the
  non-mlaprolog ``forward_absorb_prepare_npu_rms_norm_cache``).

``build_attention`` makes a layer with every attribute ``npu_mla_preprocess`` /
``NPUFusedMLAPreprocess`` read, shaped from the public model configs (``CONFIGS``) for a TP size, with
``w_kc`` laid out as sglang's weight loader leaves it (``transpose(1, 2).contiguous().transpose(1, 2)``)
and the fused qkv_a weight as a ``[q_lora + kv_lora + rope, hidden]`` Parameter.  ``make_batch`` gives
hidden states, positions and a forward batch (with the attention backend / KV pool each release reads).

Each kernel is declared (``simnpu.declare_kernel``) with the schema of the real op, so the stream
sanitizer sees its reads and writes: Ascend/op-plugin's ``op_plugin/config/op_plugin_functions.yaml``
(read at 517f2e7, 2026-08-21) for the custom ops, torch_npu's
``torch_npu/csrc/aten/npu_native_functions.yaml`` (Ascend/pytorch, read at 9e73e70) for
``npu_format_cast``.  ``npu_mla_prolog_v3`` writes ``kv_cache`` / ``kr_cache`` in place (``Tensor(a!)``
there).  ``npu_kv_rmsnorm_rope_cache`` is in-place too, though its registered schema does not say
so: the op scatters into both caches and returns them ("in-place update", torch_npu's documentation
of the op), and op-plugin's ``npu_kv_rmsnorm_rope_cache_v2`` marks the same two arguments
``Tensor(a!)`` / ``Tensor(b!)``; the declaration here follows what the kernel does.  (A sanitizer on
a device that reads the registered schema would miss those writes.)
"""
from __future__ import annotations

import contextlib
import types

import torch

from shimdev.simnpu import declare_kernel

OP_PLUGIN = "Ascend/op-plugin op_plugin/config/op_plugin_functions.yaml"
TORCH_NPU = "Ascend/pytorch torch_npu/csrc/aten/npu_native_functions.yaml"
MLA_PROLOG_V3 = (
    "npu_mla_prolog_v3(Tensor token_x, Tensor weight_dq, Tensor weight_uq_qr, Tensor weight_uk, "
    "Tensor weight_dkv_kr, Tensor rmsnorm_gamma_cq, Tensor rmsnorm_gamma_ckv, Tensor rope_sin, "
    "Tensor rope_cos, Tensor(a!) kv_cache, Tensor(b!) kr_cache, *, Tensor? cache_index=None, "
    "Tensor? dequant_scale_x=None, Tensor? dequant_scale_w_dq=None, Tensor? dequant_scale_w_uq_qr=None, "
    "Tensor? dequant_scale_w_dkv_kr=None, Tensor? quant_scale_ckv=None, Tensor? quant_scale_ckr=None, "
    "Tensor? smooth_scales_cq=None, Tensor? actual_seq_len=None, Tensor? k_nope_clip_alpha=None, "
    "float rmsnorm_epsilon_cq=1e-05, float rmsnorm_epsilon_ckv=1e-05, str cache_mode=\"PA_BSND\", "
    "bool query_norm_flag=False, int weight_quant_mode=0, int kv_cache_quant_mode=0, "
    "int query_quant_mode=0, int ckvkr_repo_mode=0, int quant_scale_repo_mode=0, int tile_size=128, "
    "float qc_qr_scale=1.0, float kc_scale=1.0, int? token_x_dtype=None, int? weight_dq_dtype=None, "
    "int? weight_uq_qr_dtype=None, int? weight_dkv_kr_dtype=None, int? kv_cache_dtype=None) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")
# The registered schema's argument list, with the two caches marked as written and returned as
# the op documents (see the module docstring).
KV_RMSNORM_ROPE_CACHE = (
    "npu_kv_rmsnorm_rope_cache(Tensor kv, Tensor gamma, Tensor cos, Tensor sin, Tensor index, "
    "Tensor(a!) k_cache, Tensor(b!) ckv_cache, *, Tensor? k_rope_scale=None, Tensor? c_kv_scale=None, "
    "Tensor? k_rope_offset=None, Tensor? c_kv_offset=None, Tensor? v=None, float epsilon=1e-5, "
    "str cache_mode='Norm', bool is_output_kv=False) -> (Tensor(a!), Tensor(b!), Tensor, Tensor)")

CALLS: list = []

#: Public model configs (transformers' DeepseekV3Config / GlmMoeDsaConfig defaults; DeepSeek-V3.2
#: has DeepSeek-V3's attention shapes).
CONFIGS = {
    "deepseek-v3": dict(hidden=7168, heads=128, q_lora=1536, kv_lora=512, nope=128, rope=64,
                        v_head=128, layers=61),
    "glm-5": dict(hidden=6144, heads=64, q_lora=2048, kv_lora=512, nope=192, rope=64,
                  v_head=256, layers=78),
}
DTYPE = torch.bfloat16


def _desc(value):
    if isinstance(value, torch.Tensor):
        return list(value.shape)
    return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)


def _rms(x, gamma, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()).to(x.dtype)


@declare_kernel(MLA_PROLOG_V3, OP_PLUGIN)
def npu_mla_prolog_v3(**kw):
    CALLS.append(("npu_mla_prolog_v3", {k: _desc(v) for k, v in kw.items()}))
    x = kw["token_x"]
    w_dq, w_uq, w_uk, w_dkv = kw["weight_dq"], kw["weight_uq_qr"], kw["weight_uk"], kw["weight_dkv_kr"]
    heads, nope, kv_lora = w_uk.shape
    rope = kw["rope_sin"].shape[-1]
    cq = _rms(x @ w_dq, kw["rmsnorm_gamma_cq"], kw["rmsnorm_epsilon_cq"])
    scale = kw.get("dequant_scale_w_uq_qr")
    w_uq_f = w_uq.float() * (scale.float().view(1, -1) if scale is not None else 1.0)
    q = (cq.float() @ w_uq_f).view(x.shape[0], heads, nope + rope)
    q_nope = torch.einsum("thn,hnk->thk", q[..., :nope], w_uk.float()).to(x.dtype)
    q_pe = q[..., nope:].to(x.dtype)
    ckv = x @ w_dkv
    kv = _rms(ckv[..., :kv_lora], kw["rmsnorm_gamma_ckv"], kw["rmsnorm_epsilon_ckv"])
    k_cache, kr_cache, index = kw["kv_cache"], kw["kr_cache"], kw["cache_index"]
    k_cache.view(-1, kv_lora)[index] = kv.to(k_cache.dtype)
    kr_cache.view(-1, rope)[index] = ckv[..., kv_lora:].to(kr_cache.dtype)
    tokens = x.shape[0]
    return (q_nope, q_pe, torch.ones(tokens, heads, 1), cq, torch.ones(tokens, 1))


@declare_kernel("npu_interleave_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", OP_PLUGIN)
def npu_interleave_rope(q_pe, cos, sin):
    CALLS.append(("npu_interleave_rope", {"x": _desc(q_pe)}))
    return q_pe.clone()


@declare_kernel(KV_RMSNORM_ROPE_CACHE, OP_PLUGIN + " (v1's argument list; v2's write marks)")
def npu_kv_rmsnorm_rope_cache(latent, gamma, cos, sin, index, kr_cache, kv_cache, **kw):
    """Returns the two caches it updated in place, then (with ``is_output_kv``) the rope'd k and
    the normalised kv, as the op does."""
    CALLS.append(("npu_kv_rmsnorm_rope_cache", {"latent": _desc(latent), "gamma": _desc(gamma)}))
    kv_lora = gamma.shape[0]
    flat = latent.reshape(-1, latent.shape[-1])
    kv = _rms(flat[:, :kv_lora], gamma, kw.get("epsilon", 1e-6))
    kv_cache.view(-1, kv_lora)[index] = kv.to(kv_cache.dtype)
    kr_cache.view(-1, flat.shape[-1] - kv_lora)[index] = flat[:, kv_lora:].to(kr_cache.dtype)
    if not kw.get("is_output_kv"):
        return kr_cache, kv_cache, None, None
    tokens = flat.shape[0]
    return kr_cache, kv_cache, flat[:, kv_lora:].view(tokens, 1, 1, -1), kv.view(tokens, 1, 1, -1)


@declare_kernel("npu_format_cast(Tensor self, int acl_format, *, int? customize_dtype=None, "
                "int? input_dtype=None) -> Tensor", TORCH_NPU)
def npu_format_cast(tensor, acl_format=29, **kw):
    """ND -> NZ cast: on a device a new tensor with its own memory (never a view of the input)."""
    CALLS.append(("npu_format_cast", {"x": _desc(tensor), "format": acl_format}))
    return tensor.clone()


def install():
    """Put the simulated kernels where sglang calls them (idempotent)."""
    torch.ops.custom.npu_mla_prolog_v3 = npu_mla_prolog_v3
    torch.ops.npu.npu_interleave_rope = npu_interleave_rope
    torch.ops.npu.npu_kv_rmsnorm_rope_cache = npu_kv_rmsnorm_rope_cache
    try:
        import torch_npu  # the simnpu stub: give it real kernels too
    except ImportError:
        return
    torch_npu.npu_interleave_rope = npu_interleave_rope
    torch_npu.npu_kv_rmsnorm_rope_cache = npu_kv_rmsnorm_rope_cache
    # 0.5.9 - 0.5.11 call it for any tensor; 0.5.19 returns a CPU tensor as it is.
    torch_npu.npu_format_cast = npu_format_cast


# ------------------------------------------------------------------------------- the layer

class QuantMethod:
    """``quant_method`` of a linear layer; ``modelslim`` under ``attr`` makes it W8A8."""

    def __init__(self, modelslim_attr=None):
        if modelslim_attr:
            setattr(self, modelslim_attr, types.SimpleNamespace(get_name=lambda: "modelslim"))


class Linear(torch.nn.Module):
    """A replicated/column linear: ``weight`` [out, in]; returns (out, None) like sglang's."""

    def __init__(self, in_features, out_features, dtype=DTYPE, quant_method=None):
        super().__init__()
        self.input_size = in_features
        self.output_size = out_features
        self.weight = torch.nn.Parameter(
            (torch.randn(out_features, in_features) * 0.02).to(dtype), requires_grad=False)
        self.quant_method = quant_method or QuantMethod()

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), None


class QBProj(torch.nn.Module):
    """W8A8 q_b_proj as mlaprolog takes it: int8 ``weight`` [q_lora, out], per-channel scale."""

    def __init__(self, q_lora, out_features):
        super().__init__()
        self.input_size = q_lora
        self.weight = torch.nn.Parameter(torch.randint(-8, 8, (q_lora, out_features), dtype=torch.int8),
                                         requires_grad=False)
        self.weight_scale = torch.nn.Parameter(torch.full((out_features, 1), 0.01), requires_grad=False)

    def forward(self, x):
        return (x.float() @ (self.weight.float() * self.weight_scale.view(1, -1))).to(x.dtype), None


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=DTYPE), requires_grad=False)

    def forward(self, x):
        return _rms(x, self.weight, self.variance_epsilon)


class Rotary(torch.nn.Module):
    def __init__(self, rope, max_positions=64):
        super().__init__()
        self.cos_sin_cache = torch.randn(max_positions, rope, dtype=DTYPE)


class MLAAttention(torch.nn.Module):
    """The attributes of ``DeepseekV2AttentionMLA`` the NPU MLA path reads."""


def quant_config(mlaprolog=True, layers=(0,)):
    """A modelslim-style config; kv_b_proj in ``ignore`` is what selects mlaprolog."""
    ignore = ["model.layers.%d.mlp.gate" % i for i in layers]
    if mlaprolog:
        ignore += ["model.layers.%d.self_attn.kv_b_proj" % i for i in layers]
    return types.SimpleNamespace(ignore=ignore, get_name=lambda: "modelslim")


def build_attention(model="glm-5", tp=16, layer_id=0, mlaprolog=True, w8a8_attr=None,
                    w_kc_contiguous=False, alt_stream=False):
    """A synthetic MLA attention layer (real tensors) for ``model`` at attention TP size ``tp``;
    ``alt_stream``: with a second stream, as DeepseekV2Model gives its layers under
    ``SGLANG_NPU_USE_MULTI_STREAM=1``."""
    c = CONFIGS[model]
    heads = c["heads"] // tp
    m = MLAAttention()
    m.layer_id = layer_id
    m.num_local_heads = heads
    m.q_lora_rank, m.kv_lora_rank = c["q_lora"], c["kv_lora"]
    m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = c["nope"], c["rope"], c["v_head"]
    m.qk_head_dim = c["nope"] + c["rope"]
    m.fused_qkv_a_proj_with_mqa = Linear(
        c["hidden"], c["q_lora"] + c["kv_lora"] + c["rope"],
        quant_method=QuantMethod(modelslim_attr=w8a8_attr))
    m.q_a_layernorm = RMSNorm(c["q_lora"])
    m.kv_a_layernorm = RMSNorm(c["kv_lora"])
    m.q_b_proj = QBProj(c["q_lora"], heads * m.qk_head_dim)
    m.rotary_emb = Rotary(c["rope"])
    # As DeepseekV2WeightLoaderMixin.post_load_weights leaves them (kv_b_proj split per head).
    w = (torch.randn(heads * (c["nope"] + c["v_head"]), c["kv_lora"]) * 0.02).to(DTYPE)
    w_kc, w_vc = w.unflatten(0, (-1, c["nope"] + c["v_head"])).split([c["nope"], c["v_head"]], dim=1)
    if w_kc_contiguous:
        m.w_kc = w_kc.contiguous()  # a layout where NPUFusedMLAPreprocess would share it
    else:
        m.w_kc = w_kc.transpose(1, 2).contiguous().transpose(1, 2)
    m.w_vc = w_vc.contiguous().transpose(1, 2).contiguous()
    m.quant_config = quant_config(mlaprolog, layers=(layer_id,))
    m.alt_stream = torch.npu.Stream() if alt_stream else None
    return m


class KVPool:
    def __init__(self, kv_lora, rope, blocks=4, page=16):
        self.k = torch.zeros(blocks, page, 1, kv_lora, dtype=DTYPE)
        self.v = torch.zeros(blocks, page, 1, rope, dtype=DTYPE)
        self.index_head_dim = None

    def get_kv_buffer(self, layer_id):
        return self.k, self.v


def make_batch(model="glm-5", tokens=4):
    """(hidden_states, positions, forward_batch, context manager to enter around the call)."""
    c = CONFIGS[model]
    pool = KVPool(c["kv_lora"], c["rope"])
    backend = types.SimpleNamespace(token_to_kv_pool=pool, page_size=16, kv_lora_rank=c["kv_lora"],
                                    qk_rope_head_dim=c["rope"])
    batch = types.SimpleNamespace(out_cache_loc=torch.arange(tokens, dtype=torch.int64),
                                  token_to_kv_pool=pool, attn_backend=backend)
    hidden = (torch.randn(tokens, c["hidden"]) * 0.1).to(DTYPE)
    positions = torch.arange(tokens)
    return hidden, positions, batch, _forward_context(backend)


@contextlib.contextmanager
def _forward_context(backend):
    """0.5.19 reads the pool / backend from sglang's forward context; older ones from the batch."""
    try:
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    except ImportError:
        yield
        return
    with forward_context(ForwardContext(attn_backend=backend)):
        yield


# ------------------------------------------------------------------------------- in a release

MLA_NPU = "sglang.srt.hardware_backend.npu.modules.deepseek_v2_attention_mla_npu"
_MODEL_DIR = None


def _model_dir():
    """A local HF config (DeepSeek-V3 shapes) so ServerArgs can be built offline; removed when the
    process exits (every scenario process makes its own)."""
    global _MODEL_DIR
    if _MODEL_DIR is None:
        import atexit
        import json
        import os
        import shutil
        import tempfile

        _MODEL_DIR = tempfile.mkdtemp(prefix="mla-model-")
        atexit.register(shutil.rmtree, _MODEL_DIR, True)
        c = CONFIGS["deepseek-v3"]
        with open(os.path.join(_MODEL_DIR, "config.json"), "w") as f:
            json.dump({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                       "hidden_size": c["hidden"], "num_attention_heads": c["heads"],
                       "num_key_value_heads": c["heads"], "num_hidden_layers": c["layers"],
                       "q_lora_rank": c["q_lora"], "kv_lora_rank": c["kv_lora"],
                       "qk_nope_head_dim": c["nope"], "qk_rope_head_dim": c["rope"],
                       "v_head_dim": c["v_head"], "vocab_size": 129280,
                       "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}, f)
    return _MODEL_DIR


def publish_server_args(role, **fields):
    """Publish real ServerArgs with ``disaggregation_mode=role`` (and ``fields`` set on them) the
    way the scheduler does; ``role=None`` unpublishes them (the role cannot be known)."""
    from sglang.srt import server_args as S

    if role is None:
        try:
            from sglang.srt.runtime_context import reset_context
        except ImportError:
            S._global_server_args = None
        else:
            reset_context()
        return None
    args = S.ServerArgs(model_path=_model_dir(), disaggregation_mode=role, device="npu",
                        skip_tokenizer_init=True)
    for key, value in fields.items():
        setattr(args, key, value)
    S.set_global_server_args_for_scheduler(args)
    return args


def run_alt_stream_step(model="glm-5", tp=16):
    """One step of the release's own ``npu_mla_preprocess`` on the non-mlaprolog path with the
    layer's ``alt_stream`` set.  sglang 0.5.9 - 0.5.23 end that path with
    ``torch.npu.current_stream().wait_event(m.alt_stream)``: a Stream where torch_npu expects an
    Event, which raises there.  Returns the error (type, message) and the bytes freed meanwhile."""
    import importlib

    install()
    module = importlib.import_module(MLA_NPU)
    m = build_attention(model, tp, mlaprolog=False, alt_stream=True)
    weights = (m.fused_qkv_a_proj_with_mqa.weight, m.w_kc)
    before = sum(w.untyped_storage().nbytes() for w in weights)
    hidden, positions, batch, context = make_batch(model)
    error = None
    try:
        with context:
            module.npu_mla_preprocess(m, hidden, positions, batch, None)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = [type(exc).__name__, str(exc)]
    return {"error": error, "freed": before - sum(w.untyped_storage().nbytes() for w in weights),
            "built_preprocess": hasattr(m, "mla_preprocess")}


def run_layer(model="glm-5", tp=16, steps=2, layer_id=0, hold=None, consume=False, **build):
    """Build a layer, call the real ``npu_mla_preprocess`` ``steps`` times; report the bytes of
    the qkv_a / w_kc storages before and after, the kernels run and what they read.  ``hold(m)``:
    something taken from the layer before the first step (an alias of a weight), kept as
    ``result["held"]``.  ``consume``: the current stream reads every tensor the call returns, as
    the attention after it does."""
    import importlib

    install()
    module = importlib.import_module(MLA_NPU)
    m = build_attention(model, tp, layer_id=layer_id, **build)
    storages = {"qkv_a": m.fused_qkv_a_proj_with_mqa.weight.untyped_storage(),
                "w_kc": m.w_kc.untyped_storage()}
    before = {k: s.nbytes() for k, s in storages.items()}
    held = hold(m) if hold else None
    del CALLS[:]
    outputs = []
    for _ in range(steps):
        hidden, positions, batch, context = make_batch(model)
        with context:
            out = module.npu_mla_preprocess(m, hidden, positions, batch, None)
        if consume:
            for tensor in out:
                if isinstance(tensor, torch.Tensor):
                    tensor.sum()
        outputs.append([list(t.shape) if isinstance(t, torch.Tensor) else None for t in out])
    after = {k: s.nbytes() for k, s in storages.items()}
    prolog = [args for name, args in CALLS if name == "npu_mla_prolog_v3"]
    return {
        "before": before, "after": after,
        "freed": {k: before[k] - after[k] for k in before},
        "expected": {"qkv_a": m.fused_qkv_a_proj_with_mqa.output_size * CONFIGS[model]["hidden"] * 2,
                     "w_kc": (CONFIGS[model]["heads"] // tp) * CONFIGS[model]["nope"]
                     * CONFIGS[model]["kv_lora"] * 2},
        "kernels": [name for name, _ in CALLS if name != "npu_format_cast"],
        "format_casts": [args["x"] for name, args in CALLS if name == "npu_format_cast"],
        "prolog_weights": [{k: a[k] for k in ("weight_dq", "weight_dkv_kr", "weight_uk")}
                           for a in prolog],
        "outputs": outputs,
        "uses_mlaprolog": (m.mla_preprocess.uses_mlaprolog()
                           if hasattr(type(m.mla_preprocess), "uses_mlaprolog") else None),
        "qkv_type": type(m.fused_qkv_a_proj_with_mqa.weight).__name__,
        "w_kc_type": type(m.w_kc).__name__,
        "layer": m,
        "held": held,
    }
