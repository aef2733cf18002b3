"""``check`` and ``status`` on a broken NPU stack: the real torch-npu 2.13.0 wheel installed, CANN
not on the library path -- what an Ascend image shows when CANN's set_env.sh was not sourced.

There ``import torch`` itself raises ``RuntimeError: Failed to load the backend extension:
torch_npu`` (torch_npu registers the ``torch.backends`` entry point; its C extension cannot load
libhccl.so).  The environment: sglang 0.5.11's layers with the real wheel unpacked after them
(``realsglang.release_env(no_cann=True)``); no CANN exists on these machines.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile

import pytest

from npu_shim import __main__ as cli
from npu_shim.cli import check
from shimdev.envs import realsglang

RELEASE = "0.5.11"


def run(argv, shim=True):
    prefix, env = realsglang.release_command(RELEASE, no_cann=True)
    if not shim:  # the same image without npu-shim on PYTHONPATH
        env["PYTHONPATH"] = os.pathsep.join(p for p in env["PYTHONPATH"].split(os.pathsep)
                                            if p != str(realsglang.REPO))
    with tempfile.TemporaryDirectory() as cwd:
        return subprocess.run(prefix + argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_check_names_the_missing_library_and_the_fix_in_one_line(release_venv, capsys):
    release_venv(RELEASE)
    proc = run(["-m", "npu_shim", "check", "--json"])
    assert proc.returncode == cli.EXIT_PROBLEM == 4, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["imports"] == {}  # no module is tried: each would fail the same way
    problem = report["torch_problem"]
    assert (problem["kind"], problem["library"]) == ("cann", "libhccl.so")
    assert problem["error"].startswith("RuntimeError: Failed to load the backend extension: torch_npu")
    assert "Traceback" not in proc.stderr
    check.print_report(report)  # what the text form prints of that report
    lines = capsys.readouterr().out.splitlines()
    (line,) = [ln for ln in lines if "libhccl.so" in ln]
    assert line.startswith("  NPU stack BROKEN: import torch fails: torch_npu cannot load libhccl.so")
    for fix in ("set_env.sh", "LD_LIBRARY_PATH", "TORCH_DEVICE_BACKEND_AUTOLOAD=0"):
        assert fix in line
    # no cascade: nothing listed as failed, nothing else blamed
    assert not [ln for ln in lines if "FAILED" in ln or "KeyError" in ln or "RuntimeError" in ln]
    assert any(ln.startswith("  torch failed to import, torch_npu 2.13.0") for ln in lines)


def _messages(stderr):
    """A traceback's own lines (not its indented frames): the exceptions and their links."""
    return [ln for ln in stderr.splitlines() if ln and not ln.startswith(" ")]


def test_a_server_process_fails_as_it_would_without_the_shim(release_venv):
    release_venv(RELEASE)
    argv = ["-m", "sglang.launch_server", "--model-path", "/nonexistent"]
    with_shim, without = run(argv), run(argv, shim=False)
    assert with_shim.returncode == without.returncode == 1
    plain = _messages(without.stderr)
    assert plain[-1].startswith("RuntimeError: Failed to load the backend extension: torch_npu")
    assert "ImportError: libhccl.so: cannot open shared object file: No such file or directory" in plain
    ours = [ln for ln in _messages(with_shim.stderr) if not ln.startswith("[npu-shim")]
    assert ours == plain  # the same exceptions, one traceback: the shim adds none
    assert len(_messages(with_shim.stderr)) - len(ours) <= 1  # and at most one line of its own


def test_status_still_predicts_from_the_source(release_venv):
    release_venv(RELEASE)
    proc = run(["-m", "npu_shim", "status"])
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    assert "sglang: 0.5.11" in proc.stdout and "`check` does" in proc.stdout


@pytest.mark.parametrize("exc, kind, library", [
    (RuntimeError("Failed to load the backend extension: torch_npu."), "torch", None),
    (ModuleNotFoundError("No module named 'torch._C'", name="torch._C"), "torch", None),
    (OSError("libascendcl.so: cannot open shared object file: No such file or directory"), "cann",
     "libascendcl.so"),
])
def test_diagnosis_reads_the_loader_error_anywhere_in_the_chain(exc, kind, library):
    if kind == "cann":
        try:
            try:
                raise exc
            except OSError as inner:
                raise RuntimeError("Failed to load the backend extension: torch_npu") from inner
        except RuntimeError as outer:
            exc = outer
    found = check.diagnose_torch_error(exc)
    assert found["kind"] == kind and found.get("library") == library
    assert found["text"].startswith("import torch fails: ")
    if kind == "cann":
        assert check.CANN_FIX in found["text"] and library in found["text"]


@pytest.mark.parametrize("problem, env, code", [
    ({"kind": "cann", "text": "t"}, {}, 4),  # the line names the fix; a problem like any other
    ({"kind": "torch", "text": "t"}, {}, 4),
    ({"kind": "cann", "text": "t"}, {"SGLANG_ZBAL_LOCAL_MEM_SIZE": "12G"}, 2),  # a bad variable first
])
def test_exit_codes(monkeypatch, capsys, problem, env, code):
    report = {"pid": 1, "python": "3.11.7", "shim_active": True, "sitecustomize": "s", "imports": {},
              "states": {}, "wrapped": {}, "wrapt": {"text": "w"}, "sglang": {"path": None, "version": None},
              "bundle": {"ok": True, "text": "b"}, "zbal": {"text": "z"},
              "npu": {"torch": None, "torch_npu": "/x", "torch_npu_version": "2.13.0", "npu_available": False,
                      "npu_count": 0},
              "kernel": {"text": "k"}, "seconds": 1.0, "torch_problem": problem}
    monkeypatch.setattr(check, "run_child", lambda: (report, None))
    for name in list(os.environ):
        if name.startswith(("NPU_SHIM_", "SGLANG_")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["check"]) == code
    assert capsys.readouterr().out.count("BROKEN") == 1
