"""MLA weight bytes a real sglang 0.5.11 decode server frees, shim on vs off, in one run.

Two decode servers of the tiny DSA model (``--disaggregation-mode decode``, sglang's ``fake``
transfer backend, ``SGLANG_NPU_USE_MLAPO=1``; dev/shimdev/server/mla.py), one with the shim on
``PYTHONPATH``, one without, both up at once and sent the same requests; then, per server (every TP
rank added up):

* what the patch says it released (its details in each scheduler, from sglang's /metrics, in bytes);
* what the simulated device holds less: device memory in use, shim off minus shim on, read from
  each scheduler (``SIMNPU_TRACK_DERIVED``: storages sglang derives from npu weights count);
* what the model's shapes say: the fused qkv_a weight and ``w_kc``, bf16, every layer.

The shim off frees nothing (0.5.11 has no release); the figures are a tiny model's bytes -- what a
real model frees per NPU is bench_mla_release's rows (the same release code on real shapes).

Usage: python scripts/bench_mla_server.py [--tp N]
"""

import argparse
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "dev"), REPO]  # shimdev (dev/shimdev/__init__.py), npu_shim

RELEASE = "0.5.11"
WHAT = "MLA bytes freed per decode server: real sglang 0.5.11 DSA decode server (simulated NPU), shim on vs off"


def measure(tp=2, workdir=None):
    from shimdev.server import mla

    servers = {}
    try:
        for arm, shim in (("on", "on"), ("off", "absent")):
            servers[arm] = mla.decode_server(RELEASE, tp, shim, workdir, "bench-" + arm)
            servers[arm].start()
        tokens = {arm: [mla.decode(s, p) for p in ([5, 6, 7, 8], [9, 10, 11])] for arm, s in servers.items()}
        device = {arm: mla.devices(s) for arm, s in servers.items()}
        details = mla.release_details(servers["on"])
        expected = mla.expected_release(servers["on"].model_dir, tp)
    finally:
        for server in servers.values():
            server.stop()
    return {
        "tp": tp,
        "same_tokens": tokens["on"] == tokens["off"],
        "details": sum(d["details"].get("released_bytes", 0) for d in details.values()),
        "device": sum(device["off"][r]["live_npu_bytes"] - device["on"][r]["live_npu_bytes"]
                      for r in device["on"]),
        "shapes": tp * sum(expected.values()),
        "ranks": sorted(details),
    }


def rows(tp=2):
    with tempfile.TemporaryDirectory(prefix="npu-shim-bench-mla-") as tmp:
        m = measure(tp, tmp)
    ok = m["details"] == m["device"] == m["shapes"] > 0 and m["same_tokens"] and m["ranks"] == list(range(tp))
    return [{
        "what": WHAT,
        "how": "TP %d, both servers up, the same requests; patch details (all ranks) vs device memory "
               "in use off - on vs the shapes" % tp,
        "measured": "%d B (details) = %d B (device) = %d B (shapes); same tokens: %s"
                    % (m["details"], m["device"], m["shapes"], m["same_tokens"]),
        "target": "details = device = shapes, same tokens", "ok": ok}]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    for row in rows(args.tp):
        print("%s: %s (target %s)" % (row["what"], row["measured"], row["target"]))


if __name__ == "__main__":
    main()
