"""One process's decisions: each patch decided into a ``PatchRecord`` (``decide_each``), what a
record must do when it did not apply (``enforce``: stop the process where the user asked for the
patch, or in strict mode), undoing a record's changes, and the steps that publish the decisions
(each guarded: enforcing comes after, whatever they did).  The ``Runtime`` (activation.py) calls
these; nothing here keeps state."""

import os
import sys

from npu_shim.core import config, framework, loading
from npu_shim.core.framework import FAILED, PROBLEMS, ShimError
from npu_shim.reporting import log
from npu_shim.runtime.targets import Wrap


class PatchRecord:
    """What happened to one patch in this process."""

    def __init__(self, patch, decision):
        self.patch = patch
        self.state = decision.state
        self.reason = decision.reason
        self.targets = decision.targets
        self.changes = []        # targets.Change, in the order applied
        self.applied = set()     # describe() of targets applied so far
        self.retired = {}        # describe() of a retired target: its changes, reverted (Runtime.retire)
        self.details = decision.details  # what the patch's wrappers report (e.g. MiB released)
        self.process_state = decision.process_state  # what its wrappers share in this process (ctx.process_state)

    def as_dict(self):
        return {
            "name": self.patch.name,
            "state": self.state,
            "reason": self.reason,
            "targets": {t.describe(): t.describe() in self.applied for t in self.targets},
            "wrappers": sorted(t.describe() for t in self.targets
                               if isinstance(t, Wrap) and t.describe() in self.applied
                               and t.describe() not in self.retired),
            "retired": sorted(self.retired),
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
    """What deciding reads sglang's source through (source/inherited.py), or None without a directory."""
    from npu_shim.source import inherited

    return inherited.view(package_dir) if package_dir else None


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
    record.changes = []
    record.applied = set()
    record.retired = {}  # their originals are back already
    record.details.pop("retired", None)


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


def published(what, step):
    """Run one step of publishing the decisions; False when it raised.  A failure is logged once
    and not raised: enforcing, which comes after, must still run."""
    try:
        step()
        return True
    except Exception as exc:  # noqa: BLE001 - enforce runs whatever happened here
        log.error_once("publish:" + what, "%s failed: %r" % (what, exc))
        return False

