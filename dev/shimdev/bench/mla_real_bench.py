"""MLA weights freed, measured through the REAL sglang ``npu_mla_preprocess`` (used by
scripts/bench_mla_release.py).

One process in the release's environment (simulated NPU, the shim active, every trigger of the demo
set): for each (model, TP, role) a synthetic MLA attention layer of the model's public config shape
(shimdev.beds.mla_kernels: real bf16 CPU tensors, ``w_kc`` laid out as sglang's loader leaves it) goes
through the release's own ``npu_mla_preprocess`` -> ``NPUFusedMLAPreprocess`` twice with the role
published through the real ``ServerArgs``.  Freed = the ``untyped_storage().nbytes()`` of the layer's
original fused qkv_a weight and ``w_kc`` before the first call minus after the second (what the
real code path and the shim's release left allocated); compared with the bytes the weights' shapes
say nothing reads any more (qkv_a ``[q_lora + kv_lora + rope, hidden]``; ``w_kc`` ``[heads/TP, nope,
kv_lora]`` on decode only), bf16.
"""
from shimdev.envs import realsglang
from shimdev.bench.bench_rows import MLA_CASES
from shimdev.beds.demo_features import DEMO_ENV

RELEASE = "0.5.11"

def measure(release=RELEASE, cases=MLA_CASES):
    """{"state": the patch's state in that process, "results": [per case]}."""
    return realsglang.run_program(release, "mla_release_measure", list(cases), env=DEMO_ENV, zbal=True,
                                  timeout=900)
