"""The shim inside a process that imports sglang: one ``Runtime`` (``RUNTIME``) that hooks,
decides, applies and reverts.

Timeline in a process:
1. ``Runtime.activate`` (first ``import sglang``, handed the start-up watcher that saw it, or
   ``install()``, which hands it the watcher too): wrapt is loaded, the watcher hands every import
   on to the shim's hook table (npu_shim/runtime/finder.py), and a post-import hook is registered
   there on every module any patch may touch.
2. The first of those hooks decides every patch at once (``framework.decide``) from the sglang
   source on disk -- every process reads it itself, a spawned child too -- and logs one summary
   line for the process (``summary.report_all``: each reason at DEBUG, ``unsupported`` at WARNING,
   ``failed`` at ERROR): everything is validated before anything changes.  A spawned child that
   decides while unpickling its target logs that line when the target starts (a scheduler's then
   carries its role: npu_shim/runtime/role.py).
   Where sglang keeps metrics (``--enable-metrics``) the shim's gauges follow every decision
   and application (npu_shim/reporting/metrics.py).
3. Each hook then applies the targets that live in its module -- the shim's own first (the
   scheduler's role, npu_shim/runtime/role.py), undone last, so a patch's wrapper of the same
   function stacks on it -- a target whose loaded code does not match fails its whole patch,
   which is reverted everywhere.
4. ``importlib.reload`` of a patched module (which post-import hooks never see) re-applies its
   targets to the new code, checked like the first time (npu_shim/runtime/finder.py); the new
   changes take over from the old code's, of which only what ``uninstall()`` must still put back
   is kept, held weakly (``decisions.take_over``).
A child made by ``os.fork()`` makes the runtime's and the hook table's locks anew (a thread that held
one in the parent, inside a hook, is not there to release it).
No exception leaves a hook unless strict mode is on or a patch the user explicitly asked for
(``Patch.must_honour``) cannot be applied.
"""

import os
import sys
import threading

from npu_shim.core import loading
from npu_shim.core.framework import APPLIED, FAILED, ShimError
from npu_shim.reporting import log, metrics, procinfo, summary
from npu_shim.runtime import metrics_hook, role, wrapt_loader
from npu_shim.runtime.decisions import (
    decide_each, enforce, note_version, pruned, report_invalid_variables, revert_record,
    running_on_npu, sglang_view, strict, take_over, view_of)
from npu_shim.runtime.finder import ShimFinder, after_fork_in_child
from npu_shim.source.reading import find_package_dir

class Runtime:
    """The shim in this process: the patches, their records, the hooks and their table.  The
    start-up watcher (npu_shim/_bootstrap.py) is handed in by whoever activates (the watcher
    itself, or ``install()``); it is the only meta-path finder of the shim's, and the runtime
    never imports it.  Nothing else reaches into this object's fields.  ``patches``: the
    Patch instances to decide before ``activate`` loads the registry's (a test's own runtime)."""

    def __init__(self, patches=None):
        self.lock = threading.RLock()
        self.installed = False
        self.generation = 0
        self.patches = patches        # loaded Patch instances
        self.records = None           # {name: PatchRecord} once decided
        self.imported_before = set()  # target modules already imported when the shim activated
        self.hooked = set()           # every module a patch may touch
        self.watcher = None           # the start-up watcher, once handed in
        self.own_changes = []         # the shim's own targets' changes (role.py), in order applied
        self.own_replaced = []        # decisions.Replaced: those of code loaded again since
        self.summary_due = None       # the pid whose summary line is still to be said
        self.finder = ShimFinder(self.watches, self.reapply_after_reload)
        after_fork_in_child(self, Runtime.forked)

    def forked(self):
        """In a child made by ``os.fork()``: the lock anew.  A thread that held it in the parent
        (inside an import hook) does not exist here, and the child would wait for it for ever; the
        child goes on with whatever that thread had done when the process forked."""
        self.lock = threading.RLock()

    # -- activation
    def activate_guarded(self, watcher):
        """``activate`` for the import watcher: errors are logged once, raised only in strict mode."""
        try:
            self.activate(watcher)
        except ShimError:
            raise
        except Exception as exc:
            log.error_once("activate", "shim off: activation failed: %r" % (exc,))
            if strict():
                raise ShimError("npu-shim activation failed: %r" % (exc,)) from exc

    def activate(self, watcher):
        """Have ``watcher`` hand imports on to the hook table and register the post-import hooks
        (idempotent within one install)."""
        with self.lock:
            if self.installed:
                return
            self.watcher = watcher
            self.installed = True
            self.generation += 1
            generation = self.generation
            self.patches = loading.load_all()
            self.records = None
            modules = loading.target_modules(self.patches)
            modules += [m for m in (role.MODULE,) + metrics_hook.MODULES if m not in modules]
            self.imported_before = {m for m in modules if m in sys.modules}
            try:
                wrapt_loader.load()  # the wrappers; the post-import hooks are the hook table's
            except Exception as exc:  # noqa: BLE001 - WraptUnavailable, or a bundled build that broke
                self.fail_without_wrapt(str(exc) if isinstance(exc, wrapt_loader.WraptUnavailable)
                                        else "wrapt could not be loaded: %r" % (exc,))
                return
            self.hooked = set(modules)
            self.finder.install(watcher)

        for name in modules:
            # Fires at once for a module that is already imported (install() after sglang).
            self.finder.register(name, self.import_hook(generation))

    def import_hook(self, generation):
        """The post-import hook of one install (``generation``): decides every patch on the first
        call, then applies the targets of the module it is called with."""
        def on_import(module):
            if generation != self.generation or not self.installed:
                return  # an earlier install, since uninstalled
            try:
                with self.lock:
                    if self.records is None:
                        self.decide_all()
                    self.apply_module(module)
            except ShimError:
                raise
            except Exception as exc:
                log.error_once("hook:" + module.__name__, "hook on %s failed: %r" % (module.__name__, exc))
                if strict():
                    raise ShimError("npu-shim hook on %s failed: %r" % (module.__name__, exc)) from exc

        return on_import

    # -- deciding
    def decide_all(self):
        """Decide every patch in a hook (sglang is imported and torch loaded, so the NPU is known),
        log one line each and enforce ``must_honour``/strict mode."""
        self.decide(sglang_view(), running_on_npu())

    def fail_without_wrapt(self, reason):
        """No wrapt: nothing can be wrapped, so say per patch what does not happen (and stop the
        process where the user explicitly asked for a feature, as for any other failure).  Decided
        when ``import sglang`` starts (nothing else can run later): every patch that would apply
        is ``failed`` with the reason."""
        # torch is usually not imported yet at ``import sglang``: the NPU is then unknown (None).
        on_npu = running_on_npu() if "torch" in sys.modules else None
        self.decide(view_of(find_package_dir("sglang")), on_npu, missing_wrapt=reason)

    def decide(self, view, on_npu, missing_wrapt=None):
        """Decide every patch from ``view``, say so, then enforce.  Saying so is three steps --
        sglang's version for the process's lines, the summary line (now, or when a spawned child's
        target starts), the metrics -- each guarded: a patch the user asked for that failed stops
        the process even where one raised, and in strict mode a step that raised stops it too.
        The walk goes one way: each call below returns to this one (the functions of decisions.py
        are handed nothing of the runtime to call back)."""
        self.records = decide_each(self.patches, view, on_npu, missing_wrapt)
        self.summary_due = os.getpid()
        steps = (("noting sglang's version", lambda: note_version(view)),
                 ("the summary line", lambda: self.say_summary_when_due(missing_wrapt)),
                 ("the metrics", metrics.publish))
        failures = [what for what, step in steps if not said(what, step)]
        for record in self.records.values():
            self.enforce(record)
        if failures and strict():
            raise ShimError("npu-shim (strict): publishing the decisions failed: %s" % ", ".join(failures))

    def say_summary_when_due(self, missing_wrapt):
        """The summary line now, or in a spawned child when its target starts (role.py); at once
        where the child-start hook cannot be set or fails."""
        if missing_wrapt is None and role.child_unpickling() and self.hook_child_start():
            return
        self.say_summary()

    def hook_child_start(self):
        """True once the child-start hook is set (role.when_child_starts); False where it cannot
        be, a failure logged: the summary line is then said at once rather than never."""
        try:
            return role.when_child_starts(self.child_starts, self.say_summary)
        except Exception as exc:  # noqa: BLE001 - the line is said now instead
            log.error_once("publish:child-start", "the child-start hook failed: %r" % (exc,))
            return False

    def enforce(self, record):
        """``enforce``, the summary line said first if it is still due (the process stops)."""
        try:
            enforce(record)
        except ShimError:
            self.say_summary()
            raise

    def say_summary(self):
        """The process's summary line (then each reason and invalid variable), once: when the
        patches are decided, or in a spawned child when its target starts (role.py)."""
        with self.lock:
            due, self.summary_due = self.summary_due, None
            if due != os.getpid() or self.records is None:
                return
            summary.report_all(self.records)
            report_invalid_variables(self.records, self.patches)

    def child_starts(self, target):
        """A spawned child is about to run ``target``: the shim's scheduler wrapper says the
        summary itself (with the role); any other target's child says it now."""
        if not any(target is change.replacement for change in self.own_changes):
            procinfo.note_child_target(target)
            self.say_summary()

    # -- applying
    def watches(self, name):
        """A hooked module of a process that decided (the hook table re-applies it after a reload or
        an import again)."""
        return name in self.hooked and self.records is not None

    def apply_module(self, module, imported_before=None):
        name = module.__name__
        if imported_before is None:
            imported_before = name in self.imported_before
        self.apply_own(module, imported_before)
        for record in self.records.values():
            if record.state != APPLIED:
                continue
            targets = [t for t in record.targets if t.module == name]
            try:
                # All of this module's targets are checked against the loaded code before any is set.
                changes = [t.prepare(module) for t in targets]
                # Code loaded again (a reload): its changes take over from the old code's.
                record.changes, record.replaced = take_over(record.changes, record.replaced, changes)
                for target, change in zip(targets, changes):
                    change.apply(imported_before)
                    record.changes.append(change)
                    record.applied.add(target.describe())
            except Exception as exc:  # noqa: BLE001 - any failure while patching reverts the whole patch
                revert_record(record)
                record.state, record.reason = FAILED, "while patching %s: %s" % (name, exc)
                if self.summary_due is None:  # else the summary line, still to come, says it
                    summary.report(record)
                metrics.publish()
                self.enforce(record)
            record.replaced = pruned(record.replaced)
        metrics.publish()

    def apply_own(self, module, imported_before):
        """The shim's own targets in ``module`` (the scheduler's role, the metrics collectors);
        where one cannot be set the patches apply regardless."""
        name, changes = module.__name__, []
        if name == role.MODULE:
            try:
                change = role.prepare(module, self.say_summary)
                change.apply(imported_before)
                changes.append(change)
            except Exception as exc:  # noqa: BLE001 - the patches apply regardless
                log.debug("the scheduler's role comes from its process title: %s" % exc)
        if name in metrics_hook.MODULES:
            try:
                for change in metrics_hook.prepare(module, self.state_snapshot):
                    change.apply(imported_before)
                    changes.append(change)
            except Exception as exc:  # noqa: BLE001 - the patches apply regardless
                log.debug("the shim's metrics are not published: %s" % exc)
        if changes:
            staying, self.own_replaced = take_over(self.own_changes, self.own_replaced, changes)
            self.own_changes = staying + changes
            self.own_replaced = pruned(self.own_replaced)

    def reapply_after_reload(self, module):
        """Re-apply the patches to a hooked module's code after ``importlib.reload`` ran it, or
        after it was imported again once it had left ``sys.modules`` (the hook table's loader calls
        this); a failure is logged, not raised, unless it is the shim's own."""
        try:
            with self.lock:
                if self.records is not None:
                    # Copies other modules took keep the code they took, as after any reload.
                    self.apply_module(module, imported_before=False)
        except ShimError:
            raise
        except Exception as exc:  # noqa: BLE001 - never break the application's reload
            log.error_once("reload:" + module.__name__,
                           "re-applying after reload of %s failed: %r" % (module.__name__, exc))

    # -- install() / uninstall()
    def install(self, watcher):
        """Arm the shim in this process; patches already imported sglang modules in place.  False
        when it is armed or active already."""
        with self.lock:
            if self.installed or (watcher.waiting() and not watcher.says_off_only()):
                return False
            # An explicit install() decides every patch even with NPU_SHIM_ENABLED=0 (each then
            # reads ``disabled``), as it always has; the start-up watcher only says "off".
            watcher.take_over()
            self.watcher = watcher
            if "sglang" in sys.modules:
                self.activate(watcher)
            else:
                watcher.arm()
        return True

    def uninstall(self, watcher):
        """Restore every original (and every rebound copy); the shim is then off in this process."""
        with self.lock:
            watcher.disarm()
            self.finder.uninstall(watcher)
            if self.records:
                for record in self.records.values():
                    revert_record(record)
            for change in reversed(self.own_changes):
                change.revert()
            for replaced in reversed(self.own_replaced):
                replaced.revert()
            self.own_changes, self.own_replaced = [], []
            self.installed = False
            self.generation += 1
            self.records = None
            self.patches = None
        metrics.publish()  # every state 0: nothing of the shim is left in this process

    # -- what the process says
    def decided_records(self):
        """The PatchRecord of every patch, in registry order ([] before the patches are decided)."""
        return list((self.records or {}).values())

    def record(self, name):
        """The PatchRecord of a decided patch, or None."""
        records = self.records
        return records.get(name) if records else None

    def states(self):
        """{patch name: record dict} for this process; empty before sglang's targets are imported."""
        return {name: r.as_dict() for name, r in (self.records or {}).items()}

    def state_snapshot(self):
        """{patch: {"state", "reason", "details", "targets_applied"}} for the metrics."""
        return {name: {"state": r.state, "reason": r.reason, "details": dict(r.details),
                       "targets_applied": "%d/%d" % (len(r.applied), len(r.targets))}
                for name, r in (self.records or {}).items()}


def said(what, step):
    """Run one step of saying the decisions; False when it raised.  A failure is logged once and
    not raised: enforcing, which comes after, must still run."""
    try:
        step()
        return True
    except Exception as exc:  # noqa: BLE001 - enforcing runs whatever happened here
        log.error_once("publish:" + what, "%s failed: %r" % (what, exc))
        return False


RUNTIME = Runtime()
