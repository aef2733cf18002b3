#!/usr/bin/env python3
"""The dual-stream backport under PyTorch's CUDA Sanitizer (TORCH_CUDA_SANITIZER=1), on a CUDA
device, next to what the simulated NPU's stream sanitizer reports for the same cases: see
dev/shimdev/bench/csan_check.py.  ``python3 scripts/csan_dual_stream.py`` (exit 0: they agree, 1: a case
differs, 2: no CUDA device here).  Needs torch with CUDA; nothing else is installed."""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "dev"), REPO]  # shimdev (dev/shimdev/__init__.py), npu_shim

from shimdev.bench.csan_check import main  # noqa: E402 - after dev/ is put on sys.path

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], REPO))
