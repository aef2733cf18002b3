"""npu_shim/runtime/off.py: what a process where the shim is switched off (``NPU_SHIM_ENABLED=0``)
says at ``import sglang``, in this process (the whole start-up path in a fresh interpreter:
tests/test_bootstrap.py)."""

import logging

import pytest

from npu_shim.reporting import log, procinfo
from npu_shim.runtime import off


@pytest.fixture
def quiet_state(monkeypatch):
    """The process-wide state say_off writes (the sglang version the log tag carries, the error
    keys already reported), restored afterwards."""
    monkeypatch.setattr(procinfo, "_sglang_version", None)
    monkeypatch.setattr(log, "_reported", set())
    log.configure()  # sets the logger's level once per process: before caplog lowers it


def _sglang(tmp_path, monkeypatch, version='__version__ = "0.5.11"\n'):
    """An sglang of the test's own first on sys.path (and none imported)."""
    package = tmp_path / "site" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "version.py").write_text(version)
    monkeypatch.delitem(__import__("sys").modules, "sglang", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return str(package)


def _lines(caplog):
    return [(r.levelname, r.getMessage(), getattr(r, "npu_shim", None)) for r in caplog.records]


def test_off_says_one_line_and_notes_the_version(tmp_path, monkeypatch, caplog, quiet_state):
    _sglang(tmp_path, monkeypatch)
    monkeypatch.setenv("NPU_SHIM_ENABLED", " 0 ")
    with caplog.at_level(logging.DEBUG, logger="npu_shim"):
        assert off.say_off() is None
    assert _lines(caplog) == [("INFO", "off (NPU_SHIM_ENABLED=0): sglang is not patched in this process",
                               {"event": "off"})]
    assert procinfo.sglang_version() == "0.5.11"  # every later line's tag names it


def test_off_without_sglang_to_be_found_still_says_so(monkeypatch, caplog, quiet_state):
    """Called by the watcher, so an sglang is being imported; if no finder can place it (or the
    variable is gone by then) the line still says off."""
    monkeypatch.setattr(off, "find_package_dir", lambda name: None)
    monkeypatch.delenv("NPU_SHIM_ENABLED", raising=False)
    with caplog.at_level(logging.DEBUG, logger="npu_shim"):
        off.say_off()
    assert _lines(caplog) == [("INFO", "off (NPU_SHIM_ENABLED=): sglang is not patched in this process",
                               {"event": "off"})]
    assert procinfo.sglang_version() is None


def test_off_notes_no_version_an_sglang_does_not_state(tmp_path, monkeypatch, caplog, quiet_state):
    _sglang(tmp_path, monkeypatch, version="")
    monkeypatch.setenv("NPU_SHIM_ENABLED", "0")
    with caplog.at_level(logging.DEBUG, logger="npu_shim"):
        off.say_off()
    assert procinfo.sglang_version() is None
    assert [line[1] for line in _lines(caplog)] == ["off (NPU_SHIM_ENABLED=0): sglang is not patched in this process"]


def test_off_that_fails_says_why_once_and_never_raises(monkeypatch, caplog, quiet_state):
    """It runs inside the import hook of the application's ``import sglang``."""
    def broken(name):
        raise RuntimeError("finder broke on %s" % name)

    monkeypatch.setattr(off, "find_package_dir", broken)
    with caplog.at_level(logging.DEBUG, logger="npu_shim"):
        assert off.say_off() is None
        assert off.say_off() is None
    assert _lines(caplog) == [("ERROR", "shim off; could not say more: RuntimeError('finder broke on sglang')",
                               None)]
    assert log._reported == {"off"}  # the key of that one error


def test_off_that_cannot_even_log_stays_silent(monkeypatch, caplog, quiet_state):
    def broken(*args, **kwargs):
        raise RuntimeError("no logging")

    monkeypatch.setattr(off, "find_package_dir", broken)
    monkeypatch.setattr(log, "error_once", broken)
    with caplog.at_level(logging.DEBUG, logger="npu_shim"):
        assert off.say_off() is None
    assert caplog.records == []
