"""The cache the test bed builds into, and how it builds: ``CACHE`` (``$NPU_SHIM_CACHE`` or
``~/.cache/npu-shim``), file locks (two processes may build the same thing at once), pip runs that
fail with their output's tail, the torch pin every pip run is constrained to, and ``build_once``:
a content-addressed directory built under a lock and stamped last, so a build never replaces an
environment another process is running in and a half-built one is never used."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

#: Bump to build every layer anew (part of every layer's hash).
LAYOUT = 1

PIP_TIMEOUT_S = 1800


class EnvError(RuntimeError):
    """A wheel, source tree or environment could not be provided."""


#: The only torch ever installed (a CPU build is on the local disk); also passed as constraint.
TORCH_PIN = "torch==2.13.0"


def cache_dir() -> Path:
    """``$NPU_SHIM_CACHE`` or ``~/.cache/npu-shim`` (read at call time)."""
    env = os.environ.get("NPU_SHIM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "npu-shim"


@contextlib.contextmanager
def file_lock(name: str):
    """Exclusive inter-process lock ``CACHE/locks/<name>.lock`` (blocks until acquired)."""
    d = cache_dir() / "locks"
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f"{name}.lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def run(cmd: list[str], what: str, env: dict | None = None) -> None:
    """Run quietly; on failure raise with the command and the tail of its output."""
    full_env = dict(os.environ)
    full_env.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    full_env.pop("PYTHONPATH", None)  # the shim/tests must not leak into pip
    if env:
        full_env.update(env)
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=full_env, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise EnvError(f"{what}: timed out after {PIP_TIMEOUT_S}s: {' '.join(cmd)}") from e
    if p.returncode != 0:
        tail = "\n".join(p.stdout.splitlines()[-60:])
        raise EnvError(f"{what} failed (exit {p.returncode}): {' '.join(cmd)}\n{tail}")


def pip(python: str | Path, *args: str) -> list[str]:
    return [str(python), "-m", "pip", "-q", "--disable-pip-version-check", *args]


def constraints_file() -> Path:
    p = cache_dir() / "constraints.txt"
    text = f"{TORCH_PIN}\n"
    if not p.exists() or p.read_text() != text:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(p)
    return p


def layered_dir() -> Path:
    return cache_dir() / "layered"


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def python_tag() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def stamp_of(d: Path) -> dict | None:
    try:
        return json.loads((d / "npu-shim-stamp.json").read_text())
    except (OSError, ValueError):
        return None


def write_stamp(d: Path, info: dict) -> None:
    (d / "npu-shim-stamp.json").write_text(json.dumps(info, indent=1, sort_keys=True))


def build_once(d: Path, lock: str, build, *, in_place: bool = False) -> Path:
    """``d`` when its stamp exists; else ``build(dir) -> stamp dict``, under a file lock.

    The stamp is written last: a directory without one is never used.  ``--target`` layers are
    built in a temporary sibling renamed to ``d``; a venv (``in_place``) is built at ``d`` itself,
    since it records its own absolute path."""
    if stamp_of(d) is not None:
        return d
    with file_lock(lock):
        if stamp_of(d) is not None:
            return d
        work = d if in_place else d.with_name(f"{d.name}.tmp{os.getpid()}")
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(d, ignore_errors=True)
        work.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        try:
            info = build(work)
            info["build_seconds"] = round(time.monotonic() - t0, 1)
            write_stamp(work, info)
            if work != d:
                work.replace(d)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return d
