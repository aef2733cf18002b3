"""zbal backported into a real release (tests/patches/test_zbal_real.py, 0.5.9 and 0.5.11): the
wrapped objects, the memory queries, DeepEP and the backend, the real ``Scheduler.__init__`` (stub
body) and ``ModelRunner.initialize``, then the settings re-decided in this process."""
import os
import sys

import wrapt
import zbal

from shimdev import simnpu, simzbal
import sglang.srt.utils as u
import sglang.srt.utils.common as common
import sglang.srt.managers.scheduler as sch
import sglang.srt.model_executor.model_runner as mr
import sglang.srt.layers.moe.token_dispatcher.deepep as dp
import sglang.srt.distributed.parallel_state as ps
import npu_shim
from npu_shim.runtime import activation
from npu_shim.core.framework import ShimError
from shimdev.programs import emit

GIB, MIB = 1 << 30, 1 << 20
out = {"state": activation.RUNTIME.states()["zbal"]}

from shimdev.beds.release_beds import zbal_fresh as fresh, event_order as order, make_scheduler, stub_model_runner  # noqa: E402 - after the state is read

def is_wrapper(obj):
    return isinstance(obj, wrapt.FunctionWrapper)

out["wrapped"] = {
    "Scheduler.__init__": is_wrapper(sch.Scheduler.__dict__["__init__"]),
    "ModelRunner.initialize": is_wrapper(mr.ModelRunner.__dict__["initialize"]),
    "ModelRunner.init_device_graphs": is_wrapper(mr.ModelRunner.__dict__["init_device_graphs"]),
    "utils.get_available_gpu_memory": u.get_available_gpu_memory is common.get_available_gpu_memory
        and is_wrapper(u.get_available_gpu_memory),
    "model_runner.get_available_gpu_memory": mr.get_available_gpu_memory is common.get_available_gpu_memory,
    "utils.get_npu_memory_capacity": is_wrapper(u.get_npu_memory_capacity),
}

# -- 3./4. memory queries ---------------------------------------------------------------------------
fresh()
simnpu.set_memory(total_mib=65536, free_mib=1024)
simzbal.STATE.heap_free, simzbal.STATE.heap_total = 10 * GIB + 5 * MIB, 60 * GIB
native = common.get_available_gpu_memory.__wrapped__
mem = {"full": u.get_available_gpu_memory("npu", 0), "native": native("npu", 0),
       "full_no_empty_cache_events": None}
simnpu.clear_events()
u.get_available_gpu_memory("npu", 0, empty_cache=False)
mem["full_no_empty_cache_events"] = len(simnpu.events("empty_cache"))
import torch.distributed as dist  # noqa: E402 - where the distributed query is made
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mem["full_distributed"] = u.get_available_gpu_memory("npu", 0, distributed=True, cpu_group=dist.group.WORLD)
dist.destroy_process_group()
simzbal.STATE.mix = True
mem["mix"] = u.get_available_gpu_memory("npu", 0)
mem["capacity"] = u.get_npu_memory_capacity()
mem["capacity_native"] = common.get_npu_memory_capacity.__wrapped__()
out["mem"] = mem

# -- 5./6. DeepEP and the backend ------------------------------------------------------------------
import zbal.zbal_buffer  # noqa: E402 - where DeepEP is checked
import zbal.zbal.deepep_adaptor  # noqa: E402 - where DeepEP is checked
out["deepep"] = {"Buffer": dp.Buffer is zbal.zbal_buffer.Buffer,
                 "Config": dp.Config is zbal.zbal.deepep_adaptor.Config, "use_deepep": dp.use_deepep}
seen = []
def dist_body(*args, **kwargs):
    seen.append(kwargs.get("backend", args[4] if len(args) > 4 else None))
init_dist = ps.__dict__["init_distributed_environment"]
real_body = init_dist.__wrapped__
init_dist.__wrapped__ = dist_body
try:
    if hasattr(ps, "get_default_distributed_backend"):
        npu_backend = ps.get_default_distributed_backend("npu")
        cuda_backend = ps.get_default_distributed_backend("cuda")
    else:  # 0.5.9: ModelRunner.init_torch_distributed passes "hccl" for npu
        npu_backend, cuda_backend = "hccl", "nccl"
    mr.init_distributed_environment(backend=npu_backend, world_size=1, rank=0, local_rank=0,
                                    distributed_init_method="tcp://127.0.0.1:1")
    mr.init_distributed_environment(1, 0, "tcp://127.0.0.1:1", 0, cuda_backend)
finally:
    init_dist.__wrapped__ = real_body
out["backend"] = {"seen": seen, "map_npu": getattr(ps, "_DEVICE_TO_DISTRIBUTED_BACKEND", {}).get("npu"),
                  "same_function": mr.init_distributed_environment is ps.init_distributed_environment,
                  "registered": "zbal" in dist.Backend.backend_list}

# -- 1. Scheduler.__init__ (body: a recording stub that allocates at once) ---------------------
sched = {}
fresh()
make_scheduler()
sched["full_order"] = order()
sched["full_init"] = simzbal.bootstraps()
fresh(mix=True)
make_scheduler(pp=2)
sched["mix_order"] = order()
sched["mix_allocator"] = simnpu.allocator_backend()
for name, knobs in (("pp", dict(pp=2)), ("init_false", {})):
    fresh()
    simzbal.STATE.init_result = name != "init_false"
    try:
        make_scheduler(**knobs)
        sched[name] = None
    except ShimError as exc:
        sched[name] = [type(exc).__name__, str(exc), "body_start" in order()]
out["scheduler"] = sched

# -- 2. the real ModelRunner.initialize body -------------------------------------------------------
Runner = stub_model_runner()  # the real initialize(), stubbed heavy steps

runner = {}
fresh(mix=True, scheduler_started=True)
runner["draft_calls"] = None
simnpu.set_memory(total_mib=65536, free_mib=62000)
Runner(draft=True).initialize(1.0)
runner["draft_calls"] = simzbal.bootstraps()
runner["draft_order"] = order()
simnpu.clear_events()
Runner(weights=20000, kv=25000).initialize(1.0)
runner["order"] = order()
runner["init"] = simzbal.bootstraps()
Runner().initialize(1.0)  # a second runner in the process: no second heap
runner["inits_after_second"] = len(simzbal.bootstraps())
fresh(mix=False)
Runner(weights=20000, kv=25000).initialize(1.0)
runner["full_mode_inits"] = len(simzbal.bootstraps())
fresh(mix=True, scheduler_started=True)
os.environ["SGLANG_ZBAL_LOCAL_MEM_SIZE"] = "40000"
simnpu.set_memory(total_mib=65536, free_mib=62000)
try:
    Runner(weights=20000, kv=18000).initialize(1.0)
    runner["too_small"] = None
except ShimError as exc:
    runner["too_small"] = [type(exc).__name__, str(exc), "device_graphs_body" in order()]
os.environ["SGLANG_ZBAL_LOCAL_MEM_SIZE"] = "61440"
out["runner"] = runner

# -- 7./settings: re-decide in this process ---------------------------------------------------------
def put_env(values):
    """Set each variable of ``values``; None unsets it."""
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def redecide(env, hide_zbal=False):
    npu_shim.uninstall()
    saved = {k: os.environ.get(k) for k in env}
    put_env(env)
    if hide_zbal:
        saved_zbal = {n: m for n, m in sys.modules.items() if n == "zbal" or n.startswith("zbal.")}
        for n in saved_zbal:
            del sys.modules[n]
        sys.modules["zbal"] = None
    try:
        npu_shim.install()
        result = {"state": activation.RUNTIME.states()["zbal"]["state"], "error": None}
    except ShimError as exc:
        result = {"state": activation.RUNTIME.states()["zbal"]["state"], "error": str(exc)}
    finally:
        put_env(saved)
        if hide_zbal:
            del sys.modules["zbal"]
            sys.modules.update(saved_zbal)
    result["untouched"] = not any((
        is_wrapper(sch.Scheduler.__dict__["__init__"]), is_wrapper(mr.ModelRunner.__dict__["initialize"]),
        is_wrapper(mr.ModelRunner.__dict__["init_device_graphs"]), is_wrapper(u.get_available_gpu_memory),
        is_wrapper(mr.get_available_gpu_memory), is_wrapper(u.get_npu_memory_capacity),
        is_wrapper(ps.init_distributed_environment), getattr(dp, "Buffer", None) is zbal.zbal_buffer.Buffer,
        getattr(ps, "_DEVICE_TO_DISTRIBUTED_BACKEND", {}).get("npu") == "zbal", dp.use_deepep is True))
    return result


out["off"] = redecide({"SGLANG_ZBAL_LOCAL_MEM_SIZE": None})
out["zero"] = redecide({"SGLANG_ZBAL_LOCAL_MEM_SIZE": "0"})
out["switched_off"] = redecide({"NPU_SHIM_ZBAL": "0"})
out["bad_url"] = redecide({"SGLANG_ZBAL_BOOTSTRAP_URL": "10.0.0.1:6789"})
out["bad_size"] = redecide({"SGLANG_ZBAL_LOCAL_MEM_SIZE": "60G"})
out["missing"] = redecide({}, hide_zbal=True)
out["again"] = redecide({})
emit(out)
