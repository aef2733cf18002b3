"""Pure-torch stand-ins for the NPU kernels the GLM-4.x MoE paths call, for the simulated NPU.

The simulated ``torch_npu`` / ``sgl_kernel_npu`` answer every call with an inert ``StubValue``;
the dual-stream/fused tests need real numbers from both the original and the patched paths:

* ``split_qkv_rmsnorm_rope`` -- reference for ``sgl_kernel_npu.norm.split_qkv_rmsnorm_rope``
  (sgl-kernel-npu's Triton kernel, the version with partial rotary): split qkv, RMSNorm each q/k
  head in float32 (weight, optional bias), neox rope on the first ``sin.shape[-1]`` dims of each
  head, v copied.  Differences from the Triton code: its intermediate cast goes to the input dtype
  (the Triton code casts to bfloat16 -- the same thing for the bf16 models it serves).
* ``split_qkv_rmsnorm_rope_full_head`` -- the older kernel (before partial rotary): rotates the
  whole head whatever the size of sin/cos; wrong for GLM-4.x, used to test that it is refused.
* ``npu_rms_norm`` / ``npu_mrope`` -- what ``RMSNorm.forward_npu`` and
  ``RotaryEmbedding.forward_npu`` call in torch_npu (mrope with sections [0, 0, 0] is plain rope).

``install(simnpu, kernel=...)`` puts them in place under their real module names.

Each is declared (``simnpu.declare_kernel``) with the schema of what it stands for, so the stream
sanitizer sees the reads and writes of the real kernel: torch_npu's ops from Ascend/op-plugin's
``op_plugin/config/op_plugin_functions.yaml`` (read at 517f2e7, 2026-08-21); the fused kernel is
a Triton launcher in sgl-kernel-npu's ``python/sgl_kernel_npu/sgl_kernel_npu/norm/
split_qkv_rmsnorm_rope.py`` (read at f425bdf), not a registered op: it allocates q, k and v with
``torch.empty`` and only reads its arguments, which the schema written for it says.  All four are
functional: none writes an input.
"""
from __future__ import annotations

import torch

from shimdev.simnpu import declare_kernel

OP_PLUGIN = "Ascend/op-plugin op_plugin/config/op_plugin_functions.yaml"
SGL_KERNEL_NPU = "sgl-kernel-npu norm/split_qkv_rmsnorm_rope.py (outputs from torch.empty)"
FUSED_SCHEMA = (
    "split_qkv_rmsnorm_rope(Tensor input, Tensor sin, Tensor cos, int q_hidden_size, "
    "int kv_hidden_size, int head_dim, float? eps=None, Tensor? q_weight=None, "
    "Tensor? k_weight=None, Tensor? q_bias=None, Tensor? k_bias=None, bool is_neox_style=True) "
    "-> (Tensor, Tensor, Tensor)")


def _rms(x, weight, eps, bias=None):
    x32 = x.float()
    out = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        out = out * weight.float()
    if bias is not None:
        out = out + bias.float()
    return out


def _neox(x, cos, sin):
    """x: (..., R); cos/sin: (T, 1, R) with each half repeated (as get_cos_sin_with_position)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@declare_kernel(FUSED_SCHEMA, SGL_KERNEL_NPU)
def split_qkv_rmsnorm_rope(input, sin, cos, q_hidden_size, kv_hidden_size, head_dim, eps=None,
                           q_weight=None, k_weight=None, q_bias=None, k_bias=None):
    tokens = input.shape[0]
    rope_dim = sin.shape[-1]
    sin = sin.reshape(tokens, 1, rope_dim).float()
    cos = cos.reshape(tokens, 1, rope_dim).float()
    q, k, v = input.split([q_hidden_size, kv_hidden_size, kv_hidden_size], dim=-1)

    def one(x, weight, bias):
        x = x.reshape(tokens, -1, head_dim)
        x = (_rms(x, weight, eps, bias) if eps is not None else x.float()).to(input.dtype).float()
        rot = _neox(x[..., :rope_dim], cos, sin)
        return torch.cat((rot, x[..., rope_dim:]), dim=-1).reshape(tokens, -1).to(input.dtype)

    return one(q, q_weight, q_bias), one(k, k_weight, k_bias), v.clone()


@declare_kernel(FUSED_SCHEMA, SGL_KERNEL_NPU + ", its version before partial rotary")
def split_qkv_rmsnorm_rope_full_head(input, sin, cos, q_hidden_size, kv_hidden_size, head_dim,
                                     eps=None, q_weight=None, k_weight=None, q_bias=None,
                                     k_bias=None):
    tokens = input.shape[0]
    # The old kernel reads HEAD_DIM values of sin/cos per token whatever their real width.
    flat_sin = sin.reshape(-1).float()
    flat_cos = cos.reshape(-1).float()
    need = tokens * head_dim
    sin_h = torch.cat((flat_sin, flat_sin))[:need].reshape(tokens, 1, head_dim)
    cos_h = torch.cat((flat_cos, flat_cos))[:need].reshape(tokens, 1, head_dim)
    q, k, v = input.split([q_hidden_size, kv_hidden_size, kv_hidden_size], dim=-1)

    def one(x, weight, bias):
        x = x.reshape(tokens, -1, head_dim)
        x = _rms(x, weight, eps, bias) if eps is not None else x.float()
        return _neox(x, cos_h, sin_h).reshape(tokens, -1).to(input.dtype)

    return one(q, q_weight, q_bias), one(k, k_weight, k_bias), v.clone()


@declare_kernel("npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
                OP_PLUGIN)
def npu_rms_norm(x, weight, epsilon=1e-6):
    out = _rms(x, weight, epsilon).to(x.dtype)
    rstd = torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + epsilon)
    return out, rstd


@declare_kernel("npu_mrope(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache, "
                "int head_size, *, int[]? mrope_section=None, str? rotary_mode='half', "
                "str? cache_mode='default') -> (Tensor, Tensor)", OP_PLUGIN)
def npu_mrope(positions, query, key, cos_sin_cache, head_size, mrope_section=None,
              rotary_mode="half"):
    assert rotary_mode == "half", "reference covers neox ('half') rope only"
    assert not any(mrope_section or ()), "reference covers plain rope (sections [0, 0, 0]) only"
    cos_sin = cos_sin_cache.index_select(0, positions.flatten()).float()
    cos, sin = cos_sin.chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)
    rotary_dim = cos.shape[-1]
    tokens = positions.numel()

    def one(x):
        shape = x.shape
        x = x.reshape(tokens, -1, head_size).float()
        rot = _neox(x[..., :rotary_dim], cos, sin)
        return torch.cat((rot, x[..., rotary_dim:]), dim=-1).reshape(shape).to(query.dtype)

    return one(query), one(key)


KERNEL_MODULE = "sgl_kernel_npu.norm.split_qkv_rmsnorm_rope"


def install(simnpu, kernel="partial"):
    """torch_npu's rms-norm/rope references, and the fused kernel: "partial" (current),
    "full_head" (the old kernel), or None (absent, as on 0.5.7-0.5.9 images)."""
    simnpu.add_stub("torch_npu", npu_rms_norm=npu_rms_norm, npu_mrope=npu_mrope)
    if kernel == "partial":
        simnpu.add_stub(KERNEL_MODULE, split_qkv_rmsnorm_rope=split_qkv_rmsnorm_rope)
    elif kernel == "full_head":
        simnpu.add_stub(KERNEL_MODULE, split_qkv_rmsnorm_rope=split_qkv_rmsnorm_rope_full_head)
    elif kernel is None:
        simnpu.remove_stub(KERNEL_MODULE)
    else:
        raise ValueError("kernel must be 'partial', 'full_head' or None")
