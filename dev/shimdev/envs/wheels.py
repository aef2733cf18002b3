"""The wheels and sources the test bed reads, each downloaded once into the cache: every
release's sglang wheel and its extracted ``sglang/`` tree (the static matrix reads them), the
editable install's sdist, and the pinned memfabric-zbal and torch-npu wheels."""
from __future__ import annotations

import os
import shutil
import sys
import zipfile
from pathlib import Path

from shimdev.envs.buildcache import EnvError, cache_dir, file_lock, pip, run
from shimdev.envs.releases import check_release

def find_wheel(d: Path, version: str) -> Path | None:
    hits = sorted(d.glob(f"sglang-{version}-*.whl"))
    return hits[0] if hits else None


def ensure_wheel(version: str, *, strict: bool = True) -> Path:
    """Path of sglang ``version``'s wheel in ``CACHE/wheels`` (downloaded once, with --no-deps).
    ``strict=False`` accepts a release outside the table (scripts/release_report.py)."""
    check_release(version, strict)
    d = cache_dir() / "wheels"
    hit = find_wheel(d, version)
    if hit:
        return hit
    with file_lock(f"wheel-{version}"):
        hit = find_wheel(d, version)
        if hit:
            return hit
        d.mkdir(parents=True, exist_ok=True)
        run(pip(sys.executable, "download", "--no-deps", "--only-binary=:all:",
                  "-d", str(d), f"sglang=={version}"),
             f"downloading the sglang {version} wheel")
        hit = find_wheel(d, version)
        if not hit:
            raise EnvError(f"pip download reported success but no sglang-{version}-*.whl is in {d}")
        return hit


def ensure_sources(version: str, *, strict: bool = True) -> Path:
    """``CACHE/src/<version>/`` holding the wheel's ``sglang/`` tree (extracted once)."""
    wheel = ensure_wheel(version, strict=strict)
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
#: The torch_npu the simulated NPU is held to (tests/dev/test_simnpu_conformance.py reads its Python
#: files) and the no-CANN environment installs (its C extension cannot load without CANN).
TORCH_NPU_PIN = "torch-npu==2.13.0"


def ensure_pinned_wheel(pin: str, subdir: str) -> Path:
    """The wheel of ``pin`` in ``CACHE/<subdir>`` (``pip download --no-deps``, once)."""
    d = cache_dir() / subdir
    name, version = pin.split("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    hits = sorted(d.glob(pattern))
    if hits:
        return hits[0]
    with file_lock(f"{subdir}-wheel"):
        hits = sorted(d.glob(pattern))
        if not hits:
            d.mkdir(parents=True, exist_ok=True)
            run(pip(sys.executable, "download", "--no-deps", "--only-binary=:all:", "-d", str(d),
                      pin), f"downloading {pin}")
            hits = sorted(d.glob(pattern))
        if not hits:
            raise EnvError(f"pip download reported success but no {pattern} is in {d}")
        return hits[0]


def ensure_zbal_wheel() -> Path:
    """The real memfabric-zbal wheel in ``CACHE/zbal`` (its Python files run in the zbal layer;
    its native library is never loaded)."""
    return ensure_pinned_wheel(ZBAL_PIN, "zbal")


def ensure_torch_npu_wheel() -> Path:
    """The real torch-npu wheel in ``CACHE/torch-npu`` (read by the conformance test, unpacked
    into the no-CANN layer)."""
    return ensure_pinned_wheel(TORCH_NPU_PIN, "torch-npu")


def ensure_sdist(version: str) -> Path:
    """sglang ``version``'s sdist in ``CACHE/sdists`` (``pip download --no-binary``)."""
    d = cache_dir() / "sdists"
    pattern = f"sglang-{version}.tar.gz"
    if (d / pattern).exists():
        return d / pattern
    with file_lock(f"sdist-{version}"):
        if not (d / pattern).exists():
            d.mkdir(parents=True, exist_ok=True)
            run(pip(sys.executable, "download", "--no-deps", "--no-binary=:all:", "-d", str(d),
                      f"sglang=={version}"), f"downloading the sglang {version} sdist")
        if not (d / pattern).exists():
            raise EnvError(f"pip download reported success but no {pattern} is in {d}")
    return d / pattern
