"""pickle, copy.deepcopy and dill of every wrapper the shim put in a real release
(tests/test_hostile_inputs.py, 0.5.9, every patch applied): functions, methods unbound and bound;
and of every function it replaced outright (a plain function under sglang's name)."""
import copy
import importlib
import pickle

import dill
import npu_shim
from npu_shim.runtime import activation
from shimdev.programs import emit

importlib.import_module("sglang.srt.managers.scheduler")
for patch in ("zbal", "mla_weight_release", "dual_stream_experts"):
    for module in activation.RUNTIME.record(patch).patch.modules:
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
            # an abstract class (BaseTpWorker) is bound through its concrete subclass there
            cls = owner if not getattr(owner, "__abstractmethods__", None) else next(
                sub for sub in owner.__subclasses__()
                if sub.__module__ == owner.__module__ and not sub.__abstractmethods__)
            objects["bound"] = getattr(object.__new__(cls), attr)
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
                    "still_wrapped": all(type(x).__module__ == "npu_shim.runtime.targets"
                                         for x in (back, dill_back, copied)),
                    "global_by_name": how == "" and not isinstance(owner, type)
                                      and back is obj and copied is obj,
                }
            except Exception as exc:  # noqa: BLE001 - whatever fails is the fact
                results[key] = repr(exc)
replaced = {}
for name, state in npu_shim.states().items():
    for target, applied in state["targets"].items():
        if not applied or target in state["wrappers"]:
            continue
        owner, attr = resolve(target)
        obj = getattr(owner, attr)
        try:
            copies = (pickle.loads(pickle.dumps(obj)), dill.loads(dill.dumps(obj)), copy.deepcopy(obj))
            # by name, as any module-level function: the very same object back, sglang's underneath
            replaced[target] = {"same_object": all(x is obj for x in copies),
                                "over_sglang_s": getattr(obj, "__wrapped__", None) is not None}
        except Exception as exc:  # noqa: BLE001 - whatever fails is the fact
            replaced[target] = repr(exc)
emit({"states": {k: v["state"] for k, v in npu_shim.states().items()}, "results": results, "replaced": replaced})
