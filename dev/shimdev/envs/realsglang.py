"""Run code against a real sglang release, in its layered environment, with the simulated NPU.

``run_in_release("0.5.11", "from sglang.srt.utils import is_npu\\nemit({'npu': is_npu()})")``
builds/reuses the release's layers (shimdev/envs/sglang_envs.py: one base venv with torch and no wrapt,
the release's sglang and dependency layers, a wrapt layer), runs the snippet in a fresh
interpreter of the base venv with ``PYTHONPATH=<repo root>:<dev>:<wrapt layer>:<release
layers>`` (repo root first, so the shim's sitecustomize.py is active exactly as for a user),
``simnpu.install(release=...)`` done before the snippet, and returns the JSON the snippet passed
to ``emit(obj)`` (the last stdout line).

For running other commands there (``python -m npu_shim status``, processes that spawn children):
``release_command(version, ...)`` gives the argv prefix and env; ``release_env(...)`` the env.
``wrapt=None`` runs a release the way a real Ascend image is (no wrapt importable);
``wrapt="1.14.1"`` with that wrapt; ``shim_root=DIR`` puts DIR first instead of the repo root.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import textwrap
from pathlib import Path

from shimdev import DEV, REPO


from shimdev.envs import sglang_envs
class ReleaseRunError(AssertionError):
    """The snippet failed (or emitted nothing); carries its stdout/stderr."""

    def __init__(self, msg: str, stdout: str = "", stderr: str = "", returncode: int | None = None):
        super().__init__(msg)
        self.stdout, self.stderr, self.returncode = stdout, stderr, returncode


_PRELUDE = """\
from shimdev import simnpu
simnpu.install(release={release!r})
from shimdev.programs import emit
"""

#: What runs a program of shimdev.programs (run_program): as ``__main__``, with its arguments.
_PROGRAM = """\
import json, runpy, sys
sys.argv[1:] = [json.dumps(a) for a in {args!r}]
runpy.run_module("shimdev.programs.{name}", run_name="__main__", alter_sys=True)
"""


#: Releases the real-import matrix covers: every release of the table and the editable install.
IMPORT_MATRIX = sglang_envs.ALL_RELEASES + (sglang_envs.EDITABLE["version"],)
#: The editable install's version string (a setuptools-scm dev version) and the release it is.
EDITABLE_VERSION = sglang_envs.EDITABLE["version"]
WRAPT_DEFAULT = sglang_envs.WRAPT_DEFAULT


def table_release(version: str) -> str:
    """The row of the expected table ``version`` runs as (the editable install: its sdist's)."""
    return sglang_envs.EDITABLE["release"] if version == EDITABLE_VERSION else version


def release_python(version: str) -> Path:
    """The python that runs ``version`` (its layers built when missing; raises
    sglang_envs.EnvError).  The base venv's python, or the editable install's venv."""
    return sglang_envs.ensure_release(version, strict=False).python


def release_env(env: dict | None = None, *, version: str | None = None, zbal: bool = False,
                shim_enabled: bool | None = None, wrapt: str | None = WRAPT_DEFAULT,
                shim_root: str | os.PathLike = REPO, no_cann: bool = False) -> dict:
    """The environment a release subprocess gets: the inherited env, ``PYTHONPATH`` =
    ``shim_root``, dev/ (shimdev), [the zbal layer], [the wrapt layer], [the release's layers],
    then the overrides in ``env`` (value None removes a variable).

    version      -- put that release's layers on PYTHONPATH (building them when missing); None:
                    no sglang (e.g. for a process that must not import it).
    wrapt        -- a wrapt version: its layer is on PYTHONPATH; None: wrapt is not importable
                    (the base environment has none, as a real Ascend image).
    shim_root    -- the directory first on PYTHONPATH in place of the repo root (a built bundle).
    no_cann      -- the real torch-npu wheel last on PYTHONPATH and no CANN anywhere: an image where
                    CANN's set_env.sh was not sourced (``import torch`` fails through torch_npu's
                    ``torch.backends`` entry point).
    """
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    zbal_layer = sglang_envs.ensure_zbal_layer() if zbal else None
    path = [str(shim_root), str(DEV)] + ([str(zbal_layer)] if zbal else [])
    if version is not None:
        _, layers = sglang_envs.release_env_paths(version, wrapt=wrapt)
    else:
        layers = [sglang_envs.ensure_wrapt(wrapt)] if wrapt is not None else []
    path += [str(p) for p in layers]
    if no_cann:
        path.append(str(sglang_envs.ensure_torch_npu_layer()))
    e["PYTHONPATH"] = os.pathsep.join(path)
    e.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    e["PYTHONHASHSEED"] = "0"
    e.pop("PYTHONUSERBASE", None)
    e["PYTHONNOUSERSITE"] = "1"  # nothing from ~/.local (a wrapt there would defeat wrapt=None)
    if zbal_layer is not None:
        e.update(sglang_envs.zbal_env(zbal_layer))
    if shim_enabled is not None:
        e["NPU_SHIM_ENABLED"] = "1" if shim_enabled else "0"
    if env:
        for k, v in env.items():
            if v is None:
                e.pop(k, None)
            else:
                e[k] = str(v)
    return e


def release_command(version: str, env: dict | None = None, *, zbal: bool = False,
                    shim_enabled: bool | None = None, wrapt: str | None = WRAPT_DEFAULT,
                    shim_root: str | os.PathLike = REPO, no_cann: bool = False) -> tuple[list[str], dict]:
    """``(argv prefix, env)`` to run any command in release ``version``, e.g.
    ``argv, env = release_command("0.5.11", wrapt=None)``;
    ``subprocess.run(argv + ["-m", "npu_shim", "status"], env=env)``.  The prefix is
    ``[python]`` (the base venv's, or the editable install's); children it spawns inherit the env.
    Same keywords as release_env().  The simulated NPU is NOT installed (dev/ is on the
    path: ``from shimdev import simnpu; simnpu.install(release=...)`` where a process needs it)."""
    python = release_python(version)
    return [str(python)], release_env(env, version=version, zbal=zbal, shim_enabled=shim_enabled,
                                      wrapt=wrapt, shim_root=shim_root, no_cann=no_cann)


def run_in_release(version: str, code: str, env: dict | None = None, timeout: float = 600, *,
                   zbal: bool = False, shim_enabled: bool | None = None,
                   install_sim: bool = True, wrapt: str | None = WRAPT_DEFAULT,
                   shim_root: str | os.PathLike = REPO) -> dict:
    """Run ``code`` in sglang ``version``; return what it ``emit()``-ed last (JSON).

    env          -- extra/overriding env vars (value None removes one); e.g. SIMNPU_FREE_MIB.
    zbal         -- put the zbal layer on PYTHONPATH (``import zbal``: the wheel's Python files over
                    the simulated native module, shimdev/simzbal).
    shim_enabled -- set NPU_SHIM_ENABLED to 1/0 (None: inherit).
    install_sim  -- False skips ``simnpu.install()`` (the snippet does it itself).
    wrapt        -- wrapt version on PYTHONPATH (default the pinned one); None: no wrapt at all.
    shim_root    -- the directory first on PYTHONPATH instead of the repo root.
    Raises ReleaseRunError (an AssertionError) with stdout/stderr on failure.
    """
    argv, run_env = release_command(version, env, zbal=zbal, shim_enabled=shim_enabled, wrapt=wrapt,
                                    shim_root=shim_root)
    prelude = _PRELUDE.format(release=version)
    if not install_sim:
        prelude = prelude.replace("simnpu.install(release={!r})\n".format(version), "")
    script = prelude + "\n" + textwrap.dedent(code)
    with tempfile.TemporaryDirectory(prefix="npu-shim-run-") as cwd:
        try:
            p = subprocess.run(argv + ["-c", script], cwd=cwd, env=run_env, stdout=subprocess.PIPE,
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


def run_program(version: str, name: str, *args, **kwargs) -> dict:
    """Run the program ``shimdev.programs.<name>`` (dev/shimdev/programs/) in sglang ``version``
    as ``run_in_release`` runs a snippet (same keywords), with ``args`` (JSON values) its
    arguments; return what it ``emit()``-ed last."""
    if not name.isidentifier():
        raise ValueError("not a program's name: %r" % (name,))
    return run_in_release(version, _PROGRAM.format(name=name, args=list(args)), **kwargs)


def _s(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _tail(s: str, n: int = 60) -> str:
    return "\n".join(s.splitlines()[-n:])
