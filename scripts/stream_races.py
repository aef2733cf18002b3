#!/usr/bin/env python3
"""The GLM-4.x MoE dual-stream path of real sglang releases under the simulated NPU's stream
sanitizer, each report with its call sites: see dev/shimdev/beds/stream_races.py.

    python3 scripts/stream_races.py [VERSION ...]   # default: 0.5.9 (the backport), 0.5.11 (upstream)

Builds (or reuses) each release's environment as the tests do; exit 1 when a release reports
other than dev/shimdev/beds/stream_races.py's EXPECTED."""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "dev"), REPO]  # shimdev (dev/shimdev/__init__.py), npu_shim

from shimdev.beds.stream_races import main  # noqa: E402 - after dev/ is put on sys.path

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
