"""The triton kernels sglang launches itself (triton-ascend runs them on a device): each launch runs
its torch stand-in, a kernel without one fails naming itself."""
from __future__ import annotations


from .speculative import (
    _align_evict_mask_to_page_size,
    _assign_draft_cache_locs,
    _assign_req_to_token_pool,
    _create_extend_after_decode_spec_info,
    _filter_finished_cache_loc,
    _get_target_cache_loc)


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
                                      "shimdev/simnpu/_ops/triton.py TRITON_KERNELS)" % self.name)
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
