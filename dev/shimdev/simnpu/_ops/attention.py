"""Paged attention: the KV cache writes, the eager paged and flash attention ops,
``npu_fused_infer_attention_score`` (BSH, BSND, TND) and its graph-only forms (the workspace
query, the output-shape inference, the ``.out`` overload a captured decode calls)."""
from __future__ import annotations

import math

from .common import (
    _unsupported)


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
