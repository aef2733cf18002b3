"""Benchmark (run by scripts/bench_dual_stream.py and scripts/bench.py; smoke-tested by
tests/patches/test_dual_stream_experts.py): how much of the ideal saving the dual-stream experts path
gets (CUDA or NPU).

A synthetic GLM-4.x-style MoE block (router gate, top-k, routed experts run expert by expert,
one shared expert MLP) is run three ways on one device, side by side in one process:

* serial     -- the original order, everything on the main stream;
* overlapped -- the shim's own dual-stream body
  (``dual_stream_experts.DualStreamExpertsState._forward_deepep_dual_stream``:
  shared experts on the side stream, gate -> topk -> routed experts on the main stream, main waits
  for the side stream before the combine);
* the parts alone -- shared experts only, routed path only; ideal = max(shared, routed).

It prints serial, overlapped and ideal time (medians of device time between two events on the main
stream), overlapped/ideal, and the fraction of the ideal saving (serial - ideal) that the overlap
realises; target >= 90 %.  Block and measurement are npu_shim/patches/_selftest/_synthetic_moe.py's, the code
``python -m npu_shim selftest`` runs on the device.  The stream helpers use
``torch.get_device_module()`` as upstream does, so the same code runs on CUDA and on an NPU.
Without either device it says so and measures nothing.

    python3 scripts/bench_dual_stream.py [--tokens 512] [--hidden 2048] [--device cpu]

``--device cpu`` only smoke-tests the code paths (CPU streams are no-ops: no overlap to measure).
"""
from __future__ import annotations

import argparse
import time

from npu_shim.patches._selftest import _synthetic_moe
from npu_shim.patches._selftest._synthetic_moe import DEFAULTS, build_block, serial_forward as _serial_forward
from shimdev.bench import interleave

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
    """npu_shim.patches._selftest._synthetic_moe.measure: the same code as ``python -m npu_shim selftest``."""
    return _synthetic_moe.measure(device, **overrides)


def _row(result, device, name):
    serial, ideal, over = result["serial_median"], result["ideal"], result["overlapped"]
    fraction = result["fraction"]
    p = result["params"]
    measured = ("serial %.3f ms, overlapped %.3f ms, ideal max(shared %.3f, routed %.3f) = %.3f ms; "
                "overlapped/ideal = %s; saving %s of the ideal; outputs equal: %s"
                % (serial, over, result["shared"], result["routed"], ideal,
                   "%.2f" % (over / ideal) if ideal > 0 else "n/a",
                   "%.0f %%" % (fraction * 100) if fraction is not None else "n/a", result["equal"]))
    ok = bool(result["equal"] and fraction is not None and fraction >= _synthetic_moe.TARGET_FRACTION)
    if device == "cpu":
        measured += " (CPU smoke run: CPU streams are no-ops, nothing to overlap)"
        ok = None
    return {
        "what": WHAT,
        "how": ("%s (%s): synthetic MoE block, %d tokens x hidden %d, shared MLP %d, %d routed experts "
                "(top-%d, MLP %d) run one by one, %s; medians of %d samples x %d reps"
                % (device, name, p["tokens"], p["hidden"], p["shared_inter"], p["experts"], p["topk"],
                   p["expert_inter"], p["routed"], p["samples"], p["reps"])),
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


WRAPPER_WHAT = "dual-stream experts wrapper, host time per MoE layer call on the device"


def wrapper_cost(device, wrapt, tokens=16, calls=200, rounds=9, device_module=None, dtype=None, **overrides):
    """{"ms": {arm: [ms per call, one per round]}, "dual_stream_python_calls": how many calls the wrapper
    sent down the dual-stream path} of the synthetic block's ``forward_deepep``, wall time
    per call over ``calls`` calls then a synchronize, arms in turn (the order reversed every other
    round): ``plain`` the unwrapped single-stream body (0.5.9's order), ``extend`` the same method
    under the shim's wrapper (``DualStreamExpertsState.forward_deepep_wrapper`` through ``wrapt`` as a class
    attribute, as the shim installs it) on an extend batch: the dual-stream path, ``decode`` the
    wrapper on a decode batch: it calls through.  A small batch (``tokens``): the launches, not the
    device's arithmetic, set the time, so what the wrapper adds on the host shows."""
    import enum
    import types

    import torch

    from npu_shim.patches import dual_stream_experts as ds

    p = dict(DEFAULTS, tokens=tokens, **overrides)
    if device == "cpu":
        torch.set_num_threads(1)  # a dry run on shared cores: no thread pool waiting on other jobs
    dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
    dm = device_module or torch.get_device_module(device)
    block = build_block(device, dtype, p)
    cls = type(block)
    cls.forward_plain = _serial_forward
    process = ds.DualStreamExpertsState()  # the shim's per-process state, as a decision builds it
    cls.forward_deepep = wrapt.FunctionWrapper(_serial_forward, process.forward_deepep_wrapper)
    hidden = torch.randn(p["tokens"], p["hidden"], device=device, dtype=dtype)

    class Mode(enum.IntEnum):  # sglang's ForwardMode, the two members and predicates it asks
        EXTEND = 1
        DECODE = 2

        def is_extend(self):
            return self is Mode.EXTEND

        def is_target_verify(self):
            return False

    def batch(extend):
        return types.SimpleNamespace(num_token_non_padded=None, forward_mode=Mode.EXTEND if extend else Mode.DECODE)

    extend, decode = batch(True), batch(False)
    arms = {"plain": lambda: block.forward_plain(hidden, extend),
            "extend": lambda: block.forward_deepep(hidden, extend),
            "decode": lambda: block.forward_deepep(hidden, decode)}
    real_get = torch.get_device_module
    torch.get_device_module = lambda d=None: dm if d is None else real_get(d)
    try:
        with torch.no_grad():
            for fn in arms.values():
                for _ in range(max(3, calls // 10)):
                    fn()
            dm.synchronize()
            out = {name: [] for name in arms}
            for _, name in interleave.turns(rounds, list(arms)):
                start = time.perf_counter()
                for _ in range(calls):
                    arms[name]()
                dm.synchronize()
                out[name].append((time.perf_counter() - start) * 1000.0 / calls)
    finally:
        torch.get_device_module = real_get
    return {"ms": out, "dual_stream_python_calls": process.counts["dual_stream_python_calls"]}


def wrapper_cost_row(device, name, wrapt, wrapt_note, **kw):
    import statistics

    out = wrapper_cost(device, wrapt, **kw)["ms"]
    med = {arm: statistics.median(values) for arm, values in out.items()}
    tokens = kw.get("tokens", 16)
    ok = None if device == "cpu" else med["decode"] - med["plain"] <= 0.001  # <= 1 us on the pass-through
    return {
        "what": WRAPPER_WHAT,
        "how": "%s (%s): the synthetic block's forward_deepep, %d tokens, wall time per call (calls then a "
               "synchronize), the unwrapped single-stream body vs the same under the shim's wrapper (%s) on an "
               "extend batch (dual stream) and a decode batch (calls through); %d rounds, arms alternated, medians"
               % (device, name, tokens, wrapt_note, kw.get("rounds", 9)),
        "measured": "plain %.1f us; wrapper, extend %.1f us (%+.1f us); wrapper, decode %.1f us (%+.1f us)%s"
                    % (med["plain"] * 1e3, med["extend"] * 1e3, (med["extend"] - med["plain"]) * 1e3,
                       med["decode"] * 1e3, (med["decode"] - med["plain"]) * 1e3,
                       " (CPU dry run: CPU streams are no-ops)" if device == "cpu" else ""),
        "target": "decode (pass-through) <= +1 us; extend: the overlap row says what the side stream buys",
        "ok": ok,
    }


def bundle_wrapt(bundle_dir, pure=False):
    """(wrapt module, note): a bundle's wrapt build for this interpreter (or its pure-Python one),
    loaded by the shim's loader."""
    import os

    from npu_shim.runtime import wrapt_loader

    vendor = os.path.join(bundle_dir, "npu_shim", "_vendor", "wrapt")
    build = wrapt_loader.PURE_BUILD
    if not pure:
        build, why = wrapt_loader.select_build(wrapt_loader.bundled_builds(vendor), *wrapt_loader.platform_facts())
        if build is None:
            raise SystemExit("no wrapt build in %s: %s" % (vendor, why))
    return wrapt_loader._load_private(os.path.join(vendor, build, "wrapt")), "the bundle's wrapt %s" % build


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "npu", "cpu"), help="default: the one present")
    for key in ("tokens", "hidden", "shared_inter", "experts", "topk", "expert_inter", "samples", "reps"):
        parser.add_argument("--" + key.replace("_", "-"), type=int, dest=key)
    parser.add_argument("--routed", choices=_synthetic_moe.ROUTED,
                        help="how the routed experts run (_synthetic_moe.ROUTED; default per-expert)")
    parser.add_argument("--wrapper-cost", action="store_true",
                        help="the shim's wrapper's host time per call instead of the overlap")
    parser.add_argument("--bundle", help="with --wrapper-cost: a bundle whose wrapt to use (default: import wrapt)")
    parser.add_argument("--calls", type=int, default=200, help="with --wrapper-cost: calls per round")
    parser.add_argument("--rounds", type=int, default=9, help="with --wrapper-cost: rounds")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items()
                 if k not in ("device", "wrapper_cost", "bundle", "calls", "rounds") and v is not None}
    if args.wrapper_cost:
        device, name = (args.device, args.device) if args.device else find_device()
        if device is None:
            print("not measured: %s" % name)
            return 0
        if args.bundle:
            wrapt, note = bundle_wrapt(args.bundle)
        else:
            import wrapt
            note = "wrapt %s" % wrapt.__version__
        found = [row for row in [wrapper_cost_row(device, name, wrapt, note, calls=args.calls, rounds=args.rounds,
                                                  **overrides)]]
    else:
        found = rows(args.device, **overrides)
    for row in found:
        for key in ("what", "how", "measured", "target", "ok"):
            print("%-9s %s" % (key + ":", row[key]))
    return 0
