"""The backported dual-stream experts and fused decode on the synthetic GLM-4 MoE bed
(tests/patches/test_dual_stream_experts_real.py, 0.5.9): stream order, numerics, fused decode, and
the races of dev/shimdev/stream_races.py."""
import copy

import torch
from shimdev import stream_races
from shimdev.programs import arg, emit
from shimdev.release_beds import glm4_moe_bed

bed = glm4_moe_bed(arg(0))  # the fused decode kernel: "partial", "full_head" or None
H = bed.H
ForwardMode = bed.ForwardMode
moe = bed.moe
prepare = bed.prepare
layers = bed.layers
max_diff = bed.max_diff
state = bed.state
wrapped_names = bed.wrapped_names
cos_sin_calls = bed.cos_sin_calls
sanitizer_reports = bed.sanitizer_reports

result = {"wrapped": wrapped_names()}
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
    diffs = [max_diff(*prepare(layer, positions, hidden, ForwardMode.DECODE)) for layer in layers]
    steps.append({"diffs": diffs, "cos_sin_calls": len(cos_sin_calls)})
result["decode_steps"] = steps
fused_before = state()["details"]["counts"]["fused_calls"]
got, ref = prepare(layers[0], torch.tensor([1, 2, 3, 4]), torch.randn(4, H), ForwardMode.EXTEND)
result["extend_equal"] = all(bool(torch.equal(g, r)) for g, r in zip(got, ref))
result["extend_fused_calls"] = state()["details"]["counts"]["fused_calls"] - fused_before
result["state"] = copy.deepcopy(state())  # its counts are live: the races below call forward_deepep
result["sanitizer"] = sanitizer_reports
result["races"] = stream_races.run(bed)
emit(result)
