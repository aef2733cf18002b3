"""Loading the registered patches (npu_shim/core/registry.py) and what the rest asks of them:
the modules their targets live in, the variables they read, their selftest steps.  A feature
module that cannot be loaded becomes a ``BrokenPatch``: that patch alone is ``failed``; the
others work.

The patches are plug-ins: this module is the only place that imports a patch's modules, by the
names the registry and the convention give (tests/test_layering.py holds it so)."""

import importlib
import importlib.util

from npu_shim.core import config
from npu_shim.core.framework import Report
from npu_shim.core import registry


class BrokenPatch:
    """Stands in for a feature module that cannot be loaded (an import error, a declaration
    error, no ``PATCH``): that patch alone is ``failed`` with the reason; the others work."""

    title = "(could not be loaded)"
    reads = ()
    modules = ()
    report = Report()

    def __init__(self, name, reason):
        self.name = name
        self.broken = reason
        self.switch = config.switch(name, "")
        self.upstream = _Unknown("feature module npu_shim.patches.%s" % name)

    def must_honour(self, environ):
        return False


class _Unknown:
    """A broken patch's ``upstream``: where it came from, nothing it promises."""

    pr = release = remove_when = ""
    backports = ()

    def __init__(self, text):
        self.text = text

    def __str__(self):
        return self.text


def load(module_name):
    """The module's PATCH, or a BrokenPatch saying why it cannot be had."""
    name = module_name.rpartition(".")[2]
    try:
        patch = importlib.import_module(module_name).PATCH
    except Exception as exc:  # noqa: BLE001 - one broken feature must not take the others down
        return BrokenPatch(name, "feature module %s cannot be loaded: %r" % (module_name, exc))
    if getattr(patch, "name", None) != name:
        return BrokenPatch(name, "%s.PATCH is named %r, not %r" % (module_name, getattr(patch, "name", None), name))
    return patch


class SelftestStep:
    """A patch's step of ``python -m npu_shim selftest``: its module ``<its package>._selftest.<name>``,
    whose ``run(step)`` exercises the patch, and what that module says of the step (each optional):
    ``DEVICES`` the device kinds it runs on (default: the NPU), ``ALONE`` whether it runs in a
    process of its own before anything touches the device, ``OPTIONS`` the (flag, options key,
    default, help) of the ``selftest`` options it reads, ``mib(options)`` the free device memory it
    needs."""

    def __init__(self, module):
        self.module = module
        self.devices = getattr(module, "DEVICES", ("npu",))
        self.alone = getattr(module, "ALONE", False)
        self.options = getattr(module, "OPTIONS", ())

    def mib(self, options):
        need = getattr(self.module, "mib", None)
        return need(options) if need is not None else 0


def selftest_step(patch):
    """The patch's SelftestStep, or None: it has none (a broken patch has none either)."""
    if getattr(patch, "broken", None):
        return None
    package = type(patch).__module__.rpartition(".")[0]
    name = "%s._selftest.%s" % (package, patch.name)
    try:
        found = importlib.util.find_spec(name)
    except ImportError:  # no parent package (none at all: a relative name)
        found = None
    return SelftestStep(importlib.import_module(name)) if found is not None else None


def load_all():
    """The Patch of every registered module, in registry order."""
    return [load(name) for name in registry.PATCH_MODULES]


def target_modules(patches):
    """Every module any of ``patches`` may touch, each once, in declaration order."""
    modules = []
    for patch in patches:
        modules += [m for m in patch.modules if m not in modules]
    return modules


def all_variables(patches=None):
    """Every variable the shim reads: its own, then each patch's switch and the others it reads."""
    found = list(config.SHIM_VARIABLES)
    for patch in load_all() if patches is None else patches:
        found += [var for var in (patch.switch,) + tuple(patch.reads) if var not in found]
    return found
