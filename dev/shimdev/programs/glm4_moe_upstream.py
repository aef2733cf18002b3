"""A release with the dual-stream experts upstream (tests/patches/test_dual_stream_experts_real.py,
0.5.11): the patch stands down, glm4_moe is the release's own."""
import sglang.srt.models.glm4_moe as m
from npu_shim.runtime import activation
from shimdev.programs import emit

emit({"state": activation.RUNTIME.states()["dual_stream_experts"],
      "deepep": type(m.Glm4MoeSparseMoeBlock.__dict__["forward_deepep"]).__name__,
      "prepare": type(m.Glm4MoeAttention.__dict__["forward_prepare"]).__name__})
