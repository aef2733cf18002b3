#!/usr/bin/env python3
"""Mutation testing of the shim's own code with mutmut 3, by hand (not in CI; the scope is
``[tool.mutmut]`` in pyproject.toml, the helpers dev/shimdev/envs/mutation.py):

    python3 scripts/mutation.py                      # mutmut run, then the score per file
    python3 scripts/mutation.py --out /tmp/mut.json  # ... and every mutant's status as JSON
    python3 scripts/mutation.py NAME...              # those mutants again (mutmut's names or globs)
    python3 scripts/mutation.py --fresh NAME...      # ... after the tests changed: mutants/ made anew
    python3 scripts/mutation.py --report             # the score of the last run, nothing run

mutmut writes its mutants and results under ``mutants/`` (git-ignored); ``mutmut show NAME`` in the
mutation venv shows a mutant's diff.
"""
import argparse
import json
import os
import shutil
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "dev"), REPO]  # shimdev (dev/shimdev/__init__.py), npu_shim

from shimdev.envs import mutation  # noqa: E402 - after dev/ is put on sys.path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("names", nargs="*", help="mutmut's mutant names or globs (default: every mutant)")
    parser.add_argument("--max-children", type=int, default=2, help="mutants run at once (default 2)")
    parser.add_argument("--fresh", action="store_true",
                        help="remove mutants/ first: mutmut keeps a mutant's result, and its map of which tests "
                             "reach which function, until the mutated code changes -- not when a test does")
    parser.add_argument("--report", action="store_true", help="print the last run's score; run nothing")
    parser.add_argument("--mutants", default=os.path.join(REPO, "mutants"),
                        help="the mutants directory to read (default: mutmut's, in the repository root)")
    parser.add_argument("--out", help="write {file: {mutant: status}} of the run here as JSON")
    args = parser.parse_args(argv)
    code = 0
    if args.fresh and not args.report:
        shutil.rmtree(os.path.join(REPO, "mutants"), ignore_errors=True)
    if not args.report:
        code = mutation.run_mutmut(["run", "--max-children", str(args.max_children)] + args.names)
    results = mutation.read_results(args.mutants)
    if not results:
        print("no mutmut results under %s" % args.mutants)
        return code or 1
    print(mutation.render(mutation.score(results)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
