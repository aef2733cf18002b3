"""All benchmarks in one table: `python3 scripts/bench.py [--quick]`.

Each row is measured side by side in this one run (ratios of medians over alternating runs; these
machines are noisy), by the script named in the row.  A missed target says MISSED; a row that
cannot be measured here (no GPU/NPU) says so.  Exits 0 unless a benchmark itself crashed.
"""

import argparse
import datetime
import os
import platform
import sys
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))


def machine():
    cores = os.cpu_count()
    try:
        with open("/proc/meminfo") as handle:
            mem = int(handle.readline().split()[1]) / 2**20
    except OSError:
        mem = 0
    return "%s, %d cores, %.0f GiB, Python %s" % (platform.machine(), cores, mem, platform.python_version())


def collect(quick):
    import bench_drop_in
    import bench_dual_stream
    import bench_mla_release
    import bench_shim_cost

    sources = [
        ("bench_shim_cost", lambda: bench_shim_cost.rows(*((20, 3) if quick else (30, 7)))),
        ("bench_drop_in", lambda: bench_drop_in.rows(20 if quick else 40)),
        ("bench_mla_release", bench_mla_release.rows),
        ("bench_dual_stream", bench_dual_stream.rows),
    ]
    rows = []
    crashed = False
    for name, produce in sources:
        try:
            for row in produce():
                row.setdefault("script", name)
                rows.append(row)
        except Exception:  # noqa: BLE001 - report and go on with the other benchmarks
            crashed = True
            rows.append({"what": name, "how": "", "measured": "CRASHED: " + traceback.format_exc(limit=2),
                         "target": "", "ok": False, "script": name})
    return rows, crashed


def verdict(ok):
    return {True: "ok", False: "MISSED", None: "not measured here"}[ok]


def in_runner_venv():
    """Re-run this script in the test runner's venv (torch, wrapt: built by the test command's
    own code when missing) unless this interpreter already has torch."""
    try:
        import torch  # noqa: F401
        return
    except ImportError:
        pass
    import run_tests

    python = str(run_tests.runner_python())
    os.execv(python, [python, os.path.abspath(__file__)] + sys.argv[1:])


def main():
    in_runner_venv()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    rows, crashed = collect(args.quick)
    print("npu-shim benchmarks, %s UTC, %s" % (
        datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M"), machine()))
    print()
    print("| what | how | measured | target | result | script |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| %s | %s | %s | %s | %s | %s |" % (
            row["what"], row["how"], str(row["measured"]).replace("\n", " "), row["target"],
            verdict(row["ok"]), row["script"]))
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
