"""Read the running sglang's code from its source files, without importing it.

Probes and target checks ask questions of a ``SourceView`` ("does Scheduler.init_zbal_on_npu
exist?", "what are the parameters of ModelRunner.initialize?").  Answering from the ``.py`` files
means the shim can decide everything about a patch before the first target module executes (all
or nothing), ``python -m npu_shim status`` can answer without importing sglang, and the test suite
can ask the same questions of every released wheel.

A function is read from its own lines when they can be told apart without parsing the module
(``_def_node``): the targets live in sglang's largest files (scheduler.py, model_runner.py,
utils/common.py: ~0.5 MB together), and parsing them whole cost ~100-200 ms in every process that
decides.  A module-level name is found the same way: a column-0 assignment, or the one if/try
statement that assigns it (``_assigned_in_top_block``).  Where that is not certain -- the name defined twice, inside an ``if``, a decorator
spanning lines, a quote count that leaves the def inside a string -- or where the answer is "not
there", the whole module is parsed, once, and answers as before.  Either way the function's AST is
the one the whole parse gives (same fingerprint, same parameters).

Files are decoded the way Python imports them (PEP 263 coding cookie, UTF-8 BOM); a file that
cannot be decoded, or parsed where it has to be, raises ``SourceError`` with a one-line reason,
which leaves the patch that asked ``unsupported``.

``live_params`` answers the signature question for an already imported function (cheap: it reads
``__code__``), so the shim can check the loaded code matches what it decided on.
"""

import ast
import bisect
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
    still the one read; else the def read from its own lines (``_def_node``) when it starts on the
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
            found = _read_def(read_source(code.co_filename), qualname)
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


def _definitions(body):
    """({qualname: FunctionInfo}, {module-level name}) of a module's statements."""
    functions, names = {}, set()
    for node in _walk_block(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions[node.name] = FunctionInfo(node.name, _params(node.args, False), node)
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    qualname = node.name + "." + item.name
                    functions[qualname] = FunctionInfo(qualname, _params(item.args, not _is_static(item)), item)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    names.add(target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.add((alias.asname or alias.name).split(".")[0])
    return functions, names


class ModuleSource:
    """Functions, methods and global names of one module, from its source."""

    def __init__(self, path, text):
        self.path = path
        self.text = text
        self._whole = None  # (functions, globals) once the whole module is parsed
        self._read = {}     # qualname -> FunctionInfo read from its own lines
        self._indexed = None  # _Text, once the fast path reads from the text

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
            where = _locate_def(self._text(), qualname)
            # The header alone gives the parameters; most functions are asked for nothing else, and
            # the large ones (Scheduler.__init__, ModelRunner.initialize) are most of the text.
            node = _parse_def(where, body=False) if where is not None else None
            read_body = lambda: _parse_def(where) or self._whole_def(qualname)  # noqa: E731
            if node is None and where is not None:  # a one-line def: its body is on its header's line
                node, read_body = _parse_def(where), None
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
            if "." not in qualname and (_assigned_at_top(self._text(), qualname)
                                        or _assigned_in_top_block(self._text(), qualname)):
                return True
        return self.function(qualname) is not None or qualname in self.globals

    def _may_define(self, name, function):
        """False when the text cannot define ``name``: no ``def name(`` for a function or method,
        the name nowhere at all for any other (a sure "absent" without parsing)."""
        if name not in self.text:
            return False
        return not function or any(_after_def(self.text, at) and _OPENS.match(self.text, at + len(name))
                                   for at in _words(self.text, name))

    def _whole_def(self, qualname):
        """The def of ``qualname`` with its body, from the whole parse (its own lines did not parse)."""
        info = self.functions.get(qualname)
        if info is None:
            raise SourceError("%s: %s was read from its header but the module does not define it"
                              % (self.path, qualname))
        return info._node

    def _text(self):
        if self._indexed is None:
            self._indexed = _Text(self.text)
        return self._indexed

    def _parse_whole(self):
        if self._whole is None:
            self._whole = _definitions(parse_source(self.text, self.path).body)
        return self._whole

    def contains(self, pattern):
        """True when the source text matches a regular expression (for probes on code, not names)."""
        return re.search(pattern, self.text) is not None


# -- one def from its own lines --------------------------------------------------------------------

def _indent(line):
    return len(line) - len(line.lstrip(" "))


def _quiet(line):
    """A blank or comment-only line: it neither ends a block nor starts a statement."""
    stripped = line.strip()
    return not stripped or stripped.startswith("#")


def _depth(line):
    """Brackets a line opens minus those it closes (strings and comments are not told apart:
    a miscount only makes a check here say no, and the whole module is parsed)."""
    return sum(line.count(c) for c in "([{") - sum(line.count(c) for c in ")]}")


def _follows_a_statement(lines, index, low):
    """True when line ``index`` (a def, its first decorator, an assignment) starts a statement of
    its own: the last line before it in ``lines[low:index]`` that is not blank or a comment, if
    any, leaves no bracket open and does not continue, and the line it closes brackets of
    (``x = f(`` ... ``)``) does not start with ``@`` (a decorator spanning lines, which would
    belong to the def)."""
    index -= 1
    while index >= low and _quiet(lines[index]):
        index -= 1
    if index < low:
        return True
    line = lines[index].rstrip()
    if line.endswith("\\"):
        return False
    depth = _depth(line)
    start = index
    while depth < 0 and start > low:
        start -= 1
        depth += _depth(lines[start])
    return depth == 0 and not lines[start].lstrip().startswith("@")


def _statement_end(lines, index, limit):
    """Index of the line that closes the brackets line ``index`` opens (a class's bases, a def's
    parameters), below ``limit``; None when they stay open."""
    depth = _depth(lines[index])
    while depth > 0 and index + 1 < limit:
        index += 1
        depth += _depth(lines[index])
    return None if depth else index


class _Text:
    """A module's text with what the fast path asks of it: its lines (split once), the line a
    position is on, and whether a position is inside a triple-quoted string (by bisection over
    where the triple quotes are, found once)."""

    __slots__ = ("text", "_lines", "_quote_ends")

    def __init__(self, text):
        self.text = text
        self._lines = self._quote_ends = None

    @property
    def lines(self):
        if self._lines is None:
            self._lines = self.text.split("\n")
        return self._lines

    def line_at(self, position):
        """The index of the line ``position`` is on: the newlines before it (counted: for the few
        positions asked per module, cheaper than an index of every line)."""
        return self.text.count("\n", 0, position)

    def in_string(self, position):
        """True when an odd number of triple quotes of one kind precede ``position`` (a def inside
        a docstring), counted as ``str.count`` counts them."""
        if self._quote_ends is None:
            self._quote_ends = (_ends_of(self.text, '"""'), _ends_of(self.text, "'''"))
        return any(bisect.bisect_right(ends, position) % 2 for ends in self._quote_ends)


def _ends_of(text, quote):
    """Where each occurrence of ``quote`` ends, found left to right without overlaps (as
    ``str.count`` counts them)."""
    ends, at = [], text.find(quote)
    while at >= 0:
        ends.append(at + len(quote))
        at = text.find(quote, at + len(quote))
    return ends


def _as_text(text):
    return text if isinstance(text, _Text) else _Text(text)


# Searched for with str.find and checked around each hit, rather than with a regular expression per
# name: compiling one costs more than the search (~40 us; ~50 names in a deciding process).
_OPENS = re.compile(r"\s*\(")                       # after a def's name
_ASSIGNS = re.compile(r"[ ]*(?::[^=\n]*)?=(?!=)")     # after an assigned name: ``= ``, ``: T = ``
_COLUMN_0 = re.compile(r"\n[^ \n#]")                # a line that starts at column 0 (after its \n:
#                                                     a literal first character is found fast)


def _is_word_char(char):
    return char.isalnum() or char == "_"


def _words(text, name, begin=0, stop=None):
    """Positions of ``name`` in text[begin:stop] as a whole word."""
    stop = len(text) if stop is None else stop
    at = text.find(name, begin, stop)
    while at >= 0:
        end = at + len(name)
        if not (at and _is_word_char(text[at - 1])) and not (end < len(text) and _is_word_char(text[end])):
            yield at
        at = text.find(name, at + 1, stop)


def _after_def(text, at):
    """``def`` and whitespace come right before position ``at``."""
    index = at
    while index and text[index - 1].isspace():
        index -= 1
    return index < at and text.endswith("def", 0, index)


def _headers(text, keyword, name, begin=0, stop=None):
    """[(indentation, position of the line)] of every line that starts (after spaces, and
    ``async`` for a def) with ``keyword name``."""
    found = []
    for at in _words(text, name, begin, stop):
        line = text.rfind("\n", 0, at) + 1
        head = text[line:at]
        before = head.rstrip(" ")
        if before == head or not before.endswith(keyword):
            continue
        prefix = before[:-len(keyword)]
        if prefix.strip() in ("", "async" if keyword == "def" else ""):
            found.append((len(prefix) - len(prefix.lstrip(" ")), line))
    return found


def _assigned_at_top(text, name):
    """True when a line at column 0 assigns ``name`` (``NAME = ...``, ``NAME: T = ...``) outside any
    string and after a line that ends a statement: a module-level assignment for sure."""
    source = _as_text(text)
    text = source.text
    for at in _words(text, name):
        if (at and text[at - 1] != "\n") or not _ASSIGNS.match(text, at + len(name)) or source.in_string(at):
            continue
        if _follows_a_statement(source.lines, source.line_at(at), 0):
            return True
    return False


# Lines at column 0 that carry on the if/try statement above them rather than start one.
_CARRIES_ON = re.compile(r"(?:else|elif|except|finally)\b")


def _assigned_in_top_block(text, name):
    """True when a module-level ``if``/``try`` statement assigns ``name`` in one of its blocks (``try:
    ... use_deepep = True`` / ``except ImportError: use_deepep = False``): that statement, read from
    its own lines, parses alone and defines the name as the whole parse would count it."""
    source = _as_text(text)
    text = source.text
    if "\t" in text:
        return False
    for at in _words(text, name):
        line = text.rfind("\n", 0, at) + 1
        if line == at or text[line:at].strip(" ") or not _ASSIGNS.match(text, at + len(name)):
            continue  # not indented by spaces alone, or not an assignment
        if source.in_string(at):
            continue
        segment = _top_statement(source.lines, source.line_at(at))
        if segment is None:
            continue
        try:
            body = ast.parse(segment).body
        except (SyntaxError, ValueError):
            continue
        if len(body) == 1 and isinstance(body[0], (ast.If, ast.Try)) and name in _definitions(body)[1]:
            return True
    return False


def _top_statement(lines, index):
    """The text of the module-level if/try statement that line ``index`` (indented) is inside, or
    None when its first line is not an ``if``/``try`` that starts a statement of its own."""
    def inside(line):
        return _quiet(line) or line.startswith(" ") or _CARRIES_ON.match(line) is not None

    top = index
    while top >= 0 and inside(lines[top]):
        top -= 1
    if top < 0 or not lines[top].startswith(("if ", "try:")) or not _follows_a_statement(lines, top, 0):
        return None
    end = index + 1
    while end < len(lines) and inside(lines[end]):
        end += 1
    return "\n".join(lines[top:end]) + "\n"


def _def_node(text, qualname, body=True):
    """The FunctionDef of ``qualname`` parsed from its own lines (decorators included), or None
    where those lines cannot be told apart for certain without parsing the whole module.
    ``body=False``: only the decorators and the signature are parsed (the node's body is
    ``pass``)."""
    found = _read_def(text, qualname, body)
    return found[0] if found is not None else None


def _read_def(text, qualname, body=True):
    """``_def_node``'s node and the line number its first line (decorators included) has in the
    file, or None.  ``text``: a str, or the module's _Text."""
    where = _locate_def(_as_text(text), qualname)
    node = _parse_def(where, body) if where is not None else None
    return (node, where.top + 1) if node is not None else None


class _DefLines:
    """Where one def lies in its module's lines: ``top`` (its first decorator, else the def
    line), ``first`` (the def line), ``signature_end`` (the line its signature closes on),
    ``indent``, and ``high`` (where its block -- the module, or the class body -- ends)."""

    __slots__ = ("lines", "name", "top", "first", "signature_end", "indent", "high")

    def __init__(self, lines, name, top, first, signature_end, indent, high):
        self.lines, self.name, self.top, self.first = lines, name, top, first
        self.signature_end, self.indent, self.high = signature_end, indent, high


def _locate_def(source, qualname):
    """The _DefLines of ``qualname`` (``f`` or ``Class.method``) in ``source`` (a _Text), or None
    where its lines cannot be told apart for certain without parsing the whole module."""
    text, lines, line_at = source.text, source.lines, source.line_at
    parts = qualname.split(".")
    if len(parts) > 2 or "\t" in text:  # tabs: indentation widths are not comparable by count
        return None

    low, high = 0, len(lines)  # the block the def must be in: the module, or the class body
    if len(parts) == 2:
        classes = _headers(text, "class", parts[0])
        if len(classes) != 1 or classes[0][0] or source.in_string(classes[0][1]):
            return None  # absent, defined twice, inside an if/try or another class, in a string
        end = _statement_end(lines, line_at(classes[0][1]), len(lines))  # bases may span lines
        if end is None or not lines[end].rstrip().endswith(":"):
            return None
        low = end + 1
        first_in_body = next((i for i in range(low, len(lines)) if not _quiet(lines[i])), None)
        if first_in_body is None or not _indent(lines[first_in_body]):
            return None
        indent = _indent(lines[first_in_body])
        begin = classes[0][1]  # character position of the body: past the class's header lines
        for line in lines[line_at(begin):low]:
            begin += len(line) + 1
        after = _COLUMN_0.search(text, begin - 1)  # the next line at column 0 (begin > 0: a class came first)
        stop = after.start() + 1 if after else len(text)
        high = line_at(stop) if after else len(lines)
        defs = [at for width, at in _headers(text, "def", parts[1], begin, stop) if width == indent]
    else:
        defs = _headers(text, "def", parts[0])
        if any(width for width, _ in defs):
            return None  # maybe defined inside a top-level if/try: the whole parse decides
        defs = [at for _, at in defs]
        indent = 0
    if len(defs) != 1 or source.in_string(defs[0]):
        return None
    first = line_at(defs[0])
    # Decorators: single-line ones directly above.  The line before them must end a statement.
    top = first
    while top - 1 >= low and lines[top - 1].startswith(" " * indent + "@") and _indent(lines[top - 1]) == indent:
        if _depth(lines[top - 1]):
            return None
        top -= 1
    if not _follows_a_statement(lines, top, low):
        return None
    # The signature may span lines (black puts its closing "):" at the def's indentation).
    signature_end = _statement_end(lines, first, high)
    if signature_end is None:
        return None
    return _DefLines(lines, parts[-1], top, first, signature_end, indent, high)


def _parse_def(where, body=True):
    """The FunctionDef at ``where`` (a _DefLines), or None when its lines do not parse as exactly
    that def.  ``body=False``: its decorators and signature only, with ``pass`` for a body (a
    one-line def, whose body is on the signature's line, then does not parse)."""
    lines, indent = where.lines, where.indent
    if body:
        # The body ends before the next line after the signature that is not indented deeper
        # (comments do not count).
        last = where.signature_end
        for i in range(last + 1, where.high):
            if _quiet(lines[i]):
                continue
            if _indent(lines[i]) <= indent:
                break
            last = i
        segment = "\n".join(lines[where.top:last + 1]) + "\n"
    else:
        segment = "\n".join(lines[where.top:where.signature_end + 1]) + "\n" + " " * (indent + 4) + "pass\n"
    if indent:
        segment = "if 1:\n" + segment  # keeps every line as written (docstrings included)
    try:
        tree = ast.parse(segment)
    except (SyntaxError, ValueError):
        return None
    block = tree.body[0].body if indent else tree.body
    if len(tree.body) != 1 or len(block) != 1:
        return None
    node = block[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name != where.name:
        return None
    return node


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
