"""The repository root is on users' PYTHONPATH: only ``sitecustomize`` and ``npu_shim`` may be
importable from it.  The dev tooling lives in ``dev/shimdev`` and is imported one way
(``shimdev.<module>`` with ``dev/`` on sys.path), never by file path."""
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: setup.py is importable as ``setup`` in principle, but pip needs it at the root; every other
#: top-level module or regular package would shadow a user's own.
ALLOWED = {"sitecustomize", "npu_shim", "setup"}


def test_the_repository_root_exposes_only_the_shim():
    found = {m.name for m in pkgutil.iter_modules([str(REPO)])}
    assert found <= ALLOWED, sorted(found - ALLOWED)
    assert {"sitecustomize", "npu_shim"} <= found
    # no regular package at the root but npu_shim (a folder with __init__.py)
    packages = sorted(p.name for p in REPO.iterdir() if (p / "__init__.py").exists())
    assert packages == ["npu_shim"], packages


def test_dev_tooling_is_not_importable_from_the_root():
    code = ("import importlib.util, json\n"
            "print(json.dumps({n: importlib.util.find_spec(n) is not None for n in "
            "('shimdev', 'simnpu', 'realsglang', 'sglang_envs', 'zbal', 'demo_features')}))")
    env = {"PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "NPU_SHIM_ENABLED": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd="/",
                         capture_output=True, text=True, timeout=120, check=True)
    assert '"shimdev": false' in out.stdout and "true" not in out.stdout, out.stdout


def _python_files():
    for top in ("scripts", "tests", "dev"):
        yield from (REPO / top).rglob("*.py")


def test_nothing_loads_a_script_by_path_and_no_test_imports_a_benchmark():
    for path in _python_files():
        if path == Path(__file__).resolve():
            continue
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(REPO)
        assert "spec_from_file_location" not in text, rel
        assert not re.search(r"\bsglang_envs\._\w+\(", text), rel  # private names of the env code
        if rel.parts[0] in ("tests", "dev"):
            assert not re.search(r"^\s*(import|from)\s+bench_", text, re.M), rel
        # the old locations and the old double import are gone
        assert "tests/support" not in text and "npu_shim_sglang_envs" not in text, rel
        assert not re.search(r"^\s*import ([\w, ]*\b)?(simnpu|realsglang|sglang_envs|demo_features|expected_states"
                             r"|mla_kernels|dual_stream_kernels|import_probe|drop_in_probe|release_beds)\b",
                             text, re.M), rel


def test_no_init_py_makes_a_packaging_folder_of_the_tooling():
    for top in ("scripts", "tests", "dev"):
        assert not (REPO / top / "__init__.py").exists(), top
