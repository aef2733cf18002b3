"""Aliases of an MLA weight taken before the first step keep it
(tests/patches/test_mla_weight_release_real.py, 0.5.11)."""
import torch
from npu_shim.runtime import activation
from shimdev.beds import mla_kernels as K
from shimdev.programs import emit
K.publish_server_args("decode")
KINDS = {
    "qkv.detach()": lambda m: m.fused_qkv_a_proj_with_mqa.weight.detach(),
    "qkv.view(-1)": lambda m: m.fused_qkv_a_proj_with_mqa.weight.view(-1),
    "qkv.data": lambda m: m.fused_qkv_a_proj_with_mqa.weight.data,
    "qkv.t()": lambda m: m.fused_qkv_a_proj_with_mqa.weight.t(),
    "w_kc.detach()": lambda m: m.w_kc.detach(),
    "w_kc._base": lambda m: m.w_kc._base,
}
out = {}
for kind, hold in KINDS.items():
    print("holding", kind, flush=True)  # a signal would show which kind
    # Each kind a fresh layer 0: start over, as a fresh decision would.
    activation.RUNTIME.record("mla_weight_release").process_state.reset()
    r = K.run_layer("glm-5", 16, hold=hold)
    weight = "qkv_a" if kind.startswith("qkv") else "w_kc"
    other = "w_kc" if weight == "qkv_a" else "qkv_a"
    with torch._C.DisableTorchFunctionSubclass():
        base = r["layer"].w_kc._base
    out[kind] = {"kept": r["freed"][weight] == 0, "other_freed": r["freed"][other] == r["expected"][other],
                 "sum_is_finite": bool(torch.isfinite(r["held"].float().sum())),
                 "w_kc_base": None if base is None else base.numel()}
emit(out)
