#!/usr/bin/env python3
"""How much of the ideal saving the dual-stream experts path gets (CUDA or NPU): see
dev/shimdev/bench/dual_stream_bench.py.  ``python3 scripts/bench_dual_stream.py [--device cpu] ...``"""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "dev"), REPO]  # shimdev (dev/shimdev/__init__.py), npu_shim

from shimdev.bench.dual_stream_bench import main, rows  # noqa: E402,F401  (rows: for scripts/bench.py)

if __name__ == "__main__":
    sys.exit(main())
