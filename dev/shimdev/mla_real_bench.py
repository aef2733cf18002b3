"""MLA weights freed, measured through the REAL sglang ``npu_mla_preprocess`` (used by
scripts/bench_mla_release.py).

One process in the release's environment (simulated NPU, the shim active, every trigger of the demo
set): for each (model, TP, role) a synthetic MLA attention layer of the model's public config shape
(shimdev.mla_kernels: real bf16 CPU tensors, ``w_kc`` laid out as sglang's loader leaves it) goes
through the release's own ``npu_mla_preprocess`` -> ``NPUFusedMLAPreprocess`` twice with the role
published through the real ``ServerArgs``.  Freed = the ``untyped_storage().nbytes()`` of the layer's
original fused qkv_a weight and ``w_kc`` before the first call minus after the second (what the
real code path and the shim's release left allocated); compared with the bytes the weights' shapes
say nothing reads any more (qkv_a ``[q_lora + kv_lora + rope, hidden]``; ``w_kc`` ``[heads/TP, nope,
kv_lora]`` on decode only), bf16.
"""
from shimdev import realsglang
from shimdev.bench_rows import MLA_CASES
from shimdev.demo_features import DEMO_ENV

RELEASE = "0.5.11"

_SNIPPET = r'''
from npu_shim.runtime import activation
from npu_shim.patches import mla_weight_release as R
from shimdev import mla_kernels as K

results = []
for model, tp, role in {cases!r}:
    record = activation.RUNTIME.record("mla_weight_release")  # None until the first layer imported its modules
    if record is not None:
        record.process_state.reset()
    K.publish_server_args(role)
    r = K.run_layer(model.lower(), tp)
    r.pop("layer")
    c = K.CONFIGS[model.lower()]
    shape_qkv = (c["q_lora"] + c["kv_lora"] + c["rope"]) * c["hidden"] * 2
    shape_w_kc = (c["heads"] // tp) * c["nope"] * c["kv_lora"] * 2 if role == "decode" else 0
    results.append({{"model": model, "tp": tp, "role": role, "layers": c["layers"],
                    "freed": r["freed"], "before": r["before"], "after": r["after"],
                    "shape": {{"qkv_a": shape_qkv, "w_kc": shape_w_kc}},
                    "kernels": r["kernels"]}})
emit({{"state": activation.RUNTIME.states()["mla_weight_release"]["state"], "results": results}})
'''


def measure(release=RELEASE, cases=MLA_CASES):
    """{"state": the patch's state in that process, "results": [per case]}."""
    return realsglang.run_in_release(release, _SNIPPET.format(cases=list(cases)), env=DEMO_ENV,
                                     zbal=True, timeout=900)
