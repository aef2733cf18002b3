"""What a process says about the shim: its one summary line and each patch's reason (log), and the
snapshot its state record is written from (npu_shim/statefile.py)."""

import os

from npu_shim import config, log, procinfo, statefile
from npu_shim.framework import FAILED, UNSUPPORTED


def report(record):
    """One patch's state with its reason: ``failed`` at ERROR, ``unsupported`` at WARNING (both
    always seen), the others at DEBUG (the summary line has their states)."""
    line = "%s: %s (%s)" % (record.patch.name, record.state, record.reason)
    if record.state == FAILED:
        log.error(line)
    elif record.state == UNSUPPORTED:
        log.warning(line)
    else:
        log.debug(line)


def short_details(record):
    """What the summary line adds after a state, from the details the wrappers keep."""
    details = record.details or {}
    parts = []
    if details.get("mode"):
        parts.append(str(details["mode"]))
    if isinstance(details.get("gva_mib"), int):
        parts.append("%d MiB" % details["gva_mib"])
    if details.get("released_mib") is not None:
        parts.append("released %s MiB" % details["released_mib"])
    return "(%s)" % ", ".join(parts) if parts else ""


def summary_line(records):
    return " ".join("%s=%s%s" % (name, record.state, short_details(record))
                    for name, record in records.items())


def report_all(records):
    """The process's summary line at INFO (tagged by the log handler with versions, pid and role:
    ``[npu-shim 0.2.2 sglang 0.5.11 pid 812 tp 3/16] zbal=applied mla_weight_release=applied
    dual_stream_experts=upstream``), then each patch's reason (``report``)."""
    log.info(summary_line(records),
             fields={"event": "summary",
                     "states": {name: record.state for name, record in records.items()},
                     "reasons": {name: record.reason for name, record in records.items()}})
    for record in records.values():
        report(record)


def state_snapshot():
    """{patch: {"state", "reason", "details", "targets_applied"}} for the state record."""
    from npu_shim.runtime import _RT

    records = _RT.records
    return {name: {"state": r.state, "reason": r.reason, "details": dict(r.details),
                   "targets_applied": "%d/%d" % (len(r.applied), len(r.targets))}
            for name, r in (records or {}).items()}


def say_off():
    """The watcher saw ``import sglang`` with the shim off (NPU_SHIM_ENABLED=0): one line, and the
    state record says so too.  Never raises."""
    try:
        from npu_shim.codeview import find_package_dir, read_version

        package_dir = find_package_dir("sglang")
        if package_dir:
            procinfo.SGLANG_VERSION["value"] = read_version(package_dir)
        log.info("off (%s=%s): sglang is not patched in this process"
                 % (config.ENABLED.name, os.environ.get(config.ENABLED.name, "").strip()),
                 fields={"event": "off"})
        statefile.write_off_record(package_dir)
    except Exception as exc:  # noqa: BLE001
        try:
            log.error_once("off", "shim off; could not say more: %r" % (exc,))
        except Exception:  # noqa: BLE001
            pass
