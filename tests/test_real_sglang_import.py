"""The real sglang modules the shim patches import on CPU with the simulated NPU (one subprocess
per release; ~7-10 s each plus a one-time venv build of ~60-80 s)."""
from __future__ import annotations

import pytest

import realsglang

TARGETS = [
    "sglang.srt.utils.common",
    "sglang.srt.managers.scheduler",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.glm4_moe",
    "sglang.srt.distributed.parallel_state",
    "sglang.srt.layers.moe.token_dispatcher.deepep",
]
# npu_mla_preprocess / mlaprolog appear in 0.5.9; every release in the matrix is >= 0.5.9.
TARGETS_059 = [
    "sglang.srt.hardware_backend.npu.modules.deepseek_v2_attention_mla_npu",
    "sglang.srt.hardware_backend.npu.attention.mla_preprocess",
]

SNIPPET = """
import importlib, traceback
failed = {}
for name in TARGETS:
    try:
        importlib.import_module(name)
    except BaseException as e:  # report every failing module, not only the first
        failed[name] = "".join(traceback.format_exception_only(type(e), e)).strip()
import sglang, torch
from sglang.srt.utils.common import is_npu
from sglang.srt.utils import get_available_gpu_memory
emit({
    "failed": failed,
    "is_npu": is_npu(),
    "version": getattr(sglang, "__version__", None),
    "torch_npu_available": torch.npu.is_available(),
    "sim_release": simnpu.installed()["release"],
    "stub_roots": sorted({n.split(".")[0] for n in simnpu.STUB_IMPORTS}),
    "shim_modules": sorted(m for m in __import__("sys").modules if m.startswith("npu_shim")),
})
"""


@pytest.mark.parametrize("version", realsglang.IMPORT_MATRIX)
def test_real_modules_import_with_simulated_npu(version, release_venv):
    release_venv(version)  # build (or fail) before timing the snippet
    targets = TARGETS + TARGETS_059
    out = realsglang.run_in_release(
        version, f"TARGETS = {targets!r}\n" + SNIPPET,
        env={"NPU_SHIM_ENABLED": "0"}, timeout=600)
    assert out["failed"] == {}, f"sglang {version}: modules failed to import: {out['failed']}"
    assert out["is_npu"] is True
    assert out["torch_npu_available"] is True
    assert out["sim_release"] == version
    assert out["version"] == version
    # Only the stubs the release needs were pulled in.
    assert "sgl_kernel" not in out["stub_roots"] or version in ("0.5.9", "0.5.11"), out["stub_roots"]
