#!/usr/bin/env python3
"""Test bed: the layered environments the sglang releases run in, and the one import of the test
bed's names.

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

The rest of the test bed, each a module of its own, is re-exported here (``__all__``), so that a
caller imports the test bed once (``from shimdev.envs import sglang_envs``):

* ``shimdev.envs.releases`` -- ``RELEASES`` / ``POST_RELEASES`` / ``ALL_RELEASES`` (add one line to
  support one more), ``EDITABLE``, ``version_key``;
* ``shimdev.envs.buildcache`` -- ``cache_dir()`` (``$NPU_SHIM_CACHE`` or ``~/.cache/npu-shim``), file
  locks, pip runs, ``build_once`` (content-addressed, stamped last: a changed pin gives a new
  directory, so a build never replaces an environment another process is running in);
* ``shimdev.envs.wheels`` -- ``ensure_wheel(v)`` (the sglang wheel in ``CACHE/wheels``),
  ``ensure_sources(v)`` (its ``sglang/`` tree in ``CACHE/src/<v>/``), the sdist, the pinned
  memfabric-zbal and torch-npu wheels;
* ``shimdev.envs.npu_layers`` -- the zbal layer (the wheel's Python files over the simulated native
  library) and the no-CANN torch-npu layer.

CLI::

    PYTHONPATH=dev python3 -m shimdev.envs.sglang_envs wheels           # download every release's wheel
    PYTHONPATH=dev python3 -m shimdev.envs.sglang_envs sources [V ...]  # extract sources (default: all)
    PYTHONPATH=dev python3 -m shimdev.envs.sglang_envs envs [V ...]     # build layers (default: all + editable)
    PYTHONPATH=dev python3 -m shimdev.envs.sglang_envs python V         # print the python that runs release V

Part of ``shimdev`` (dev/shimdev/): imported as ``from shimdev.envs import sglang_envs`` with ``dev/`` on
sys.path (see shimdev/__init__.py), never by file path.
"""
from __future__ import annotations

import argparse
import email.parser
import json
import os
import re
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from typing import NamedTuple

from shimdev.envs.buildcache import (LAYOUT, TORCH_PIN, EnvError, build_once, cache_dir, constraints_file, digest,
                                file_lock, layered_dir, pip, python_tag, run, stamp_of)
from shimdev.envs.npu_layers import ZBAL_PY_FILES, ensure_torch_npu_layer, ensure_zbal_layer, zbal_env
from shimdev.envs.releases import ALL_RELEASES, EDITABLE, POST_RELEASES, RELEASES, check_release, version_key
from shimdev.envs.wheels import (ensure_sdist, ensure_sources, ensure_torch_npu_wheel, ensure_wheel, ensure_zbal_wheel,
                            find_wheel)

__all__ = [
    # the releases (shimdev.envs.releases)
    "RELEASES", "POST_RELEASES", "ALL_RELEASES", "EDITABLE", "version_key",
    # the cache and its builds (shimdev.envs.buildcache)
    "EnvError", "LAYOUT", "TORCH_PIN", "cache_dir", "layered_dir", "file_lock", "run", "pip", "constraints_file",
    "digest", "build_once",
    # wheels and sources (shimdev.envs.wheels)
    "ensure_wheel", "ensure_sources", "ensure_sdist", "ensure_zbal_wheel", "ensure_torch_npu_wheel",
    # the NPU stack's layers (shimdev.envs.npu_layers)
    "ZBAL_PY_FILES", "ensure_zbal_layer", "zbal_env", "ensure_torch_npu_layer",
    # the layered environments (here)
    "WRAPT_DEFAULT", "COMMON_DEPS", "BASE_PINS", "LAYER_REQUIREMENTS", "NODEPS_REQUIREMENTS", "NEVER_IN_LAYERS",
    "base_spec", "base_dir", "base_python", "site_packages", "ensure_base", "ensure_wrapt", "ensure_sglang_layer",
    "wheel_requirements", "ensure_deps_layer", "ReleaseEnv", "ensure_release", "editable_dir", "put_base_under",
    "ensure_editable", "release_is_built", "release_env_paths", "ensure_all", "main",
]


# --------------------------------------------------------------------------------------------
# Configuration of the layers
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# Layered environments
# --------------------------------------------------------------------------------------------

# -- the base ---------------------------------------------------------------------------------

def base_spec() -> dict:
    return {"layout": LAYOUT, "python": python_tag(), "torch": TORCH_PIN, "common": list(COMMON_DEPS),
            "pins": list(BASE_PINS)}


def base_dir() -> Path:
    return layered_dir() / f"base-{digest(base_spec())}"


def base_python() -> Path:
    return base_dir() / "bin" / "python"


def site_packages(prefix: Path) -> Path:
    return prefix / "lib" / f"python{python_tag()}" / "site-packages"


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
    d = layered_dir() / f"wrapt-{version}-py{python_tag()}"

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
    check_release(version, strict)
    python = ensure_base(log=log)
    sglang = ensure_sglang_layer(version, strict=strict, log=log)
    deps = ensure_deps_layer(wheel_requirements(version, strict=strict), log=log)
    return ReleaseEnv(version, python, (sglang, deps))


# -- the editable install --------------------------------------------------------------------------

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
    if stamp_of(base_dir()) is None or stamp_of(layered_dir() / f"wrapt-{WRAPT_DEFAULT}-py{python_tag()}") is None:
        return False
    if version == EDITABLE["version"]:
        if stamp_of(editable_dir()) is None:
            return False
        version = EDITABLE["release"]
    elif stamp_of(layered_dir() / f"sglang-{version}") is None:
        return False
    if find_wheel(cache_dir() / "wheels", version) is None:
        return False
    key = {"base": base_dir().name, "requirements": wheel_requirements(version, strict=False),
           "layout": LAYOUT}
    return stamp_of(_deps_dir(key)) is not None


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


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def _versions(args: list[str], default) -> list[str]:
    vs = list(args) or list(default)
    for v in vs:
        if v != EDITABLE["version"]:
            check_release(v)
    return vs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m shimdev.envs.sglang_envs", description=__doc__.split("\n\n")[0])
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
