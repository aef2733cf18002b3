"""Import-time stubs for the NPU / CUDA-only packages sglang imports.

A meta-path finder (first on ``sys.meta_path``) serves every module under the stubbed roots.
A stub module answers any attribute:

* ``Capitalised`` names -> an auto *class* (real ``type``: supports ``A | B``, subclassing,
  ``isinstance``); attributes of it are auto classes too; instantiating accepts anything;
* other names -> the stub *submodule* ``<module>.<name>`` (so ``triton.language`` is the same object
  however it is reached); a stub module is callable: ``@triton.jit`` / ``@torch_npu.foo`` return the
  decorated function unchanged, other calls return an inert ``StubValue``.

Names listed as *absent* (dotted, e.g. ``sgl_kernel_npu.norm.split_qkv_rmsnorm_rope``) are neither
importable nor attributes -- a guarded ``try: from x import y`` sees them missing.  Explicit
attributes (``OVERRIDES``) win over auto ones: ``triton.runtime.driver.active`` raises like triton
without a GPU, ``__version__`` strings, ``torch_npu.npu`` is the simulated device module.
Nothing in a stub does real work: calling an NPU kernel stub returns a ``StubValue``.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import typing

#: Names of stub modules imported so far (in order) -- what sglang really pulled in.
STUB_IMPORTS: list[str] = []


def _called(origin, args, kwargs):
    """What calling the stub ``origin`` gives: used as a decorator, the function it decorates;
    otherwise an inert ``StubValue``."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return StubValue(f"{origin}()")


class StubValue:
    """What calling a stub returns: inert, callable, attribute-rich; never equal to real data."""

    def __init__(self, origin: str = "?"):
        object.__setattr__(self, "_origin", origin)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return StubValue(f"{self._origin}.{name}")

    def __call__(self, *args, **kwargs):
        return _called(self._origin, args, kwargs)

    def __getitem__(self, item):
        return self

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __or__(self, other):
        return typing.Any

    __ror__ = __or__

    def __repr__(self):
        return f"<stub value {self._origin}>"


class _AutoMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _AutoMeta(name, (_AutoBase,), {"__module__": cls.__module__,
                                             "__qualname__": f"{cls.__qualname__}.{name}"})
        type.__setattr__(cls, name, sub)
        return sub

    def __getitem__(cls, item):
        return cls


class _AutoBase(metaclass=_AutoMeta):
    def __init__(self, *args, **kwargs):
        self._stub_args = (args, kwargs)

    def __call__(self, *args, **kwargs):
        return _called(type(self).__qualname__, args, kwargs)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return StubValue(f"{type(self).__qualname__}.{name}")


def auto_class(module: str, name: str) -> type:
    return _AutoMeta(name, (_AutoBase,), {"__module__": module, "__qualname__": name})


class StubModule(types.ModuleType):
    """A stub (sub)package; see the module docstring."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if _FINDER.is_absent(full):
            raise AttributeError(f"stub module {self.__name__!r} has no attribute {name!r} "
                                 f"(absent in this simulated environment)")
        if name[:1].isupper():
            val = auto_class(self.__name__, name)
            self.__dict__[name] = val
            return val
        return importlib.import_module(full)  # parent gets the attribute set by the import system

    def __call__(self, *args, **kwargs):
        return _called(self.__name__, args, kwargs)

    def __getitem__(self, item):
        return self

    # A module is not iterable: with ``__getitem__`` above, ``x in module`` would otherwise count
    # 0, 1, 2, ... for ever (torch's ``has_triton()`` asks ``"cpu" in triton.backends.backends``).
    __iter__ = None

    def __or__(self, other):
        return typing.Any

    __ror__ = __or__

    def __repr__(self):
        return f"<stub module {self.__name__!r}>"


class _RaisingDriver:
    """``triton.runtime.driver``: ``.active`` raises as on a machine without a GPU driver."""

    @property
    def active(self):
        raise RuntimeError("0 active drivers ([]). There should only be one.")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError("0 active drivers ([]). There should only be one.")


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self) -> None:
        self.roots: set[str] = set()
        self.absent: set[str] = set()
        self.overrides: dict[str, dict] = {}

    # -- policy
    def is_absent(self, fullname: str) -> bool:
        parts = fullname.split(".")
        return any(".".join(parts[:i]) in self.absent for i in range(1, len(parts) + 1))

    def serves(self, fullname: str) -> bool:
        return fullname.split(".")[0] in self.roots and not self.is_absent(fullname)

    # -- importlib protocol
    def find_spec(self, fullname, path=None, target=None):
        if not self.serves(fullname):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        m = StubModule(spec.name)
        m.__path__ = []
        m.__file__ = None
        return m

    def exec_module(self, module):
        module.__dict__["__simnpu_stub__"] = True
        module.__dict__.update(self.overrides.get(module.__name__, {}))
        STUB_IMPORTS.append(module.__name__)


_FINDER = StubFinder()


def finder() -> StubFinder:
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    return _FINDER


# ------------------------------------------------------------------------------ per release

def _v(s: str) -> tuple[int, ...]:
    """'0.5.10' -> (0, 5, 10); a post or dev release counts as its base ('0.5.10.post2.dev3+g..'
    -> (0, 5, 10))."""
    numbers = []
    for part in s.split("."):
        if not part.isdigit():
            break
        numbers.append(int(part))
    return tuple(numbers)


#: Roots stubbed for every release.
COMMON_ROOTS = ("torch_npu", "torchair", "sgl_kernel_npu", "triton", "torchvision")


def roots_for(release: str | None) -> set[str]:
    """Which packages a release needs stubbed (only those: a stub flips guarded imports)."""
    roots = set(COMMON_ROOTS)
    r = _v(release) if release else None
    # memory_pool_host.py imports sgl_kernel.kvcacheio unguarded up to 0.5.11 (measured on
    # 0.5.9/0.5.11; 0.5.19+ import without it).  Releases in between: assumed like 0.5.11 until
    # measured.
    if r is not None and r <= (0, 5, 18):
        roots.add("sgl_kernel")
    # 0.5.15 (not its post1, which guards it with is_cuda()) imports cutlass and cuda.bindings
    # (nvidia-cutlass-dsl / cuda-python, CUDA requirements of the wheel) unguarded from
    # jit_kernel/dsa, which the NPU MLA module and glm4_moe import: without them those modules
    # fail to import on an NPU image that lacks them.
    if r == (0, 5, 15) and ".post" not in release:
        roots |= {"cutlass", "cuda"}
    # acl is imported (lazily, in npu/utils.py is_npu_arch35 and kv-offload) from 0.5.23.
    if r is None or r >= (0, 5, 20):
        roots.add("acl")
    return roots


def absent_for(release: str | None) -> set[str]:
    absent = set()
    r = _v(release) if release else None
    # 0.5.10+ import split_qkv_rmsnorm_rope unguarded in glm4_moe/qwen3/llama (NPU images ship
    # it); older releases never use it, so by default the simulated environment lacks it.
    if r is None or r < (0, 5, 10):
        absent.add("sgl_kernel_npu.norm.split_qkv_rmsnorm_rope")
    return absent


VERSIONS = {"cutlass": "4.5.2", "cuda": "13.0.0", "triton": "3.4.0", "torch_npu": "2.13.0", "torchvision": "0.28.0",
            "torchair": "0.1", "sgl_kernel_npu": "2026.1.0", "sgl_kernel": "0.3.20", "acl": "0"}
