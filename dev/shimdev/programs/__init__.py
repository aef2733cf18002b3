"""Programs the real-release tests run inside a release's process, as modules a linter reads
(not code in strings): ``realsglang.run_program(version, "zbal_backport", ...)`` runs
``shimdev.programs.zbal_backport`` as ``__main__`` in a fresh interpreter of the release, after the
simulated NPU is installed, with the arguments it was given (``arg(i)``); the program ends with
``emit(facts)``, the JSON the test checks.  Each is named for what it drives, and the test that
runs it says which.

Not collected by pytest (dev/ holds no tests) and imported by nothing but the release process.
"""
import json
import sys


def emit(obj):
    """Hand ``obj`` to the test: the last line of stdout, as JSON."""
    sys.stdout.write("\n" + json.dumps(obj, default=repr, sort_keys=True) + "\n")
    sys.stdout.flush()


def arg(index):
    """The program's argument ``index`` (any JSON value, as ``run_program`` was given it)."""
    return json.loads(sys.argv[1 + index])
