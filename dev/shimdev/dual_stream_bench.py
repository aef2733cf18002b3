"""Benchmark (run by scripts/bench_dual_stream.py and scripts/bench.py; smoke-tested by
tests/patches/test_dual_stream_experts.py): how much of the ideal saving the dual-stream experts path
gets (CUDA or NPU).

A synthetic GLM-4.x-style MoE block (router gate, top-k, routed experts run expert by expert,
one shared expert MLP) is run three ways on one device, side by side in one process:

* serial     -- the original order, everything on the main stream;
* overlapped -- the shim's own dual-stream body (``dual_stream_experts.DualStream._forward_deepep_dual_stream``:
  shared experts on the side stream, gate -> topk -> routed experts on the main stream, main waits
  for the side stream before the combine);
* the parts alone -- shared experts only, routed path only; ideal = max(shared, routed).

It prints serial, overlapped and ideal time (medians of device time between two events on the main
stream), overlapped/ideal, and the fraction of the ideal saving (serial - ideal) that the overlap
realises; target >= 90 %.  Block and measurement are npu_shim/patches/_selftest/synthetic_moe.py's, the code
``python -m npu_shim selftest`` runs on the device.  The stream helpers use
``torch.get_device_module()`` as upstream does, so the same code runs on CUDA and on an NPU.
Without either device it says so and measures nothing.

    python3 scripts/bench_dual_stream.py [--tokens 512] [--hidden 2048] [--device cpu]

``--device cpu`` only smoke-tests the code paths (CPU streams are no-ops: no overlap to measure).
"""
from __future__ import annotations

import argparse

from npu_shim.patches._selftest import synthetic_moe
from npu_shim.patches._selftest.synthetic_moe import DEFAULTS, build_block, serial_forward as _serial_forward  # noqa: F401 - for csan_check and the tests

WHAT = "dual-stream overlap (CUDA or NPU when present)"
TARGET = ">= 90 % of the ideal saving (serial - max(shared, routed))"


def find_device():
    """('cuda'|'npu', name) for a real accelerator, else (None, why not); the simulated NPU of the
    tests is no device here (npu_shim.cli.selftest_child.find_device, as the selftest finds it)."""
    try:
        import torch  # noqa: F401 - only whether it imports
    except ImportError:
        return None, "torch is not installed"
    from npu_shim.cli.selftest_child import find_device as find_accelerator

    kind, name, simulated = find_accelerator()
    if kind is None or simulated:
        return None, "no CUDA or NPU device on this machine"
    return kind, name


def measure(device, **overrides):
    """npu_shim.patches._selftest.synthetic_moe.measure: the same code as ``python -m npu_shim selftest``."""
    return synthetic_moe.measure(device, **overrides)


def _row(result, device, name):
    serial, ideal, over = result["serial_median"], result["ideal"], result["overlapped"]
    fraction = result["fraction"]
    p = result["params"]
    measured = ("serial %.3f ms, overlapped %.3f ms, ideal max(shared %.3f, routed %.3f) = %.3f ms; "
                "overlapped/ideal = %s; saving %s of the ideal; outputs equal: %s"
                % (serial, over, result["shared"], result["routed"], ideal,
                   "%.2f" % (over / ideal) if ideal > 0 else "n/a",
                   "%.0f %%" % (fraction * 100) if fraction is not None else "n/a", result["equal"]))
    ok = bool(result["equal"] and fraction is not None and fraction >= synthetic_moe.TARGET_FRACTION)
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
