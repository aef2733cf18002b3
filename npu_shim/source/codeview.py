"""Read the running sglang's code from its source files, without importing it.

Probes and target checks ask questions of a ``SourceView`` ("does Scheduler.init_foo
exist?", "what are the parameters of ModelRunner.initialize?").  Answering from the ``.py`` files
means the shim can decide everything about a patch before the first target module executes (all
or nothing), ``python -m npu_shim status`` can answer without importing sglang, and the test suite
can ask the same questions of every released wheel.

A function is read from its own lines when they can be told apart without parsing the module,
and a module-level name found the same way (npu_shim/source/fastscan.py).  Where that is not certain, or
where the answer is "not there", the whole module is parsed, once, and answers as before.  Either
way the function's AST is the one the whole parse gives (same fingerprint, same parameters).

Files are decoded the way Python imports them (PEP 263 coding cookie, UTF-8 BOM); a file that
cannot be decoded, or parsed where it has to be, raises ``SourceError`` with a one-line reason,
which leaves the patch that asked ``unsupported``.

``live_params`` answers the signature question for an already imported function (cheap: it reads
``__code__``), so the shim can check the loaded code matches what it decided on.
"""

import ast
import hashlib
import os
import re

from npu_shim.source import fastscan
from npu_shim.core.framework import SourceError  # noqa: F401 - raised here, caught by deciding
from npu_shim.ops.log import one_line


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

    __slots__ = ("qualname", "params", "first_line", "_node", "_fingerprint", "_read_body")

    def __init__(self, qualname, params, node, read_body=None, first_line=None):
        self.qualname = qualname
        self.params = params            # parameter names, ``self``/``cls`` left out for methods
        # The def's first line in the file (its first decorator's), as its code's co_firstlineno.
        self.first_line = _first_line(node) if first_line is None else first_line
        self._node = node
        self._fingerprint = None
        # Where only the def's header was parsed (its parameters): reads the whole def, once its
        # fingerprint is asked for.
        self._read_body = read_body

    @property
    def fingerprint(self):
        """Short hash of the normalised AST of the whole def (computed on first use)."""
        if self._fingerprint is None:
            if self._read_body is not None:
                self._node, self._read_body = self._read_body(), None
            self._fingerprint = fingerprint_node(self._node)
        return self._fingerprint

    def __repr__(self):
        return "FunctionInfo(%s(%s))" % (self.qualname, ", ".join(self.params))


def _first_line(node):
    return (node.decorator_list[0] if node.decorator_list else node).lineno


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


def file_identity(path):
    """[path, size, mtime_ns, ctime_ns, inode] of a file, or None: what says it is still the file
    that was read (``ctime`` changes with any write and cannot be set back)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


# Defs whose fingerprint this process has from their source (deciding, or the answers its parent's
# source gave): {(path, qualname): (first line, fingerprint, file identity)}.
_KNOWN = {}


def remember(path, qualname, first_line, fingerprint, identity):
    """``live_fingerprint`` of the def at ``first_line`` of ``path`` is ``fingerprint`` while the
    file keeps ``identity``."""
    _KNOWN[(path, qualname)] = (first_line, fingerprint, identity)


def live_fingerprint(func):
    """``fingerprint_node`` of an imported function, from the source file it was loaded from:
    known already when this process read that def of that file (``remember``) and the file is
    still the one read; else the def read from its own lines (``fastscan.read_def``) when it starts on the
    line the loaded code says; else through ``inspect``.  The file's lines ``inspect`` reads are
    not left in ``linecache`` (every sglang process would keep them)."""
    import inspect
    import linecache

    func = unwrap(func)
    code = getattr(func, "__code__", None)
    qualname = getattr(func, "__qualname__", "")
    if code is not None:
        known = _KNOWN.get((code.co_filename, qualname))
        if known is not None and known[0] == code.co_firstlineno and known[2] == file_identity(code.co_filename):
            return known[1]
    if code is not None and "<" not in qualname:  # not a lambda, nor a def inside a function
        try:
            found = fastscan.read_def(read_source(code.co_filename), qualname)
        except (OSError, SourceError):
            found = None
        if found is not None and found[1] == code.co_firstlineno:
            return fingerprint_node(found[0])
    filename = getattr(code, "co_filename", None)
    kept = filename in linecache.cache
    try:
        source = inspect.getsource(func)
    finally:
        if not kept:
            linecache.cache.pop(filename, None)
    if source[:1] in (" ", "\t"):  # a method: kept as written (dedenting would change its strings)
        return fingerprint_node(ast.parse("if 1:\n" + source).body[0].body[0])
    return fingerprint_node(ast.parse(source).body[0])


def _is_static(node):
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)


def _definitions(body):
    """({qualname: FunctionInfo}, {module-level name}) of a module's statements."""
    functions = {}
    for node in fastscan.walk_block(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions[node.name] = FunctionInfo(node.name, _params(node.args, False), node)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    qualname = node.name + "." + item.name
                    functions[qualname] = FunctionInfo(qualname, _params(item.args, not _is_static(item)), item)
    return functions, fastscan.defined_names(body)


class ModuleSource:
    """Functions, methods and global names of one module, from its source."""

    def __init__(self, path, text):
        self.path = path
        self.text = text
        self._whole = None  # (functions, globals) once the whole module is parsed
        self._read = {}     # qualname -> FunctionInfo read from its own lines
        self._indexed = None  # fastscan.Text, once the text is read from

    @property
    def functions(self):
        """{qualname: FunctionInfo} of every function and method (parses the whole module)."""
        return self._parse_whole()[0]

    @property
    def globals(self):
        """Every module-level name (parses the whole module)."""
        return self._parse_whole()[1]

    def function(self, qualname):
        """The FunctionInfo of ``qualname`` (``f`` or ``Class.method``), or None."""
        if qualname in self._read:
            return self._read[qualname]
        if self._whole is None:
            if not self._may_define(qualname.rsplit(".", 1)[-1], function=True):
                return None
            where = fastscan.locate_def(self._text(), qualname)
            # The header alone gives the parameters; most functions are asked for nothing else, and
            # the large ones (Scheduler.__init__, ModelRunner.initialize) are most of the text.
            node = fastscan.parse_def(where, body=False) if where is not None else None
            read_body = lambda: fastscan.parse_def(where) or self._whole_def(qualname)  # noqa: E731
            if node is None and where is not None:  # a one-line def: its body is on its header's line
                node, read_body = fastscan.parse_def(where), None
            if node is not None:
                method = "." in qualname
                info = FunctionInfo(qualname, _params(node.args, method and not _is_static(node)), node,
                                    read_body, first_line=where.top + 1)
                self._read[qualname] = info
                return info
        return self.functions.get(qualname)

    def has(self, qualname):
        """A function, method or module-level name exists."""
        if self._whole is None:
            if not self._may_define(qualname.rsplit(".", 1)[-1], function="." in qualname):
                return False
            if "." not in qualname and (fastscan.assigned_at_top(self._text(), qualname)
                                        or fastscan.assigned_in_top_block(self._text(), qualname)):
                return True
        return self.function(qualname) is not None or qualname in self.globals

    def _may_define(self, name, function):
        """False when the text cannot define ``name``: no ``def name(`` for a function or method,
        the name nowhere at all for any other (a sure "absent" without parsing)."""
        return fastscan.may_define(self.text, name, function)

    def _whole_def(self, qualname):
        """The def of ``qualname`` with its body, from the whole parse (its own lines did not parse)."""
        info = self.functions.get(qualname)
        if info is None:
            raise SourceError("%s: %s was read from its header but the module does not define it"
                              % (self.path, qualname))
        return info._node

    def _text(self):
        if self._indexed is None:
            self._indexed = fastscan.Text(self.text)
        return self._indexed

    def _parse_whole(self):
        if self._whole is None:
            self._whole = _definitions(parse_source(self.text, self.path).body)
        return self._whole

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
        return module.function(qualname) if module else None

    def has(self, dotted, qualname):
        """A function, method or module-level name exists."""
        module = self.module(dotted)
        return module is not None and module.has(qualname)


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
