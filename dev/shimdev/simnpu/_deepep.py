"""DeepEP's dispatch and combine on the simulated NPU, for one expert-parallel rank.

On an Ascend image sglang's ``token_dispatcher/deepep.py`` imports ``deep_ep`` (sgl-kernel-npu's
``python/deep_ep``: a Python ``Buffer`` over the C++ runtime ``deep_ep_cpp``), or -- with zbal --
zbal's ``zbal_buffer.Buffer`` over ``zbal.zbal.deepep_adaptor.Buffer``.  Both Python layers hand
the work to a runtime with the same calls (``get_dispatch_layout``, ``intranode_dispatch``,
``intranode_combine``, ``low_latency_dispatch``, ``low_latency_combine``).  ``Runtime`` here is
that runtime in pure torch, with zbal's adaptor's argument lists (the real ``zbal_buffer.py``
calls it unchanged: ``simzbal/native.py``); ``Buffer`` is the ``deep_ep`` package's Buffer as
sglang calls it (the stand-in module ``deep_ep`` in server mode), over the same runtime.

What the kernels compute, on the NPU (MoeDistributeDispatch / MoeDistributeCombine, which both
runtimes launch), and here:

* dispatch: every (token, k) slot whose expert is on this rank, its token's row, sorted by
  expert (stably) -- the rows the grouped matmul reads with ``group_list`` = the count per local
  expert (``group_list_type`` 1); the low-latency dispatch with ``use_fp8`` quantises the rows to
  int8 with one float32 scale per row (the NPU's "fp8" dispatch is int8);
* combine: each token's rows back, times its top-k weight, summed in float32, in x's dtype (the
  NPU combine applies the weights: sglang's NPU expert path does not).

Only one rank is simulated: a group of more raises (the ranks' rows would cross through HCCL).
Nothing here is asynchronous: an event is already complete.
"""
from __future__ import annotations

import sys


class EventHandle:
    """A finished event (``deep_ep_cpp.EventHandle`` / the adaptor's)."""

    def current_stream_wait(self):
        return None


class EventOverlap:
    """``deep_ep.utils.EventOverlap``: the event and the tensors it keeps alive."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self):
        if self.event is not None:
            self.event.current_stream_wait()


class Config:
    def __init__(self, num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256,
                 num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=128):
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        return self.num_max_nvl_chunked_recv_tokens * hidden_bytes * num_ranks

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        return 0  # intranode only

    def __eq__(self, other):
        return isinstance(other, Config) and vars(self) == vars(other)


def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
    return num_max_dispatch_tokens_per_rank * hidden * num_ranks * 2 * 2


#: Counts of what ran, per process (read by tests through the scheduler's log, and here).
CALLS = {"dispatch": 0, "combine": 0, "low_latency_dispatch": 0, "low_latency_combine": 0}


def _expand(x, topk_idx, num_experts, fixed=False):
    """(rows sorted by expert, the slot order, counts per expert).  ``fixed`` (the low-latency
    dispatch, which decode and target-verify graphs capture): every (token, k) slot, the slots of
    no expert (-1) last, so the shapes follow the input's and nothing is read back to the host --
    the rows past the counts' sum are not the experts' (the grouped matmul leaves them alone)."""
    import torch

    k = topk_idx.shape[1]
    flat = topk_idx.reshape(-1).long()
    valid = flat >= 0
    order = torch.sort(torch.where(valid, flat, num_experts), stable=True).indices
    if fixed:
        # (made from a device tensor: a capture records it, so each replay starts from zeros)
        counts = flat.new_zeros(num_experts + 1).scatter_add_(
            0, torch.where(valid, flat, num_experts), torch.ones_like(flat))[:num_experts]
    else:
        order = order[: int(valid.sum())]
        counts = torch.bincount(flat[valid], minlength=num_experts)[:num_experts]
    return x[order // k].clone(), order, counts


def _combine(x, order, topk_idx, topk_weights, tokens):
    import torch

    k = topk_idx.shape[1]
    out = x.new_zeros((tokens, x.shape[-1]), dtype=torch.float32)  # recorded in a capture: zeros each replay
    # a slot of no expert (-1: a padded token) adds nothing
    weights = torch.where(topk_idx.reshape(-1) >= 0, topk_weights.reshape(-1).float(), 0.0)[order]
    out.index_add_(0, order // k, x[: order.numel()].float() * weights[:, None])
    return out.to(x.dtype)


def _int8_per_row(x):
    import torch

    scale = x.float().abs().amax(dim=-1).clamp(min=1e-12) / 127.0
    q = torch.round(x.float() / scale[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scale


class Runtime:
    """The runtime behind a Buffer (zbal's adaptor argument lists), for one rank."""

    def __init__(self, rank, group_size, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 group_name="", *rest):
        if group_size != 1:
            raise NotImplementedError("simnpu: DeepEP dispatch/combine is simulated for one expert-"
                                      "parallel rank, this group has %d" % group_size)
        self.rank, self.group_size = rank, group_size
        self.low_latency_mode = low_latency_mode

    def get_num_rdma_ranks(self):
        return 1

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        import torch

        flat = topk_idx.reshape(-1).long()
        per_expert = torch.bincount(flat[flat >= 0], minlength=num_experts)[:num_experts].to(torch.int32)
        in_rank = (topk_idx >= 0).any(dim=1, keepdim=True).to(torch.int32)
        per_rank = in_rank.sum(0).to(torch.int32)
        return per_rank, None, per_expert, in_rank, EventHandle()

    def intranode_dispatch(self, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank,
                           is_token_in_rank, num_tokens_per_expert, num_worst_tokens, config,
                           previous_event, async_finish, allocate_on_comm_stream, use_quant):
        if use_quant or x_scales is not None:
            raise NotImplementedError("simnpu: DeepEP normal dispatch with int8 quantisation")
        rows, order, counts = _expand(x, topk_idx, int(num_tokens_per_expert.numel()))
        CALLS["dispatch"] += 1
        return (rows, None, topk_idx, topk_weights, [int(c) for c in counts.tolist()], order, counts,
                EventHandle())

    def intranode_combine(self, x, topk_idx, topk_weights, put_offset, balance_matrix,
                          previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        CALLS["combine"] += 1
        return _combine(x, put_offset, topk_idx, topk_weights, topk_idx.shape[0]), None, EventHandle()

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        return None

    def low_latency_dispatch(self, x, topk_idx, cumulative_local_expert_recv_stats,
                             num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale,
                             use_ue8m0, async_finish, return_recv_hook):
        import torch

        if x.shape[0] > num_max_dispatch_tokens_per_rank:
            raise RuntimeError("low_latency_dispatch: %d tokens, more than num_max_dispatch_tokens_"
                               "per_rank %d" % (x.shape[0], num_max_dispatch_tokens_per_rank))
        rows, order, counts = _expand(x, topk_idx, num_experts, fixed=True)
        scales = None
        if use_fp8:
            rows, scales = _int8_per_row(rows)
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += counts.to(cumulative_local_expert_recv_stats.dtype)
        CALLS["low_latency_dispatch"] += 1
        return rows, scales, counts.to(torch.int32), order, counts, EventHandle(), (lambda: None)

    def low_latency_combine(self, x, topk_idx, topk_weights, src_info, layout_range,
                            num_max_dispatch_tokens_per_rank, num_experts, packed_recv_count,
                            zero_copy, async_finish, return_recv_hook, out):
        combined = _combine(x, src_info, topk_idx, topk_weights, topk_idx.shape[0])
        if out is not None:
            out.copy_(combined)
            combined = out
        CALLS["low_latency_combine"] += 1
        return combined, EventHandle(), (lambda: None)


class Buffer:
    """``deep_ep.Buffer`` (sgl-kernel-npu's Python layer) as sglang calls it, over ``Runtime``."""

    num_sms: int = 20

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=12, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                 meta_addr=0):
        self.rank, self.group_size = group.rank(), group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.runtime = Runtime(self.rank, self.group_size, num_nvl_bytes, num_rdma_bytes,
                               low_latency_mode, "")
        # what a test reads in the server's log: which DeepEP took the job
        print("[simnpu] deep_ep.Buffer: rank %d of %d (sgl-kernel-npu's DeepEP, simulated)"
              % (self.rank, self.group_size), file=sys.stderr, flush=True)

    #: The EP sizes deep_ep's Buffer recommends configs for (its ``config_map``; zbal's Buffer has
    #: the same): for any other -- one rank included -- sglang must be given ``--deepep-config``.
    CONFIG_RANKS = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)

    @staticmethod
    def get_dispatch_config(num_ranks):
        assert num_ranks in Buffer.CONFIG_RANKS, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, 24 if num_ranks == 2 else 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks):
        assert num_ranks in Buffer.CONFIG_RANKS, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, 10 if num_ranks == 2 else 4, 256, 6, 128)

    @staticmethod
    def set_num_sms(new_num_sms):
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture():
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
        return get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                              num_experts)

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        *layout, event = self.runtime.get_dispatch_layout(topk_idx, num_experts, None, async_finish,
                                                          allocate_on_comm_stream)
        return (*layout, EventOverlap(event))

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        self.runtime.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None,
                 async_finish=False, allocate_on_comm_stream=False, dispatch_wait_recv_cost_stats=None):
        if isinstance(x, tuple):
            raise NotImplementedError("Not support fp8")
        if handle is not None:
            raise NotImplementedError("Optional communication handle is not supported yet.")
        assert (num_tokens_per_rank is not None and is_token_in_rank is not None
                and num_tokens_per_expert is not None)
        recv_x, _, recv_idx, recv_weights, counts, order, balance, event = self.runtime.intranode_dispatch(
            x, None, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
            num_tokens_per_expert, num_worst_tokens, config, None, async_finish,
            allocate_on_comm_stream, False)
        handle = (is_token_in_rank, topk_idx, topk_weights, order, balance)
        return recv_x, recv_idx, recv_weights, counts, handle, EventOverlap(event)

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False, combine_send_cost_stats=None):
        _, topk_idx, topk_weights_ori, order, balance = handle
        recv_x, recv_weights, event = self.runtime.intranode_combine(x, topk_idx, topk_weights_ori,
                                                                     order, balance)
        return recv_x, recv_weights, EventOverlap(event)

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None, use_fp8=True, round_scale=False,
                             use_ue8m0=False, async_finish=False, return_recv_hook=False):
        rows, scales, count, src_info, layout, event, hook = self.runtime.low_latency_dispatch(
            x, topk_idx.int(), cumulative_local_expert_recv_stats, num_max_dispatch_tokens_per_rank,
            num_experts, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)
        handle = (src_info, layout, num_max_dispatch_tokens_per_rank, x.size(1), num_experts, count)
        return ((rows, scales) if use_fp8 else rows), count, handle, EventOverlap(event), hook

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, zero_copy=False,
                            async_finish=False, return_recv_hook=False, out=None):
        src_info, layout, num_max, hidden, num_experts, count = handle
        combined, event, hook = self.runtime.low_latency_combine(
            x, topk_idx.int(), topk_weights, src_info, layout, num_max, num_experts, count,
            zero_copy, async_finish, return_recv_hook, out)
        return combined, EventOverlap(event), hook


def stand_in_modules() -> dict:
    """{module: {name: object}} of the ``deep_ep`` stand-in (server mode)."""
    return {"deep_ep": {"Buffer": Buffer, "Config": Config, "EventOverlap": EventOverlap},
            "deep_ep.utils": {"EventOverlap": EventOverlap}}
