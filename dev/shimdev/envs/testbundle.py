"""The bundle the tests share (tests/conftest.py ``built_bundle``): built once per run by the real
command (``python -m npu_shim bundle``), under a lock, by whoever comes first.

The test command (scripts/run_tests.py) starts the build itself as pytest starts, in a private
directory named to the tests by ``SHIMDEV_TEST_BUNDLE``: xdist hands out the real-server groups
first, minutes long, so the bundle is there before any test asks for it and no worker waits for
it (a build in the fixture kept the other worker idle for its whole length).  Where that build
failed, the fixture builds it again and fails the tests that need it with the command's words.
"""
from __future__ import annotations

import fcntl
import os
import subprocess
import tempfile
from pathlib import Path

from shimdev import REPO

#: The directory the test command built the bundle in (unset: the fixture builds it).
ENV = "SHIMDEV_TEST_BUNDLE"


def paths(shared: Path) -> tuple[Path, Path]:
    """(the bundle, its lock) in ``shared``."""
    return shared / "npu-shim-bundle" / "npu-shim", shared / "npu-shim-bundle.lock"


def ensure(python: str, shared: Path, env: dict | None = None, held=None) -> tuple[Path, str | None]:
    """The bundle in ``shared``, built there unless a build under the lock made it already;
    ``(path, None)`` or ``(path, why the build failed)``.  ``held``: the lock file, already
    locked by the caller (released here)."""
    out, lock_path = paths(Path(shared))
    lock = held or open(str(lock_path), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "MANIFEST").is_file():
            return out, None
        proc = subprocess.run([python, "-m", "npu_shim", "bundle", str(out), "--force"], cwd=str(REPO),
                              env=dict(env if env is not None else os.environ, PYTHONPATH=str(REPO)),
                              capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            return out, "python -m npu_shim bundle failed:\n%s" % proc.stderr[-3000:]
        return out, None
    finally:
        lock.close()


def reserve() -> tuple[Path, object]:
    """A new private directory for the bundle and its lock, already held: tests that ask for the
    bundle before ``ensure(..., held=lock)`` has built it wait for it."""
    shared = Path(tempfile.mkdtemp(prefix="npu-shim-test-bundle-"))
    lock = open(str(paths(shared)[1]), "a+")
    fcntl.flock(lock, fcntl.LOCK_EX)
    return shared, lock
