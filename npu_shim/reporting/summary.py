"""What a process says about the shim: its one summary line and each patch's reason (log)."""

from npu_shim.core.framework import FAILED, UNSUPPORTED, Details
from npu_shim.reporting import log


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
    parts = record.patch.report.summary(Details(record.details))
    return "(%s)" % ", ".join(parts) if parts else ""


def summary_line(records):
    return " ".join("%s=%s%s" % (name, record.state, short_details(record))
                    for name, record in records.items())


def report_all(records):
    """The process's summary line at INFO (tagged by the log handler with versions, pid and role:
    ``[npu-shim VERSION sglang VERSION pid PID tp 3/16] NAME=STATE(DETAILS) ...``), then each
    patch's reason (``report``)."""
    log.info(summary_line(records),
             fields={"event": "summary",
                     "states": {name: record.state for name, record in records.items()},
                     "reasons": {name: record.reason for name, record in records.items()}})
    for record in records.values():
        report(record)
