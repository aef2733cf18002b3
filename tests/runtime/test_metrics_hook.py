"""runtime/metrics_hook.py: the shim's gauges start where sglang makes its metrics collector."""
import types

from npu_shim.reporting import metrics
from npu_shim.runtime import metrics_hook


def _collector_module(name):
    module = types.ModuleType(name)
    made = []

    class TokenizerMetricsCollector:
        def __init__(self, labels):
            made.append(labels)

    module.TokenizerMetricsCollector = TokenizerMetricsCollector
    return module, made


def test_the_collector_is_made_then_the_gauges_start(monkeypatch):
    module, made = _collector_module(metrics_hook.MODULES[1])
    started = []
    monkeypatch.setattr(metrics, "start", lambda source: started.append(source()))
    changes = metrics_hook.prepare(module, lambda: {"zbal": {"state": "applied"}})
    assert len(changes) == 1  # only the class this module has
    for change in changes:
        change.apply(False)
    module.TokenizerMetricsCollector({"a": 1})
    assert made == [{"a": 1}] and started == [{"zbal": {"state": "applied"}}]
    for change in changes:
        change.revert()
    assert not hasattr(module.TokenizerMetricsCollector.__init__, "__wrapped__")


def test_a_failing_start_leaves_sglangs_collector_standing(monkeypatch):
    module, made = _collector_module(metrics_hook.MODULES[0])

    def boom(source):
        raise RuntimeError("no")

    monkeypatch.setattr(metrics, "start", boom)
    (change,) = metrics_hook.prepare(module, dict)
    change.apply(False)
    module.TokenizerMetricsCollector("x")
    assert made == ["x"]
    change.revert()


def test_the_wrapper_hands_the_collectors_arguments_and_result_through(monkeypatch):
    """The wrapper stands between sglang and its own ``__init__``: positional and keyword arguments
    reach it, and what it returns is returned."""
    module = types.ModuleType(metrics_hook.MODULES[1])
    seen = []

    class SchedulerMetricsCollector:
        def __init__(self, labels, *, enable=False):
            seen.append((labels, enable))
            return "result"

    module.SchedulerMetricsCollector = SchedulerMetricsCollector
    monkeypatch.setattr(metrics, "start", lambda source: None)
    (change,) = metrics_hook.prepare(module, dict)
    assert (change.owner, change.attr) == (SchedulerMetricsCollector, "__init__")
    assert change.original is SchedulerMetricsCollector.__dict__["__init__"] is not change.replacement
    change.apply(False)
    collector = SchedulerMetricsCollector.__new__(SchedulerMetricsCollector)
    assert SchedulerMetricsCollector.__init__(collector, {"tp": 0}, enable=True) == "result"
    assert seen == [({"tp": 0}, True)]
    change.revert()
    assert SchedulerMetricsCollector.__dict__["__init__"] is change.original


def test_a_release_without_a_collector_is_said_at_debug_and_the_next_one_still_wrapped(monkeypatch):
    module = types.ModuleType(metrics_hook.MODULES[0])

    class SchedulerMetricsCollector:
        def __init__(self):
            pass

    module.SchedulerMetricsCollector = SchedulerMetricsCollector
    debug = []
    monkeypatch.setattr(metrics_hook.log, "debug", debug.append)
    (change,) = metrics_hook.prepare(module, dict)
    assert change.owner is SchedulerMetricsCollector
    assert debug == ["no sglang.srt.metrics.collector.TokenizerMetricsCollector.__init__: module "
                     "'sglang.srt.metrics.collector' has no attribute 'TokenizerMetricsCollector'"]


def test_a_collector_without_an_init_of_its_own_is_left_alone():
    module = types.ModuleType(metrics_hook.MODULES[1])
    module.TokenizerMetricsCollector = type("TokenizerMetricsCollector", (), {})
    assert metrics_hook.prepare(module, dict) == []


def test_a_failing_start_is_said_once_per_process_under_one_key(monkeypatch):
    """``log.error_once`` keeps it to one line a process: each failure reaches it with the same key."""
    module, made = _collector_module(metrics_hook.MODULES[1])
    errors = []

    def boom(source):
        raise RuntimeError("port in use")

    monkeypatch.setattr(metrics, "start", boom)
    monkeypatch.setattr(metrics_hook.log, "error_once", lambda key, message: errors.append((key, message)))
    (change,) = metrics_hook.prepare(module, dict)
    change.apply(False)
    module.TokenizerMetricsCollector("a")
    module.TokenizerMetricsCollector("b")
    change.revert()
    assert made == ["a", "b"]
    assert errors == [("metrics:start", "publishing the shim's metrics failed: RuntimeError('port in use')")] * 2


def test_the_schedulers_stats_log_publishes_the_counts_after_sglangs_own_values(monkeypatch):
    """The count details (a wrapper's calls) are written when sglang's scheduler logs its stats,
    from its loop between batches -- never from a forward: after sglang's own ``log_stats``."""
    module = types.ModuleType(metrics_hook.MODULES[1])
    order = []

    class SchedulerMetricsCollector:
        def __init__(self):
            pass

        def log_stats(self, stats):
            order.append(("sglang", stats))
            return "logged"

    module.SchedulerMetricsCollector = SchedulerMetricsCollector
    monkeypatch.setattr(metrics, "publish", lambda: order.append("shim"))
    monkeypatch.setattr(metrics, "start", lambda source: order.append("start"))
    changes = metrics_hook.prepare(module, dict)
    assert [(c.owner, c.attr) for c in changes] == [(SchedulerMetricsCollector, "__init__"),
                                                    (SchedulerMetricsCollector, "log_stats")]
    for change in changes:
        change.apply(False)
    assert SchedulerMetricsCollector().log_stats({"tok/s": 1}) == "logged"
    assert order == ["start", ("sglang", {"tok/s": 1}), "shim"]
    for change in changes:
        change.revert()
    assert SchedulerMetricsCollector.__dict__["log_stats"] is changes[1].original


def test_the_stats_log_wrapper_hands_keyword_arguments_and_the_result_through(monkeypatch):
    """sglang's scheduler may pass ``log_stats`` its arguments by keyword: they reach its own method,
    what it returns is returned, and the shim's counts are published after it."""
    module = types.ModuleType(metrics_hook.MODULES[0])
    seen = []

    class SchedulerMetricsCollector:
        def log_stats(self, stats, *, step=None):
            seen.append((stats, step))
            return "logged"

    module.SchedulerMetricsCollector = SchedulerMetricsCollector
    monkeypatch.setattr(metrics, "publish", lambda: seen.append("shim"))
    (change,) = metrics_hook.prepare(module, dict)
    assert (change.owner, change.attr) == (SchedulerMetricsCollector, "log_stats")
    change.apply(False)
    assert SchedulerMetricsCollector().log_stats(stats={"tok/s": 1}, step=3) == "logged"
    assert seen == [({"tok/s": 1}, 3), "shim"]
    change.revert()
