"""A release with the MLA weight release upstream (tests/patches/test_mla_weight_release_real.py,
0.5.23): the patch stands down."""
from npu_shim.runtime import activation
from shimdev.programs import emit
from sglang.srt.hardware_backend.npu.attention import mla_preprocess as P
from sglang.srt.hardware_backend.npu.modules import deepseek_v2_attention_mla_npu as N
emit({"state": activation.RUNTIME.states()["mla_weight_release"],
      "wrapped": type(N.npu_mla_preprocess).__name__,
      "weight_fn": type(P.NPUFusedMLAPreprocess.__dict__["mlaprolog_preprocess_weight"]).__name__,
      "uses_module": P.NPUFusedMLAPreprocess.uses_mlaprolog.__module__})
