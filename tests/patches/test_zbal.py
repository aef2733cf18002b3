"""zbal backport, unit level: decisions from the real release sources, and every wrapper driven on
the simulated NPU with memfabric-zbal's own Python layer over the simulated native module
(dev/shimdev/simzbal; its calls are what the tests observe: zbal_init's arguments as the bootstrap
it hands to the native side).  The sglang objects the wrappers
receive are small stand-ins here; tests/patches/test_zbal_real.py drives the real classes."""
from __future__ import annotations

import ast
import os
import sys
import types

import pytest
import torch
import wrapt

from npu_shim.core import config, framework
from npu_shim.runtime import decisions, targets
from npu_shim.core.loading import all_variables
from npu_shim.source.codeview import SourceView
from npu_shim.patches import zbal as zp

from shimdev.envs import realsglang

from shimdev import simzbal
MIB = 1 << 20
GIB = 1 << 30
BACKPORTED = ("0.5.7", "0.5.8", "0.5.9", "0.5.10", "0.5.11")
UPSTREAM = ("0.5.12", "0.5.19", "0.5.23")


# -- fixtures --------------------------------------------------------------------------------------

_VIEWS = {}


# The wrappers' per-process state, as a decision builds it (the fixture starts each test afresh).
PROC = zp.ZbalState()


def view(version):
    if version not in _VIEWS:
        root = realsglang.sglang_envs.ensure_sources(version)
        _VIEWS[version] = SourceView(os.path.join(str(root), "sglang"))
    return _VIEWS[version]


@pytest.fixture
def zb(simnpu_clean, zbal_pkg, monkeypatch):
    """Simulated native zbal reset, shim state reset, size 61440 MiB set, no bootstrap URL (nor
    MASTER_ADDR/PORT: zbal then derives tcp://127.0.0.1:6789)."""
    simzbal.reset()
    PROC.__init__()
    monkeypatch.setenv("SGLANG_ZBAL_LOCAL_MEM_SIZE", "61440")
    for name in ("SGLANG_ZBAL_BOOTSTRAP_URL", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(zp, "_world_group", lambda: types.SimpleNamespace(
        world_size=1, rank_in_group=0, cpu_group=None))
    yield zbal_pkg
    PROC.__init__()
    simzbal.reset()


def inits():
    """zbal_init's arguments, as the bootstrap it handed to the native module carries them."""
    return simzbal.bootstraps()


def wrap_method(cls, name, wrapper):
    setattr(cls, name, wrapt.FunctionWrapper(cls.__dict__[name], wrapper))


# -- decisions ---------------------------------------------------------------------------------------

ON = {"SGLANG_ZBAL_LOCAL_MEM_SIZE": "61440"}


def test_size_set_without_memfabric_zbal_is_failed_when_decided(monkeypatch):
    """What ``status`` says before launch (no import: find_spec), and why the process stops."""
    monkeypatch.setitem(__import__("sys").modules, "zbal", None)  # find_spec -> None
    d = framework.decide(zp.PATCH, view("0.5.11"), environ=ON, on_npu=True)
    assert d.state == framework.FAILED and d.targets == []
    assert "memfabric-zbal" in d.reason and "SGLANG_ZBAL_LOCAL_MEM_SIZE=" in d.reason
    assert zp.PATCH.must_honour(ON) and zp.PATCH.error is zp.ZbalError
    # asked statically "would it apply if switched on?", zbal being installed does not matter
    assert framework.decide(zp.PATCH, view("0.5.11"), environ={}, assume_triggered=True).state == "applied"


@pytest.mark.parametrize("version", BACKPORTED)
def test_applied_on_backport_range_with_every_target(version, zbal_pkg):
    d = framework.decide(zp.PATCH, view(version), environ=ON, on_npu=True)
    assert d.state == framework.APPLIED, d.reason
    described = {t.describe() for t in d.targets}
    expected = {
        "sglang.srt.utils.common:get_available_gpu_memory",
        "sglang.srt.utils.common:get_npu_memory_capacity",
        "sglang.srt.distributed.parallel_state:init_distributed_environment",
        "sglang.srt.layers.moe.token_dispatcher.deepep:Buffer",
        "sglang.srt.layers.moe.token_dispatcher.deepep:Config",
        "sglang.srt.layers.moe.token_dispatcher.deepep:use_deepep",
        "sglang.srt.model_executor.model_runner:ModelRunner.initialize",
        "sglang.srt.model_executor.model_runner:ModelRunner.init_device_graphs",
        "sglang.srt.managers.scheduler:Scheduler.__init__",
    }
    if version in ("0.5.10", "0.5.11"):
        expected.add("sglang.srt.distributed.parallel_state:_DEVICE_TO_DISTRIBUTED_BACKEND")
    assert described == expected
    assert set(zp.PATCH.modules) == {t.module for t in d.targets}


@pytest.mark.parametrize("version", UPSTREAM)
def test_upstream_releases_stand_down(version):
    d = framework.decide(zp.PATCH, view(version), environ=ON, on_npu=True)
    assert d.state == framework.UPSTREAM
    assert "init_zbal_on_npu" in d.reason and d.targets == []


# What upstream's EnvInt reads with int() and the backport refuses (or finds too large).
UPSTREAMS_OWN = ["+4096", "4_096", "\uff14\uff10\uff19\uff16", "2097152", " 4096 ", "12G", "-5"]


@pytest.mark.parametrize("version", UPSTREAM)
@pytest.mark.parametrize("raw", UPSTREAMS_OWN)
def test_upstream_reads_its_own_size_and_the_shim_stands_down(version, raw):
    """On a release with zbal upstream the size is upstream's to read: ``upstream``, whatever the
    backport would make of it, the reason saying so -- nothing stops the process."""
    environ = {"SGLANG_ZBAL_LOCAL_MEM_SIZE": raw}
    d = framework.decide(zp.PATCH, view(version), environ=environ, on_npu=True)
    assert d.state == framework.UPSTREAM and d.targets == []
    try:
        zp.LOCAL_MEM_SIZE.read(environ)
    except config.ConfigError as exc:
        assert d.reason == ("sglang %s has it: Scheduler.init_zbal_on_npu; upstream reads "
                            "SGLANG_ZBAL_LOCAL_MEM_SIZE itself (to the backport, %s)" % (view(version).version, exc))
    else:  # " 4096 ": read alike, nothing to note
        assert d.reason == "sglang %s has it: Scheduler.init_zbal_on_npu" % view(version).version
    decisions.enforce(decisions.PatchRecord(zp.PATCH, d))  # raises nothing: the process runs


def test_upstream_reads_its_own_bootstrap_url_too():
    d = framework.decide(zp.PATCH, view("0.5.12"), environ=dict(ON, SGLANG_ZBAL_BOOTSTRAP_URL="10.0.0.1:6789"),
                         on_npu=True)
    assert d.state == framework.UPSTREAM
    assert "upstream reads SGLANG_ZBAL_BOOTSTRAP_URL itself (to the backport, SGLANG_ZBAL_BOOTSTRAP_URL=" in d.reason


@pytest.mark.parametrize("raw", ["+4096", "4_096", "2097152"])
def test_the_backport_still_refuses_what_it_cannot_read(raw):
    """Where the shim backports, it reads the size: a value it cannot read stops the process
    (zbal was asked for) with the variable, the value and the accepted form."""
    environ = {"SGLANG_ZBAL_LOCAL_MEM_SIZE": raw}
    d = framework.decide(zp.PATCH, view("0.5.11"), environ=environ, on_npu=True)
    assert d.state == framework.FAILED and d.reason.startswith("SGLANG_ZBAL_LOCAL_MEM_SIZE=%r is invalid" % raw)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SGLANG_ZBAL_LOCAL_MEM_SIZE", raw)
        with pytest.raises(zp.ZbalError):
            decisions.enforce(decisions.PatchRecord(zp.PATCH, d))


def test_a_switched_off_backport_or_an_invalid_switch_are_not_upstreams_to_judge():
    d = framework.decide(zp.PATCH, view("0.5.12"), environ={"SGLANG_ZBAL_LOCAL_MEM_SIZE": "+4096",
                                                             "NPU_SHIM_ZBAL": "maybe"}, on_npu=True)
    assert d.state == framework.FAILED and d.reason.startswith("NPU_SHIM_ZBAL='maybe' is invalid")


@pytest.mark.parametrize("raw, state, honour", [
    ("0000000000000", framework.INACTIVE, False),    # zero, padded past the length bound: off
    ("00000000000000000000", framework.INACTIVE, False),
    ("0000000000061440", framework.APPLIED, True),
])
def test_a_padded_size_is_read_before_its_length_is_judged(raw, state, honour, zbal_pkg):
    environ = {"SGLANG_ZBAL_LOCAL_MEM_SIZE": raw}
    d = framework.decide(zp.PATCH, view("0.5.11"), environ=environ, on_npu=True)
    assert (d.state, zp.PATCH.must_honour(environ)) == (state, honour), d.reason
    assert zp.LOCAL_MEM_SIZE.read(environ) == int(raw)


@pytest.mark.parametrize("environ, state, words", [
    ({}, framework.INACTIVE, "SGLANG_ZBAL_LOCAL_MEM_SIZE is unset or 0"),
    ({"SGLANG_ZBAL_LOCAL_MEM_SIZE": "0"}, framework.INACTIVE, "unset or 0"),
    ({"SGLANG_ZBAL_LOCAL_MEM_SIZE": "  "}, framework.INACTIVE, "unset or 0"),
    (dict(ON, NPU_SHIM_ZBAL="0"), framework.DISABLED, "NPU_SHIM_ZBAL=0"),
    ({"SGLANG_ZBAL_LOCAL_MEM_SIZE": "12G"}, framework.FAILED,
     "SGLANG_ZBAL_LOCAL_MEM_SIZE='12G' is invalid: expected a whole number of MiB"),
    ({"SGLANG_ZBAL_LOCAL_MEM_SIZE": "-5"}, framework.FAILED,
     "SGLANG_ZBAL_LOCAL_MEM_SIZE='-5' is invalid: expected a whole number of MiB >= 0"),
    (dict(ON, SGLANG_ZBAL_BOOTSTRAP_URL="10.0.0.1:6789"), framework.FAILED,
     "SGLANG_ZBAL_BOOTSTRAP_URL='10.0.0.1:6789' is invalid: expected tcp://HOST:PORT"),
    (dict(ON, SGLANG_ZBAL_BOOTSTRAP_URL="tcp://10.0.0.1:70000"), framework.FAILED,
     "port in 1..65535"),
])
def test_trigger_and_settings(environ, state, words):
    d = framework.decide(zp.PATCH, view("0.5.11"), environ=environ, on_npu=True)
    assert d.state == state
    assert words in d.reason


def test_not_on_an_npu_is_inactive():
    d = framework.decide(zp.PATCH, view("0.5.9"), environ=ON, on_npu=False)
    assert d.state == framework.INACTIVE and "not running on an NPU" in d.reason


@pytest.mark.parametrize("environ, honour", [
    ({}, False), ({"SGLANG_ZBAL_LOCAL_MEM_SIZE": "0"}, False), (ON, True),
    ({"SGLANG_ZBAL_LOCAL_MEM_SIZE": "lots"}, True),
    ({"SGLANG_ZBAL_LOCAL_MEM_SIZE": "0", "SGLANG_ZBAL_BOOTSTRAP_URL": "bad"}, False),
])
def test_must_honour_when_the_size_asks_for_zbal(environ, honour):
    assert zp.PATCH.must_honour(environ) is honour


def test_a_bad_url_with_zbal_requested_raises_at_decision(monkeypatch):
    # decisions.enforce is what the first import hook runs after deciding.
    monkeypatch.setenv("SGLANG_ZBAL_LOCAL_MEM_SIZE", "61440")
    monkeypatch.setenv("SGLANG_ZBAL_BOOTSTRAP_URL", "http://10.0.0.1:6789")
    d = framework.decide(zp.PATCH, view("0.5.11"), environ=dict(os.environ), on_npu=True)
    record = decisions.PatchRecord(zp.PATCH, d)
    with pytest.raises(framework.ShimError) as exc:
        decisions.enforce(record)
    assert "SGLANG_ZBAL_BOOTSTRAP_URL='http://10.0.0.1:6789' is invalid" in str(exc.value)


def test_source_checks_guard_what_the_wrappers_rely_on():
    # The NPU branch order (attention backend, then graphs) and the query's NPU branch are checked.
    v = view("0.5.11")
    for target in framework.targets_for(zp.PATCH, v)[1]:
        assert target.check_source(v) is None, target.describe()
    broken = types.SimpleNamespace(
        function=v.function, has=v.has,
        module=lambda name: types.SimpleNamespace(contains=lambda pattern: False))
    problems = [t.check_source(broken) for t in framework.targets_for(zp.PATCH, v)[1] if isinstance(t, targets.Wrap)]
    assert any("init_attention_backend(); init_device_graphs()" in (p or "") for p in problems)
    assert any("NPU branch the full-mode query re-states" in (p or "") for p in problems)


# -- zbal missing -------------------------------------------------------------------------------------

def test_zbal_missing_fails_before_anything_is_patched(zb, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "zbal", None)  # find_spec -> None, import fails
    found = framework.targets_for(zp.PATCH, view("0.5.11"))[1]
    assert all(t.requires is zp.require_zbal for t in found)  # every target, whichever module is first
    target = found[0]
    module = types.ModuleType("sglang.srt.utils.common")
    module.get_available_gpu_memory = lambda device, gpu_id, distributed=False, empty_cache=True, cpu_group=None: 0
    with pytest.raises(zp.ZbalError) as exc:
        target.prepare(module)
    msg = str(exc.value)
    assert "memfabric-zbal" in msg and "SGLANG_ZBAL_LOCAL_MEM_SIZE=61440" in msg
    assert "not importable" in msg
    with pytest.raises(zp.ZbalError) as exc:
        zp.zbal_module()
    assert "memfabric-zbal" in str(exc.value) and "import failed" in str(exc.value)


# -- 1. Scheduler.__init__ ----------------------------------------------------------------------------

class FakeScheduler:
    """Body allocates on the NPU first thing, like the real one does somewhere after its start."""

    def __init__(self, server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, attn_cp_rank,
                 moe_dp_rank, dp_rank):
        from shimdev import simnpu

        simnpu.log("body_start")
        self.buffer = torch.empty(4, device="npu")


wrap_method(FakeScheduler, "__init__", PROC.scheduler_init_wrapper(zp.SCHEDULER_INIT_SIGS[1]))


def server_args(tp=4, pp=1):
    return types.SimpleNamespace(tp_size=tp, pp_size=pp)


def make_scheduler(sim, tp=4, pp=1, gpu_id=2, tp_rank=3, positional=True):
    with sim.record_allocations():
        if positional:
            return FakeScheduler(server_args(tp, pp), None, gpu_id, tp_rank, 0, 0, 0, 0, None)
        return FakeScheduler(server_args=server_args(tp, pp), port_args=None, gpu_id=gpu_id,
                             tp_rank=tp_rank, moe_ep_rank=0, pp_rank=0, attn_cp_rank=0,
                             moe_dp_rank=0, dp_rank=None)


def kinds(sim):
    return [(e[0], e[1]) if e[0] == "zbal" else (e[0],) for e in sim.EVENTS]


@pytest.mark.parametrize("positional", [True, False])
def test_full_mode_zbal_init_before_the_first_allocation(zb, simnpu_clean, positional):
    make_scheduler(simnpu_clean, positional=positional)
    order = kinds(simnpu_clean)
    assert order.index(("zbal", "zbal_bootstrap")) < order.index(("body_start",)) < order.index(("alloc",))
    args, = inits()
    assert (args["world_size"], args["device_id"], args["rank_id"]) == (4, 2, 3)
    assert args["device_mem_size"] == 61440 * MIB
    assert args["ip_port"] == "tcp://127.0.0.1:6789"  # not passed: zbal derived it (no MASTER_ADDR/PORT)
    assert simnpu_clean.allocator_backend() == "pluggable"  # zbal_init switched it (native before)
    assert PROC.mode == "full" and PROC.gva_mib == 61440


def test_bootstrap_url_is_passed_as_ip_port(zb, simnpu_clean, monkeypatch):
    monkeypatch.setenv("SGLANG_ZBAL_BOOTSTRAP_URL", "tcp://10.0.0.1:6789")
    make_scheduler(simnpu_clean)
    args, = inits()
    assert args["ip_port"] == "tcp://10.0.0.1:6789" == simzbal.STATE.ip_port


def test_mix_mode_only_switches_the_allocator_first(zb, simnpu_clean):
    simzbal.STATE.mix = True
    make_scheduler(simnpu_clean, pp=2)  # pp_size > 1 is fine in mix mode
    order = kinds(simnpu_clean)
    assert order.index(("change_allocator",)) < order.index(("body_start",)) < order.index(("alloc",))
    assert inits() == []
    assert PROC.mode == "mix" and PROC.gva_mib is None


def test_switch_after_an_allocation_would_be_refused(zb, simnpu_clean):
    # Why the order matters: torch_npu refuses to swap the allocator once it allocated.
    simzbal.STATE.mix = True
    with simnpu_clean.record_allocations():
        torch.empty(1, device="npu")
        with pytest.raises(RuntimeError, match="already initialized allocator"):
            zb.switch_to_allocator()


def test_pp_without_mix_mode_is_a_clear_error(zb, simnpu_clean):
    with pytest.raises(zp.ZbalError) as exc:
        make_scheduler(simnpu_clean, pp=2)
    assert "only zbal mix mode supports pp_size > 1" in str(exc.value)
    assert "pp_size=2" in str(exc.value)
    assert inits() == [] and simnpu_clean.events("body_start") == []


def test_init_failure_stops_with_rank_device_size(zb, simnpu_clean, monkeypatch):
    monkeypatch.setenv("SGLANG_ZBAL_BOOTSTRAP_URL", "tcp://10.0.0.1:6789")
    simzbal.STATE.init_result = False
    with pytest.raises(zp.ZbalInitError) as exc:
        make_scheduler(simnpu_clean)
    err = exc.value
    assert isinstance(err, framework.ShimError)  # an Exception: run_scheduler_process reports it
    assert (err.rank, err.device, err.size_mib) == (3, 2, 61440)
    assert str(err) == ("zbal_init failed (full mode, Scheduler start-up): rank 3 of 4, device 2, "
                        "61440 MiB, bootstrap tcp://10.0.0.1:6789; see zbal's log above (memfabric "
                        "library path, bootstrap server reachable, device memory free)")
    assert simnpu_clean.events("body_start") == []


def test_scheduler_setup_once_per_process(zb, simnpu_clean):
    make_scheduler(simnpu_clean)
    make_scheduler(simnpu_clean)
    assert len(inits()) == 1


# -- 2. ModelRunner: lazy GVA heap --------------------------------------------------------------------

class FakeRunner:
    """initialize() in the order of the real NPU branch: weights, KV cache, attention, graphs."""

    def __init__(self, draft=False, device="npu", weights_mib=0, kv_mib=0, call_graphs=True):
        self.device, self.gpu_id, self.is_draft_worker = device, 0, draft
        self.weights_mib, self.kv_mib, self.call_graphs = weights_mib, kv_mib, call_graphs

    def _use(self, mib):
        from shimdev import simnpu

        simnpu.set_memory(free_mib=simnpu.STATE.free_mib - mib)

    def initialize(self, pre_model_load_memory):
        from shimdev import simnpu

        if self.device == "npu":
            torch.npu.set_device(self.gpu_id)  # as init_torch_distributed does before any of this
        self._use(self.weights_mib)
        simnpu.log("weights")
        self._use(self.kv_mib)
        simnpu.log("kv_cache")
        self.init_attention_backend()
        if self.call_graphs:
            self.init_device_graphs()

    def init_attention_backend(self):
        from shimdev import simnpu

        simnpu.log("attention_backend")

    def init_device_graphs(self):
        from shimdev import simnpu

        simnpu.log("graph_capture")


wrap_method(FakeRunner, "initialize", PROC.model_runner_initialize)
wrap_method(FakeRunner, "init_device_graphs", PROC.model_runner_init_device_graphs)


def mix_mode_started(zb):
    """Mix mode as the scheduler leaves it: zbal's allocator switched in before the device was
    touched (the simulated NPU, like torch_npu, refuses the switch afterwards)."""
    simzbal.STATE.mix = True
    zb.switch_to_allocator()


def test_lazy_init_after_attention_backend_before_graph_capture(zb, simnpu_clean):
    mix_mode_started(zb)
    simnpu_clean.set_memory(total_mib=65536, free_mib=62000)  # 3.5 GB taken before the model
    FakeRunner(weights_mib=20000, kv_mib=25000).initialize(1.0)
    order = kinds(simnpu_clean)
    assert order.index(("kv_cache",)) < order.index(("attention_backend",)) \
        < order.index(("zbal", "zbal_bootstrap")) < order.index(("graph_capture",))
    assert ("empty_cache",) in order[order.index(("attention_backend",)):order.index(("zbal", "zbal_bootstrap"))]
    args, = inits()
    in_use = 65536 - (62000 - 45000)
    expected = (61440 - in_use) // 128 * 128
    assert args["device_mem_size"] == expected * MIB
    assert (args["world_size"], args["device_id"], args["rank_id"]) == (1, 0, 0)
    assert PROC.gva_mib == expected


@pytest.mark.parametrize("total, free, configured, expected", [
    (32768, 9000, 30000, 6144),    # in use 23768 -> 6232 -> 6144
    (65536, 20050, 61440, 15872),  # in use 45486 -> 15954 -> 15872
    (98304, 40000, 92160, 33792),  # in use 58304 -> 33856 -> 33792
])
def test_gva_size_from_the_device_total(zb, simnpu_clean, monkeypatch, total, free, configured, expected):
    mix_mode_started(zb)
    monkeypatch.setenv("SGLANG_ZBAL_LOCAL_MEM_SIZE", str(configured))
    simnpu_clean.set_memory(total_mib=total, free_mib=free)
    FakeRunner().initialize(1.0)
    args, = inits()
    assert args["device_mem_size"] == expected * MIB
    assert expected % 128 == 0 and 0 <= configured - (total - free) - expected < 128
    # upstream's fixed 61.2 (GiB) total asks for something else: 2.8 GiB more on a 64 GiB card,
    # a negative size on 32 GiB, 34.8 GiB too little on 96 GiB
    upstream = configured - int((61.2 - free / 1024) * 1024)
    upstream -= upstream % 128
    assert upstream != expected


def test_in_use_rounds_up_partial_mib(zb, simnpu_clean, monkeypatch):
    monkeypatch.setattr(torch.npu, "mem_get_info", lambda device=None: (20000 * MIB - 1, 65536 * MIB))
    size, in_use, total = zp.gva_size_mib(61440, 1, None)
    assert (in_use, total) == (45537, 65536) and size == (61440 - 45537) // 128 * 128


def test_gva_size_uses_the_largest_in_use_across_ranks(zb, simnpu_clean, monkeypatch):
    seen = {}

    def all_reduce(tensor, op=None, group=None):
        seen["op"], seen["group"] = op, group
        tensor.fill_(50000 * MIB)  # another rank has more in use

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    simnpu_clean.set_memory(total_mib=65536, free_mib=30000)
    size, in_use, _ = zp.gva_size_mib(61440, 2, "cpu-group")
    assert seen == {"op": torch.distributed.ReduceOp.MAX, "group": "cpu-group"}
    assert in_use == 50000 and size == 11392


def test_gva_size_not_positive_is_a_clear_error(zb, simnpu_clean, monkeypatch):
    simzbal.STATE.mix = True
    monkeypatch.setenv("SGLANG_ZBAL_LOCAL_MEM_SIZE", "40000")
    simnpu_clean.set_memory(total_mib=65536, free_mib=25600)
    with pytest.raises(zp.ZbalError) as exc:
        FakeRunner().initialize(1.0)
    assert str(exc.value).startswith(
        "no room for the zbal GVA heap: SGLANG_ZBAL_LOCAL_MEM_SIZE=40000 MiB configured, 39936 MiB "
        "already in use (weights, KV cache, workspace) of the device's 65536 MiB total -> 64 MiB "
        "left (0 after aligning down to 128 MiB)")
    assert inits() == [] and simnpu_clean.events("graph_capture") == []


def test_lazy_init_once_per_process_and_never_in_a_draft_worker(zb, simnpu_clean):
    mix_mode_started(zb)
    FakeRunner(draft=True).initialize(1.0)
    assert inits() == []
    assert PROC.details.get("draft_worker_skipped") is True
    FakeRunner().initialize(1.0)
    FakeRunner().initialize(1.0)
    FakeRunner(draft=True).initialize(1.0)
    assert len(inits()) == 1
    assert len(simnpu_clean.events("graph_capture")) == 4
    assert PROC.details["gva_init"] == "before device-graph capture"


def test_full_mode_and_other_devices_do_no_lazy_init(zb, simnpu_clean):
    FakeRunner().initialize(1.0)  # full mode (simzbal.STATE.mix False)
    simzbal.STATE.mix = True
    FakeRunner(device="cpu").initialize(1.0)
    assert inits() == []


def test_graphs_outside_initialize_do_not_init(zb, simnpu_clean):
    simzbal.STATE.mix = True
    FakeRunner().init_device_graphs()  # e.g. a later re-capture
    assert inits() == []


def test_initialize_without_graphs_inits_after_it(zb, simnpu_clean, caplog):
    from npu_shim.reporting import log

    log.configure()  # sets the logger's level once per process: before caplog lowers it
    mix_mode_started(zb)
    simnpu_clean.set_memory(total_mib=65536, free_mib=30000)
    with caplog.at_level("INFO", logger="npu_shim"):
        FakeRunner(call_graphs=False).initialize(1.0)
    order = kinds(simnpu_clean)
    assert order.index(("attention_backend",)) < order.index(("zbal", "zbal_bootstrap"))
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name.startswith("npu_shim")] == [
        ("WARNING", "zbal: ModelRunner.initialize did not reach init_device_graphs; initialising "
                    "the GVA heap after it instead"),
        ("INFO", "zbal: rank 0 initialised a 25856 MiB GVA heap (61440 MiB configured, 35536 of "
                 "65536 MiB in use)")]


def test_mix_mode_without_zbal_s_allocator_says_why(zb, simnpu_clean):
    """A runner whose process never switched zbal's allocator in (no Scheduler): torch_npu would
    refuse the swap zbal_init attempts after the weights; the shim names the cause instead."""
    simzbal.STATE.mix = True
    with pytest.raises(zp.ZbalError, match="cannot be swapped once used"):
        FakeRunner(weights_mib=20000).initialize(1.0)
    assert inits() == [] and simnpu_clean.events("change_allocator") == []
    with pytest.raises(RuntimeError, match="Can't swap an already initialized allocator"):
        zb.switch_to_allocator()  # what upstream's zbal_init would have run into


def test_lazy_init_failure(zb, simnpu_clean):
    mix_mode_started(zb)
    simzbal.STATE.init_result = False
    with pytest.raises(zp.ZbalInitError) as exc:
        FakeRunner().initialize(1.0)
    assert "zbal_init failed (mix mode, lazy GVA heap before device-graph capture): rank 0 of 1, " \
           "device 0, 61440 MiB" in str(exc.value)
    assert simnpu_clean.events("graph_capture") == []


# -- 3./4. memory queries, against the original's own code ------------------------------------------

def original_function(version, name):
    """The release's function, compiled from its source (needs only torch for the npu path)."""
    path = os.path.join(view(version).package_dir, "srt", "utils", "common.py")
    tree = ast.parse(open(path, encoding="utf-8").read())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), namespace)
    return namespace[name]


@pytest.fixture
def cpu_group():
    """A one-rank gloo group (zbal_init must not see it: it would barrier on it)."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


@pytest.mark.parametrize("version", ["0.5.7", "0.5.11"])
@pytest.mark.parametrize("kwargs", [
    {}, {"empty_cache": False}, {"distributed": True, "empty_cache": True},
])
def test_available_memory_full_mode_matches_the_original_contract(zb, simnpu_clean, cpu_group, version,
                                                                   kwargs):
    original = original_function(version, "get_available_gpu_memory")
    wrapped = wrapt.FunctionWrapper(original, zp.get_available_gpu_memory)
    if kwargs.get("distributed"):
        kwargs = dict(kwargs, cpu_group=cpu_group)
    heap_free = 12345 * MIB + 777
    simzbal.STATE.heap_free, simzbal.STATE.heap_total = heap_free, 60 * GIB
    simnpu_clean.set_memory(total_mib=65536, free_mib=1000)  # device figure must NOT be used
    got = wrapped("npu", 0, **kwargs)
    empties = len(simnpu_clean.events("empty_cache"))
    # the original, fed the same free bytes by the device, is the reference
    simnpu_clean.reset()
    orig_free = torch.npu.mem_get_info

    try:
        torch.npu.mem_get_info = lambda device=None: (heap_free, 60 * GIB)
        expected = original("npu", 0, **kwargs)
    finally:
        torch.npu.mem_get_info = orig_free
    assert got == expected and type(got) is type(expected)
    assert empties == len(simnpu_clean.events("empty_cache")) == (0 if kwargs.get("empty_cache") is False else 1)
    # zbal.mem_get_info() reads the heap's statistics afresh for each figure it computes
    assert len(simzbal.calls("get_heap_stats")) == 3


def test_available_memory_positional_arguments(zb, simnpu_clean, cpu_group):
    original = original_function("0.5.11", "get_available_gpu_memory")
    wrapped = wrapt.FunctionWrapper(original, zp.get_available_gpu_memory)
    simzbal.STATE.heap_free = 3 * GIB
    assert wrapped("npu", 0, True, False, cpu_group) == 3.0
    assert simnpu_clean.events("empty_cache") == []


def test_available_memory_mix_mode_and_other_devices_are_the_original(zb, simnpu_clean):
    original = original_function("0.5.11", "get_available_gpu_memory")
    wrapped = wrapt.FunctionWrapper(original, zp.get_available_gpu_memory)
    simzbal.STATE.mix = True
    simnpu_clean.set_memory(total_mib=65536, free_mib=4096)
    assert wrapped("npu", 0) == original("npu", 0) == 4.0
    assert simzbal.calls("get_heap_stats") == []
    seen = []
    passthrough = wrapt.FunctionWrapper(lambda *a, **k: seen.append((a, k)) or 7.0,
                                        zp.get_available_gpu_memory)
    assert passthrough("cuda", 1, distributed=True) == 7.0
    assert seen == [(("cuda", 1), {"distributed": True})]


def test_available_memory_asserts_the_gpu_id_like_the_original(zb, simnpu_clean):
    wrapped = wrapt.FunctionWrapper(original_function("0.5.11", "get_available_gpu_memory"),
                                    zp.get_available_gpu_memory)
    with pytest.raises(AssertionError):
        wrapped("npu", 5)


def test_npu_memory_capacity_is_the_configured_size(zb, simnpu_clean, monkeypatch):
    original = original_function("0.5.11", "get_npu_memory_capacity")
    wrapped = wrapt.FunctionWrapper(original, zp.get_npu_memory_capacity)
    simnpu_clean.set_memory(total_mib=65536)
    assert original() == 65536
    assert wrapped() == 61440
    simzbal.STATE.mix = True
    assert wrapped() == 61440  # upstream: whatever the mode
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", None)
    with pytest.raises(ImportError, match="torch_npu is required when run on npu device."):
        wrapped()


# -- 5./6. DeepEP and the distributed backend --------------------------------------------------------

def test_deepep_uses_zbal_buffer_and_config(zb, monkeypatch):
    deepep = types.ModuleType(zp.DEEPEP)
    deepep.Buffer, deepep.Config, deepep.use_deepep = object, dict, False
    targets = [t for t in framework.targets_for(zp.PATCH, view("0.5.9"))[1] if t.module == zp.DEEPEP]
    bystander = types.ModuleType("npu_shim_test_bystander")
    bystander.flag, bystander.Buffer = False, object  # same objects, must not be rebound
    monkeypatch.setitem(sys.modules, bystander.__name__, bystander)
    changes = [t.prepare(deepep) for t in targets]
    for change in changes:
        change.apply(imported_before=True)  # as if the shim arrived after sglang was imported
    import zbal.zbal.deepep_adaptor
    import zbal.zbal_buffer

    assert deepep.Buffer is zbal.zbal_buffer.Buffer
    assert deepep.Config is zbal.zbal.deepep_adaptor.Config
    assert deepep.use_deepep is True
    assert (bystander.flag, bystander.Buffer) == (False, object)
    for change in reversed(changes):
        change.revert()
    assert (deepep.Buffer, deepep.Config, deepep.use_deepep) == (object, dict, False)
    assert (bystander.flag, bystander.Buffer) == (False, object)


def test_deepep_without_deep_ep_installed(zb):
    # deep_ep missing: the module has no Buffer/Config and use_deepep False; zbal supplies them.
    deepep = types.ModuleType(zp.DEEPEP)
    deepep.use_deepep = False
    for t in [t for t in framework.targets_for(zp.PATCH, view("0.5.11"))[1] if t.module == zp.DEEPEP]:
        t.prepare(deepep).apply(imported_before=False)
    assert deepep.Buffer.__module__ == "zbal.zbal_buffer" and deepep.use_deepep is True


def test_backend_map_gives_zbal_for_npu(zb):
    ps = types.ModuleType(zp.PARALLEL_STATE)
    original = {"cuda": "nccl", "hpu": "hccl", "cpu": "gloo", "npu": "hccl"}
    ps._DEVICE_TO_DISTRIBUTED_BACKEND = original
    target = next(t for t in framework.targets_for(zp.PATCH, view("0.5.11"))[1]
                  if t.describe().endswith("_DEVICE_TO_DISTRIBUTED_BACKEND"))
    change = target.prepare(ps)
    change.apply(imported_before=False)
    assert ps._DEVICE_TO_DISTRIBUTED_BACKEND == {"cuda": "nccl", "hpu": "hccl", "cpu": "gloo", "npu": "zbal"}
    assert original["npu"] == "hccl"  # a copy: the original is restored on revert
    change.revert()
    assert ps._DEVICE_TO_DISTRIBUTED_BACKEND is original


def _recorder():
    seen = []

    def init_distributed_environment(world_size=-1, rank=-1, distributed_init_method="env://",
                                     local_rank=-1, backend="nccl", timeout=None):
        seen.append(backend)

    return seen, init_distributed_environment


def test_hccl_becomes_zbal_where_the_release_has_no_map(zb):
    seen, body = _recorder()
    wrapper = PROC.init_dist_wrapper(zp.INIT_DIST_SIGS[0], hccl_means_npu=True)
    wrapped = wrapt.FunctionWrapper(body, wrapper)
    wrapped(backend="hccl", world_size=2, rank=0, local_rank=0, distributed_init_method="tcp://x:1")
    wrapped(2, 0, "tcp://x:1", 0, "hccl", None)
    wrapped(backend="gloo")
    assert seen == ["zbal", "zbal", "gloo"]
    import torch.distributed as dist

    assert "zbal" in dist.Backend.backend_list  # zbal imported -> backend registered


def test_with_a_map_hccl_is_left_alone(zb):
    seen, body = _recorder()
    wrapper = PROC.init_dist_wrapper(zp.INIT_DIST_SIGS[0], hccl_means_npu=False)
    wrapped = wrapt.FunctionWrapper(body, wrapper)
    wrapped(backend="hccl")
    wrapped(backend="zbal")
    assert seen == ["hccl", "zbal"]


def test_each_decision_gets_fresh_process_state_tied_to_its_details(zb, simnpu_clean):
    make_scheduler(simnpu_clean)
    assert PROC.mode == "full"
    decisions = [framework.decide(zp.PATCH, view("0.5.11"), environ=ON, on_npu=True) for _ in range(2)]
    assert [d.state for d in decisions] == ["applied", "applied"]
    owners = [{t.wrapper.__self__ for t in d.targets if hasattr(getattr(t, "wrapper", None), "__self__")}
              for d in decisions]
    (first,), (second,) = owners
    assert first is not second and first is not PROC
    assert (first.mode, first.gva_mib, first.initializing) == (None, None, set())
    assert first.details is decisions[0].details and second.details is decisions[1].details


def test_module_imports_nothing_heavy():
    import subprocess
    import sys

    code = ("import sys; import npu_shim.patches.zbal as m; "
            "print(sorted(n for n in ('torch','wrapt','sglang','zbal') if n in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=realsglang.REPO, env=dict(os.environ, PYTHONPATH=str(realsglang.REPO)))
    assert out.stdout.strip() == "[]", out.stderr


def test_env_vars_are_declared_in_config():
    names = {v.name for v in (zp.PATCH.switch,) + tuple(zp.PATCH.reads)}
    assert names == {"NPU_SHIM_ZBAL", "SGLANG_ZBAL_LOCAL_MEM_SIZE", "SGLANG_ZBAL_BOOTSTRAP_URL"}
    assert names <= {v.name for v in all_variables()}


class FakeScheduler057:
    """0.5.7/0.5.8 signature: no attn_cp_rank / moe_dp_rank."""

    def __init__(self, server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank):
        self.args = (gpu_id, tp_rank)


def test_scheduler_signature_of_0_5_7(zb, simnpu_clean):
    params = view("0.5.7").function(zp.SCHEDULER, "Scheduler.__init__").params
    assert params == zp.SCHEDULER_INIT_SIGS[0]
    wrap_method(FakeScheduler057, "__init__", PROC.scheduler_init_wrapper(params))
    FakeScheduler057(server_args(tp=8), None, 5, 6, 0, 0, None)
    args, = inits()
    assert (args["world_size"], args["device_id"], args["rank_id"]) == (8, 5, 6)


# -- the GVA size at its boundaries --------------------------------------------------------------------

def _sized(monkeypatch, configured, in_use_bytes, total_mib=65536):
    monkeypatch.setattr(torch.npu, "mem_get_info",
                        lambda device=None: (total_mib * MIB - in_use_bytes, total_mib * MIB))
    return zp.gva_size_mib(configured, 1, None)


@pytest.mark.parametrize("left", [-1, 0, 1, 2, 127])
def test_less_than_one_aligned_block_left_is_no_room(zb, simnpu_clean, monkeypatch, left):
    """1 MiB left (or any amount under 128) aligns down to nothing: never a zbal_init of 0 MiB or
    of an unaligned 1 MiB."""
    in_use = 40000
    with pytest.raises(zp.ZbalError) as exc:
        _sized(monkeypatch, in_use + left, in_use * MIB)
    after = left if left <= 0 else 0
    assert str(exc.value).startswith(
        "no room for the zbal GVA heap: SGLANG_ZBAL_LOCAL_MEM_SIZE=%d MiB configured, 40000 MiB "
        "already in use (weights, KV cache, workspace) of the device's 65536 MiB total -> %d MiB "
        "left (%d after aligning down to 128 MiB); raise SGLANG_ZBAL_LOCAL_MEM_SIZE to at least "
        "40128 or lower --mem-fraction-static" % (in_use + left, left, after))


@pytest.mark.parametrize("left, size", [(128, 128), (129, 128), (255, 128), (256, 256)])
def test_one_aligned_block_or_more_left_is_the_heap(zb, simnpu_clean, monkeypatch, left, size):
    assert _sized(monkeypatch, 40000 + left, 40000 * MIB) == (size, 40000, 65536)


@pytest.mark.parametrize("extra_bytes, in_use_mib, outcome", [
    (-1, 40000, 128),   # one byte under 40000 MiB in use counts as 40000 MiB
    (0, 40000, 128),    # exactly 40000 MiB
    (1, 40001, None),   # one byte more is a whole MiB more: 127 MiB left, no room
])
def test_in_use_is_rounded_up_to_the_mib_at_the_boundary(zb, simnpu_clean, monkeypatch, extra_bytes,
                                                         in_use_mib, outcome):
    if outcome is None:
        with pytest.raises(zp.ZbalError, match="40001 MiB already in use .* -> 127 MiB left"):
            _sized(monkeypatch, 40128, 40000 * MIB + extra_bytes)
    else:
        assert _sized(monkeypatch, 40128, 40000 * MIB + extra_bytes) == (outcome, in_use_mib, 65536)


# -- sglang's metrics once the heap is set up ---------------------------------------------------------

@pytest.fixture
def state_dir(monkeypatch):
    """The details as the last ``metrics.publish`` of the patch saw them (the runtime's snapshot
    hands PROC.details to the gauges)."""
    from npu_shim.reporting import metrics

    published = []
    monkeypatch.setattr(metrics, "publish", lambda: published.append(dict(PROC.details)))
    return lambda: published[-1]


def test_the_metrics_carry_the_lazy_heap_once_it_is_set_up(zb, simnpu_clean, state_dir):
    simzbal.STATE.mix = True
    make_scheduler(simnpu_clean)  # mix mode: the allocator only; written at once
    assert state_dir() == {"mode": "mix", "allocator": "zbal (GVA heap after the KV cache)"}
    simnpu_clean.set_memory(total_mib=65536, free_mib=30000)
    FakeRunner().initialize(1.0)
    assert state_dir() == {"mode": "mix", "allocator": "zbal (GVA heap after the KV cache)",
                           "gva_mib": 25856, "in_use_mib": 35536, "device_total_mib": 65536,
                           "gva_init": "before device-graph capture"}


def test_the_metrics_carry_the_full_mode_heap_at_scheduler_start(zb, simnpu_clean, state_dir):
    make_scheduler(simnpu_clean)
    assert state_dir() == {"mode": "full", "gva_mib": 61440}
