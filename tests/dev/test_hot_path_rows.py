"""scripts/bench_hot_path.py's rows (shimdev/bench/hot_path_rows.py) from given measurements (its
plumbing, nothing timed): what a row's result rests on -- the wrapper the caller reaches and the
budget for the first, the outputs and the states for the MoE rows -- and that a measurement that
fails is one line and a problem for bench.py."""
import pytest

from shimdev.bench import bench_rows
from shimdev.bench import hot_path_bench as H
from shimdev.bench import hot_path_rows


@pytest.fixture
def bench():
    return hot_path_rows


def mla(caller=(1100, 1090, 1095), **info):
    facts = dict(state="applied", layers=3, through_wrapper=[True] * 6, released_layers=3, caller_is_wrapper=True,
                 wrapper_type="FunctionWrapper", wrapt="image 2.5.2", c_extension=True)
    facts.update(info)
    return {"info": facts, "ns": {"caller": list(caller), "sglang": [98, 92, 96]}}


def test_the_eager_row_holds_the_budget_through_the_wrapper_the_caller_reaches(bench, monkeypatch):
    monkeypatch.setattr(H, "mla_eager", lambda rounds, calls: mla())
    row = bench.mla_eager_row(3, 1000)
    assert row["ok"] is True and row["measured"] == ("+999 ns (1095 ns through the wrapper vs 96 ns sglang's "
                                                     "function, image 2.5.2)")
    assert row["target"] == "<= 1000 ns per eager call (0 at graph replay: no Python runs there)"
    monkeypatch.setattr(H, "mla_eager", lambda rounds, calls: mla(caller=(1100, 1100, 1100)))
    assert bench.mla_eager_row(3, 1000)["ok"] is False  # +1004 ns: over the budget
    for broken in ({"caller_is_wrapper": False}, {"through_wrapper": [True] * 3 + [False] * 3},
                   {"released_layers": None}, {"state": "failed"}):
        monkeypatch.setattr(H, "mla_eager", lambda rounds, calls, b=broken: mla(**b))
        row = bench.mla_eager_row(3, 1000)
        assert row["ok"] is False and "NOT held" in row["measured"], broken


def moe(arm, state, wrapped, digest="d1", cpu=(300e3, 310e3, 305e3)):
    ns = {"extend": list(cpu), "decode": [c * 0.9 for c in cpu]}
    ns.update({k + "@wall": v for k, v in list(ns.items())})
    return {"info": {"state": state, "wrapped": {"forward_deepep": wrapped}, "params": ["gate.weight"],
                     "digests": {"extend": digest, "decode": "d2"}, "waits": {"extend": 2, "decode": 0},
                     "calls": {"extend": 154.0 if arm == "shim" else 152.0, "decode": 80.0},
                     "tokens": 16, "hidden": 16}, "ns": ns}


def test_the_moe_rows_hold_the_ratio_the_outputs_and_the_states(bench, monkeypatch):
    runs = {"shim": moe("shim", "applied", "FunctionWrapper"),
            "upstream": moe("upstream", "upstream", "function", cpu=(280e3, 300e3, 290e3)),
            "off": moe("off", "off", "function")}
    monkeypatch.setattr(H, "dual_stream", lambda rounds, calls, tokens: runs)
    extend, decode = bench.moe_rows(3, 10)
    assert extend["what"] == bench.WHAT_EXTEND and decode["what"] == bench.WHAT_DECODE
    assert extend["measured"].startswith("305.0 us vs 290.0 us = 1.052x") and extend["ok"] is False
    assert "function calls per layer call 154 vs 152" in extend["measured"]
    assert "outputs equal bit for bit (all three): yes" in extend["measured"]
    runs["upstream"] = moe("upstream", "upstream", "function", digest="other")
    extend, _ = bench.moe_rows(3, 10)
    assert "outputs equal bit for bit (all three): NO" in extend["measured"] and extend["ok"] is False
    runs["upstream"] = moe("upstream", "applied", "FunctionWrapper", cpu=(400e3,) * 3)
    extend, _ = bench.moe_rows(3, 10)
    assert extend["ok"] is False and "0.5.10: dual_stream_experts applied" in extend["measured"]


def test_a_measurement_that_fails_is_one_line_each_row_and_a_problem(bench, monkeypatch):
    def boom(*args):
        raise H.interleave.WorkerError("sglang 0.5.11: exited 1 without answering\nTraceback ...")

    monkeypatch.setattr(H, "mla_eager", boom)
    monkeypatch.setattr(H, "dual_stream", boom)
    monkeypatch.setattr(H, "mla_function", boom)
    produced = bench.rows(3, 10, 10)
    assert [r["what"] for r in produced] == [w for s, w in bench_rows.ROWS if s == "bench_hot_path"]
    rows, problems = bench_rows.collect([("bench_hot_path", lambda: produced)], log=lambda line: None)
    assert len(problems) == len(produced)
    assert all(r["measured"].startswith("not measured: failed: WorkerError: sglang 0.5.11: exited 1")
               and len(bench_rows.render([r]).splitlines()) == 3 for r in rows)


def test_round_ratios_give_the_middle_half():
    ratios, (low, high) = H.round_ratios([1, 2, 3, 4, 5, 6, 7, 8], [1] * 8)
    assert ratios == [1, 2, 3, 4, 5, 6, 7, 8] and (low, high) == (3, 6)
    assert H.round_ratios([2], [1])[1] == (2, 2)


def test_the_function_row_times_the_shim_s_function_beside_the_one_it_replaces():
    """Tiny rounds: the row's plumbing in a process of its own, nothing timed."""
    row = hot_path_rows.mla_function_row(1, 200)
    assert row["what"] == hot_path_rows.WHAT_FUNCTION and row["target"] == hot_path_rows.EAGER_TARGET
    assert row["how"].startswith("Python 3.") and " ns (" in row["measured"] and isinstance(row["ok"], bool)
