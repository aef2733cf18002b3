"""Read the running sglang's code from its source files, without importing it.

Probes and target checks ask questions of a ``SourceView`` ("does Scheduler.init_foo
exist?", "what are the parameters of ModelRunner.initialize?").  Answering from the ``.py`` files
means the shim can decide everything about a patch before the first target module executes (all
or nothing), ``python -m npu_shim status`` can answer without importing sglang, and the test suite
can ask the same questions of every released wheel.

A function is read from its own lines when they can be told apart without parsing the module,
and a module-level name found the same way (npu_shim/source/fastscan.py).  A name the text cannot
define (no ``def name(`` for a function, the name nowhere for any other) is "not there" without
parsing; where the answer is not certain, the whole module is parsed, once, and answers as before.
Either way the function's AST is the one the whole parse gives (same fingerprint, same parameters).

Files are decoded the way Python imports them (PEP 263 coding cookie, UTF-8 BOM); a file that
cannot be decoded, or parsed where it has to be, raises ``SourceError`` with a one-line reason,
which leaves the patch that asked ``unsupported``.

What applying asks of the loaded code, and what deciding shares with it (reading a file, the
fingerprint of a def), is in npu_shim/source/reading.py: this module is needed only while deciding.
"""

import ast
import os
import re

from npu_shim.source import fastscan
from npu_shim.source.reading import SourceError, fingerprint_node, parse_source, read_source, read_version


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
            read_body = lambda: fastscan.parse_def(where) or self._whole_def(qualname)  # noqa: E731 - bound here, read later
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
