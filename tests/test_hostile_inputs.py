"""Hostile inputs (issue 11): the shim answers each with a clear message, a documented exit code
and never a traceback or a signal.  Where a crash is possible the probe runs in a subprocess.

* pickling / copying every wrapped target of a real release (``test_every_wrapped_target_...``);
"""
from __future__ import annotations

import pytest

import realsglang

PICKLE = r'''
import copy, importlib, pickle
import dill
import npu_shim
from npu_shim import runtime
importlib.import_module("sglang.srt.managers.scheduler")
for patch in ("zbal", "mla_weight_release", "dual_stream_experts"):
    for module in runtime.record(patch).patch.modules:
        importlib.import_module(module)

def resolve(target):
    module, qualname = target.split(":")
    owner = importlib.import_module(module)
    parts = qualname.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    return owner, parts[-1]

results = {}
for name, state in npu_shim.states().items():
    for target in state["wrappers"]:
        owner, attr = resolve(target)
        objects = {"": getattr(owner, attr)}
        if isinstance(owner, type):
            objects["bound"] = getattr(object.__new__(owner), attr)
        for how, obj in objects.items():
            key = "%s %s" % (target, how)
            try:
                back = pickle.loads(pickle.dumps(obj))
                dill_back = dill.loads(dill.dumps(obj))
                copied = copy.deepcopy(obj)
                results[key] = {
                    "same_function": all(x.__wrapped__ is obj.__wrapped__ if how == "" else
                                         x.__func__ is obj.__func__ if hasattr(x, "__func__") else
                                         x.__wrapped__.__func__ is obj.__wrapped__.__func__
                                         for x in (back, dill_back, copied)),
                    "still_wrapped": all(type(x).__name__.endswith("ShimWrapper")
                                         for x in (back, dill_back, copied)),
                    "global_by_name": how == "" and not isinstance(owner, type)
                                      and back is obj and copied is obj,
                }
            except Exception as exc:
                results[key] = repr(exc)
emit({"states": {k: v["state"] for k, v in npu_shim.states().items()}, "results": results})
'''


def test_every_wrapped_target_pickles_and_copies_like_the_plain_function():
    """pickle, copy.deepcopy and dill of each wrapper (functions, methods unbound and bound) work
    and give back the wrapper itself or one around the same function."""
    out = realsglang.run_in_release(
        "0.5.9", PICKLE, zbal=True,
        env={"SGLANG_ZBAL_LOCAL_MEM_SIZE": "4096", "SGLANG_NPU_USE_MULTI_STREAM": "1"})
    assert set(out["states"].values()) == {"applied"}, out["states"]
    results = out["results"]
    for target in ("sglang.srt.managers.scheduler:Scheduler.__init__ ",
                   "sglang.srt.managers.scheduler:Scheduler.__init__ bound",
                   "sglang.srt.utils.common:get_available_gpu_memory ",
                   "sglang.srt.hardware_backend.npu.modules.deepseek_v2_attention_mla_npu:npu_mla_preprocess ",
                   "sglang.srt.hardware_backend.npu.attention.mla_preprocess:"
                   "NPUFusedMLAPreprocess.mlaprolog_preprocess_weight bound"):
        assert target in results, sorted(results)
    for key, result in results.items():
        assert isinstance(result, dict), (key, result)
        assert result["same_function"] and result["still_wrapped"], (key, result)
        if ":" in key and "." not in key.split(":")[1].split()[0]:
            assert result["global_by_name"], (key, result)  # module-level: the very same object
