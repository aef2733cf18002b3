"""Run code against a real sglang release, in that release's venv, with the simulated NPU.

``run_in_release("0.5.11", "from sglang.srt.utils import is_npu\\nemit({'npu': is_npu()})")``
builds/reuses the venv (scripts/sglang_envs.py), runs the snippet in a fresh interpreter with
``PYTHONPATH=<repo root>:<tests/support>`` (repo root first, so the shim's sitecustomize.py is
active exactly as for a user), ``simnpu.install(release=...)`` done before the snippet, and returns
the JSON the snippet passed to ``emit(obj)`` (the last stdout line).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
REPO = TESTS.parent
FAKE_ZBAL = SUPPORT / "fake_zbal"

#: Releases the real-import matrix covers (each has a venv recipe in scripts/sglang_envs.py).
IMPORT_MATRIX = ("0.5.9", "0.5.11", "0.5.19", "0.5.23")


def _load_envs():
    mod = sys.modules.get("npu_shim_sglang_envs")
    if mod is None:
        # scripts/ has no __init__.py on purpose (it must not shadow an image's "scripts").
        spec = importlib.util.spec_from_file_location("npu_shim_sglang_envs",
                                                      REPO / "scripts" / "sglang_envs.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return mod


sglang_envs = _load_envs()


class ReleaseRunError(AssertionError):
    """The snippet failed (or emitted nothing); carries its stdout/stderr."""

    def __init__(self, msg: str, stdout: str = "", stderr: str = "", returncode: int | None = None):
        super().__init__(msg)
        self.stdout, self.stderr, self.returncode = stdout, stderr, returncode


_PRELUDE = """\
import json as _json, sys as _sys
import simnpu
simnpu.install(release={release!r})
def emit(obj):
    _sys.stdout.write("\\n" + _json.dumps(obj, default=repr, sort_keys=True) + "\\n")
    _sys.stdout.flush()
"""


def release_python(version: str) -> Path:
    """The venv python for ``version`` (built when missing; raises sglang_envs.EnvError)."""
    return sglang_envs.ensure_venv(version)


def release_env(env: dict | None = None, *, zbal: bool = False, shim_enabled: bool | None = None) -> dict:
    """The environment a release subprocess gets (inherited env, PYTHONPATH set, overrides)."""
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    path = [str(REPO), str(SUPPORT)] + ([str(FAKE_ZBAL)] if zbal else [])
    e["PYTHONPATH"] = os.pathsep.join(path)
    e.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    e["PYTHONHASHSEED"] = "0"
    if shim_enabled is not None:
        e["NPU_SHIM_ENABLED"] = "1" if shim_enabled else "0"
    if env:
        for k, v in env.items():
            if v is None:
                e.pop(k, None)
            else:
                e[k] = str(v)
    return e


def run_in_release(version: str, code: str, env: dict | None = None, timeout: float = 600, *,
                   zbal: bool = False, shim_enabled: bool | None = None,
                   install_sim: bool = True) -> dict:
    """Run ``code`` in sglang ``version``'s venv; return what it ``emit()``-ed last (JSON).

    env          -- extra/overriding env vars (value None removes one); e.g. SIMNPU_FREE_MIB.
    zbal         -- put tests/support/fake_zbal on PYTHONPATH (``import zbal`` gets the fake).
    shim_enabled -- set NPU_SHIM_ENABLED to 1/0 (None: inherit).
    install_sim  -- False skips ``simnpu.install()`` (the snippet does it itself).
    Raises ReleaseRunError (an AssertionError) with stdout/stderr on failure.
    """
    python = release_python(version)
    prelude = _PRELUDE.format(release=version)
    if not install_sim:
        prelude = prelude.replace("simnpu.install(release={!r})\n".format(version), "")
    script = prelude + "\n" + textwrap.dedent(code)
    with tempfile.TemporaryDirectory(prefix="npu-shim-run-") as cwd:
        try:
            p = subprocess.run([str(python), "-c", script], cwd=cwd, env=release_env(env, zbal=zbal,
                               shim_enabled=shim_enabled), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise ReleaseRunError(f"sglang {version}: snippet timed out after {timeout}s",
                                  _s(e.stdout), _s(e.stderr)) from None
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    if p.returncode != 0 or not lines:
        raise ReleaseRunError(
            f"sglang {version}: snippet exited {p.returncode}"
            f"{'' if lines else ' without emit()'}\n--- stdout (tail) ---\n{_tail(p.stdout)}"
            f"\n--- stderr (tail) ---\n{_tail(p.stderr)}", p.stdout, p.stderr, p.returncode)
    try:
        return json.loads(lines[-1])
    except ValueError:
        raise ReleaseRunError(
            f"sglang {version}: last stdout line is not JSON (call emit(obj) last): {lines[-1][:300]!r}"
            f"\n--- stderr (tail) ---\n{_tail(p.stderr)}", p.stdout, p.stderr, p.returncode) from None


def _s(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _tail(s: str, n: int = 60) -> str:
    return "\n".join(s.splitlines()[-n:])
