"""The linter the test command runs before the suite: ruff, configured in pyproject.toml
(``[tool.ruff]``), pinned in the runner venv (dev/shimdev/envs/runner.py), over the whole checkout (what
git ignores left out).  A finding fails the run (scripts/run_tests.py) after the suite has run, with
one line that says so; the findings themselves are ruff's, one a line, above it."""
from __future__ import annotations

import subprocess

from shimdev import REPO

#: The ruff the runner venv holds (a new pin builds a new runner venv).
RUFF_PIN = "ruff==0.17.6"


def check(python, root=REPO, log=print) -> bool:
    """``ruff check`` over ``root`` with ``python``'s ruff; True when it finds nothing.  Its
    findings go to this process's output, then one line says what failed."""
    command = [str(python), "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."]
    try:
        code = subprocess.call(command, cwd=str(root), timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        code, why = -1, "%s: %s" % (type(exc).__name__, exc)
    else:
        why = {0: None, 1: "it found the problems above"}.get(code, "it exited %d (above)" % code)
    if why is not None:
        log("lint failed: `%s` in %s: %s -- fix them, or mark a line `# noqa: RULE - why` "
            "(pyproject.toml's [tool.ruff])" % (" ".join(command[1:]), root, why))
    return why is None
