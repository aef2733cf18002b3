"""Graph mode of scripts/bench_dual_stream.py (``--graph``, ``--mla-replay``; tested by
tests/patches/test_dual_stream_graph_bench.py; run by scripts/device_check.sh).

``--graph``: the dual-stream overlap on the synthetic MoE block (npu_shim/patches/_selftest/
_synthetic_moe.py), eager and under device graphs side by side over one sweep of sizes.  Eager:
``_synthetic_moe.measure`` (device time between two events around the calls).  Graph: serial,
overlapped, shared-only and routed-only each captured once (``_synthetic_moe.capture``: warm-ups on
a capture stream of its own, then ``torch.cuda.graph`` / ``torch.npu.graph`` on it, the side stream
forked and joined with events inside the capture) and timed by replays, the production mode.  Per
size: serial, overlapped, ideal = max(shared, routed) and the share of the ideal saving (serial -
ideal) realised; then the **crossover** of each mode (``_synthetic_moe.crossover``: the smallest
measured size from which two streams win, or "always" / "never" within the sweep).  Graphs run the
"masked" routed path: "per-expert" reads the host once per expert, which a capture refuses; asked
for it, the graph column says so.

``--mla-replay``: the shim's ``npu_mla_preprocess`` replacement (npu_shim/patches/
mla_weight_release.py, ``MlaWeightReleaseState.npu_mla_preprocess_for``) at graph replay: a graph
captured through it beside one captured through the function it replaces (a stand-in body with a
decode step's q_a / kv_a projection and q_a's RMSNorm, DeepSeek-V3's dims), replays timed in
alternating rounds.  Expected equal: a replay runs no Python -- the row counts the Python calls made
during the replays (0).

``--simnpu``: on the tests' simulated NPU (dev/shimdev/simnpu, torch.npu.graph held to torch_npu
2.13.0): the graphs are really captured and replayed, so the code path runs, but nothing is timed
there (its events time 0): every figure it prints is meaningless and the output says so.  On a plain
CPU (``--device cpu``) eager runs as a smoke test and graph mode says "not measured: no device
graphs".
"""
from __future__ import annotations

import argparse
import statistics

from npu_shim.patches._selftest import _synthetic_moe
from shimdev.bench import interleave

WHAT = "dual-stream overlap, eager beside graph replay, over one sweep of sizes"
TARGET = ">= 90 % of the ideal saving (serial - max(shared, routed)) under graph replay"
MLA_WHAT = "the shim's npu_mla_preprocess function at graph replay"
MLA_TARGET = "equal to the function it replaces (a replay runs no Python)"
SIMULATED = "simulated NPU: captured and replayed for real, timings mean nothing (its events time 0)"
# DeepSeek-V3's MLA layer (config.json, TP 1): hidden, q_lora, kv_lora + rope.
MLA_DIMS = dict(hidden=7168, q_lora=1536, kv=576)


def target_device(device=None, simnpu=False):
    """(device string, device module, name, simulated) or (None, None, why not, False)."""
    import torch

    if simnpu:
        from shimdev import simnpu as sim

        if sim.installed() is None:
            sim.install(server=True)  # npu tensors (on the CPU), which its graphs record
        return "npu:0", torch.npu, "simulated NPU", True
    if device == "cpu":
        return "cpu", torch.get_device_module("cpu"), "cpu", False
    if device is None:
        from shimdev.bench.dual_stream_bench import find_device

        device, name = find_device()
        if device is None:
            return None, None, name, False
    else:
        name = device
    return device, torch.get_device_module(device), name, False


def _pct(fraction):
    return "%.0f %%" % (fraction * 100) if fraction is not None else "n/a"


def _figures(r):
    return "serial %.3f, overlapped %.3f, ideal %.3f ms, saving %s%s" % (
        r["serial_median"], r["overlapped"], r["ideal"], _pct(r["fraction"]), "" if r["equal"] else ", outputs DIFFER")


def sweep(device, dm, sizes, **overrides):
    """[{tokens, eager: measure's result, graph: measure_graph's result or None, graph_why}] over
    ``sizes``; the graph column is None where the device has no graphs or the routed path is not
    capturable (``graph_why`` says which)."""
    cls, why = _synthetic_moe.graph_support(dm)
    routed = overrides.get("routed", "masked")
    if cls is not None and routed != "masked":
        why = "%s routing reads the host per expert, which a capture refuses (graphs run --routed masked)" % routed
    out = []
    for tokens in sizes:
        params = dict(overrides, routed=routed, tokens=tokens)
        row = {"tokens": tokens, "eager": _synthetic_moe.measure(device, device_module=dm, **params),
               "graph": None, "graph_why": why}
        if cls is not None and routed == "masked":
            row["graph"] = _synthetic_moe.measure_graph(device, device_module=dm, **params)
        out.append(row)
    return out


def _crossover(rows, mode):
    points = [dict(row[mode], tokens=row["tokens"]) for row in rows if row[mode] is not None]
    return _synthetic_moe.crossover(points)


def graph_report(device, dm, name, simulated, sizes, **overrides):
    """The lines ``--graph`` prints: what, how, one ``size:`` line per size (eager | graph), the
    crossover of each mode, target, ok (None where nothing was measured on a device)."""
    rows = sweep(device, dm, sizes, **overrides)
    p = rows[0]["eager"]["params"]
    lines = [("what", WHAT),
             ("how", "%s (%s): synthetic MoE block, hidden %d, shared MLP %d, %d routed experts (top-%d, MLP %d), "
                     "%s; eager: the calls timed; graph: each arm captured once, its replays timed; medians of "
                     "%d samples x %d reps" % (device, name, p["hidden"], p["shared_inter"], p["experts"], p["topk"],
                                               p["expert_inter"], p["routed"], p["samples"], p["reps"]))]
    for row in rows:
        graph = _figures(row["graph"]) if row["graph"] is not None else "not measured: %s" % row["graph_why"]
        lines.append(("size", "%d tokens | eager: %s | graph: %s" % (row["tokens"], _figures(row["eager"]), graph)))
    fake = None
    if simulated:
        fake = SIMULATED
    elif device == "cpu":
        fake = "CPU smoke run: CPU streams are no-ops, nothing to overlap"
    for mode in ("eager", "graph"):
        if mode == "graph" and rows[0]["graph"] is None:
            text = "not measured: %s" % rows[0]["graph_why"]
        elif fake:
            text = "not measured: %s" % fake
        else:
            text = _crossover(rows, mode)["text"]
        lines.append(("crossover (%s)" % mode, text))
    lines.append(("target", TARGET))
    graphed = [row["graph"] for row in rows if row["graph"] is not None]
    ok = None
    if graphed and not fake:
        fractions = [g["fraction"] for g in graphed if g["fraction"] is not None]
        ok = bool(all(g["equal"] for g in graphed) and fractions and max(fractions) >= _synthetic_moe.TARGET_FRACTION)
    if simulated:
        lines.append(("note", "%s; %s" % (fake, simulated_graph_facts())))
    elif fake:
        lines.append(("note", fake))
    lines.append(("ok", ok))
    return lines, rows


# -- the MLA function at replay ----------------------------------------------------------------------

def mla_replay(device, dm, tokens=64, rounds=7, reps=20, dims=None):
    """{"ms": {"replaced": [...], "shim": [...]} (ms per replay, one per round), "equal": bool,
    "python_calls_in_replays": int}: graphs captured through the function ``npu_mla_preprocess``
    replaces (a stand-in body) and through the shim's replacement of it, on a layer the shim has
    seen (its warm-ups are its first calls), replays timed in alternating rounds."""
    import types

    import torch

    from npu_shim.patches import mla_weight_release as mla

    d = dict(MLA_DIMS, **(dims or {}))
    dtype = torch.float32 if device == "cpu" or _is_sim(dm) else torch.bfloat16
    torch.manual_seed(0)
    calls = [0]

    def npu_mla_preprocess(m, hidden_states, positions, forward_batch, zero_allocator):
        """A decode step's first MLA work: the fused q_a / kv_a projection and q_a's RMSNorm."""
        calls[0] += 1
        q, kv = torch.matmul(hidden_states, m.qkv_a.t()).split([d["q_lora"], d["kv"]], dim=-1)
        return q * torch.rsqrt(q.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(q.dtype), kv

    def layer():
        m = types.SimpleNamespace()
        m.qkv_a = torch.randn(d["q_lora"] + d["kv"], d["hidden"], device=device, dtype=dtype) * 0.02
        m.mla_preprocess = object()  # a layer with its preprocess built: nothing to release here
        return m

    shim = mla.MlaWeightReleaseState().npu_mla_preprocess_for(npu_mla_preprocess)
    hidden = torch.randn(tokens, d["hidden"], device=device, dtype=dtype)
    arms = {"replaced": (npu_mla_preprocess, layer()), "shim": (shim, layer())}
    arms["shim"][1].qkv_a.copy_(arms["replaced"][1].qkv_a)
    graphs, outs = {}, {}
    with torch.no_grad():
        try:
            for name, (fn, m) in arms.items():
                graphs[name], outs[name] = _synthetic_moe.capture(
                    dm, lambda fn=fn, m=m: fn(m, hidden, None, None, None), warmup=3)
            before = calls[0]
            out = {name: [] for name in graphs}
            for _, name in interleave.turns(rounds, list(graphs)):
                out[name].append(_synthetic_moe.sample_ms(graphs[name].replay, dm, reps))
            dm.synchronize()
            in_replays = calls[0] - before
            equal = all(bool(torch.equal(a, b)) for a, b in zip(outs["replaced"], outs["shim"]))
        finally:
            for graph in graphs.values():
                graph.reset()
    return {"ms": out, "equal": equal, "python_calls_in_replays": in_replays, "tokens": tokens, "dims": d}


def simulated_graph_facts():
    """How many graphs the simulated NPU captured and replayed in this process (its event log):
    the proof the graph code path ran where nothing is timed."""
    from shimdev import simnpu

    return "%d graphs captured, %d replays" % (len(simnpu.events("capture_begin")), len(simnpu.events("replay")))


def _is_sim(dm):
    return bool(getattr(dm, "__simnpu__", False))


def mla_replay_row(device, dm, name, simulated, **kw):
    """The ``--mla-replay`` row: what, how, measured, target, ok (None off a device)."""
    cls, why = _synthetic_moe.graph_support(dm)
    how = ("graphs captured through the function npu_mla_preprocess replaces (a stand-in body: a decode step's "
           "q_a / kv_a projection and q_a's RMSNorm) and through the shim's replacement of it, on a layer it has "
           "seen; replays timed in alternating rounds, medians")
    if cls is None:
        return {"what": MLA_WHAT, "how": how, "measured": "not measured: %s" % why, "target": MLA_TARGET, "ok": None}
    r = mla_replay(device, dm, **kw)
    med = {arm: statistics.median(values) for arm, values in r["ms"].items()}
    measured = ("replay through the function it replaces %.1f us, through the shim's %.1f us (%+.1f us); Python calls "
                "during the replays: %d; outputs equal: %s" % (
                    med["replaced"] * 1e3, med["shim"] * 1e3, (med["shim"] - med["replaced"]) * 1e3,
                    r["python_calls_in_replays"], r["equal"]))
    ok = None
    if simulated:
        measured += " (%s; %s)" % (SIMULATED, simulated_graph_facts())
    else:
        ok = bool(r["equal"] and r["python_calls_in_replays"] == 0
                  and abs(med["shim"] - med["replaced"]) <= 0.02 * med["replaced"] + 0.001)
    return {"what": MLA_WHAT,
            "how": "%s (%s), %d tokens, hidden %d: %s" % (device, name, r["tokens"], r["dims"]["hidden"], how),
            "measured": measured, "target": MLA_TARGET + "; equal within 2 % + 1 us", "ok": ok}


# -- the command line ----------------------------------------------------------------------------------

FLAGS = ("--graph", "--mla-replay", "--simnpu")


def wants(argv):
    """Whether scripts/bench_dual_stream.py's command line is this module's (one of ``FLAGS``)."""
    return any(arg in FLAGS for arg in argv)


def parse_sizes(text, default):
    if not text:
        return [default]
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit("--sizes takes comma-separated token counts, not %r" % text) from None
    if not sizes or min(sizes) <= 0:
        raise SystemExit("--sizes takes positive token counts, not %r" % text)
    return sorted(set(sizes))


def main(argv):
    parser = argparse.ArgumentParser(prog="bench_dual_stream.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", action="store_true",
                        help="eager and graph replay side by side over --sizes, with each mode's crossover")
    parser.add_argument("--mla-replay", action="store_true",
                        help="the shim's npu_mla_preprocess function at graph replay beside the one it replaces")
    parser.add_argument("--simnpu", action="store_true",
                        help="on the simulated NPU (dev): the graph code path runs, nothing is timed")
    parser.add_argument("--device", choices=("cuda", "npu", "cpu"), help="default: the one present")
    parser.add_argument("--sizes", help="with --graph: comma-separated token counts (default: --tokens)")
    for key in ("tokens", "hidden", "shared_inter", "experts", "topk", "expert_inter", "samples", "reps"):
        parser.add_argument("--" + key.replace("_", "-"), type=int, dest=key)
    parser.add_argument("--routed", choices=_synthetic_moe.ROUTED, default="masked",
                        help="how the routed experts run (default masked: the one a graph captures)")
    args = parser.parse_args(argv)
    if args.graph == args.mla_replay:
        parser.error("one of --graph or --mla-replay")
    overrides = {k: v for k, v in vars(args).items()
                 if k not in ("graph", "mla_replay", "simnpu", "device", "sizes") and v is not None}
    device, dm, name, simulated = target_device(args.device, args.simnpu)
    if args.mla_replay:
        if device is None:
            row = {"what": MLA_WHAT, "how": "-", "measured": "not measured: no device graphs (%s)" % name,
                   "target": MLA_TARGET,
                   "ok": None}
        else:
            small = device == "cpu" or simulated
            kw = dict(tokens=4, rounds=3, reps=1, dims=dict(hidden=32, q_lora=16, kv=8)) if small else {}
            row = mla_replay_row(device, dm, name, simulated, **kw)
        for key in ("what", "how", "measured", "target", "ok"):
            print("%-9s %s" % (key + ":", row[key]))
        return 0
    if device is None:
        print("what:     %s\nnot measured: no device graphs (%s)" % (WHAT, name))
        return 0
    sizes = parse_sizes(args.sizes, overrides.pop("tokens", _synthetic_moe.DEFAULTS["tokens"]))
    lines, _ = graph_report(device, dm, name, simulated, sizes, **overrides)
    for key, value in lines:
        print("%-9s %s" % (key + ":", value))
    return 0
