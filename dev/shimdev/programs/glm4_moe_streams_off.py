"""Streams off on the synthetic GLM-4 MoE bed (tests/patches/test_dual_stream_experts_real.py,
0.5.9): the experts keep their original path, the fused decode still applies."""
import torch
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

h = torch.randn(5, H)
out, ref, events = moe(h, ForwardMode.EXTEND)
got, fref = prepare(layers[0], torch.tensor([3, 9, 17]), torch.randn(3, H), ForwardMode.DECODE)
emit({"wrapped": wrapped_names(), "state": state(), "equal": bool(torch.equal(out, ref)),
      "events": events, "fused_diff": max_diff(got, fref)})
