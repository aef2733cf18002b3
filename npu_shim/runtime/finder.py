"""The shim's one meta-path finder while it is active.

The import system asks every finder in ``sys.meta_path`` about every import (thousands in an
sglang process; scripts/bench_drop_in.py measures what each finder costs), so the shim keeps one: the start-up watcher
(``_bootstrap.SglangImportWatcher``, handed in by the runtime) hands each import to ``ShimFinder`` once it fired, and
``ShimFinder`` stands in for wrapt's own post-import finder.  It answers almost every import with
a dict lookup or two:

* a module with a post-import hook waiting: handed to wrapt's finder, kept out of sys.meta_path
  when wrapt is the shim's private copy (``wrapt_loader.take_import_finder``; wrapt's takes a
  lock on every import);
* ``importlib.reload`` of a hooked module (reload passes the module as ``target``, an import
  does not): the new code runs, then the runtime re-applies the patches to it.
"""

import sys


class ShimFinder:
    def __init__(self, watches, reapply):
        self._watches = watches  # (name) -> True for a hooked module of a process that decided
        self._reapply = reapply  # (module) -> the patches re-applied to its reloaded code
        self.pending = {}        # wrapt's {module name: hooks waiting}, once its finder is taken
        self.hook_finder = None  # that finder, kept out of sys.meta_path
        self.watcher = None      # the start-up watcher that hands imports on to this finder

    def take(self, taken):
        if taken is not None:
            self.pending, self.hook_finder = taken

    def install(self, watcher=None):
        """Answer through the start-up ``watcher`` when it fired (it is in sys.meta_path already,
        and a list the import system may be walking right now is not reordered), else from the
        front of sys.meta_path (``install()`` after sglang was imported)."""
        self.watcher = watcher
        if watcher is not None and watcher.fired and watcher in sys.meta_path:
            watcher.then = self.find_spec
        elif self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def uninstall(self, watcher=None):
        if watcher is not None:
            watcher.then = None
        while self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.pending:
            return self.hook_finder.find_spec(fullname, path, target)
        if target is None or not self._watches(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or finder is self.watcher or not hasattr(finder, "find_spec"):
                continue  # (the watcher hands on to this finder)
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ReapplyingLoader(spec.loader, self._reapply)
                return spec
        return None


class _ReapplyingLoader:
    def __init__(self, loader, reapply):
        self.loader = loader
        self._reapply = reapply

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader  # leave no trace of ourselves
        self.loader.exec_module(module)
        self._reapply(module)
