"""Feature drivers for ``scripts/demo.py`` -- run inside a release venv (simulated NPU, real sglang).

``run_all(release)`` drives each patch on a small synthetic model through the release's *real*
modules and returns plain JSON-able facts; the demo formats them.  It is called once, in one
interpreter started by ``realsglang.run_in_release(..., env=DEMO_ENV, zbal=True)``:

* zbal -- the real (wrapped) ``Scheduler.__init__`` with a recording stub body, the real
  ``ModelRunner.initialize`` body on a runner whose heavy steps are stubs that take simulated device
  memory (64 GB device), the real ``get_available_gpu_memory`` / ``get_npu_memory_capacity``;
* mla_weight_release -- a GLM-5-shaped MLA layer through the real ``npu_mla_preprocess`` with the
  decode role published through real ``ServerArgs`` (dev/shimdev/beds/mla_kernels.py);
* dual_stream_experts -- the real ``Glm4MoeSparseMoeBlock.forward_deepep`` (wrapped on 0.5.9, the
  release's own on 0.5.10+) on a synthetic block; the stream each part ran on from simnpu.EVENTS,
  and what the stream sanitizer (on in every call) reported.

The set-ups the drivers stand on (``zbal_fresh``, ``make_scheduler``, ``stub_model_runner``,
``glm4_moe_bed``, ...) are dev/shimdev/beds/release_beds.py, which the real-release tests use too.

Nothing heavy at module level: the outer test process imports this module too.
"""
from __future__ import annotations

from shimdev.beds.release_beds import (GIB, MIB, event_order, glm4_moe_bed, make_scheduler, stub_model_runner,
                                  zbal_fresh)

#: The demo's drivers, keyed by patch name: each runs the release's real (patched or own) code on a
#: synthetic model and returns JSON-able facts.  A patch without a driver needs no change here: the
#: demo shows its state, reason and details.  Filled by ``@driver(name)`` below.
DRIVERS = {}
#: Patches whose driver runs where the release has the feature upstream too (its own code runs).
DRIVE_UPSTREAM = set()


def driver(name, upstream_too=False):
    """Register the decorated function as the demo driver of patch ``name``."""
    def register(fn):
        DRIVERS[name] = fn
        if upstream_too:
            DRIVE_UPSTREAM.add(name)
        return fn
    return register

#: The environment the demo's release processes get: every patch's trigger set, the shim's own
#: switches at their defaults (a user's NPU_SHIM_* overrides would hide what the demo shows).
def _demo_env():
    """Every patch switched on and triggered: each variable any patch reads unset (None: removed
    from the child's environment), then each patch's trigger (expected_states.TRIGGERS, what the
    release table assumes) -- and the drivers' own sizes."""
    from npu_shim.core.loading import all_variables
    from shimdev.beds.expected_states import TRIGGERS

    env = {var.name: None for var in all_variables()}
    env.update({alias: None for var in all_variables() for alias in var.aliases})
    env["NPU_SHIM_ENABLED"] = "1"
    for trigger in TRIGGERS.values():
        env.update(trigger)
    # the zbal driver's device is 64 GB (61440 MiB managed), its bootstrap URL a fixed one
    env.update(SGLANG_ZBAL_LOCAL_MEM_SIZE="61440", SGLANG_ZBAL_BOOTSTRAP_URL="tcp://10.0.0.1:6789")
    return env


DEMO_ENV = _demo_env()


# ------------------------------------------------------------------------------------ zbal

@driver("zbal")
def zbal_demo():
    """Init order (full / mix mode), the mix-mode lazy heap on a 64 GB device, memory queries."""
    from shimdev import simnpu, simzbal
    import sglang.srt.utils as u
    import sglang.srt.utils.common as common

    out = {}
    zbal_fresh()
    make_scheduler()
    out["full_order"] = event_order()
    (init,) = simzbal.bootstraps()
    out["full_init"] = {k: init[k] for k in ("world_size", "rank_id", "device_id", "ip_port")}
    out["full_init"]["mib"] = init["device_mem_size"] >> 20
    zbal_fresh(mix=True)
    make_scheduler()
    out["mix_order"] = event_order()
    out["mix_allocator"] = simnpu.allocator_backend()

    # Mix mode: the GVA heap is sized after weights + KV cache, before graph capture.
    Runner = stub_model_runner()
    zbal_fresh(mix=True, scheduler_started=True)
    simnpu.set_memory(total_mib=65536, free_mib=62000)
    Runner(weights=20000, kv=25000).initialize(1.0)
    out["runner_order"] = event_order()
    (init,) = simzbal.bootstraps()
    out["heap_mib"] = init["device_mem_size"] >> 20
    out["device_total_mib"], out["device_free_mib"] = 65536, simnpu.STATE.free_mib

    # Full mode: free memory comes from the zbal heap, capacity is the configured size.
    zbal_fresh()
    simnpu.set_memory(total_mib=65536, free_mib=1024)
    simzbal.STATE.heap_free, simzbal.STATE.heap_total = 10 * GIB + 5 * MIB, 60 * GIB
    out["mem"] = {"avail_gib": u.get_available_gpu_memory("npu", 0),
                  "avail_native_gib": common.get_available_gpu_memory.__wrapped__("npu", 0),
                  "capacity_mib": u.get_npu_memory_capacity(),
                  "capacity_native_mib": common.get_npu_memory_capacity.__wrapped__()}
    return out


# ------------------------------------------------------------------------ mla_weight_release

@driver("mla_weight_release")
def mla_demo(model="glm-5", tp=16):
    """Decode role: bytes released from one synthetic MLA layer; touching a released weight."""
    from shimdev.beds import mla_kernels as K
    from npu_shim.runtime import activation
    from npu_shim.patches import mla_weight_release as R

    record = activation.RUNTIME.record("mla_weight_release")  # None until its modules are imported
    if record is not None:
        record.process_state.reset()
    K.publish_server_args("decode")
    r = K.run_layer(model, tp)
    m = r.pop("layer")
    out = {"model": model, "tp": tp, "freed": r["freed"], "expected": r["expected"],
           "before": r["before"], "kernels": r["kernels"], "outputs_equal": r["outputs"][0] == r["outputs"][1],
           "qkv_type": r["qkv_type"], "w_kc_type": r["w_kc_type"],
           "details": dict(activation.RUNTIME.record("mla_weight_release").details)}
    try:
        m.w_kc.sum()
        out["touch"] = None
    except R.ReleasedWeightError as exc:
        out["touch"] = [type(exc).__name__, str(exc)]
    return out


# ----------------------------------------------------------------------- dual_stream_experts

@driver("dual_stream_experts", upstream_too=True)
def dual_stream_demo():
    """Which stream ran the shared experts in an extend batch (the patched or the release's own
    forward_deepep), and whether the output equals the single-stream one."""
    import os

    import torch

    b = glm4_moe_bed("partial", head_dim=64)  # a size every release's NPU rope takes
    h = torch.randn(5, b.H)
    out, ref, events = b.moe(h, b.ForwardMode.EXTEND)
    computes = {e[1]: e[2] for e in events if e[0] == "compute"}
    result = {"wrapped": b.wrapped_names(), "streams": computes,
              "waits": [e[1:] for e in events if e[0] == "wait_stream"],
              "state": b.state()["state"]}
    if result["wrapped"]["forward_deepep"] == "FunctionWrapper":
        single = ref  # the original body: shared experts inline on the main stream
    else:  # the release's own code: its single-stream path is the same call with the switch off
        saved = os.environ.get("SGLANG_NPU_USE_MULTI_STREAM")
        os.environ["SGLANG_NPU_USE_MULTI_STREAM"] = "0"
        try:
            b.simnpu.clear_events()
            single = b.block.forward_deepep(h, b.batch(b.ForwardMode.EXTEND))
            result["single_streams"] = sorted({e[2] for e in b.simnpu.EVENTS if e[0] == "compute"})
        finally:
            os.environ["SGLANG_NPU_USE_MULTI_STREAM"] = saved or "1"
    result["equal_single_stream"] = bool(torch.equal(out, single))
    result["max_abs"] = float((out - single).abs().max())
    return result


# ------------------------------------------------------------------------------------ all

def import_targets():
    """Install the fused decode kernel stand-in, then import every module a patch targets (the first
    one decides every patch, each applies its own).  Must run before the first sglang import.
    Returns {module: "ExcType: message"} for each module that failed to import."""
    import importlib

    from shimdev.beds import dual_stream_kernels
    from shimdev import simnpu
    from npu_shim.core.loading import load_all

    dual_stream_kernels.install(simnpu, kernel="partial")
    failed = {}
    for patch in load_all():
        for module in patch.modules:
            try:
                importlib.import_module(module)
            except BaseException as exc:  # noqa: BLE001 - report every failing module, not only the first
                failed.setdefault(module, "%s: %s" % (type(exc).__name__, exc))
    return failed


def run_drivers(names):
    """{feature: driver facts, or {"error", "traceback"}} for each feature in ``names``.  Each
    driver runs under the simulated NPU's stream sanitizer: its reports are ``facts["sanitizer"]``."""
    import traceback

    from shimdev import simnpu

    out = {}
    for name in names:
        if name not in DRIVERS:
            continue
        try:
            with simnpu.sanitize() as san:
                facts = DRIVERS[name]()
            facts["sanitizer"] = [report.as_dict() for report in san.reports]
            out[name] = facts
        except Exception as exc:  # noqa: BLE001 - a broken driver is reported in its facts
            out[name] = {"error": "%s: %s" % (type(exc).__name__, exc),
                         "traceback": traceback.format_exc()[-3000:]}
    return out


def run_all(release):
    """Every feature's facts for the demo (a feature whose patch is not applied is only run where
    the release's own code can be driven the same way)."""
    failed = import_targets()
    broken = {m: e for m, e in failed.items() if not e.startswith("ModuleNotFoundError")}
    if broken:
        raise RuntimeError("target modules failed to import: %s" % broken)
    import sglang
    from npu_shim.runtime import activation

    out = {"release": release, "states": {}, "sglang_file": sglang.__file__, "missing_modules": sorted(failed)}
    for name, st in activation.RUNTIME.states().items():
        out["states"][name] = {"state": st["state"], "reason": st["reason"],
                               "details": st.get("details") or {}}
    # upstream/off: the shim has nothing of its own to show, except where the release's own code
    # can be driven the same way (DRIVE_UPSTREAM)
    names = [name for name, st in out["states"].items()
             if st["state"] == "applied" or (name in DRIVE_UPSTREAM and st["state"] == "upstream")]
    out["facts"] = {name: None for name in out["states"]}
    out["facts"].update(run_drivers(names))
    return out
