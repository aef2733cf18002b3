"""The device side of ``python -m npu_shim selftest`` (npu_shim/selftest.py starts it, twice at most).

Stage ``main``: imports every sglang module a patch targets, as ``check`` does (the patches decide
in this process as in a server), finds the device (NPU, else CUDA) and its free memory, refuses
when too little is free, then runs the steps of ``mla_weight_release`` and ``dual_stream_experts``.
Stage ``zbal``: a fresh process, since zbal's allocator must be switched in before anything else
touches the device: zbal set up through the shim's own ``ZbalProcess`` as ``Scheduler.__init__``
sets it up.  Each stage prints progress lines and one report line (JSON) on stdout.

On the tests' simulated NPU (``torch.npu.__simnpu__``) the flow runs on host tensors: no allocator
statistics and no timings exist there, and the report says so.
"""

import json
import os
import sys
import time
import types

MARK = "npu-shim-selftest:"
PROGRESS = "npu-shim-selftest-progress:"
MIB = 1 << 20
NPU_ONLY = ("zbal", "mla_weight_release")
# Dims of one MLA layer of two public configs (config.json of each model, TP 1).
MLA_CONFIGS = {
    "DeepSeek-V3": dict(hidden=7168, heads=128, q_lora=1536, kv_lora=512, nope=128, rope=64),
    "GLM-5": dict(hidden=6144, heads=64, q_lora=2048, kv_lora=512, nope=192, rope=64),
}
# Device memory the mla and dual-stream steps use at most (GLM-4.5-Air shapes), with room to spare.
STEPS_MIB = 2048
# Timing repetitions on a device; on the simulated NPU a tiny block, once (the flow only).
DEVICE_TIMING = dict(samples=7, reps=5, warmup=3)
SIMULATED_SHAPE = dict(hidden=16, shared_inter=16, experts=4, topk=2, expert_inter=8, samples=1,
                       reps=1, warmup=1)
SIMULATED_TOKENS = (4, 8)


def progress(text):
    sys.stdout.write(PROGRESS + text + "\n")
    sys.stdout.flush()


def emit(report):
    sys.stdout.write("\n" + MARK + json.dumps(report, default=str) + "\n")
    sys.stdout.flush()


def _one_line(exc):
    text = " ".join(("%s: %s" % (type(exc).__name__, exc)).split())
    return text if len(text) <= 300 else text[:297] + "..."


# -- what to run -----------------------------------------------------------------------------------

def plan(states, kind, forced=()):
    """{patch: None (run its step) or why not} for every known patch, in registry order.
    ``states``: {name: {"state", "reason"}} of this process; ``kind``: "npu", "cuda" or None;
    ``forced``: names run whatever their state (``--patch``)."""
    from npu_shim.patches import known_names

    decided = {}
    for name in known_names():
        state = (states.get(name) or {}).get("state")
        if state != "applied" and name not in forced:
            decided[name] = "not applied here" if state else "not decided here (no target module imported)"
        elif kind is None:
            decided[name] = "no device"
        elif kind == "cuda" and name in NPU_ONLY:
            decided[name] = "n/a on cuda"
        else:
            decided[name] = None
    return decided


def need_mib(steps, zbal_mib):
    """Free device memory the planned steps need: the zbal heap (its stage runs alone, after this
    one) or the other steps' working set, whichever is larger."""
    return max(zbal_mib + 512 if "zbal" in steps else 0, STEPS_MIB if set(steps) - {"zbal"} else 0)


def memory_info(torch, kind, index):
    """(free MiB, total MiB) of the device, from its device module's ``mem_get_info``."""
    free, total = torch.get_device_module(kind).mem_get_info(index)
    return int(free) // MIB, int(total) // MIB


# -- mla_weight_release ----------------------------------------------------------------------------

class _Meter:
    """Device memory as the allocator counts it: ``memory_allocated``, and ``memory_reserved`` after
    ``empty_cache``.  The simulated NPU keeps no allocator statistics: there the bytes held by the
    weights' own storages are read instead (0 once released)."""

    def __init__(self, torch, dm, simulated, index):
        self.torch, self.dm, self.simulated, self.index = torch, dm, simulated, index

    def read(self, weights=()):
        if self.simulated:
            with self.torch._C.DisableTorchFunctionSubclass():  # a released weight raises otherwise
                held = sum(w.untyped_storage().nbytes() for w in weights)
            return held, held
        self.dm.synchronize()
        allocated = self.dm.memory_allocated(self.index)
        self.dm.empty_cache()
        return allocated, self.dm.memory_reserved(self.index)


def mla_layer(torch, config, device):
    """One layer's fused qkv_a weight ([q_lora + kv_lora + rope, hidden], a Parameter) and ``w_kc``
    laid out as sglang's loader leaves it (``transpose(1, 2).contiguous().transpose(1, 2)`` of
    [heads, nope, kv_lora]), bf16."""
    c = MLA_CONFIGS[config]
    qkv = torch.nn.Parameter(torch.randn(c["q_lora"] + c["kv_lora"] + c["rope"], c["hidden"],
                                         dtype=torch.bfloat16, device=device), requires_grad=False)
    w_kc = torch.randn(c["heads"], c["nope"], c["kv_lora"], dtype=torch.bfloat16,
                       device=device).transpose(1, 2).contiguous().transpose(1, 2)
    return qkv, w_kc


def mla_step(torch, dm, device, simulated, index):
    """Each config's layer released through the shim's ``release``; (ok, line, facts)."""
    from npu_shim.patches import mla_weight_release as mla

    facts, parts, ok = {}, [], True
    said = []
    once = lambda key, level, message: said.append(message)  # noqa: E731 - release's ``once``
    meter = _Meter(torch, dm, simulated, index)
    for config in MLA_CONFIGS:
        progress("mla_weight_release: %s layer: allocate, release, touch" % config)
        said.clear()
        base_alloc, base_res = meter.read()
        qkv, w_kc = mla_layer(torch, config, device)
        weights = (qkv, w_kc)
        nbytes = sum(w.untyped_storage().nbytes() for w in weights)
        if simulated:
            base_alloc = base_res = 0
        up_alloc, up_res = meter.read(weights)
        view = qkv[:1]  # a live view: the weight must be kept whole
        kept = mla.release(qkv, "qkv_a_proj.weight (with a live view)", once)
        kept_ok = kept == 0 and not mla.is_released(qkv) and bool(said)
        del view
        freed = mla.release(qkv, "qkv_a_proj.weight of the %s layer" % config, once) + \
            mla.release(w_kc, "w_kc of the %s layer" % config, once)
        after_alloc, after_res = meter.read(weights)
        touches = []
        for name, touch in (("qkv_a.sum()", lambda: qkv.sum()), ("w_kc @ x", lambda: w_kc @ w_kc)):
            try:
                touch()
                touches.append("%s did not raise" % name)
            except mla.ReleasedWeightError:
                pass
        rise, drop = up_alloc - base_alloc, up_alloc - after_alloc
        rise_res, drop_res = up_res - base_res, up_res - after_res
        case_ok = (freed == nbytes and drop == rise and rise >= nbytes and drop_res == rise_res
                   and not touches and kept_ok)
        ok = ok and case_ok
        facts[config] = {"bytes": nbytes, "released": freed, "allocated_rise": rise,
                         "allocated_drop": drop, "reserved_rise": rise_res, "reserved_drop": drop_res,
                         "touch_raises": not touches, "view_kept": kept_ok, "ok": case_ok,
                         "problems": touches}
        parts.append("%s %.1f MiB freed%s" % (config, freed / MIB, "" if case_ok else " (MISMATCH: "
                     "freed %d of %d bytes, allocated -%d of +%d, reserved -%d of +%d%s%s)" % (
                         freed, nbytes, drop, rise, drop_res, rise_res,
                         "" if kept_ok else ", a weight with a live view was not kept",
                         "".join("; " + t for t in touches))))
        del qkv, w_kc, weights
    how = ("storage bytes (the simulated NPU keeps no allocator statistics)" if simulated else
           "memory_allocated and memory_reserved after empty_cache dropped by what the weights added")
    line = ("%s; checked: %s, a touch raises ReleasedWeightError, a weight with a live view is kept"
            % ("; ".join(parts), how))
    return ok, line, facts


# -- dual_stream_experts ---------------------------------------------------------------------------

def dual_stream_step(torch, dm, device, simulated, tokens=None):
    """The shim's dual-stream body on a GLM-4.x-shaped block at a few batch sizes; (ok, line, facts).
    ok: outputs equal to single-stream at every size (the overlap is reported against its target)."""
    from npu_shim import synthetic_moe

    shape = dict(SIMULATED_SHAPE) if simulated else dict(synthetic_moe.GLM4_AIR, **DEVICE_TIMING)
    sizes = tokens or (SIMULATED_TOKENS if simulated else synthetic_moe.SELFTEST_TOKENS)
    facts, parts, ok = [], [], True
    for count in sizes:
        progress("dual_stream_experts: %d tokens: single-stream vs dual-stream, timed with events" % count)
        r = synthetic_moe.measure(device, device_module=dm, **dict(shape, tokens=count))
        ok = ok and r["equal"]
        facts.append(dict({k: r[k] for k in ("serial_median", "overlapped", "shared", "routed", "ideal",
                                             "possible", "fraction", "equal")}, tokens=count))
        if simulated:
            parts.append("%d tokens: outputs %s" % (count, "equal" if r["equal"] else "DIFFER"))
        else:
            parts.append("%d tokens: serial %.3f ms, overlapped %.3f ms, saving %s of the ideal "
                         "(serial - max(shared, routed) = %.3f ms)%s"
                         % (count, r["serial_median"], r["overlapped"],
                            "%.0f %%" % (r["fraction"] * 100) if r["fraction"] is not None else "n/a",
                            r["possible"], "" if r["equal"] else ", outputs DIFFER"))
    shape_text = "hidden %d, shared MLP %d, %d routed experts top-%d" % (
        shape["hidden"], shape["shared_inter"], shape["experts"], shape["topk"])
    if simulated:
        line = ("%s (%s); timings are meaningless on the simulated NPU (no device runs): not measured"
                % ("; ".join(parts), shape_text))
    else:
        best = [f["fraction"] for f in facts if f["fraction"] is not None]
        target = synthetic_moe.TARGET_FRACTION
        line = "%s (%s); outputs equal to single-stream: %s; target >= %.0f %% of the ideal saving: %s" % (
            "; ".join(parts), shape_text, "yes" if ok else "NO", target * 100,
            "met" if best and max(best) >= target else "not met")
    return ok, line, facts


# -- zbal (its own stage) ------------------------------------------------------------------------

def _one_rank_world():
    """The world group of a one-rank job, for ZbalProcess.lazy_init (sglang's own group exists only
    once torch.distributed is initialised, which the selftest does not do)."""
    return types.SimpleNamespace(world_size=1, cpu_group=None, rank_in_group=0)


def zbal_step(torch, index, zbal_mib, simulated):
    """zbal set up as the Scheduler wrapper does (the live ZbalProcess of this process's decision),
    a tensor allocated through it, the shim's memory queries against zbal's; (ok, line, facts)."""
    from npu_shim import runtime
    from npu_shim.patches import zbal as zbal_patch

    progress("zbal: importing zbal and sglang.srt.utils.common (the shim wraps its memory queries)")
    zbal = zbal_patch.zbal_module()
    from sglang.srt.utils import common

    record = runtime.record("zbal")
    if record is None or record.process is None:
        return False, "the zbal patch was not applied in this process (%s)" % (
            record.state if record else "not decided"), {}
    process = record.process
    mix = bool(zbal.is_mix_alloc())
    device = "cpu" if simulated else "npu:%d" % index
    facts = {"mode": "mix" if mix else "full"}
    os.environ[zbal_patch.LOCAL_MEM_SIZE.name] = str(zbal_mib)
    progress("zbal: %s mode: setting zbal up as Scheduler.__init__ does" % facts["mode"])
    process.init_for_rank(1, 1, index, 0)  # tp_size, pp_size, gpu_id, tp_rank: one rank
    tensor = torch.ones(16 * MIB // 2, dtype=torch.bfloat16, device=device)  # 16 MiB
    if mix:
        progress("zbal: mix mode: lazy GVA heap after an allocation, as before graph capture")
        torch.npu.empty_cache()
        free, total = torch.npu.mem_get_info()
        in_use = -(-(int(total) - int(free)) // MIB)
        configured = in_use + zbal_mib  # the heap is what is configured beyond what is in use
        os.environ[zbal_patch.LOCAL_MEM_SIZE.name] = str(configured)
        runner = types.SimpleNamespace(device="npu", gpu_id=index, is_draft_worker=False)
        zbal_patch._world_group = _one_rank_world
        if not process.lazy_init_due(runner):
            return False, "mix mode: the shim does not see the lazy GVA heap as due", facts
        process.lazy_init(runner, "in the selftest")
        facts.update(configured_mib=configured, in_use_mib=in_use)
    facts["heap_mib"] = process.gva_mib
    facts["backend"] = torch.npu.memory.get_allocator_backend()
    progress("zbal: the shim's memory queries against zbal.mem_get_info()")
    zfree, ztotal = zbal.mem_get_info()
    shim_free_gib = common.get_available_gpu_memory("npu", index, empty_cache=True)
    capacity = common.get_npu_memory_capacity()
    facts.update(zbal_free=int(zfree), zbal_total=int(ztotal), shim_free_gib=shim_free_gib,
                 shim_capacity_mib=capacity, tensor_bytes=tensor.numel() * tensor.element_size())
    problems = []
    if facts["backend"] == "native":
        problems.append("the allocator backend is still torch_npu's native one")
    if mix:
        device_free = torch.npu.mem_get_info()[0] / (1 << 30)
        facts["device_free_gib"] = device_free
        agree = abs(shim_free_gib - device_free) < 1e-3  # mix: the original query, device figures
        queries = "free %.2f GiB = the device's (mix mode: the original query)" % shim_free_gib
    else:
        agree = shim_free_gib == zfree / (1 << 30)
        queries = "free %.2f GiB = zbal.mem_get_info()'s" % shim_free_gib
    if not agree:
        problems.append("get_available_gpu_memory says %.3f GiB, zbal/device %.3f GiB" % (
            shim_free_gib, facts.get("device_free_gib", zfree / (1 << 30))))
    if capacity != int(os.environ[zbal_patch.LOCAL_MEM_SIZE.name]):
        problems.append("get_npu_memory_capacity says %s MiB, not the configured size" % capacity)
    facts["problems"] = problems
    line = ("%s mode: %d MiB heap, allocator backend %s, 16 MiB tensor allocated %s; shim: %s, "
            "capacity %s MiB; zbal heap %d of %d MiB free%s%s" % (
                facts["mode"], facts["heap_mib"], facts["backend"],
                "(host memory: the simulated NPU has none)" if simulated else "through it", queries,
                capacity, zfree // MIB, ztotal // MIB,
                " (simulated zbal: its heap figures are fixed)" if simulated else "",
                "".join("; PROBLEM: " + p for p in problems)))
    del tensor
    return not problems, line, facts


# -- the stages ------------------------------------------------------------------------------------

def _run_step(results, name, func, *args):
    started = time.monotonic()
    try:
        ok, line, facts = func(*args)
    except Exception as exc:  # noqa: BLE001 - a step that raises failed; the others still run
        ok, line, facts = False, "raised " + _one_line(exc), {}
    results[name] = {"result": "ok" if ok else "FAILED", "line": line, "facts": facts,
                     "seconds": round(time.monotonic() - started, 2)}


def stage_main(options):
    from npu_shim import check, runtime

    started = time.monotonic()
    report = {"stage": "main", "pid": os.getpid(), "python": "%d.%d.%d" % sys.version_info[:3]}
    progress("importing sglang's target modules (the patches decide as in a server)")
    broken = check.torch_problem()
    report["torch_problem"] = broken
    if broken is not None:
        return report
    from npu_shim import _bootstrap, installer

    report["shim_active"] = bool((installer.watcher_armed() or _bootstrap._WATCHER.fired)
                                 and not _bootstrap._WATCHER.off)
    report["imports"] = check.import_target_modules()
    report["sglang"] = check.sglang_facts()
    states = runtime.states()
    report["states"] = {n: {"state": s["state"], "reason": s["reason"]} for n, s in states.items()}
    import torch

    from npu_shim import synthetic_moe

    progress("finding the device")
    kind, name, simulated = synthetic_moe.find_device(torch)
    index = options["device_index"]
    report["device"] = {"kind": kind, "name": name, "simulated": simulated, "index": index}
    decided = plan(report["states"], kind, options["patches"])
    report["plan"] = decided
    steps = [n for n, why in decided.items() if why is None]
    if kind is None or not steps:
        return report
    free, total = memory_info(torch, kind, index)
    need = need_mib(steps, options["zbal_mib"])
    report["device"].update(free_mib=free, total_mib=total, need_mib=need)
    if free < need:
        report["refused"] = ("%s %d has %d MiB free of %d MiB; the selftest needs %d MiB (is a server "
                             "using it?)" % (kind, index, free, total, need))
        return report
    dm = torch.get_device_module(kind)
    device = "cpu" if simulated else "%s:%d" % (kind, index)
    if not simulated:
        dm.set_device(index)
    results = {}
    if "mla_weight_release" in steps:
        _run_step(results, "mla_weight_release", mla_step, torch, dm, device, simulated, index)
    if "dual_stream_experts" in steps:
        _run_step(results, "dual_stream_experts", dual_stream_step, torch, dm, device, simulated,
                  options.get("tokens"))
    report["results"] = results
    report["zbal_next"] = "zbal" in steps
    report["seconds"] = round(time.monotonic() - started, 2)
    return report


def stage_zbal(options):
    import torch  # torch only: nothing may touch the device before zbal's allocator is in

    report = {"stage": "zbal", "pid": os.getpid()}
    npu = getattr(torch, "npu", None)
    simulated = bool(getattr(npu, "__simnpu__", False))
    results = {}
    _run_step(results, "zbal", zbal_step, torch, options["device_index"], options["zbal_mib"], simulated)
    report["results"] = results
    return report


def main(argv=None):
    """``python -c 'from npu_shim import selftest_child; selftest_child.main()' STAGE OPTIONS``."""
    argv = sys.argv[1:] if argv is None else argv
    stage, options = argv[0], json.loads(argv[1])
    report = (stage_zbal if stage == "zbal" else stage_main)(options)
    emit(report)
