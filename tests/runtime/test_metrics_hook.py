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
