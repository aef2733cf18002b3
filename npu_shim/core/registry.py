"""The registry: every feature module, in the order patches are decided and shown.

Each module ``npu_shim/patches/<name>.py`` defines ``PATCH`` (a ``core.framework.Patch`` named
``<name>``) and says in its docstring why, how, the upstream PR and when it can be removed; the
README has one row per patch.  tests/core/test_registry.py ties the three together, so adding
a patch is its module, its tests, its line here and its README row (docs/adding-a-patch.md).

A list of names and nothing else: it imports nothing, so the variables (``NPU_SHIM_PATCHES``)
and the loader (npu_shim/core/loading.py) can read it without loading a patch.  It lives in the
core, below everything that reads it (tests/test_layering.py), and is the one module outside
``patches/`` that names the patches (tests/core/test_no_patch_named.py).
"""

PATCH_MODULES = [
    "npu_shim.patches.zbal",
    "npu_shim.patches.mla_weight_release",
    "npu_shim.patches.dual_stream_experts",
]


def known_names():
    """The registered patch names (for NPU_SHIM_PATCHES)."""
    return [name.rsplit(".", 1)[-1] for name in PATCH_MODULES]
