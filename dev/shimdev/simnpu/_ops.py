"""torch_npu's operators on the dense path of a real sglang server, in pure torch on the CPU.

Each is defined with ``torch.library`` under the schema torch_npu 2.13.0 registers, so sglang's
calls are parsed and checked as on a device (a wrong keyword, a missing argument or a tensor where
an int belongs fails here as there), in the namespace torch_npu registers it in:

* ``npu::`` -- the schemas are strings of the wheel's ``torch_npu/lib/libtorch_npu.so``, copied
  here verbatim (tests/dev/test_simnpu_conformance.py finds each one there);
* ``atb::`` -- registered by ``torch_npu/lib/libop_plugin_atb.so`` (``torch_npu/op_plugin/atb/
  _atb_ops.py`` lists the names and binds ``torch_npu.<name> = torch.ops.atb.<name>``).  That
  library assembles its schema strings at run time, so they are not in the file whole: the argument
  types here are those of the C++ function its registration names (the mangled
  ``atb::<name>(...)`` symbol, which the conformance test matches type for type) and the argument
  names are the ones sglang passes by keyword;
* ``custom::npu_mla_prolog_v3`` -- the CANN custom-ops package's namespace, which sglang 0.5.9 -
  0.5.19's mlaprolog path calls; its schema is torch_npu 2.13.0's ``npu::npu_mla_prolog_v3`` (a
  string of libtorch_npu.so, which the conformance test finds) less five trailing dtype arguments.
  sglang 0.5.20+ call the wheel's own ``torch_npu.npu_mla_prolog_v3`` (``npu::``, whole schema):
  one stand-in behind both;
* sgl-kernel-npu's ``npu::batch_matmul_transpose`` -- quoted from its ``csrc/pytorch_extensions.cpp``
  (no public wheel to hold it to).

The DSA decode path's stand-ins (DECLARED, custom::, sgl-kernel-npu's) are declared to the stream
sanitizer (``declare_kernel``) with the real op's schema: one launch each, writing only what the
schema marks ``(a!)`` (the prolog's two caches, ``batch_matmul_transpose``'s output).

What a kernel computes is the reference math of the op (float32 accumulation, the input's dtype
out); what it writes in place is what the schema marks ``(a!)``.
"""
from __future__ import annotations

import math

#: name -> schema (after the name), for ``npu::``.  Verbatim from libtorch_npu.so.
NPU_SCHEMAS = {
    "npu_rms_norm": "(Tensor input, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
    "npu_add_rms_norm": "(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)",
    "npu_swiglu": "(Tensor input, int dim=-1) -> Tensor",
    "npu_mrope": ("(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache, int head_size, *, "
                  "int[]? mrope_section=None, str? rotary_mode='half', str? cache_mode='default') "
                  "-> (Tensor, Tensor)"),
    # The DSA (DeepSeek-V3.2 / GLM-5 indexer) decode path: the indexer's rope, its top-k and the
    # sparse attention over the selected tokens; the W8A8 dynamic linear (q_b_proj, indexer.wq_b).
    "npu_rotary_mul": "(Tensor input, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None) -> Tensor",
    "npu_interleave_rope": "(Tensor x, Tensor cos, Tensor sin) -> Tensor",
    "npu_lightning_indexer": (
        '(Tensor query, Tensor key, Tensor weights, *, Tensor? actual_seq_lengths_query=None, '
        'Tensor? actual_seq_lengths_key=None, Tensor? block_table=None, str layout_query="BSND", '
        'str layout_key="BSND", int sparse_count=2048, int sparse_mode=3, '
        'int pre_tokens=9223372036854775807, int next_tokens=9223372036854775807, '
        'bool return_value=False) -> (Tensor, Tensor)'),
    "npu_sparse_flash_attention": (
        '(Tensor query, Tensor key, Tensor? value, Tensor sparse_indices, float scale_value, *, '
        'Tensor? block_table=None, Tensor? actual_seq_lengths_query=None, '
        'Tensor? actual_seq_lengths_kv=None, Tensor? query_rope=None, Tensor? key_rope=None, '
        'int sparse_block_size=1, str layout_query="BSND", str layout_kv="BSND", int sparse_mode=3, '
        'int pre_tokens=9223372036854775807, int next_tokens=9223372036854775807, '
        'int attention_mode=0, bool return_softmax_lse=False, Tensor? sinks=None) '
        '-> (Tensor, Tensor, Tensor)'),
    "npu_quant_matmul": (
        "(Tensor x1, Tensor x2, Tensor scale, *, Tensor? offset=None, Tensor? pertoken_scale=None, "
        "Tensor? bias=None, int? output_dtype=None, int? x1_dtype=None, int? x2_dtype=None, "
        "int? pertoken_scale_dtype=None, int? scale_dtype=None, int[]? group_sizes=None, "
        "Tensor? y_scale=None) -> Tensor"),
    "npu_dynamic_quant": (
        '(Tensor input, *, Tensor? smooth_scales=None, Tensor? group_index=None, int? dst_type=None, '
        'str quant_mode="pertoken", float dst_type_max=0.0) -> (Tensor, Tensor)'),
    "npu_format_cast": ("(Tensor input, int acl_format, *, int? customize_dtype=None, "
                        "int? input_dtype=None) -> Tensor"),
    # -- speculative decoding (EAGLE / NextN): ascend_backend.forward_mtp's attention for
    # target-verify and draft-extend batches
    "npu_fused_infer_attention_score": (
        '(Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, Tensor? atten_mask=None, '
        'SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None, '
        'Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, '
        'Tensor? quant_scale2=None, Tensor? quant_offset2=None, Tensor? antiquant_scale=None, '
        'Tensor? antiquant_offset=None, Tensor? key_antiquant_scale=None, '
        'Tensor? key_antiquant_offset=None, Tensor? value_antiquant_scale=None, '
        'Tensor? value_antiquant_offset=None, Tensor? block_table=None, '
        'Tensor? query_padding_size=None, Tensor? kv_padding_size=None, '
        'Tensor? key_shared_prefix=None, Tensor? value_shared_prefix=None, '
        'SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, Tensor? key_rope=None, '
        'Tensor? key_rope_antiquant_scale=None, int num_heads=1, float scale=1.0, '
        'int pre_tokens=2147483647, int next_tokens=2147483647, str input_layout="BSH", '
        'int num_key_value_heads=0, int sparse_mode=0, int inner_precise=0, int block_size=0, '
        'int antiquant_mode=0, int key_antiquant_mode=0, int value_antiquant_mode=0, '
        'bool softmax_lse_flag=False) -> (Tensor, Tensor)'),
    # -- the MoE path (sglang's hardware_backend/npu/moe/topk.py, ep_moe/layer.py's forward_npu,
    # quantization/unquant.py's forward_npu, npu/quantization/fused_moe_method_npu.py)
    "npu_moe_gating_top_k": (
        "(Tensor x, int k, *, Tensor? bias=None, Tensor? input_ids=None, Tensor? tid2eid=None, "
        "int k_group=1, int group_count=1, int group_select_mode=0, int renorm=0, int norm_type=0, "
        "bool out_flag=False, float routed_scaling_factor=1.0, float eps=1e-20) "
        "-> (Tensor, Tensor, Tensor)"),
    "npu_moe_gating_top_k_softmax": "(Tensor x, Tensor? finished=None, int k=1) -> (Tensor, Tensor, Tensor)",
    "npu_grouped_matmul": (
        "(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
        "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
        "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
        "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, "
        "int? split_item=0, int? group_type=None, int? group_list_type=0, int? act_type=0, "
        "int[]? tuning_config=None, int? output_dtype=None, int? x_dtype=None, int? weight_dtype=None, "
        "int? scale_dtype=None, int? per_token_scale_dtype=None) -> Tensor[]"),
    "npu_moe_init_routing": (
        "(Tensor x, Tensor row_idx, Tensor expert_idx, int active_num) -> (Tensor, Tensor, Tensor)"),
    "npu_moe_compute_expert_tokens": "(Tensor sorted_expert_for_source_row, int num_expert) -> Tensor",
    "npu_moe_init_routing_v2": (
        "(Tensor x, Tensor expert_idx, *, Tensor? scale=None, Tensor? offset=None, int active_num=-1, "
        "int expert_capacity=-1, int expert_num=-1, int drop_pad_mode=0, int expert_tokens_num_type=0, "
        "bool expert_tokens_num_flag=False, int quant_mode=-1, int[2] active_expert_range=[], "
        "int row_idx_type=0, int? x_dtype=None) -> (Tensor, Tensor, Tensor, Tensor)"),
    "npu_moe_finalize_routing": (
        "(Tensor expanded_permuted_rows, Tensor? skip1, Tensor? skip2, Tensor? bias, Tensor? scales, "
        "Tensor expanded_src_to_dst_row, Tensor? export_for_source_row, int? drop_pad_mode=0, "
        "int? k=1) -> Tensor"),
}

#: torch_npu 2.13.0's ``npu::npu_mla_prolog_v3`` (a string of libtorch_npu.so).  sglang 0.5.9 -
#: 0.5.19 call it as ``torch.ops.custom.npu_mla_prolog_v3``: the ``custom`` namespace is not
#: torch_npu's but the CANN custom-ops package's (cann-recipes-infer
#: ``ops/ascendc/torch_ops_extension/custom_ops/csrc/ops_def_registration.cpp``,
#: ``TORCH_LIBRARY(custom, m)``), whose schema is this one without the five trailing ``int? *_dtype``
#: arguments (torch_npu added them for its FP8/HiFloat8 variants).  The conformance test holds the
#: ``custom::`` schema to be exactly that prefix of the wheel's string.
NPU_MLA_PROLOG_V3 = (
    '(Tensor token_x, Tensor weight_dq, Tensor weight_uq_qr, Tensor weight_uk, Tensor weight_dkv_kr, '
    'Tensor rmsnorm_gamma_cq, Tensor rmsnorm_gamma_ckv, Tensor rope_sin, Tensor rope_cos, '
    'Tensor(a!) kv_cache, Tensor(b!) kr_cache, *, Tensor? cache_index=None, Tensor? dequant_scale_x=None, '
    'Tensor? dequant_scale_w_dq=None, Tensor? dequant_scale_w_uq_qr=None, '
    'Tensor? dequant_scale_w_dkv_kr=None, Tensor? quant_scale_ckv=None, Tensor? quant_scale_ckr=None, '
    'Tensor? smooth_scales_cq=None, Tensor? actual_seq_len=None, Tensor? k_nope_clip_alpha=None, '
    'float rmsnorm_epsilon_cq=1e-05, float rmsnorm_epsilon_ckv=1e-05, str cache_mode="PA_BSND", '
    'bool query_norm_flag=False, int weight_quant_mode=0, int kv_cache_quant_mode=0, '
    'int query_quant_mode=0, int ckvkr_repo_mode=0, int quant_scale_repo_mode=0, int tile_size=128, '
    'float qc_qr_scale=1.0, float kc_scale=1.0, int? token_x_dtype=None, int? weight_dq_dtype=None, '
    'int? weight_uq_qr_dtype=None, int? weight_dkv_kr_dtype=None, int? kv_cache_dtype=None) '
    '-> (Tensor, Tensor, Tensor, Tensor, Tensor)')
_DTYPE_ARGS = (", int? token_x_dtype=None, int? weight_dq_dtype=None, int? weight_uq_qr_dtype=None, "
               "int? weight_dkv_kr_dtype=None, int? kv_cache_dtype=None")
CUSTOM_SCHEMAS = {"npu_mla_prolog_v3": NPU_MLA_PROLOG_V3.replace(_DTYPE_ARGS, "")}
#: sglang 0.5.20+ call the wheel's own op, ``torch_npu.npu_mla_prolog_v3`` (torch_npu/utils/
#: custom_ops.py binds it as ``torch.ops.npu.npu_mla_prolog_v3``): defined here under the wheel's
#: whole string, the same stand-in behind both namespaces.
NPU_SCHEMAS["npu_mla_prolog_v3"] = NPU_MLA_PROLOG_V3

#: sgl-kernel-npu's own ``npu::`` op (``csrc/pytorch_extensions.cpp``, ``TORCH_LIBRARY_FRAGMENT(npu,
#: m)``): the decode attention's ``w_vc`` product (``forward_dsa_core_npu``).  Not in the torch-npu
#: wheel, so the conformance test cannot hold it to a binary (no sgl-kernel-npu wheel is public).
SGL_KERNEL_NPU_SCHEMAS = {
    "batch_matmul_transpose": (
        "(Tensor tensor_a, Tensor tensor_b, Tensor(a!) tensor_c, str? format_mode=None, "
        "str? quant_mode=None) -> ()"),
    # EAGLE's draft tree (sglang speculative/eagle_utils.py calls torch.ops.npu.<this> on NPU).
    # The registered string marks no argument written, though the kernel fills its five output
    # buffers in place (as sgl-kernel's CUDA op of the same name, whose schema marks them ``!``):
    # the op is defined here under the real string, and declared to the sanitizer with the writes
    # (SANITIZER_WRITES).
    "build_tree_kernel_efficient": (
        "(Tensor parent_list, Tensor selected_index, Tensor verified_seq_len, Tensor tree_mask, "
        "Tensor positions, Tensor retrive_index, Tensor retrive_next_token, "
        "Tensor retrive_next_sibling, int topk, int depth, int draft_token_num, "
        "int tree_mask_mode)->()"),
}

#: op -> the arguments its kernel writes where its registered schema does not say so: the schema
#: the stream sanitizer is given marks them ``(x!)``.
SANITIZER_WRITES = {"build_tree_kernel_efficient": ("tree_mask", "positions", "retrive_index",
                                                    "retrive_next_token", "retrive_next_sibling")}

#: Where each op's schema (and so what it reads and writes, for the stream sanitizer) is from.
SOURCES = {
    "npu": "torch-npu 2.13.0 torch_npu/lib/libtorch_npu.so",
    "custom": ("CANN custom ops (cann-recipes-infer ops/ascendc/torch_ops_extension/custom_ops/csrc/"
               "ops_def_registration.cpp); = torch-npu 2.13.0's npu::npu_mla_prolog_v3 less its dtype "
               "arguments"),
    "sgl_kernel_npu": "sgl-kernel-npu csrc/pytorch_extensions.cpp",
}

#: name -> schema, for ``atb::`` (types: the C++ function's; names: sglang's keywords).
ATB_SCHEMAS = {
    "_npu_reshape_and_cache": (
        "(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_indices) -> ()"),
    "_npu_flash_attention_qlens": (
        "(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, Tensor mask, "
        "Tensor seq_len, Tensor context_lens, int num_kv_heads, int num_heads, float scale_value, "
        "Tensor(a!) out) -> ()"),
    "_npu_paged_attention": (
        "(Tensor query, Tensor key_cache, Tensor value_cache, int num_kv_heads, int num_heads, "
        "float scale_value, Tensor block_table, Tensor context_lens, Tensor(a!) out, "
        "Tensor? mask=None) -> ()"),
}

_LIBRARIES = []  # kept alive: a torch.library.Library unregisters its ops when collected


# -- the kernels ------------------------------------------------------------------------------------

def _rms(x, gamma, eps):
    import torch

    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def npu_rms_norm(input, gamma, epsilon=1e-06):
    return _rms(input, gamma, epsilon)


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06):
    x = (x1.float() + x2.float()).to(x1.dtype)
    y, rstd = _rms(x, gamma, epsilon)
    return y, rstd, x


def npu_swiglu(input, dim=-1):
    import torch

    a, b = input.chunk(2, dim=dim)
    return (torch.nn.functional.silu(a.float()) * b.float()).to(input.dtype)


def _rotate(x, cos, sin, neox):
    import torch

    if neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def npu_mrope(positions, query, key, cos_sin_cache, head_size, *, mrope_section=None,
              rotary_mode="half", cache_mode="default"):
    """Plain rotary embedding (``mrope_section`` all zero, what sglang's ``forward_npu`` passes) on
    the first ``cos_sin_cache.shape[-1]`` dims of each head; ``half`` is neox style."""
    import torch

    if mrope_section and any(mrope_section):
        raise NotImplementedError("simnpu: npu_mrope with a non-zero mrope_section")
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    out = []
    for x in (query, key):
        heads = x.reshape(x.shape[0], -1, head_size)
        rot = _rotate(heads[..., :rotary_dim].float(), cos, sin, rotary_mode == "half")
        out.append(torch.cat((rot.to(x.dtype), heads[..., rotary_dim:]), dim=-1).reshape(x.shape))
    return out[0], out[1]


def _rotate_half(x):
    import torch

    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def npu_rotary_mul(input, r1, r2, rotary_mode="half", rotate=None):
    """``input * cos + rotate(input) * sin`` (r1 = cos, r2 = sin, broadcast): ``half`` rotates the
    two halves (neox), ``interleave`` adjacent pairs."""
    import torch

    x = input.float()
    if rotary_mode == "half":
        rotated = _rotate_half(x)
    elif rotary_mode == "interleave":
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        raise NotImplementedError("simnpu: npu_rotary_mul rotary_mode=%r" % (rotary_mode,))
    return (x * r1.float() + rotated * r2.float()).to(input.dtype)


def npu_interleave_rope(x, cos, sin):
    """Rope on interleaved pairs: the last dim de-interleaved (even, then odd elements), then
    rotated by halves with ``cos`` / ``sin`` (``[B, 1, S, D]`` against ``x`` ``[B, N, S, D]``)."""
    import torch

    xf = x.float()
    xf = torch.cat((xf[..., 0::2], xf[..., 1::2]), dim=-1)
    return (xf * cos.float() + _rotate_half(xf) * sin.float()).to(x.dtype)


def _batch_of_tokens(cumulative_q, tokens):
    """Request index of each of ``tokens`` query tokens from TND's cumulative query lengths."""
    import torch

    ends = cumulative_q.long().flatten()[:, None]
    return (torch.arange(tokens)[None, :] >= ends).sum(0)


def _paged_rows(cache, block_table_row, positions):
    """Rows ``positions`` of one request in a paged ``[blocks, page, heads, dim]`` cache."""
    page = cache.shape[1]
    slots = block_table_row.long()[positions // page] * page + positions % page
    return cache.reshape(-1, cache.shape[-1])[slots]


def _visible(actual_q, actual_kv, batch, t):
    """sparse_mode 3 (causal from the bottom right): how many of its request's keys query token
    ``t`` sees."""
    q_end = int(actual_q[batch])
    q_start = int(actual_q[batch - 1]) if batch else 0
    return int(actual_kv[batch]) - (q_end - q_start) + (t - q_start) + 1


def npu_lightning_indexer(query, key, weights, *, actual_seq_lengths_query=None,
                          actual_seq_lengths_key=None, block_table=None, layout_query="BSND",
                          layout_key="BSND", sparse_count=2048, sparse_mode=3,
                          pre_tokens=9223372036854775807, next_tokens=9223372036854775807,
                          return_value=False):
    """DSA's indexer: per query token, ``score(s) = sum_n weights[n] * relu(q[n] . k[s])`` over the
    keys it sees (sparse_mode 3), and the positions of the ``sparse_count`` best (-1 past the
    visible ones).  TND queries over a PA_BSND key cache only (what sglang passes)."""
    import torch

    if layout_query != "TND" or layout_key != "PA_BSND" or sparse_mode != 3:
        raise NotImplementedError("simnpu: npu_lightning_indexer %s/%s sparse_mode %d"
                                  % (layout_query, layout_key, sparse_mode))
    tokens = query.shape[0]
    indices = torch.full((tokens, 1, sparse_count), -1, dtype=torch.int32)
    values = torch.full((tokens, 1, sparse_count), float("-inf"), dtype=torch.float32)
    batches = _batch_of_tokens(actual_seq_lengths_query, tokens)
    for t in range(tokens):
        b = int(batches[t])
        n = _visible(actual_seq_lengths_query, actual_seq_lengths_key, b, t)
        k = _paged_rows(key, block_table[b], torch.arange(n)).float()
        scores = (torch.relu(query[t].float() @ k.T) * weights[t].float()[:, None]).sum(0)
        top = torch.topk(scores, min(sparse_count, n))
        indices[t, 0, :top.indices.numel()] = top.indices.to(torch.int32)
        values[t, 0, :top.values.numel()] = top.values
    return indices, (values.to(query.dtype) if return_value else torch.empty(0, dtype=query.dtype))


def npu_sparse_flash_attention(query, key, value, sparse_indices, scale_value, *, block_table=None,
                               actual_seq_lengths_query=None, actual_seq_lengths_kv=None,
                               query_rope=None, key_rope=None, sparse_block_size=1,
                               layout_query="BSND", layout_kv="BSND", sparse_mode=3,
                               pre_tokens=9223372036854775807, next_tokens=9223372036854775807,
                               attention_mode=0, return_softmax_lse=False, sinks=None):
    """Attention of each query token over the tokens ``sparse_indices`` selects (-1, or an index
    at or past the request's ``actual_seq_lengths_kv``: none); with
    ``attention_mode`` 2 (MLA, absorbed) the scores add ``query_rope . key_rope`` and the values
    are ``value`` (the latent cache).  TND over PA_BSND, sparse_block_size 1 (what sglang passes)."""
    import torch

    if layout_query != "TND" or layout_kv != "PA_BSND" or sparse_block_size != 1:
        raise NotImplementedError("simnpu: npu_sparse_flash_attention %s/%s block %d"
                                  % (layout_query, layout_kv, sparse_block_size))
    tokens = query.shape[0]
    out = torch.zeros(query.shape[0], query.shape[1], value.shape[-1], dtype=query.dtype)
    batches = _batch_of_tokens(actual_seq_lengths_query, tokens)
    kv_lens = None if actual_seq_lengths_kv is None else actual_seq_lengths_kv.reshape(-1).long()
    for t in range(tokens):
        b = int(batches[t])
        chosen = sparse_indices[t, 0].long()
        # -1 selects nothing; nor does an index past the request's KV length: the kernel reads a
        # request's pages only up to actual_seq_lengths_kv[b] (in a capture, where the lengths are
        # not yet known, nothing)
        chosen = chosen[(chosen >= 0) & (True if kv_lens is None else chosen < kv_lens[b])]
        if not chosen.numel():
            continue
        scores = query[t].float() @ _paged_rows(key, block_table[b], chosen).float().T
        if query_rope is not None:
            scores = scores + query_rope[t].float() @ _paged_rows(key_rope, block_table[b], chosen).float().T
        probs = (scores * scale_value).softmax(-1)
        out[t] = (probs @ _paged_rows(value, block_table[b], chosen).float()).to(query.dtype)
    empty = torch.empty(0, dtype=torch.float32)
    return out, empty, empty


#: c10::ScalarType numbers (an ``int? output_dtype`` receives a torch.dtype as its number).
_SCALAR_TYPES = {0: "uint8", 1: "int8", 2: "int16", 3: "int32", 4: "int64", 5: "float16",
                 6: "float32", 7: "float64", 11: "bool", 15: "bfloat16"}


def _dtype(number, default):
    """An ``int?`` dtype argument: torch's ScalarType number (a torch.dtype passed through the op
    arrives as its number; one passed to the Python stand-in directly, as itself)."""
    import torch

    if number is None:
        return default
    if isinstance(number, torch.dtype):
        return number
    if number not in _SCALAR_TYPES:
        raise NotImplementedError("simnpu: output dtype number %r" % (number,))
    return getattr(torch, _SCALAR_TYPES[number])


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
                     x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None,
                     group_sizes=None, y_scale=None):
    """INT8 x INT8 -> ``(x1 @ x2) * scale[n] * pertoken_scale[t] (+ bias)``, in ``output_dtype``
    (int8 when none is given, the op's default)."""
    import torch

    acc = x1.float() @ x2.float()
    acc = acc * scale.float().flatten()
    if pertoken_scale is not None:
        acc = acc * pertoken_scale.float().reshape(-1, *([1] * (acc.dim() - 1)))
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(_dtype(output_dtype, torch.int8))


def npu_dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None,
                      quant_mode="pertoken", dst_type_max=0.0):
    """Per-token symmetric INT8: ``scale = amax(|x|) / 127`` per row, ``round(x / scale)``."""
    import torch

    x = input.float()
    if smooth_scales is not None:
        x = x * smooth_scales.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-12)
    return torch.round(x / scale).clamp(-128, 127).to(torch.int8), scale.squeeze(-1)


def _mla_prolog_shapes(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq,
                       rmsnorm_gamma_ckv, rope_sin, rope_cos, kv_cache, kr_cache, cache_index,
                       dequant_scale_w_uq_qr, weight_quant_mode):
    """(tokens, heads, nope, rope, kv_lora) of a prolog call, or ``RuntimeError`` naming the operand
    that disagrees.  torch_npu's meta function checks the ranks (token_x 2-D or 3-D, weight_uk
    3-D, rope_sin of token_x's rank); the kernel's shape rules (CANN's aclnnMlaPrologV3) are
    those of the math: ``x [T, H]``, ``W_dq [H, q_lora]``, ``W_uq_qr [q_lora, N * (nope + rope)]``,
    ``W_uk [N, nope, kv_lora]``, ``W_dkv_kr [H, kv_lora + rope]``, the two gammas, rope_sin /
    rope_cos ``[T, rope]``, one slot per token, caches whose last dims are kv_lora and rope."""
    op = "npu_mla_prolog_v3"
    required = {"token_x": token_x, "weight_dq": weight_dq, "weight_uq_qr": weight_uq_qr, "weight_uk": weight_uk,
                "weight_dkv_kr": weight_dkv_kr, "rmsnorm_gamma_cq": rmsnorm_gamma_cq,
                "rmsnorm_gamma_ckv": rmsnorm_gamma_ckv, "rope_sin": rope_sin, "rope_cos": rope_cos,
                "kv_cache": kv_cache, "kr_cache": kr_cache}
    for name, value in required.items():  # the meta function's require_param (Tensor? passes None)
        if value is None:
            raise RuntimeError("%s: %s should not be None, but the actual value is None" % (op, name))
    if token_x.dim() not in (2, 3):
        raise RuntimeError("%s: token_x dim num should be 2 or 3, but the actual value is %d" % (op, token_x.dim()))
    if weight_uk.dim() != 3:
        raise RuntimeError("%s: weight_uk dim num should be 3, but the actual value is %d" % (op, weight_uk.dim()))
    if rope_sin.dim() != token_x.dim():
        raise RuntimeError("%s: when token_x dim num is %d, rope_sin dim num should be %d, but the actual value "
                           "is %d" % (op, token_x.dim(), token_x.dim(), rope_sin.dim()))
    if token_x.dim() == 3:
        raise NotImplementedError("simnpu: %s with a 3-D token_x (BS layout; sglang passes [T, H])" % op)
    tokens, hidden = token_x.shape
    heads, nope, kv_lora = weight_uk.shape
    rope = rope_sin.shape[-1]
    q_lora = weight_dq.shape[-1] if weight_dq.dim() == 2 else -1
    want = {"weight_dq": (weight_dq, (hidden, q_lora)),
            "weight_uq_qr": (weight_uq_qr, (q_lora, heads * (nope + rope))),
            "weight_dkv_kr": (weight_dkv_kr, (hidden, kv_lora + rope)),
            "rmsnorm_gamma_cq": (rmsnorm_gamma_cq, (q_lora,)), "rmsnorm_gamma_ckv": (rmsnorm_gamma_ckv, (kv_lora,)),
            "rope_sin": (rope_sin, (tokens, rope)), "rope_cos": (rope_cos, (tokens, rope))}
    for name, (tensor, shape) in want.items():
        if tuple(tensor.shape) != shape:
            raise RuntimeError("%s: %s has shape %r, token_x %r and weight_uk %r make it %r"
                               % (op, name, tuple(tensor.shape), tuple(token_x.shape), tuple(weight_uk.shape), shape))
    if cache_index is None or cache_index.numel() != tokens:
        raise RuntimeError("%s: cache_mode PA_BSND takes one cache_index per token: %d tokens, cache_index %r"
                           % (op, tokens, None if cache_index is None else tuple(cache_index.shape)))
    for name, cache, last in (("kv_cache", kv_cache, kv_lora), ("kr_cache", kr_cache, rope)):
        if cache.dim() < 2 or cache.shape[-1] != last:
            raise RuntimeError("%s: %s %r, its last dim should be %d" % (op, name, tuple(cache.shape), last))
    if weight_quant_mode == 1 and (dequant_scale_w_uq_qr is None
                                   or dequant_scale_w_uq_qr.numel() != weight_uq_qr.shape[1]):
        raise RuntimeError("%s: weight_quant_mode 1 takes a per-channel dequant_scale_w_uq_qr of %d, got %r"
                           % (op, weight_uq_qr.shape[1], None if dequant_scale_w_uq_qr is None
                              else tuple(dequant_scale_w_uq_qr.shape)))
    return tokens, heads, nope, rope, kv_lora


def npu_mla_prolog_v3(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq,
                      rmsnorm_gamma_ckv, rope_sin, rope_cos, kv_cache, kr_cache, *, cache_index=None,
                      dequant_scale_x=None, dequant_scale_w_dq=None, dequant_scale_w_uq_qr=None,
                      dequant_scale_w_dkv_kr=None, quant_scale_ckv=None, quant_scale_ckr=None,
                      smooth_scales_cq=None, actual_seq_len=None, k_nope_clip_alpha=None,
                      rmsnorm_epsilon_cq=1e-05, rmsnorm_epsilon_ckv=1e-05, cache_mode="PA_BSND",
                      query_norm_flag=False, weight_quant_mode=0, kv_cache_quant_mode=0,
                      query_quant_mode=0, ckvkr_repo_mode=0, quant_scale_repo_mode=0, tile_size=128,
                      qc_qr_scale=1.0, kc_scale=1.0, token_x_dtype=None, weight_dq_dtype=None,
                      weight_uq_qr_dtype=None, weight_dkv_kr_dtype=None, kv_cache_dtype=None):
    """MLA's prolog, fused: ``cq = rmsnorm(x @ W_dq)``; with ``weight_quant_mode`` 1 cq is
    quantised per token to INT8 (returned as the query norm with its scale when
    ``query_norm_flag``) and multiplied by the INT8 ``W_uq_qr`` (dequantised per channel); the
    query's nope part absorbed through ``W_uk`` (``[heads, nope, kv_lora]``), its rope part
    rotated by halves; ``ckv = x @ W_dkv_kr``: the kv part normed into ``kv_cache``, the rope
    part rotated into ``kr_cache``, at the slots ``cache_index`` (PA_BSND).  Modes 0 and 1 only
    (what sglang passes on a bf16 / W8A8 model: 0.5.9 - 0.5.19 through ``custom::``, 0.5.20+
    through ``torch_npu.npu_mla_prolog_v3``); the five ``*_dtype`` arguments (HiFloat8, the
    ``npu::`` schema only) are not simulated.  The outputs as torch_npu's meta function makes them
    for those modes (CANN >= 8.5.0), but for the query's dtype: an empty ``dequant_scale_q_nope``;
    with ``query_norm_flag`` the query norm ``[T, q_lora]`` of ``W_uq_qr``'s dtype and (mode 1)
    its per-token scale ``[T, 1]``, else empty.  The query and its rope part are token_x's dtype
    (the meta function says bf16 whatever token_x is; sglang's token_x is the model's bf16)."""
    import torch

    op = "npu_mla_prolog_v3"
    if weight_quant_mode not in (0, 1) or kv_cache_quant_mode or query_quant_mode or cache_mode != "PA_BSND":
        raise NotImplementedError("simnpu: npu_mla_prolog_v3 weight_quant_mode %d kv_cache_quant_mode %d "
                                  "query_quant_mode %d cache_mode %s" % (
                                      weight_quant_mode, kv_cache_quant_mode, query_quant_mode, cache_mode))
    _unsupported(op, token_x_dtype=token_x_dtype, weight_dq_dtype=weight_dq_dtype,
                 weight_uq_qr_dtype=weight_uq_qr_dtype, weight_dkv_kr_dtype=weight_dkv_kr_dtype,
                 kv_cache_dtype=kv_cache_dtype, ckvkr_repo_mode=ckvkr_repo_mode,
                 quant_scale_repo_mode=quant_scale_repo_mode)
    tokens, heads, nope, rope, kv_lora = _mla_prolog_shapes(
        token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq, rmsnorm_gamma_ckv,
        rope_sin, rope_cos, kv_cache, kr_cache, cache_index, dequant_scale_w_uq_qr, weight_quant_mode)
    cos, sin = rope_cos.float().view(tokens, 1, rope), rope_sin.float().view(tokens, 1, rope)
    cq, _ = _rms((token_x.float() @ weight_dq.float()).to(token_x.dtype), rmsnorm_gamma_cq, rmsnorm_epsilon_cq)
    if weight_quant_mode == 1:
        qr, cq_scale = npu_dynamic_quant(cq)
        q = (qr.float() @ weight_uq_qr.float()) * cq_scale[:, None] * dequant_scale_w_uq_qr.float().view(1, -1)
    else:
        qr, cq_scale = cq, None
        q = cq.float() @ weight_uq_qr.float()
    q = q.view(tokens, heads, nope + rope)
    q_nope = torch.einsum("thn,hnk->thk", q[..., :nope], weight_uk.float()).to(token_x.dtype)
    q_pe = (q[..., nope:] * cos + _rotate_half(q[..., nope:]) * sin).to(token_x.dtype)
    ckv = token_x.float() @ weight_dkv_kr.float()
    kv, _ = _rms(ckv[:, :kv_lora].to(token_x.dtype), rmsnorm_gamma_ckv, rmsnorm_epsilon_ckv)
    kr = ckv[:, kv_lora:].view(tokens, 1, rope)
    kr = (kr * cos + _rotate_half(kr) * sin).view(tokens, rope)
    slots = cache_index.long().flatten()
    kv_cache.view(-1, kv_lora)[slots] = kv.to(kv_cache.dtype)
    kr_cache.view(-1, rope)[slots] = kr.to(kr_cache.dtype)
    if query_norm_flag:
        query_norm = qr.to(weight_uq_qr.dtype)
        norm_scale = cq_scale.float().view(tokens, 1) if cq_scale is not None else torch.empty(0)
    else:
        query_norm, norm_scale = torch.empty(0, dtype=weight_uq_qr.dtype), torch.empty(0)
    return q_nope, q_pe, torch.empty(0), query_norm, norm_scale


def batch_matmul_transpose(tensor_a, tensor_b, tensor_c, format_mode=None, quant_mode=None):
    """``tensor_c[t, n] = tensor_a[t, n] @ tensor_b[n]`` (a ``[T, N, K]``, b ``[N, K, V]``)."""
    import torch

    tensor_c.copy_(torch.einsum("tnk,nkv->tnv", tensor_a.float(), tensor_b.float()).to(tensor_c.dtype))


def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    slots = slot_indices.long().flatten()
    heads, dim = key_cache.shape[-2], key_cache.shape[-1]
    key_cache.view(-1, heads, dim)[slots] = key.reshape(-1, heads, dim).to(key_cache.dtype)
    heads, dim = value_cache.shape[-2], value_cache.shape[-1]
    value_cache.view(-1, heads, dim)[slots] = value.reshape(-1, heads, dim).to(value_cache.dtype)


def _paged_requests(op, k_cache, v_cache, block_table, lengths):
    """(request, keys, values) of each request with tokens: its first ``lengths[b]`` tokens
    gathered through its block table row (a length past the row's blocks is refused)."""
    for b, total in enumerate(int(n) for n in lengths):
        if total > block_table.shape[1] * k_cache.shape[1]:
            raise RuntimeError("%s: request %d has %d tokens, its block table row holds %d"
                               % (op, b, total, block_table.shape[1] * k_cache.shape[1]))
        if total > 0:
            yield b, _gather(k_cache, block_table[b], total), _gather(v_cache, block_table[b], total)


def _gather(cache, block_table_row, length):
    """The first ``length`` tokens of one request from a paged cache ``[blocks, page, heads, dim]``."""
    import torch

    page = cache.shape[1]
    positions = torch.arange(length)
    slots = block_table_row.long()[positions // page] * page + positions % page
    return cache.reshape(-1, cache.shape[-2], cache.shape[-1])[slots]


def _attend(q, k, v, scale, causal_offset):
    """q ``[n, hq, d]``, k/v ``[m, hkv, d]``; query i sees keys ``<= causal_offset + i``."""
    import torch

    groups = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(groups, dim=1)
    v = v.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.float(), k) * scale
    if causal_offset is not None:
        n, m = q.shape[0], k.shape[0]
        allowed = torch.arange(m)[None, :] <= (torch.arange(n)[:, None] + causal_offset)
        scores = scores.masked_fill(~allowed, -math.inf)
    return torch.einsum("hnm,mhd->nhd", scores.softmax(-1), v)


def _npu_flash_attention_qlens(query, key_cache, value_cache, block_table, mask, seq_len,
                               context_lens, num_kv_heads, num_heads, scale_value, out):
    """Causal prefill over a paged cache: request i's ``seq_len[i]`` new tokens attend to its first
    ``context_lens[i]`` cached ones."""
    head_dim = key_cache.shape[-1]
    q_all = query.reshape(query.shape[0], num_heads, head_dim)
    o_all = out.view(out.shape[0], num_heads, -1)
    start = 0
    for i, (n, total) in enumerate(zip(seq_len.tolist(), context_lens.tolist())):
        k = _gather(key_cache, block_table[i], total)
        v = _gather(value_cache, block_table[i], total)
        o_all[start:start + n] = _attend(q_all[start:start + n], k, v, scale_value,
                                         total - n).to(out.dtype)
        start += n


def _npu_paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value,
                         block_table, context_lens, out, mask=None):
    """Decode: request i's one query token attends to its first ``context_lens[i]`` tokens."""
    for i, total in enumerate(context_lens.tolist()):
        k = _gather(key_cache, block_table[i], total)
        v = _gather(value_cache, block_table[i], total)
        out[i:i + 1] = _attend(query[i:i + 1], k, v, scale_value, None).to(out.dtype)


def npu_format_cast(input, acl_format, *, customize_dtype=None, input_dtype=None):
    """ND -> a device format (sglang casts MoE and MLA weights to FRACTAL_NZ): the same values in
    memory of their own, as on a device (the layout of the copy is the device's business)."""
    if customize_dtype is not None or input_dtype is not None:
        raise NotImplementedError("simnpu: npu_format_cast with a customize/input dtype")
    return input.clone()


def npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None,
                                    actual_seq_lengths=None, actual_seq_lengths_kv=None,
                                    dequant_scale1=None, quant_scale1=None, dequant_scale2=None,
                                    quant_scale2=None, quant_offset2=None, antiquant_scale=None,
                                    antiquant_offset=None, key_antiquant_scale=None,
                                    key_antiquant_offset=None, value_antiquant_scale=None,
                                    value_antiquant_offset=None, block_table=None,
                                    query_padding_size=None, kv_padding_size=None,
                                    key_shared_prefix=None, value_shared_prefix=None,
                                    actual_shared_prefix_len=None, query_rope=None, key_rope=None,
                                    key_rope_antiquant_scale=None, num_heads=1, scale=1.0,
                                    pre_tokens=2147483647, next_tokens=2147483647,
                                    input_layout="BSH", num_key_value_heads=0, sparse_mode=0,
                                    inner_precise=0, block_size=0, antiquant_mode=0,
                                    key_antiquant_mode=0, value_antiquant_mode=0,
                                    softmax_lse_flag=False):
    """aclnnFusedInferAttentionScore as sglang's ascend ``forward_mtp`` calls it for GQA models
    (target-verify and draft-extend batches): ``input_layout="TND"`` queries ``[T, N, D]`` with
    ``actual_seq_lengths`` their *cumulative* ends per request, a paged key/value cache
    ``[blocks, block_size, H_kv * D]`` read through ``block_table`` for ``actual_seq_lengths_kv``
    tokens per request, and ``sparse_mode=3`` (rightDownCausal: the queries are the last tokens of
    their request, query i of n sees keys ``<= kv_len - n + i``) with the op's compressed 2048 x
    2048 upper-triangle mask.  Returns (attention_out ``[T, N, D]`` in the query's dtype,
    softmax_lse -- a one-element tensor, as the op gives without ``softmax_lse_flag``).  With
    ``query_rope`` / ``key_rope`` (MLA: BSND or TND), see the MLA block below.  Anything else sglang
    does not pass here raises by name."""
    import torch

    op = "npu_fused_infer_attention_score"
    _unsupported(op, pse_shift=pse_shift is not None, dequant_scale1=dequant_scale1 is not None,
                 quant_scale1=quant_scale1 is not None, dequant_scale2=dequant_scale2 is not None,
                 quant_scale2=quant_scale2 is not None, quant_offset2=quant_offset2 is not None,
                 antiquant_scale=antiquant_scale is not None, antiquant_offset=antiquant_offset is not None,
                 key_antiquant_scale=key_antiquant_scale is not None,
                 key_antiquant_offset=key_antiquant_offset is not None,
                 value_antiquant_scale=value_antiquant_scale is not None,
                 value_antiquant_offset=value_antiquant_offset is not None,
                 query_padding_size=query_padding_size is not None, kv_padding_size=kv_padding_size is not None,
                 key_shared_prefix=key_shared_prefix is not None, value_shared_prefix=value_shared_prefix is not None,
                 actual_shared_prefix_len=actual_shared_prefix_len is not None,
                 key_rope_antiquant_scale=key_rope_antiquant_scale is not None,
                 softmax_lse_flag=softmax_lse_flag, antiquant_mode=antiquant_mode,
                 key_antiquant_mode=key_antiquant_mode, value_antiquant_mode=value_antiquant_mode)
    if query_rope is not None or key_rope is not None:
        query, key = _mla_rope_joined(query, key, query_rope, key_rope, input_layout, num_heads,
                                      num_key_value_heads)  # the MLA block below
        if input_layout == "BSND":
            return _bsnd_paged_decode(query, key, value, block_table, actual_seq_lengths_kv, num_heads,
                                      num_key_value_heads, scale, block_size, sparse_mode, atten_mask)
    if input_layout == "BSH" and block_table is not None and sparse_mode == 0 and atten_mask is None:
        return _bsh_paged_decode(query, key, value, block_table, actual_seq_lengths_kv, num_heads,
                                 num_key_value_heads, scale, block_size)  # the graph-only block below
    if input_layout != "TND" or block_table is None or sparse_mode != 3:
        raise NotImplementedError("simnpu: %s with input_layout=%r, sparse_mode=%r and %s block table "
                                  "is not simulated (sglang's forward_mtp passes TND, 3, a table)"
                                  % (op, input_layout, sparse_mode, "a" if block_table is not None else "no"))
    if atten_mask is None or tuple(atten_mask.shape[-2:]) != (2048, 2048):
        raise RuntimeError("%s: sparse_mode 3 takes the compressed 2048 x 2048 causal mask, got %r"
                           % (op, None if atten_mask is None else tuple(atten_mask.shape)))
    if actual_seq_lengths is None or actual_seq_lengths_kv is None:
        raise RuntimeError("%s: TND needs actual_seq_lengths and actual_seq_lengths_kv" % op)
    kv_heads = num_key_value_heads or num_heads
    if num_heads % kv_heads or query.dim() != 3 or query.shape[1] != num_heads:
        raise RuntimeError("%s: query %r for %d heads over %d key/value heads"
                           % (op, tuple(query.shape), num_heads, kv_heads))
    ends = [int(e) for e in actual_seq_lengths]
    kv_lens = [int(n) for n in actual_seq_lengths_kv]
    if len(ends) != len(kv_lens) or ends[-1] != query.shape[0] or block_table.shape[0] != len(kv_lens):
        raise RuntimeError("%s: actual_seq_lengths %r / actual_seq_lengths_kv %r / block_table %r do not "
                           "describe %d query tokens" % (op, ends, kv_lens, tuple(block_table.shape), query.shape[0]))
    if block_size and key.shape[1] != block_size:
        raise RuntimeError("%s: key cache blocks of %d tokens, block_size %d" % (op, key.shape[1], block_size))
    head_dim = query.shape[-1]
    k_cache = key.reshape(key.shape[0], key.shape[1], kv_heads, -1)
    v_cache = value.reshape(value.shape[0], value.shape[1], kv_heads, -1)
    out = torch.empty(query.shape[0], num_heads, v_cache.shape[-1], dtype=query.dtype)
    if k_cache.shape[-1] != head_dim:
        raise RuntimeError("%s: keys of dim %d, queries of dim %d" % (op, k_cache.shape[-1], head_dim))
    start = 0
    for b, (end, total) in enumerate(zip(ends, kv_lens)):
        n = end - start
        # A query that sees no key gets a row of zeros, as a padded batch entry does: a graph
        # runner's warm-ups and captures fill the target-verify sequence lengths with 0 (sglang's
        # get_cuda_graph_seq_len_fill_value on the ascend backend), which the device runs.  0 is a
        # guess (no documented value was found), never read: each replay passes the real lengths.
        blind = max(0, n - total)
        out[start:start + blind] = 0
        if n > blind:
            k = _gather(k_cache, block_table[b], total)
            v = _gather(v_cache, block_table[b], total)
            out[start + blind:end] = _attend(query[start + blind:end], k, v, scale, total - n + blind).to(query.dtype)
        start = end
    return out, torch.zeros(1, dtype=query.dtype)


def build_tree_kernel_efficient(parent_list, selected_index, verified_seq_len, tree_mask, positions,
                                retrive_index, retrive_next_token, retrive_next_sibling, topk, depth,
                                draft_token_num, tree_mask_mode):
    """sgl-kernel-npu's EAGLE draft tree, as sgl-kernel's CUDA ``build_tree_efficient`` computes it
    (csrc/speculative/eagle_utils.cu; the NPU op takes the same arguments for the same result),
    thread by thread: per request, the token tree's mask rows (FULL_MASK: each draft token's row
    over the prefix and the draft tokens; QLEN_ONLY: over the draft tokens only), each draft
    token's position (seq_len + its depth), and the retrieval lists (index, first child, next
    sibling).  QLEN_ONLY_BITPACKING raises by name."""
    if tree_mask_mode not in (0, 1):
        raise NotImplementedError("simnpu: build_tree_kernel_efficient with tree_mask_mode %d" % tree_mask_mode)
    n = draft_token_num
    sel = selected_index.reshape(-1).tolist()
    parents = parent_list.reshape(-1).tolist()
    seq_lens = [int(x) for x in verified_seq_len.tolist()]
    width = topk * (depth - 1) + 1
    nt, ns = retrive_next_token.view(-1), retrive_next_sibling.view(-1)
    for bid in range(parent_list.shape[0]):
        seq_len = seq_lens[bid]
        seq_tree_idx = n * n * bid + sum(seq_lens[:bid]) * n
        for tid in range(n):
            if tree_mask_mode == 0:
                token_tree_idx = seq_tree_idx + (seq_len + n) * tid + seq_len + 1
            else:
                token_tree_idx = n * n * bid + n * tid + 1
            tree_mask[token_tree_idx - 1] = True
            tree_mask[token_tree_idx:token_tree_idx + n - 1] = False
            if tid == 0:
                positions[bid * n] = seq_len
                for i in range(n - 1, 0, -1):
                    retrive_index[bid, i] = bid * n + i
                    parent_tb_idx = sel[bid * (n - 1) + i - 1] // topk
                    parent_position = 0
                    if parent_tb_idx > 0:
                        parent_token_idx = parents[bid * width + parent_tb_idx]
                        while parent_position < n:
                            if sel[bid * (n - 1) + parent_position] == parent_token_idx:
                                parent_position += 1
                                break
                            parent_position += 1
                    if parent_position == n:
                        continue  # the kernel's "invalid eagle tree" case: the token is skipped
                    slot = bid * n + parent_position
                    if int(nt[slot]) == -1:
                        nt[slot] = i
                    else:
                        ns[bid * n + i] = int(nt[slot])
                        nt[slot] = i
                retrive_index[bid, 0] = bid * n
            else:
                cur, position = tid - 1, 0
                while True:
                    position += 1
                    tree_mask[token_tree_idx + cur] = True
                    parent_tb_idx = sel[bid * (n - 1) + cur] // topk
                    if parent_tb_idx == 0:
                        break
                    token_idx = parents[bid * width + parent_tb_idx]
                    cur = next((c for c in range(n - 1) if sel[bid * (n - 1) + c] == token_idx), n - 1)
                positions[bid * n + tid] = position + seq_len


def verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, retrive_index,
                       retrive_next_token, retrive_next_sibling, target_predict):
    """sgl_kernel_npu.sample.verify_tree_greedy (a triton kernel and its launcher; sglang's
    eagle_utils.verify_tree_greedy_func calls it on NPU), program by program as
    ``verify_tree_greedy_kernel`` computes it: per request, walk the draft chain in order (the
    kernel reads candidates i = 1.. against the target's prediction at i - 1, not the sibling
    lists), accepting while draft token == target token; the accepted slots into accept_index
    (its row of num_draft_tokens), their count, and the target's tokens into predicts."""
    bs, n = candidates.shape
    cand, ridx, target = candidates.tolist(), retrive_index.tolist(), target_predict.tolist()
    flat_accept = accept_index.view(-1)
    for req in range(bs):
        last = ridx[req][0]
        flat_accept[req * n] = last
        accepted, rejected = 0, False
        for i in range(1, n):
            if rejected:
                continue
            if cand[req][i] == target[req][i - 1]:
                draft_idx = ridx[req][i]
                predicts[last] = target[req][i - 1]
                accepted += 1
                flat_accept[req * n + accepted] = draft_idx
                last = draft_idx
            else:
                rejected = True
        accept_token_num[req] = accepted
        predicts[last] = target[req][last - n * req]


# -- the MoE path ---------------------------------------------------------------------------------
#
# What each computes follows the op's documentation (Ascend "torch_npu API" pages for torch_npu
# 2.x, and the aclnn pages of the kernels behind them: aclnnMoeGatingTopK, aclnnGroupedMatmulV4,
# aclnnMoeInitRouting(V2), aclnnMoeComputeExpertTokens, aclnnMoeFinalizeRouting).  A mode or an
# argument sglang's NPU paths never pass raises NotImplementedError naming it -- never a guess.

def _unsupported(op, **given):
    """Raise for each argument given a value the stand-in does not model."""
    for name, value in given.items():
        if value:
            raise NotImplementedError("simnpu: %s with %s=%r is not simulated" % (op, name, value))


def npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1,
                         group_count=1, group_select_mode=0, renorm=0, norm_type=0, out_flag=False,
                         routed_scaling_factor=1.0, eps=1e-20):
    """aclnnMoeGatingTopK: norm (0 softmax, 1 sigmoid) -> + bias for the choice -> groups scored
    (0: max, 1: sum of the top two), the best ``k_group`` kept -> top ``k`` experts of those; the
    weights are the *unbiased* normed scores, with sigmoid divided by their sum (+ eps) and times
    ``routed_scaling_factor``.  Returns (weights in x's dtype, expert ids int32, normed scores)."""
    import torch

    _unsupported("npu_moe_gating_top_k", input_ids=input_ids is not None,
                 tid2eid=tid2eid is not None, renorm=renorm)
    if x.dim() != 2:
        raise RuntimeError("The x should be 2D")
    xf = x.float()
    if norm_type == 1:
        normed = torch.sigmoid(xf)
    elif norm_type == 0:
        normed = torch.softmax(xf, dim=-1)
    else:
        raise NotImplementedError("simnpu: npu_moe_gating_top_k norm_type=%r" % norm_type)
    choice = normed + bias.float() if bias is not None else normed
    tokens, experts = choice.shape
    if group_count > 1:
        grouped = choice.view(tokens, group_count, experts // group_count)
        if group_select_mode == 1:
            score = grouped.topk(2, dim=-1).values.sum(-1)
        else:
            score = grouped.max(dim=-1).values
        keep = torch.zeros_like(score, dtype=torch.bool)
        keep.scatter_(1, score.topk(k_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(experts // group_count, dim=1),
                                    -math.inf)
    ids = choice.topk(k, dim=-1).indices
    weights = normed.gather(1, ids)
    if norm_type == 1:
        weights = weights / (weights.sum(-1, keepdim=True) + eps) * routed_scaling_factor
    return weights.to(x.dtype), ids.to(torch.int32), normed


def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
    """softmax over the experts, top ``k``; row_idx[i, j] = j * tokens + i (int32)."""
    import torch

    _unsupported("npu_moe_gating_top_k_softmax", finished=finished is not None)
    values, ids = torch.softmax(x.float(), dim=-1).topk(k, dim=-1)
    rows = x.shape[0]
    row_idx = torch.arange(rows * k, dtype=torch.int32).view(k, rows).t().contiguous()
    return values.to(x.dtype), ids.to(torch.int32), row_idx


def _group_bounds(group_list, group_list_type, groups):
    """[(start, end)] rows of each group: type 0 the list is a cumulative sum, 1 the counts."""
    values = [int(v) for v in group_list.tolist()]
    if group_list_type == 1:
        ends, total = [], 0
        for v in values:
            total += v
            ends.append(total)
    elif group_list_type == 0:
        ends = values
    else:
        raise NotImplementedError("simnpu: npu_grouped_matmul group_list_type=%r" % group_list_type)
    if len(ends) != groups:
        raise RuntimeError("group_list has %d entries for %d weights" % (len(ends), groups))
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None,
                       activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None,
                       group_list_type=0, act_type=0, tuning_config=None, output_dtype=None,
                       x_dtype=None, weight_dtype=None, scale_dtype=None, per_token_scale_dtype=None):
    """aclnnGroupedMatmulV4, the case MoE uses: one x ``[M, K]`` split on M (group_type 0) by
    ``group_list`` over E weights (``[E, K, N]`` or a list of E ``[K, N]``), one output ``[M, N]``
    (split_item 2/3) -- rows past the last group are zero here (undefined on a device).  Without
    quantisation arguments x and weight must have one dtype, as the kernel requires."""
    import torch

    _unsupported("npu_grouped_matmul", scale=scale, offset=offset, antiquant_scale=antiquant_scale,
                 antiquant_offset=antiquant_offset, per_token_scale=per_token_scale,
                 activation_input=activation_input, activation_quant_scale=activation_quant_scale,
                 activation_quant_offset=activation_quant_offset, act_type=act_type)
    if len(x) != 1 or group_type != 0 or split_item not in (2, 3) or group_list is None:
        raise NotImplementedError(
            "simnpu: npu_grouped_matmul with %d x, group_type=%r, split_item=%r, group_list %s "
            "(only one x split on M is simulated)" % (len(x), group_type, split_item,
                                                      "absent" if group_list is None else "given"))
    (a,) = x
    weights = list(weight[0]) if len(weight) == 1 and weight[0].dim() == 3 else list(weight)
    for w in weights:
        if w.dtype != a.dtype:
            raise RuntimeError("npu_grouped_matmul: x is %s and weight is %s, and no quantisation "
                               "argument is given" % (a.dtype, w.dtype))
    for w in weights:
        if w.shape[0] != a.shape[-1]:
            # what the device says (sglang#30085, a GLM-5.2 start-up on Ascend): the K of x and of
            # each weight must agree -- never a silent matmul of another orientation
            raise RuntimeError("Dim 1 value of x[0] should be equal with dim 1 value of weight[0], "
                               "but now is %d and %d respectively." % (a.shape[-1], w.shape[0]))
    biases = None
    if bias:
        biases = list(bias[0]) if len(bias) == 1 and bias[0].dim() == 2 else list(bias)
    out = torch.zeros(a.shape[0], weights[0].shape[-1], dtype=_dtype(output_dtype, a.dtype))
    for e, (start, end) in enumerate(_group_bounds(group_list, group_list_type, len(weights))):
        if end > start:
            y = a[start:end].float() @ weights[e].float()
            if biases is not None:
                y = y + biases[e].float()
            out[start:end] = y.to(out.dtype)
    return [out]


def _sorted_by_expert(expert_ids):
    """(order, sorted experts): the flattened (token, k) slots sorted by expert, stably."""
    import torch

    flat = expert_ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    return order, flat[order]


def npu_moe_init_routing(x, row_idx, expert_idx, active_num):
    """aclnnMoeInitRouting: the (token, k) slots sorted by expert (ties by row_idx); returns the
    rows of x in that order (the first ``active_num`` tokens' slots), expanded_row_idx
    (source slot ``row_idx[i, j]`` -> its row) and the sorted expert ids (int32)."""
    import torch

    tokens, k = expert_idx.shape
    sources = row_idx.reshape(-1).long()
    keys = expert_idx.reshape(-1).long() * (tokens * k) + sources
    order = torch.sort(keys, stable=True).indices
    expanded_row_idx = torch.empty(tokens * k, dtype=torch.int32)
    expanded_row_idx[sources[order]] = torch.arange(tokens * k, dtype=torch.int32)
    rows = sources[order] % tokens
    limit = min(tokens, active_num) * k
    return (x[rows[:limit]].clone(), expanded_row_idx,
            expert_idx.reshape(-1)[order].to(torch.int32))


def npu_moe_compute_expert_tokens(sorted_expert_for_source_row, num_expert):
    """Cumulative token count per expert: out[e] = #slots with expert <= e (int32)."""
    import torch

    counts = torch.bincount(sorted_expert_for_source_row.long(), minlength=num_expert)[:num_expert]
    return counts.cumsum(0).to(torch.int32)


def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1,
                            expert_capacity=-1, expert_num=-1, drop_pad_mode=0,
                            expert_tokens_num_type=0, expert_tokens_num_flag=False,
                            quant_mode=-1, active_expert_range=(), row_idx_type=0, x_dtype=None):
    """aclnnMoeInitRoutingV2/V3, dropless (drop_pad_mode 0), unquantised (quant_mode -1): the
    (token, k) slots (index i * k + j) sorted by expert, stably; expanded_row_idx is the scatter
    index (slot -> row, row_idx_type 0) or the gather index (row -> slot, 1); the expert token
    counts cumulative (type 0) or per expert (1) when asked; the scale output empty."""
    import torch

    _unsupported("npu_moe_init_routing_v2", scale=scale is not None, offset=offset is not None,
                 drop_pad_mode=drop_pad_mode, x_dtype=x_dtype is not None)
    if quant_mode != -1 or expert_tokens_num_type not in (0, 1) or row_idx_type not in (0, 1):
        raise NotImplementedError("simnpu: npu_moe_init_routing_v2 quant_mode=%r "
                                  "expert_tokens_num_type=%r row_idx_type=%r"
                                  % (quant_mode, expert_tokens_num_type, row_idx_type))
    tokens, k = expert_idx.shape
    experts = expert_num if expert_num > 0 else int(expert_idx.max()) + 1
    first, last = (list(active_expert_range) or [0, experts])[:2]
    if (first, last) != (0, experts):
        raise NotImplementedError("simnpu: npu_moe_init_routing_v2 active_expert_range=%r"
                                  % (list(active_expert_range),))
    order, sorted_experts = _sorted_by_expert(expert_idx)
    limit = tokens * k if active_num in (-1, 0) else min(tokens, active_num) * k
    expanded_x = x[(order // k)[:limit]].clone()
    if row_idx_type == 1:
        expanded_row_idx = order.to(torch.int32)
    else:
        expanded_row_idx = torch.empty(tokens * k, dtype=torch.int32)
        expanded_row_idx[order] = torch.arange(tokens * k, dtype=torch.int32)
    counts = torch.bincount(sorted_experts, minlength=experts)[:experts]
    tokens_out = (counts.cumsum(0) if expert_tokens_num_type == 0 else counts).to(torch.int64)
    if not expert_tokens_num_flag:
        tokens_out = torch.empty(0, dtype=torch.int64)
    return expanded_x, expanded_row_idx, tokens_out, torch.empty(0, dtype=torch.float32)


def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales,
                             expanded_src_to_dst_row, export_for_source_row, drop_pad_mode=0, k=1):
    """aclnnMoeFinalizeRouting (drop_pad_mode 0): out[i] = skip1[i] + skip2[i] + sum_j
    scales[i, j] * (rows[expanded_src_to_dst_row[j * tokens + i]] + bias[expert[i, j]]),
    accumulated in float32, in the rows' dtype."""
    import torch

    _unsupported("npu_moe_finalize_routing", drop_pad_mode=drop_pad_mode)
    if scales is None:
        raise NotImplementedError("simnpu: npu_moe_finalize_routing without scales")
    tokens, topk = scales.shape
    rows = expanded_permuted_rows.float()
    dst = expanded_src_to_dst_row.long().view(topk, tokens)
    out = torch.zeros(tokens, rows.shape[-1])
    for j in range(topk):
        picked = rows[dst[j]]
        if bias is not None:
            picked = picked + bias.float()[export_for_source_row[:, j].long()]
        out += scales[:, j:j + 1].float() * picked
    for skip in (skip1, skip2):
        if skip is not None:
            out += skip.float()
    return out.to(expanded_permuted_rows.dtype)


# -- registration -----------------------------------------------------------------------------------

#: The ops whose stand-ins are declared to the stream sanitizer (``simnpu.declare_kernel``) with
#: the real op's schema: one launch reading and writing what the real kernel does.
DECLARED = ("npu_rotary_mul", "npu_interleave_rope", "npu_lightning_indexer",
            "npu_sparse_flash_attention", "npu_quant_matmul", "npu_dynamic_quant",
            "npu_fused_infer_attention_score")


def _schemas():
    """(namespace, name, schema, where the schema is from) of every op defined here."""
    out = [("npu", n, sc, SOURCES["npu"]) for n, sc in NPU_SCHEMAS.items()]
    out += [("atb", n, sc, "torch-npu 2.13.0 libop_plugin_atb.so") for n, sc in ATB_SCHEMAS.items()]
    out += [("custom", n, sc, SOURCES["custom"]) for n, sc in CUSTOM_SCHEMAS.items()]
    out += [("npu", n, sc, SOURCES["sgl_kernel_npu"]) for n, sc in SGL_KERNEL_NPU_SCHEMAS.items()]
    return out


def kernel(name, namespace=None):
    """The stand-in registered for ``name`` (in ``namespace``; the first one defining it when
    None): declared to the sanitizer where the op is one of DECLARED, a custom:: one (in either
    namespace: ``npu_mla_prolog_v3``) or sgl-kernel-npu's, with that namespace's schema of the
    real op and its source."""
    from ._sanitizer import declare_kernel

    if name in GRAPH_SCHEMAS:
        return _graph_kernel(name)
    wanted = namespace
    for namespace, op, schema, source in _schemas():
        if op == name and wanted in (None, namespace):
            fn = globals()[name]
            if name in DECLARED or name in CUSTOM_SCHEMAS or name in SGL_KERNEL_NPU_SCHEMAS:
                for index, written in enumerate(SANITIZER_WRITES.get(name, ())):
                    schema = schema.replace("Tensor %s," % written, "Tensor(%s!) %s," % (chr(97 + index), written))
                return declare_kernel(name + schema, source)(fn)
            return fn
    raise KeyError(name)


def define() -> None:
    """Define every op once in this process (``torch.ops.npu.*``, ``torch.ops.atb.*``,
    ``torch.ops.custom.*``)."""
    import torch

    libraries = {}
    for namespace, name, schema, _ in _schemas():
        if namespace not in libraries:
            libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
            _LIBRARIES.append(libraries[namespace])
        libraries[namespace].define(name + schema)
        libraries[namespace].impl(name, kernel(name, namespace), "CompositeExplicitAutograd")
    for name, schema in GRAPH_SCHEMAS.items():  # the graph-only block below
        libraries["npu"].define(name + schema)
        libraries["npu"].impl(name, kernel(name), "CompositeExplicitAutograd")


def torch_npu_names() -> dict:
    """What ``torch_npu.<name>`` is on a device: the op itself, as torch_npu binds it."""
    import torch

    names = {name: getattr(torch.ops.npu, name) for name in NPU_SCHEMAS}
    names.update({name: getattr(torch.ops.npu, name) for name in GRAPH_SCHEMAS if "." not in name})
    names.update({name: getattr(torch.ops.atb, name) for name in ATB_SCHEMAS})
    return names


def _alloc_extend_kernel(prefix_lens, seq_lens, last_loc, free_pages, out_indices, bs_upper,
                         page_size, max_num_extend_tokens):
    """sgl_kernel_npu.mem_cache.allocator.alloc_extend_kernel, program by program: the triton
    kernel sglang's own ``mem_cache/allocator.py`` defines under the same name and signature (its
    three parts: the rest of the old partial page, the new full pages, the new partial page; a
    program returns as soon as its request's tokens are placed).

    Not sglang's ``alloc_extend_naive``: 0.5.7/0.5.8's NPU copy (``allocator_npu._alloc_extend_naive``)
    lacks the early return after part 1 that 0.5.9 added, so for a request that stays in its
    partial page (a speculative draft's slots: prefix 4, seq 5, page 128) its part 2 is -128 tokens
    and it writes the free-page list's tail into nothing -- a path that release takes only past 200
    new pages, never for the draft's few slots, which the kernel places."""
    import torch

    for pid in range(prefix_lens.shape[0]):
        pre_len, seq_len = int(prefix_lens[pid]), int(seq_lens[pid])
        output_start = int((seq_lens[:pid + 1] - prefix_lens[:pid + 1]).sum()) - (seq_len - pre_len)
        new_pages = ((seq_lens[:pid + 1] + page_size - 1) // page_size
                     - (prefix_lens[:pid + 1] + page_size - 1) // page_size)
        self_pages = int(new_pages[-1])
        page_start = int(new_pages.sum()) - self_pages
        part1 = min(seq_len, (pre_len + page_size - 1) // page_size * page_size) - pre_len
        if part1 > 0:
            out_indices[output_start:output_start + part1] = int(last_loc[pid]) + 1 + torch.arange(part1)
        if pre_len + part1 == seq_len:
            continue
        part2 = seq_len // page_size * page_size - (pre_len + page_size - 1) // page_size * page_size
        if part2 > 0:
            offsets = torch.arange(part2)
            out_indices[output_start + part1:output_start + part1 + part2] = (
                free_pages[page_start + offsets // page_size] * page_size + offsets % page_size)
        if pre_len + part1 + part2 == seq_len:
            continue
        part3 = seq_len - seq_len // page_size * page_size
        first = int(free_pages[page_start + self_pages - 1]) * page_size
        out_indices[output_start + part1 + part2:output_start + part1 + part2 + part3] = first + torch.arange(part3)


# -- triton kernels sglang launches itself (triton-ascend runs them on a device) ---------------------

def _write_req_to_token_pool(req_to_token, req_pool_indices, prefix_pointers, pre_lens, seq_lens,
                             extend_lens, out_cache_loc, req_to_token_ptr_stride):
    """sglang.srt.mem_cache.common.write_req_to_token_pool_triton: each request's prefix (read
    through its int64 pointer, as the kernel does) then its new slots into its req_to_token row."""
    import ctypes

    import torch

    start = 0
    for pid in range(req_pool_indices.shape[0]):
        row = req_to_token[int(req_pool_indices[pid])]
        pre, seq, ext = int(pre_lens[pid]), int(seq_lens[pid]), int(extend_lens[pid])
        if pre:
            buffer = (ctypes.c_int64 * pre).from_address(int(prefix_pointers[pid]))
            row[:pre] = torch.frombuffer(buffer, dtype=torch.int64, count=pre).to(row.dtype)
        row[pre:seq] = out_cache_loc[start:start + ext].to(row.dtype)
        start += ext


def _compute_position(positions, extend_start_loc, extend_prefix_lens, extend_seq_lens, has_prefix):
    """sglang.srt.model_executor.forward_batch_info.compute_position_kernel."""
    import torch

    start = 0
    for pid in range(extend_seq_lens.shape[0]):
        prefix = int(extend_prefix_lens[pid]) if has_prefix else 0
        n = int(extend_seq_lens[pid])
        positions[start:start + n] = torch.arange(prefix, prefix + n)
        extend_start_loc[pid] = start
        start += n


# -- EAGLE / NextN speculative decoding's triton kernels (sglang.srt.speculative.spec_utils), each
# program of the kernel's grid in turn, as the kernel computes it (masked loads and stores become
# the slices they cover)

def _create_extend_after_decode_spec_info(verified_id, seq_lens, accept_lens, positions,
                                          new_verified_id, bs_upper):
    """spec_utils.create_extend_after_decode_spec_info: per request, the positions of its accepted
    tokens (seq_len - accept_len ... seq_len - 1, packed after the earlier requests') and its last
    accepted token as the new verified id."""
    import torch

    cum = 0
    for pid in range(seq_lens.shape[0]):
        seq, acc = int(seq_lens[pid]), int(accept_lens[pid])
        positions[cum:cum + acc] = torch.arange(seq - acc, seq)
        new_verified_id[pid] = verified_id[cum + acc - 1]
        cum += acc


def _assign_req_to_token_pool(req_pool_indices, req_to_token, start_offset, end_offset,
                              out_cache_loc, pool_len, bs_upper):
    """spec_utils.assign_req_to_token_pool: request pid's slots start..end of its req_to_token row
    from out_cache_loc, packed after the earlier requests' (end - start each)."""
    out = 0
    for pid in range(req_pool_indices.shape[0]):
        start, end = int(start_offset[pid]), int(end_offset[pid])
        row = req_to_token[int(req_pool_indices[pid])]
        row[start:end] = out_cache_loc[out:out + end - start].to(row.dtype)
        out += end - start


def _assign_draft_cache_locs(req_pool_indices, req_to_token, seq_lens, extend_lens,
                             num_new_pages_per_topk, out_cache_loc, source_cache_loc,
                             target_cache_loc, last_page_lens_cumsum, duplicate_cache_len, pool_len,
                             topk, speculative_num_steps, page_size, bs_upper, iter_upper):
    """spec_utils.assign_draft_cache_locs, its part 1 (page size 1 or top-k 1, the case sglang
    launches it for here): each request's topk * steps draft slots into its req_to_token row after
    its seq_len.  The paged top-k > 1 duplication (parts 2 and 3) raises by name."""
    if not (page_size == 1 or topk == 1):
        raise NotImplementedError("simnpu: assign_draft_cache_locs with page_size %d and topk %d "
                                  "(the last-page duplication) has no stand-in" % (page_size, topk))
    copy_len = topk * speculative_num_steps
    for pid in range(req_pool_indices.shape[0]):
        row = req_to_token[int(req_pool_indices[pid])]
        kv_start = int(seq_lens[pid])
        row[kv_start:kv_start + copy_len] = out_cache_loc[pid * copy_len:(pid + 1) * copy_len].to(row.dtype)


def _align_evict_mask_to_page_size(seq_lens, evict_mask, page_size, num_draft_tokens, BLOCK_SIZE):
    """spec_utils.align_evict_mask_to_page_size: keep (un-evict) the draft slots of the page the
    accepted tokens end in.  ``evict_mask`` is [bs * num_draft_tokens]."""
    for bid in range(seq_lens.shape[0]):
        row = evict_mask[bid * num_draft_tokens:(bid + 1) * num_draft_tokens]
        num_false = num_draft_tokens - int(row.sum())
        seq_len = int(seq_lens[bid])
        start = (seq_len + num_false - 1) // page_size * page_size - seq_len
        for i in range(max(start, 0), min(start + page_size, num_draft_tokens)):
            row[i] = False


def _get_target_cache_loc(tgt_cache_loc, to_free_slots, accept_length, to_free_num_slots,
                          out_cache_loc, num_verify_tokens, num_verify_tokens_upper, bs_upper):
    """spec_utils.get_target_cache_loc: per request, its first accept_length + 1 verify slots into
    tgt_cache_loc and its last to_free_num_slots into to_free_slots, each packed after the earlier
    requests'."""
    for bid in range(accept_length.shape[0]):
        row = out_cache_loc[bid * num_verify_tokens:(bid + 1) * num_verify_tokens]
        start = int(accept_length[:bid].sum()) + bid
        n = int(accept_length[bid]) + 1
        tgt_cache_loc[start:start + n] = row[:n]
        free_n = int(to_free_num_slots[bid])
        free_start = int(to_free_num_slots[:bid].sum())
        to_free_slots[free_start:free_start + free_n] = row[num_verify_tokens - free_n:]


def _filter_finished_cache_loc(out_cache_loc, tgt_cache_loc, accept_length, accept_length_filter,
                               bs_upper, num_verify_tokens_upper):
    """spec_utils.filter_finished_cache_loc_kernel: the kept slots of the unfinished requests
    (accept_length_filter each, 0 for a finished one) packed into out_cache_loc."""
    for bid in range(accept_length.shape[0]):
        old = int(accept_length[:bid].sum()) + bid
        new = int(accept_length_filter[:bid].sum())
        n = int(accept_length_filter[bid])
        out_cache_loc[new:new + n] = tgt_cache_loc[old:old + n]


#: "module.function" of a triton kernel -> what it computes, in torch: sglang's own ``@triton.jit``
#: kernels, and sgl-kernel-npu's (shipped compiled, so the stub module hands out a JitKernel).
TRITON_KERNELS = {
    "sglang.srt.mem_cache.common.write_req_to_token_pool_triton": _write_req_to_token_pool,
    "sglang.srt.model_executor.forward_batch_info.compute_position_kernel": _compute_position,
    "sgl_kernel_npu.mem_cache.allocator.alloc_extend_kernel": _alloc_extend_kernel,
    "sglang.srt.speculative.spec_utils.create_extend_after_decode_spec_info": _create_extend_after_decode_spec_info,
    "sglang.srt.speculative.spec_utils.assign_req_to_token_pool": _assign_req_to_token_pool,
    "sglang.srt.speculative.spec_utils.assign_draft_cache_locs": _assign_draft_cache_locs,
    "sglang.srt.speculative.spec_utils.align_evict_mask_to_page_size": _align_evict_mask_to_page_size,
    "sglang.srt.speculative.spec_utils.get_target_cache_loc": _get_target_cache_loc,
    "sglang.srt.speculative.spec_utils.filter_finished_cache_loc_kernel": _filter_finished_cache_loc,
}


class JitKernel:
    """A triton kernel here: launching it (``kernel[grid](*args)``) runs its entry of
    TRITON_KERNELS; a kernel without one fails naming itself -- never a silent no-op."""

    def __init__(self, fn=None, name=None):
        self.fn = fn
        self.name = name or "%s.%s" % (fn.__module__, fn.__name__)
        self.__module__, _, self.__name__ = self.name.rpartition(".")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __getitem__(self, grid):
        run = TRITON_KERNELS.get(self.name)
        if run is None:
            raise NotImplementedError("simnpu: the triton kernel %s has no stand-in (add one to "
                                      "shimdev/simnpu/_ops.py TRITON_KERNELS)" % self.name)
        return lambda *args, **kwargs: run(*args, **{k: v for k, v in kwargs.items()
                                                     if k not in ("num_warps", "num_stages")})

    def __call__(self, *args, **kwargs):
        if self.fn is None:
            raise TypeError("%s is a triton kernel: launch it as kernel[grid](...)" % self.name)
        return self.fn(*args, **kwargs)  # called as a plain function (it is not one on a device)

    def __repr__(self):
        return "<simnpu triton kernel %s>" % self.name


def jit(fn=None, **options):
    """``@triton.jit`` and ``@triton.jit(**options)``."""
    if fn is None:
        return lambda f: JitKernel(f)
    return JitKernel(fn)


def swiglu_quant(x, group_list, group_list_type, need_quant=True):
    """sgl_kernel_npu.activation.swiglu_quant (a triton kernel with its Python launcher; 0.5.10+'s
    bf16 DeepEP experts call it with ``need_quant=False``): swiglu of the rows the group list
    covers (its last cumulative entry, type 0, or the sum of its counts, type 1), into a new
    ``[rows, h / 2]`` tensor (int8 with one scale per row, max |y| / 127, when ``need_quant``);
    the launcher's ``torch.empty`` rows past them are zero here.  Returns (out, scale)."""
    import torch

    if group_list_type not in (0, 1):
        raise ValueError(f"group_list_type must be 0 or 1, but got {group_list_type}")
    if group_list.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"group_list dtype must be torch.int32 or torch.int64, but got {group_list.dtype}")
    s, h = x.shape
    rows = int(group_list[-1]) if group_list_type == 0 else int(group_list.sum())
    out = torch.zeros((s, h // 2), dtype=torch.int8 if need_quant else x.dtype)
    scale = torch.zeros((s,), dtype=torch.float32)
    a, b = x[:rows, : h // 2].float(), x[:rows, h // 2:].float()
    y = (a * torch.sigmoid(a) * b).to(x.dtype)
    if need_quant:
        scale[:rows] = y.float().abs().amax(dim=-1) / 127
        out[:rows] = torch.round(y.float() / scale[:rows, None]).to(torch.int8)
    else:
        out[:rows] = y
    return out, scale


def kernel_stand_ins() -> dict:
    """{stub module: {name: stand-in}} for sgl-kernel-npu's kernels on the paths a server takes."""
    return {"sgl_kernel_npu.mem_cache.allocator": {
                "alloc_extend_kernel": JitKernel(name="sgl_kernel_npu.mem_cache.allocator.alloc_extend_kernel")},
            "sgl_kernel_npu.activation.swiglu_quant": {"swiglu_quant": swiglu_quant},
            "sgl_kernel_npu.sample.verify_tree_greedy": {"verify_tree_greedy": verify_tree_greedy},
            "triton": {"jit": jit}}


# == graph-only attention ops =======================================================================
#
# What sglang's NPU-graph decode (``ascend_backend.forward_decode_graph``, 0.5.9 - 0.5.11) and
# torch_npu's own ``_IFAv1DefaultHandler`` (``torch_npu/npu/_npugraph_handlers/ifa_handler.py``)
# call: the max-workspace query, the output-shape inference, and the ``.out`` overload that writes
# into preallocated outputs.  Schemas verbatim from libtorch_npu.so (the conformance test finds
# each one there).  ``.out`` registers ``Tensor[] out`` without a write annotation, though the
# kernel fills it: the graph recorder (``_graphs.py``) and the stream sanitizer are told so by
# ``WRITES_UNANNOTATED``.

_FIA_ARGS = NPU_SCHEMAS["npu_fused_infer_attention_score"][:-len(" -> (Tensor, Tensor)")]
GRAPH_SCHEMAS = {
    "npu_fused_infer_attention_score.out": (
        _FIA_ARGS[:-1] + ", Tensor? workspace=None, Tensor[] out) -> (Tensor, Tensor)"),
    "_npu_fused_infer_attention_score_get_max_workspace": _FIA_ARGS + " -> Tensor",
    "_npu_fused_infer_attention_score_infer_output": (
        '(Tensor query, Tensor value, *, str input_layout="BSH", Tensor? quant_scale2=None, '
        'Tensor? block_table=None, int num_heads=1, int num_key_value_heads=0, '
        'bool softmax_lse_flag=False, Tensor? query_rope=None) -> (Tensor, Tensor)'),
}
#: op -> arguments its kernel writes that its registered schema does not mark ``(a!)``.
WRITES_UNANNOTATED = {"npu_fused_infer_attention_score.out": ("out",)}
#: Bytes per query element the simulated workspace holds.  CANN sizes the real one inside
#: aclnnFusedInferAttentionScoreGetWorkspaceSize (not public); the simulation's is a real
#: uint8 tensor of ``WORKSPACE_BYTES_PER_QUERY_ELEMENT * query.numel()`` bytes (at least one
#: 512-byte line), so a capture holds memory for it as on a device.
WORKSPACE_BYTES_PER_QUERY_ELEMENT = 4


def _bsh_paged_decode(query, key, value, block_table, actual_seq_lengths_kv, num_heads,
                      num_key_value_heads, scale, block_size):
    """forward_decode_graph's MHA call: ``input_layout="BSH"`` queries ``[B, 1, N * D]``, a paged
    cache ``[blocks, block_size, H_kv * D]`` read through ``block_table`` for
    ``actual_seq_lengths_kv[b]`` tokens (a padded batch entry has 0: its row is zeros), no mask
    (each query token sees every cached token of its request)."""
    import torch

    op = "npu_fused_infer_attention_score"
    kv_heads = num_key_value_heads or num_heads
    if query.dim() != 3 or query.shape[1] != 1:
        raise NotImplementedError("simnpu: %s BSH with query %r (sglang's graph decode passes [B, 1, N*D])"
                                  % (op, tuple(query.shape)))
    if actual_seq_lengths_kv is None or len(actual_seq_lengths_kv) != query.shape[0]:
        raise RuntimeError("%s: actual_seq_lengths_kv %r for a batch of %d"
                           % (op, actual_seq_lengths_kv, query.shape[0]))
    if block_size and key.shape[1] != block_size:
        raise RuntimeError("%s: key cache blocks of %d tokens, block_size %d" % (op, key.shape[1], block_size))
    if query.shape[-1] % num_heads or num_heads % kv_heads:
        raise RuntimeError("%s: query %r for %d heads over %d key/value heads"
                           % (op, tuple(query.shape), num_heads, kv_heads))
    head_dim = query.shape[-1] // num_heads
    k_cache = key.reshape(key.shape[0], key.shape[1], kv_heads, -1)
    v_cache = value.reshape(value.shape[0], value.shape[1], kv_heads, -1)
    if k_cache.shape[-1] != head_dim:
        raise RuntimeError("%s: key head dim %d, query head dim %d" % (op, k_cache.shape[-1], head_dim))
    out = torch.zeros(query.shape[0], 1, num_heads * v_cache.shape[-1], dtype=query.dtype)
    for b, k, v in _paged_requests(op, k_cache, v_cache, block_table, actual_seq_lengths_kv):
        q = query[b].reshape(1, num_heads, head_dim)
        out[b] = _attend(q, k, v, scale, None).reshape(1, -1).to(query.dtype)
    return out, torch.zeros(1, dtype=query.dtype)


def _npu_fused_infer_attention_score_get_max_workspace(query, key, value, **kwargs):
    """A workspace for the ``.out`` call with the same arguments: a uint8 tensor (see
    WORKSPACE_BYTES_PER_QUERY_ELEMENT)."""
    import torch

    nbytes = max(512, -(-WORKSPACE_BYTES_PER_QUERY_ELEMENT * query.numel() // 512) * 512)
    return torch.empty(nbytes, dtype=torch.uint8)


def _npu_fused_infer_attention_score_infer_output(query, value, *, input_layout="BSH", quant_scale2=None,
                                                  block_table=None, num_heads=1, num_key_value_heads=0,
                                                  softmax_lse_flag=False, query_rope=None):
    """The outputs the ``.out`` call fills, uninitialised: attention_out of the query's shape with
    the value's head dim (BSH: ``[B, S, N * Dv]``; TND / BSND: ``[..., N, Dv]``), and softmax_lse
    (one element unless ``softmax_lse_flag``, which sglang never sets)."""
    import torch

    op = "_npu_fused_infer_attention_score_infer_output"
    _unsupported(op, quant_scale2=quant_scale2 is not None, softmax_lse_flag=softmax_lse_flag)
    kv_heads = num_key_value_heads or num_heads
    if input_layout == "BSH":
        value_dim = value.shape[-1] // kv_heads
        shape = (*query.shape[:-1], num_heads * value_dim)
    elif input_layout in ("TND", "BSND"):
        value_dim = value.shape[-1] // kv_heads if value.dim() == 3 else value.shape[-1]
        shape = (*query.shape[:-1], value_dim)
    else:
        raise NotImplementedError("simnpu: %s with input_layout=%r" % (op, input_layout))
    return torch.empty(shape, dtype=query.dtype), torch.empty(1, dtype=query.dtype)


def _npu_fused_infer_attention_score_out(query, key, value, *, workspace=None, out, **kwargs):
    """``.out``: the functional op's results written into ``out`` ([attention_out, softmax_lse]),
    which it returns; a workspace smaller than the max-workspace query's is refused."""
    op = "npu_fused_infer_attention_score.out"
    if len(out) != 2:
        raise RuntimeError("%s: out holds %d tensors, the op writes 2" % (op, len(out)))
    if workspace is not None:
        needed = _npu_fused_infer_attention_score_get_max_workspace(query, key, value).numel()
        if workspace.numel() * workspace.element_size() < needed:
            raise RuntimeError("%s: a workspace of %d bytes, the op needs %d"
                               % (op, workspace.numel() * workspace.element_size(), needed))
    attention, lse = npu_fused_infer_attention_score(query, key, value, **kwargs)
    if tuple(out[0].shape) != tuple(attention.shape):
        raise RuntimeError("%s: out[0] has shape %r, the attention output is %r"
                           % (op, tuple(out[0].shape), tuple(attention.shape)))
    out[0].copy_(attention)
    out[1].reshape(-1)[:lse.numel()].copy_(lse.reshape(-1)[:out[1].numel()])
    return out[0], out[1]


# == MLA's form of the fused attention (query_rope / key_rope) ======================================
#
# sglang 0.5.9 - 0.5.11's ascend backend with MLA: ``forward_decode_graph`` passes BSND queries
# ``[B, 1, N, kv_lora]`` (``q_nope`` after absorbing W_UK) with ``query_rope`` ``[B, 1, N, rope]``,
# the latent cache ``c_kv`` ``[blocks, page, H_kv * kv_lora]`` as both key and value and its rope
# cache ``[blocks, page, H_kv * rope]`` as ``key_rope``, ``sparse_mode=0``, no mask, the head count
# padded to a power of two (a padded head's query is zeros: its row is computed like any other);
# ``forward_mtp`` passes the same operands in TND with ``sparse_mode=3`` and the MTP mask.  A
# score is ``(q_nope . k_nope + q_rope . k_rope) * scale``; the output has the value's head dim
# (kv_lora).  The FRACTAL_NZ cache form (``SGLANG_USE_FIA_NZ``: 5-D caches) raises by name.


def _mla_rope_joined(query, key, query_rope, key_rope, input_layout, num_heads, num_key_value_heads):
    """(query, key) with the rope parts joined on the head dim: a score over the joined vectors is
    the op's nope + rope score."""
    import torch

    op = "npu_fused_infer_attention_score"
    if query_rope is None or key_rope is None:
        raise RuntimeError("%s: query_rope and key_rope come together (got %s only)"
                           % (op, "query_rope" if key_rope is None else "key_rope"))
    if input_layout not in ("BSND", "TND"):
        raise NotImplementedError("simnpu: %s with query_rope/key_rope and input_layout=%r (sglang's MLA "
                                  "paths pass BSND or TND)" % (op, input_layout))
    if key.dim() != 3 or key_rope.dim() != 3:
        raise NotImplementedError("simnpu: %s with %d-D key / %d-D key_rope caches (the FRACTAL_NZ form is "
                                  "not simulated; sglang passes [blocks, page, H_kv * D] without "
                                  "SGLANG_USE_FIA_NZ)" % (op, key.dim(), key_rope.dim()))
    if tuple(query_rope.shape[:-1]) != tuple(query.shape[:-1]) or tuple(key_rope.shape[:2]) != tuple(key.shape[:2]):
        raise RuntimeError("%s: query %r / query_rope %r or key %r / key_rope %r disagree outside the head dim"
                           % (op, tuple(query.shape), tuple(query_rope.shape), tuple(key.shape),
                              tuple(key_rope.shape)))
    kv_heads = num_key_value_heads or num_heads
    if key.shape[-1] % kv_heads or key_rope.shape[-1] % kv_heads:
        raise RuntimeError("%s: key %r / key_rope %r for %d key/value heads"
                           % (op, tuple(key.shape), tuple(key_rope.shape), kv_heads))
    joined_key = torch.cat([key.reshape(*key.shape[:2], kv_heads, -1),
                            key_rope.reshape(*key_rope.shape[:2], kv_heads, -1).to(key.dtype)], dim=-1)
    return (torch.cat([query, query_rope.to(query.dtype)], dim=-1),
            joined_key.reshape(*key.shape[:2], -1))


def _bsnd_paged_decode(query, key, value, block_table, actual_seq_lengths_kv, num_heads,
                       num_key_value_heads, scale, block_size, sparse_mode, atten_mask):
    """BSND queries ``[B, S, N, D]`` over a paged cache ``[blocks, page, H_kv * D]`` read through
    ``block_table`` for ``actual_seq_lengths_kv[b]`` tokens, ``sparse_mode=0`` without a mask: each
    query of request b sees all its cached tokens (a request with 0 tokens -- a padded batch entry
    -- gets zeros)."""
    import torch

    op = "npu_fused_infer_attention_score"
    if block_table is None or sparse_mode != 0 or atten_mask is not None:
        raise NotImplementedError("simnpu: %s BSND with sparse_mode=%r, %s mask and %s block table (sglang's "
                                  "MLA graph decode passes 0, no mask, a table)"
                                  % (op, sparse_mode, "a" if atten_mask is not None else "no",
                                     "a" if block_table is not None else "no"))
    kv_heads = num_key_value_heads or num_heads
    if query.dim() != 4 or query.shape[2] != num_heads or num_heads % kv_heads:
        raise RuntimeError("%s: BSND query %r for %d heads over %d key/value heads"
                           % (op, tuple(query.shape), num_heads, kv_heads))
    if actual_seq_lengths_kv is None or len(actual_seq_lengths_kv) != query.shape[0] \
            or block_table.shape[0] != query.shape[0]:
        raise RuntimeError("%s: actual_seq_lengths_kv %r / block_table %r for a batch of %d"
                           % (op, actual_seq_lengths_kv, tuple(block_table.shape), query.shape[0]))
    if block_size and key.shape[1] != block_size:
        raise RuntimeError("%s: key cache blocks of %d tokens, block_size %d" % (op, key.shape[1], block_size))
    k_cache = key.reshape(key.shape[0], key.shape[1], kv_heads, -1)
    v_cache = value.reshape(value.shape[0], value.shape[1], kv_heads, -1)
    if k_cache.shape[-1] != query.shape[-1]:
        raise RuntimeError("%s: key head dim %d, query head dim %d" % (op, k_cache.shape[-1], query.shape[-1]))
    out = torch.zeros(*query.shape[:3], v_cache.shape[-1], dtype=query.dtype)
    for b, k, v in _paged_requests(op, k_cache, v_cache, block_table, actual_seq_lengths_kv):
        out[b] = _attend(query[b], k, v, scale, None).to(query.dtype)
    return out, torch.zeros(1, dtype=query.dtype)


_GRAPH_KERNELS = {
    "npu_fused_infer_attention_score.out": _npu_fused_infer_attention_score_out,
    "_npu_fused_infer_attention_score_get_max_workspace": _npu_fused_infer_attention_score_get_max_workspace,
    "_npu_fused_infer_attention_score_infer_output": _npu_fused_infer_attention_score_infer_output,
}


def _graph_kernel(name):
    """The graph-only ops' stand-ins; ``.out`` is declared to the stream sanitizer with its ``out``
    marked written and returned (what the kernel does; the registered string does not say so)."""
    from ._sanitizer import declare_kernel

    fn = _GRAPH_KERNELS[name]
    if name not in WRITES_UNANNOTATED:
        return fn
    schema = GRAPH_SCHEMAS[name].replace("Tensor[] out)", "Tensor(a!)[] out)")
    schema = schema.replace("-> (Tensor, Tensor)", "-> (Tensor(a!), Tensor(a!))")  # it returns out
    return declare_kernel(name.split(".")[0] + schema, SOURCES["npu"])(fn)
