"""What a patch changes: ``Wrap`` (a function or method) and ``Replace`` (a module-level name).

Both say in one vocabulary what the code must still be for the change to be right:

* ``signatures`` (Wrap): the parameter tuples the wrapper was written for;
* ``pins``: ``{(module, qualname): {fingerprint: releases}}`` -- defs whose code the change relies
  on must be code the shim has read (the fingerprints of npu_shim/source/reading.py).  A pin on the target itself is
  checked again in the loaded code, since the wrapper stands in for (part of) that body;
* ``source_has``: ``[(regex, what)]`` the target's module source must match;
* ``requires``: a callable run before the loaded module is changed; it raises (with the reason)
  when an apply-time precondition does not hold (e.g. a package the wrapper imports is missing).

Each is checked on the source before anything changes (``check_source``) and on the loaded
module when its hook fires (``prepare``), which builds the ``Change`` the runtime applies.
"""

from npu_shim.source.reading import SourceError, live_fingerprint, live_params

_MISSING = object()


class Change:
    """One attribute replaced by a target; knows how to put everything back."""

    def __init__(self, owner, attr, original, replacement, rebind_copies=True, what=None):
        self.what = what                  # the target's describe(): what a reload's change takes over
        self.owner = owner
        self.attr = attr
        self.original = original          # _MISSING when the attribute did not exist
        self.replacement = replacement
        # Copies are found by identity: right for functions, wrong for shared values such as
        # True/False or a dict other code also holds, which must be replaced in place only.
        self.rebind_copies = rebind_copies and original is not _MISSING and _is_module(owner)

    def apply(self, imported_before):
        """``imported_before``: the module was imported before the shim, so copies of it may exist."""
        setattr(self.owner, self.attr, self.replacement)
        if imported_before and self.rebind_copies:
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


def _known(pinned):
    return ", ".join("%s (%s)" % item for item in pinned.items())


class Target:
    """What Wrap and Replace share: where the target is and what must hold for it."""

    def __init__(self, module, qualname, pins=None, source_has=(), requires=None):
        self.module = module
        self.qualname = qualname
        self.pins = {key: dict(value) for key, value in (pins or {}).items()}
        self.source_has = tuple(source_has)
        self.requires = requires

    def describe(self):
        return "%s:%s" % (self.module, self.qualname)

    @property
    def own_pin(self):
        return self.pins.get((self.module, self.qualname))

    def check_source(self, view):
        """None when the source is what this target was written for, else why not."""
        for (dotted, qualname), pinned in self.pins.items():
            info = view.function(dotted, qualname)
            if info is None:
                return "%s:%s not found" % (dotted, qualname)
            if info.fingerprint not in pinned:
                return ("%s:%s differs from the code the shim %s (source fingerprint %s, known: %s)"
                        % (dotted, qualname, "stands in for" if (dotted, qualname) == (self.module, self.qualname)
                           else "relies on", info.fingerprint, _known(pinned)))
        for pattern, what in self.source_has:
            source = view.module(self.module)
            if source is None or not source.contains(pattern):
                return "%s: %s not found in the source" % (self.describe(), what)
        return None

    def check_loaded(self, original):
        """Raise LookupError when the loaded code differs from what was decided on."""
        if self.requires is not None:
            self.requires()
        pinned = self.own_pin
        if pinned is None:
            return
        try:
            fingerprint = live_fingerprint(original)
        except (OSError, TypeError, SyntaxError, IndexError, SourceError) as exc:
            raise LookupError("%s: cannot read the loaded code (%r)" % (self.describe(), exc))
        if fingerprint not in pinned:
            raise LookupError("%s differs from the code the shim stands in for (loaded fingerprint "
                              "%s, known: %s)" % (self.describe(), fingerprint, _known(pinned)))


class Wrap(Target):
    """Wrap a function or method with a wrapt wrapper ``wrapper(wrapped, instance, args, kwargs)``;
    ``signatures``: the parameter tuples (``self`` left out) it was written for."""

    def __init__(self, module, qualname, wrapper, signatures, **checks):
        super().__init__(module, qualname, **checks)
        self.wrapper = wrapper
        self.signatures = tuple(tuple(s) for s in signatures)

    @property
    def is_method(self):
        return "." in self.qualname

    def _signature_problem(self, params):
        if params in self.signatures:
            return None
        return "%s has signature (%s), known: %s" % (
            self.describe(), ", ".join(params),
            " or ".join("(%s)" % ", ".join(s) for s in self.signatures))

    def check_source(self, view):
        info = view.function(self.module, self.qualname)
        if info is None:
            return "%s not found" % self.describe()
        return self._signature_problem(info.params) or super().check_source(view)

    def prepare(self, module):
        """The Change for the loaded module, or LookupError (or ``requires``' error) with why not."""
        owner, attr, original = resolve(module, self.qualname)
        if original is _MISSING:
            raise LookupError("%s not found in the loaded module" % self.describe())
        problem = self._signature_problem(live_params(original, self.is_method))
        if problem:
            raise LookupError(problem + " (loaded code differs from its source)")
        self.check_loaded(original)
        return Change(owner, attr, original, function_wrapper(original, self.wrapper), what=self.describe())


class Replace(Target):
    """Replace a module-level name (or class attribute) with ``factory(original)``; ``original``
    is None when absent.  For objects rather than functions (a class imported from another
    package, a dict entry), and for a function on a per-call hot path, replaced by a plain
    function of its pinned parameters (``functools.wraps``: it pickles by name), which costs a
    tenth of a wrapt proxy per call.  Only the name in its own module is replaced unless
    ``rebind_copies``."""

    def __init__(self, module, qualname, factory, must_exist=True, rebind_copies=False, **checks):
        super().__init__(module, qualname, **checks)
        self.factory = factory
        self.must_exist = must_exist
        self.rebind_copies = rebind_copies

    def check_source(self, view):
        if view.module(self.module) is None:
            return "module %s not found" % self.module
        if self.must_exist and not view.has(self.module, self.qualname):
            return "%s not found" % self.describe()
        return super().check_source(view)

    def prepare(self, module):
        owner, attr, original = resolve(module, self.qualname)
        if original is _MISSING and self.must_exist:
            raise LookupError("%s not found in the loaded module" % self.describe())
        self.check_loaded(original)
        current = None if original is _MISSING else original
        return Change(owner, attr, original, self.factory(current), self.rebind_copies, self.describe())


# -- wrappers that pickle and copy like the functions they wrap ------------------------------------
# multiprocessing spawn pickles sglang's functions and bound methods; wrapt's own proxies refuse
# to.  wrapt itself is loaded through ``wrapt_loader`` (the image's, or the bundle's private copy)
# when the first wrapper is built.

_WRAPPER_CLASSES = []


def function_wrapper(original, wrapper):
    """``wrapt.FunctionWrapper(original, wrapper)`` that pickles and copies like the function it
    wraps (wrapt's own proxies refuse to): by reference to its importable name."""
    if not _WRAPPER_CLASSES:
        from npu_shim.runtime import wrapt_loader

        _WRAPPER_CLASSES.append(make_wrapper_class(wrapt_loader.load()))
    return _WRAPPER_CLASSES[0](original, wrapper)


def _owner_class(function):
    """The class a method was defined in, found by its qualified name (None for a function)."""
    import sys

    owner = sys.modules.get(function.__module__)
    for part in function.__qualname__.split(".")[:-1]:
        owner = getattr(owner, part, None)
    return owner if isinstance(owner, type) else None


def make_wrapper_class(wrapt):
    """The shim's FunctionWrapper class over ``wrapt`` (the module wrapt_loader loaded)."""
    def reduce(self, protocol=None):
        function = self.__wrapped__
        instance = self._self_instance  # None unless bound to an instance
        if instance is not None:
            return getattr, (instance, function.__name__)  # a bound method, as Python pickles one
        owner = _owner_class(function)
        if owner is not None:
            return getattr, (owner, function.__name__)
        return function.__qualname__  # a module-level name: pickled as a global, like a function

    def deepcopy(self, memo):
        instance = self._self_instance  # None unless bound to an instance
        if instance is None:
            return self  # functions are atomic to copy.deepcopy
        import copy

        return getattr(copy.deepcopy(instance, memo), self.__wrapped__.__name__)

    methods = {"__reduce__": reduce, "__reduce_ex__": reduce, "__copy__": lambda self: self,
               "__deepcopy__": deepcopy}  # __module__: this module's, as type() gives it
    # wrapt's names, so that what reports a wrapper's type (logs, tests) reads the same
    bound = type("BoundFunctionWrapper", (wrapt.BoundFunctionWrapper,), dict(methods))
    return type("FunctionWrapper", (wrapt.FunctionWrapper,),
                dict(methods, __bound_function_wrapper__=bound))


def bind_arguments(params, args, kwargs):
    """Map a call's ``args``/``kwargs`` onto a known parameter tuple (as in ``Wrap.signatures``).

    Wrappers use it to read arguments by name without ``inspect``; parameters not passed (left
    to their defaults) are absent from the result.
    """
    bound = dict(zip([p for p in params if not p.startswith("*")], args))
    bound.update(kwargs)
    return bound
