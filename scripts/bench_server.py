"""The shim in a real sglang 0.5.11 server on the simulated NPU, shim on vs off, side by side.

* start-up: ``python -m sglang.launch_server`` to its first ``/health_generate`` 200, the two arms
  started in alternating order, each ``--rounds`` times;
* decode throughput: both servers up at once, the same fixed greedy load (``--requests`` requests
  of ``--tokens`` new tokens each, one at a time) sent to each in alternating order, tokens per
  second of wall time; ratio of medians.

On: the shim on ``PYTHONPATH`` with zbal in full mode (every wrapper of the path a request takes);
off: no shim at all.  On the simulated NPU the forward pass is CPU torch, so the ratio is the
wrappers' cost inside a real serving loop, not a device figure.

Usage: python scripts/bench_server.py [--rounds N] [--requests N] [--tokens N]
"""

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "dev"), REPO]  # shimdev (dev/shimdev/__init__.py), npu_shim

RELEASE = "0.5.11"
ARMS = {"off": {"shim": "absent", "env": {}},
        "on": {"shim": "on", "env": {"SGLANG_ZBAL_LOCAL_MEM_SIZE": "512"}}}


def _server(arm, log_dir):
    from shimdev.server import models
    from shimdev.server.process import Server, free_port

    env = {"SIMNPU_TOTAL_MIB": "1024", **ARMS[arm]["env"]}
    if arm == "on":
        env["SGLANG_ZBAL_BOOTSTRAP_URL"] = "tcp://127.0.0.1:%d" % free_port()
    return Server(RELEASE, models.ensure_model("qwen2", RELEASE), shim=ARMS[arm]["shim"],
                  zbal=arm == "on", env=env, args=["--mem-fraction-static", "0.5"],
                  log_path=os.path.join(log_dir, "bench-%s.log" % arm), wait_ready=False)


def _decode_rate(server, requests, tokens):
    start = time.perf_counter()
    made = 0
    for i in range(requests):
        made += len(server.generate([5 + i, 6, 7, 8, 9, 10], tokens))
    return made / (time.perf_counter() - start)


def measure(rounds=2, requests=4, tokens=64, log_dir="/tmp"):
    startup = {"off": [], "on": []}
    live = {}
    try:
        for r in range(rounds):
            for arm in (("off", "on") if r % 2 == 0 else ("on", "off")):
                server = _server(arm, log_dir)
                server.start()
                startup[arm].append(server.wait_until_ready())
                if r == rounds - 1:
                    live[arm] = server
                else:
                    server.stop()
        rates = {"off": [], "on": []}
        for arm in live:
            _decode_rate(live[arm], 1, 8)  # the first request compiles what it needs: not timed
        for r in range(rounds * 2):
            for arm in (("off", "on") if r % 2 == 0 else ("on", "off")):
                rates[arm].append(_decode_rate(live[arm], requests, tokens))
    finally:
        for server in live.values():
            server.stop()
    return startup, rates


def rows(rounds=2, requests=4, tokens=64):
    import tempfile

    with tempfile.TemporaryDirectory(prefix="npu-shim-bench-server-") as tmp:
        startup, rates = measure(rounds, requests, tokens, tmp)
    off_s, on_s = statistics.median(startup["off"]), statistics.median(startup["on"])
    off_r, on_r = statistics.median(rates["off"]), statistics.median(rates["on"])
    return [
        {"what": "real sglang 0.5.11 server (simulated NPU), start-up to ready, shim on (zbal) vs off",
         "how": "%d alternating starts per arm, median" % rounds,
         "measured": "%.1f s on vs %.1f s off (%.3fx)" % (on_s, off_s, on_s / off_s),
         "target": "each <= 45 s", "ok": max(on_s, off_s) <= 45},
        {"what": "the same server, decode tokens per second over a fixed greedy load, shim on vs off",
         "how": "%d x %d alternating rounds of %d requests x %d new tokens, both servers up"
                % (rounds * 2, 2, requests, tokens),
         "measured": "%.1f vs %.1f tok/s = %.3fx" % (on_r, off_r, on_r / off_r),
         "target": ">= 0.99x", "ok": on_r / off_r >= 0.99},
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    for row in rows(args.rounds, args.requests, args.tokens):
        print("%s: %s (target %s)" % (row["what"], row["measured"], row["target"]))


if __name__ == "__main__":
    main()
