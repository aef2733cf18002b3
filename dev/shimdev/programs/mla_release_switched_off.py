"""mla_weight_release switched off (tests/patches/test_mla_weight_release_real.py, 0.5.19):
nothing touched."""
from shimdev.beds import mla_kernels as K
from shimdev.programs import emit
from npu_shim.runtime import activation
from sglang.srt.hardware_backend.npu.attention import mla_preprocess as P
from sglang.srt.hardware_backend.npu.modules import deepseek_v2_attention_mla_npu as N
K.publish_server_args("decode")
r = K.run_layer("glm-5", 16)
from sglang.srt.managers import tp_worker as TW  # noqa: E402 - imported after the layer ran, as the test had it
emit({"state": activation.RUNTIME.states()["mla_weight_release"], "freed": r["freed"],
      "alt_stream": K.run_alt_stream_step(), "wrapped": type(N.npu_mla_preprocess).__name__,
      "update_fn": type(TW.BaseTpWorker.__dict__["update_weights_from_disk"]).__name__,
      "has_method": hasattr(P.NPUFusedMLAPreprocess, "uses_mlaprolog")})
