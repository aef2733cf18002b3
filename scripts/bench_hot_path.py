"""The hot path's per-call costs, side by side in one run (dev/shimdev/bench/hot_path_bench.py says how).

* the ``npu_mla_preprocess`` wrapper in eager mode, in a real sglang 0.5.11 process: calls of a
  layer it has seen through the name the caller looks up (the wrapper, checked by identity) beside
  sglang's own function.  Budget <= 1000 ns per eager call; 0 at graph replay, where a captured
  graph's kernels run without Python.
* the same function in a process of its own with no sglang (what a device machine without the
  release environments measures).  Same budget.
* the dual-stream experts per MoE layer call: the shim's wrapper on real sglang 0.5.9 beside sglang
  0.5.10's own ``forward_deepep`` with its ``process_shared_expert``, the same synthetic block, and
  0.5.9's own with the patch off (what the two differ from); the three processes asked in
  alternating rounds.  Target <= 1.05x.

Usage: python3 scripts/bench_hot_path.py [--rounds N] [--calls N] [--moe-calls N]
(in a Python with torch and wrapt, e.g. the test runner's venv; scripts/bench.py finds it);
``--mla-only``: the function's row of its own process alone (scripts/device_check.sh).
"""

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "dev"), REPO]  # shimdev (dev/shimdev/__init__.py), npu_shim

from shimdev.bench.hot_path_rows import mla_function_row, rows  # noqa: E402 - after the path is set

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=100000, help="calls per round, the ns/call rows")
    parser.add_argument("--moe-calls", type=int, default=2000, help="calls per round, the MoE rows")
    parser.add_argument("--mla-only", action="store_true",
                        help="only the MLA function's row of its own process (no sglang release needed: "
                             "what scripts/device_check.sh runs on a device machine)")
    args = parser.parse_args()
    found = [mla_function_row(args.rounds, args.calls)] if args.mla_only else rows(args.rounds, args.calls,
                                                                                      args.moe_calls)
    for row in found:
        print("%s\n    %s  [%s]" % (row["what"], row["measured"], {True: "ok", False: "MISSED", None: "-"}[row["ok"]]))


if __name__ == "__main__":
    main()
