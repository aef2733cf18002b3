"""Benchmark (run by scripts/bench_dual_stream.py and scripts/bench.py; smoke-tested by
tests/patches/test_dual_stream_experts.py): how much of the ideal saving the dual-stream experts path gets (CUDA or NPU).

A synthetic GLM-4.x-style MoE block (router gate, top-k, routed experts run expert by expert,
one shared expert MLP) is run three ways on one device, side by side in one process:

* serial     -- the original order, everything on the main stream;
* overlapped -- the shim's own dual-stream body (``dual_stream_experts.DualStream._forward_deepep_dual_stream``:
  shared experts on the side stream, gate -> topk -> routed experts on the main stream, main waits
  for the side stream before the combine);
* the parts alone -- shared experts only, routed path only; ideal = max(shared, routed).

It prints serial, overlapped and ideal time (medians), overlapped/ideal, and the fraction of the
ideal saving (serial - ideal) that the overlap realises; target >= 90 %.  The stream helpers use
``torch.get_device_module()`` as upstream does, so the same code runs on CUDA and on an NPU.
Without either device it says so and measures nothing.

    python3 scripts/bench_dual_stream.py [--tokens 512] [--hidden 2048] [--device cpu]

``--device cpu`` only smoke-tests the code paths (CPU streams are no-ops: no overlap to measure).
"""
from __future__ import annotations

import argparse
import statistics
import time

WHAT = "dual-stream overlap (CUDA or NPU when present)"
TARGET = ">= 90 % of the ideal saving (serial - max(shared, routed))"
DEFAULTS = dict(tokens=512, hidden=2048, shared_inter=4096, experts=8, topk=2, expert_inter=1024,
                samples=15, reps=10, warmup=5)


class _NoDispatchInfo:
    """What ExpertLocationDispatchInfo.init_new returns without EPLB: None."""

    @staticmethod
    def init_new(layer_id):
        return None


# The dual-stream body reads ExpertLocationDispatchInfo from the globals of the function it
# stands in for; _serial_forward (below) is that function here.
ExpertLocationDispatchInfo = _NoDispatchInfo


def find_device():
    """('cuda'|'npu', reason) for a real accelerator, else (None, why not)."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if torch.cuda.is_available():
        return "cuda", torch.cuda.get_device_name(0)
    npu = getattr(torch, "npu", None)
    if npu is None:
        try:
            import torch_npu  # noqa: F401
        except Exception:  # noqa: BLE001 - no NPU stack on this machine
            npu = None
        npu = getattr(torch, "npu", None)
    if npu is not None and not getattr(npu, "__simnpu__", False):
        try:
            if npu.is_available():
                return "npu", "Ascend NPU"
        except Exception:  # noqa: BLE001
            pass
    return None, "no CUDA or NPU device on this machine"


def build_block(device, dtype, p):
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    H, E, K = p["hidden"], p["experts"], p["topk"]

    class Mlp(torch.nn.Module):
        def __init__(self, inter):
            super().__init__()
            self.gate_up = torch.nn.Linear(H, 2 * inter, bias=False)
            self.down = torch.nn.Linear(inter, H, bias=False)

        def forward(self, x):
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)

    class TopK:
        def __call__(self, hidden_states, router_logits, num_token_non_padded=None,
                     expert_location_dispatch_info=None):
            weights, ids = torch.softmax(router_logits.float(), dim=-1).topk(K, dim=-1)
            return (weights / weights.sum(dim=-1, keepdim=True)).to(hidden_states.dtype), ids

    class Experts(torch.nn.Module):
        """Routed experts, one expert at a time (small GEMMs: the device is far from full)."""
        should_fuse_routed_scaling_factor_in_topk = False

        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleList(Mlp(p["expert_inter"]) for _ in range(E))

        def forward(self, hidden_states, topk_output):
            weights, ids = topk_output
            out = torch.zeros_like(hidden_states)
            for e, mlp in enumerate(self.experts):
                token, slot = (ids == e).nonzero(as_tuple=True)
                if token.numel():
                    y = mlp(hidden_states[token]) * weights[token, slot].unsqueeze(-1)
                    out.index_add_(0, token, y)
            return out

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer_id = 0
            self.num_fused_shared_experts = 0
            self.routed_scaling_factor = 2.5
            self.gate = torch.nn.Linear(H, E, bias=False)
            self.topk = TopK()
            self.experts = Experts()
            self.shared_experts = Mlp(p["shared_inter"])

        def _forward_shared_experts(self, hidden_states):
            return self.shared_experts(hidden_states)

    return Block().to(device=device, dtype=dtype)


def _serial_forward(self, hidden_states, forward_batch):
    """0.5.9's forward_deepep order, single stream (the shim's dual-stream body mirrors it)."""
    router_logits = self.gate(hidden_states)
    shared_output = self._forward_shared_experts(hidden_states)
    topk_output = self.topk(hidden_states, router_logits,
                            num_token_non_padded=forward_batch.num_token_non_padded,
                            expert_location_dispatch_info=ExpertLocationDispatchInfo.init_new(
                                layer_id=self.layer_id))
    final = self.experts(hidden_states=hidden_states, topk_output=topk_output)
    shared_output.add_(final, alpha=self.routed_scaling_factor)
    return shared_output


def _routed_only(self, hidden_states, forward_batch):
    router_logits = self.gate(hidden_states)
    topk_output = self.topk(hidden_states, router_logits)
    final = self.experts(hidden_states=hidden_states, topk_output=topk_output)
    return final.mul_(self.routed_scaling_factor)


def _median_ms(fn, device_module, p):
    for _ in range(p["warmup"]):
        fn()
    device_module.synchronize()
    samples = []
    for _ in range(p["samples"]):
        start = time.perf_counter()
        for _ in range(p["reps"]):
            fn()
        device_module.synchronize()
        samples.append((time.perf_counter() - start) * 1000.0 / p["reps"])
    return statistics.median(samples)


def measure(device, **overrides):
    """{serial, overlapped, shared, routed, ideal (ms), equal (bool)} on ``device``."""
    import types

    import torch

    from npu_shim.patches import dual_stream_experts as ds

    p = dict(DEFAULTS, **overrides)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    dm = torch.get_device_module(device)
    block = build_block(device, dtype, p)
    hidden = torch.randn(p["tokens"], p["hidden"], device=device, dtype=dtype)
    batch = types.SimpleNamespace(num_token_non_padded=None)
    # The stream helpers ask torch.get_device_module() (no argument, as upstream): make sure it
    # names this device even where the accelerator default differs (e.g. --device cpu on a GPU box).
    real_get = torch.get_device_module
    torch.get_device_module = lambda d=None: real_get(device if d is None else d)
    try:
        with torch.no_grad():
            serial = lambda: _serial_forward(block, hidden, batch)  # noqa: E731
            process = ds.DualStream()  # the shim's per-process state, as a decision builds it
            overlapped = lambda: process._forward_deepep_dual_stream(_serial_forward, block, hidden, batch)  # noqa: E731
            shared = lambda: block._forward_shared_experts(hidden)  # noqa: E731
            routed = lambda: _routed_only(block, hidden, batch)  # noqa: E731
            equal = bool(torch.equal(serial(), overlapped()))
            result = {name: _median_ms(fn, dm, p) for name, fn in
                      (("serial", serial), ("overlapped", overlapped), ("shared", shared),
                       ("routed", routed))}
            # Serial once more after the rest: a drift between the two would show up here.
            result["serial_again"] = _median_ms(serial, dm, p)
    finally:
        torch.get_device_module = real_get
    result["ideal"] = max(result["shared"], result["routed"])
    result["equal"] = equal
    result["params"] = p
    return result


def _row(result, device, name):
    serial = statistics.median([result["serial"], result["serial_again"]])
    ideal, over = result["ideal"], result["overlapped"]
    possible = serial - ideal
    fraction = (serial - over) / possible if possible > 0 else float("nan")
    p = result["params"]
    measured = ("serial %.3f ms, overlapped %.3f ms, ideal max(shared %.3f, routed %.3f) = %.3f ms; "
                "overlapped/ideal = %.2f; saving %.0f %% of the ideal; outputs equal: %s"
                % (serial, over, result["shared"], result["routed"], ideal, over / ideal,
                   fraction * 100, result["equal"]))
    ok = bool(result["equal"] and possible > 0 and fraction >= 0.9)
    if device == "cpu":
        measured += " (CPU smoke run: CPU streams are no-ops, nothing to overlap)"
        ok = None
    return {
        "what": WHAT,
        "how": ("%s (%s): synthetic MoE block, %d tokens x hidden %d, shared MLP %d, %d routed experts "
                "(top-%d, MLP %d) run one by one; medians of %d samples x %d reps"
                % (device, name, p["tokens"], p["hidden"], p["shared_inter"], p["experts"], p["topk"],
                   p["expert_inter"], p["samples"], p["reps"])),
        "measured": measured,
        "target": TARGET,
        "ok": ok,
    }


def rows(device=None, **overrides):
    """The benchmark table rows (one): measured where a CUDA or NPU device exists, else ok=None."""
    name = device
    if device is None:
        device, name = find_device()
        if device is None:
            return [{
                "what": WHAT,
                "how": "serial vs overlapped time of shared+routed experts on a synthetic MoE block",
                "measured": "not measured: %s" % name,
                "target": TARGET,
                "ok": None,
            }]
    return [_row(measure(device, **overrides), device, name)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "npu", "cpu"), help="default: the one present")
    for key in ("tokens", "hidden", "shared_inter", "experts", "topk", "expert_inter", "samples", "reps"):
        parser.add_argument("--" + key.replace("_", "-"), type=int, dest=key)
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k != "device" and v is not None}
    for row in rows(args.device, **overrides):
        for key in ("what", "how", "measured", "target", "ok"):
            print("%-9s %s" % (key + ":", row[key]))
    return 0
