"""A real release on a machine without an NPU (tests/test_hostile_inputs.py, 0.5.11, no simulated
NPU installed): every hooked module that imports on a plain CPU torch, and what each patch says."""
import importlib
import sys

import npu_shim
from npu_shim.runtime import wrapt_loader
from shimdev import simnpu
from shimdev.programs import emit

simnpu.install_without_npu("0.5.11")
# Every hooked module that imports on a plain CPU torch (the NPU-only ones need torch_npu).
imported = []
for name in ("sglang.srt.utils.common", "sglang.srt.distributed.parallel_state",
             "sglang.srt.managers.scheduler", "sglang.srt.model_executor.model_runner"):
    try:
        importlib.import_module(name)
        imported.append(name)
    except Exception as exc:  # noqa: BLE001 - an NPU-only module: said, and the others go on
        print("cannot import %s on CPU: %r" % (name, exc), file=sys.stderr)
import torch  # noqa: E402 - after the imports above, as a process without an NPU has it
common = sys.modules["sglang.srt.utils.common"]
emit({"npu": hasattr(torch, "npu") and torch.npu.is_available(), "imported": imported,
      "states": {k: [v["state"], v["reason"], v["targets"]] for k, v in npu_shim.states().items()},
      "wrapped": isinstance(common.get_available_gpu_memory, wrapt_loader.load().FunctionWrapper)})
