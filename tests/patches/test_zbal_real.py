"""zbal backport inside the real sglang releases (their venvs, simulated NPU, memfabric-zbal's own
Python layer over its simulated native module).

0.5.9 and 0.5.11 (backported): one subprocess each drives the real wrapped objects --
``Scheduler.__init__`` with its body replaced by a recording stub (the real one needs a model and
ports), the *real* ``ModelRunner.initialize`` body on a runner whose heavy steps (load_model,
init_memory_pool, ...) are stubs that take simulated device memory, the real memory queries, the real
DeepEP module and backend map -- then re-decides in the same process (uninstall/install) for the
"off" and bad-setting cases.  zbal missing gets a fresh process (the error must come at import).
0.5.19 and 0.5.23 (upstream): the patch reports ``upstream`` and nothing is wrapped.
"""
from __future__ import annotations

import pytest

from shimdev import realsglang

ENV = {"SGLANG_ZBAL_LOCAL_MEM_SIZE": "61440", "SGLANG_ZBAL_BOOTSTRAP_URL": "tcp://10.0.0.1:6789",
       "NPU_SHIM_STRICT": None, "NPU_SHIM_ZBAL": None}

BACKPORT_SNIPPET = r'''
import os, sys, types, torch, wrapt, zbal
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
from npu_shim.patches import zbal as zp

GIB, MIB = 1 << 30, 1 << 20
out = {"state": activation.RUNTIME.states()["zbal"]}

from shimdev.release_beds import zbal_fresh as fresh, event_order as order, make_scheduler, stub_model_runner

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
import torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mem["full_distributed"] = u.get_available_gpu_memory("npu", 0, distributed=True, cpu_group=dist.group.WORLD)
dist.destroy_process_group()
simzbal.STATE.mix = True
mem["mix"] = u.get_available_gpu_memory("npu", 0)
mem["capacity"] = u.get_npu_memory_capacity()
mem["capacity_native"] = common.get_npu_memory_capacity.__wrapped__()
out["mem"] = mem

# -- 5./6. DeepEP and the backend ------------------------------------------------------------------
import zbal.zbal_buffer, zbal.zbal.deepep_adaptor
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
def redecide(env, hide_zbal=False):
    npu_shim.uninstall()
    saved = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        if v is None: os.environ.pop(k, None)
        else: os.environ[k] = v
    if hide_zbal:
        saved_zbal = {n: m for n, m in sys.modules.items() if n == "zbal" or n.startswith("zbal.")}
        for n in saved_zbal: del sys.modules[n]
        sys.modules["zbal"] = None
    try:
        npu_shim.install()
        result = {"state": activation.RUNTIME.states()["zbal"]["state"], "error": None}
    except ShimError as exc:
        result = {"state": activation.RUNTIME.states()["zbal"]["state"], "error": str(exc)}
    finally:
        for k, v in saved.items():
            if v is None: os.environ.pop(k, None)
            else: os.environ[k] = v
        if hide_zbal:
            del sys.modules["zbal"]; sys.modules.update(saved_zbal)
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
'''


def check_backport(version, out):
    state = out["state"]
    assert state["state"] == "applied", state
    assert state["targets"] and all(state["targets"].values()), state["targets"]
    assert all(out["wrapped"].values()), out["wrapped"]

    mem = out["mem"]
    assert mem["full"] == (10 * (1 << 30) + 5 * (1 << 20)) / (1 << 30)  # zbal heap, GiB
    assert mem["native"] == 1.0                                         # the device says 1 GiB free
    assert mem["full_no_empty_cache_events"] == 0
    assert abs(mem["full_distributed"] - mem["full"]) < 1e-6            # float32 MIN all-reduce
    assert mem["mix"] == mem["native"] == 1.0
    assert (mem["capacity"], mem["capacity_native"]) == (61440, 65536)

    assert out["deepep"] == {"Buffer": True, "Config": True, "use_deepep": True}
    backend = out["backend"]
    assert backend["seen"] == ["zbal", "nccl"] and backend["same_function"] and backend["registered"]
    assert backend["map_npu"] == ("zbal" if version == "0.5.11" else None)

    sched = out["scheduler"]
    full = sched["full_order"]
    assert full.index("zbal_bootstrap") < full.index("body_start") < full.index("alloc")
    (init,) = sched["full_init"]
    assert (init["world_size"], init["device_id"], init["rank_id"]) == (4, 0, 3)
    assert init["device_mem_size"] == 61440 << 20 and init["ip_port"] == "tcp://10.0.0.1:6789"
    mix = sched["mix_order"]
    assert "zbal_bootstrap" not in mix and sched["mix_allocator"] == "pluggable"
    assert mix.index("change_allocator") < mix.index("body_start") < mix.index("alloc")
    assert sched["pp"][0] == "ZbalError" and "only zbal mix mode supports pp_size > 1" in sched["pp"][1]
    assert sched["pp"][2] is False
    name, message, body_ran = sched["init_false"]
    assert name == "ZbalInitError" and body_ran is False
    assert message.startswith("zbal_init failed (full mode, Scheduler start-up): rank 3 of 4, device 0, "
                              "61440 MiB, bootstrap tcp://10.0.0.1:6789")

    runner = out["runner"]
    assert runner["draft_calls"] == []
    assert runner["draft_order"] == ["weights", "kv_cache", "attention_backend", "device_graphs_body"]
    o = runner["order"]
    assert o.index("weights") < o.index("kv_cache") < o.index("attention_backend") \
        < o.index("zbal_bootstrap") < o.index("device_graphs_body")
    (init,) = runner["init"]
    in_use = 65536 - (62000 - 45000)
    assert init["device_mem_size"] == (61440 - in_use) // 128 * 128 << 20 == 12800 << 20
    assert (init["world_size"], init["rank_id"], init["device_id"]) == (1, 0, 0)
    assert init["ip_port"] == "tcp://10.0.0.1:6789"
    assert runner["inits_after_second"] == 1 and runner["full_mode_inits"] == 0
    name, message, graphs = runner["too_small"]
    assert name == "ZbalError" and graphs is False
    assert "SGLANG_ZBAL_LOCAL_MEM_SIZE=40000 MiB configured, 41536 MiB already in use" in message
    assert "of the device's 65536 MiB total" in message

    assert out["off"] == {"state": "inactive", "error": None, "untouched": True}
    assert out["zero"] == {"state": "inactive", "error": None, "untouched": True}
    assert out["switched_off"] == {"state": "disabled", "error": None, "untouched": True}
    for key, words in (("bad_url", "SGLANG_ZBAL_BOOTSTRAP_URL='10.0.0.1:6789' is invalid: expected "
                                   "tcp://HOST:PORT"),
                       ("bad_size", "SGLANG_ZBAL_LOCAL_MEM_SIZE='60G' is invalid: expected a whole "
                                    "number of MiB")):
        assert out[key]["state"] == "failed" and out[key]["untouched"], out[key]
        assert words in out[key]["error"]
    missing = out["missing"]
    assert missing["state"] == "failed" and missing["untouched"], missing
    assert "memfabric-zbal" in missing["error"] and "SGLANG_ZBAL_LOCAL_MEM_SIZE=61440" in missing["error"]
    assert out["again"] == {"state": "applied", "error": None, "untouched": False}


@pytest.mark.parametrize("version", ["0.5.9", "0.5.11"])
def test_backport_in_real_release(version, release_venv):
    release_venv(version)
    out = realsglang.run_in_release(version, BACKPORT_SNIPPET, env=ENV, zbal=True)
    check_backport(version, out)


MISSING_SNIPPET = r'''
from npu_shim.core.framework import ShimError
try:
    import sglang.srt.utils  # its utils.common is the first target module
    emit({"error": None})
except ShimError as exc:
    import sys
    emit({"error": str(exc), "allocations": simnpu.STATE.npu_allocations,
          "scheduler_imported": "sglang.srt.managers.scheduler" in sys.modules})
'''


def test_zbal_missing_stops_at_the_first_import(release_venv):
    release_venv("0.5.11")
    out = realsglang.run_in_release("0.5.11", MISSING_SNIPPET, env=ENV, zbal=False)
    assert out["error"] is not None, "importing sglang without zbal must fail while the size is set"
    # decided (find_spec, no import) before any target module is patched
    assert out["error"].startswith("npu-shim: zbal was requested but is failed: "
                                   "SGLANG_ZBAL_LOCAL_MEM_SIZE=61440 asks for "
                                   "the zbal allocator, but the Python package 'zbal' is not importable: "
                                   "install memfabric-zbal")
    assert out["allocations"] == 0 and out["scheduler_imported"] is False


UPSTREAM_SNIPPET = r'''
import wrapt, zbal
from shimdev import simzbal
import sglang.srt.utils as u
import sglang.srt.managers.scheduler as sch
import sglang.srt.model_executor.model_runner as mr
import sglang.srt.distributed.parallel_state as ps
import sglang.srt.layers.moe.token_dispatcher.deepep as dp
import sglang.srt.hardware_backend.npu.utils as npu_utils
from npu_shim.runtime import activation
w = lambda o: isinstance(o, wrapt.FunctionWrapper)
emit({
    "state": activation.RUNTIME.states()["zbal"],
    "wrapped": [w(sch.Scheduler.__dict__["__init__"]), w(mr.ModelRunner.__dict__["initialize"]),
                w(u.get_available_gpu_memory), w(u.get_npu_memory_capacity),
                w(ps.init_distributed_environment)],
    "own": [hasattr(sch.Scheduler, "init_zbal_on_npu"), hasattr(npu_utils, "init_zbal"),
            hasattr(npu_utils, "lazy_init_zbal_gva_mem")],
    "calls": list(simzbal.CALLS),
})
'''


@pytest.mark.parametrize("version", ["0.5.19", "0.5.23"])
def test_upstream_release_is_left_alone(version, release_venv):
    release_venv(version)
    out = realsglang.run_in_release(version, UPSTREAM_SNIPPET, env=ENV, zbal=True)
    state = out["state"]
    assert state["state"] == "upstream" and state["targets"] == {}, state
    assert state["reason"].endswith("has it: Scheduler.init_zbal_on_npu")
    assert out["wrapped"] == [False] * 5
    assert out["own"] == [True, True, True]
    assert out["calls"] == []
