"""The hot path's per-call costs, side by side in one run (dev/shimdev/bench/hot_path_bench.py says how).

* the ``npu_mla_preprocess`` wrapper in eager mode, in a real sglang 0.5.11 process: calls of a
  layer it has seen through the name the caller looks up (the wrapper, checked by identity) beside
  sglang's own function.  Budget <= 1000 ns per eager call; 0 at graph replay, where a captured
  graph's kernels run without Python.
* the same wrapper with a bundle's wrapt C build and its pure-Python build, each loaded by the
  shim's loader in a process of its own, the two asked in alternating rounds.  Same budget.
* why the C build reads slower: the same two processes, the wrapper over a function that has a
  ``__self__`` and the AttributeError alone.
* the dual-stream experts per MoE layer call: the shim's wrapper on real sglang 0.5.9 beside sglang
  0.5.10's own ``forward_deepep`` with its ``process_shared_expert``, the same synthetic block, and
  0.5.9's own with the patch off (what the two differ from); the three processes asked in
  alternating rounds.  Target <= 1.05x.

Usage: python3 scripts/bench_hot_path.py [--rounds N] [--calls N] [--moe-calls N] [--bundle DIR]
(in a Python with torch and wrapt, e.g. the test runner's venv; scripts/bench.py finds it);
``--wrapt-only --bundle DIR``: the two builds' rows alone (scripts/device_check.sh).
"""

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "dev"), REPO]  # shimdev (dev/shimdev/__init__.py), npu_shim

from shimdev.bench.hot_path_rows import rows, wrapt_rows  # noqa: E402 - after the path is set

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=100000, help="calls per round, the ns/call rows")
    parser.add_argument("--moe-calls", type=int, default=2000, help="calls per round, the MoE rows")
    parser.add_argument("--bundle", help="an existing bundle directory (default: build one)")
    parser.add_argument("--wrapt-only", action="store_true",
                        help="only the wrapper rows of the bundle's two wrapt builds (no sglang release "
                             "needed: what scripts/device_check.sh runs on a device machine)")
    args = parser.parse_args()
    if args.wrapt_only:
        if not args.bundle:
            parser.error("--wrapt-only needs --bundle DIR")
        found = wrapt_rows(args.bundle, args.rounds, args.calls)
    else:
        found = rows(args.rounds, args.calls, args.moe_calls, args.bundle)
    for row in found:
        print("%s\n    %s  [%s]" % (row["what"], row["measured"], {True: "ok", False: "MISSED", None: "-"}[row["ok"]]))


if __name__ == "__main__":
    main()
