"""A release with zbal upstream (tests/patches/test_zbal_real.py, 0.5.19 and 0.5.23): nothing
wrapped, the release's own zbal code present."""
import wrapt
import zbal  # noqa: F401 - importable and imported, as in a server
from shimdev import simzbal
import sglang.srt.utils as u
import sglang.srt.managers.scheduler as sch
import sglang.srt.model_executor.model_runner as mr
import sglang.srt.distributed.parallel_state as ps
import sglang.srt.layers.moe.token_dispatcher.deepep  # noqa: F401 - a target module, imported as a server does
import sglang.srt.hardware_backend.npu.utils as npu_utils
from npu_shim.runtime import activation
from shimdev.programs import emit


def w(obj):
    return isinstance(obj, wrapt.FunctionWrapper)


emit({
    "state": activation.RUNTIME.states()["zbal"],
    "wrapped": [w(sch.Scheduler.__dict__["__init__"]), w(mr.ModelRunner.__dict__["initialize"]),
                w(u.get_available_gpu_memory), w(u.get_npu_memory_capacity),
                w(ps.init_distributed_environment)],
    "own": [hasattr(sch.Scheduler, "init_zbal_on_npu"), hasattr(npu_utils, "init_zbal"),
            hasattr(npu_utils, "lazy_init_zbal_gva_mem")],
    "calls": list(simzbal.CALLS),
})
