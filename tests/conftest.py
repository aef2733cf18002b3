"""Session fixtures shared by npu-shim's tests.

* the tests mirror the package: ``tests/<room>/test_<module>.py`` (``core``, ``reporting``, ``source``,
  ``runtime``, ``patches``, ``cli``), the dev tooling's own tests in ``tests/dev/``, the whole
  shim's (drop-in, bootstrap, hostile inputs, the layering) here.  The folders have no
  ``__init__.py``: each is put on sys.path, so a test module imports another's helpers by its
  name (``from test_bootstrap import run``) wherever it lives; names are unique across folders.
* ``dev/`` is put on sys.path: the dev tooling is imported as ``shimdev.<module>`` (simnpu,
  realsglang, ...; dev/shimdev/__init__.py); the zbal layer (memfabric-zbal 1.2.0's own Python
  files over the simulated native module, shimdev/simzbal) only by tests that want ``import zbal``
  (fixture ``zbal_pkg``).
* ``release_venv(version)`` builds/reuses a release's layered environment through
  shimdev.sglang_envs and returns the python that runs it; an environment that cannot be built
  FAILS the test (never skips).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
DEV = TESTS.parent / "dev"
for _folder in [DEV, TESTS] + sorted(p for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

from shimdev import realsglang  # noqa: E402 - after dev/ is put on sys.path

try:  # the property tests' settings (hypothesis is in the runner venv, dev/shimdev/runner.py)
    from hypothesis import HealthCheck, settings as _hypothesis_settings
except ImportError:  # a test that imports hypothesis then fails at its import, as it should
    pass
else:
    # No deadline (the cores are shared: a slow example is no bug) and no example database in the
    # working tree; every run draws new examples, so each run searches further.
    _hypothesis_settings.register_profile("npu-shim", deadline=None, database=None, max_examples=300,
                                          suppress_health_check=[HealthCheck.too_slow])
    _hypothesis_settings.load_profile("npu-shim")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "another_python: runs the shim's code in a Python other than the test's own (a release's, a "
        "bare venv's, one started with -S); mutation runs leave these out, as mutmut's mutants import mutmut "
        "and that Python has none (pyproject.toml [tool.mutmut])")


@pytest.fixture(autouse=True)
def _environ_restored():
    """Each test leaves ``os.environ`` as it found it.  The shim writes to the environment by design
    (zbal's ``ZBAL_ENABLE_GRAPH``, the inherited source answers) and the servers the suite starts
    inherit this process's environment, so a variable one test's shim left behind would change what a
    later server in the same worker does."""
    saved = dict(os.environ)
    yield
    for name in [k for k in os.environ if k not in saved]:
        del os.environ[name]
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


@pytest.fixture(scope="session")
def release_venv():
    """Callable ``release_venv(version) -> Path`` of the release's python (built once per session)."""
    cache: dict[str, Path] = {}

    def get(version: str) -> Path:
        if version not in cache:
            try:
                cache[version] = realsglang.release_python(version)
            except realsglang.sglang_envs.EnvError as e:
                pytest.fail(f"could not provide the sglang {version} environment: {e}", pytrace=False)
        return cache[version]

    return get


@pytest.fixture(scope="session")
def sim():
    """simnpu installed in this (outer) test process; state reset by ``simnpu_clean``."""
    from shimdev import simnpu

    if simnpu.installed() is None:
        simnpu.install()
    return simnpu


@pytest.fixture
def simnpu_clean(sim):
    sim.reset()
    yield sim
    sim.reset()


@pytest.fixture(scope="session")
def zbal_pkg(sim):
    """``zbal`` imported in this process (after simnpu): the wheel's Python files from the zbal
    layer, its native module the simulated one (``shimdev.simzbal`` drives it)."""
    import os

    try:
        layer = realsglang.sglang_envs.ensure_zbal_layer()
    except realsglang.sglang_envs.EnvError as e:
        pytest.fail(f"could not build the zbal layer: {e}", pytrace=False)
    if str(layer) not in sys.path:
        sys.path.insert(0, str(layer))
    os.environ.update(realsglang.sglang_envs.zbal_env(layer))
    import zbal

    assert Path(zbal.__file__).parent == layer / "zbal", f"'import zbal' did not give the layer's: {zbal!r}"
    return zbal


@pytest.fixture(scope="session")
def built_bundle(tmp_path_factory):
    """A bundle built once per test run by the real command (``python -m npu_shim bundle``, wrapt
    wheels from PyPI), shared by the xdist workers (their base temp dirs are siblings)."""
    import fcntl
    import os
    import subprocess

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    out = shared / "npu-shim-bundle" / "npu-shim"
    repo = str(Path(__file__).resolve().parent.parent)
    with open(str(shared / "npu-shim-bundle.lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "MANIFEST").is_file():
            proc = subprocess.run([sys.executable, "-m", "npu_shim", "bundle", str(out), "--force"],
                                  cwd=repo, env=dict(os.environ, PYTHONPATH=repo),
                                  capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                pytest.fail("python -m npu_shim bundle failed:\n%s" % proc.stderr[-3000:], pytrace=False)
    return out
