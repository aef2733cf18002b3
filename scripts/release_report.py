#!/usr/bin/env python3
"""For maintainers, when upstream publishes an sglang release (what it does: dev/shimdev/beds/release_report.py):

    python3 scripts/release_report.py VERSION     # e.g. 0.5.24; "latest" = the newest on PyPI
    python3 scripts/release_report.py --write-docs   # docs/releases.md, docs/configuration.md
"""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "dev"), REPO]  # shimdev (dev/shimdev/__init__.py), npu_shim

from shimdev.beds.release_report import main  # noqa: E402 - after dev/ is put on sys.path

if __name__ == "__main__":
    sys.exit(main())
