"""The DSA / MLA decode path's ops: the lightning indexer, sparse flash attention, the W8A8 matmul
and dynamic quantisation, the mlaprolog (``npu_mla_prolog_v3``), sgl-kernel-npu's
``batch_matmul_transpose``."""
from __future__ import annotations


from .common import (
    _dtype,
    _unsupported)
from .dense import (
    _rms,
    _rotate_half)


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
