#!/usr/bin/env python3
"""Test bed: the sglang releases npu-shim supports, their wheels, sources and venvs.

One place for:

* ``CACHE`` -- ``$NPU_SHIM_CACHE`` or ``~/.cache/npu-shim``;
* ``RELEASES`` -- every supported base release (add one line to support one more);
* ``ensure_wheel(v)`` -- the sglang wheel in ``CACHE/wheels`` (``pip download --no-deps``);
* ``ensure_sources(v)`` -- the wheel's ``sglang/`` tree extracted to ``CACHE/src/<v>/``;
* ``ensure_venv(v)`` -- a venv at ``CACHE/venvs/sglang-<v>`` able to import the real sglang
  on CPU (with the tests' simulated NPU); returns the path of its python.

Everything is reused when present, guarded by file locks (two processes may call the same
function at once) and rebuilt when the pins of a venv change (a stamp file holds their hash).

CLI::

    python scripts/sglang_envs.py wheels              # download every release's wheel
    python scripts/sglang_envs.py sources [V ...]     # extract sources (default: all)
    python scripts/sglang_envs.py venvs [V ...]       # build venvs (default: all in VENV_PINS)
    python scripts/sglang_envs.py python V            # print the venv's python path

This file lives in ``scripts/`` without an ``__init__.py`` on purpose: the repo root is on
users' PYTHONPATH and must not shadow an image's own ``scripts`` package.  Import it by path
(``tests/support/realsglang.py`` does).
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------

#: Every supported base release, oldest first.  One line to add one.
RELEASES = (
    "0.5.7",
    "0.5.8",
    "0.5.9",
    "0.5.10",
    "0.5.11",
    "0.5.12",
    "0.5.13",
    "0.5.14",
    "0.5.15",
    "0.5.16",
    "0.5.17",
    "0.5.18",
    "0.5.19",
    "0.5.20",
    "0.5.21",
    "0.5.22",
    "0.5.23",
)

#: The only torch ever installed (a CPU build is on the local disk); also passed as constraint.
TORCH_PIN = "torch==2.13.0"
#: The shim's runtime dependency, and the test runner.
SHIM_PINS = ("wrapt==2.5.2", "pytest")

#: Packages every release needs to import its scheduler / model runner on CPU.
COMMON_DEPS = (
    "numpy", "orjson", "psutil", "pybase64", "requests", "packaging", "starlette", "pillow",
    "tqdm", "ipython", "pydantic", "aiohttp", "setproctitle", "pyzmq", "partial-json-parser",
    "dill", "sentencepiece", "gguf", "msgspec", "einops",
)

#: Per-release extra pins (see shared/docs/real-sglang-on-cpu.md).  ``deps`` are installed with
#: dependency resolution, ``nodeps`` with ``--no-deps``.  A release gets a venv only if listed.
VENV_PINS: dict[str, dict[str, tuple[str, ...]]] = {
    "0.5.9": {
        "deps": ("transformers==4.57.1", "openai==2.6.1", "compressed-tensors"),
    },
    "0.5.11": {
        "deps": ("transformers==5.6.0", "openai==2.6.1", "compressed-tensors"),
    },
    "0.5.19": {
        "deps": ("transformers==5.12.1", "tokenizers==0.22.2", "openai==2.6.1",
                 "compressed-tensors==0.18.0", "uvicorn", "fastapi", "apache-tvm-ffi==0.1.11"),
        # xgrammar's deps would pull a 1 GB triton.
        "nodeps": ("xgrammar==0.2.1",),
    },
    "0.5.23": {
        "deps": ("transformers==5.19.0", "tokenizers==0.23.2", "openai==2.8.0",
                 "compressed-tensors==0.18.0", "uvicorn", "fastapi", "apache-tvm-ffi==0.1.11"),
    },
}

#: Bump to force every venv to be rebuilt (changes the stamp hash).
VENV_LAYOUT = 1

PIP_TIMEOUT_S = 1800


class EnvError(RuntimeError):
    """A wheel, source tree or venv could not be provided."""


# --------------------------------------------------------------------------------------------
# Paths and helpers
# --------------------------------------------------------------------------------------------

def cache_dir() -> Path:
    """``$NPU_SHIM_CACHE`` or ``~/.cache/npu-shim`` (read at call time)."""
    env = os.environ.get("NPU_SHIM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "npu-shim"


def _check_release(version: str) -> None:
    if version not in RELEASES:
        raise EnvError(f"sglang {version!r} is not a supported release; supported: {', '.join(RELEASES)}")


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


def _run(cmd: list[str], what: str, env: dict | None = None) -> None:
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


def _pip(python: str | Path, *args: str) -> list[str]:
    return [str(python), "-m", "pip", "-q", "--disable-pip-version-check", *args]


def _constraints_file() -> Path:
    p = cache_dir() / "constraints.txt"
    text = f"{TORCH_PIN}\n"
    if not p.exists() or p.read_text() != text:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(p)
    return p


# --------------------------------------------------------------------------------------------
# Wheels and sources
# --------------------------------------------------------------------------------------------

def _find_wheel(d: Path, version: str) -> Path | None:
    hits = sorted(d.glob(f"sglang-{version}-*.whl"))
    return hits[0] if hits else None


def ensure_wheel(version: str) -> Path:
    """Path of sglang ``version``'s wheel in ``CACHE/wheels`` (downloaded once, with --no-deps)."""
    _check_release(version)
    d = cache_dir() / "wheels"
    hit = _find_wheel(d, version)
    if hit:
        return hit
    with file_lock(f"wheel-{version}"):
        hit = _find_wheel(d, version)
        if hit:
            return hit
        d.mkdir(parents=True, exist_ok=True)
        _run(_pip(sys.executable, "download", "--no-deps", "--only-binary=:all:",
                  "-d", str(d), f"sglang=={version}"),
             f"downloading the sglang {version} wheel")
        hit = _find_wheel(d, version)
        if not hit:
            raise EnvError(f"pip download reported success but no sglang-{version}-*.whl is in {d}")
        return hit


def ensure_sources(version: str) -> Path:
    """``CACHE/src/<version>/`` holding the wheel's ``sglang/`` tree (extracted once)."""
    wheel = ensure_wheel(version)
    dest = cache_dir() / "src" / version
    stamp = dest / ".extracted"
    if stamp.exists() and stamp.read_text() == wheel.name:
        return dest
    with file_lock(f"src-{version}"):
        if stamp.exists() and stamp.read_text() == wheel.name:
            return dest
        tmp = dest.with_name(f"{version}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            with zipfile.ZipFile(wheel) as zf:
                members = [m for m in zf.namelist() if m.startswith("sglang/")]
                if not members:
                    raise EnvError(f"{wheel} holds no sglang/ tree")
                zf.extractall(tmp, members)
            (tmp / ".extracted").write_text(wheel.name)
            shutil.rmtree(dest, ignore_errors=True)
            tmp.replace(dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return dest


ZBAL_PIN = "memfabric-zbal==1.2.0"


def ensure_zbal_wheel() -> Path:
    """The real memfabric-zbal wheel in ``CACHE/zbal`` (for reading its sources; never installed)."""
    d = cache_dir() / "zbal"
    name, version = ZBAL_PIN.split("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    hits = sorted(d.glob(pattern))
    if hits:
        return hits[0]
    with file_lock("zbal-wheel"):
        hits = sorted(d.glob(pattern))
        if not hits:
            d.mkdir(parents=True, exist_ok=True)
            _run(_pip(sys.executable, "download", "--no-deps", "--only-binary=:all:", "-d", str(d),
                      ZBAL_PIN), f"downloading {ZBAL_PIN}")
            hits = sorted(d.glob(pattern))
        if not hits:
            raise EnvError(f"pip download reported success but no {pattern} is in {d}")
        return hits[0]


# --------------------------------------------------------------------------------------------
# Venvs
# --------------------------------------------------------------------------------------------

def venv_dir(version: str) -> Path:
    return cache_dir() / "venvs" / f"sglang-{version}"


def venv_python(version: str) -> Path:
    return venv_dir(version) / "bin" / "python"


def venv_pins(version: str) -> dict:
    """Everything that decides a venv's content (hashed into its stamp)."""
    _check_release(version)
    if version not in VENV_PINS:
        raise EnvError(
            f"no venv recipe for sglang {version}; releases with one: {', '.join(VENV_PINS)} "
            "(add its pins to VENV_PINS in scripts/sglang_envs.py)")
    extra = VENV_PINS[version]
    return {
        "layout": VENV_LAYOUT,
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "torch": TORCH_PIN,
        "sglang": version,
        "common": list(COMMON_DEPS),
        "shim": list(SHIM_PINS),
        "deps": list(extra.get("deps", ())),
        "nodeps": list(extra.get("nodeps", ())),
    }


def _pins_hash(version: str) -> str:
    blob = json.dumps(venv_pins(version), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _stamp(version: str) -> Path:
    return venv_dir(version) / "npu-shim-stamp.json"


def venv_is_current(version: str) -> bool:
    st = _stamp(version)
    if not st.exists() or not venv_python(version).exists():
        return False
    try:
        return json.loads(st.read_text()).get("pins_hash") == _pins_hash(version)
    except (OSError, ValueError):
        return False


def ensure_venv(version: str, *, log=None) -> Path:
    """Path of the python of sglang ``version``'s venv, building it when missing or stale.

    ``log`` (a callable taking one str) receives progress lines; default: silent.
    """
    pins = venv_pins(version)  # validates the release
    if venv_is_current(version):
        return venv_python(version)
    with file_lock(f"venv-{version}"):
        if venv_is_current(version):
            return venv_python(version)
        wheel = ensure_wheel(version)
        _build_venv(version, wheel, pins, log or (lambda s: None))
        return venv_python(version)


def _build_venv(version: str, wheel: Path, pins: dict, log) -> None:
    d = venv_dir(version)
    t0 = time.monotonic()
    shutil.rmtree(d, ignore_errors=True)
    d.parent.mkdir(parents=True, exist_ok=True)
    log(f"[sglang {version}] creating venv {d}")
    _run([sys.executable, "-m", "venv", str(d)], f"creating venv for sglang {version}")
    py = venv_python(version)
    cons = str(_constraints_file())
    what = f"building the sglang {version} venv"
    # torch first and alone, so nothing resolves against another torch.
    log(f"[sglang {version}] installing {TORCH_PIN}")
    _run(_pip(py, "install", "-c", cons, TORCH_PIN), f"{what}: {TORCH_PIN}")
    log(f"[sglang {version}] installing {wheel.name} (--no-deps)")
    _run(_pip(py, "install", "--no-deps", str(wheel)), f"{what}: sglang wheel")
    reqs = [TORCH_PIN, *pins["common"], *pins["deps"], *pins["shim"]]
    log(f"[sglang {version}] installing {len(reqs)} requirements")
    _run(_pip(py, "install", "-c", cons, *reqs), f"{what}: dependencies")
    if pins["nodeps"]:
        _run(_pip(py, "install", "--no-deps", *pins["nodeps"]), f"{what}: --no-deps pins")
    # Sanity: torch must still be the pinned CPU build.
    _run([str(py), "-c", "import torch, sys; v = torch.__version__; "
          f"sys.exit(0 if v.split('+')[0] == {TORCH_PIN.split('==')[1]!r} else 'torch is ' + v)"],
         f"{what}: checking torch")
    dt = time.monotonic() - t0
    _stamp(version).write_text(json.dumps(
        {"pins_hash": _pins_hash(version), "pins": pins, "build_seconds": round(dt, 1)},
        indent=1, sort_keys=True))
    log(f"[sglang {version}] venv ready in {dt:.0f}s")


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def _versions(args: list[str], default) -> list[str]:
    vs = list(args) or list(default)
    for v in vs:
        _check_release(v)
    return vs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sglang_envs.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("wheels", help="download every supported release's wheel")
    p = sub.add_parser("sources", help="extract releases' sglang/ trees (default: all)")
    p.add_argument("versions", nargs="*")
    p = sub.add_parser("venvs", help="build release venvs (default: all with a recipe)")
    p.add_argument("versions", nargs="*")
    p = sub.add_parser("python", help="print a release venv's python (building it if needed)")
    p.add_argument("version")
    a = ap.parse_args(argv)
    err = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    try:
        if a.cmd == "wheels":
            for v in RELEASES:
                print(ensure_wheel(v))
        elif a.cmd == "sources":
            for v in _versions(a.versions, RELEASES):
                print(ensure_sources(v))
        elif a.cmd == "venvs":
            for v in _versions(a.versions, VENV_PINS):
                t0 = time.monotonic()
                fresh = venv_is_current(v)
                py = ensure_venv(v, log=err)
                print(f"{v} {py} {'reused' if fresh else f'built in {time.monotonic() - t0:.0f}s'}",
                      flush=True)
        elif a.cmd == "python":
            print(ensure_venv(a.version, log=err))
    except EnvError as e:
        err(f"sglang_envs: error: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
