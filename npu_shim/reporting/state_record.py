"""Whether this process keeps a state record, and what the runtime hands the writer.

An operator asks for records with ``NPU_SHIM_STATE_DIR``; most processes never set it, so the
writer (npu_shim/reporting/record_writer.py: its thread, the record and the directory checks) is imported
only by the first write the variable asks for.  The runtime calls only this module.
"""

import sys

from npu_shim.core import config
from npu_shim.reporting import metrics

WRITER = "npu_shim.reporting.record_writer"


class Attached:
    """How to read the patches' records, handed over by the runtime once they are decided."""

    source = None        # () -> {patch: {"state", "reason", "details", ...}}, or None
    sglang_path = None
    shim_enabled = True


ATTACHED = Attached()


def attach(source, sglang_path=None, shim_enabled=True):
    ATTACHED.source = source
    ATTACHED.sglang_path = sglang_path
    ATTACHED.shim_enabled = shim_enabled


def write(force=False):
    """Write the record now where one is asked for (record_writer.write, which checks the value);
    never raises.  The shim's gauges in sglang's metrics follow (reporting/metrics.py)."""
    metrics.publish()
    if not config.STATE_DIR.is_set():
        return False
    try:
        from npu_shim.reporting import record_writer
    except Exception:  # noqa: BLE001 - never into the application
        return False
    return record_writer.write(force, ATTACHED)


def touch(now=False):
    """Something in the record changed: rewrite it soon (from the writer's thread), or ``now``."""
    if now:
        write()
        return
    metrics.publish()
    writer = sys.modules.get(WRITER)
    if writer is not None:  # else nothing was written in this process: the first write is synchronous
        writer.touch()


def write_off_record(sglang_path=None):
    """A process where the shim is off (NPU_SHIM_ENABLED=0) still says so in its record."""
    attach(None, sglang_path, shim_enabled=False)
    write()
