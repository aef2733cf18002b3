"""The shim inside a process that imports sglang: hooks, decisions, applying and reverting.

Timeline in a process:
1. ``activate`` (first ``import sglang``, or ``install()``): wrapt is loaded and a post-import
   hook is registered on every module any patch may touch.
2. The first of those hooks decides every patch at once (``framework.decide``) from the sglang
   source on disk and logs one summary line for the process (``report_all``: each reason at
   DEBUG, ``unsupported`` at WARNING, ``failed`` at ERROR): everything is validated before
   anything changes.  With ``NPU_SHIM_STATE_DIR`` set the process's state record is written then,
   and again whenever it changes (npu_shim/statefile.py).
3. Each hook then applies the targets that live in its module; a target whose loaded code does
   not match fails its whole patch, which is reverted everywhere.
4. ``importlib.reload`` of a patched module (which post-import hooks never see) re-applies its
   targets to the new code, checked like the first time (npu_shim/finder.py).
No exception leaves a hook unless strict mode is on or a patch the user explicitly asked for
(``Patch.must_honour``) cannot be applied.
"""

import os
import sys
import threading

from npu_shim import config, decision_cache, framework, log, procinfo, reporting, statefile, wrapt_loader
from npu_shim.finder import ShimFinder
from npu_shim.framework import APPLIED, FAILED, PROBLEMS, ShimError
from npu_shim.targets import Wrap


class PatchRecord:
    """What happened to one patch in this process."""

    def __init__(self, patch, decision):
        self.patch = patch
        self.state = decision.state
        self.reason = decision.reason
        self.targets = decision.targets
        self.changes = []        # targets.Change, in the order applied
        self.applied = set()     # describe() of targets applied so far
        self.details = decision.details  # what the patch's wrappers report (e.g. MiB released)
        self.process = decision.process  # the wrappers' per-process state (ctx.process)

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


class Runtime:
    def __init__(self):
        self.lock = threading.RLock()
        self.installed = False
        self.generation = 0
        self.patches = None      # loaded Patch instances
        self.records = None      # {name: PatchRecord} once decided
        self.decided_from = None   # "sglang source", or "inherited answers" (decision_cache)
        self.late_modules = set()  # target modules already imported when the shim activated
        self.hooked = set()        # every module a patch may touch


_RT = Runtime()


def strict():
    try:
        return config.STRICT.read()
    except config.ConfigError as exc:
        log.error_once(log.config_key(config.STRICT), "%s (strict mode off)" % exc)
        return False


def report_invalid_variables(records):
    """Each invalid variable once, at activation: those a patch read are in its ``failed`` line
    already; the others (e.g. strict mode, the log level, a switched-off patch's) are said here,
    and so is every ``NPU_SHIM_*`` name the shim does not read (a typo is not silently ignored)."""
    from npu_shim.patches import all_variables

    strict()
    log.configure()  # reports a bad log level
    said = " ".join(record.reason for record in records.values())
    variables = all_variables(_RT.patches)
    for var in variables:
        try:
            var.read()
        except config.ConfigError as exc:
            if str(exc) not in said:
                log.error_once(log.config_key(var), "%s (ignored)" % exc)
    for name, suggestion in config.unknown_names(variables):
        log.warning_once("unknown:" + name, "%s is not a variable npu-shim reads (ignored)%s"
                         % (name, "; did you mean %s?" % suggestion if suggestion else ""))


def load_patches():
    from npu_shim.patches import load_all

    return load_all()


def activate_guarded():
    """``activate`` for the import watcher: errors are logged once, raised only in strict mode."""
    try:
        activate()
    except ShimError:
        raise
    except Exception as exc:  # noqa: BLE001
        log.error_once("activate", "shim off: activation failed: %r" % (exc,))
        if strict():
            raise ShimError("npu-shim activation failed: %r" % (exc,)) from exc


def activate():
    """Register the post-import hooks (idempotent within one install)."""
    with _RT.lock:
        if _RT.installed:
            return
        _RT.installed = True
        _RT.generation += 1
        generation = _RT.generation
        _RT.patches = load_patches()
        _RT.records = None
        from npu_shim.patches import target_modules

        modules = target_modules(_RT.patches)
        _RT.late_modules = {m for m in modules if m in sys.modules}
        try:
            wrapt = wrapt_loader.load()
        except Exception as exc:  # noqa: BLE001 - WraptUnavailable, or a bundled build that broke
            fail_without_wrapt(str(exc) if isinstance(exc, wrapt_loader.WraptUnavailable)
                               else "wrapt could not be loaded: %r" % (exc,))
            return
        _RT.hooked = set(modules)
        _FINDER.take(wrapt_loader.take_import_finder())
        _FINDER.install()

    for name in modules:
        # Fires at once for a module that is already imported (install() after sglang).
        wrapt.register_post_import_hook(_make_hook(generation), name)


def _make_hook(generation):
    def on_import(module):
        if generation != _RT.generation or not _RT.installed:
            return  # an earlier install, since uninstalled
        try:
            with _RT.lock:
                if _RT.records is None:
                    decide_all()
                apply_module(module)
        except ShimError:
            raise
        except Exception as exc:  # noqa: BLE001 - never break the application's import
            log.error_once("hook:" + module.__name__, "hook on %s failed: %r" % (module.__name__, exc))
            if strict():
                raise ShimError("npu-shim hook on %s failed: %r" % (module.__name__, exc)) from exc

    return on_import


def sglang_view():
    package = sys.modules.get("sglang")
    path = getattr(package, "__file__", None)
    if not path:
        return None
    return decision_cache.view(os.path.dirname(path))


def running_on_npu():
    """The same test sglang's ``is_npu()`` makes; torch is loaded by the time a target imports."""
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and hasattr(torch, "npu") and torch.npu.is_available())
    except Exception:  # noqa: BLE001
        return False


def decide_all(view=None, on_npu=None, missing_wrapt=None):
    """Decide every patch, log one line each and enforce ``must_honour``/strict mode.

    In the hooks sglang is imported and torch loaded, so the NPU is known.  Without wrapt the
    decision is made when ``import sglang`` starts (nothing else can run later): every patch that
    would apply is ``failed`` with the reason."""
    if missing_wrapt is None:
        view, on_npu = sglang_view(), running_on_npu()
    records = {}
    for patch in _RT.patches:
        try:
            decision = framework.decide(patch, view, on_npu=on_npu)
        except Exception as exc:  # noqa: BLE001
            decision = framework.Decision(FAILED, "deciding raised %r" % (exc,))
        if missing_wrapt is not None:
            decision = framework.without_wrapt(decision, missing_wrapt)
        records[patch.name] = PatchRecord(patch, decision)
    # The parsed source is dropped here (the view is local): every sglang process keeps only
    # the decisions.  Children get the answers the sources gave (decision_cache).
    inherited = getattr(view, "reused", False) and not getattr(view, "_modules", None)  # parsed nothing
    _RT.decided_from = "inherited answers" if inherited else "sglang source"
    if view is not None:
        decision_cache.export(view)
        procinfo.SGLANG_VERSION["value"] = view.version
    _RT.records = records
    reporting.report_all(records)
    report_invalid_variables(records)
    statefile.attach(reporting.state_snapshot, getattr(view, "package_dir", None))
    statefile.write()
    for record in records.values():
        enforce(record)


def fail_without_wrapt(reason):
    """No wrapt: nothing can be wrapped, so say per patch what does not happen (and stop the
    process where the user explicitly asked for a feature, as for any other failure)."""
    from npu_shim.codeview import find_package_dir

    package_dir = find_package_dir("sglang")
    view = decision_cache.view(package_dir) if package_dir else None
    # torch is usually not imported yet at ``import sglang``: the NPU is then unknown (None).
    on_npu = running_on_npu() if "torch" in sys.modules else None
    decide_all(view, on_npu, missing_wrapt=reason)


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


def reapply_after_reload(module):
    """Re-apply the patches to a hooked module's code after ``importlib.reload`` ran it (the
    finder's loader calls this); a failure is logged, not raised, unless it is the shim's own."""
    try:
        with _RT.lock:
            if _RT.records is not None:
                # Copies other modules took keep the code they took, as after any reload.
                apply_module(module, late=False)
    except ShimError:
        raise
    except Exception as exc:  # noqa: BLE001 - never break the application's reload
        log.error_once("reload:" + module.__name__,
                       "re-applying after reload of %s failed: %r" % (module.__name__, exc))


_FINDER = ShimFinder(lambda name: name in _RT.hooked and _RT.records is not None, reapply_after_reload)


def apply_module(module, late=None):
    name = module.__name__
    if late is None:
        late = name in _RT.late_modules
    for record in _RT.records.values():
        if record.state != APPLIED:
            continue
        targets = [t for t in record.targets if t.module == name]
        try:
            # All of this module's targets are checked against the loaded code before any is set.
            changes = [t.prepare(module) for t in targets]
            for target, change in zip(targets, changes):
                change.apply(late)
                record.changes.append(change)
                record.applied.add(target.describe())
        except Exception as exc:  # noqa: BLE001
            revert_record(record)
            record.state, record.reason = FAILED, "while patching %s: %s" % (name, exc)
            reporting.report(record)
            statefile.write()
            enforce(record)
    statefile.write()


def revert_record(record):
    for change in reversed(record.changes):
        change.revert()
    record.changes = []
    record.applied = set()


def record(name):
    """The PatchRecord of a decided patch, or None."""
    records = _RT.records
    return records.get(name) if records else None


def states():
    """{patch name: record dict} for this process; empty before sglang's targets are imported."""
    records = _RT.records
    return {name: r.as_dict() for name, r in (records or {}).items()}
