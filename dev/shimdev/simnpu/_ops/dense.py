"""The dense path's elementwise ops: RMS norms, SwiGLU, the rotary embeddings, the format cast."""
from __future__ import annotations



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


def npu_format_cast(input, acl_format, *, customize_dtype=None, input_dtype=None):
    """ND -> a device format (sglang casts MoE and MLA weights to FRACTAL_NZ): the same values in
    memory of their own, as on a device (the layout of the copy is the device's business)."""
    if customize_dtype is not None or input_dtype is not None:
        raise NotImplementedError("simnpu: npu_format_cast with a customize/input dtype")
    return input.clone()
