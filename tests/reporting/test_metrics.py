"""reporting/metrics.py: the shim's gauges in sglang's multiprocess Prometheus metrics."""
import json
import subprocess
import sys
import textwrap

from npu_shim.reporting import metrics

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[2]
    import prometheus_client  # as sglang does: after the variable is set
    from prometheus_client import CollectorRegistry, multiprocess
    from npu_shim.reporting import metrics

    records = {"zbal": {"state": "applied", "details": {"mode": "mix"}},
               "mla_weight_release": {"state": "applied", "details": {}}}
    metrics.start(lambda: records)
    records["zbal"]["details"]["gva_mib"] = 128          # the lazy heap, later
    records["mla_weight_release"]["details"]["released_mib"] = 1.5
    metrics.publish()
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    out = {}
    for family in registry.collect():
        for s in family.samples:
            out[s.name + json.dumps(s.labels, sort_keys=True)] = s.value
    print(json.dumps(out))
""")


def test_gauges_in_the_multiprocess_directory_follow_later_changes(tmp_path):
    p = subprocess.run([sys.executable, "-c", _CHILD, str(REPO), str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    pid = next(json.loads(k[len("npu_shim_patch_state"):])["pid"]
               for k in got if k.startswith("npu_shim_patch_state"))
    detail = 'npu_shim_patch_detail{"detail": "%s", "patch": "%s", "pid": "%s"}'
    assert got[detail % ("gva_mib", "zbal", pid)] == 128
    assert got[detail % ("released_mib", "mla_weight_release", pid)] == 1.5
    assert not any('"mode"' in k for k in got)  # only numbers are published
    assert got['npu_shim_patch_state{"patch": "zbal", "pid": "%s", "state": "applied"}' % pid] == 1


def test_nothing_is_published_before_sglang_made_its_collector(monkeypatch):
    """publish() before start(): no prometheus_client import, no gauge."""
    monkeypatch.setattr(metrics, "_gauges", None)
    monkeypatch.setattr(metrics, "_source", None)
    before = "prometheus_client" in sys.modules
    metrics.publish()
    assert ("prometheus_client" in sys.modules) == before
    assert metrics._gauges is None


def test_a_source_that_raises_never_reaches_the_application(monkeypatch):
    monkeypatch.setattr(metrics, "_gauges", {"state": None})
    monkeypatch.setattr(metrics, "_source", lambda: 1 / 0)
    monkeypatch.setitem(sys.modules, "prometheus_client", sys.modules.get("prometheus_client") or object())
    metrics.publish()  # no exception
