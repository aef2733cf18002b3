"""The patches, one module per feature.  Each module defines ``PATCH``, a ``patching.Patch``.

Registry (what, why, how to switch it off, upstream, when it can be removed):

* ``zbal`` -- ``npu_shim/patches/zbal.py``
  Targets: ``Scheduler.__init__``, ``ModelRunner.initialize``/``init_device_graphs``,
  ``utils.common.get_available_gpu_memory``/``get_npu_memory_capacity``, DeepEP's
  ``Buffer``/``Config``/``use_deepep``, ``parallel_state.init_distributed_environment`` and (0.5.10+)
  ``parallel_state._DEVICE_TO_DISTRIBUTED_BACKEND``.
  Why: memfabric's zero-buffer allocator takes over NPU memory (faster MoE dispatch, less memory).
  How: ``SGLANG_ZBAL_LOCAL_MEM_SIZE`` (MiB) > 0 turns it on (``SGLANG_ZBAL_BOOTSTRAP_URL`` optional);
  ``NPU_SHIM_ZBAL=0`` keeps it off.
  Upstream: sglang#24575, 0.5.12.  Remove when every supported image runs sglang >= 0.5.12.

* ``mla_weight_release`` -- ``npu_shim/patches/mla_weight_release.py``
  Targets: ``npu_mla_preprocess``, ``NPUFusedMLAPreprocess.mlaprolog_preprocess_weight`` (wrapped),
  ``NPUFusedMLAPreprocess.uses_mlaprolog`` (added), ``BaseTpWorker.update_weights_from_*`` /
  ``init_weights_update_group`` (wrapped: refused with (False, message) once weights are
  released); 0.5.9 - 0.5.19 code shapes pinned.
  Why: under PD disaggregation the fused mlaprolog path no longer reads the fused qkv_a weight
  (after its NZ copies) nor, on decode, ``w_kc``: their memory goes back to the device.  A released
  weight raises ``ReleasedWeightError`` if touched; LoRA / weight updates / speculative decoding keep it.
  How: on by default when the disaggregation role is prefill/decode; ``NPU_SHIM_MLA_WEIGHT_RELEASE=0``
  keeps the weights; ``NPU_SHIM_MLA_RELEASE_FORCE=1`` releases despite LoRA / weight updates.
  Upstream: sglang#38807, 0.5.20.  Remove when every supported image runs sglang >= 0.5.20.

* ``dual_stream_experts`` -- ``npu_shim/patches/dual_stream_experts.py``
  Targets: ``Glm4MoeSparseMoeBlock.forward_deepep``, ``Glm4MoeAttention.forward_prepare``.
  Why: GLM-4.x MoE overlaps shared experts (side stream) with routed experts (main stream) and
  uses the fused split_qkv_rmsnorm_rope kernel in decode.
  How: ``SGLANG_NPU_USE_MULTI_STREAM=1`` for the streams (extend/target-verify); the fused path is on
  (as upstream) wherever the image's ``sgl_kernel_npu`` has the kernel; ``NPU_SHIM_DUAL_STREAM=0`` for
  all of it.  Both wrappers stand in for part of a body: AST fingerprints of 0.5.7-0.5.9 guard them.
  Upstream: sglang#19246, 0.5.10.  Remove when every supported image runs sglang >= 0.5.10.
"""

import importlib

PATCH_MODULES = [
    "npu_shim.patches.zbal",
    "npu_shim.patches.mla_weight_release",
    "npu_shim.patches.dual_stream_experts",
]


class BrokenPatch:
    """Stands in for a feature module that cannot be loaded (an import error, a declaration
    error, no ``PATCH``): that patch alone is ``failed`` with the reason; the others work."""

    title = "(could not be loaded)"
    upstream_pr = upstream_release = remove_when = ""
    backport_range = ()
    reads = ()
    modules = ()
    trigger_env = {}

    def __init__(self, name, reason):
        from npu_shim import config

        self.name = name
        self.broken = reason
        self.switch = config.switch(name, "")

    def must_honour(self, environ):
        return False

    def origin(self):
        return "feature module npu_shim.patches.%s" % self.name


def load(module_name):
    """The module's PATCH, or a BrokenPatch saying why it cannot be had."""
    name = module_name.rsplit(".", 1)[-1]
    try:
        patch = importlib.import_module(module_name).PATCH
    except Exception as exc:  # noqa: BLE001 - one broken feature must not take the others down
        return BrokenPatch(name, "feature module %s cannot be loaded: %r" % (module_name, exc))
    if getattr(patch, "name", None) != name:
        return BrokenPatch(name, "%s.PATCH is named %r, not %r" % (module_name, getattr(patch, "name", None), name))
    return patch


def load_all():
    """The Patch of every registered module, in registry order."""
    return [load(name) for name in PATCH_MODULES]


def target_modules(patches):
    """Every module any of ``patches`` may touch, each once, in declaration order."""
    modules = []
    for patch in patches:
        modules += [m for m in patch.modules if m not in modules]
    return modules


def known_names():
    """The registered patch names (for NPU_SHIM_PATCHES)."""
    return [name.rsplit(".", 1)[-1] for name in PATCH_MODULES]


def all_variables(patches=None):
    """Every variable the shim reads: its own, then each patch's switch and the others it reads."""
    from npu_shim import config

    found = list(config.SHIM_VARIABLES)
    for patch in load_all() if patches is None else patches:
        found += [var for var in (patch.switch,) + tuple(patch.reads) if var not in found]
    return found
