"""The shim's own target (no patch's): sglang's metrics collectors, where the shim's gauges start
and where its counts are published.

Wherever sglang makes a ``TokenizerMetricsCollector`` (the launcher, with ``--enable-metrics``)
or a ``SchedulerMetricsCollector`` (each scheduler), its ``__init__`` has just imported
``prometheus_client`` after setting ``PROMETHEUS_MULTIPROC_DIR`` -- the order multiprocess metrics
need.  The wrapper calls the original, then ``reporting.metrics.start``
(npu_shim/reporting/metrics.py).

``SchedulerMetricsCollector.log_stats`` is where sglang's scheduler writes its own gauges, from
its loop between batches (before a prefill batch runs, and every ``--decode-log-interval`` decode
batches): the wrapper publishes the shim's values after it, so the count details (how often a
wrapper ran Python) are as current as sglang's own numbers, at no cost on any forward.  A release
whose collector module lacks a class or method is left alone for it (DEBUG line).
"""

from npu_shim.reporting import log, metrics
from npu_shim.runtime.targets import Change, function_wrapper, resolve

#: Where the collectors live: 0.5.7-0.5.9, then 0.5.10 on.
MODULES = ("sglang.srt.metrics.collector", "sglang.srt.observability.metrics_collector")
COLLECTORS = ("TokenizerMetricsCollector.__init__", "SchedulerMetricsCollector.__init__")
STATS = "SchedulerMetricsCollector.log_stats"


def prepare(module, source):
    """The Changes wrapping each collector's ``__init__`` and the scheduler's ``log_stats`` in
    ``module``; ``source()`` gives the patches' records."""
    changes = []

    def made(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        try:
            metrics.start(source)
        except Exception as exc:  # noqa: BLE001 - sglang's collector stands whatever happens here
            log.error_once("metrics:start", "publishing the shim's metrics failed: %r" % (exc,))
        return result

    def logged(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        metrics.publish()  # never raises
        return result

    for qualname, wrapper in [(name, made) for name in COLLECTORS] + [(STATS, logged)]:
        try:
            owner, attr, original = resolve(module, qualname)
        except Exception as exc:  # noqa: BLE001 - absent in this release
            log.debug("no %s.%s: %s" % (module.__name__, qualname, exc))
            continue
        if callable(original):
            changes.append(Change(owner, attr, original, function_wrapper(original, wrapper)))
    return changes
