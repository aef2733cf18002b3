"""The device side of ``python -m npu_shim selftest`` (npu_shim/cli/selftest.py starts it).

Stage ``main``: imports every sglang module a patch targets, as ``check`` does (the patches decide
in this process as in a server), finds the device (NPU, else CUDA) and its free memory, refuses
when too little is free, then runs the step of each applied patch that shares a process.  A patch
whose step must run alone (its module's ``ALONE``: its allocator goes in before anything else
touches the device) gets a fresh process of its own after that.  Each step is the patch's own
(npu_shim/patches/_selftest/<name>.py, ``core.loading.selftest_step``): ``run(step)`` returns (ok, line,
facts).  Each stage prints progress lines and one report line (JSON) on stdout.

On the tests' simulated NPU (``torch.npu.__simnpu__``) the flow runs on host tensors: no allocator
statistics and no timings exist there, and the report says so.
"""

import json
import os
import sys
import time
import types

from npu_shim.reporting.log import one_line

MARK = "npu-shim-selftest:"
PROGRESS = "npu-shim-selftest-progress:"
MIB = 1 << 20


def progress(text):
    sys.stdout.write(PROGRESS + text + "\n")
    sys.stdout.flush()


def emit(report):
    from npu_shim.cli import children

    children.write_report(MARK, report)


def _one_line(exc):
    return one_line("%s: %s" % (type(exc).__name__, exc))


def patches():
    """{name: Patch} of the registered patches, in registry order."""
    from npu_shim.core.loading import load_all

    return {patch.name: patch for patch in load_all()}


def steps_of_patches():
    """{name: its SelftestStep, or None} of the registered patches, in registry order."""
    from npu_shim.core.loading import selftest_step

    return {name: selftest_step(patch) for name, patch in patches().items()}


# -- what to run -----------------------------------------------------------------------------------

def plan(states, kind, forced=()):
    """{patch: None (run its step) or why not} for every known patch, in registry order.
    ``states``: {name: {"state", "reason"}} of this process; ``kind``: "npu", "cuda" or None;
    ``forced``: names run whatever their state (``--patch``)."""
    decided, steps = {}, steps_of_patches()
    for name, step in steps.items():
        state = (states.get(name) or {}).get("state")
        if state != "applied" and name not in forced:
            decided[name] = "not applied here" if state else "not decided here (no target module imported)"
        elif step is None:
            decided[name] = "nothing to exercise on a device"
        elif kind is None:
            decided[name] = "no device"
        elif kind not in step.devices:
            decided[name] = "n/a on %s" % kind
        else:
            decided[name] = None
    return decided


def need_mib(steps, options):
    """Free device memory the planned steps need: the largest step's (they run one after another)."""
    found = steps_of_patches()
    return max([found[name].mib(options) for name in steps] or [0])


def no_torch():
    """``torch_problem``'s answer where no torch is installed at all (``check`` leaves that to the
    target modules' imports; every step here needs torch)."""
    try:
        import torch  # noqa: F401 - whether it imports is the question
    except ModuleNotFoundError as exc:
        if exc.name == "torch":
            return {"kind": "torch", "error": _one_line(exc),
                    "text": "torch is not installed in this Python (%s): the selftest needs torch "
                            "to reach the device" % sys.executable}
    return None  # any other failure: torch_problem has said it


def device_count(torch, kind):
    """How many devices of ``kind`` torch sees (the simulated NPU: as many as it says)."""
    return int(torch.get_device_module(kind).device_count())


def memory_info(torch, kind, index):
    """(free MiB, total MiB) of the device, from its device module's ``mem_get_info``."""
    free, total = torch.get_device_module(kind).mem_get_info(index)
    return int(free) // MIB, int(total) // MIB


def find_device(torch=None):
    """(kind, name, simulated) of this machine's accelerator without initialising it: kind "npu"
    (torch.npu, loading torch_npu if torch did not) before "cuda", or None (name then says why);
    simulated is True for the tests' simulated NPU (its module says ``__simnpu__``)."""
    if torch is None:
        import torch
    npu = getattr(torch, "npu", None)
    if npu is None:
        try:
            import torch_npu  # noqa: F401 - registers torch.npu where torch did not autoload it
        except Exception:  # noqa: BLE001 - no NPU stack on this machine
            pass
        npu = getattr(torch, "npu", None)
    if npu is not None:
        try:
            if npu.is_available() and npu.device_count() > 0:
                simulated = bool(getattr(npu, "__simnpu__", False))
                return "npu", "simulated NPU" if simulated else npu.get_device_name(0), simulated
        except Exception:  # noqa: BLE001 - a broken driver: look for CUDA instead
            pass
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda", cuda.get_device_name(0), False
    return None, "no NPU or CUDA device visible to torch", False


def graphs_skipped(kind, dm, simulated=False, torch=None):
    """None where the steps drive their paths through an NPU graph capture and a replay (an NPU
    whose torch_npu has the graph API sglang's runner calls), else why not.  On the simulated NPU
    a graph records only tensors on the npu: where it makes none, nothing would be captured.  (A
    real NPU is not touched here: one patch's step needs its allocator in first.)"""
    from npu_shim.cli import check

    if kind != "npu":
        return "graph capture is an NPU's here; the device is %s" % (kind or "none")
    api = check.graph_api(dm)
    if not api["usable"]:
        return "torch_npu's graph API is missing here (%s present of %s)" % (
            ", ".join(api["present"]) or "none", ", ".join(check.GRAPH_API))
    if simulated:
        try:
            torch.empty(1, device="npu")
        except Exception as exc:  # noqa: BLE001 - the simulation's own refusal, in one line
            return "the simulated NPU here makes no tensors on the npu (%s)" % _one_line(exc)[:120]
    return None


def step_context(name, torch, kind, index, simulated, options, graphs):
    """What patch ``name``'s ``run(step)`` is handed: torch, the device module and device, this
    run's options, ``progress(text)`` (the line names the patch), ``record()``, the patch's
    PatchRecord in this process once its target modules are imported, and ``graphs``: None where
    the step also drives its path through a graph capture and a replay, else why not (decided once,
    in the main stage: a process whose step runs alone touches nothing before the step does), and
    ``graph_device``, where that capture's tensors live (the device itself, simulated or not)."""
    from npu_shim.runtime import activation

    dm = torch.get_device_module(kind) if kind else None
    device = "cpu" if simulated else "%s:%d" % (kind, index)
    return types.SimpleNamespace(torch=torch, kind=kind, dm=dm, device=device, index=index,
                                 simulated=simulated, options=options, graphs=graphs,
                                 graph_device="%s:%d" % (kind, index) if kind else None,
                                 progress=lambda text: progress("%s: %s" % (name, text)),
                                 record=lambda: activation.RUNTIME.record(name))


def run_patch_step(results, name, step):
    started = time.monotonic()
    try:
        ok, line, facts = steps_of_patches()[name].module.run(step)
    except Exception as exc:  # noqa: BLE001 - a step that raises failed; the others still run
        ok, line, facts = False, "raised " + _one_line(exc), {}
    results[name] = {"result": "ok" if ok else "FAILED", "line": line, "facts": facts,
                     "seconds": round(time.monotonic() - started, 2)}


# -- the stages ------------------------------------------------------------------------------------

def stage_main(options, watcher):
    from npu_shim.cli import check
    from npu_shim.runtime import activation

    started = time.monotonic()
    report = {"stage": "main", "pid": os.getpid(), "python": "%d.%d.%d" % sys.version_info[:3]}
    progress("importing sglang's target modules (the patches decide as in a server)")
    broken = check.torch_problem() or no_torch()
    report["torch_problem"] = broken
    if broken is not None:
        return report
    report["shim_active"] = watcher.activates_the_shim()
    report["imports"] = check.import_target_modules()
    report["sglang"] = check.sglang_facts()
    states = activation.RUNTIME.states()
    report["states"] = {n: {"state": s["state"], "reason": s["reason"]} for n, s in states.items()}
    import torch

    progress("finding the device")
    kind, name, simulated = find_device(torch)
    index = options["device_index"]
    report["device"] = {"kind": kind, "name": name, "simulated": simulated, "index": index}
    npu = getattr(torch, "npu", None)
    report["graphs"] = check.graph_facts(npu)
    skipped = report["graphs"]["skipped"] = (
        graphs_skipped(kind, torch.get_device_module(kind), simulated, torch) if kind else "no device")
    decided = plan(report["states"], kind, options["patches"])
    report["plan"] = decided
    steps = [n for n, why in decided.items() if why is None]
    count = device_count(torch, kind) if kind is not None else 0
    if kind is not None and index >= count:  # a device that is not there: the user's words were wrong
        report["bad_index"] = ("--device-index %d: torch sees %d %s device%s here (0%s)" % (
            index, count, kind, "" if count == 1 else "s", "" if count == 1 else " to %d" % (count - 1)))
        return report
    if kind is None or not steps:
        return report
    free, total = memory_info(torch, kind, index)
    need = need_mib(steps, options)
    report["device"].update(free_mib=free, total_mib=total, need_mib=need)
    if free < need:
        report["refused"] = ("%s %d has %d MiB free of %d MiB; the selftest needs %d MiB (is a server "
                             "using it?)" % (kind, index, free, total, need))
        return report
    if not simulated:
        torch.get_device_module(kind).set_device(index)
    found = steps_of_patches()
    results = {}
    for name in steps:
        if not found[name].alone:
            run_patch_step(results, name, step_context(name, torch, kind, index, simulated, options, skipped))
    report["results"] = results
    report["alone_next"] = [name for name in steps if found[name].alone]
    report["seconds"] = round(time.monotonic() - started, 2)
    return report


def stage_alone(name, options):
    """A patch's step in a fresh process, where torch is imported and nothing has touched the device."""
    import torch

    report = {"stage": name, "pid": os.getpid()}
    npu = getattr(torch, "npu", None)
    simulated = bool(getattr(npu, "__simnpu__", False))
    results = {}
    run_patch_step(results, name, step_context(name, torch, options["kind"], options["device_index"],
                                               simulated, options, options["graphs"]))
    report["results"] = results
    return report


def main(watcher, argv=None):
    """``STAGE OPTIONS`` on the command line of npu_shim/cli/selftest.py's ``CHILD_CODE``;
    ``watcher``: the start-up watcher (npu_shim/_bootstrap.py), handed in by that code."""
    argv = sys.argv[1:] if argv is None else argv
    stage, options = argv[0], json.loads(argv[1])
    try:
        report = stage_main(options, watcher) if stage == "main" else stage_alone(stage, options)
    except Exception as exc:  # noqa: BLE001 - one line for the parent, not a traceback
        report = {"stage": stage, "pid": os.getpid(), "error": "the %s stage raised %s"
                  % (stage, _one_line(exc))}
    emit(report)
