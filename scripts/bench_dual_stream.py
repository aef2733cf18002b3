#!/usr/bin/env python3
"""How much of the ideal saving the dual-stream experts path gets (CUDA or NPU): see
dev/shimdev/bench/dual_stream_bench.py; ``--graph`` (eager and graph replay side by side over
``--sizes``, with the crossover) and ``--mla-replay`` (the shim's npu_mla_preprocess function at
graph replay): dev/shimdev/bench/graph_bench.py.

    python3 scripts/bench_dual_stream.py [--device cpu] [--tokens 512] ...
    python3 scripts/bench_dual_stream.py --graph --sizes 512,2048,8192 [--simnpu] ...
    python3 scripts/bench_dual_stream.py --mla-replay [--simnpu]
"""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "dev"), REPO]  # shimdev (dev/shimdev/__init__.py), npu_shim

from shimdev.bench import graph_bench  # noqa: E402 - after the path set-up above
from shimdev.bench.dual_stream_bench import main, rows  # noqa: E402,F401  (rows: for scripts/bench.py)

if __name__ == "__main__":
    sys.exit(graph_bench.main(sys.argv[1:]) if graph_bench.wants(sys.argv[1:]) else main())
