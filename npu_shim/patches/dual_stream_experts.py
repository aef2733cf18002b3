"""GLM-4.x MoE on NPU: shared experts on a side stream, fused qkv-rmsnorm-rope in decode.

Why: in a GLM-4.5/4.6/4.7 MoE layer the shared experts and the routed experts read the same
hidden states and are independent until their outputs are added, so on an NPU the shared experts
can run on a second stream while gate -> topk -> routed experts run on the main one.  In decode,
one Triton kernel of ``sgl_kernel_npu`` (``norm.split_qkv_rmsnorm_rope``) replaces the three
launches split -> q/k RMSNorm -> rope of every attention layer.

How (two sub-features, gated as upstream 0.5.10 gates them):

* dual-stream experts -- ``Glm4MoeSparseMoeBlock.forward_deepep`` is wrapped when
  ``SGLANG_NPU_USE_MULTI_STREAM=1`` (upstream's variable).  For extend/target-verify batches the
  wrapper runs shared+routed experts itself: the side stream waits for the main stream, the shared
  experts are queued on it; gate, topk and routed experts are queued on the main stream; the main
  stream waits for the side stream *before* the two outputs are added.  Decode, and empty batches,
  go to the original method.  One side stream per main stream (upstream: one per process),
  created on first use: a draft model on a stream of its own gets its own side stream.
* fused decode path -- ``Glm4MoeAttention.forward_prepare`` is wrapped when the image's
  ``sgl_kernel_npu`` has ``norm.split_qkv_rmsnorm_rope`` with the signature upstream's call binds
  and partial-rotary support, both read from the kernel's ``def`` (``kernel_support``: the same
  check on the file before anything is patched and on the loaded kernel at its first call).
  Outside extend/draft-extend/mixed (as upstream: decode, target-verify, draft-extend-v2, dLLM
  extend, idle -- every mode but those three) it calls the kernel instead of split -> qk-norm -> rope, with
  cos/sin computed once per step at the first layer.  Layers the kernel would compute differently
  (no qk-norm, q/k eps differ, non-neox rope, 2-D positions, a kernel without partial-rotary
  support) keep the original path, and the reason is put into the patch's status details.

Both wrappers re-implement part of a method body, so each target carries the AST fingerprint of
the body it stands in for (0.5.7, 0.5.8 and 0.5.9 share one): any other code is ``unsupported``.
States: ``applied`` when at least one sub-feature applies (the reason says which, and why the
other does not); ``inactive`` when the image has no usable kernel and the streams are not asked for
(nothing to do); ``unsupported`` when a fingerprint differs or the kernel's signature is one the
shim does not know; ``upstream`` from 0.5.10.  ``NPU_SHIM_DUAL_STREAM_EXPERTS=0`` (or the older
``NPU_SHIM_DUAL_STREAM=0``) switches all of it off.

Upstream: sgl-project/sglang#19246 ("[NPU] optimize glm4.7"), sglang 0.5.10
(``hardware_backend/npu/utils.py``: ``process_shared_expert``, ``wait_share_stream``).
Remove when every supported image runs sglang >= 0.5.10.
"""
from npu_shim.core import config
from npu_shim.core.framework import Patch, Report

GLM4_MOE = "sglang.srt.models.glm4_moe"
NPU_UTILS = "sglang.srt.hardware_backend.npu.utils"

MULTI_STREAM = config.boolean(
    "SGLANG_NPU_USE_MULTI_STREAM", False,
    "Run GLM-4.x shared experts on a side stream during extend/verify (upstream name and meaning).")


class DualStreamExpertsReport(Report):
    def check_facts(self):
        problem = PATCH.implementation().kernel_problem()
        return {"kernel": {"label": "sgl_kernel_npu", "ok": problem is None,
                           "text": "split_qkv_rmsnorm_rope usable" if problem is None else str(problem)}}


class DualStreamExperts(Patch):
    title = "GLM-4.x MoE: shared experts on a side stream; fused qkv-rmsnorm-rope in decode"
    upstream_pr = "sgl-project/sglang#19246"
    upstream_release = "0.5.10"
    backport_range = ("0.5.7", "0.5.9")
    remove_when = "every supported image runs sglang >= 0.5.10"
    switch_doc = "Switch for the GLM-4.x MoE dual-stream experts and fused qkv-rmsnorm-rope backport."
    switch_aliases = ("NPU_SHIM_DUAL_STREAM",)
    reads = (MULTI_STREAM,)
    trigger_env = {MULTI_STREAM.name: "1"}
    modules = (GLM4_MOE,)
    report = DualStreamExpertsReport()

    def probe(self, view):
        module = view.module(GLM4_MOE)
        if (module is not None and module.contains(r"process_shared_expert\(")
                and view.has(NPU_UTILS, "process_shared_expert")):
            return "glm4_moe runs shared experts through hardware_backend.npu.utils.process_shared_expert"
        return None


PATCH = DualStreamExperts()
