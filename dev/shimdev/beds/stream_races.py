"""The GLM-4.x MoE dual-stream path of a real sglang release under the simulated NPU's stream
sanitizer: the shim's backport on 0.5.7-0.5.9, upstream's own ``process_shared_expert`` from 0.5.10.

Run inside a release process (``realsglang.run_program``, the import probe), after the release's
modules were imported with the streams asked for (``SGLANG_NPU_USE_MULTI_STREAM=1``).  Each scenario
drives the release's real ``Glm4MoeSparseMoeBlock.forward_deepep`` on the synthetic block of
``release_beds.glm4_moe_bed`` and returns what the sanitizer reported:

* ``extend`` / ``target_verify`` -- two MoE layers on the main stream; the first layer's output is
  read by the main stream (the decoder layer's residual add) and freed before the second;
* ``in_place_routed`` -- the same, with routed experts that write their output over their input
  (as a fused MoE with ``inplace=True`` does, sglang#10352).  sglang's NPU routed path does not do
  this (DeepEP dispatch/combine and torch_npu's npu_grouped_matmul / npu_swiglu /
  npu_dynamic_quant all return new tensors): the scenario shows what would happen if it did;
* ``draft_and_target`` -- speculative decoding's target model on the default stream and its draft
  model on a stream of its own (spec v2's overlap plan stream, sglang#30965): target verify, its
  output read and freed, a draft extend on the draft's stream, the target's next layer.

``EXPECTED`` says what each should report for the backport and for upstream; ``problems`` compares
(the import matrix and ``scripts/release_report.py`` through dev/shimdev/beds/import_probe.py).  A
release whose own code stops racing -- or starts -- shows up there: say so in docs/reliability.md and here.
"""
from __future__ import annotations

SCENARIOS = ("extend", "target_verify", "in_place_routed", "draft_and_target")

#: Report kinds expected per scenario: the backport (after its fix) and upstream 0.5.10+.
EXPECTED = {
    "backport": {"extend": [], "target_verify": [], "in_place_routed": ["write-after-read"],
                 "draft_and_target": []},
    "upstream": {"extend": [], "target_verify": [], "in_place_routed": ["write-after-read"],
                 "draft_and_target": ["unsafe-reuse"]},
}


def in_place(experts):
    """``experts`` writing its output into its input (what an in-place routed path would do);
    csan_check.py runs the same scenario on CUDA."""
    import torch

    class InPlaceExperts(torch.nn.Module):
        should_fuse_routed_scaling_factor_in_topk = experts.should_fuse_routed_scaling_factor_in_topk

        def __init__(self):
            super().__init__()
            self.inner = experts

        def forward(self, hidden_states, topk_output):
            return hidden_states.copy_(self.inner(hidden_states=hidden_states, topk_output=topk_output))

    return InPlaceExperts()


def _two_layers(bed, mode):
    import torch

    hidden = torch.randn(5, bed.H)
    out = bed.block.forward_deepep(hidden, bed.batch(mode))
    residual = out + hidden  # the decoder layer reads the output on the main stream
    del out
    return bed.block.forward_deepep(residual, bed.batch(mode))


def _draft_and_target(bed):
    import torch

    mode = bed.ForwardMode
    draft = torch.npu.Stream()
    hidden = torch.randn(5, bed.H)
    out = bed.block.forward_deepep(hidden, bed.batch(mode.TARGET_VERIFY))
    residual = out + hidden
    del out
    with torch.npu.stream(draft):
        bed.block.forward_deepep(torch.randn(3, bed.H), bed.batch(getattr(mode, "DRAFT_EXTEND", mode.EXTEND)))
    return bed.block.forward_deepep(residual, bed.batch(mode.TARGET_VERIFY))


def _in_place_routed(bed):
    experts = bed.block.experts
    bed.block.experts = in_place(experts)
    try:
        return _two_layers(bed, bed.ForwardMode.EXTEND)
    finally:
        bed.block.experts = experts


def run(bed=None):
    """{scenario: [report as a dict]} for every scenario, on ``bed`` (a glm4_moe_bed)."""
    import torch
    from shimdev import simnpu
    from shimdev.beds.release_beds import glm4_moe_bed

    bed = bed or glm4_moe_bed("partial", head_dim=64)
    drive = {
        "extend": lambda: _two_layers(bed, bed.ForwardMode.EXTEND),
        "target_verify": lambda: _two_layers(bed, bed.ForwardMode.TARGET_VERIFY),
        "in_place_routed": lambda: _in_place_routed(bed),
        "draft_and_target": lambda: _draft_and_target(bed),
    }
    out = {}
    for name in SCENARIOS:
        with torch.no_grad(), simnpu.sanitize() as san:
            drive[name]()
        out[name] = [report.as_dict() for report in san.reports]
    return out


def kinds(races):
    return {name: sorted({r["kind"] for r in reports}) for name, reports in races.items()}


def problems(races, who):
    """How ``races`` (from run) differ from what EXPECTED says for ``who`` (backport / upstream)."""
    found = []
    for name, expected in EXPECTED[who].items():
        got = kinds(races).get(name)
        if got != expected:
            detail = "; ".join(r["message"] for r in races.get(name, []))[:2000]
            found.append("%s: %s, expected %s (%s)" % (name, got, expected, detail))
    return found


# ------------------------------------------------------------------------------ from outside

def probe(version):
    """{state, races} of dual_stream_experts in release ``version`` (its own process)."""
    from shimdev.envs import realsglang
    from shimdev.beds.demo_features import DEMO_ENV

    return realsglang.run_program(version, "dual_stream_races", env=DEMO_ENV, zbal=True)


def main(argv):
    """Print what the sanitizer reports per scenario for each release in ``argv``; 1 when a
    release's reports are not what EXPECTED says for it."""
    status = 0
    for version in argv or ("0.5.9", "0.5.11"):
        out = probe(version)
        who = "backport" if out["state"] == "applied" else "upstream"
        print("sglang %s: dual_stream_experts %s (%s's code)" % (version, out["state"], who))
        for name in SCENARIOS:
            reports = out["races"][name]
            print("  %-17s %s" % (name, ", ".join(sorted({r["kind"] for r in reports})) or "nothing"))
            for report in reports:
                print("    - " + report["message"])
        wrong = problems(out["races"], who) if out["state"] in ("applied", "upstream") else []
        for line in wrong:
            print("  UNEXPECTED: " + line)
        status |= bool(wrong)
    return status
