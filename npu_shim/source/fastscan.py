"""A def, or a module-level name, read from its own lines of a module's text, without parsing
the module (``codeview`` parses the whole module where these cannot be sure).

sglang's target functions live in its largest files (scheduler.py, model_runner.py,
utils/common.py); parsing them whole costs every process that decides more than reading the
few defs it needs (scripts/bench_shim_cost.py).  Here:

* ``locate_def`` finds the lines of ``f`` or ``Class.method`` by their text -- one class header and
  one def header at the class body's indentation, outside any triple-quoted string, with
  single-line decorators above and a statement ended before them -- and ``parse_def`` parses
  those lines alone: the decorators and signature (``body=False``: the parameters), or the whole
  def (its fingerprint);
* ``assigned_at_top`` / ``assigned_in_top_block``: a column-0 assignment after a finished
  statement, or the one module-level if/try statement that assigns the name, parsed alone;
* ``may_define``: a sure "absent" from the text alone.

Every answer is one the whole parse would give, or "not sure" (None / False): the name defined
twice or inside an ``if``, a decorator spanning lines, tabs, a column-0 line inside the def.
tests/source/test_fastscan.py and tests/source/test_codeview.py hold them to the whole parse, on hand-made
hostile sources and on every function of every module the patches read in every release.
"""

import ast
import bisect
import re


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


def defined_names(body):
    """Every module-level name ``body`` (a module's statements) defines: defs, classes, assigned
    names and imports, looking through if/try blocks as ``walk_block`` does."""
    names = set()
    for node in walk_block(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def may_define(text, name, function):
    """False when ``text`` cannot define ``name``: no ``def name(`` for a function or method, the
    name nowhere at all for any other (a sure "absent" without parsing)."""
    if name not in text:
        return False
    return not function or any(after_def(text, at) and _OPENS.match(text, at + len(name))
                               for at in words(text, name))


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


class Text:
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


def as_text(text):
    return text if isinstance(text, Text) else Text(text)


# Searched for with str.find and checked around each hit, rather than with a regular expression per
# name: compiling one costs more than the search (and a deciding process looks up dozens).
_OPENS = re.compile(r"\s*\(")                       # after a def's name
_ASSIGNS = re.compile(r"[ ]*(?::[^=\n]*)?=(?!=)")     # after an assigned name: ``= ``, ``: T = ``
_COLUMN_0 = re.compile(r"\n[^ \n#]")                # a line that starts at column 0 (after its \n:
#                                                     a literal first character is found fast)


def _is_word_char(char):
    return char.isalnum() or char == "_"


def words(text, name, begin=0, stop=None):
    """Positions of ``name`` in text[begin:stop] as a whole word."""
    stop = len(text) if stop is None else stop
    at = text.find(name, begin, stop)
    while at >= 0:
        end = at + len(name)
        if not (at and _is_word_char(text[at - 1])) and not (end < len(text) and _is_word_char(text[end])):
            yield at
        at = text.find(name, at + 1, stop)


def after_def(text, at):
    """``def`` and whitespace come right before position ``at``."""
    index = at
    while index and text[index - 1].isspace():
        index -= 1
    return index < at and text.endswith("def", 0, index)


def _headers(text, keyword, name, begin=0, stop=None):
    """[(indentation, position of the line)] of every line that starts (after spaces, and
    ``async`` for a def) with ``keyword name``."""
    found = []
    for at in words(text, name, begin, stop):
        line = text.rfind("\n", 0, at) + 1
        head = text[line:at]
        before = head.rstrip(" ")
        if before == head or not before.endswith(keyword):
            continue
        prefix = before[:-len(keyword)]
        if prefix.strip() in ("", "async" if keyword == "def" else ""):
            found.append((len(prefix) - len(prefix.lstrip(" ")), line))
    return found


def assigned_at_top(text, name):
    """True when a line at column 0 assigns ``name`` (``NAME = ...``, ``NAME: T = ...``) outside any
    string and after a line that ends a statement: a module-level assignment for sure."""
    source = as_text(text)
    text = source.text
    for at in words(text, name):
        if (at and text[at - 1] != "\n") or not _ASSIGNS.match(text, at + len(name)) or source.in_string(at):
            continue
        if _follows_a_statement(source.lines, source.line_at(at), 0):
            return True
    return False


# Lines at column 0 that carry on the if/try statement above them rather than start one.
_CARRIES_ON = re.compile(r"(?:else|elif|except|finally)\b")


def assigned_in_top_block(text, name):
    """True when a module-level ``if``/``try`` statement assigns ``name`` in one of its blocks (``try:
    ... use_deepep = True`` / ``except ImportError: use_deepep = False``): that statement, read from
    its own lines, parses alone and defines the name as the whole parse would count it."""
    source = as_text(text)
    text = source.text
    if "\t" in text:
        return False
    for at in words(text, name):
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
        if len(body) == 1 and isinstance(body[0], (ast.If, ast.Try)) and name in defined_names(body):
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


def read_def(text, qualname, body=True):
    """(the FunctionDef of ``qualname`` parsed from its own lines, decorators included; the line
    number its first line has in the file), or None where those lines cannot be told apart for
    certain without parsing the whole module.  ``body=False``: only the decorators and the
    signature are parsed (the node's body is ``pass``).  ``text``: a str, or the module's Text."""
    where = locate_def(as_text(text), qualname)
    node = parse_def(where, body) if where is not None else None
    return (node, where.top + 1) if node is not None else None


class DefLines:
    """Where one def lies in its module's lines: ``top`` (its first decorator, else the def
    line), ``first`` (the def line), ``signature_end`` (the line its signature closes on),
    ``indent``, and ``high`` (where its block -- the module, or the class body -- ends)."""

    __slots__ = ("lines", "name", "top", "first", "signature_end", "indent", "high")

    def __init__(self, lines, name, top, first, signature_end, indent, high):
        self.lines, self.name, self.top, self.first = lines, name, top, first
        self.signature_end, self.indent, self.high = signature_end, indent, high


def locate_def(source, qualname):
    """The DefLines of ``qualname`` (``f`` or ``Class.method``) in ``source`` (a Text), or None
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
    return DefLines(lines, parts[-1], top, first, signature_end, indent, high)


def parse_def(where, body=True):
    """The FunctionDef at ``where`` (a DefLines), or None when its lines do not parse as exactly
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
