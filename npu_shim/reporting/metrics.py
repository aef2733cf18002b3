"""The shim's state in sglang's own Prometheus metrics (``--enable-metrics``).

sglang serves ``/metrics`` from the launcher over the multiprocess directory it sets up
(``PROMETHEUS_MULTIPROC_DIR``): every process writes its own values there, the scrape adds them
up.  The shim writes beside them, in each process where sglang itself makes a metrics collector
(the launcher's tokenizer manager, each scheduler; npu_shim/runtime/metrics_hook.py calls
``start``), so it never imports ``prometheus_client`` before sglang has configured it, and no
server of its own is started:

* ``npu_shim_patch_state{patch, state}`` 1 for the state each patch is in;
* ``npu_shim_patch_detail{patch, detail}`` each number a patch's details hold (a heap's size,
  the bytes a patch released, ...), as the state record has them; docs/operations.md lists them.

Each is a ``liveall`` gauge: one sample per live process, labelled with its ``pid``.  Values are
written again whenever the state record would be (``state_record.write`` / ``touch`` call
``publish``), so a heap made later (mix mode) or weights released at the first forward show up.
"""

import sys

_gauges = None
_source = None


def start(source):
    """sglang made its metrics collector in this process: make the shim's gauges and publish.
    ``source()`` gives ``{patch: {"state", "details", ...}}``.  Never raises."""
    global _gauges, _source
    _source = source
    if _gauges is None:
        try:
            from prometheus_client import Gauge

            _gauges = {
                "state": Gauge("npu_shim_patch_state", "npu-shim: 1 for the state each patch is in",
                               ["patch", "state"], multiprocess_mode="liveall"),
                "detail": Gauge("npu_shim_patch_detail", "npu-shim: a number of a patch's details",
                                ["patch", "detail"], multiprocess_mode="liveall"),
            }
        except Exception:  # noqa: BLE001 - sglang's metrics go on without the shim's
            _gauges = {}
    publish()


def publish():
    """Write the current values (only once ``start`` ran in this process); never raises."""
    if not _gauges or _source is None or "prometheus_client" not in sys.modules:
        return
    try:
        for name, record in (_source() or {}).items():
            _gauges["state"].labels(patch=name, state=str(record.get("state"))).set(1)
            for key, value in (record.get("details") or {}).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    _gauges["detail"].labels(patch=name, detail=str(key)).set(value)
    except Exception:  # noqa: BLE001 - never into the application
        pass
