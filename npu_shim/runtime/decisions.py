"""One process's decisions: each patch decided into a ``PatchRecord`` (``decide_each``) from the
sglang source this process reads itself (``view_of``), sglang's version noted for its lines
(``note_version``), what a record must do when it did not apply (``enforce``: stop the process
where the user asked for the patch, or in strict mode), undoing a record's changes
(``revert_record``), and what a reload's changes leave of the old code's (``take_over``,
``Replaced``).  The ``Runtime`` (activation.py) calls these and each returns to it: none is handed
anything of the runtime to call back, so the walk from activation to a wrapper goes one way
(tests/runtime/test_decisions.py holds it).  No module-level state."""

import os
import sys
import weakref

from npu_shim.core import config, framework, loading
from npu_shim.core.framework import FAILED, PROBLEMS, ShimError
from npu_shim.reporting import log, procinfo
from npu_shim.runtime.targets import Change, Wrap, rebind


class PatchRecord:
    """What happened to one patch in this process."""

    def __init__(self, patch, decision):
        self.patch = patch
        self.state = decision.state
        self.reason = decision.reason
        self.targets = decision.targets
        self.changes = []        # targets.Change, in the order applied
        self.replaced = []       # Replaced: changes of code loaded again since (a reload), still to undo
        self.applied = set()     # describe() of targets applied so far
        self.details = decision.details  # what the patch's wrappers report (e.g. MiB released)
        self.process_state = decision.process_state  # what its wrappers share in this process (ctx.process_state)

    def as_dict(self):
        return {
            "name": self.patch.name,
            "state": self.state,
            "reason": self.reason,
            "targets": {t.describe(): t.describe() in self.applied for t in self.targets},
            "wrappers": sorted(t.describe() for t in self.targets
                               if isinstance(t, Wrap) and t.describe() in self.applied),
            "details": dict(self.details),
        }


def strict():
    try:
        return config.STRICT.read()
    except config.ConfigError as exc:
        log.error_once(log.config_key(config.STRICT), "%s (strict mode off)" % exc)
        return False


def report_invalid_variables(records, patches):
    """Each invalid variable once, at activation: those a patch read are in its ``failed`` line
    already; the others (e.g. strict mode, the log level, a switched-off patch's) are said here,
    and so is every ``NPU_SHIM_*`` name the shim does not read (a typo is not silently ignored)."""
    strict()
    log.configure()  # reports a bad log level
    said = " ".join(record.reason for record in records.values())
    variables = loading.all_variables(patches)
    for var in variables:
        try:
            var.read()
        except config.ConfigError as exc:
            if str(exc) not in said:
                log.error_once(log.config_key(var), "%s (ignored)" % exc)
    for name, suggestion in config.unknown_names(variables):
        log.warning_once("unknown:" + name, "%s is not a variable npu-shim reads (ignored)%s"
                         % (name, "; did you mean %s?" % suggestion if suggestion else ""))


def sglang_view():
    package = sys.modules.get("sglang")
    path = getattr(package, "__file__", None)
    return view_of(os.path.dirname(path)) if path else None


def view_of(package_dir):
    """What deciding reads sglang's source through (source/codeview.py), or None without a directory.
    Every process reads it itself: a spawned child is told nothing by its parent."""
    from npu_shim.source.codeview import SourceView

    return SourceView(package_dir) if package_dir else None


def running_on_npu():
    """The same test sglang's ``is_npu()`` makes; torch is loaded by the time a target imports."""
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and hasattr(torch, "npu") and torch.npu.is_available())
    except Exception:  # noqa: BLE001 - a device stack that cannot answer is no NPU to patch for
        return False


def enforce(record):
    """Raise when a patch that did not apply must not be silently skipped."""
    if record.state not in PROBLEMS:
        return
    if record.patch.must_honour(os.environ):
        raise getattr(record.patch, "error", ShimError)(
            "npu-shim: %s was requested but is %s: %s" % (record.patch.name, record.state, record.reason))
    if strict():
        raise ShimError("npu-shim (strict): %s is %s: %s"
                        % (record.patch.name, record.state, record.reason))


def revert_record(record):
    for change in reversed(record.changes):
        change.revert()
    for replaced in reversed(record.replaced):
        replaced.revert()
    record.changes = []
    record.replaced = []
    record.applied = set()


def decide_each(patches, view, on_npu, missing_wrapt):
    """{name: PatchRecord}: every patch decided with ``view``; a patch whose deciding raised is
    ``failed`` (the others are decided regardless)."""
    records = {}
    for patch in patches:
        try:
            decision = framework.decide(patch, view, on_npu=on_npu)
        except Exception as exc:  # noqa: BLE001 - one patch's bug fails that patch alone
            decision = framework.Decision(FAILED, "deciding raised %r" % (exc,))
        if missing_wrapt is not None:
            decision = framework.without_wrapt(decision, missing_wrapt)
        records[patch.name] = PatchRecord(patch, decision)
    return records


def note_version(view):
    """sglang's version for this process's lines (nothing without a view).  The parsed source is
    dropped after this (the view is the caller's): every sglang process keeps only the decisions."""
    if view is not None:
        procinfo.note_sglang_version(view.version)


# -- changes of code loaded again (a reload, an import again after a purge) ---------------------------

_GONE = object()


def _held(obj):
    """A callable that gives ``obj`` back: through a weak reference where it takes one (then
    ``_GONE`` once it is collected), else the object itself."""
    try:
        ref = weakref.ref(obj)
    except TypeError:  # True, a dict, an int: cheap, and held by whoever holds the owner anyway
        return lambda: obj
    return lambda: _GONE if ref() is None else ref()


class Replaced:
    """A change whose target's module was loaded again, the new code changed in its turn: what it
    may still have to put back at ``uninstall()`` -- its owner's attribute, where the owner is not
    the one the new change holds (a class of the old code, the module object a purge left), and
    the module-level copies of its replacement (``from m import f`` taken before the reload) --
    held weakly, so that it keeps none of the old code alive.  It counts while something it would
    put back is there (``alive``)."""

    def __init__(self, change, same_owner):
        self.what = change.what
        self.attr = change.attr
        self.rebind_copies = change.rebind_copies
        self._owner = None if same_owner else _held(change.owner)
        self._replacement = _held(change.replacement)
        # A wrapper holds its original: held through it, the original lives exactly as long.  Any
        # other original (a Replace's: a value, a class of another package) is held, as the
        # change held it: nothing else may.
        through = getattr(change.replacement, "__wrapped__", _GONE) is change.original
        self._original = None if through else (lambda original=change.original: original)

    def _parts(self):
        """(owner or None, original, replacement), or None when there is nothing to put back."""
        replacement = self._replacement()
        owner = None if self._owner is None else self._owner()
        if replacement is _GONE or (owner in (None, _GONE) and not self.rebind_copies):
            return None
        original = replacement.__wrapped__ if self._original is None else self._original()
        return (None if owner is _GONE else owner), original, replacement

    def alive(self):
        return self._parts() is not None

    def revert(self):
        parts = self._parts()
        if parts is None:
            return
        owner, original, replacement = parts
        if owner is not None:
            Change(owner, self.attr, original, replacement, self.rebind_copies).revert()
        elif self.rebind_copies:
            rebind(replacement, original)


def take_over(changes, replaced, new):
    """(changes, replaced) once the ``new`` changes (not applied yet) take over from those in
    ``changes`` of the same targets -- code loaded again (a reload, an import again): each of those
    leaves ``changes`` for ``replaced`` as a ``Replaced``, so that a reload replaces what it reloaded
    rather than adding to it.  An old change that a new one wraps (its replacement is the new one's
    original: the same code changed twice) is no old code, and stays -- unless that replacement is
    a literal (``True``, ``0``, ``None``): reloaded code that sets the same literal is no sign of it.
    ``pruned`` then drops what has nothing left to put back, once the caller holds the old changes
    no more."""
    by_key = {}
    for change in new:
        by_key.setdefault(_key(change), change)
    staying, replaced = [], list(replaced)
    for change in changes:
        successor = by_key.get(_key(change))
        if successor is None or (successor.original is change.replacement
                                 and not isinstance(change.replacement, _LITERALS)):
            staying.append(change)
        else:
            replaced.append(Replaced(change, same_owner=successor.owner is change.owner))
    return staying, replaced


_LITERALS = (bool, int, float, str, bytes, type(None))


def pruned(replaced):
    """The ``Replaced`` that still have something to put back."""
    return [entry for entry in replaced if entry.alive()]


def _key(change):
    """What a change changes, whichever load of the module: its target, or for the shim's own
    changes (which have none) the owner's module and qualified name, and the attribute."""
    if change.what is not None:
        return change.what
    owner = change.owner
    module = owner.__name__ if type(owner).__name__ == "module" else getattr(owner, "__module__", None)
    return (module, getattr(owner, "__qualname__", None), change.attr)
