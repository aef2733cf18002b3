"""dual_stream_experts in a real GLM-4 MoE server vs sglang 0.5.10's own implementation of it,
both in graph mode under sglang's own load client.

Two servers up at once on the simulated NPU, the same tiny GLM-4 MoE (dev/shimdev/server/models.py),
``--moe-a2a-backend deepep``, ``SGLANG_NPU_USE_MULTI_STREAM=1`` and the fused
``split_qkv_rmsnorm_rope`` in the image, NPU graphs on as production runs them (decode captured at
batch sizes 1 and 2, each warmed up twice and captured into one pool, then replayed at every
decode step):

* ``shim``: sglang 0.5.8 with the shim (its dual-stream ``forward_deepep`` and fused
  ``forward_prepare`` wrappers, captured into the decode graphs);
* ``upstream``: sglang 0.5.10 without the shim (the feature as merged, sglang#19246).

(0.5.9 cannot serve this model with DeepEP on an NPU: docs/dual-stream-experts.md.)  A second
phase puts the shim's server against 0.5.8 without the shim (neither path): how much of the first
ratio is the two releases' other code rather than the backport.

The load: ``python -m sglang.bench_serving`` (backend sglang, ``random-ids``, fixed seed: the
client of scripts/bench_graph_server.py) against each live server in alternating order,
``--rounds`` x 2 times per phase: ``--requests`` prompts of 32 token ids, ``--tokens`` new tokens
each, at most 2 in flight (the captured batch sizes); every request must complete.  Per arm the
median of bench_serving's output throughput (tokens per second; with 32-token prompts and 64 new
tokens the run is decode), and the ratio of the medians; beside it the median ITL and the CPU
time the server's processes spent per output token over the run (``/proc``: on a shared machine
the steadier figure -- wall time moves with whatever else runs, CPU time much less).  Each
server's log must say that its decode graphs were captured and that every decode batch it logged
ran from them.

On the simulated NPU the forward pass is CPU torch and a replay re-runs the recorded ops, so this
is the cost of each side's captured forward path and of the releases' serving loops, not a device
figure; the two releases' other code differs too (the scheduler, the MoE layer), which the first
ratio includes and the second phase sizes.

Usage: python scripts/bench_moe_server.py [--rounds N] [--requests N] [--tokens N]
"""

import argparse
import json
import os
import re
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "dev"), REPO]  # shimdev (dev/shimdev/__init__.py), npu_shim

from shimdev.bench import interleave  # noqa: E402 - after dev/ is put on sys.path

ARMS = {"shim": ("0.5.8", "on"), "upstream": ("0.5.10", "absent"), "off": ("0.5.8", "absent")}
WHAT = ("GLM-4 MoE server (simulated NPU, DeepEP, dual-stream on), decode tokens per second, "
        "shim on sglang 0.5.8 vs sglang 0.5.10's own")
WHAT_OFF = "the same shim server vs sglang 0.5.8 without the shim (neither path), decode tokens per second"
#: The line sglang logs when the decode capture ended ("npu" on 0.5.10; the device's name).
CAPTURE_END = re.compile(r"Capture (npu|cuda|cpu) graph end")
#: sglang's decode log line says whether the batch ran from a graph: "npu graph: True" (0.5.10),
#: "cpu graph: True" (0.5.8 names every device but cuda "cpu").
DECODE_GRAPH = re.compile(r"Decode batch,.* graph: (True|False)")


def _server(arm, log_dir):
    from shimdev.server import models, moe_job  # the job the tests serve
    from shimdev.server.process import Server

    release, shim = ARMS[arm]
    # sglang's metrics on every arm alike: the shim's counts are read from them
    return Server(release, models.ensure_model("glm4_moe", release), shim=shim, env=dict(moe_job.NPU_ENV),
                  args=list(moe_job.NPU_ARGS) + ["--enable-metrics"], ready_timeout=420, graphs=True,
                  log_path=os.path.join(log_dir, "bench-moe-%s.log" % arm))


def graph_use(server):
    """(whether the decode capture ended, decode log lines that ran from a graph, lines that did not),
    from the server's log."""
    with open(server.log_path, encoding="utf-8", errors="replace") as handle:
        text = handle.read()
    said = DECODE_GRAPH.findall(text)
    return bool(CAPTURE_END.search(text)), said.count("True"), said.count("False")


def check_graphs(arm, server):
    """RuntimeError unless the server captured its decode and every decode batch it logged ran
    from a graph (and it logged one)."""
    captured, replayed, eager = graph_use(server)
    if not captured or eager or not replayed:
        raise RuntimeError("the %s server (sglang %s) did not decode from its graphs: capture ended %s, "
                           "decode log lines from a graph %d, eager %d (log %s)"
                           % (arm, server.version, captured, replayed, eager, server.log_path))
    return replayed


def _alternate(live, pair, rounds, load, loads):
    for r, arm in interleave.turns(rounds * 2, pair):
        loads.setdefault(arm, []).append(load(live[arm], "%s-%s-%d" % (pair[1], arm, r)))


def measure(rounds=2, requests=4, tokens=64, log_dir="/tmp", log=print):
    """Two phases, two servers up at a time (each holds ~2 GB): the shim's server against
    0.5.10's, then against 0.5.8 without the shim; ({phase: {arm: [bench_serving result]}},
    fused calls, {arm: decode log lines from a graph})."""
    import bench_graph_server as client  # scripts/: sglang.bench_serving, as that benchmark runs it
    from shimdev.server.process import tree_cpu_seconds

    live, phases, graphs, envs = {}, {"upstream": {}, "off": {}}, {}, {}

    def load(server, name):
        output_file = os.path.join(log_dir, "bench-serving-%s.jsonl" % name)
        sid = os.getsid(server.proc.pid)
        cpu = tree_cpu_seconds(sid)
        out = client.run_load(server, client.client_env(envs["upstream"]), server.model, output_file,
                              requests, tokens)
        cpu = tree_cpu_seconds(sid) - cpu
        with open(output_file, encoding="utf-8") as handle:
            made = json.loads([line for line in handle if line.strip()][-1])["total_output_tokens"]
        out["cpu_ms"] = 1000.0 * cpu / made
        log("[bench_moe_server] %s: %.1f tok/s, %.2f server CPU ms per output token"
            % (name, out["tok_s"], out["cpu_ms"]))
        return out

    try:
        for other in ("upstream", "off"):
            for arm in ("shim", other):
                if arm not in live:
                    server = live[arm] = _server(arm, log_dir)
                    envs.setdefault(arm, server.env)  # one client for every run: 0.5.10's, no shim
                    server.start()
                    server.generate([5, 6, 7, 8, 9, 10], 8)  # the first request builds what it needs: not timed
            _alternate(live, ("shim", other), rounds, load, phases[other])
            graphs[other] = check_graphs(other, live[other])
            live.pop(other).stop()
        graphs["shim"] = check_graphs("shim", live["shim"])
        fused = _fused_calls(live["shim"])
    finally:
        for server in live.values():
            server.stop()
    return phases, fused, graphs


def _fused_calls(server):
    """The shim's count of fused decode calls in its scheduler, from sglang's ``/metrics``: one
    more request first, whose prefill logs sglang's stats -- which publishes every call before it.
    In graph mode these are the warm-ups' and the captures' calls: a replay adds none.  The
    scheduler found by its process title (``sglang::scheduler``)."""
    from shimdev.server.process import schedulers, shim_metrics

    server.generate([1, 2, 3], 1)
    details = shim_metrics(server)["detail"]
    return sum(details.get((pid, "dual_stream_experts"), {}).get("fused_python_calls", 0)
               for pid in schedulers(server).values())


def rows_from(phases, fused, graphs, rounds, requests, tokens):
    """The two table rows of a measurement (medians per arm, ratios of the medians)."""
    if not fused:
        raise RuntimeError("the shim's fused decode path did not run in the shim's server (counts %r)" % fused)
    out = []
    for other, what, target in (("upstream", WHAT, 0.98), ("off", WHAT_OFF, None)):
        med = {arm: {key: statistics.median(run[key] for run in runs) for key in ("tok_s", "itl_ms", "cpu_ms")}
               for arm, runs in phases[other].items()}
        shim, base = med["shim"], med[other]
        how = ("graphs on (decode captured at batch sizes 1 and 2, every logged decode batch replayed: %d / %d "
               "log lines); both servers up, %d alternating `python -m sglang.bench_serving` runs each "
               "(random-ids, fixed seed, %d prompts x 32 in / %d out tokens, at most 2 in flight, every "
               "request completed), median; the shim's fused path ran %d times (warm-ups and captures)"
               % (graphs["shim"], graphs[other], len(phases[other]["shim"]), requests, tokens, fused)) \
            if other == "upstream" else "the same, against 0.5.8 without the shim (%d log lines from a graph)" \
            % graphs[other]
        out.append({"what": what, "how": how,
                    "measured": "%.1f vs %.1f tok/s = %.3fx; median ITL %.1f vs %.1f ms; server CPU "
                                "%.2f vs %.2f ms per output token = %.3fx" % (
                                    shim["tok_s"], base["tok_s"], shim["tok_s"] / base["tok_s"], shim["itl_ms"],
                                    base["itl_ms"], shim["cpu_ms"], base["cpu_ms"], shim["cpu_ms"] / base["cpu_ms"]),
                    "target": ">= %.2fx" % target if target else "(how much of the row above is the release)",
                    "ok": shim["tok_s"] / base["tok_s"] >= target if target else None})
    return out


def rows(rounds=2, requests=4, tokens=64):
    import tempfile

    with tempfile.TemporaryDirectory(prefix="npu-shim-bench-moe-") as tmp:
        phases, fused, graphs = measure(rounds, requests, tokens, tmp)
    return rows_from(phases, fused, graphs, rounds, requests, tokens)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    for row in rows(args.rounds, args.requests, args.tokens):
        print("%s: %s (%s; target %s)" % (row["what"], row["measured"], row["how"], row["target"]))


if __name__ == "__main__":
    main()
