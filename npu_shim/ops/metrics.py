"""The shim's state in sglang's own Prometheus metrics (``--enable-metrics``).

sglang serves ``/metrics`` from the launcher over the multiprocess directory it sets up
(``PROMETHEUS_MULTIPROC_DIR``): every process writes its own values there, the scrape adds them
up.  The shim writes beside them, in each process where sglang itself makes a metrics collector
(the launcher's tokenizer manager, each scheduler; npu_shim/runtime/metrics_hook.py calls
``start``), so it never imports ``prometheus_client`` before sglang has configured it, and no
server of its own is started:

* ``npu_shim_patch_state{patch, state}`` 1 for the state each patch is in;
* ``npu_shim_zbal_heap_bytes`` the zbal heap this process initialised (0: none);
* ``npu_shim_mla_released_bytes`` the MLA weights this process released.

Each is a ``liveall`` gauge: one sample per live process, labelled with its ``pid``.  Values are
written again whenever the state record would be (``staterecord.write`` / ``touch`` call
``publish``), so a heap made later (mix mode) or weights released at the first forward show up.
"""

import sys

MIB = 1 << 20
_gauges = None


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
                "heap": Gauge("npu_shim_zbal_heap_bytes", "npu-shim: the zbal heap this process "
                              "initialised", multiprocess_mode="liveall"),
                "mla": Gauge("npu_shim_mla_released_bytes", "npu-shim: MLA weight bytes this "
                             "process released", multiprocess_mode="liveall"),
            }
        except Exception:  # noqa: BLE001 - sglang's metrics go on without the shim's
            _gauges = {}
    publish()


_source = None


def publish():
    """Write the current values (only once ``start`` ran in this process); never raises."""
    if not _gauges or _source is None or "prometheus_client" not in sys.modules:
        return
    try:
        records = _source() or {}
        for name, record in records.items():
            _gauges["state"].labels(patch=name, state=str(record.get("state"))).set(1)
        details = lambda name: (records.get(name) or {}).get("details") or {}  # noqa: E731
        heap = details("zbal").get("gva_mib")
        _gauges["heap"].set(int(heap) * MIB if isinstance(heap, int) else 0)
        released = details("mla_weight_release").get("released_mib")
        _gauges["mla"].set(round(released * MIB) if isinstance(released, (int, float)) else 0)
    except Exception:  # noqa: BLE001 - never into the application
        pass
