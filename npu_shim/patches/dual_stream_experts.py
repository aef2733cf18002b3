"""GLM-4.x MoE dual-stream experts + fused qkv-rmsnorm-rope (placeholder, being written)."""

from npu_shim import config
from npu_shim.patching import Patch


class DualStreamExperts(Patch):
    name = "dual_stream_experts"
    title = "GLM-4.x MoE: shared experts on a side stream; fused qkv-rmsnorm-rope in decode"
    upstream_pr = "sgl-project/sglang#19246"
    upstream_release = "0.5.10"
    backport_range = "0.5.7 - 0.5.9"
    remove_when = "every supported image runs sglang >= 0.5.10"
    switch = config.DUAL_STREAM
    reads = (config.NPU_USE_MULTI_STREAM,)
    modules = ("sglang.srt.models.glm4_moe",)

    def probe(self, view):
        return None

    def trigger(self, environ):
        return "not implemented yet"

    def targets(self, view):
        return []


PATCH = DualStreamExperts()
