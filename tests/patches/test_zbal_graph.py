"""zbal and NPU graphs: the shim has zbal's graph-pool hooks installed (``ZBAL_ENABLE_GRAPH``) in a
scheduler that will capture graphs, before zbal's allocator is switched in; the operator's own
value stands, a value that keeps the hooks off is said.  Driven as tests/patches/test_zbal.py
drives the Scheduler wrapper: memfabric-zbal's own Python layer over the simulated native module,
whose ``set_*`` calls torch_npu's pluggable allocator records."""
from __future__ import annotations

import os
import types

import pytest
import torch
import wrapt

from npu_shim.patches import zbal as zp
from shimdev import simzbal

SWITCH = "ZBAL_ENABLE_GRAPH"
POOL_HOOKS = ["set_begin_allocate_to_pool", "set_end_allocate_to_pool_fn", "set_release_pool"]
BASE_HOOKS = ["set_init_fn", "set_reset_fn", "set_record_stream_fn", "set_erase_stream_fn",
              "set_get_device_stats_fn"]

PROC = zp.ZbalState()


class Scheduler:
    def __init__(self, server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, attn_cp_rank,
                 moe_dp_rank, dp_rank):
        from shimdev import simnpu

        simnpu.log("body_start")
        self.buffer = torch.empty(4, device="npu")


Scheduler.__init__ = wrapt.FunctionWrapper(
    Scheduler.__dict__["__init__"], PROC.scheduler_init_wrapper(zp.SCHEDULER_INIT_SIGS[1]))


@pytest.fixture
def zb(simnpu_clean, zbal_pkg, monkeypatch):
    """As test_zbal's: and zbal imported in this process without the variable (its module global
    False, as read at import), the variable unset."""
    simzbal.reset()
    PROC.__init__()
    monkeypatch.setenv("SGLANG_ZBAL_LOCAL_MEM_SIZE", "61440")
    for name in ("SGLANG_ZBAL_BOOTSTRAP_URL", "MASTER_ADDR", "MASTER_PORT", SWITCH):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(zbal_pkg.zbal_module, SWITCH, False)  # restored after the test
    yield zbal_pkg
    PROC.__init__()
    simzbal.reset()


def start(sim, graphs=True, mix=False):
    simzbal.STATE.mix = mix
    args = types.SimpleNamespace(tp_size=1, pp_size=1, disable_cuda_graph=not graphs)
    with sim.record_allocations():
        Scheduler(args, None, 0, 0, 0, 0, 0, 0, None)
    return [e[1] for e in sim.events("allocator_fn")]


@pytest.mark.parametrize("mix", [False, True], ids=["full", "mix"])
def test_graphs_captured_the_shim_has_the_pool_hooks_installed(zb, simnpu_clean, mix):
    assert start(simnpu_clean, mix=mix) == BASE_HOOKS + POOL_HOOKS
    assert os.environ[SWITCH] == "1" and zb.zbal_module.ZBAL_ENABLE_GRAPH is True
    assert PROC.details["graph_pool"] == "zbal pool hooks (ZBAL_ENABLE_GRAPH=1 set by the shim)"
    assert PROC.details["graph_pool_hooks"] == 1
    # the hooks are in place before the scheduler's body allocates anything
    order = [e[0] if e[0] != "allocator_fn" else e[1] for e in simnpu_clean.EVENTS]
    assert order.index("set_release_pool") < order.index("body_start") < order.index("alloc")


def test_no_capture_leaves_zbal_as_it_is(zb, simnpu_clean):
    assert start(simnpu_clean, graphs=False) == BASE_HOOKS
    assert SWITCH not in os.environ and zb.zbal_module.ZBAL_ENABLE_GRAPH is False
    assert "graph_pool" not in PROC.details and "graph_pool_hooks" not in PROC.details


def test_the_operator_s_1_stands(zb, simnpu_clean, monkeypatch):
    monkeypatch.setenv(SWITCH, "01")  # zbal's own test: int(value) == 1, read at its import
    monkeypatch.setattr(zb.zbal_module, SWITCH, True)
    assert start(simnpu_clean) == BASE_HOOKS + POOL_HOOKS
    assert os.environ[SWITCH] == "01"
    assert PROC.details["graph_pool"] == "zbal pool hooks (ZBAL_ENABLE_GRAPH=01 set in the environment)"
    assert PROC.details["graph_pool_hooks"] == 1


@pytest.mark.parametrize("value, extra", [("0", ""), ("yes", " (not an integer: zbal fails to import)")])
def test_the_operator_s_other_value_stands_and_the_capture_is_said_unpooled(zb, simnpu_clean, monkeypatch,
                                                                             caplog, value, extra):
    from npu_shim.reporting import log

    log.configure()
    monkeypatch.setenv(SWITCH, value)
    with caplog.at_level("WARNING", logger="npu_shim"):
        assert start(simnpu_clean) == BASE_HOOKS
    assert os.environ[SWITCH] == value and zb.zbal_module.ZBAL_ENABLE_GRAPH is False
    assert PROC.details["graph_pool"] == "unpooled (ZBAL_ENABLE_GRAPH=%s set in the environment)" % value
    assert PROC.details["graph_pool_hooks"] == 0
    assert [r.getMessage() for r in caplog.records if r.name.startswith("npu_shim")] == [
        "zbal: graphs will be captured but ZBAL_ENABLE_GRAPH=%s%s keeps zbal's pool hooks off: a "
        "captured graph's memory is not pooled and may be reused while replays write it; unset "
        "ZBAL_ENABLE_GRAPH (the shim then sets it to 1) or pass --disable-cuda-graph" % (value, extra)]
