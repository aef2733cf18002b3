"""zbal backport, the wrappers as sglang and operators meet them: which wrapper each target installs
(and that it behaves, driven through the decision's own targets), the exact error and log texts,
the memory figures and the collective calls behind them, and the arguments every wrapper hands on.

Every wrapper is built inside its test from a fresh ``ZbalState`` (never at import), over
memfabric-zbal's own Python layer on the simulated native module, as tests/patches/test_zbal.py
does; zbal_init's arguments are what the simulated bootstrap received."""
from __future__ import annotations

import sys
import types

import pytest
import torch
import wrapt

from npu_shim.core import framework
from npu_shim.patches import zbal as zp
from shimdev import simzbal

from test_zbal import original_function, view

MIB = 1 << 20
GIB = 1 << 30
ON = {"SGLANG_ZBAL_LOCAL_MEM_SIZE": "61440"}
MISSING_TAIL = ("asks for the zbal allocator, but the Python package 'zbal' is not importable: install "
                "memfabric-zbal (pip install memfabric-zbal) into this image, or unset "
                "SGLANG_ZBAL_LOCAL_MEM_SIZE to run on torch_npu's native allocator")


@pytest.fixture
def zb(simnpu_clean, zbal_pkg, monkeypatch):
    """Simulated zbal reset, size 61440 MiB, no bootstrap URL, a one-rank world group, and
    ZBAL_ENABLE_GRAPH (variable and zbal_module's global) restored after the test."""
    simzbal.reset()
    monkeypatch.setenv("SGLANG_ZBAL_LOCAL_MEM_SIZE", "61440")
    for name in ("SGLANG_ZBAL_BOOTSTRAP_URL", "MASTER_ADDR", "MASTER_PORT", zp.GRAPH_SWITCH):
        monkeypatch.setenv(name, "")  # recorded, so that delenv's absence is restored too
        monkeypatch.delenv(name)
    monkeypatch.setattr(zbal_pkg.zbal_module, zp.GRAPH_SWITCH, False)
    monkeypatch.setattr(zp, "_world_group", lambda: types.SimpleNamespace(
        world_size=1, rank_in_group=0, cpu_group=None))
    yield zbal_pkg
    simzbal.reset()


@pytest.fixture
def npu_log(caplog):
    """The shim's log records as (level, message), from DEBUG up."""
    from npu_shim.reporting import log

    log.configure()  # sets the logger's level once per process: before caplog lowers it
    with caplog.at_level("DEBUG", logger="npu_shim"):
        yield lambda: [(r.levelname, r.getMessage()) for r in caplog.records if r.name.startswith("npu_shim")]


def scheduler_class():
    class Scheduler:
        def __init__(self, server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, attn_cp_rank,
                     moe_dp_rank, dp_rank):
            self.started = (gpu_id, tp_rank, dp_rank)

    return Scheduler


def wrapped_scheduler(wrapper):
    cls = scheduler_class()
    cls.__init__ = wrapt.FunctionWrapper(cls.__dict__["__init__"], wrapper)
    return cls


def server_args(tp=4, pp=1, graphs=False):
    return types.SimpleNamespace(tp_size=tp, pp_size=pp, disable_cuda_graph=not graphs)


def start_scheduler(state, tp=4, pp=1, gpu_id=2, tp_rank=3):
    cls = wrapped_scheduler(state.scheduler_init_wrapper(zp.SCHEDULER_INIT_SIGS[1]))
    return cls(server_args(tp, pp), None, gpu_id, tp_rank, 0, 0, 0, 0, None)


class Runner:
    """A ModelRunner as the wrappers read it: ``device``, ``gpu_id``, ``is_draft_worker``."""

    def __init__(self, device="npu", draft=False, fail=None, graphs=True):
        self.device, self.gpu_id, self.is_draft_worker = device, 0, draft
        self.fail, self.graphs, self.calls = fail, graphs, []

    def initialize(self, pre_model_load_memory):
        self.calls.append(("initialize", pre_model_load_memory))
        if self.fail:
            raise self.fail
        if self.graphs:
            self.init_device_graphs()

    def init_device_graphs(self):
        self.calls.append(("init_device_graphs",))


def wrapped_runner_class(state):
    cls = type("Runner", (Runner,), {})
    cls.initialize = wrapt.FunctionWrapper(Runner.__dict__["initialize"], state.model_runner_initialize)
    cls.init_device_graphs = wrapt.FunctionWrapper(Runner.__dict__["init_device_graphs"],
                                                   state.model_runner_init_device_graphs)
    return cls


def mix_mode_started(zb):
    """Mix mode as the scheduler leaves it: zbal's allocator switched in before any allocation."""
    simzbal.STATE.mix = True
    zb.switch_to_allocator()


# -- the targets: which wrapper each installs ------------------------------------------------------

def by_name(decision):
    return {t.describe(): t for t in decision.targets}


@pytest.mark.parametrize("version, has_map", [("0.5.9", False), ("0.5.11", True)])
def test_each_target_installs_its_wrapper_bound_to_the_decision_s_state(zb, simnpu_clean, version, has_map):
    d = framework.decide(zp.PATCH, view(version), environ=ON, on_npu=True)
    assert d.state == framework.APPLIED, d.reason
    found, state = by_name(d), d.process_state
    assert found[zp.COMMON + ":get_available_gpu_memory"].wrapper is zp.get_available_gpu_memory
    assert found[zp.COMMON + ":get_npu_memory_capacity"].wrapper is zp.get_npu_memory_capacity
    assert found[zp.MODEL_RUNNER + ":ModelRunner.initialize"].wrapper == state.model_runner_initialize
    assert found[zp.MODEL_RUNNER + ":ModelRunner.init_device_graphs"].wrapper == \
        state.model_runner_init_device_graphs
    # Scheduler.__init__: the release's arguments read by name, zbal set up on the decision's state
    cls = wrapped_scheduler(found[zp.SCHEDULER + ":Scheduler.__init__"].wrapper)
    assert cls(server_args(tp=8), None, 5, 6, 0, 0, 0, 0, None).started == (5, 6, None)
    args, = simzbal.bootstraps()
    assert (args["world_size"], args["device_id"], args["rank_id"]) == (8, 5, 6)
    assert (state.mode, state.gva_mib) == ("full", 61440)
    # init_distributed_environment: hccl means the NPU only where the release has no backend map
    seen = []

    def init_distributed_environment(world_size=-1, rank=-1, distributed_init_method="env://",
                                     local_rank=-1, backend="nccl", timeout=None):
        seen.append(backend)

    dist = wrapt.FunctionWrapper(init_distributed_environment,
                                 found[zp.PARALLEL_STATE + ":init_distributed_environment"].wrapper)
    dist(backend="hccl")
    assert seen == ["hccl" if has_map else "zbal"]


class MissingView:
    """A release's view where one function is absent or has other parameters."""

    def __init__(self, base, qualname, params=None):
        self._base, self._qualname, self._params = base, qualname, params

    def function(self, dotted, qualname):
        if qualname == self._qualname:
            if self._params is None:
                return None
            return types.SimpleNamespace(qualname=qualname, params=self._params)
        return self._base.function(dotted, qualname)

    def has(self, dotted, qualname):
        if qualname == self._qualname:
            return self._params is not None
        return self._base.has(dotted, qualname)

    def __getattr__(self, name):
        return getattr(self._base, name)


@pytest.mark.parametrize("qualname, params, reason", [
    ("Scheduler.__init__", None, "sglang.srt.managers.scheduler:Scheduler.__init__ not found"),
    ("init_distributed_environment", None,
     "sglang.srt.distributed.parallel_state:init_distributed_environment not found"),
    ("init_distributed_environment", ("world_size", "rank", "distributed_init_method", "local_rank", "timeout"),
     "sglang.srt.distributed.parallel_state:init_distributed_environment has signature (world_size, rank, "
     "distributed_init_method, local_rank, timeout), known: "),
])
def test_a_release_without_a_wrapped_function_is_unsupported_and_says_which(zbal_pkg, qualname, params, reason):
    """The release matrix and status decide on every source: a missing or reshaped function is an
    ``unsupported`` decision naming it, never a crash while the targets are built."""
    d = framework.decide(zp.PATCH, MissingView(view("0.5.11"), qualname, params), environ=ON, on_npu=True)
    assert d.state == framework.UNSUPPORTED
    assert d.reason.startswith(reason)


def test_source_check_problems_say_which_branch_is_missing():
    v = view("0.5.11")
    broken = types.SimpleNamespace(
        function=v.function, has=v.has,
        module=lambda name: types.SimpleNamespace(contains=lambda pattern: False))
    problems = {t.check_source(broken) for t in framework.targets_for(zp.PATCH, v)[1]} - {None}
    assert problems == {
        "sglang.srt.utils.common:get_available_gpu_memory: the NPU branch the full-mode query re-states "
        "not found in the source",
        "sglang.srt.model_executor.model_runner:ModelRunner.init_device_graphs: the NPU branch "
        "'init_attention_backend(); init_device_graphs()' of initialize not found in the source"}


# -- probe, trigger, must_honour -------------------------------------------------------------------

def has_only(*present):
    return types.SimpleNamespace(has=lambda module, qualname: (module, qualname) in present)


@pytest.mark.parametrize("present, evidence", [
    ([(zp.SCHEDULER, "Scheduler.init_zbal_on_npu")], "Scheduler.init_zbal_on_npu"),
    ([(zp.NPU_UTILS, "init_zbal")], "hardware_backend.npu.utils.init_zbal"),
    ([(zp.SCHEDULER, "Scheduler.init_zbal_on_npu"), (zp.NPU_UTILS, "init_zbal")], "Scheduler.init_zbal_on_npu"),
    ([(zp.NPU_UTILS, "init_zbal_gva")], None),
    ([], None),
])
def test_upstream_is_found_by_either_of_its_functions(present, evidence):
    """The evidence is the ``upstream`` decision's reason ("sglang X has it: <evidence>")."""
    assert zp.PATCH.probe(has_only(*present)) == evidence


def test_one_mib_is_a_request_for_zbal(zbal_pkg):
    environ = {"SGLANG_ZBAL_LOCAL_MEM_SIZE": "1"}
    assert zp.PATCH.must_honour(environ) is True
    assert framework.decide(zp.PATCH, view("0.5.11"), environ=environ, on_npu=True).state == framework.APPLIED


@pytest.mark.parametrize("environ", [{}, {"SGLANG_ZBAL_LOCAL_MEM_SIZE": "0"}])
def test_inactive_reason_is_exact(environ):
    d = framework.decide(zp.PATCH, view("0.5.11"), environ=environ, on_npu=True)
    assert (d.state, d.reason) == (framework.INACTIVE, "SGLANG_ZBAL_LOCAL_MEM_SIZE is unset or 0")


# -- zbal missing: the operator's instructions -------------------------------------------------------

def test_missing_message_names_the_value_the_package_and_the_way_out(monkeypatch):
    monkeypatch.setenv("SGLANG_ZBAL_LOCAL_MEM_SIZE", "61440")
    assert zp.missing_message() == "SGLANG_ZBAL_LOCAL_MEM_SIZE=61440 " + MISSING_TAIL
    monkeypatch.delenv("SGLANG_ZBAL_LOCAL_MEM_SIZE")
    assert zp.missing_message() == "SGLANG_ZBAL_LOCAL_MEM_SIZE= " + MISSING_TAIL  # unset: nothing shown


def test_import_failure_message(monkeypatch):
    monkeypatch.setenv("SGLANG_ZBAL_LOCAL_MEM_SIZE", "61440")
    monkeypatch.setitem(sys.modules, "zbal", None)
    with pytest.raises(zp.ZbalError) as exc:
        zp.zbal_module()
    assert str(exc.value) == ("SGLANG_ZBAL_LOCAL_MEM_SIZE=61440 " + MISSING_TAIL
                              + " (import failed: import of zbal halted; None in sys.modules)")


def test_a_zbal_module_without_a_spec_is_not_findable(monkeypatch):
    """find_spec raises ValueError for a module whose __spec__ is None (e.g. one put in
    sys.modules by hand): not findable, so the patch fails with the install hint."""
    broken = types.ModuleType("zbal")
    broken.__spec__ = None
    monkeypatch.setitem(sys.modules, "zbal", broken)
    monkeypatch.setenv("SGLANG_ZBAL_LOCAL_MEM_SIZE", "61440")
    assert zp.zbal_findable() is False
    with pytest.raises(zp.ZbalError, match="is not importable"):
        zp.require_zbal()


def test_npu_memory_capacity_without_torch_npu_raises_the_original_s_error(zb, monkeypatch):
    wrapped = wrapt.FunctionWrapper(original_function("0.5.11", "get_npu_memory_capacity"),
                                    zp.get_npu_memory_capacity)
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(ImportError) as exc:
        wrapped()
    assert str(exc.value) == "torch_npu is required when run on npu device."


# -- 1. Scheduler.__init__ -----------------------------------------------------------------------------

def test_scheduler_wrapper_passes_keyword_arguments_on(zb, simnpu_clean):
    state = zp.ZbalState()
    cls = wrapped_scheduler(state.scheduler_init_wrapper(zp.SCHEDULER_INIT_SIGS[1]))
    scheduler = cls(server_args=server_args(), port_args=None, gpu_id=2, tp_rank=3, moe_ep_rank=0,
                    pp_rank=0, attn_cp_rank=0, moe_dp_rank=0, dp_rank=7)
    assert scheduler.started == (2, 3, 7)
    args, = simzbal.bootstraps()
    assert (args["device_id"], args["rank_id"]) == (2, 3)


def test_scheduler_that_captures_graphs_gets_the_pool_hooks(zb, simnpu_clean):
    import os

    state = zp.ZbalState()
    cls = wrapped_scheduler(state.scheduler_init_wrapper(zp.SCHEDULER_INIT_SIGS[1]))
    cls(server_args(graphs=True), None, 2, 3, 0, 0, 0, 0, None)
    assert os.environ[zp.GRAPH_SWITCH] == "1" and zb.zbal_module.ZBAL_ENABLE_GRAPH is True
    assert state.details["graph_pool_hooks"] == 1


def test_a_zbal_module_without_the_graph_global_is_not_given_one(zb, monkeypatch):
    """Only a zbal_module that reads the global (memfabric-zbal 1.2.0) has it set; another
    version's module is left as it is."""
    other = types.ModuleType("zbal.zbal_module")
    monkeypatch.setitem(sys.modules, "zbal.zbal_module", other)
    zp.ZbalState().graph_pool_hooks(server_args(graphs=True))
    assert not hasattr(other, zp.GRAPH_SWITCH)


def test_scheduler_set_up_twice_says_so_at_debug(zb, simnpu_clean, npu_log):
    state = zp.ZbalState()
    start_scheduler(state)
    start_scheduler(state)
    assert len(simzbal.bootstraps()) == 1
    assert npu_log() == [
        ("INFO", "zbal: rank 3 initialised a 61440 MiB heap in full mode (device 2, world 4)"),
        ("DEBUG", "zbal: already set up in this process (full mode)")]


def test_pp_in_full_mode_error_text(zb, simnpu_clean):
    with pytest.raises(zp.ZbalError) as exc:
        start_scheduler(zp.ZbalState(), pp=2)
    assert str(exc.value) == ("only zbal mix mode supports pp_size > 1 (got pp_size=2 with "
                              "SGLANG_ZBAL_LOCAL_MEM_SIZE=61440 in full mode); enable zbal's mix mode "
                              "or use pp_size 1")


def test_init_failure_without_bootstrap_url_names_no_bootstrap(zb, simnpu_clean):
    simzbal.STATE.init_result = False
    with pytest.raises(zp.ZbalInitError) as exc:
        start_scheduler(zp.ZbalState())
    assert str(exc.value) == ("zbal_init failed (full mode, Scheduler start-up): rank 3 of 4, device 2, "
                              "61440 MiB; see zbal's log above (memfabric library path, bootstrap server "
                              "reachable, device memory free)")


# -- 2. ModelRunner: the lazy GVA heap ---------------------------------------------------------------

def test_initialize_passes_keyword_arguments_on(zb, simnpu_clean):
    state = zp.ZbalState()
    runner = wrapped_runner_class(state)()
    runner.initialize(pre_model_load_memory=12.5)
    assert runner.calls == [("initialize", 12.5), ("init_device_graphs",)]


def test_a_failed_initialize_leaves_no_runner_marked(zb, simnpu_clean):
    """A later graph capture outside initialize (sglang re-captures) must not set the heap up."""
    mix_mode_started(zb)
    state = zp.ZbalState()
    runner = wrapped_runner_class(state)(fail=RuntimeError("out of memory loading weights"))
    with pytest.raises(RuntimeError, match="out of memory"):
        runner.initialize(1.0)
    assert state.initializing == set()
    runner.init_device_graphs()
    assert simzbal.bootstraps() == [] and state.gva_mib is None


def test_heap_set_up_after_initialize_says_when(zb, simnpu_clean):
    mix_mode_started(zb)
    simnpu_clean.set_memory(total_mib=65536, free_mib=30000)
    state = zp.ZbalState()
    wrapped_runner_class(state)(graphs=False).initialize(1.0)
    assert state.details["gva_init"] == "after ModelRunner.initialize"
    assert state.gva_mib == 25856


def test_heap_set_up_after_initialize_failure_says_when(zb, simnpu_clean):
    mix_mode_started(zb)
    simzbal.STATE.init_result = False
    with pytest.raises(zp.ZbalInitError) as exc:
        wrapped_runner_class(zp.ZbalState())(graphs=False).initialize(1.0)
    assert str(exc.value).startswith("zbal_init failed (mix mode, lazy GVA heap after ModelRunner.initialize): "
                                     "rank 0 of 1, device 0, 61440 MiB; ")


class BareRunner:
    """A runner without the attributes a release may lack (no ``is_draft_worker``, or no ``device``)."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)


def test_a_runner_without_is_draft_worker_is_not_a_draft(zb, simnpu_clean):
    mix_mode_started(zb)
    state = zp.ZbalState()
    assert state.lazy_init_due(BareRunner(device="npu", gpu_id=0)) is True
    assert "draft_worker_skipped" not in state.details


def test_a_runner_without_a_device_is_not_due(zb, simnpu_clean):
    mix_mode_started(zb)
    assert zp.ZbalState().lazy_init_due(BareRunner(gpu_id=0)) is False


def test_the_gva_line_on_stdout_is_upstream_s(zb, simnpu_clean, capsys):
    """Operators' log scrapers look for upstream's own line."""
    mix_mode_started(zb)
    simnpu_clean.set_memory(total_mib=65536, free_mib=30000)
    zp.ZbalState().lazy_init(BareRunner(device="npu", gpu_id=0), "before device-graph capture")
    assert "[ZBAL] rank 0 allocated 25856 MB gva space.\n" in capsys.readouterr().out.splitlines(keepends=True)


def test_lazy_init_sizes_the_heap_over_the_world_group_s_cpu_group(zb, simnpu_clean, monkeypatch):
    mix_mode_started(zb)
    seen = []
    group = types.SimpleNamespace(world_size=2, rank_in_group=1, cpu_group=object())
    monkeypatch.setattr(zp, "gva_size_mib", lambda *args: seen.append(args) or (1024, 500, 65536))
    zp.ZbalState().lazy_init(BareRunner(device="npu", gpu_id=1), "before device-graph capture", group)
    assert seen == [(61440, 2, group.cpu_group)]
    args, = simzbal.bootstraps()
    assert (args["world_size"], args["rank_id"], args["device_id"], args["device_mem_size"]) == (2, 1, 1, 1024 * MIB)


def test_mix_mode_on_the_native_allocator_error_text(zb, simnpu_clean):
    simzbal.STATE.mix = True
    with pytest.raises(zp.ZbalError) as exc:
        zp.ZbalState().lazy_init(BareRunner(device="npu", gpu_id=0), "before device-graph capture")
    assert str(exc.value) == (
        "zbal mix mode: the GVA heap needs zbal's allocator, switched in before the first NPU allocation "
        "(at sglang's Scheduler start-up), but this process allocated on torch_npu's native allocator, "
        "which cannot be swapped once used (a ModelRunner started without sglang's Scheduler?); unset "
        "SGLANG_ZBAL_LOCAL_MEM_SIZE for this process")


def test_device_total_is_whole_mib(zb, simnpu_clean, monkeypatch):
    """The details (and /metrics) carry whole MiB even where the device total is not."""
    total = 65536 * MIB + 300 * 1024
    monkeypatch.setattr(torch.npu, "mem_get_info", lambda device=None: (total - 40000 * MIB, total))
    size, in_use, total_mib = zp.gva_size_mib(40256, 1, None)
    assert (size, in_use, total_mib) == (256, 40000, 65536) and type(total_mib) is int


# -- 3. get_available_gpu_memory ---------------------------------------------------------------------

def available():
    return wrapt.FunctionWrapper(original_function("0.5.11", "get_available_gpu_memory"),
                                 zp.get_available_gpu_memory)


def test_mix_mode_query_passes_keyword_arguments_to_the_original(zb, simnpu_clean):
    simzbal.STATE.mix = True
    simnpu_clean.set_memory(total_mib=65536, free_mib=4096)
    assert available()("npu", 0, empty_cache=False) == 4.0
    assert simnpu_clean.events("empty_cache") == []  # the original was told not to empty it


def test_gpu_id_equal_to_the_device_count_fails_the_assert(zb, simnpu_clean):
    with pytest.raises(AssertionError):
        available()("npu", torch.npu.device_count())


@pytest.mark.parametrize("current, expect_warning", [(1, True), (0, False)])
def test_current_device_warning_as_the_original_prints_it(zb, simnpu_clean, monkeypatch, capsys, current,
                                                          expect_warning):
    from shimdev.simnpu import _device

    monkeypatch.setattr(_device.STATE, "device_count", 2)
    torch.npu.set_device(current)
    available()("npu", 0)
    got = capsys.readouterr().out
    expected = ("WARNING: current device is not 0, but 1,  which may cause useless memory allocation for "
                "torch NPU context.\n") if expect_warning else ""
    assert got == expected


@pytest.mark.parametrize("call", [
    lambda f, group: f("npu", 0, distributed=True, cpu_group=group),
    lambda f, group: f("npu", 0, True, True, group),
], ids=["keywords", "positional"])
def test_full_mode_free_memory_is_the_min_over_the_cpu_group(zb, simnpu_clean, monkeypatch, call):
    seen = []

    def all_reduce(tensor, op=None, group=None):
        seen.append((op, group))
        tensor.fill_(2 * GIB)  # another rank has less free

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    simzbal.STATE.heap_free = 3 * GIB
    group = object()
    assert call(available(), group) == 2.0
    assert seen == [(torch.distributed.ReduceOp.MIN, group)]


# -- 6. init_distributed_environment ------------------------------------------------------------------

def _recorder():
    seen = []

    def init_distributed_environment(world_size=-1, rank=-1, distributed_init_method="env://",
                                     local_rank=-1, backend="nccl", timeout=None):
        seen.append((world_size, rank, distributed_init_method, local_rank, backend, timeout))

    return seen, init_distributed_environment


def dist_wrapped(state, hccl_means_npu=True):
    seen, body = _recorder()
    return seen, wrapt.FunctionWrapper(body, state.init_dist_wrapper(zp.INIT_DIST_SIGS[0], hccl_means_npu))


def test_hccl_to_zbal_keeps_every_other_argument(zb):
    seen, wrapped = dist_wrapped(zp.ZbalState())
    wrapped(2, 0, "tcp://x:1", 0, backend="hccl")  # as many positional arguments as before backend
    wrapped(2, 0, "tcp://x:1", 0, "hccl", 30)
    wrapped(world_size=2, rank=1, distributed_init_method="tcp://x:1", local_rank=1, backend="hccl",
            timeout=60)
    assert seen == [(2, 0, "tcp://x:1", 0, "zbal", None), (2, 0, "tcp://x:1", 0, "zbal", 30),
                    (2, 1, "tcp://x:1", 1, "zbal", 60)]


def test_the_details_say_zbal_is_the_distributed_backend_only_when_it_is(zb):
    state = zp.ZbalState()
    seen, wrapped = dist_wrapped(state, hccl_means_npu=False)
    wrapped(backend="gloo")
    assert state.details == {}
    wrapped(backend="zbal")
    assert state.details == {"dist_backend": "zbal"}
    assert [s[4] for s in seen] == ["gloo", "zbal"]
