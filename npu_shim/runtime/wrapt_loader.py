"""Where the shim's wrapt comes from, and the part of it the shim loads.

Real Ascend sglang images do not ship wrapt (sglang's NPU dependency set does not contain it), so
``python -m npu_shim bundle`` puts wrapt builds under ``npu_shim/_vendor/wrapt/<build>/wrapt`` --
one folder per (CPython, machine, minimum glibc) plus the pure-Python wheel.  At activation:

1. the image's ``wrapt``, when importable and >= ``MIN_IMAGE_VERSION``;
2. otherwise the bundle's build for this interpreter and platform (the pure-Python build when
   there is none);
3. otherwise ``WraptUnavailable`` with a one-line reason.

The shim uses two names: ``FunctionWrapper`` and ``BoundFunctionWrapper`` (its post-import
hooks are its own: npu_shim/runtime/finder.py).  It loads only the modules that define them (and
what those import) under the private name ``npu_shim._wrapt``, without running the package's
``__init__``.  ``import wrapt`` would also load the decorators, proxies, locks, caches, import
hooks and monkey-patching helpers, most of wrapt's memory in every sglang process.  The
application's ``wrapt``, present or absent, stays what it would be without the shim (its own
post-import hooks keep wrapt's finder).  When the application has already imported the same
wrapt, that module is used and nothing is loaded twice.

``locate()`` answers the same question without importing anything (for ``status``).  Nothing
here writes to disk.
"""

import os
import re
import sys

from npu_shim import _paths

MIN_IMAGE_VERSION = (1, 14)  # measured: 1.14.1, 1.17.3 and 2.5.2 patch the real sglang 0.5.11
PRIVATE_NAME = "npu_shim._wrapt"
PURE_BUILD = "py3-none-any"
# A C build folder: cp311-x86_64-glibc2.5 (the wheel's oldest manylinux glibc).
_BUILD = re.compile(r"^cp(?P<py>\d)(?P<minor>\d+)-(?P<machine>[a-z0-9_]+)-glibc(?P<glibc>\d+\.\d+)$")
_VERSION_INFO = re.compile(r"^__version_info__\s*=\s*\(([^)]*)\)", re.M)


class WraptUnavailable(ImportError):
    """Neither the image nor a bundle provides a usable wrapt."""


class Origin:
    """Where wrapt comes from in this interpreter: ``source`` is image, bundle or missing."""

    def __init__(self, source, version=None, path=None, build=None, note=None):
        self.source = source
        self.version = version
        self.path = path
        self.build = build      # bundle only: the build folder chosen
        self.note = note        # why this source and not a better one, if there is a reason

    def describe(self):
        if self.source == "missing":
            return "missing (%s)" % self.note
        text = "%s %s" % (self.source, self.version or "?")
        if self.build:
            text += " [%s]" % self.build
        if self.note:
            text += " (%s)" % self.note
        return text

    def as_dict(self):
        return {"source": self.source, "version": self.version, "path": self.path,
                "build": self.build, "note": self.note, "text": self.describe()}


def vendor_dir():
    """``npu_shim/_vendor/wrapt`` (present in a bundle, absent in the repo)."""
    return os.path.join(_paths.PACKAGE_DIR, "_vendor", "wrapt")


def version_of(package_dir):
    """wrapt's version read from its ``__init__.py`` text, as a tuple of ints, or None."""
    try:
        with open(os.path.join(package_dir, "__init__.py"), encoding="utf-8") as handle:
            match = _VERSION_INFO.search(handle.read())
    except OSError:
        return None
    if not match:
        return None
    parts = re.findall(r"['\"]?(\d+)['\"]?", match.group(1))
    return tuple(int(part) for part in parts[:3]) or None


def _text(version):
    return ".".join(str(part) for part in version) if version else None


def find_image_wrapt():
    """(package dir, version tuple or None) of the ``wrapt`` this interpreter would import, or None."""
    from npu_shim.source.reading import find_package_dir

    path = find_package_dir("wrapt")
    return (path, version_of(path)) if path else None


def platform_facts():
    """(implementation, (major, minor), machine, glibc (major, minor) or None) of this process."""
    import platform  # cheap; only on activation and in status

    glibc = None
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION") or ""  # "glibc 2.36"; unset on musl
    except (AttributeError, ValueError, OSError):
        text = ""
    match = re.match(r"glibc (\d+)\.(\d+)", text)
    if match:
        glibc = (int(match.group(1)), int(match.group(2)))
    return sys.implementation.name, tuple(sys.version_info[:2]), platform.machine().lower(), glibc


def select_build(builds, implementation, python, machine, glibc):
    """The build folder name for this platform among ``builds`` and a note, or (None, reason).

    A C build needs CPython of the same minor version, the same machine and a glibc at least as
    new as the wheel's manylinux tag; otherwise the pure-Python build (wrapt then runs its own
    Python implementation of the wrappers: slower per call, same behaviour)."""
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    if implementation == "cpython":
        for build in sorted(builds):
            match = _BUILD.match(build)
            if not match:
                continue
            wanted = (int(match.group("py")), int(match.group("minor")))
            needs = tuple(int(x) for x in match.group("glibc").split("."))
            if wanted == tuple(python) and match.group("machine") == machine and glibc and glibc >= needs:
                return build, None
    why = "no C build for %s %d.%d on %s%s" % (
        implementation, python[0], python[1], machine,
        " with glibc %d.%d" % glibc if glibc else " without glibc")
    if PURE_BUILD in builds:
        return PURE_BUILD, why + ": pure-Python wrapt"
    return None, why + " and no pure-Python build"


def bundled_builds(directory=None):
    directory = directory or vendor_dir()
    try:
        return sorted(name for name in os.listdir(directory)
                      if os.path.isfile(os.path.join(directory, name, "wrapt", "__init__.py")))
    except OSError:
        return []


def locate():
    """The Origin ``load()`` would use, decided without importing wrapt."""
    image = find_image_wrapt()
    note = None
    if image is not None:
        path, version = image
        if version is not None and version >= MIN_IMAGE_VERSION:
            return Origin("image", _text(version), path)
        note = "the image's wrapt %s at %s is older than %s" % (
            _text(version) or "of unknown version", path, _text(MIN_IMAGE_VERSION))
    builds = bundled_builds()
    if not builds:
        reason = note or "wrapt is not installed in this image"
        return Origin("missing", note="%s, and this npu-shim is not a bundle (build one with "
                                      "'python -m npu_shim bundle DIR')" % reason)
    build, why = select_build(builds, *platform_facts())
    if build is None:
        return Origin("missing", note="%s; the bundle has %s" % (why, ", ".join(builds)))
    path = os.path.join(vendor_dir(), build, "wrapt")
    return Origin("bundle", _text(version_of(path)), path, build,
                  "; ".join(text for text in (note, why) if text) or None)


_LOADED = None  # (module, Origin) once load() succeeded


def load():
    """The namespace with the two wrapt names the shim uses (loaded once); raises
    WraptUnavailable."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED[0]
    origin = locate()
    if origin.source == "missing":
        raise WraptUnavailable("wrapt is not available: %s" % origin.note)
    module = _already_imported(origin.path) if origin.source == "image" else None
    if module is None:
        module = _load_private(origin.path)
        if PRIVATE_NAME + "._wrappers" not in sys.modules and (
                origin.source == "bundle" or _has_extension(origin.path)):
            origin.note = "; ".join(t for t in (origin.note, "C extension not loaded: pure-Python wrappers") if t)
    _LOADED = (module, origin)
    return module


def loaded_origin():
    """The Origin of the wrapt ``load()`` returned in this process, or None before."""
    return _LOADED[1] if _LOADED is not None else None


def _already_imported(package_dir):
    """The application's ``wrapt`` module when it is loaded already from ``package_dir``."""
    module = sys.modules.get("wrapt")
    path = getattr(module, "__file__", None)
    if path and os.path.realpath(os.path.dirname(path)) == os.path.realpath(package_dir):
        return module
    return None


def _has_extension(package_dir):
    try:
        return any(name.startswith("_wrappers.") for name in os.listdir(package_dir))
    except OSError:
        return False


def _c_wrappers(package_dir):
    """wrapt's C extension module, or None (none built, or switched off as wrapt itself allows
    with ``WRAPT_DISABLE_EXTENSIONS``): it defines both names by itself.  wrapt's own choice goes
    through its pure-Python wrappers module first, which is most of what it would keep in every
    sglang process."""
    import importlib

    if os.environ.get("WRAPT_DISABLE_EXTENSIONS") or not _has_extension(package_dir):
        return None
    try:
        return importlib.import_module(PRIVATE_NAME + "._wrappers")
    except ImportError:  # as wrapt does: its Python wrappers instead (the import took it out of sys.modules)
        return None


def _load_private(package_dir):
    """The wrappers of the wrapt in ``package_dir``, imported under PRIVATE_NAME without its
    ``__init__`` (its imports are all relative); the two names the shim uses are set on the
    returned package module."""
    import importlib
    import importlib.util

    # An __init__.py: a package spec, its submodules searched for in package_dir.
    spec = importlib.util.spec_from_file_location(PRIVATE_NAME, os.path.join(package_dir, "__init__.py"))
    module = importlib.util.module_from_spec(spec)  # a package whose __init__ is never run
    sys.modules[PRIVATE_NAME] = module
    # wrapt 2.x's C extension imports "wrapt.exceptions" by its absolute name (and so "wrapt") while
    # it initialises: serve it ours for that moment only -- without it wrapt silently falls back
    # to pure Python.  Names the process already has are left as they are.
    aliases = [name for name in ("wrapt", "wrapt.exceptions") if name not in sys.modules]
    try:
        try:
            exceptions = importlib.import_module(PRIVATE_NAME + ".exceptions")
        except ImportError:
            aliases = []  # a wrapt without that module (1.x) has nothing to serve
        for name in aliases:
            sys.modules[name] = module if name == "wrapt" else exceptions
        core = _c_wrappers(package_dir)
        if core is None:
            # 2.x chooses between its C and Python wrappers in __wrapt__; 1.x in wrappers.
            core_name = "__wrapt__" if os.path.isfile(os.path.join(package_dir, "__wrapt__.py")) else "wrappers"
            core = importlib.import_module("%s.%s" % (PRIVATE_NAME, core_name))
        module.FunctionWrapper = core.FunctionWrapper
        module.BoundFunctionWrapper = core.BoundFunctionWrapper
    except BaseException:
        for name in [n for n in sys.modules if n == PRIVATE_NAME or n.startswith(PRIVATE_NAME + ".")]:
            del sys.modules[name]
        raise
    finally:
        for name in aliases:
            sys.modules.pop(name, None)
    return module
