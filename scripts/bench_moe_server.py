"""dual_stream_experts in a real GLM-4 MoE server vs sglang 0.5.10's own implementation of it.

Two servers up at once on the simulated NPU, the same tiny GLM-4 MoE (dev/shimdev/server/models.py),
``--moe-a2a-backend deepep``, ``SGLANG_NPU_USE_MULTI_STREAM=1`` and the fused
``split_qkv_rmsnorm_rope`` in the image:

* ``shim``: sglang 0.5.8 with the shim (its dual-stream ``forward_deepep`` and fused
  ``forward_prepare`` wrappers);
* ``upstream``: sglang 0.5.10 without the shim (the feature as merged, sglang#19246).

(0.5.9 cannot serve this model with DeepEP on an NPU: docs/dual-stream-experts.md.)  A second
phase puts the shim's server against 0.5.8 without the shim (neither path): how much of the first
ratio is the two releases' other code rather than the backport.  The same fixed
greedy load (``--requests`` requests of ``--tokens`` new tokens, one at a time) goes to each in
alternating order; decode tokens per second of wall time, ratio of medians.  On the simulated NPU
the forward pass is CPU torch, so this is the Python cost of the backport's forward path against
upstream's, not a device figure; the two releases' other code differs too (the scheduler, the MoE
layer), which the ratio includes.

Usage: python scripts/bench_moe_server.py [--rounds N] [--requests N] [--tokens N]
"""

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "dev"), REPO]  # shimdev (dev/shimdev/__init__.py), npu_shim

from shimdev.bench import interleave  # noqa: E402 - after dev/ is put on sys.path

ARMS = {"shim": ("0.5.8", "on"), "upstream": ("0.5.10", "absent"), "off": ("0.5.8", "absent")}
WHAT = ("GLM-4 MoE server (simulated NPU, DeepEP, dual-stream on), decode tokens per second, "
        "shim on sglang 0.5.8 vs sglang 0.5.10's own")
WHAT_OFF = "the same shim server vs sglang 0.5.8 without the shim (neither path), decode tokens per second"


def _server(arm, log_dir):
    from shimdev.server import models, moe_job  # the job the tests serve
    from shimdev.server.process import Server

    release, shim = ARMS[arm]
    # sglang's metrics on every arm alike: the shim's counts are read from them
    return Server(release, models.ensure_model("glm4_moe", release), shim=shim, env=dict(moe_job.NPU_ENV),
                  args=list(moe_job.NPU_ARGS) + ["--enable-metrics"], ready_timeout=420,
                  log_path=os.path.join(log_dir, "bench-moe-%s.log" % arm))


def _decode_rate(server, requests, tokens):
    start = time.perf_counter()
    made = 0
    for i in range(requests):
        made += len(server.generate([5 + i, 6, 7, 8, 9, 10], tokens))
    return made / (time.perf_counter() - start)


def _alternate(live, pair, rounds, requests, tokens, rates):
    for _, arm in interleave.turns(rounds * 2, pair):
        rates.setdefault(arm, []).append(_decode_rate(live[arm], requests, tokens))


def measure(rounds=2, requests=4, tokens=64, log_dir="/tmp"):
    """Two phases, two servers up at a time (each holds ~2 GB): the shim's server against
    0.5.10's, then against 0.5.8 without the shim; ({phase: {arm: [tok/s]}}, fused calls)."""
    live, phases = {}, {"upstream": {}, "off": {}}
    try:
        for other in ("upstream", "off"):
            for arm in ("shim", other):
                if arm not in live:
                    live[arm] = _server(arm, log_dir).start()
                    _decode_rate(live[arm], 1, 8)  # the first request builds what it needs: not timed
            _alternate(live, ("shim", other), rounds, requests, tokens, phases[other])
            live.pop(other).stop()
        fused = _fused_calls(live["shim"])
    finally:
        for server in live.values():
            server.stop()
    return phases, fused


def _fused_calls(server):
    """The shim's count of fused decode calls in its scheduler, from sglang's ``/metrics``: one
    more request first, whose prefill logs sglang's stats -- which publishes every call before it."""
    from shimdev.server.process import shim_metrics, summaries

    server.generate([1, 2, 3], 1)
    details = shim_metrics(server)["detail"]
    schedulers = [pid for pid, said in summaries(server).items() if said["role"].startswith("tp ")]
    return sum(details.get((pid, "dual_stream_experts"), {}).get("fused_python_calls", 0) for pid in schedulers)


def rows(rounds=2, requests=4, tokens=64):
    import tempfile

    with tempfile.TemporaryDirectory(prefix="npu-shim-bench-moe-") as tmp:
        phases, fused = measure(rounds, requests, tokens, tmp)
    if not fused:
        raise RuntimeError("the shim's fused decode path did not run in the shim's server (counts %r)" % fused)
    out = []
    for other, what, target in (("upstream", WHAT, 0.98), ("off", WHAT_OFF, None)):
        rates = phases[other]
        shim, base = statistics.median(rates["shim"]), statistics.median(rates[other])
        out.append({"what": what,
                    "how": "both servers up, %d alternating rounds of %d requests x %d new tokens, "
                           "median; the shim's fused path ran %d times in all" % (rounds * 2, requests, tokens, fused),
                    "measured": "%.1f vs %.1f tok/s = %.3fx" % (shim, base, shim / base),
                    "target": ">= %.2fx" % target if target else "(how much of the row above is the release)",
                    "ok": shim / base >= target if target else None})
    return out


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
