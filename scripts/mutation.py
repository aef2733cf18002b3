#!/usr/bin/env python3
"""Mutation testing of the shim's own code, by hand (not in CI; what it does: dev/shimdev/mutation.py):

    python3 scripts/mutation.py --out /tmp/mutation.json     # seed 1, 120 mutants (an hour or so)
    python3 scripts/mutation.py --quick                      # a smoke run: 12 mutants
    python3 scripts/mutation.py --list                       # the sample, nothing run
"""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "dev"), REPO]  # shimdev (dev/shimdev/__init__.py), npu_shim

from shimdev.mutation import main  # noqa: E402 - after dev/ is put on sys.path

if __name__ == "__main__":
    sys.exit(main())
