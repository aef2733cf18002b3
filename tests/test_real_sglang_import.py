"""Import matrix: the real sglang modules of each release, executed on the simulated NPU with the
shim on PYTHONPATH exactly as a user has it (one subprocess per release, ~7-10 s each).

Every patch is triggered (zbal size set and the fake zbal importable, multi-stream on), so each
reaches the state the static matrix expects for that release; the test then looks at the loaded
modules themselves: which functions are wrapt wrappers, and whether the copies other modules took
with ``from ... import`` are the wrapped ones.
"""
from __future__ import annotations

import pytest

import realsglang
from expected_states import expected

from npu_shim.patches import load_all

# Every module a patch hooks (all of them exist from 0.5.9, the oldest release of this matrix).
TARGETS = sorted({module for patch in load_all() for module in patch.modules})

SNIPPET = """
import importlib, sys, traceback
import wrapt
failed = {}
for name in TARGETS:
    try:
        importlib.import_module(name)
    except BaseException as e:  # report every failing module, not only the first
        failed[name] = "".join(traceback.format_exception_only(type(e), e)).strip()
import sglang, torch
import npu_shim
from sglang.srt.utils.common import is_npu

def wrapped_names(module):
    # Functions defined in ``module`` that are wrappers (copies imported from elsewhere are not counted).
    found = []
    for key, value in vars(module).items():
        if isinstance(value, wrapt.FunctionWrapper) and value.__wrapped__.__module__ == module.__name__:
            found.append(key)
        elif isinstance(value, type) and value.__module__ == module.__name__:
            found += [key + "." + k for k, v in vars(value).items() if isinstance(v, wrapt.FunctionWrapper)]
    return sorted(found)

common = sys.modules["sglang.srt.utils.common"]
copies = {
    name: getattr(sys.modules[name], "get_available_gpu_memory", None) is common.get_available_gpu_memory
    for name in ("sglang.srt.utils", "sglang.srt.model_executor.model_runner")
}
emit({
    "failed": failed,
    "is_npu": is_npu(),
    "version": getattr(sglang, "__version__", None),
    "states": npu_shim.states(),
    "wrapped": {name: wrapped_names(sys.modules[name]) for name in TARGETS if name in sys.modules},
    "copies_are_the_module_function": copies,
    "gpu_memory_is_wrapped": isinstance(common.get_available_gpu_memory, wrapt.FunctionWrapper),
})
"""

TRIGGERS = {"SGLANG_ZBAL_LOCAL_MEM_SIZE": "4096", "SGLANG_NPU_USE_MULTI_STREAM": "1"}


@pytest.mark.parametrize("version", realsglang.IMPORT_MATRIX)
def test_real_modules_import_and_are_patched_as_expected(version, release_venv):
    release_venv(version)  # build (or fail) before running the snippet
    out = realsglang.run_in_release(version, "TARGETS = %r\n%s" % (TARGETS, SNIPPET), env=TRIGGERS,
                                    zbal=True, timeout=600)
    assert out["failed"] == {}, "sglang %s: modules failed to import: %s" % (version, out["failed"])
    assert out["is_npu"] is True and out["version"] == version

    states = out["states"]
    assert {name: s["state"] for name, s in states.items()} == expected(version), states
    # Exactly the targets of applied patches are wrapped, each where the patch says.
    wrappers = set()
    for record in states.values():
        if record["state"] == "applied":
            assert record["targets"] and all(record["targets"].values()), record
            wrappers |= set(record["wrappers"])
        else:
            assert not any(record["targets"].values()), record
    wrapped = {"%s:%s" % (module, name) for module, names in out["wrapped"].items() for name in names}
    assert wrapped == wrappers

    # from-import copies (sglang.srt.utils star-import, model_runner's from-import) are the
    # module's own function: the wrapper where zbal is applied, the original elsewhere.
    assert out["copies_are_the_module_function"] == {
        "sglang.srt.utils": True, "sglang.srt.model_executor.model_runner": True}
    assert out["gpu_memory_is_wrapped"] is (expected(version)["zbal"] == "applied")

