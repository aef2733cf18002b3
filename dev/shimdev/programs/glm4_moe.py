"""The dual-stream experts on the synthetic GLM-4 MoE bed of ``release_beds.glm4_moe_bed``
(tests/patches/test_dual_stream_experts_real.py, 0.5.9).  Arguments: the fused decode kernel
("partial", "full_head" or None, see dev/shimdev/beds/dual_stream_kernels.py) and the scenario, one of
``SCENARIOS``."""
import copy

import torch
from shimdev.beds import stream_races
from shimdev.programs import arg, emit
from shimdev.beds.release_beds import glm4_moe_bed


def streams_and_fused(bed):
    """Stream order, numerics, fused decode, and the races of dev/shimdev/beds/stream_races.py."""
    H, ForwardMode, moe, prepare = bed.H, bed.ForwardMode, bed.moe, bed.prepare
    result = {"wrapped": bed.wrapped_names()}
    h = torch.randn(5, H)
    runs = {}
    for name in ("EXTEND", "TARGET_VERIFY", "MIXED", "DECODE"):
        out, ref, events = moe(h, getattr(ForwardMode, name))
        runs[name] = {"equal": bool(torch.equal(out, ref)), "events": events}
    out, ref, events = moe(torch.empty(0, H), ForwardMode.EXTEND)
    runs["EMPTY_EXTEND"] = {"equal": bool(torch.equal(out, ref)), "events": events}
    result["moe"] = runs

    steps = []
    for step, positions in enumerate((torch.tensor([3, 9, 17]), torch.tensor([4, 10, 18]))):
        hidden = torch.randn(3, H)
        diffs = [bed.max_diff(*prepare(layer, positions, hidden, ForwardMode.DECODE)) for layer in bed.layers]
        steps.append({"diffs": diffs, "cos_sin_calls": len(bed.cos_sin_calls)})
    result["decode_steps"] = steps
    fused_before = bed.state()["details"]["counts"]["fused_python_calls"]
    got, ref = prepare(bed.layers[0], torch.tensor([1, 2, 3, 4]), torch.randn(4, H), ForwardMode.EXTEND)
    result["extend_equal"] = all(bool(torch.equal(g, r)) for g, r in zip(got, ref))
    result["extend_fused_calls"] = bed.state()["details"]["counts"]["fused_python_calls"] - fused_before
    result["state"] = copy.deepcopy(bed.state())  # its counts are live: the races below call forward_deepep
    result["sanitizer"] = bed.sanitizer_reports
    result["races"] = stream_races.run(bed)
    return result


def extend_then_decode(bed):
    """One extend batch through the MoE block, then one decode step of the first attention layer:
    (patched, original, events) of the block and (patched, original) q, k, v of the layer."""
    h = torch.randn(5, bed.H)
    out, ref, events = bed.moe(h, bed.ForwardMode.EXTEND)
    got, fref = bed.prepare(bed.layers[0], torch.tensor([3, 9, 17]), torch.randn(3, bed.H), bed.ForwardMode.DECODE)
    return out, ref, events, got, fref


def streams_off(bed):
    """Streams off: the experts keep their original path, the fused decode still applies."""
    out, ref, events, got, fref = extend_then_decode(bed)
    return {"wrapped": bed.wrapped_names(), "state": bed.state(), "equal": bool(torch.equal(out, ref)),
            "events": events, "fused_diff": bed.max_diff(got, fref)}


def old_kernel(bed):
    """A fused kernel without partial rotary: refused per layer, the streams still apply."""
    out, ref, events, got, fref = extend_then_decode(bed)
    return {"wrapped": bed.wrapped_names(), "state": bed.state(), "equal": bool(torch.equal(out, ref)),
            "fused_equal": all(bool(torch.equal(g, r)) for g, r in zip(got, fref)),
            "waits": [e for e in events if e[0] == "wait_stream"]}


def nothing_applies(bed):
    """What the patch says and wraps when nothing of it applies (no kernel and streams off, or
    switched off)."""
    return {"wrapped": bed.wrapped_names(), "state": bed.state()}


SCENARIOS = {f.__name__: f for f in (streams_and_fused, streams_off, old_kernel, nothing_applies)}

if __name__ == "__main__":
    scenario = SCENARIOS[arg(1)]  # a wrong name fails before the bed is built
    emit(scenario(glm4_moe_bed(arg(0))))
