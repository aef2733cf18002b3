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
  names are the ones sglang passes by keyword.

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


def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    slots = slot_indices.long().flatten()
    heads, dim = key_cache.shape[-2], key_cache.shape[-1]
    key_cache.view(-1, heads, dim)[slots] = key.reshape(-1, heads, dim).to(key_cache.dtype)
    heads, dim = value_cache.shape[-2], value_cache.shape[-1]
    value_cache.view(-1, heads, dim)[slots] = value.reshape(-1, heads, dim).to(value_cache.dtype)


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


# -- registration -----------------------------------------------------------------------------------

def define() -> None:
    """Define every op once in this process (``torch.ops.npu.*``, ``torch.ops.atb.*``)."""
    import torch

    here = globals()
    for namespace, schemas in (("npu", NPU_SCHEMAS), ("atb", ATB_SCHEMAS)):
        lib = torch.library.Library(namespace, "FRAGMENT")
        for name, schema in schemas.items():
            lib.define(name + schema)
            lib.impl(name, here[name], "CompositeExplicitAutograd")
        _LIBRARIES.append(lib)


def torch_npu_names() -> dict:
    """What ``torch_npu.<name>`` is on a device: the op itself, as torch_npu binds it."""
    import torch

    names = {name: getattr(torch.ops.npu, name) for name in NPU_SCHEMAS}
    names.update({name: getattr(torch.ops.atb, name) for name in ATB_SCHEMAS})
    return names


def _alloc_extend_kernel(prefix_lens, seq_lens, last_loc, free_pages, out_indices, bs_upper,
                         page_size, max_num_extend_tokens):
    """sgl_kernel_npu.mem_cache.allocator.alloc_extend_kernel: what sglang's own
    ``alloc_extend_naive`` computes (the path sglang itself takes past 200 new pages)."""
    from sglang.srt.mem_cache.allocator import alloc_extend_naive

    alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size,
                       out_indices.device)


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


def kernel_stand_ins() -> dict:
    """{stub module: {name: stand-in}} for sgl-kernel-npu's kernels on the dense path."""
    return {"sgl_kernel_npu.mem_cache.allocator": {
                "alloc_extend_kernel": JitKernel(name="sgl_kernel_npu.mem_cache.allocator.alloc_extend_kernel")},
            "triton": {"jit": jit}}
