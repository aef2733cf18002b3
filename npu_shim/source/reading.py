"""What applying asks of sglang in every process, and what both sides of a decision share.

Applying checks the loaded code against what deciding read: ``live_params`` reads an imported
function's parameters from its ``__code__``; ``live_fingerprint`` gives its fingerprint from the
def's source as loaded.  Reading and parsing a source file, the fingerprint of a def, and where a
package and its version are here too.

Deciding itself (``codeview``'s SourceView) is needed once per process, applying never: nothing
here imports it at module level.
"""

import ast
import hashlib
import os
import re

from npu_shim.core.framework import SourceError
from npu_shim.reporting.log import one_line


def read_source(path):
    """The text of a ``.py`` file as Python's import system decodes it (coding cookie, BOM,
    universal newlines)."""
    import importlib.util

    with open(path, "rb") as handle:
        data = handle.read()
    try:
        return importlib.util.decode_source(data)
    except (SyntaxError, UnicodeDecodeError, LookupError) as exc:
        raise SourceError("cannot decode %s: %s" % (path, one_line(exc, 120))) from None


def parse_source(text, path):
    try:
        return ast.parse(text, filename=path)
    except (SyntaxError, ValueError) as exc:  # ValueError: null bytes
        where = " line %s" % exc.lineno if getattr(exc, "lineno", None) else ""
        raise SourceError("cannot parse %s%s: %s: %s"
                          % (path, where, type(exc).__name__, one_line(getattr(exc, "msg", exc), 120)))


_LEFT_OUT = ("type_comment", "kind")
_FIELDS = {}  # AST class -> its fields in order, less those left out


def _canonical(node):
    """A text form of an AST that is the same on every Python 3.9+: ``ast.dump`` is not (3.12 added
    ``type_params``, 3.13 changed how empty fields print), so empty fields are left out.  Written
    into one list and joined once: this runs over every pinned def in every deciding process."""
    out = []
    _write(node, out.append)
    return "".join(out)


def _write(value, put):
    if isinstance(value, ast.AST):
        cls = value.__class__
        fields = _FIELDS.get(cls)
        if fields is None:
            fields = _FIELDS[cls] = tuple(f for f in cls._fields if f not in _LEFT_OUT)
        put("(" + cls.__name__)
        for name in fields:
            item = getattr(value, name, None)
            if item is None or item == []:
                continue
            put(" " + name + "=")
            _write(item, put)
        put(")")
    elif isinstance(value, list):
        put("[")
        for index, item in enumerate(value):
            if index:
                put(",")
            _write(item, put)
        put("]")
    else:
        put(repr(value))


def fingerprint_node(node):
    """Hash of a def's AST: insensitive to comments, formatting and the Python version that
    parses it; sensitive to any change of the code (docstrings included)."""
    return hashlib.sha256(_canonical(node).encode()).hexdigest()[:16]


def live_fingerprint(func):
    """``fingerprint_node`` of an imported function, from the source file it was loaded from
    (through ``inspect``).  The file's lines ``inspect`` reads are not left in ``linecache``
    (every sglang process would keep them)."""
    import inspect
    import linecache

    func = unwrap(func)
    filename = getattr(getattr(func, "__code__", None), "co_filename", None)
    kept = filename in linecache.cache
    try:
        source = inspect.getsource(func)
    finally:
        if not kept:
            linecache.cache.pop(filename, None)
    if source[:1] in (" ", "\t"):  # a method: kept as written (dedenting would change its strings)
        return fingerprint_node(ast.parse("if 1:\n" + source).body[0].body[0])
    return fingerprint_node(ast.parse(source).body[0])


def find_package_dir(name):
    """The directory of top-level package ``name`` as ``import`` would find it, without importing.

    Every meta-path finder is asked in turn, so editable installs (setuptools' meta-path finder)
    are found as well as plain ``sys.path`` entries; the shim's own import watcher is skipped,
    since asking it about sglang would activate the shim."""
    import sys

    module = sys.modules.get(name)
    if module is not None and getattr(module, "__path__", None):
        return list(module.__path__)[0]
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None or getattr(finder, "is_npu_shim_watcher", False):
            continue
        try:
            spec = find_spec(name, None)
        except Exception:  # noqa: BLE001 - a broken finder must not break the shim
            continue
        if spec is not None:
            locations = list(spec.submodule_search_locations or ())
            return locations[0] if locations else None
    return None


_VERSION = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?["']([^"']+)["']""", re.M)
_VERSION_TEXT = re.compile(r"[0-9A-Za-z.+!_-]{1,64}")


def module_version(dist_names, package_dir):
    """A package's installed version: its distribution's metadata, else its version file."""
    from importlib import metadata

    for name in dist_names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return read_version(package_dir)


def read_version(package_dir):
    """sglang's version from its source text, or None.  Wheels built by setuptools-scm write it
    to ``_version.py``; ``version.py`` only holds a fallback (``0.0.0.dev0``) or, in older trees,
    the literal version."""
    for name in ("_version.py", "version.py"):
        try:
            match = _VERSION.search(read_source(os.path.join(package_dir, name)))
        except (OSError, SourceError):
            continue
        if match:
            # a version is a PEP 440 string; anything else (a newline, an escape) is not one
            return match.group(1) if _VERSION_TEXT.fullmatch(match.group(1)) else None
    return None


def unwrap(func):
    """Follow ``__wrapped__`` (functools.wraps decorators, wrapt wrappers) to the defining function."""
    seen = set()
    while hasattr(func, "__wrapped__") and id(func) not in seen:
        seen.add(id(func))
        func = func.__wrapped__
    return func


def live_params(func, is_method):
    """Parameter names of an imported function, in the form ``FunctionInfo.params`` uses."""
    if isinstance(func, (staticmethod, classmethod)):  # before unwrap: 3.10+ gives them __wrapped__
        is_method = isinstance(func, classmethod)
        func = func.__func__
    func = unwrap(func)
    code = func.__code__
    count = code.co_argcount  # includes positional-only parameters
    names = list(code.co_varnames[:count])
    index = count
    kwonly = list(code.co_varnames[index:index + code.co_kwonlyargcount])
    index += code.co_kwonlyargcount
    if is_method and names:
        names = names[1:]
    if code.co_flags & 0x04:  # CO_VARARGS
        names.append("*" + code.co_varnames[index])
        index += 1
    names += kwonly
    if code.co_flags & 0x08:  # CO_VARKEYWORDS
        names.append("**" + code.co_varnames[index])
    return tuple(names)
