"""The answers sglang's source gave, handed from the process that decided to the ones it starts.

Deciding reads about ten sglang modules (the functions it checks are parsed; what that costs:
scripts/bench_shim_cost.py).  The launcher decides first; sglang then spawns its scheduler, detokenizer
and other workers, which would read the same files again.  After deciding, the runtime puts every
answer its view gave (``has``, ``function`` params and -- where it was asked for --
fingerprint, ``module`` exists, ``contains``) and the identity
of every file behind them (path, size, mtime_ns, ctime_ns, inode) into ``NPU_SHIM_SOURCE_ANSWERS``,
which children inherit.  A child answers from there only while every one of those files is still
the file that was read -- ``ctime`` changes with any write and cannot be set back -- and reads the
source for any question, or any file, not covered: an answer is used only where the record lists
the files of its module (the version only where it lists the files it is read from), whatever
else the record holds.  Answers are about code only: each process still decides with its own
environment.
"""

import hashlib
import json
import os

from npu_shim.source.codeview import SourceView
from npu_shim.source.reading import file_identity, remember

ENV = "NPU_SHIM_SOURCE_ANSWERS"
# 2: a function is [params, fingerprint -- null until asked for --, first line in its file]
FORMAT = 2
# The files sglang's version is read from (``reading.read_version``), as modules: the record
# lists their identities like any module's.
VERSION_FILES = ("sglang._version", "sglang.version")


def _identities(package_dir, dotted):
    """The identities of the two files module ``dotted`` may be (``x.py``, ``x/__init__.py``)."""
    base = os.path.join(package_dir, *dotted.split(".")[1:])
    return [file_identity(base + ".py"), file_identity(os.path.join(base, "__init__.py"))]


class FunctionAnswer:
    """What the answers keep of a ``codeview.FunctionInfo``: its parameters, and its fingerprint
    once asked for (a fingerprint needs the whole def parsed; the parameters only its header)."""

    __slots__ = ("qualname", "params", "_view", "_dotted")

    def __init__(self, view, dotted, qualname, params):
        self.qualname = qualname
        self.params = tuple(params)
        self._view = view
        self._dotted = dotted

    @property
    def fingerprint(self):
        return self._view.fingerprint(self._dotted, self.qualname)


class ModuleAnswer:
    """A module that exists; ``contains`` is answered (and recorded) by the view."""

    def __init__(self, view, dotted):
        self._view = view
        self._dotted = dotted

    def contains(self, pattern):
        return self._view.contains(self._dotted, pattern)


class InheritedView(SourceView):
    """A SourceView that records every answer (and the files behind them), and answers from a
    record it was given."""

    def __init__(self, package_dir, record=None):
        record = record or {}
        listed = dict(record.get("files", {}))  # view() found each of them unchanged
        # Only answers about modules whose files the record lists; the rest is read from the source.
        self.answers = {key: answer for key, answer in record.get("answers", {}).items()
                        if _module_of(key) in listed}
        self.files = dict(listed)
        for name in VERSION_FILES:  # their identities before the version is read: a later write shows
            self.files.setdefault(name, _identities(package_dir, name))
        known = all(name in listed for name in VERSION_FILES)
        super().__init__(package_dir, version=record.get("version") if known else None)
        self.reused = bool(self.answers)

    def _ask(self, key, compute):
        if key not in self.answers:
            self.answers[key] = compute()
        return self.answers[key]

    def _load(self, dotted):
        self.files[dotted] = _identities(self.package_dir, dotted)
        return super()._load(dotted)

    def module(self, dotted):
        exists = self._ask("module|" + dotted, lambda: SourceView.module(self, dotted) is not None)
        return ModuleAnswer(self, dotted) if exists else None

    def _source(self, dotted):
        return SourceView.module(self, dotted)

    def contains(self, dotted, pattern):
        digest = hashlib.sha256(pattern.encode()).hexdigest()[:16]
        return self._ask("contains|%s|%s" % (dotted, digest),
                         lambda: self._source(dotted).contains(pattern))

    def has(self, dotted, qualname):
        def compute():
            source = self._source(dotted)
            return source is not None and source.has(qualname)

        return self._ask("has|%s|%s" % (dotted, qualname), compute)

    def _info(self, dotted, qualname):
        source = self._source(dotted)
        return source.function(qualname) if source is not None else None

    def function(self, dotted, qualname):
        def compute():
            info = self._info(dotted, qualname)
            return None if info is None else [list(info.params), None, info.first_line]

        answer = self._ask("function|%s|%s" % (dotted, qualname), compute)
        return None if answer is None else FunctionAnswer(self, dotted, qualname, answer[0])

    def fingerprint(self, dotted, qualname):
        """The fingerprint of a function ``function`` answered for (recorded once computed).  The
        loaded code is checked against it at apply time without reading the file again, while the
        file is the one read (``reading.remember``)."""
        answer = self.answers["function|%s|%s" % (dotted, qualname)]
        if answer[1] is None:
            answer[1] = self._info(dotted, qualname).fingerprint
        identity = next((i for i in self.files.get(dotted, ()) if i), None)
        if identity is not None:
            remember(identity[0], qualname, answer[2], answer[1], identity)
        return answer[1]

    def record(self):
        return {"format": FORMAT, "dir": self.package_dir, "version": self.version,
                "files": self.files, "answers": self.answers}


def _module_of(key):
    """The module an answer's key asks about (``has|sglang.x|f`` -> ``sglang.x``), or None."""
    parts = key.split("|")
    return parts[1] if len(parts) > 1 else None


def _answer_fits(kind, answer):
    """An answer of the shape this format gives to a question of ``kind``."""
    if kind != "function":
        return kind in ("module", "has", "contains") and isinstance(answer, bool)
    return answer is None or (
        type(answer) is list and len(answer) == 3 and type(answer[0]) is list
        and all(isinstance(param, str) for param in answer[0])
        and (answer[1] is None or isinstance(answer[1], str)) and type(answer[2]) is int)


def _well_formed(record):
    """The record's version, answers and files have the shapes this format writes."""
    version, answers, files = record.get("version"), record.get("answers", {}), record.get("files", {})
    if not (version is None or isinstance(version, str)) or type(answers) is not dict or type(files) is not dict:
        return False
    return all(_answer_fits(key.partition("|")[0], answer) for key, answer in answers.items())


def _still_valid(record, package_dir):
    if record.get("format") != FORMAT or record.get("dir") != package_dir or not _well_formed(record):
        return False
    for dotted, identities in record.get("files", {}).items():
        if _identities(package_dir, dotted) != identities:
            return False
    return True


def view(package_dir, environ=None):
    """A view of ``package_dir`` that answers from the inherited record where it still holds."""
    environ = os.environ if environ is None else environ
    raw = environ.get(ENV)
    if raw:
        try:
            record = json.loads(raw)
            if isinstance(record, dict) and _still_valid(record, package_dir):
                return InheritedView(package_dir, record)
        except (ValueError, TypeError, AttributeError):
            pass  # anything odd: read the source, as without a record
    return InheritedView(package_dir)


def export(answering_view, environ=None):
    """Put the view's answers into the environment children inherit (a plain view: nothing)."""
    if not isinstance(answering_view, InheritedView):
        return
    environ = os.environ if environ is None else environ
    environ[ENV] = json.dumps(answering_view.record(), separators=(",", ":"), sort_keys=True)
