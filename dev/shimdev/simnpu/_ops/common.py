"""What several families share: the dtype numbers torch_npu's ops take, and the refusal of a mode
sglang never passes (by name, never a silent default)."""
from __future__ import annotations



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
