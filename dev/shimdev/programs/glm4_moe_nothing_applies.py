"""What the patch says and wraps on the synthetic GLM-4 MoE bed when nothing of it applies
(tests/patches/test_dual_stream_experts_real.py, 0.5.9: no kernel and streams off, or switched
off)."""
from shimdev.programs import arg, emit
from shimdev.release_beds import glm4_moe_bed

bed = glm4_moe_bed(arg(0))  # the fused decode kernel: "partial", "full_head" or None
state = bed.state
wrapped_names = bed.wrapped_names

emit({"wrapped": wrapped_names(), "state": state()})
