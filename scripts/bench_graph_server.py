"""Real sglang 0.5.11 servers in graph mode on the simulated NPU, shim on vs off, side by side.

Graph mode is sglang's default on Ascend: decode is captured into NPU graphs at start-up (here of
batch sizes 1 and 2, ``--cuda-graph-bs 1 2``, each warmed up twice and captured into one pool) and
replayed at every decode step after.  Both arms run it:

* start-up: ``python -m sglang.launch_server`` to its first ``/health_generate`` 200, capture
  included, the two arms started in alternating order, each ``--rounds`` times; the log of each
  start must say the capture ended;
* the load: sglang's own ``python -m sglang.bench_serving`` (backend sglang) against each live
  server in alternating order, ``--rounds`` x 2 times: ``--num-prompts`` prompts of the
  ``random-ids`` dataset (random token ids from the model's own tokenizer, ``--seed`` fixed; 0.5.11's
  ``random`` samples its prompts from ShareGPT, a download), ``--input-len`` prompt and
  ``--output-len`` new tokens each, at most 2 in flight (the captured batch sizes).  Every request
  must complete.  Its output throughput (tokens per second), median TTFT and median ITL are read
  from its ``--output-file``; per arm the median over the runs, and the ratio of the medians.

On: the shim on ``PYTHONPATH`` with zbal in full mode (its allocator current when capture begins);
off: no shim at all.  On the simulated NPU the forward pass is CPU torch and a replay re-runs the
recorded ops, so the ratios are the shim's cost inside a real graph-mode serving loop, not a
device figure.

Usage: python scripts/bench_graph_server.py [--rounds N] [--num-prompts N] [--output-len N]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "dev"), REPO]  # shimdev (dev/shimdev/__init__.py), npu_shim

from shimdev.bench import interleave  # noqa: E402 - after dev/ is put on sys.path

RELEASE = "0.5.11"
BATCH_SIZES = ("1", "2")
ARMS = {"off": {"shim": "absent", "env": {}},
        "on": {"shim": "on", "env": {"SGLANG_ZBAL_LOCAL_MEM_SIZE": "512"}}}
CAPTURE_END = "Capture npu graph end"
SEED = 1
INPUT_LEN = 32
LOAD_TIMEOUT_S = 900

WHAT_STARTUP = ("real sglang 0.5.11 server in graph mode (simulated NPU, decode captured at batch sizes 1 "
                "and 2), start-up to ready with the capture, shim on (zbal) vs off")
WHAT_DECODE = ("the same graph-mode servers under `python -m sglang.bench_serving` (random-ids, fixed seed, "
               "every request completed), output tokens per second, shim on vs off")
WHAT_LATENCY = "the same load: median TTFT and median ITL, shim on vs off"


#: What ``sglang.bench_serving`` imports that the test bed's sglang environment lacks: HF ``datasets``
#: (imported at module level for its MMMU and LongBench sets; random-ids never calls it) and what it
#: needs beyond that environment.  Installed once, ``--no-deps``, into a layer of the test bed's
#: cache that only the client's PYTHONPATH names: the servers never see it.
CLIENT_PINS = ("datasets==5.2.0", "pandas==3.1.1", "pyarrow==26.0.1", "multiprocess==0.70.19", "xxhash==4.1.0",
               "python-dateutil==4.0.0", "pytz==2026.6", "tzdata==2026.6", "six==1.17.0")


def client_layer():
    """The directory of CLIENT_PINS (built once, under the cache's lock)."""
    from shimdev.envs import buildcache, sglang_envs

    d = buildcache.layered_dir() / ("bench-client-" + buildcache.digest({"pins": CLIENT_PINS}))

    def build(tmp):
        buildcache.run(buildcache.pip(sglang_envs.ensure_base(), "install", "--no-deps", "--only-binary=:all:",
                                      "--target", str(tmp), *CLIENT_PINS), "installing bench_serving's imports")
        return {"pins": list(CLIENT_PINS)}

    return buildcache.build_once(d, "layered-" + d.name, build)


def client_env(server_env):
    """The load client's environment: a graph-off server's (the simulated NPU, sglang 0.5.11, no
    shim), with the client layer last on PYTHONPATH."""
    env = dict(server_env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(client_layer())) if p)
    return env


def graph_mode(argv):
    """A launch command in graph mode: the test servers' ``--disable-cuda-graph`` left out, the
    captured batch sizes named (where the command does not name them already)."""
    argv = [a for a in argv if a != "--disable-cuda-graph"]
    if "--cuda-graph-bs" not in argv:
        argv += ["--cuda-graph-bs", *BATCH_SIZES]
    return argv


def _server(arm, log_dir):
    from shimdev.server import models
    from shimdev.server.process import Server, free_port

    env = {"SIMNPU_TOTAL_MIB": "1024", **ARMS[arm]["env"]}
    if arm == "on":
        env["SGLANG_ZBAL_BOOTSTRAP_URL"] = "tcp://127.0.0.1:%d" % free_port()
    server = Server(RELEASE, models.ensure_model("qwen2", RELEASE), shim=ARMS[arm]["shim"],
                    zbal=arm == "on", env=env, args=["--mem-fraction-static", "0.5"],
                    log_path=os.path.join(log_dir, "bench-graph-%s.log" % arm), wait_ready=False,
                    ready_timeout=600)
    server.argv = graph_mode(server.argv)
    return server


def load_command(python, port, tokenizer, output_file, num_prompts, output_len):
    """sglang's own benchmark client against the server on ``port``."""
    return [python, "-m", "sglang.bench_serving", "--backend", "sglang", "--host", "127.0.0.1",
            "--port", str(port), "--dataset-name", "random-ids", "--tokenizer", str(tokenizer),
            "--num-prompts", str(num_prompts), "--random-input-len", str(INPUT_LEN),
            "--random-output-len", str(output_len), "--random-range-ratio", "1.0", "--seed", str(SEED),
            "--max-concurrency", BATCH_SIZES[-1], "--request-rate", "inf", "--disable-tqdm",
            "--output-file", str(output_file)]


def read_result(output_file, num_prompts):
    """{tok_s, ttft_ms, itl_ms, completed} of the run bench_serving appended last to
    ``output_file``; ValueError when a request did not complete."""
    with open(output_file, encoding="utf-8") as handle:
        lines = [line for line in handle if line.strip()]
    if not lines:
        raise ValueError("bench_serving wrote no result to %s" % output_file)
    result = json.loads(lines[-1])
    if result.get("completed") != num_prompts:
        raise ValueError("bench_serving completed %s of %d requests" % (result.get("completed"), num_prompts))
    return {"tok_s": float(result["output_throughput"]), "ttft_ms": float(result["median_ttft_ms"]),
            "itl_ms": float(result["median_itl_ms"]), "completed": result["completed"]}


def run_load(server, client_env, tokenizer, output_file, num_prompts, output_len):
    command = load_command(server.argv[0], server.port, tokenizer, output_file, num_prompts, output_len)
    proc = subprocess.run(command, env=client_env, capture_output=True, text=True, timeout=LOAD_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError("bench_serving exited %d: %s" % (proc.returncode, (proc.stderr or proc.stdout)[-800:]))
    return read_result(output_file, num_prompts)


def captured(server):
    """Whether the server's log says the decode capture ended."""
    with open(server.log_path, encoding="utf-8", errors="replace") as handle:
        return CAPTURE_END in handle.read()


def measure(rounds=2, num_prompts=8, output_len=32, log_dir="/tmp", log=print):
    startup = {"off": [], "on": []}
    live = {}
    try:
        for r, arm in interleave.turns(rounds, ("off", "on")):
            server = _server(arm, log_dir)
            server.start()
            startup[arm].append(server.wait_until_ready())
            if not captured(server):
                server.stop()
                raise RuntimeError("the %s server came up without %r in its log: no graph captured"
                                   % (arm, CAPTURE_END))
            log("[bench_graph_server] %s up in %.1f s (capture included)" % (arm, startup[arm][-1]))
            if r == rounds - 1:
                live[arm] = server
            else:
                server.stop()
        tokenizer = live["off"].model
        client = client_env(live["off"].env)  # no shim in the client: it measures, it is not measured
        loads = {"off": [], "on": []}
        for r, arm in interleave.turns(rounds * 2, ("off", "on")):
            output_file = os.path.join(log_dir, "bench-serving-%s-%d.jsonl" % (arm, r))
            loads[arm].append(run_load(live[arm], client, tokenizer, output_file, num_prompts, output_len))
            log("[bench_graph_server] %s load %d: %.1f tok/s" % (arm, r, loads[arm][-1]["tok_s"]))
    finally:
        for server in live.values():
            server.stop()
    return startup, loads


def rows_from(startup, loads, rounds, num_prompts, output_len):
    """The three table rows of a measurement (medians per arm, ratios of the medians)."""
    off_s, on_s = statistics.median(startup["off"]), statistics.median(startup["on"])
    med = {arm: {key: statistics.median(run[key] for run in loads[arm]) for key in ("tok_s", "ttft_ms", "itl_ms")}
           for arm in ("off", "on")}
    on, off = med["on"], med["off"]
    how = "%d x 2 alternating bench_serving runs of %d prompts (%d in, %d out tokens, at most %s in flight)" % (
        len(loads["on"]), num_prompts, INPUT_LEN, output_len, BATCH_SIZES[-1])
    return [
        {"what": WHAT_STARTUP, "how": "%d alternating starts per arm, median; each log says the capture ended" % rounds,
         "measured": "%.1f s on vs %.1f s off (%.3fx)" % (on_s, off_s, on_s / off_s),
         "target": "on <= 1.10x off", "ok": on_s / off_s <= 1.10},
        {"what": WHAT_DECODE, "how": how,
         "measured": "%.1f vs %.1f tok/s = %.3fx" % (on["tok_s"], off["tok_s"], on["tok_s"] / off["tok_s"]),
         "target": ">= 0.99x", "ok": on["tok_s"] / off["tok_s"] >= 0.99},
        {"what": WHAT_LATENCY, "how": "the same runs, medians of bench_serving's medians",
         "measured": "TTFT %.1f vs %.1f ms (%.3fx); ITL %.1f vs %.1f ms (%.3fx)" % (
             on["ttft_ms"], off["ttft_ms"], on["ttft_ms"] / off["ttft_ms"],
             on["itl_ms"], off["itl_ms"], on["itl_ms"] / off["itl_ms"]),
         "target": "ITL <= 1.01x", "ok": on["itl_ms"] / off["itl_ms"] <= 1.01},
    ]


def rows(rounds=2, num_prompts=8, output_len=32):
    import tempfile

    with tempfile.TemporaryDirectory(prefix="npu-shim-bench-graph-server-") as tmp:
        startup, loads = measure(rounds, num_prompts, output_len, tmp)
    return rows_from(startup, loads, rounds, num_prompts, output_len)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=32)
    args = parser.parse_args()
    started = time.monotonic()
    for row in rows(args.rounds, args.num_prompts, args.output_len):
        print("%s: %s (target %s)" % (row["what"], row["measured"], row["target"]))
    print("%.0f s" % (time.monotonic() - started))


if __name__ == "__main__":
    main()
