"""The two layers of the NPU stack's own Python: memfabric-zbal 1.2.0's Python files over the
simulated native library compiled from dev/shimdev/simzbal/zbal_native.c (``ensure_zbal_layer``),
and the real torch-npu wheel unpacked where no CANN exists (``ensure_torch_npu_layer``: ``import
torch`` fails there as on an image where CANN's set_env.sh was not sourced)."""
from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

from shimdev.envs.buildcache import LAYOUT, build_once, digest, layered_dir, python_tag, run
from shimdev.envs.wheels import TORCH_NPU_PIN, ZBAL_PIN, ensure_torch_npu_wheel, ensure_zbal_wheel


# -- memfabric-zbal: the wheel's Python files over a simulated native module --------------------------

#: The C source of the simulated native library (dev/shimdev/simzbal/zbal_native.c).
ZBAL_NATIVE_SOURCE = Path(__file__).resolve().parents[1] / "simzbal" / "zbal_native.c"
#: The wheel's files the layer takes, byte for byte.
ZBAL_PY_FILES = ("__init__.py", "zbal_module.py", "zbal_buffer.py", "zbal_utils.py")
#: The directory MEMFABRIC_HYBRID_LIBRARY_PATH names in the layer (empty: only the native side
#: would load memfabric from it).
MEMFABRIC_DIR = "memfabric-lib"


def zbal_layer_dir() -> Path:
    key = {"zbal": ZBAL_PIN, "native": hashlib.sha256(ZBAL_NATIVE_SOURCE.read_bytes()).hexdigest(),
           "python": python_tag(), "layout": LAYOUT, "files": list(ZBAL_PY_FILES) + ["dist-info"]}
    return layered_dir() / f"zbal-{ZBAL_PIN.split('==')[1]}-{digest(key)}"


def c_compiler() -> str:
    """The C compiler the zbal layer is built with: ``$CC``, else ``cc``."""
    return os.environ.get("CC", "cc")


def _compile_zbal_native(out: Path) -> str:
    """Build the simulated ``zbal.zbal`` extension and allocator library with the C compiler
    (``$CC`` or ``cc``) against this interpreter's headers; returns the command line."""
    import sysconfig

    cmd = [c_compiler(), "-shared", "-fPIC", "-O1", "-Wall", "-I", sysconfig.get_paths()["include"],
           "-o", str(out), str(ZBAL_NATIVE_SOURCE)]
    run(cmd, "compiling the simulated zbal native library")
    return " ".join(cmd)


def ensure_zbal_layer(*, log=None) -> Path:
    """``CACHE/layered/zbal-1.2.0-<hash>``: the wheel's zbal/*.py unmodified and its dist-info (as
    pip installs it: the version is read from there), and in place of its native
    ``zbal.cpython-*.so`` the library compiled from ZBAL_NATIVE_SOURCE under the same name (an
    extension module and an allocator library in one file, as the real one is)."""
    import sysconfig

    wheel = ensure_zbal_wheel()

    def build(tmp: Path) -> dict:
        (log or (lambda s: None))(f"[zbal] {wheel.name}'s Python files + the simulated native library")
        package = tmp / "zbal"
        package.mkdir(parents=True)
        with zipfile.ZipFile(wheel) as zf:
            for name in ZBAL_PY_FILES:
                (package / name).write_bytes(zf.read(f"zbal/{name}"))
            # not its RECORD: that lists the real native library's hash
            zf.extractall(tmp, [n for n in zf.namelist() if n.split("/")[0].endswith(".dist-info")
                                and not n.endswith("/RECORD")])
        (tmp / MEMFABRIC_DIR).mkdir()
        command = _compile_zbal_native(package / ("zbal" + sysconfig.get_config_var("EXT_SUFFIX")))
        return {"wheel": wheel.name, "files": list(ZBAL_PY_FILES), "compiled": command}

    return build_once(zbal_layer_dir(), "layered-zbal", build)


def zbal_env(layer: Path) -> dict:
    """The variables a process using the zbal layer gets (zbal_init reads memfabric's path)."""
    return {"MEMFABRIC_HYBRID_LIBRARY_PATH": str(layer / MEMFABRIC_DIR)}


# -- torch_npu without CANN: the image where set_env.sh was not sourced --------------------------------

def ensure_torch_npu_layer(*, log=None) -> Path:
    """``CACHE/layered/torch-npu-2.13.0-py3.11``: the real torch-npu wheel unpacked as pip would
    (``--no-deps --target``; its ``torch.backends`` entry point included).  No CANN exists here, so
    with this layer on PYTHONPATH ``import torch`` fails as on an image without set_env.sh."""
    wheel = ensure_torch_npu_wheel()
    d = layered_dir() / f"torch-npu-{TORCH_NPU_PIN.split('==')[1]}-py{python_tag()}"

    def build(tmp: Path) -> dict:
        (log or (lambda s: None))(f"[torch-npu] unpacking {wheel.name} as a layer")
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tmp)
        return {"wheel": wheel.name}

    return build_once(d, "layered-torch-npu", build)
