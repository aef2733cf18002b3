"""The patch model: what a patch declares, how it is decided, applied and reverted.

A feature module under ``npu_shim/patches/`` defines one ``Patch`` subclass that says, in one
place: the upstream PR it backports and the release that has it, its switch and the variables it
reads, a ``probe`` that recognises upstream's own implementation in the running code, and its
``targets``.  ``decide`` turns that into one of the states below using the sglang *source*
(``codeview.SourceView``), before anything is changed; the runtime then applies the targets module
by module as sglang imports them, checking each against the loaded code first.
"""

from npu_shim import config
from npu_shim.codeview import SourceError, live_fingerprint, live_params

APPLIED = "applied"          # backported into the running sglang
UPSTREAM = "upstream"        # stood down: the running sglang has the feature itself
DISABLED = "disabled"        # switched off by its NPU_SHIM_* switch
INACTIVE = "inactive"        # its trigger is not set (e.g. zbal without a size) or no NPU
UNSUPPORTED = "unsupported"  # a target is missing or has a signature the shim does not know
FAILED = "failed"            # an error (bad configuration, or an exception while applying)
STATES = (APPLIED, UPSTREAM, DISABLED, INACTIVE, UNSUPPORTED, FAILED)

_MISSING = object()


class ShimError(RuntimeError):
    """Raised to the application only in strict mode, or when a feature the user explicitly
    configured cannot be honoured (running without it would be silently wrong)."""


class Change:
    """One attribute replaced by a target; knows how to put everything back."""

    def __init__(self, owner, attr, original, replacement, rebind_copies=True):
        self.owner = owner
        self.attr = attr
        self.original = original          # _MISSING when the attribute did not exist
        self.replacement = replacement
        # Copies are found by identity: right for functions, wrong for shared values such as
        # True/False or a dict other code also holds, which must be replaced in place only.
        self.rebind_copies = rebind_copies and original is not _MISSING and _is_module(owner)

    def apply(self, late):
        """``late``: the module was imported before the shim, so copies of it may exist."""
        setattr(self.owner, self.attr, self.replacement)
        if late and self.rebind_copies:
            rebind(self.original, self.replacement, skip=self.owner)

    def revert(self):
        if self.owner.__dict__.get(self.attr, _MISSING) is self.replacement:
            if self.original is _MISSING:
                delattr(self.owner, self.attr)
            else:
                setattr(self.owner, self.attr, self.original)
        if self.rebind_copies:
            # Modules imported after the patch took copies of the replacement (from-imports).
            rebind(self.replacement, self.original, skip=self.owner)


def _is_module(obj):
    return type(obj).__name__ == "module"


def rebind(original, replacement, skip=None):
    """Point every module-level copy of ``original`` (``from m import f``, star imports, aliases)
    at ``replacement``: when the shim arrives after sglang was imported, and when it leaves."""
    import sys

    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if module is skip or not isinstance(namespace, dict):
            continue
        for key, value in list(namespace.items()):
            if value is original:
                namespace[key] = replacement


def resolve(module, qualname):
    """(owner, attribute name, current value or _MISSING) for 'name' or 'Class.name' in module."""
    owner = module
    parts = qualname.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    return owner, parts[-1], owner.__dict__.get(parts[-1], _MISSING)


class Wrap:
    """Wrap a function or method with a wrapt wrapper ``wrapper(wrapped, instance, args, kwargs)``.

    ``signatures`` lists the parameter tuples (``self`` left out) the wrapper was written for;
    any other signature leaves the whole patch ``unsupported``.  A wrapper that re-implements
    (part of) the body also gives ``fingerprints`` ({codeview fingerprint: which releases}): the
    body must then be one of those, in the source and in the loaded code.
    """

    def __init__(self, module, qualname, wrapper, signatures, fingerprints=None):
        self.module = module
        self.qualname = qualname
        self.wrapper = wrapper
        self.signatures = tuple(tuple(s) for s in signatures)
        self.fingerprints = dict(fingerprints) if fingerprints else None

    @property
    def is_method(self):
        return "." in self.qualname

    def describe(self):
        return "%s:%s" % (self.module, self.qualname)

    def _signature_problem(self, params):
        if params in self.signatures:
            return None
        return "%s has signature (%s), known: %s" % (
            self.describe(), ", ".join(params),
            " or ".join("(%s)" % ", ".join(s) for s in self.signatures))

    def _fingerprint_problem(self, fingerprint, where):
        if self.fingerprints is None or fingerprint in self.fingerprints:
            return None
        return "%s differs from the code the shim stands in for (%s fingerprint %s, known: %s)" % (
            self.describe(), where, fingerprint,
            ", ".join("%s (%s)" % item for item in self.fingerprints.items()))

    def check_source(self, view):
        info = view.function(self.module, self.qualname)
        if info is None:
            return "%s not found" % self.describe()
        return self._signature_problem(info.params) or self._fingerprint_problem(info.fingerprint, "source")

    def prepare(self, module):
        """Build the Change for the loaded module, or raise LookupError with the reason."""
        owner, attr, original = resolve(module, self.qualname)
        if original is _MISSING:
            raise LookupError("%s not found in the loaded module" % self.describe())
        problem = self._signature_problem(live_params(original, self.is_method))
        if problem:
            raise LookupError(problem + " (loaded code differs from its source)")
        if self.fingerprints is not None:
            try:
                fingerprint = live_fingerprint(original)
            except (OSError, TypeError, SyntaxError, IndexError) as exc:
                raise LookupError("%s: cannot read the loaded code (%r)" % (self.describe(), exc))
            problem = self._fingerprint_problem(fingerprint, "loaded")
            if problem:
                raise LookupError(problem)
        return Change(owner, attr, original, function_wrapper(original, self.wrapper))


_WRAPPER_CLASSES = []


def function_wrapper(original, wrapper):
    """``wrapt.FunctionWrapper(original, wrapper)`` that pickles and copies like the function it
    wraps (wrapt's own proxies refuse to): by reference to its importable name."""
    if not _WRAPPER_CLASSES:
        _WRAPPER_CLASSES.append(_make_wrapper_class())
    return _WRAPPER_CLASSES[0](original, wrapper)


def _owner_class(function):
    """The class a method was defined in, found by its qualified name (None for a function)."""
    import sys

    owner = sys.modules.get(function.__module__)
    for part in function.__qualname__.split(".")[:-1]:
        owner = getattr(owner, part, None)
    return owner if isinstance(owner, type) else None


def _make_wrapper_class():
    from npu_shim import wrapt_loader

    wrapt = wrapt_loader.load()

    def reduce(self, protocol=None):
        function = self.__wrapped__
        instance = getattr(self, "_self_instance", None)
        if instance is not None:
            return getattr, (instance, function.__name__)  # a bound method, as Python pickles one
        owner = _owner_class(function)
        if owner is not None:
            return getattr, (owner, function.__name__)
        return function.__qualname__  # a module-level name: pickled as a global, like a function

    def deepcopy(self, memo):
        instance = getattr(self, "_self_instance", None)
        if instance is None:
            return self  # functions are atomic to copy.deepcopy
        import copy

        return getattr(copy.deepcopy(instance, memo), self.__wrapped__.__name__)

    methods = {"__reduce__": reduce, "__reduce_ex__": reduce, "__copy__": lambda self: self,
               "__deepcopy__": deepcopy, "__module__": __name__}
    # wrapt's names, so that what reports a wrapper's type (logs, tests) reads the same
    bound = type("BoundFunctionWrapper", (wrapt.BoundFunctionWrapper,), dict(methods))
    return type("FunctionWrapper", (wrapt.FunctionWrapper,),
                dict(methods, __bound_function_wrapper__=bound))


class Replace:
    """Replace a module-level name with ``factory(original)`` (``original`` is None when absent).

    For objects rather than functions: a class imported from another package, a dict entry.
    Only the name in its own module is replaced unless ``rebind_copies`` (then every module-level
    reference to the same object is, as for wrapped functions).
    """

    def __init__(self, module, qualname, factory, must_exist=True, rebind_copies=False):
        self.module = module
        self.qualname = qualname
        self.factory = factory
        self.must_exist = must_exist
        self.rebind_copies = rebind_copies

    def describe(self):
        return "%s:%s" % (self.module, self.qualname)

    def check_source(self, view):
        if view.module(self.module) is None:
            return "module %s not found" % self.module
        if self.must_exist and not view.has(self.module, self.qualname):
            return "%s not found" % self.describe()
        return None

    def prepare(self, module):
        owner, attr, original = resolve(module, self.qualname)
        if original is _MISSING and self.must_exist:
            raise LookupError("%s not found in the loaded module" % self.describe())
        current = None if original is _MISSING else original
        return Change(owner, attr, original, self.factory(current), self.rebind_copies)


class Patch:
    """Base class: a feature module subclasses it and fills in the class attributes."""

    name = ""              # short id used in logs, status and env switches
    title = ""             # one line: what it does
    upstream_pr = ""       # e.g. "sgl-project/sglang#19246"
    upstream_release = ""  # first sglang release that has it, e.g. "0.5.10"
    backport_range = ""    # releases the shim backports it to, e.g. "0.5.7 - 0.5.9"
    remove_when = ""       # when this patch can be deleted
    switch = None          # config.EnvVar that turns it off
    reads = ()             # other config.EnvVar it depends on; a bad value fails the patch
    modules = ()           # every module its targets can live in (hooks are put on these)
    needs_npu = True

    def probe(self, view):
        """Evidence (a short string) that the running sglang already has the feature, else None."""
        raise NotImplementedError

    def trigger(self, environ):
        """Why the patch has nothing to do in this job (inactive), else None."""
        return None

    def targets(self, view, ctx):
        """The Wrap/Replace targets for this release (``ctx``: a DecideContext)."""
        raise NotImplementedError

    def must_honour(self, environ):
        """True when the user explicitly asked for the feature, so that failing to apply it must
        stop the process rather than run silently without it."""
        return False

    def on_revert(self):
        """Reset per-process state the wrappers keep (called by uninstall)."""

    def origin(self):
        return "backport of %s; upstream since %s" % (self.upstream_pr, self.upstream_release)


class DecideContext:
    """What ``Patch.targets`` may consult and say while the patch is being decided."""

    def __init__(self, environ, assume_triggered):
        self.environ = environ                    # None: os.environ (as EnvVar.read takes it)
        self.assume_triggered = assume_triggered  # "would it apply if switched on?"
        self.notes = []                           # appended to the ``applied`` reason
        self.refusal = None                       # set: the patch is ``unsupported`` for this

    def note(self, text):
        self.notes.append(text)

    def refuse(self, reason):
        self.refusal = reason


class Decision:
    def __init__(self, state, reason, targets=()):
        self.state = state
        self.reason = reason
        self.targets = list(targets)

    def __repr__(self):
        return "Decision(%s: %s)" % (self.state, self.reason)


def decide(patch, view, environ=None, on_npu=None, assume_triggered=False):
    """The patch's state for this sglang source and environment; changes nothing.

    ``on_npu`` None means "not known" (static use: the status command, the release matrix);
    ``assume_triggered`` skips the env trigger (to ask "would it apply if switched on?").
    """
    try:
        if not patch.switch.read(environ):
            return Decision(DISABLED, "%s=0" % patch.switch.name)
        for var in patch.reads:
            var.read(environ)
    except config.ConfigError as exc:
        return Decision(FAILED, str(exc))
    if view is None:
        return Decision(UNSUPPORTED, "sglang not found")
    try:
        return _decide_from_source(patch, view, environ, on_npu, assume_triggered)
    except SourceError as exc:  # a file the patch reads does not decode or parse
        return Decision(UNSUPPORTED, str(exc))


def _decide_from_source(patch, view, environ, on_npu, assume_triggered):
    evidence = patch.probe(view)
    if evidence:
        return Decision(UPSTREAM, "sglang %s has it: %s" % (view.version or "?", evidence))
    if not assume_triggered:
        reason = patch.trigger(environ)
        if reason:
            return Decision(INACTIVE, reason)
    if patch.needs_npu and on_npu is False:
        return Decision(INACTIVE, "not running on an NPU (torch.npu is unavailable)")
    ctx = DecideContext(environ, assume_triggered)
    targets = patch.targets(view, ctx)
    if ctx.refusal:
        return Decision(UNSUPPORTED, ctx.refusal)
    problems = [p for p in (t.check_source(view) for t in targets) if p]
    if problems:
        return Decision(UNSUPPORTED, "; ".join(problems))
    reason = patch.origin() + (" (%s)" % "; ".join(ctx.notes) if ctx.notes else "")
    return Decision(APPLIED, reason, targets)


def without_wrapt(decision, reason):
    """A patch that would apply cannot where wrapt is missing: it is ``failed`` with the reason."""
    if decision.state != APPLIED:
        return decision
    return Decision(FAILED, "%s (use an npu-shim bundle: 'python -m npu_shim bundle DIR', or "
                            "install wrapt>=1.14 in the image)" % reason)


def bind_arguments(params, args, kwargs):
    """Map a call's ``args``/``kwargs`` onto a known parameter tuple (as in ``Wrap.signatures``).

    Wrappers use it to read arguments by name without ``inspect``; parameters not passed (left
    to their defaults) are absent from the result.
    """
    bound = dict(zip([p for p in params if not p.startswith("*")], args))
    bound.update(kwargs)
    return bound
