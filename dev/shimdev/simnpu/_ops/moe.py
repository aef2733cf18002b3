"""The MoE path's ops: gating, routing, the grouped matmul, finalising, and sgl-kernel-npu's
``swiglu_quant``."""
from __future__ import annotations

import math

from .common import (
    _dtype,
    _unsupported)


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


def swiglu_quant(x, group_list, group_list_type, need_quant=True):
    """sgl_kernel_npu.activation.swiglu_quant (a triton kernel with its Python launcher; 0.5.10+'s
    bf16 DeepEP experts call it with ``need_quant=False``): swiglu of the rows the group list
    covers (its last cumulative entry, type 0, or the sum of its counts, type 1), into a new
    ``[rows, h / 2]`` tensor (int8 with one scale per row, max |y| / 127, when ``need_quant``);
    the launcher's ``torch.empty`` rows past them are zero here.  Returns (out, scale).

    The number of rows stays on the device, as in the kernel: sgl-kernel-npu's launcher
    (``python/sgl_kernel_npu/sgl_kernel_npu/activation/swiglu_quant.py``) hands ``group_list`` to
    ``_swiglu_quant_kernel`` as a pointer, and the kernel loads the total itself (``tl.load`` of the
    cumulative entry, or ``tl.sum`` of the counts) -- no host read, so the call is captured into an
    NPU graph and a replay covers the rows of the group list it meets then.  Here the rows past the
    total are masked on the device rather than sliced on the host (a slice would need the number
    on the host: a device-to-host read the graph capture refuses)."""
    import torch

    if group_list_type not in (0, 1):
        raise ValueError(f"group_list_type must be 0 or 1, but got {group_list_type}")
    if group_list.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"group_list dtype must be torch.int32 or torch.int64, but got {group_list.dtype}")
    s, h = x.shape
    total = group_list[-1] if group_list_type == 0 else group_list.sum()
    covered = torch.arange(s, device=x.device) < total  # [s] bool, on the device
    a, b = x[:, : h // 2].float(), x[:, h // 2:].float()
    y = (a * torch.sigmoid(a) * b).to(x.dtype)
    if not need_quant:
        return torch.where(covered[:, None], y, torch.zeros((), dtype=x.dtype)), \
            torch.zeros((s,), dtype=torch.float32, device=x.device)
    scale = torch.where(covered, y.float().abs().amax(dim=-1) / 127, 0.0)
    q = torch.where(covered[:, None], torch.round(y.float() / scale[:, None]), 0.0)
    return q.to(torch.int8), scale
