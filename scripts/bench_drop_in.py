"""The drop-in bundle's cost, measured side by side in one run (alternating runs, medians).

* start-up of ``python -c pass`` with a bundle on PYTHONPATH and ``PYTHONDONTWRITEBYTECODE=1`` (as
  on a read-only image) vs without the shim, same variable (the shim's sources without any
  ``.pyc`` are measured by scripts/bench_shim_cost.py);
* the same start-up in instructions executed (valgrind, counted as
  ``bench_shim_cost.instructions_side_by_side`` counts): deterministic where wall time on a shared
  machine is not.  The budget: <= 1.03x (shimdev/bench/bench_rows.py); the wall-time row is a reference.

The ``npu_mla_preprocess`` wrapper's cost per call with the bundle's two wrapt builds:
scripts/bench_hot_path.py.

Usage: python scripts/bench_drop_in.py [--bundle DIR] [--runs N]   (builds a bundle when none is
given: wrapt wheels from PyPI through pip)
"""

import argparse
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "dev"), REPO]  # shimdev (dev/shimdev/__init__.py), npu_shim

from bench_shim_cost import alternate, clean_env, instructions_side_by_side  # noqa: E402 - after dev/ is put on sys.path
from shimdev.bench.bench_rows import STARTUP_INSTRUCTIONS  # noqa: E402 - after dev/ is put on sys.path

TARGET = "<= %.2fx (budget: start-up of a process that never imports sglang)" % STARTUP_INSTRUCTIONS


def build_bundle(workdir):
    from npu_shim.cli import bundle

    out = os.path.join(workdir, "npu-shim")
    bundle.build(out, log=lambda line: None)
    return out


def startup_rows(bundle_dir, runs):
    python = sys.executable
    no_write = {"PYTHONDONTWRITEBYTECODE": "1"}
    arms = {
        "without": ([python, "-c", "pass"], dict(clean_env([]), **no_write)),
        "bundle": ([python, "-c", "pass"], dict(clean_env([bundle_dir]), **no_write)),
    }
    res = alternate(runs, arms)
    wall = {k: statistics.median(w for w, _ in v) for k, v in res.items()}
    ratio = wall["bundle"] / wall["without"]
    return [
        {"what": "start-up of `python -c pass`, read-only bundle (its .pyc) on PYTHONPATH vs no shim",
         "how": "PYTHONDONTWRITEBYTECODE=1 in both arms, median of %d alternating runs" % runs,
         "measured": "%.1f ms vs %.1f ms = %.3fx" % (wall["bundle"] * 1e3, wall["without"] * 1e3, ratio),
         "target": "none: a reference (the budget is counted in instructions, next row)", "ok": None},
    ]


def instruction_rows(bundle_dir):
    no_write = {"PYTHONDONTWRITEBYTECODE": "1"}
    what = "start-up of `python -c pass`, read-only bundle vs no shim, in instructions executed"
    pass_ = [sys.executable, "-c", "pass"]
    # For reference, Python's own cost of one more PYTHONPATH entry (path hooks, a directory
    # listing, searching it at start-up), which any delivery on PYTHONPATH pays before the shim
    # runs a line.
    with tempfile.TemporaryDirectory(prefix="npu-shim-empty-") as empty:
        counts = instructions_side_by_side({
            "base": (pass_, dict(clean_env([]), **no_write)),
            "shim": (pass_, dict(clean_env([bundle_dir]), **no_write)),
            "entry": (pass_, dict(clean_env([empty]), **no_write)),
        })
    if counts is None:
        return [{"what": what, "how": "", "measured": "not measured: valgrind is not installed",
                 "target": TARGET, "ok": None}]
    base, shim, entry = counts["base"], counts["shim"], counts["entry"]
    return [{"what": what, "how": "valgrind --tool=cachegrind --cache-sim=no, one run each side by side "
                                  "(deterministic: one hash seed, setarch -R); for reference, an empty "
                                  "directory on PYTHONPATH instead of the bundle",
             "measured": "%.2f M vs %.2f M = %.3fx (an empty PYTHONPATH entry alone: %.3fx)" % (
                 shim / 1e6, base / 1e6, shim / base, entry / base),
             "target": TARGET, "ok": shim / base <= STARTUP_INSTRUCTIONS}]


def rows(runs=30, bundle_dir=None):
    with tempfile.TemporaryDirectory(prefix="npu-shim-bench-") as workdir:
        bundle_dir = bundle_dir or build_bundle(workdir)
        return startup_rows(bundle_dir, runs) + instruction_rows(bundle_dir)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", help="an existing bundle directory (default: build one)")
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    for row in rows(args.runs, args.bundle):
        print("%-90s %-32s target %-10s %s" % (row["what"], row["measured"], row["target"], row["ok"]))


if __name__ == "__main__":
    main()
