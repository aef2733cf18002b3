"""The fake zbal (dev/shimdev/fake_zbal) mirrors memfabric-zbal 1.2.0's Python API.

The real wheel is downloaded (pip download --no-deps, cached) and its .py files are read with
``ast`` -- never imported (the native zbal.cpython-311-x86_64-linux-gnu.so needs CANN + a device).

What can be checked, precisely:
* zbal/__init__.py, zbal_module.py, zbal_buffer.py, zbal_utils.py: every public top-level name
  (defs, classes, assignments, imports), ``__all__``, and the signature (parameter names, kinds,
  defaults, annotations) of every top-level function and every method of every class.
* The native module ``zbal.zbal`` and its submodules ``allocator`` / ``deepep_adaptor``: only that
  the names the .py files import from them exist as NUL-terminated strings in the .so (pybind11
  registration names; the linker tail-merges strings, so "get_heap_stats" is found as the tail of
  "sma_get_heap_stats", hence a suffix match).  Their signatures, their other members, and whether
  e.g. ``is_mix_alloc`` lives in ``allocator`` rather than elsewhere cannot be checked from the
  wheel: the .py imports (``from zbal.zbal.allocator import ... is_mix_alloc``) are the evidence.
"""
from __future__ import annotations

import ast
import re
import zipfile
from pathlib import Path

import pytest

from shimdev import FAKE_ZBAL, realsglang

FAKE_ROOT = FAKE_ZBAL / "zbal"
PY_MODULES = ["__init__.py", "zbal_module.py", "zbal_buffer.py", "zbal_utils.py"]
#: Extra public names the fake may have (test knobs), per module.
FAKE_EXTRAS = {"__init__.py": {"FAKE", "CALLS", "reset_fake"}, "zbal_module.py": {"FAKE", "recorded"},
               "zbal_buffer.py": {"recorded"}}
#: Names the zbal feature of the shim uses (sglang 0.5.12+ upstream uses the same).
FEATURE_NAMES = {"__init__.py": {"zbal_init", "switch_to_allocator", "is_mix_alloc", "mem_get_info"},
                 "zbal_buffer.py": {"Buffer"}}


@pytest.fixture(scope="module")
def real_wheel():
    try:
        whl = realsglang.sglang_envs.ensure_zbal_wheel()
    except realsglang.sglang_envs.EnvError as e:
        pytest.fail(f"cannot get the real memfabric-zbal wheel: {e}", pytrace=False)
    with zipfile.ZipFile(whl) as zf:
        files = {n.split("/", 1)[1]: zf.read(n) for n in zf.namelist() if n.startswith("zbal/")}
    return files


def _public_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                names.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    names.add(t.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_") or n in ("__version__", "__all__")}


def _sig(fn: ast.FunctionDef) -> tuple:
    a = fn.args
    u = lambda n: ast.unparse(n) if n is not None else None  # noqa: E731
    pos = [(x.arg, u(x.annotation)) for x in a.posonlyargs + a.args]
    defaults = [u(d) for d in a.defaults]
    return (
        tuple(pos), tuple(defaults),
        (a.vararg.arg if a.vararg else None), (a.kwarg.arg if a.kwarg else None),
        tuple((x.arg, u(x.annotation)) for x in a.kwonlyargs), tuple(u(d) for d in a.kw_defaults),
        u(fn.returns),
        tuple(sorted(ast.unparse(d) for d in fn.decorator_list if ast.unparse(d) in
                     ("staticmethod", "classmethod", "property"))),
    )


def _signatures(tree: ast.Module) -> dict[str, tuple]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            out[node.name] = _sig(node)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and (not item.name.startswith("_")
                                                          or item.name == "__init__"):
                    out[f"{node.name}.{item.name}"] = _sig(item)
    return out


def _all(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    return None


@pytest.mark.parametrize("module", PY_MODULES)
def test_public_names_match(real_wheel, module):
    real = ast.parse(real_wheel[module])
    fake = ast.parse((FAKE_ROOT / module).read_text())
    r, f = _public_names(real), _public_names(fake) - FAKE_EXTRAS.get(module, set())
    assert sorted(r - f) == [], f"{module}: fake lacks real names"
    assert sorted(f - r) == [], f"{module}: fake has names the real one has not"
    assert _all(real) == _all(fake)


@pytest.mark.parametrize("module", PY_MODULES)
def test_signatures_match(real_wheel, module):
    real = _signatures(ast.parse(real_wheel[module]))
    fake = _signatures(ast.parse((FAKE_ROOT / module).read_text()))
    assert sorted(real) == sorted(fake), f"{module}: functions/methods differ"
    for name in real:
        assert fake[name] == real[name], f"{module}: signature of {name} differs"


def test_feature_names_exist_in_real_sources(real_wheel):
    for module, names in FEATURE_NAMES.items():
        have = _public_names(ast.parse(real_wheel[module]))
        assert names <= have, f"{module}: missing {names - have}"
    # Config comes from the native submodule deepep_adaptor, imported by the .py files:
    imports = {}
    for module in PY_MODULES:
        for node in ast.walk(ast.parse(real_wheel[module])):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zbal.zbal"):
                imports.setdefault(node.module, set()).update(a.name for a in node.names)
    assert "Config" in imports["zbal.zbal.deepep_adaptor"]
    assert "is_mix_alloc" in imports["zbal.zbal.allocator"]
    # ... and every name imported from the native module is a registered string in the .so.
    so = next(v for k, v in real_wheel.items() if re.fullmatch(r"zbal\.cpython-.*\.so", k))
    missing = {}
    for mod, names in imports.items():
        for name in names | set(mod.split(".")[2:]):
            if not re.search(re.escape(name.encode()) + b"\x00", so):
                missing.setdefault(mod, []).append(name)
    assert missing == {}, f"names not found in the native module's strings: {missing}"


def test_fake_imports_as_the_same_modules(fake_zbal):
    import importlib

    for name in ["zbal", "zbal.zbal_module", "zbal.zbal_buffer", "zbal.zbal_utils", "zbal.zbal",
                 "zbal.zbal.allocator", "zbal.zbal.deepep_adaptor"]:
        importlib.import_module(name)
    from zbal.zbal.deepep_adaptor import Config
    from zbal.zbal_buffer import Buffer

    assert fake_zbal.Buffer is Buffer and Config is fake_zbal.Config


def test_fake_behaviour(fake_zbal, simnpu_clean, monkeypatch):
    zbal, sim = fake_zbal, simnpu_clean
    zbal.reset_fake()
    monkeypatch.delenv("MEMFABRIC_HYBRID_LIBRARY_PATH", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert zbal.zbal_init(8, 3, 3, 16 << 30) is True
    assert sim.allocator_backend() == "pluggable"
    kinds = [e[0] if e[0] != "zbal" else f"zbal:{e[1]}" for e in sim.EVENTS]
    assert kinds == ["zbal:zbal_init", "zbal:switch_to_allocator", "change_allocator", "set_device",
                     "zbal:zbal_bootstrap"]
    assert sim.events("set_device") == [("set_device", 3)]
    assert zbal.CALLS[0][0] == "zbal_init" and zbal.CALLS[0][1]["device_mem_size"] == 16 << 30
    assert zbal.FAKE.ip_port == "tcp://10.0.0.1:29480"
    # allocator already pluggable -> not switched again
    sim.clear_events()
    zbal.FAKE.init_result = False
    assert zbal.zbal_init(8, 3, 3, 1 << 30, ip_port="tcp://h:1") is False
    assert sim.events("change_allocator") == []
    zbal.FAKE.mix = True
    zbal.FAKE.heap_total, zbal.FAKE.heap_free = 40 << 30, 10 << 30
    assert zbal.is_mix_alloc() is True
    assert zbal.mem_get_info() == (10 << 30, 40 << 30)
    assert zbal.FAKE.backend_registered is True
    zbal.reset_fake()
