"""Read the running sglang's code from its source files, without importing it.

Probes and target checks ask questions of a ``SourceView`` ("does Scheduler.init_foo
exist?", "what are the parameters of ModelRunner.initialize?").  Answering from the ``.py`` files
means the shim can decide everything about a patch before the first target module executes (all
or nothing), ``python -m npu_shim status`` can answer without importing sglang, and the test suite
can ask the same questions of every released wheel.

Each module a question is asked of is parsed once, whole, with ``ast``; the answers come from that
tree.

Files are decoded the way Python imports them (PEP 263 coding cookie, UTF-8 BOM); a file that
cannot be decoded or parsed raises ``SourceError`` with a one-line reason,
which leaves the patch that asked ``unsupported``.

What applying asks of the loaded code, and what deciding shares with it (reading a file, the
fingerprint of a def), is in npu_shim/source/reading.py: this module is needed only while deciding.
"""

import ast
import os
import re

from npu_shim.source.reading import fingerprint_node, parse_source, read_source, read_version


class FunctionInfo:
    """A function or method as written in the source."""

    __slots__ = ("qualname", "params", "first_line", "_node", "_fingerprint")

    def __init__(self, qualname, params, node):
        self.qualname = qualname
        self.params = params            # parameter names, ``self``/``cls`` left out for methods
        # The def's first line in the file (its first decorator's), as its code's co_firstlineno.
        self.first_line = (node.decorator_list[0] if node.decorator_list else node).lineno
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


def _is_static(node):
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)


def walk_block(body):
    """Top-level statements, looking through if/try blocks (guarded imports, platform branches)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from walk_block(node.body)
            yield from walk_block(node.orelse)
        elif isinstance(node, ast.Try):
            yield from walk_block(node.body)
            for handler in node.handlers:
                yield from walk_block(handler.body)
            yield from walk_block(node.orelse)
            yield from walk_block(node.finalbody)


def _definitions(body):
    """({qualname: FunctionInfo}, {module-level name}) of a module's statements: defs, classes,
    assigned names and imports, looking through if/try blocks."""
    functions, names = {}, set()
    for node in walk_block(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions[node.name] = FunctionInfo(node.name, _params(node.args, False), node)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    qualname = node.name + "." + item.name
                    functions[qualname] = FunctionInfo(qualname, _params(item.args, not _is_static(item)), item)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return functions, names


class ModuleSource:
    """Functions, methods and global names of one module, from its source (parsed once, whole,
    when first asked)."""

    def __init__(self, path, text):
        self.path = path
        self.text = text
        self._whole = None  # (functions, globals) once the module is parsed

    @property
    def functions(self):
        """{qualname: FunctionInfo} of every function and method."""
        return self._parse_whole()[0]

    @property
    def globals(self):
        """Every module-level name."""
        return self._parse_whole()[1]

    def function(self, qualname):
        """The FunctionInfo of ``qualname`` (``f`` or ``Class.method``), or None."""
        return self.functions.get(qualname)

    def has(self, qualname):
        """A function, method or module-level name exists."""
        return qualname in self.functions or qualname in self.globals

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
