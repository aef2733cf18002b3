"""``python -m npu_shim selftest``'s step of dual_stream_experts: the shim's dual-stream body on a
GLM-4.5-Air-shaped MoE block at three batch sizes (_synthetic_moe.py, the code the benchmark row
runs): output equal to single-stream, and serial / overlapped time from device events with the
share of the ideal saving (serial - max(shared, routed)) achieved; on an NPU with the graph API,
the dual-stream body captured into a graph (its side stream made and joined inside the capture)
and replayed on new inputs, equal to single-stream eager.  Reported against its target
(>= 90 %), never failed on it.  Runs on an NPU and on CUDA (the streams go through
``torch.get_device_module()``); on the tests' simulated NPU the flow only, on a tiny block.

On an NPU the line ends with the **crossover** measured on the node's own device: the smallest
batch size of the step's sizes from which two streams beat one (``_synthetic_moe.crossover``),
eager (the sizes above) and under graph replay (each arm captured once at each size, its replays
timed: the production mode; the masked routed path, which a capture takes), within
``CROSSOVER_BUDGET_S``.  It tells the operator whether ``SGLANG_NPU_USE_MULTI_STREAM=1`` pays at
the node's batch sizes.  Elsewhere it says it did not measure and why (on the simulated NPU the
graph sweep still captures and replays: the code path, no timing).
"""
import time

DEVICES = ("npu", "cuda")  # the device kinds its step runs on: the streams go through torch.get_device_module()


def mib(options):
    """Free device memory (MiB) the step needs: the GLM-4.5-Air-shaped block and its activations,
    with room to spare."""
    return 2048


# Timing repetitions on a device; on the simulated NPU a tiny block, once (the flow only).
DEVICE_TIMING = dict(samples=7, reps=5, warmup=3)
SIMULATED_SHAPE = dict(hidden=16, shared_inter=16, experts=4, topk=2, expert_inter=8, samples=1,
                       reps=1, warmup=1)
SIMULATED_TOKENS = (4, 8)
# The graph sweep of the crossover stops past this many seconds (sizes left are named as not measured):
# the whole selftest is bounded (60 s by default), and its other steps come first.
CROSSOVER_BUDGET_S = 15.0


def _graph_part(step, shape, tokens):
    """The dual-stream body through an NPU graph capture and a replay at ``tokens`` tokens (the
    largest size: sglang captures largest first), where the step's device does graphs."""
    from npu_shim.patches._selftest import _graphs, _synthetic_moe

    why = _graphs.skipped(step)
    if why:
        return {"ok": True, "text": why, "facts": {"skipped": step.graphs}}
    step.progress("%d tokens: dual-stream captured into an NPU graph, replayed on new inputs" % tokens)
    equal, facts = _synthetic_moe.graph_check(step, **dict(shape, tokens=tokens))
    return {"ok": equal, "facts": facts,
            "text": "graph: %d tokens captured and replayed, output %s single-stream eager" % (
                tokens, "equal to" if equal else "DIFFERS from")}


def _graph_sweep(step, shape, sizes, budget=None):
    """({tokens: measure_graph's result}, sizes left unmeasured): the dual-stream block captured and
    timed by replays at each size, smallest first, until ``budget`` seconds have passed."""
    from npu_shim.patches._selftest import _synthetic_moe

    budget = CROSSOVER_BUDGET_S if budget is None else budget
    started, found, ordered = time.monotonic(), {}, sorted(sizes)
    for index, count in enumerate(ordered):
        if found and time.monotonic() - started > budget:
            return found, ordered[index:]
        step.progress("%d tokens: single-stream vs dual-stream captured into graphs, replays timed" % count)
        found[count] = _synthetic_moe.measure_graph(_graphs_device(step), device_module=step.dm,
                                                    **dict(shape, tokens=count, routed="masked"))
    return found, []


def _graphs_device(step):
    from npu_shim.patches._selftest import _graphs

    return _graphs.device(step)


def _crossover_part(step, shape, sizes, facts):
    """{"ok", "text", "facts"}: the crossover measured on the node's NPU, eager (from ``facts``, the
    timed sizes) and under graph replay; elsewhere why not (the simulated NPU: the graph sweep
    runs, untimed)."""
    from npu_shim.patches._selftest import _synthetic_moe

    if step.kind != "npu":
        why = "the device is %s, not an NPU (scripts/device_check.sh measures it there)" % step.kind
        return {"ok": True, "text": "crossover: not measured: %s" % why, "facts": {"skipped": why}}
    graphs, left, graph_text = {}, [], None
    if step.graphs is not None:
        graph_text = "not measured (%s)" % step.graphs
    else:
        try:
            graphs, left = _graph_sweep(step, shape, sizes)
        except Exception as exc:  # noqa: BLE001 - the crossover informs; the graph check above judges capture
            graph_text = "not measured (the graph sweep raised %s: %s)" % (type(exc).__name__, str(exc)[:200])
    equal = all(r["equal"] for r in graphs.values())
    if step.simulated:
        why = "the simulated NPU times nothing"
        if graphs:
            why += " (the graph sweep captured and replayed at %s tokens)" % ", ".join(str(t) for t in graphs)
        return {"ok": equal, "text": "crossover: not measured: %s" % why,
                "facts": {"skipped": why, "graph_sizes": sorted(graphs), "graph_equal": equal}}
    eager = _synthetic_moe.crossover(facts)
    found = {"eager": eager}
    if graph_text is None:
        graph = _synthetic_moe.crossover([dict(r, tokens=t) for t, r in graphs.items()])
        found["graph"] = graph
        found["graph_sizes"] = {t: {k: r[k] for k in ("serial_median", "overlapped", "fraction", "equal")}
                                for t, r in graphs.items()}
        graph_text = graph["text"]
        if left:
            graph_text += " (not measured past %.0f s: %s tokens)" % (CROSSOVER_BUDGET_S, ", ".join(map(str, left)))
        if not equal:
            graph_text += ", replayed outputs DIFFER"
    found["left"] = left
    return {"ok": equal, "facts": found,
            "text": "crossover on this NPU: graph replay (masked routed, the production mode) %s; eager (%s) %s; "
                    "SGLANG_NPU_USE_MULTI_STREAM=1 pays where batches reach it" % (
                        graph_text, shape.get("routed", _synthetic_moe.DEFAULTS["routed"]), eager["text"])}


def run(step):
    """The shim's dual-stream body on a GLM-4.x-shaped block at a few batch sizes; (ok, line, facts).
    ok: outputs equal to single-stream at every size (the overlap is reported against its target)."""
    from npu_shim.patches._selftest import _synthetic_moe

    device, dm, simulated, progress = step.device, step.dm, step.simulated, step.progress
    tokens = step.options.get("tokens")

    shape = dict(SIMULATED_SHAPE) if simulated else dict(_synthetic_moe.GLM4_AIR, **DEVICE_TIMING)
    sizes = tokens or (SIMULATED_TOKENS if simulated else _synthetic_moe.SELFTEST_TOKENS)
    facts, parts, ok = [], [], True
    for count in sizes:
        progress("%d tokens: single-stream vs dual-stream, timed with events" % count)
        r = _synthetic_moe.measure(device, device_module=dm, **dict(shape, tokens=count))
        ok = ok and r["equal"]
        facts.append(dict({k: r[k] for k in ("serial_median", "overlapped", "shared", "routed", "ideal",
                                             "possible", "fraction", "equal")}, tokens=count))
        if simulated:
            parts.append("%d tokens: outputs %s" % (count, "equal" if r["equal"] else "DIFFER"))
        else:
            parts.append("%d tokens: serial %.3f ms, overlapped %.3f ms, saving %s of the ideal "
                         "(serial - max(shared, routed) = %.3f ms)%s"
                         % (count, r["serial_median"], r["overlapped"],
                            "%.0f %%" % (r["fraction"] * 100) if r["fraction"] is not None else "n/a",
                            r["possible"], "" if r["equal"] else ", outputs DIFFER"))
    graph = _graph_part(step, shape, sizes[-1])
    ok = ok and graph["ok"]
    parts.append(graph["text"])
    facts[-1]["graph"] = graph["facts"]
    cross = _crossover_part(step, shape, sizes, facts)
    ok = ok and cross["ok"]
    facts[-1]["crossover"] = cross["facts"]
    shape_text = "hidden %d, shared MLP %d, %d routed experts top-%d" % (
        shape["hidden"], shape["shared_inter"], shape["experts"], shape["topk"])
    if simulated:
        line = ("%s (%s); timings are meaningless on the simulated NPU (no device runs): not measured; %s"
                % ("; ".join(parts), shape_text, cross["text"]))
    else:
        best = [f["fraction"] for f in facts if f["fraction"] is not None]
        target = _synthetic_moe.TARGET_FRACTION
        line = "%s (%s); outputs equal to single-stream: %s; target >= %.0f %% of the ideal saving: %s; %s" % (
            "; ".join(parts), shape_text, "yes" if ok else "NO", target * 100,
            "met" if best and max(best) >= target else "not met", cross["text"])
    return ok, line, facts
