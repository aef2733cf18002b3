"""What the test command needs of a machine: the CPythons 3.9-3.13 the drop-in tests run
(tests/test_drop_in.py) and a C compiler (the zbal layer's native stand-in); podman the test
command installs itself with apt-get (dev/shimdev/envs/containers.py).

An interpreter is looked for where a machine keeps it: pyenv's ``$PYENV_ROOT/versions/3.X.*``
(``~/.pyenv`` where ``PYENV_ROOT`` is not set, as pyenv does), then ``python3.X`` on ``PATH``.
Each candidate is run once and kept only if it says it is CPython 3.X (a pyenv shim of a version
that is not selected is a program that fails).  ``missing()`` is what the test command reports in
one line before the suite runs (scripts/run_tests.py); the tests that need a missing one fail
with the same words.
"""
from __future__ import annotations

import functools
import glob
import os
import shutil
import subprocess

from shimdev.envs import npu_layers

PYTHONS = ("3.9", "3.10", "3.11", "3.12", "3.13")

# What an interpreter prints of itself: its version and implementation, then its real executable
# (a pyenv shim or a link resolved, so a venv made from it is made from the real one).
_WHO = "import sys; print('%d.%d' % sys.version_info[:2], sys.implementation.name, sys.executable)"


def pyenv_root() -> str:
    """pyenv's root: ``$PYENV_ROOT``, else ``~/.pyenv`` (pyenv's own default)."""
    return os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")


def candidates(version: str) -> list[str]:
    """Where CPython ``version`` may be, in the order they are tried."""
    found = sorted(glob.glob(os.path.join(pyenv_root(), "versions", version + ".*", "bin", "python3")),
                   key=_patch_level, reverse=True)
    on_path = shutil.which("python" + version)
    return found + ([on_path] if on_path else [])


def _patch_level(path: str) -> tuple:
    """(3, 11, 7) of .../versions/3.11.7/bin/python3, so 3.9.18 sorts above 3.9.9."""
    name = os.path.basename(os.path.dirname(os.path.dirname(path)))
    return tuple(int(part) if part.isdigit() else -1 for part in name.split("."))


@functools.lru_cache(maxsize=None)
def cpython(version: str) -> str | None:
    """The executable of a CPython ``version`` ("3.11") on this machine, or None."""
    for path in candidates(version):
        try:
            out = subprocess.run([path, "-I", "-S", "-c", _WHO], capture_output=True, text=True,
                                 timeout=60).stdout.split()
        except (OSError, subprocess.SubprocessError):
            continue
        if len(out) == 3 and out[0] == version and out[1] == "cpython":
            return out[2]
    return None


def how_to_get(*versions: str) -> str:
    """One line: these CPythons are missing, where they were looked for, and how to get them."""
    return ("CPython %s not found (looked in %s/versions/3.X.* and for python3.X on PATH): install "
            "with `pyenv install %s` (PYENV_ROOT set where pyenv is not ~/.pyenv) or your "
            "distribution's packages, or put their bin folder on PATH"
            % (", ".join(versions), pyenv_root(), " ".join(versions)))


def missing() -> str:
    """What the test command needs of this machine and does not find, in one line ("" where
    nothing is missing): the CPythons 3.9-3.13 and a C compiler (``$CC`` or ``cc``: the zbal
    layer's native stand-in).  podman is not here: the test command installs it with apt-get where
    it can (dev/shimdev/envs/containers.py says what it cannot)."""
    gaps = []
    absent = [version for version in PYTHONS if cpython(version) is None]
    if absent:
        gaps.append(how_to_get(*absent))
    compiler = npu_layers.c_compiler()
    if shutil.which(compiler) is None:
        gaps.append("no C compiler %r (the zbal layer's native stand-in is built with it): "
                    "`apt-get install gcc`, or set CC" % compiler)
    return "; ".join(gaps)
