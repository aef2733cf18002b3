"""Session fixtures shared by npu-shim's tests.

* ``tests/support`` is put on sys.path (simnpu, realsglang); ``tests/support/fake_zbal`` only by
  tests that want ``import zbal`` (fixture ``fake_zbal``).
* ``release_venv(version)`` builds/reuses a release's layered environment through
  scripts/sglang_envs.py and returns the python that runs it; an environment that cannot be built
  FAILS the test (never skips).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

SUPPORT = Path(__file__).resolve().parent / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))

import realsglang  # noqa: E402


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
    import simnpu

    if simnpu.installed() is None:
        simnpu.install()
    return simnpu


@pytest.fixture
def simnpu_clean(sim):
    sim.reset()
    yield sim
    sim.reset()


@pytest.fixture(scope="session")
def fake_zbal(sim):
    """The fake ``zbal`` package, importable in this process (after simnpu)."""
    path = str(SUPPORT / "fake_zbal")
    if path not in sys.path:
        sys.path.insert(0, path)
    import zbal

    assert getattr(zbal, "FAKE", None) is not None, f"'import zbal' did not give the fake: {zbal!r}"
    return zbal
