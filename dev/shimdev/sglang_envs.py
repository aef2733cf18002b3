#!/usr/bin/env python3
"""Test bed: the sglang releases npu-shim supports, their wheels, sources and layered environments.

One place for:

* ``CACHE`` -- ``$NPU_SHIM_CACHE`` or ``~/.cache/npu-shim``;
* ``RELEASES`` / ``POST_RELEASES`` / ``ALL_RELEASES`` -- every supported release (add one line to
  support one more); ``EDITABLE`` -- the release installed editable with a dev version string;
* ``ensure_wheel(v)`` -- the sglang wheel in ``CACHE/wheels`` (``pip download --no-deps``);
* ``ensure_sources(v)`` -- the wheel's ``sglang/`` tree extracted to ``CACHE/src/<v>/``;
* ``ensure_release(v)`` -- what it takes to run release ``v`` on CPU (simulated NPU), as layers
  under ``CACHE/layered/``:

  - ONE base venv (``base-<hash>``): torch==2.13.0 (CPU) and the pins most releases share.  It has
    no wrapt: a real Ascend image has none (sglang's NPU dependency set does not contain it;
    docs/deploy/README.md);
  - per release, the sglang wheel unpacked with ``pip install --no-deps --target``
    (``sglang-<v>``), and a dependency layer (``deps-<hash>``) holding exactly what that
    release's pins change relative to the base (pip resolves them against the base with
    ``--dry-run --report``; releases with the same pins share one layer);
  - wrapt as its own layer (``wrapt-<version>``), chosen per run (``ensure_wrapt``);
  - the editable release: a small venv on top of the base (its ``.pth`` adds the base's
    site-packages) into which setuptools' own ``pip install -e`` installed an sdist tree whose
    version is a setuptools-scm dev version.

  ``ensure_release`` returns a ``ReleaseEnv`` (python, layer paths in ``PYTHONPATH`` order).

Everything is reused when present, guarded by file locks (two processes may call the same
function at once), and content-addressed: a changed pin gives a new directory, so a build never
replaces an environment another process is running in.

CLI::

    PYTHONPATH=dev python3 -m shimdev.sglang_envs wheels           # download every release's wheel
    PYTHONPATH=dev python3 -m shimdev.sglang_envs sources [V ...]  # extract sources (default: all)
    PYTHONPATH=dev python3 -m shimdev.sglang_envs envs [V ...]     # build layers (default: all + editable)
    PYTHONPATH=dev python3 -m shimdev.sglang_envs python V         # print the python that runs release V

Part of ``shimdev`` (dev/shimdev/): imported as ``from shimdev import sglang_envs`` with ``dev/`` on
sys.path (see shimdev/__init__.py), never by file path.
"""
from __future__ import annotations

import argparse
import contextlib
import email.parser
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from typing import NamedTuple

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

#: Every post release on PyPI of a supported base release (``pip index versions sglang``).
POST_RELEASES = (
    "0.5.8.post1",
    "0.5.10.post1",
    "0.5.12.post1",
    "0.5.13.post1",
    "0.5.15.post1",
)

_VERSION_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?(?:\.dev(\d+))?(?:\+[\w.]+)?$")


def version_key(version: str) -> tuple:
    """Sort key of an sglang version: 0.5.10 < 0.5.10.post1 < 0.5.11; a .devN sorts before the
    release it leads to (PEP 440 for the forms sglang uses)."""
    m = _VERSION_RE.match(version)
    if not m:
        raise ValueError(f"not an sglang version: {version!r}")
    major, minor, micro, post, dev = m.groups()
    post_key = int(post) if post is not None else -1
    return (int(major), int(minor), int(micro), post_key, int(dev) if dev is not None else 1 << 30)


#: Every release the test bed knows, oldest first (the expected table has one row per entry).
ALL_RELEASES = tuple(sorted(RELEASES + POST_RELEASES, key=version_key))

#: The editable install (upstream's NPU image: ``pip install -e`` of a source tree, version from
#: setuptools-scm).  ``release``: the sdist whose tree is installed (PyPI has sdists up to
#: 0.5.10.post1); ``version``: the dev version setuptools-scm is made to give it (what a checkout
#: 3 commits after the 0.5.10.post1 tag reads).  Its expected states are those of ``release``.
EDITABLE = {"release": "0.5.10.post1", "version": "0.5.10.post2.dev3+g5d1c3a7"}

#: The only torch ever installed (a CPU build is on the local disk); also passed as constraint.
TORCH_PIN = "torch==2.13.0"
#: The shim's runtime dependency in normal runs (a layer of its own, never in the base).
WRAPT_DEFAULT = "2.5.2"

#: Packages every release needs to import its scheduler / model runner on CPU.
COMMON_DEPS = (
    "numpy", "orjson", "psutil", "pybase64", "requests", "packaging", "starlette", "pillow",
    "tqdm", "ipython", "pydantic", "aiohttp", "setproctitle", "pyzmq", "partial-json-parser",
    "dill", "sentencepiece", "gguf", "msgspec", "einops",
)

#: What most releases pin alike (0.5.15-0.5.21), in the base; a release that pins otherwise gets
#: the difference in its dependency layer.
BASE_PINS = (
    "transformers==5.12.1", "tokenizers==0.22.2", "openai==2.6.1", "compressed-tensors==0.18.0",
    "apache-tvm-ffi==0.1.11", "uvicorn", "fastapi",
)

#: Requirements taken from each release's wheel metadata (``Requires-Dist``, as the release
#: states them) into its dependency layer: the packages whose version decides whether the
#: release imports on CPU (found by importing every release's target modules on CPU torch).  The
#: rest of sglang's requirements are GPU kernels or serving extras that importing the patched
#: modules on CPU does not need.
LAYER_REQUIREMENTS = ("transformers", "tokenizers", "openai", "compressed-tensors", "apache-tvm-ffi",
                      "huggingface-hub", "uvicorn", "fastapi")
#: Taken from the metadata too, but installed with ``--no-deps`` (xgrammar's would pull a 1 GB
#: triton), and only from the release that first imports it at module level (0.5.16: the
#: function_call detectors; before, only the xgrammar backend, which nothing here loads).
NODEPS_REQUIREMENTS = {"xgrammar": "0.5.16"}

#: Packages that must never be in the base or a release layer (they come in their own layer).
NEVER_IN_LAYERS = ("wrapt", "torch")

#: Bump to build every layer anew (part of every layer's hash).
LAYOUT = 1

PIP_TIMEOUT_S = 1800


class EnvError(RuntimeError):
    """A wheel, source tree or environment could not be provided."""


# --------------------------------------------------------------------------------------------
# Paths and helpers
# --------------------------------------------------------------------------------------------

def cache_dir() -> Path:
    """``$NPU_SHIM_CACHE`` or ``~/.cache/npu-shim`` (read at call time)."""
    env = os.environ.get("NPU_SHIM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "npu-shim"


def _check_release(version: str, strict: bool = True) -> None:
    """A release of the table (``strict``), or at least an sglang version string."""
    if strict and version not in ALL_RELEASES:
        raise EnvError(f"sglang {version!r} is not a supported release; supported: "
                       f"{', '.join(ALL_RELEASES)}")
    if not _VERSION_RE.match(version):
        raise EnvError(f"{version!r} is not an sglang version")


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


# --------------------------------------------------------------------------------------------
# Wheels and sources
# --------------------------------------------------------------------------------------------

def _find_wheel(d: Path, version: str) -> Path | None:
    hits = sorted(d.glob(f"sglang-{version}-*.whl"))
    return hits[0] if hits else None


def ensure_wheel(version: str, *, strict: bool = True) -> Path:
    """Path of sglang ``version``'s wheel in ``CACHE/wheels`` (downloaded once, with --no-deps).
    ``strict=False`` accepts a release outside the table (scripts/release_report.py)."""
    _check_release(version, strict)
    d = cache_dir() / "wheels"
    hit = _find_wheel(d, version)
    if hit:
        return hit
    with file_lock(f"wheel-{version}"):
        hit = _find_wheel(d, version)
        if hit:
            return hit
        d.mkdir(parents=True, exist_ok=True)
        run(pip(sys.executable, "download", "--no-deps", "--only-binary=:all:",
                  "-d", str(d), f"sglang=={version}"),
             f"downloading the sglang {version} wheel")
        hit = _find_wheel(d, version)
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


def _ensure_pinned_wheel(pin: str, subdir: str) -> Path:
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
    return _ensure_pinned_wheel(ZBAL_PIN, "zbal")


def ensure_torch_npu_wheel() -> Path:
    """The real torch-npu wheel in ``CACHE/torch-npu`` (read by the conformance test, unpacked
    into the no-CANN layer)."""
    return _ensure_pinned_wheel(TORCH_NPU_PIN, "torch-npu")


# --------------------------------------------------------------------------------------------
# Layered environments
# --------------------------------------------------------------------------------------------

def layered_dir() -> Path:
    return cache_dir() / "layered"


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def _python_tag() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def _stamp_of(d: Path) -> dict | None:
    try:
        return json.loads((d / "npu-shim-stamp.json").read_text())
    except (OSError, ValueError):
        return None


def _write_stamp(d: Path, info: dict) -> None:
    (d / "npu-shim-stamp.json").write_text(json.dumps(info, indent=1, sort_keys=True))


def build_once(d: Path, lock: str, build, *, in_place: bool = False) -> Path:
    """``d`` when its stamp exists; else ``build(dir) -> stamp dict``, under a file lock.

    The stamp is written last: a directory without one is never used.  ``--target`` layers are
    built in a temporary sibling renamed to ``d``; a venv (``in_place``) is built at ``d`` itself,
    since it records its own absolute path."""
    if _stamp_of(d) is not None:
        return d
    with file_lock(lock):
        if _stamp_of(d) is not None:
            return d
        work = d if in_place else d.with_name(f"{d.name}.tmp{os.getpid()}")
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(d, ignore_errors=True)
        work.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        try:
            info = build(work)
            info["build_seconds"] = round(time.monotonic() - t0, 1)
            _write_stamp(work, info)
            if work != d:
                work.replace(d)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return d


# -- the base ---------------------------------------------------------------------------------

def base_spec() -> dict:
    return {"layout": LAYOUT, "python": _python_tag(), "torch": TORCH_PIN, "common": list(COMMON_DEPS),
            "pins": list(BASE_PINS)}


def base_dir() -> Path:
    return layered_dir() / f"base-{digest(base_spec())}"


def base_python() -> Path:
    return base_dir() / "bin" / "python"


def site_packages(prefix: Path) -> Path:
    return prefix / "lib" / f"python{_python_tag()}" / "site-packages"


def _check_no(python: Path, names, what: str) -> None:
    """Fail with ``what`` when one of ``names`` is importable by ``python`` (no PYTHONPATH)."""
    code = ("import importlib.util, sys; bad = [n for n in sys.argv[1:] if importlib.util.find_spec(n)]; "
            "sys.exit('importable: ' + ', '.join(bad) if bad else 0)")
    run([str(python), "-c", code, *names], what, env={"PYTHONNOUSERSITE": "1"})


def ensure_base(*, log=None) -> Path:
    """The base venv's python: torch (CPU), the common deps and BASE_PINS; never wrapt."""
    log = log or (lambda s: None)

    def build(d: Path) -> dict:
        log(f"[base] creating {d}")
        run([sys.executable, "-m", "venv", str(d)], "creating the base venv")
        py = d / "bin" / "python"
        cons = str(constraints_file())
        log(f"[base] installing {TORCH_PIN}")
        run(pip(py, "install", "-c", cons, TORCH_PIN), f"base venv: {TORCH_PIN}")
        log(f"[base] installing {len(COMMON_DEPS) + len(BASE_PINS)} requirements")
        run(pip(py, "install", "-c", cons, TORCH_PIN, *COMMON_DEPS, *BASE_PINS), "base venv: dependencies")
        run([str(py), "-c", "import torch, sys; v = torch.__version__; "
              f"sys.exit(0 if v.split('+')[0] == {TORCH_PIN.split('==')[1]!r} else 'torch is ' + v)"],
             "base venv: checking torch")
        _check_no(py, ["wrapt"], "base venv: a dependency brought wrapt (the base must not have it)")
        return {"spec": base_spec()}

    return build_once(base_dir(), "layered-base", build, in_place=True) / "bin" / "python"


# -- single-package layers (wrapt, sglang) --------------------------------------------------------

def ensure_wrapt(version: str = WRAPT_DEFAULT) -> Path:
    """``CACHE/layered/wrapt-<version>``: wrapt alone (``pip install --no-deps --target``)."""
    if not re.fullmatch(r"[\w.]+", version):
        raise EnvError(f"not a wrapt version: {version!r}")
    d = layered_dir() / f"wrapt-{version}-py{_python_tag()}"

    def build(tmp: Path) -> dict:
        run(pip(sys.executable, "install", "--no-deps", "--only-binary=:all:", "--target", str(tmp),
                  f"wrapt=={version}"), f"installing wrapt {version} as a layer")
        return {"wrapt": version}

    return build_once(d, f"layered-wrapt-{version}", build)


def ensure_sglang_layer(version: str, *, strict: bool = True, log=None) -> Path:
    """``CACHE/layered/sglang-<version>``: the release's wheel, ``--no-deps --target``."""
    wheel = ensure_wheel(version, strict=strict)
    d = layered_dir() / f"sglang-{version}"

    def build(tmp: Path) -> dict:
        (log or (lambda s: None))(f"[sglang {version}] installing {wheel.name} as a layer")
        run(pip(sys.executable, "install", "--no-deps", "--target", str(tmp), str(wheel)),
             f"installing the sglang {version} wheel as a layer")
        return {"wheel": wheel.name}

    return build_once(d, f"layered-sglang-{version}", build)


# -- dependency layers ---------------------------------------------------------------------------

def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_requirements(version: str, *, strict: bool = True) -> dict:
    """{"deps": [...], "nodeps": [...]}: the LAYER_REQUIREMENTS / NODEPS_REQUIREMENTS lines of the
    release's wheel metadata (markers for other platforms dropped)."""
    wheel = ensure_wheel(version, strict=strict)
    with zipfile.ZipFile(wheel) as zf:
        (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        msg = email.parser.Parser().parsestr(zf.read(meta).decode())
    deps, nodeps = [], []
    wanted = {_norm(n) for n in LAYER_REQUIREMENTS}
    for line in msg.get_all("Requires-Dist") or []:
        req, _, marker = line.partition(";")
        if "extra ==" in marker or "sys_platform == \"darwin\"" in marker:
            continue
        name = _norm(re.match(r"[A-Za-z0-9_.\-]+", req.strip()).group(0))
        req = re.sub(r"\[[^\]]*\]", "", req.strip()).replace(" ", "")
        if name in wanted:
            deps.append(req)
        elif name in NODEPS_REQUIREMENTS and version_key(version) >= version_key(NODEPS_REQUIREMENTS[name]):
            if "==" not in req:
                raise EnvError(f"sglang {version}: {req} is installed --no-deps and must be pinned")
            nodeps.append(req)
    return {"deps": sorted(deps), "nodeps": sorted(nodeps)}


def _deps_dir(key: dict) -> Path:
    return layered_dir() / f"deps-{digest(key)}"


def ensure_deps_layer(requirements: dict, *, log=None) -> Path:
    """``CACHE/layered/deps-<hash>``: what ``requirements`` change relative to the base.

    pip resolves ``requirements["deps"]`` against the base venv (``--dry-run --report``: only what
    the base lacks or has in another version is listed), then exactly those distributions and the
    ``--no-deps`` pins are installed with ``--no-deps --target``.  Shared by every release with
    the same requirements."""
    log = log or (lambda s: None)
    py = ensure_base(log=log)
    key = {"base": base_dir().name, "requirements": requirements, "layout": LAYOUT}
    d = _deps_dir(key)

    def build(tmp: Path) -> dict:
        cons = str(constraints_file())
        report = layered_dir() / f"report-{os.getpid()}.json"
        delta: list[str] = []
        if requirements["deps"]:
            log(f"[deps] resolving {' '.join(requirements['deps'])} against the base")
            run(pip(py, "install", "--dry-run", "--report", str(report), "-c", cons, TORCH_PIN,
                      *requirements["deps"]), "resolving a dependency layer against the base")
            try:
                items = json.loads(report.read_text()).get("install", [])
            finally:
                report.unlink(missing_ok=True)
            delta = sorted(f"{i['metadata']['name']}=={i['metadata']['version']}" for i in items)
        banned = [r for r in delta + requirements["nodeps"]
                  if _norm(r.split("==")[0]) in NEVER_IN_LAYERS]
        if banned:
            raise EnvError(f"a dependency layer would hold {', '.join(banned)} (requirements "
                           f"{requirements}); those never go into a release layer")
        tmp.mkdir(parents=True)
        for group, what in ((delta, "the resolved delta"), (requirements["nodeps"], "--no-deps pins")):
            if group:
                log(f"[deps] installing {' '.join(group)}")
                run(pip(py, "install", "--no-deps", "--target", str(tmp), *group),
                     f"installing {what} of a dependency layer")
        return {"key": key, "installed": delta + requirements["nodeps"]}

    return build_once(d, f"layered-deps-{d.name}", build)


# -- a release, as its layers --------------------------------------------------------------------

class ReleaseEnv(NamedTuple):
    """How to run one release: ``python`` and the ``layers`` that go on ``PYTHONPATH`` (in that
    order, after the shim/test paths and a wrapt layer)."""
    version: str
    python: Path
    layers: tuple[Path, ...]
    editable: bool = False


def ensure_release(version: str, *, log=None, strict: bool = True) -> ReleaseEnv:
    """Build (or reuse) the layers of ``version`` (``EDITABLE["version"]`` gives the editable
    install); raises EnvError when one cannot be built."""
    if version == EDITABLE["version"]:
        return ensure_editable(log=log)
    _check_release(version, strict)
    python = ensure_base(log=log)
    sglang = ensure_sglang_layer(version, strict=strict, log=log)
    deps = ensure_deps_layer(wheel_requirements(version, strict=strict), log=log)
    return ReleaseEnv(version, python, (sglang, deps))


# -- the editable install --------------------------------------------------------------------------

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


def editable_dir() -> Path:
    key = {"base": base_dir().name, "editable": EDITABLE, "layout": LAYOUT}
    return layered_dir() / f"editable-{digest(key)}"


def put_base_under(venv: Path) -> None:
    """A venv made by the base's python also sees the base's site-packages (a ``.pth``)."""
    (site_packages(venv) / "npu_shim_base.pth").write_text(
        f"import site; site.addsitedir({str(site_packages(base_dir()))!r})\n")


def ensure_editable(*, log=None) -> ReleaseEnv:
    """The editable release: ``EDITABLE["release"]``'s sdist tree, its ``pyproject_npu.toml`` as
    ``pyproject.toml`` (as upstream's NPU Dockerfile does), installed with setuptools' own
    ``pip install -e`` (build isolation: setuptools, setuptools-scm, wheel from the index) into a
    small venv whose ``.pth`` puts the base venv's site-packages on its path; the version comes
    from setuptools-scm (``SETUPTOOLS_SCM_PRETEND_VERSION``, as a checkout after the tag would
    give).  setuptools chooses the layout: for sglang's flat tree a meta-path finder
    (``__editable___sglang_*_finder.py``) installed by a ``.pth``."""
    log = log or (lambda s: None)
    release, dev = EDITABLE["release"], EDITABLE["version"]
    python = ensure_base(log=log)
    deps = ensure_deps_layer(wheel_requirements(release, strict=False), log=log)
    sdist = ensure_sdist(release)

    def build(final: Path) -> dict:
        # pip records absolute paths (the finder's mapping, the venv's scripts): built in place.
        final.mkdir(parents=True)
        src = final / "src"
        with tarfile.open(sdist) as tf:
            tf.extractall(final, filter="data")
        (final / f"sglang-{release}").replace(src)
        (src / "pyproject_npu.toml").replace(src / "pyproject.toml")
        (src / "PKG-INFO").unlink()            # a checkout has none; the version comes from scm
        (src / "sglang" / "_version.py").unlink()
        venv = final / "venv"
        log(f"[editable] venv {venv} on top of the base")
        run([str(python), "-m", "venv", str(venv)], "creating the editable venv")
        put_base_under(venv)
        log(f"[editable] pip install -e {src} (version {dev})")
        run(pip(venv / "bin" / "python", "install", "--no-deps", "-e", str(src)),
             f"pip install -e of the sglang {release} tree", env={"SETUPTOOLS_SCM_PRETEND_VERSION": dev})
        finders = sorted(p.name for p in site_packages(venv).glob("__editable___sglang_*_finder.py"))
        pths = sorted(p.name for p in site_packages(venv).glob("__editable__.sglang-*.pth"))
        if not finders or not pths:
            raise EnvError(f"pip install -e did not install setuptools' meta-path finder: "
                           f"{sorted(p.name for p in site_packages(venv).iterdir())}")
        return {"release": release, "version": dev, "finder": finders, "pth": pths}

    d = build_once(editable_dir(), "layered-editable", build, in_place=True)
    return ReleaseEnv(dev, d / "venv" / "bin" / "python", (deps,), editable=True)


def release_is_built(version: str) -> bool:
    """Whether every layer ``version`` runs on (the default wrapt's included) is already built."""
    if _stamp_of(base_dir()) is None or _stamp_of(layered_dir() / f"wrapt-{WRAPT_DEFAULT}-py{_python_tag()}") is None:
        return False
    if version == EDITABLE["version"]:
        if _stamp_of(editable_dir()) is None:
            return False
        version = EDITABLE["release"]
    elif _stamp_of(layered_dir() / f"sglang-{version}") is None:
        return False
    if _find_wheel(cache_dir() / "wheels", version) is None:
        return False
    key = {"base": base_dir().name, "requirements": wheel_requirements(version, strict=False),
           "layout": LAYOUT}
    return _stamp_of(_deps_dir(key)) is not None


def release_env_paths(version: str, *, wrapt: str | None = WRAPT_DEFAULT, log=None,
                      strict: bool = False) -> tuple[ReleaseEnv, list[Path]]:
    """(the release's ReleaseEnv, its PYTHONPATH entries after the shim: the wrapt layer when
    ``wrapt`` is a version, then the release's layers)."""
    rel = ensure_release(version, log=log, strict=strict)
    wrapt_layer = [ensure_wrapt(wrapt)] if wrapt is not None else []
    return rel, wrapt_layer + list(rel.layers)


def ensure_all(*, log=None) -> list[ReleaseEnv]:
    """Every release's layers, the editable install, the default wrapt layer, the zbal layer and
    the no-CANN torch_npu layer (sequentially)."""
    ensure_wrapt(WRAPT_DEFAULT)
    ensure_zbal_layer(log=log)
    ensure_torch_npu_layer(log=log)
    return [ensure_release(v, log=log) for v in ALL_RELEASES] + [ensure_editable(log=log)]


# -- memfabric-zbal: the wheel's Python files over a simulated native module --------------------------

#: The C source of the simulated native library (dev/shimdev/simzbal/zbal_native.c).
ZBAL_NATIVE_SOURCE = Path(__file__).resolve().parent / "simzbal" / "zbal_native.c"
#: The wheel's files the layer takes, byte for byte.
ZBAL_PY_FILES = ("__init__.py", "zbal_module.py", "zbal_buffer.py", "zbal_utils.py")
#: The directory MEMFABRIC_HYBRID_LIBRARY_PATH names in the layer (empty: only the native side
#: would load memfabric from it).
MEMFABRIC_DIR = "memfabric-lib"


def zbal_layer_dir() -> Path:
    key = {"zbal": ZBAL_PIN, "native": hashlib.sha256(ZBAL_NATIVE_SOURCE.read_bytes()).hexdigest(),
           "python": _python_tag(), "layout": LAYOUT, "files": list(ZBAL_PY_FILES) + ["dist-info"]}
    return layered_dir() / f"zbal-{ZBAL_PIN.split('==')[1]}-{digest(key)}"


def _compile_zbal_native(out: Path) -> str:
    """Build the simulated ``zbal.zbal`` extension and allocator library with the C compiler
    (``$CC`` or ``cc``) against this interpreter's headers; returns the command line."""
    import sysconfig

    cc = os.environ.get("CC", "cc")
    cmd = [cc, "-shared", "-fPIC", "-O1", "-Wall", "-I", sysconfig.get_paths()["include"],
           "-o", str(out), str(ZBAL_NATIVE_SOURCE)]
    run(cmd, "compiling the simulated zbal native library")
    return " ".join(cmd)


def ensure_zbal_layer(*, log=None) -> Path:
    """``CACHE/layered/zbal-1.2.0-<hash>``: the wheel's zbal/*.py unmodified and its dist-info (as
    pip installs it: the version is read from there), and in place of its native
    ``zbal.cpython-*.so`` the library compiled from ZBAL_NATIVE_SOURCE under the same name (an
    extension module and an allocator library in one file, as the real one is)."""
    import sysconfig

    wheel = ensure_zbal_wheel()

    def build(tmp: Path) -> dict:
        (log or (lambda s: None))(f"[zbal] {wheel.name}'s Python files + the simulated native library")
        package = tmp / "zbal"
        package.mkdir(parents=True)
        with zipfile.ZipFile(wheel) as zf:
            for name in ZBAL_PY_FILES:
                (package / name).write_bytes(zf.read(f"zbal/{name}"))
            # not its RECORD: that lists the real native library's hash
            zf.extractall(tmp, [n for n in zf.namelist() if n.split("/")[0].endswith(".dist-info")
                                and not n.endswith("/RECORD")])
        (tmp / MEMFABRIC_DIR).mkdir()
        command = _compile_zbal_native(package / ("zbal" + sysconfig.get_config_var("EXT_SUFFIX")))
        return {"wheel": wheel.name, "files": list(ZBAL_PY_FILES), "compiled": command}

    return build_once(zbal_layer_dir(), "layered-zbal", build)


def zbal_env(layer: Path) -> dict:
    """The variables a process using the zbal layer gets (zbal_init reads memfabric's path)."""
    return {"MEMFABRIC_HYBRID_LIBRARY_PATH": str(layer / MEMFABRIC_DIR)}


# -- torch_npu without CANN: the image where set_env.sh was not sourced --------------------------------

def ensure_torch_npu_layer(*, log=None) -> Path:
    """``CACHE/layered/torch-npu-2.13.0-py3.11``: the real torch-npu wheel unpacked as pip would
    (``--no-deps --target``; its ``torch.backends`` entry point included).  No CANN exists here, so
    with this layer on PYTHONPATH ``import torch`` fails as on an image without set_env.sh."""
    wheel = ensure_torch_npu_wheel()
    d = layered_dir() / f"torch-npu-{TORCH_NPU_PIN.split('==')[1]}-py{_python_tag()}"

    def build(tmp: Path) -> dict:
        (log or (lambda s: None))(f"[torch-npu] unpacking {wheel.name} as a layer")
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tmp)
        return {"wheel": wheel.name}

    return build_once(d, "layered-torch-npu", build)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def _versions(args: list[str], default) -> list[str]:
    vs = list(args) or list(default)
    for v in vs:
        if v != EDITABLE["version"]:
            _check_release(v)
    return vs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m shimdev.sglang_envs", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("wheels", help="download every supported release's wheel")
    p = sub.add_parser("sources", help="extract releases' sglang/ trees (default: all)")
    p.add_argument("versions", nargs="*")
    p = sub.add_parser("envs", help="build release layers (default: every release and the editable one)")
    p.add_argument("versions", nargs="*")
    p = sub.add_parser("python", help="print the python that runs a release (building its layers)")
    p.add_argument("version")
    a = ap.parse_args(argv)

    def err(s):
        print(s, file=sys.stderr, flush=True)

    try:
        if a.cmd == "wheels":
            for v in ALL_RELEASES:
                print(ensure_wheel(v))
        elif a.cmd == "sources":
            for v in _versions(a.versions, ALL_RELEASES):
                print(ensure_sources(v))
        elif a.cmd == "envs":
            ensure_wrapt(WRAPT_DEFAULT)
            for v in _versions(a.versions, ALL_RELEASES + (EDITABLE["version"],)):
                t0 = time.monotonic()
                rel = ensure_release(v, log=err)
                print(f"{v} {rel.python} {' '.join(map(str, rel.layers))} ({time.monotonic() - t0:.0f}s)",
                      flush=True)
        elif a.cmd == "python":
            print(ensure_release(a.version, log=err).python)
    except EnvError as e:
        err(f"sglang_envs: error: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
