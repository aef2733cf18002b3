"""The shim's own post-import hooks: the table the start-up watcher hands every import on to.

The import system asks every finder in ``sys.meta_path`` about every import (thousands in an
sglang process; scripts/bench_drop_in.py measures what each finder costs), so the shim has one
there, ever: the start-up watcher (the ``npu_shim._bootstrap`` module itself, handed in by the
runtime).  Once the shim is active the watcher hands each import on to ``ShimFinder.find_spec``
(``watcher.hand_on``), which is never in ``sys.meta_path`` itself; ``install()`` after sglang was
imported arms the watcher in that state.  The spec of a hooked module comes from the watcher's
``look_up``, the one walk over the finders after it, with the one recursion guard.
``ShimFinder`` owns the shim's post-import hooks (as dd-trace-py's ModuleWatchdog owns its own):
wrapt gives the shim only its function wrappers, and an application's own
``wrapt.register_post_import_hook`` keeps wrapt's finder, untouched.  It answers almost every
import with a dict lookup or two:

* a module with a hook waiting (``register``): the spec the other finders give, its loader
  wrapped so that the hooks run once the module's code ran (``exec_module``, or a legacy
  loader's ``load_module``); each hook runs once.  A module that fails to import runs none and
  keeps them waiting; a hook for a module imported already runs at once, and for one whose code
  is still running (``install()`` while another thread imports it) when that import finishes;
* ``importlib.reload`` of a hooked module (reload passes the module as ``target``, an import
  does not), or an import again of one whose hooks ran, once it left ``sys.modules`` (a new
  module object): the new code runs, then the runtime re-applies the patches to it.

Hooks run outside the table's lock, with the module's import lock held by the import system
(so a hook may import other hooked modules).  A child made by ``os.fork()`` makes the lock anew
(the watcher's guard is per thread: the child has none of the other threads' lookups).
"""

import os
import sys
import threading
import weakref


class ShimFinder:
    def __init__(self, watches, reapply):
        self._watches = watches  # (name) -> True for a hooked module of a process that decided
        self._reapply = reapply  # (module) -> the patches re-applied to its reloaded code
        self._hooks = {}         # {module name: [hook(module), ...]} waiting for its import
        self._lock = threading.Lock()
        self._ran = set()        # the modules whose hooks ran
        self.watcher = None      # the start-up watcher that hands imports on to this table
        after_fork_in_child(self, ShimFinder.forked)

    def forked(self):
        """In a child made by ``os.fork()``: the lock anew (a thread that held it in the parent is
        not here to release it)."""
        self._lock = threading.Lock()

    def register(self, name, hook):
        """Run ``hook(module)`` once, after module ``name`` is imported -- at once when it is.  A
        module whose code is still running (another thread's import, or one further up this
        thread's: ``__spec__._initializing``, the import system's own mark) is not imported yet:
        its hooks run when that import finishes."""
        with self._lock:
            module = sys.modules.get(name)
            running = module is not None and _initializing(module)
            if module is None or running:
                self._hooks.setdefault(name, []).append(hook)
                if module is None:
                    return
            else:
                self._ran.add(name)
        if running:
            self._when_imported(name, module)
        else:
            hook(module)

    def _when_imported(self, name, module):
        """Run the hooks waiting for ``name`` once the import now running ``module``'s code
        finishes, on the thread that imports it (when its spec's ``_initializing`` is set back);
        at once if it finished meanwhile.  An import that fails leaves them waiting for the next."""
        def finished():
            if sys.modules.get(name) is module:
                self.run_hooks(module)

        if not _watch_initializing(module.__spec__, finished):
            finished()

    def waiting(self):
        """The names of the modules with hooks waiting for their import."""
        with self._lock:
            return sorted(self._hooks)

    def run_hooks(self, module):
        name = getattr(module, "__name__", None)
        with self._lock:
            hooks = self._hooks.pop(name, ())
            self._ran.add(name)
        for hook in hooks:
            hook(module)

    def install(self, watcher):
        """Have the start-up ``watcher`` hand every import on to this table (it goes into
        sys.meta_path where it is not there: ``install()`` after sglang was imported)."""
        self.watcher = watcher
        watcher.hand_on(self.find_spec)

    def uninstall(self, watcher):
        """Out of the imports, and the hooks still waiting dropped (they belong to the install
        that ends: an ``uninstall()``/``install()`` cycle added one more of each otherwise)."""
        watcher.stop_handing_on()
        with self._lock:
            self._hooks.clear()
            self._ran.clear()

    def find_spec(self, fullname, path=None, target=None):
        """What the watcher answers the import system once the shim is active: None, except for a
        hooked module (its spec from the finders after the watcher, the loader wrapped)."""
        if fullname in self._hooks:
            after = self.run_hooks
        elif (target is not None or fullname in self._ran) and self._watches(fullname):
            # A reload, or an import again of a module whose hooks ran: it left sys.modules (a
            # purge, ``mock.patch.dict(sys.modules)``), and its new module object gets the patches.
            after = self._reapply
        else:
            return None
        # None also when asked again by a finder the lookup asked (wrapt's calls importlib.util.find_spec)
        spec = self.watcher.look_up(fullname, path, target)
        if spec is not None:
            _hook_loader(spec, after)
        return spec


def _initializing(module):
    """True while the module's code runs (its import is under way); False once it finished or
    failed, and for a module whose spec has no such mark (made by hand: it counts as imported)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _watch_initializing(spec, finished):
    """Call ``finished()`` when ``spec._initializing`` is set to False (importlib sets it when the
    module's code has run, or failed), the spec's class then put back.  Returns True while the
    watch is set (it is still to fire), False where it is not (it fired already)."""
    base = type(spec)
    if getattr(base, "_npu_shim_watch", False):
        return True  # watched already: the hooks waiting then run, these with them

    def __setattr__(self, attr, value):
        base.__setattr__(self, attr, value)
        if attr == "_initializing" and not value and type(self) is watched:
            object.__setattr__(self, "__class__", base)
            finished()

    watched = type(base.__name__, (base,), {"__setattr__": __setattr__, "_npu_shim_watch": True,
                                            "__module__": base.__module__, "__qualname__": base.__qualname__})
    try:
        spec.__class__ = watched
    except TypeError:  # a spec of a class whose objects cannot change it: the hooks run now
        return False
    if spec._initializing:
        return True
    if type(spec) is watched:  # it finished while the watch was set: nothing will set it again
        object.__setattr__(spec, "__class__", base)
    return False


def after_fork_in_child(owner, method):
    """``method(owner)`` in every child ``os.fork()`` makes, while ``owner`` lives (the callback
    does not keep it alive: tests make many runtimes and finders)."""
    if not hasattr(os, "register_at_fork"):
        return
    ref = weakref.ref(owner)

    def in_child():
        live = ref()
        if live is not None:
            method(live)

    os.register_at_fork(after_in_child=in_child)


def _hook_loader(spec, after):
    """Make ``spec`` run ``after(module)`` once its loader ran the module's code."""
    loader = spec.loader
    if loader is None and spec.submodule_search_locations is not None:
        loader = _namespace_loader(spec)  # what the import system would set (Python < 3.11)
        if loader is not None:
            spec.loader = _NamespaceHookLoader(loader, spec, after)
        return
    if loader is None or isinstance(loader, _Chained):
        return
    if hasattr(loader, "exec_module"):
        spec.loader = _HookLoader(loader, spec, after)
    elif hasattr(loader, "load_module"):
        spec.loader = _LegacyHookLoader(loader, spec, after)


def _namespace_loader(spec):
    """The namespace loader ``importlib._bootstrap._init_module_attrs`` makes for a namespace
    package whose spec has none, made the same way; None where there is no such class."""
    from importlib import _bootstrap_external

    kind = getattr(_bootstrap_external, "NamespaceLoader", None) or \
        getattr(_bootstrap_external, "_NamespaceLoader", None)
    if kind is None:
        return None
    loader = kind.__new__(kind)
    loader._path = spec.submodule_search_locations
    return loader


class _Chained:
    """The found loader, and ``after(module)`` to run once it ran the module's code; the module
    and its spec keep the found loader (no trace of this one)."""

    def __init__(self, loader, spec, after):
        self.loader = loader
        self._spec = spec
        self._after = after

    def __getattr__(self, name):
        return getattr(self.loader, name)


class _HookLoader(_Chained):
    def create_module(self, spec):
        create = getattr(self.loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module):
        _untrace(self, module)
        self.loader.exec_module(module)
        self._after(module)


class _NamespaceHookLoader(_HookLoader):
    def exec_module(self, module):
        if not hasattr(module, "__file__"):
            module.__file__ = None  # as the import system sets it when it makes the loader
        _HookLoader.exec_module(self, module)


class _LegacyHookLoader(_Chained):
    """For a loader with only ``load_module``: the import system calls that when a loader has no
    ``exec_module``, so this one has none either."""

    def load_module(self, fullname):
        _untrace(self, None)  # the import system sets the spec's loader on the module afterwards
        module = self.loader.load_module(fullname)
        _untrace(self, module)
        self._after(module)
        return module


def _untrace(wrapper, module):
    if wrapper._spec.loader is wrapper:
        wrapper._spec.loader = wrapper.loader
    if module is None:
        return
    if getattr(module, "__loader__", None) in (None, wrapper):
        try:
            module.__loader__ = wrapper.loader
        except AttributeError:
            pass
    spec = getattr(module, "__spec__", None)
    if spec is not None and getattr(spec, "loader", None) is wrapper:
        spec.loader = wrapper.loader
