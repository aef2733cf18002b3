"""memfabric-zbal 1.2.0 in the tests: the wheel's Python files, run unmodified, over a simulated
native half (dev/shimdev/simzbal).

The zbal layer (``npu_layers.ensure_zbal_layer``, built by the test command) holds the wheel's
``__init__.py``, ``zbal_module.py``, ``zbal_buffer.py`` and ``zbal_utils.py`` byte for byte, and in
place of the native ``zbal.cpython-311-x86_64-linux-gnu.so`` (it links CANN) a library compiled
from ``simzbal/zbal_native.c`` under the same name.  Checked here:

* the Python files are the wheel's, and the only files beside them are the compiled library and
  memfabric's (empty) library directory;
* the simulated native module offers exactly the names the wheel's files import from ``zbal.zbal``
  and its submodules, each a registered string of the real native library;
* the compiled library exports every symbol the Python files and torch_npu look up with ctypes,
  each one the real library exports too; Python imports it as ``zbal.zbal`` and ``zbal_module``
  opens the same file;
* the real ``zbal_init`` / ``switch_to_allocator`` run: the allocator swap through
  ``NPUPluggableAllocator`` on that library, the ``set_*_fn`` hooks (the pool hooks too with
  ``ZBAL_ENABLE_GRAPH=1``), ``set_device``, the bootstrap with the address zbal derives;
* the pool hooks take torch_npu's three-argument call and place each graph pool where the real
  library does (full mode: the GVA heap; mix mode: the device before the lazy heap, the heap after);
  the facts about the real library the shim's ZBAL_ENABLE_GRAPH decision rests on still hold.
"""
from __future__ import annotations

import ast
import ctypes
import os
import re
import subprocess
import sys
import zipfile

import pytest

from shimdev import DEV, simzbal
from shimdev.envs import realsglang
from shimdev.simzbal import native

PY_FILES = realsglang.sglang_envs.ZBAL_PY_FILES


@pytest.fixture(scope="module")
def real_wheel():
    try:
        whl = realsglang.sglang_envs.ensure_zbal_wheel()
    except realsglang.sglang_envs.EnvError as e:
        pytest.fail(f"cannot get the real memfabric-zbal wheel: {e}", pytrace=False)
    with zipfile.ZipFile(whl) as zf:
        return {n.split("/", 1)[1]: zf.read(n) for n in zf.namelist() if n.startswith("zbal/")}


@pytest.fixture(scope="module")
def real_so(real_wheel):
    return next(v for k, v in real_wheel.items() if re.fullmatch(r"zbal\.cpython-.*\.so", k))


@pytest.fixture(scope="module")
def layer():
    return realsglang.sglang_envs.ensure_zbal_layer()


def native_imports(real_wheel) -> dict:
    """{module: names} the wheel's Python files import from the native module."""
    found = {}
    for name in PY_FILES:
        for node in ast.walk(ast.parse(real_wheel[name])):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zbal.zbal"):
                found.setdefault(node.module, set()).update(a.name for a in node.names)
    return found


def ctypes_symbols(real_wheel) -> set:
    """Symbols zbal_module.py looks up in its library: "zbal_pluggable_*" strings and attributes."""
    tree = ast.parse(real_wheel["zbal_module.py"])
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
               and n.value.startswith("zbal_pluggable_")}
    attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                  and isinstance(n.value, ast.Name) and n.value.id == "zbal_allocator"
                  and n.attr.startswith("zbal_")}
    return strings | attributes


def test_the_layer_holds_the_wheel_s_python_files_unmodified(real_wheel, layer):
    wheel_py = sorted(n for n in real_wheel if n.endswith(".py"))
    assert wheel_py == sorted(PY_FILES)
    for name in PY_FILES:
        assert (layer / "zbal" / name).read_bytes() == real_wheel[name], name
    # (a __pycache__ of bytecode is Python's, not the layer's: a process without
    # PYTHONDONTWRITEBYTECODE that imported zbal writes one)
    others = sorted(p.name for p in (layer / "zbal").iterdir() if p.name not in PY_FILES + ("__pycache__",))
    assert others == [next(n for n in real_wheel if n.endswith(".so"))]  # the same file name
    assert sorted(p.name for p in layer.iterdir() if p.is_dir()) == [
        "memfabric-lib", "memfabric_zbal-1.2.0.dist-info", "zbal"]  # the dist-info as pip installs it


def test_the_native_module_offers_exactly_what_the_python_files_import(real_wheel, real_so):
    imports = native_imports(real_wheel)
    offered = {"zbal.zbal": set(native.MODULE_NAMES) | {"allocator", "deepep_adaptor"},
               "zbal.zbal.allocator": set(native.ALLOCATOR_NAMES),
               "zbal.zbal.deepep_adaptor": set(native.DEEPEP_NAMES)}
    for module, names in imports.items():
        assert names <= offered[module], f"{module}: the simulation lacks {names - offered[module]}"
    wanted = {m: n | ({"allocator", "deepep_adaptor"} if m == "zbal.zbal" else set()) for m, n in imports.items()}
    extra = {m: offered[m] - wanted.get(m, set()) for m in offered}
    # Buffer: the DeepEP adaptor's runtime, used as deepep_adaptor.Buffer by zbal_buffer.py
    assert extra == {"zbal.zbal": set(), "zbal.zbal.allocator": set(), "zbal.zbal.deepep_adaptor": {
        "Buffer", "get_low_latency_rdma_size_hint"}}
    tree = ast.parse(real_wheel["zbal_buffer.py"])
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "deepep_adaptor"}
    assert used == extra["zbal.zbal.deepep_adaptor"]
    # every name is registered in the real native library (pybind11 registration strings; the
    # linker tail-merges strings, hence a suffix match)
    for module, names in offered.items():
        for name in names:
            assert re.search(re.escape(name.encode()) + b"\x00", real_so), f"{module}.{name}"


def test_the_compiled_library_exports_what_ctypes_looks_up(real_wheel, real_so, layer):
    symbols = ctypes_symbols(real_wheel)
    assert {"zbal_pluggable_malloc", "zbal_pluggable_free", "zbal_pluggable_init",
            "zbal_get_symm_base_addr"} <= symbols
    ours = ctypes.CDLL(str(next((layer / "zbal").glob("zbal.*.so"))))
    for name in symbols:
        assert getattr(ours, name), name
        assert name.encode() + b"\x00" in real_so, f"the real library does not export {name}"
    ours.zbal_pluggable_malloc.restype = ctypes.c_void_p
    ptr = ours.zbal_pluggable_malloc(ctypes.c_ssize_t(64), 0, None)
    assert ptr
    ours.zbal_pluggable_free(ctypes.c_void_p(ptr), ctypes.c_size_t(64), 0, None)


def test_zbal_zbal_is_the_compiled_library_and_zbal_module_opens_it(zbal_pkg, layer):
    import importlib

    for name in ["zbal", "zbal.zbal_module", "zbal.zbal_buffer", "zbal.zbal_utils", "zbal.zbal",
                 "zbal.zbal.allocator", "zbal.zbal.deepep_adaptor"]:
        importlib.import_module(name)
    lib = next((layer / "zbal").glob("zbal.*.so"))
    assert zbal_pkg.zbal.__file__ == str(lib) and zbal_pkg.zbal_module.ZBAL_LIB == lib
    from zbal.zbal.deepep_adaptor import Config
    from zbal.zbal_buffer import Buffer

    assert zbal_pkg.Buffer is Buffer and Config is zbal_pkg.Config
    assert zbal_pkg.__version__ == "1.2.0"
    import torch

    assert "zbal" in torch.distributed.Backend.backend_list  # the wheel's __init__ registered it


def test_zbal_init_runs_the_wheel_s_code(zbal_pkg, simnpu_clean, monkeypatch):
    zbal, sim = zbal_pkg, simnpu_clean
    simzbal.reset()
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert zbal.zbal_init(8, 3, 3, 16 << 30) is True
    assert sim.allocator_backend() == "pluggable"
    kinds = [e[0] if e[0] != "zbal" else f"zbal:{e[1]}" for e in sim.EVENTS]
    assert kinds == ["change_allocator"] + ["allocator_fn"] * 5 + ["set_device", "zbal:zbal_bootstrap"]
    assert sim.events("change_allocator") == [
        ("change_allocator", str(zbal.zbal_module.ZBAL_LIB), "zbal_pluggable_malloc", "zbal_pluggable_free")]
    assert [e[1] for e in sim.events("allocator_fn")] == [
        "set_init_fn", "set_reset_fn", "set_record_stream_fn", "set_erase_stream_fn", "set_get_device_stats_fn"]
    assert sim.events("set_device") == [("set_device", 3)]
    (boot,) = simzbal.bootstraps()
    assert (boot["world_size"], boot["device_id"], boot["rank_id"], boot["device_mem_size"]) == (8, 3, 3, 16 << 30)
    assert boot["ip_port"] == "tcp://10.0.0.1:29480" == simzbal.STATE.ip_port  # derived from MASTER_*
    # the allocator is pluggable now: a second zbal_init does not switch again
    sim.clear_events()
    simzbal.STATE.init_result = False
    assert zbal.zbal_init(8, 3, 3, 1 << 30, ip_port="tcp://h:1") is False
    assert sim.events("change_allocator") == []
    # ... and switching again is what torch_npu refuses
    with pytest.raises(RuntimeError, match="Can't swap an already initialized allocator"):
        zbal.switch_to_allocator()
    simzbal.STATE.mix = True
    simzbal.STATE.heap_total, simzbal.STATE.heap_free = 40 << 30, 10 << 30
    assert zbal.is_mix_alloc() is True
    assert zbal.mem_get_info() == (10 << 30, 40 << 30)
    simzbal.reset()


def test_zbal_init_without_memfabric_fails_as_the_wheel_does(zbal_pkg, simnpu_clean, monkeypatch):
    """No MEMFABRIC_HYBRID_LIBRARY_PATH: the wheel imports memfabric_hybrid, absent here."""
    monkeypatch.delenv("MEMFABRIC_HYBRID_LIBRARY_PATH", raising=False)
    with pytest.raises(ModuleNotFoundError, match="memfabric_hybrid"):
        zbal_pkg.zbal_init(1, 0, 0, 1 << 30)
    assert simnpu_clean.events() == []


def test_graph_mode_also_sets_the_pool_hooks():
    """ZBAL_ENABLE_GRAPH=1 is read when zbal_module is imported: a process of its own."""
    layer = realsglang.sglang_envs.ensure_zbal_layer()
    code = ("from shimdev import simnpu; simnpu.install(); import zbal; zbal.switch_to_allocator(); "
            "print(' '.join(e[1] for e in simnpu.events('allocator_fn')))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(DEV), str(layer)]), ZBAL_ENABLE_GRAPH="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stdout.split() == [
        "set_init_fn", "set_reset_fn", "set_record_stream_fn", "set_erase_stream_fn", "set_get_device_stats_fn",
        "set_begin_allocate_to_pool", "set_end_allocate_to_pool_fn", "set_release_pool"]


GRAPH_POOL_SCRIPT = """
import json
from shimdev import simnpu, simzbal
from shimdev.simnpu._device import STATE as DEVICE
simnpu.install()
import zbal
zbal.switch_to_allocator()
hooks = {k: DEVICE.allocator.functions[k] for k in
         ("set_begin_allocate_to_pool", "set_end_allocate_to_pool_fn", "set_release_pool")}
types = simzbal.HOOK_TYPES
begin = types["begin"](hooks["set_begin_allocate_to_pool"])
end = types["end"](hooks["set_end_allocate_to_pool_fn"])
release = types["release"](hooks["set_release_pool"])
filt = types["begin"](hooks["set_begin_allocate_to_pool"])  # any non-null address as the filter
def capture(pool, heap=0, device=0):
    begin(0, types["MempoolId"](*pool), filt)
    DEVICE.pluggable_bytes += heap
    DEVICE.live_npu_bytes += device
    end(0, types["MempoolId"](*pool))
out = {}
simzbal.STATE.initialized = DEVICE.heap_active = True          # full mode: the heap exists
capture((0, 1), heap=4096)
capture((0, 1), heap=1024)                                     # a second size, the same pool
release(0, types["MempoolId"](0, 1))
out["full"] = simzbal.STATE.pools[(0, 1)]
simzbal.STATE.mix = True
simzbal.STATE.initialized = DEVICE.heap_active = False         # mix mode before the lazy heap
capture((0, 2), device=512, heap=7)
out["mix_before_heap"] = simzbal.STATE.pools[(0, 2)]
simzbal.STATE.initialized = DEVICE.heap_active = True          # ... and after it
capture((0, 3), heap=2048)
out["mix_after_heap"] = simzbal.STATE.pools[(0, 3)]
begin(0, types["MempoolId"](0, 4), None)
begin(0, types["MempoolId"](0, 5), None)                       # refused: already recording
end(0, types["MempoolId"](0, 6))                               # refused: not recording to it
release(0, types["MempoolId"](9, 9))                           # refused: no such pool
out["errors"] = simzbal.STATE.pool_errors
out["begins"] = [f for n, f in simzbal.calls() if n == "pool_begin"]
print(json.dumps(out))
"""


def test_the_pool_hooks_take_torch_npus_call_and_account_where_graph_memory_comes_from():
    """With ZBAL_ENABLE_GRAPH=1 the three addresses switch_to_allocator hands torch_npu, called as
    torch_npu calls them (device, MempoolId_t, filter): each pool is placed as the real library
    routes it (full mode: the GVA heap; mix mode: zbal's device allocator before the lazy heap,
    the heap after it) and holds what its captures placed."""
    import json

    layer = realsglang.sglang_envs.ensure_zbal_layer()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(DEV), str(layer)]), ZBAL_ENABLE_GRAPH="1")
    env.update(realsglang.sglang_envs.zbal_env(layer))
    out = subprocess.run([sys.executable, "-c", GRAPH_POOL_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["full"] == {"source": "gva_heap", "captures": 2, "bytes": 5120, "released": True}
    assert got["mix_before_heap"] == {"source": "device", "captures": 1, "bytes": 512, "released": False}
    assert got["mix_after_heap"] == {"source": "gva_heap", "captures": 1, "bytes": 2048, "released": False}
    assert got["errors"] == ["beginAllocateToPool: already recording to mempool_id (0, 4)",
                             "endAllocatePool: not currently recording to mempool_id (0, 6)",
                             "Could not find pool of id (9, 9)"]
    assert [b["filter"] for b in got["begins"]] == [True] * 4 + [False]
    assert "[ZBAL] beginAllocateToPool: already recording" in out.stderr


def test_the_facts_the_graph_pool_decision_rests_on(real_wheel, real_so):
    """npu_shim/patches/zbal.py's ZBAL_ENABLE_GRAPH section: only the Python layer reads the
    variable (at import, into a global switch_to_allocator reads); the native hooks lead to both
    of the library's allocators, each with private pools and capture bookkeeping."""
    module = real_wheel["zbal_module.py"].decode()
    assert 'ZBAL_ENABLE_GRAPH = int(os.environ.get("ZBAL_ENABLE_GRAPH", 0)) == 1' in module
    # the global, the variable's name, and switch_to_allocator's one test of the global
    assert module.count("ZBAL_ENABLE_GRAPH") == 3 and "    if ZBAL_ENABLE_GRAPH:\n" in module
    assert b"ZBAL_ENABLE_GRAPH" not in real_so
    for symbol in (b"sma_begin_allocate_to_pool", b"dma_begin_allocate_to_pool", b"sma_release_pool",
                   b"dma_release_pool", b"insertEventsDeferredUntilNoCapture", b"captures_underway",
                   b"beginAllocateToPool: already recording to mempool_id",
                   b"endAllocatePool: not currently recording to mempool_id", b"use_vmm_for_static_memory"):
        assert symbol in real_so, symbol


def test_the_deepep_runtime_answers_only_what_the_real_library_registers(real_wheel, real_so):
    """The adaptor's Buffer computes dispatch/combine (simnpu/_deepep.py): each method it answers
    is one zbal_buffer.py calls on its runtime and a string the real library registers; the
    Config methods sglang sizes its buffers with are registered there too."""
    calls = {n.attr for n in ast.walk(ast.parse(real_wheel["zbal_buffer.py"]))
             if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
             and n.value.attr == "runtime"}
    assert set(native.RUNTIME_METHODS) == calls, sorted(calls ^ set(native.RUNTIME_METHODS))
    config_methods = {n for n in vars(native.Config) if not n.startswith("_")}
    assert config_methods == {"get_nvl_buffer_size_hint", "get_rdma_buffer_size_hint"}
    for name in sorted(calls | config_methods):
        assert name.encode() + b"\x00" in real_so, name
