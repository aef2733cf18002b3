"""``python3 scripts/demo.py`` (default release 0.5.11): runs end to end and says what it should.

One subprocess (the demo itself starts two more in the release venv: the status CLI and the
in-process drivers).  Builds the 0.5.11 venv when it is missing.
"""
import re
import subprocess
import sys
from pathlib import Path

from shimdev.beds.expected_states import PATCH_ORDER, expected

REPO = Path(__file__).resolve().parents[2]


def test_demo_default_release():
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "demo.py")], cwd=str(REPO),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=900)
    out = p.stdout
    assert p.returncode == 0, out[-4000:] + p.stderr[-4000:]
    lines = out.splitlines()

    # Simulated NPU, said at the top and at the bottom; the sglang code is real.
    assert "SIMULATED NPU" in "\n".join(lines[:3]) and "SIMULATED NPU" in "\n".join(lines[-4:])
    assert "sglang code is REAL (release 0.5.11" in out
    assert "All checks passed" in out and "DEMO FAILED" not in out

    # (1) the status table, run in the release: it reports its sglang layer and the expected states.
    assert re.search(r"\|\s+sglang: 0\.5\.11 at \S*/layered/sglang-0\.5\.11/sglang", out)
    assert "active in this interpreter: yes" in out
    states = expected("0.5.11")
    assert states == {"zbal": "applied", "mla_weight_release": "applied",
                      "dual_stream_experts": "upstream"}
    for name in PATCH_ORDER:
        assert re.search(r"^  \|\s+%s\s+%s\s" % (name, states[name]), out, re.M), name
        # (2) the in-process states, same as the table
        assert re.search(r"^    %s\s+%s\s+\S" % (name, states[name]), out, re.M), name
    assert "sglang 0.5.11 has it: glm4_moe runs shared experts through" in out

    # (3) one summary per feature, with the numbers the synthetic model gives.
    assert ("zbal full mode, Scheduler.__init__: allocator swapped to zbal -> zbal bootstrap(61440 MiB, "
            "rank 3/4, tcp://10.0.0.1:6789) -> Scheduler body -> 1st allocation") in out
    assert "zbal mix mode, Scheduler.__init__: allocator swapped to zbal -> Scheduler body" in out
    assert ("ModelRunner.initialize: weights -> KV cache -> attn backend -> "
            "zbal bootstrap(GVA heap 12800 MiB) -> graphs") in out
    assert "get_available_gpu_memory = 10.00 GiB" in out and "device alone: 1.00" in out
    assert "get_npu_memory_capacity = 61440 MiB (device alone: 65536)" in out
    assert re.search(r"mla_weight_release: decode role, GLM-5 MLA layer at TP16: released 31\.50 MiB "
                     r"\(qkv_a_proj 30\.75 \+ w_kc 0\.75\)", out)
    assert "touching the released w_kc raises ReleasedWeightError:" in out
    assert "npu-shim released w_kc of layer 0" in out
    assert "dual_stream_experts: upstream -- the shim stands down; sglang 0.5.11's own forward_deepep ran" \
        in out
    assert "extend batch: shared experts on side-1, gate/topk/routed experts on main" in out
    assert "output == single-stream output: True" in out

    assert 30 <= len(lines) <= 70, len(lines)
