"""Read the running sglang's code from its source files, without importing it.

Probes and target checks ask questions of a ``SourceView`` ("does Scheduler.init_zbal_on_npu
exist?", "what are the parameters of ModelRunner.initialize?").  Answering from the ``.py`` files
means the shim can decide everything about a patch before the first target module executes (all
or nothing), ``python -m npu_shim status`` can answer without importing sglang, and the test suite
can ask the same questions of every released wheel.  Files are parsed lazily, once each.

Files are decoded the way Python imports them (PEP 263 coding cookie, UTF-8 BOM); a file that
cannot be decoded or parsed raises ``SourceError`` with a one-line reason, which leaves the patch
that asked ``unsupported``.

``live_params`` answers the signature question for an already imported function (cheap: it reads
``__code__``), so the shim can check the loaded code matches what it decided on.
"""

import ast
import hashlib
import os
import re

from npu_shim.log import one_line


class SourceError(ValueError):
    """A source file the shim cannot decode or parse (one line: which file and why)."""


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


class FunctionInfo:
    """A function or method as written in the source."""

    __slots__ = ("qualname", "params", "_node", "_fingerprint")

    def __init__(self, qualname, params, node):
        self.qualname = qualname
        self.params = params            # parameter names, ``self``/``cls`` left out for methods
        self._node = node
        self._fingerprint = None

    @property
    def fingerprint(self):
        """Short hash of the normalised AST of the whole def (computed on first use)."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint_node(self._node)
        return self._fingerprint

    def __repr__(self):
        return "FunctionInfo(%s(%s))" % (self.qualname, ", ".join(self.params))


def _params(args, drop_first):
    names = [a.arg for a in args.posonlyargs + args.args]
    if drop_first and names:
        names = names[1:]
    if args.vararg:
        names.append("*" + args.vararg.arg)
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg:
        names.append("**" + args.kwarg.arg)
    return tuple(names)


def _canonical(node):
    """A text form of an AST that is the same on every Python 3.9+: ``ast.dump`` is not (3.12 added
    ``type_params``, 3.13 changed how empty fields print), so empty fields are left out."""
    if isinstance(node, ast.AST):
        parts = [type(node).__name__]
        for name, value in ast.iter_fields(node):
            if value is None or value == [] or name in ("type_comment", "kind"):
                continue
            parts.append("%s=%s" % (name, _canonical(value)))
        return "(%s)" % " ".join(parts)
    if isinstance(node, list):
        return "[%s]" % ",".join(_canonical(item) for item in node)
    return repr(node)


def fingerprint_node(node):
    """Hash of a def's AST: insensitive to comments, formatting and the Python version that
    parses it; sensitive to any change of the code (docstrings included)."""
    return hashlib.sha256(_canonical(node).encode()).hexdigest()[:16]


def live_fingerprint(func):
    """``fingerprint_node`` of an imported function, from the source file it was loaded from.
    The file's lines ``inspect`` reads are not left in ``linecache`` (every sglang process would
    keep them)."""
    import inspect
    import linecache
    import textwrap

    func = unwrap(func)
    filename = getattr(getattr(func, "__code__", None), "co_filename", None)
    kept = filename in linecache.cache
    try:
        source = textwrap.dedent(inspect.getsource(func))
    finally:
        if not kept:
            linecache.cache.pop(filename, None)
    return fingerprint_node(ast.parse(source).body[0])


def _is_static(node):
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)


def _walk_block(body):
    """Top-level statements, looking through if/try blocks (guarded imports, platform branches)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _walk_block(node.body)
            yield from _walk_block(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _walk_block(node.body)
            for handler in node.handlers:
                yield from _walk_block(handler.body)
            yield from _walk_block(node.orelse)
            yield from _walk_block(node.finalbody)


class ModuleSource:
    """Functions, methods and global names of one module, from its parsed source."""

    def __init__(self, path, text):
        self.path = path
        self.text = text
        tree = parse_source(text, path)
        self.functions = {}
        self.globals = set()
        for node in _walk_block(tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions[node.name] = FunctionInfo(node.name, _params(node.args, False), node)
                self.globals.add(node.name)
            elif isinstance(node, ast.ClassDef):
                self.globals.add(node.name)
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        qualname = node.name + "." + item.name
                        self.functions[qualname] = FunctionInfo(
                            qualname, _params(item.args, not _is_static(item)), item)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        self.globals.add(target.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    self.globals.add((alias.asname or alias.name).split(".")[0])

    def contains(self, pattern):
        """True when the source text matches a regular expression (for probes on code, not names)."""
        return re.search(pattern, self.text) is not None


class SourceView:
    """The sglang source tree rooted at ``package_dir`` (the directory of ``sglang/__init__.py``)."""

    def __init__(self, package_dir, version=None):
        self.package_dir = package_dir
        self.version = version if version is not None else read_version(package_dir)
        self._modules = {}

    def module(self, dotted):
        """ModuleSource for ``sglang.x.y`` or None when the release has no such file."""
        if dotted not in self._modules:
            self._modules[dotted] = self._load(dotted)
        return self._modules[dotted]

    def _load(self, dotted):
        parts = dotted.split(".")
        if parts[0] != "sglang":
            raise ValueError("not an sglang module: %s" % dotted)
        base = os.path.join(self.package_dir, *parts[1:])
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(path):
                return ModuleSource(path, read_source(path))
        return None

    def function(self, dotted, qualname):
        module = self.module(dotted)
        return module.functions.get(qualname) if module else None

    def has(self, dotted, qualname):
        """A function, method or module-level name exists."""
        module = self.module(dotted)
        if module is None:
            return False
        return qualname in module.functions or qualname in module.globals


def find_package_dir(name):
    """The directory of top-level package ``name`` as ``import`` would find it, without importing.

    Every meta-path finder is asked in turn, so editable installs (setuptools' meta-path finder)
    are found as well as plain ``sys.path`` entries; the shim's own import watcher is skipped,
    since asking it about sglang would activate the shim."""
    import sys

    from npu_shim._bootstrap import SglangImportWatcher

    module = sys.modules.get(name)
    if module is not None and getattr(module, "__path__", None):
        return list(module.__path__)[0]
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None or isinstance(finder, SglangImportWatcher):
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
            return match.group(1)
    return None


def version_tuple(text):
    """'0.5.10.post1' -> (0, 5, 10); unknown text -> ()."""
    numbers = []
    for part in (text or "").split("."):
        if not part.isdigit():
            break
        numbers.append(int(part))
    return tuple(numbers)


def unwrap(func):
    """Follow ``__wrapped__`` (functools.wraps decorators, wrapt wrappers) to the defining function."""
    seen = set()
    while hasattr(func, "__wrapped__") and id(func) not in seen:
        seen.add(id(func))
        func = func.__wrapped__
    return func


def live_params(func, is_method):
    """Parameter names of an imported function, in the form ``FunctionInfo.params`` uses."""
    func = unwrap(func)
    if isinstance(func, (staticmethod, classmethod)):
        is_method = isinstance(func, classmethod)
        func = func.__func__
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
