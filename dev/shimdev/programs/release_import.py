"""One release imported for real with the shim on (shimdev.beds.import_probe.probe, the import matrix
and scripts/release_report.py): every module a patch targets imported, the states, the wrapt
wrappers, the ``from ... import`` copies, then each applied feature's driver and the dual-stream
races.  Argument: the target modules (``import_probe.TARGETS``)."""
import importlib.metadata
import sys

import npu_shim
from npu_shim.runtime import wrapt_loader
from shimdev.beds import demo_features, stream_races
from shimdev.programs import arg, emit

TARGETS = arg(0)
failed = demo_features.import_targets()  # before anything else imports sglang
import sglang  # noqa: E402 - after import_targets
wrapt = wrapt_loader.load()  # the shim's own (npu_shim._wrapt): its wrappers' classes
from sglang.srt.utils.common import is_npu  # noqa: E402 - after import_targets

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
states = npu_shim.states()
result = {
    "failed": failed,
    "is_npu": is_npu(),
    "version": getattr(sglang, "__version__", None),
    "dist_version": importlib.metadata.version("sglang"),
    "sglang_file": sglang.__file__,
    "finders": [type(f).__name__ if not isinstance(f, type) else f.__name__ for f in sys.meta_path],
    "states": states,
    "wrapped": {name: wrapped_names(sys.modules[name]) for name in TARGETS if name in sys.modules},
    "copies_are_the_module_function": copies,
    "gpu_memory_is_wrapped": isinstance(common.get_available_gpu_memory, wrapt.FunctionWrapper),
}
# The drivers, after every structural fact was taken (they replace bodies and globals).
result["drivers"] = demo_features.run_drivers([n for n, s in states.items() if s["state"] == "applied"])
# The dual-stream MoE path, the backport's or upstream's own, under the stream sanitizer.
if states.get("dual_stream_experts", {}).get("state") in ("applied", "upstream"):
    result["races"] = stream_races.run()
emit(result)
