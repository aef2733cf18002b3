"""Feature drivers for ``scripts/demo.py`` -- run inside a release venv (simulated NPU, real sglang).

``run_all(release)`` drives each patch on a small synthetic model through the release's *real*
modules and returns plain JSON-able facts; the demo formats them.  It is called once, in one
interpreter started by ``realsglang.run_in_release(..., env=DEMO_ENV, zbal=True)``:

* zbal -- the real (wrapped) ``Scheduler.__init__`` with a recording stub body, the real
  ``ModelRunner.initialize`` body on a runner whose heavy steps are stubs that take simulated device
  memory (64 GB device), the real ``get_available_gpu_memory`` / ``get_npu_memory_capacity``;
* mla_weight_release -- a GLM-5-shaped MLA layer through the real ``npu_mla_preprocess`` with the
  decode role published through real ``ServerArgs`` (dev/shimdev/mla_kernels.py);
* dual_stream_experts -- the real ``Glm4MoeSparseMoeBlock.forward_deepep`` (wrapped on 0.5.9, the
  release's own on 0.5.10+) on a synthetic block; the stream each part ran on from simnpu.EVENTS,
  and what the stream sanitizer (on in every call) reported.

A scheduler process's start, for the role tests (tests/runtime/test_role_real.py,
tests/reporting/test_state_records_real.py): ``enter_scheduler_process`` calls the real (wrapped)
``run_scheduler_process`` with ``StopAtBody`` server arguments, which end the call where the
body first reads them (a spawned child gets them as its arguments).

The zbal and GLM-4 MoE set-ups (``zbal_fresh``, ``event_order``, ``make_scheduler``,
``stub_model_runner``, ``glm4_moe_bed``) are shared with tests/patches/test_zbal_real.py and
tests/patches/test_dual_stream_experts_real.py, which import them from here.

Nothing heavy at module level: the outer test process imports this module too.
"""
from __future__ import annotations

import contextlib
import types

GIB, MIB = 1 << 30, 1 << 20

#: The demo's drivers, keyed by patch name: each runs the release's real (patched or own) code on a
#: synthetic model and returns JSON-able facts.  A patch without a driver needs no change here: the
#: demo shows its state, reason and details.  Filled by ``@driver(name)`` below.
DRIVERS = {}
#: Patches whose driver runs where the release has the feature upstream too (its own code runs).
DRIVE_UPSTREAM = set()


def driver(name, upstream_too=False):
    """Register the decorated function as the demo driver of patch ``name``."""
    def register(fn):
        DRIVERS[name] = fn
        if upstream_too:
            DRIVE_UPSTREAM.add(name)
        return fn
    return register

#: The environment the demo's release processes get: every patch's trigger set, the shim's own
#: switches at their defaults (a user's NPU_SHIM_* overrides would hide what the demo shows).
def _demo_env():
    """Every patch switched on and triggered: each variable any patch reads unset (None: removed
    from the child's environment), then each patch's declared ``trigger_env`` -- so a new patch is
    triggered here without an edit -- and the drivers' own sizes."""
    from npu_shim.core.loading import all_variables, load_all

    env = {var.name: None for var in all_variables()}
    env.update({alias: None for var in all_variables() for alias in var.aliases})
    env["NPU_SHIM_ENABLED"] = "1"
    for patch in load_all():
        env.update(patch.trigger_env)
    # the zbal driver's device is 64 GB (61440 MiB managed), its bootstrap URL a fixed one
    env.update(SGLANG_ZBAL_LOCAL_MEM_SIZE="61440", SGLANG_ZBAL_BOOTSTRAP_URL="tcp://10.0.0.1:6789")
    return env


DEMO_ENV = _demo_env()


# ------------------------------------------------------------------------------------ zbal

def zbal_fresh(mix=False, scheduler_started=False):
    """Reset the patch's per-process state, the simulated device and zbal's simulated native side
    (as a fresh process: torch_npu's native allocator again, swappable once).
    ``scheduler_started``: mix mode as Scheduler.__init__ leaves it for the model runner (zbal's
    allocator switched in before the device is touched; afterwards torch_npu refuses the switch)."""
    from shimdev import simnpu, simzbal
    import zbal
    from npu_shim.runtime import activation

    record = activation.RUNTIME.record("zbal")
    if record is not None and record.process_state is not None:
        record.process_state.__init__(record.details)  # a scheduler process sets zbal up once
    simnpu.reset()
    simzbal.reset()
    simzbal.STATE.mix = mix
    if scheduler_started:
        zbal.switch_to_allocator()
        simnpu.clear_events()  # the runner's own events start here


def event_order():
    """simnpu.EVENTS as names (calls into zbal's native side by their function name:
    ``zbal_bootstrap`` is what ``zbal_init`` ends in; the allocator swap is ``change_allocator``)."""
    from shimdev import simnpu

    return [e[1] if e[0] == "zbal" else e[0] for e in simnpu.EVENTS]


def _scheduler_body(self, server_args, port_args, gpu_id, tp_rank, *rest):
    from shimdev import simnpu
    import torch

    simnpu.log("body_start")
    self.t = torch.empty(4, device="npu")


def make_scheduler(tp=4, pp=1, gpu_id=0, tp_rank=3):
    """Construct the real (wrapped) Scheduler with its body replaced by a stub that allocates."""
    from shimdev import simnpu
    import sglang.srt.managers.scheduler as sch

    init = sch.Scheduler.__dict__["__init__"]
    real = init.__wrapped__
    init.__wrapped__ = _scheduler_body
    try:
        with simnpu.record_allocations():
            sch.Scheduler(types.SimpleNamespace(tp_size=tp, pp_size=pp), None, gpu_id, tp_rank,
                          0, 0, 0, 0, None)
    finally:
        init.__wrapped__ = real


class StopAtBody:
    """Server arguments with only the sizes the shim's role target reads: the first other
    attribute read (the start of ``run_scheduler_process``'s body) raises ``SystemExit(0)``."""

    def __init__(self, tp_size, pp_size=1, dp_size=None):
        self.tp_size, self.pp_size, self.dp_size = tp_size, pp_size, dp_size

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)  # pickle's and copy's look-ups
        raise SystemExit(0)


def enter_scheduler_process(tp=16, tp_rank=3, pp_rank=0, dp_rank=None):
    """Call the real (wrapped) run_scheduler_process in this process, up to its body's start."""
    import sglang.srt.managers.scheduler as sch

    try:
        sch.run_scheduler_process(*scheduler_process_args(tp, tp_rank, pp_rank, dp_rank))
    except SystemExit:
        pass


def scheduler_process_args(tp=16, tp_rank=3, pp_rank=0, dp_rank=None):
    """run_scheduler_process's positional arguments in this release (names from its signature)."""
    import inspect
    import sglang.srt.managers.scheduler as sch

    values = {"server_args": StopAtBody(tp), "gpu_id": tp_rank, "tp_rank": tp_rank,
              "pp_rank": pp_rank, "dp_rank": dp_rank}
    params = [p for p in inspect.signature(sch.run_scheduler_process).parameters.values()
              if p.default is inspect.Parameter.empty]
    return tuple(values.get(p.name, 0 if p.name.endswith("_rank") else None) for p in params)


class _Falsy:
    def __bool__(self):
        return False

    def __call__(self, *a, **k):
        return _Falsy()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Falsy()


class _Args(_Falsy):
    disable_cuda_graph = True
    model_impl = "auto"
    forward_hooks = None
    torchao_config = ""
    max_running_requests = None


def _noop(*a, **k):
    return None


def stub_model_runner():
    """A ``ModelRunner`` subclass whose ``initialize`` is the release's real one and everything it
    calls that needs a model is a stub (weights / KV cache take simulated device memory); stubs
    what ``initialize`` reads from model_runner's globals.  Returns the class:
    ``Runner(draft=False, weights=MiB, kv=MiB).initialize(1.0)``."""
    from shimdev import simnpu
    import sglang.srt.model_executor.model_runner as mr
    from npu_shim.patches._impl import zbal as zbal_impl

    zbal_impl._world_group = lambda: types.SimpleNamespace(world_size=1, rank_in_group=0, cpu_group=None)
    for name in ("set_global_expert_location_metadata", "compute_initial_expert_location_metadata",
                 "set_global_expert_distribution_recorder", "apply_torchao_config_to_model",
                 "register_forward_hooks", "get_global_expert_location_metadata", "create_sampler"):
        if name in vars(mr):
            setattr(mr, name, _noop)
    mr.get_global_server_args = lambda: _Args()
    mr.ExpertDistributionRecorder = types.SimpleNamespace(init_new=_noop)

    class Runner(mr.ModelRunner):
        """Everything initialize() calls that needs a model is a stub; initialize() itself is real."""

        def __init__(self, draft=False, weights=0, kv=0):
            self.server_args = _Args(); self.device = "npu"; self.gpu_id = 0; self.tp_rank = 0
            self.tp_size = 1; self.dp_size = 1; self.moe_ep_rank = 0; self.is_draft_worker = draft
            self.enable_hisparse = False; self.spec_algorithm = _Falsy()
            self.eagle_use_aux_hidden_state = False; self.max_total_num_tokens = 64
            self.req_to_token_pool = types.SimpleNamespace(size=8)
            self.model_config = types.SimpleNamespace(
                num_nextn_predict_layers=None, num_hidden_layers=2, num_attention_layers=2,
                hf_config=types.SimpleNamespace(architectures=["LlamaForCausalLM"]))
            self._w, self._kv = weights, kv

        def _take(self, mib, what):
            simnpu.set_memory(free_mib=simnpu.STATE.free_mib - mib)
            simnpu.log(what)

        def load_model(self):
            self.model = types.SimpleNamespace()
            self._take(self._w, "weights")

        def init_memory_pool(self, *a, **k):
            self._take(self._kv, "kv_cache")

        def init_attention_backend(self):
            simnpu.log("attention_backend")

        @property
        def is_generation(self):  # first thing the real init_device_graphs reads
            simnpu.log("device_graphs_body")
            return False

        remote_instance_init_transfer_engine = configure_kv_cache_dtype = _noop
        maybe_init_ngram_embedding = init_routed_experts_capturer = _noop
        init_aux_hidden_state_capture = init_piecewise_cuda_graphs = _noop
        prealloc_symmetric_memory_pool = init_indexer_capturer = _noop
        init_lora_manager = apply_torch_tp = kernel_warmup = init_cublas = _noop

    return Runner


@driver("zbal")
def zbal_demo():
    """Init order (full / mix mode), the mix-mode lazy heap on a 64 GB device, memory queries."""
    from shimdev import simnpu, simzbal
    import sglang.srt.utils as u
    import sglang.srt.utils.common as common

    out = {}
    zbal_fresh()
    make_scheduler()
    out["full_order"] = event_order()
    (init,) = simzbal.bootstraps()
    out["full_init"] = {k: init[k] for k in ("world_size", "rank_id", "device_id", "ip_port")}
    out["full_init"]["mib"] = init["device_mem_size"] >> 20
    zbal_fresh(mix=True)
    make_scheduler()
    out["mix_order"] = event_order()
    out["mix_allocator"] = simnpu.allocator_backend()

    # Mix mode: the GVA heap is sized after weights + KV cache, before graph capture.
    Runner = stub_model_runner()
    zbal_fresh(mix=True, scheduler_started=True)
    simnpu.set_memory(total_mib=65536, free_mib=62000)
    Runner(weights=20000, kv=25000).initialize(1.0)
    out["runner_order"] = event_order()
    (init,) = simzbal.bootstraps()
    out["heap_mib"] = init["device_mem_size"] >> 20
    out["device_total_mib"], out["device_free_mib"] = 65536, simnpu.STATE.free_mib

    # Full mode: free memory comes from the zbal heap, capacity is the configured size.
    zbal_fresh()
    simnpu.set_memory(total_mib=65536, free_mib=1024)
    simzbal.STATE.heap_free, simzbal.STATE.heap_total = 10 * GIB + 5 * MIB, 60 * GIB
    out["mem"] = {"avail_gib": u.get_available_gpu_memory("npu", 0),
                  "avail_native_gib": common.get_available_gpu_memory.__wrapped__("npu", 0),
                  "capacity_mib": u.get_npu_memory_capacity(),
                  "capacity_native_mib": common.get_npu_memory_capacity.__wrapped__()}
    return out


# ------------------------------------------------------------------------ mla_weight_release

@driver("mla_weight_release")
def mla_demo(model="glm-5", tp=16):
    """Decode role: bytes released from one synthetic MLA layer; touching a released weight."""
    from shimdev import mla_kernels as K
    from npu_shim.runtime import activation
    from npu_shim.patches import mla_weight_release as R

    record = activation.RUNTIME.record("mla_weight_release")  # None until its modules are imported
    if record is not None:
        record.process_state.reset()
    K.publish_server_args("decode")
    r = K.run_layer(model, tp)
    m = r.pop("layer")
    out = {"model": model, "tp": tp, "freed": r["freed"], "expected": r["expected"],
           "before": r["before"], "kernels": r["kernels"], "outputs_equal": r["outputs"][0] == r["outputs"][1],
           "qkv_type": r["qkv_type"], "w_kc_type": r["w_kc_type"],
           "details": dict(activation.RUNTIME.record("mla_weight_release").details)}
    try:
        m.w_kc.sum()
        out["touch"] = None
    except R.ReleasedWeightError as exc:
        out["touch"] = [type(exc).__name__, str(exc)]
    return out


# ----------------------------------------------------------------------- dual_stream_experts

def glm4_moe_bed(kernel="partial", head_dim=16):
    """A small synthetic GLM-4 MoE block and two attention layers over the release's real
    ``glm4_moe`` classes, with run helpers; returns every name as a namespace.  ``kernel`` is
    "partial", "full_head" or None (see dev/shimdev/dual_stream_kernels.py).  ``head_dim``: 0.5.7
    and 0.5.8 build their NPU rotary embedding only for head sizes 64/128/256/512 (others take a
    vllm kernel)."""
    import torch
    from npu_shim.patches._selftest import synthetic_moe
    from shimdev import simnpu
    from shimdev import dual_stream_kernels as K
    from shimdev import mla_kernels

    K.install(simnpu, kernel=kernel)

    import sglang.srt.models.glm4_moe as m
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.rotary_embedding import get_rope
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from torch.overrides import TorchFunctionMode
    from npu_shim.runtime import activation
    from npu_shim.source.reading import unwrap

    # What the real constructors read from a launched server: real ServerArgs, published as the
    # scheduler publishes them (each release has its own way to read them back).
    mla_kernels.publish_server_args("null")
    # ExpertLocationDispatchInfo.init_new needs EPLB metadata of a launched server; both the
    # original and the patched body read it from the module globals, so both see this stand-in.
    m.ExpertLocationDispatchInfo = types.SimpleNamespace(init_new=lambda layer_id: None)

    torch.manual_seed(0)
    H, I, E, TOPK = 16, 8, 4, 2

    def where():
        return simnpu.current_stream_name()

    def logged(name):
        def hook(module, args):
            simnpu.log("compute", name, where())
        return hook

    class TopKRef:
        # 0.5.20+ read the scaling-factor fusion from the config (same answer as the experts' flag).
        topk_config = types.SimpleNamespace(
            apply_routed_scaling_factor_on_output=False, use_grouped_topk=False, correction_bias=None,
            scoring_func="softmax", custom_routing_function=None)

        def __call__(self, hidden_states, router_logits, num_token_non_padded=None,
                     expert_location_dispatch_info=None):
            simnpu.log("compute", "topk", where())
            weights, ids = torch.softmax(router_logits.float(), dim=-1).topk(TOPK, dim=-1)
            return weights / weights.sum(dim=-1, keepdim=True), ids

        def empty_topk_output(self, device):
            simnpu.log("compute", "empty_topk", where())
            return torch.empty(0, TOPK), torch.empty(0, TOPK, dtype=torch.long)

    class ExpertsRef(torch.nn.Module):
        should_fuse_routed_scaling_factor_in_topk = False

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(E, H, H) / H ** 0.5)

        def forward(self, hidden_states, topk_output):
            weights, ids = topk_output
            per_expert = torch.einsum("th,ehg->teg", hidden_states, self.w)
            picked = per_expert.gather(1, ids.unsqueeze(-1).expand(-1, -1, H))
            return (picked * weights.unsqueeze(-1).to(picked.dtype)).sum(dim=1)

    block = m.Glm4MoeSparseMoeBlock.__new__(m.Glm4MoeSparseMoeBlock)
    torch.nn.Module.__init__(block)
    block.layer_id = 3
    block.num_fused_shared_experts = 0
    block.routed_scaling_factor = 2.5
    block.gate = m.Glm4MoeGate(types.SimpleNamespace(n_routed_experts=E, hidden_size=H))  # real
    torch.nn.init.normal_(block.gate.weight)
    block.shared_experts = synthetic_moe.mlp_class()(H, I)  # the selftest's shared-expert MLP
    block.topk = TopKRef()
    block.experts = ExpertsRef()
    block.gate.register_forward_pre_hook(logged("gate"))
    block.shared_experts.register_forward_pre_hook(logged("shared"))
    block.experts.register_forward_pre_hook(logged("experts"))

    class InPlaceLog(TorchFunctionMode):
        """Logs the in-place ops (the combine) with the stream they are queued on."""

        def __torch_function__(self, func, types_, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in ("add_", "mul_", "__imul__", "__iadd__"):
                simnpu.log("op", name, where())
            return func(*args, **(kwargs or {}))

    def batch(mode):
        # 0.5.21+ ask the batch through moe_num_token_non_padded(); earlier ones read the field.
        return types.SimpleNamespace(forward_mode=mode, num_token_non_padded=None,
                                     moe_num_token_non_padded=lambda: None,
                                     token_to_kv_pool=types.SimpleNamespace(start_layer=0))

    ORDER_KINDS = ("stream_create", "wait_stream", "stream_enter", "stream_exit", "compute", "op")
    sanitizer_reports = []  # what the stream sanitizer found in the patched calls (on in every moe())

    def moe(hidden, mode):
        """(patched output, original output, ordered events of the patched call)."""
        simnpu.clear_events()
        # A driver already runs under run_drivers' sanitizer; a test calling moe() gets its own.
        own = simnpu.active_sanitizer() is None
        with InPlaceLog(), (simnpu.sanitize() if own else contextlib.nullcontext()) as san:
            out = block.forward_deepep(hidden, batch(mode))
        if own:
            sanitizer_reports.extend(report.as_dict() for report in san.reports)
        events = [list(e) for e in simnpu.EVENTS if e[0] in ORDER_KINDS]
        ref = unwrap(m.Glm4MoeSparseMoeBlock.forward_deepep)(block, hidden, batch(mode))
        return out, ref, events

    HD, NH, NKV = head_dim, 4, 2
    rope = get_rope(HD, rotary_dim=HD, max_position=64, partial_rotary_factor=0.5, base=10000)
    cos_sin_calls = []
    _get_cos_sin = rope.get_cos_sin_with_position

    def counting_get_cos_sin(positions):
        cos_sin_calls.append(positions.shape[0])
        return _get_cos_sin(positions)
    rope.get_cos_sin_with_position = counting_get_cos_sin

    class QKVRef(torch.nn.Module):
        def __init__(self, out):
            super().__init__()
            self.lin = torch.nn.Linear(H, out)

        def forward(self, x):
            return self.lin(x), None

    def make_attn(layer_id):
        a = m.Glm4MoeAttention.__new__(m.Glm4MoeAttention)
        torch.nn.Module.__init__(a)
        a.head_dim, a.num_heads, a.num_kv_heads = HD, NH, NKV
        a.q_size, a.kv_size = NH * HD, NKV * HD
        a.use_qk_norm, a.alt_stream = True, None
        a.q_norm, a.k_norm = RMSNorm(HD, eps=1e-5), RMSNorm(HD, eps=1e-5)  # real
        torch.nn.init.normal_(a.q_norm.weight, 1.0, 0.2)
        torch.nn.init.normal_(a.k_norm.weight, 1.0, 0.2)
        a.rotary_emb = rope  # real; get_rope shares one object between layers, as in the model
        a.qkv_proj = QKVRef(a.q_size + 2 * a.kv_size)
        a.attn = types.SimpleNamespace(layer_id=layer_id)
        return a

    layers = [make_attn(0), make_attn(1)]

    def prepare(layer, positions, hidden, mode):
        """(patched q,k,v, original q,k,v) of one layer."""
        fb = batch(mode)
        _, _, got = layer.forward_prepare(positions, hidden, fb)
        _, _, ref = unwrap(m.Glm4MoeAttention.forward_prepare)(layer, positions, hidden, fb)
        return got[:3], ref[:3]

    def max_diff(got, ref):
        return max(float((g.float() - r.float()).abs().max()) for g, r in zip(got, ref))

    def state():
        return activation.RUNTIME.states()["dual_stream_experts"]

    def wrapped_names():
        return {
            "forward_deepep": type(m.Glm4MoeSparseMoeBlock.__dict__["forward_deepep"]).__name__,
            "forward_prepare": type(m.Glm4MoeAttention.__dict__["forward_prepare"]).__name__,
        }

    return types.SimpleNamespace(**locals())


@driver("dual_stream_experts", upstream_too=True)
def dual_stream_demo():
    """Which stream ran the shared experts in an extend batch (the patched or the release's own
    forward_deepep), and whether the output equals the single-stream one."""
    import os

    import torch

    b = glm4_moe_bed("partial", head_dim=64)  # a size every release's NPU rope takes
    h = torch.randn(5, b.H)
    out, ref, events = b.moe(h, b.ForwardMode.EXTEND)
    computes = {e[1]: e[2] for e in events if e[0] == "compute"}
    result = {"wrapped": b.wrapped_names(), "streams": computes,
              "waits": [e[1:] for e in events if e[0] == "wait_stream"],
              "state": b.state()["state"]}
    if result["wrapped"]["forward_deepep"] == "FunctionWrapper":
        single = ref  # the original body: shared experts inline on the main stream
    else:  # the release's own code: its single-stream path is the same call with the switch off
        saved = os.environ.get("SGLANG_NPU_USE_MULTI_STREAM")
        os.environ["SGLANG_NPU_USE_MULTI_STREAM"] = "0"
        try:
            b.simnpu.clear_events()
            single = b.block.forward_deepep(h, b.batch(b.ForwardMode.EXTEND))
            result["single_streams"] = sorted({e[2] for e in b.simnpu.EVENTS if e[0] == "compute"})
        finally:
            os.environ["SGLANG_NPU_USE_MULTI_STREAM"] = saved or "1"
    result["equal_single_stream"] = bool(torch.equal(out, single))
    result["max_abs"] = float((out - single).abs().max())
    return result


# ------------------------------------------------------------------------------------ all

def import_targets():
    """Install the fused decode kernel stand-in, then import every module a patch targets (the first
    one decides every patch, each applies its own).  Must run before the first sglang import.
    Returns {module: "ExcType: message"} for each module that failed to import."""
    import importlib

    from shimdev import dual_stream_kernels
    from shimdev import simnpu
    from npu_shim.core.loading import load_all

    dual_stream_kernels.install(simnpu, kernel="partial")
    failed = {}
    for patch in load_all():
        for module in patch.modules:
            try:
                importlib.import_module(module)
            except BaseException as exc:  # report every failing module, not only the first
                failed.setdefault(module, "%s: %s" % (type(exc).__name__, exc))
    return failed


def run_drivers(names):
    """{feature: driver facts, or {"error", "traceback"}} for each feature in ``names``.  Each
    driver runs under the simulated NPU's stream sanitizer: its reports are ``facts["sanitizer"]``."""
    import traceback

    from shimdev import simnpu

    out = {}
    for name in names:
        if name not in DRIVERS:
            continue
        try:
            with simnpu.sanitize() as san:
                facts = DRIVERS[name]()
            facts["sanitizer"] = [report.as_dict() for report in san.reports]
            out[name] = facts
        except Exception as exc:
            out[name] = {"error": "%s: %s" % (type(exc).__name__, exc),
                         "traceback": traceback.format_exc()[-3000:]}
    return out


def run_all(release):
    """Every feature's facts for the demo (a feature whose patch is not applied is only run where
    the release's own code can be driven the same way)."""
    failed = import_targets()
    broken = {m: e for m, e in failed.items() if not e.startswith("ModuleNotFoundError")}
    if broken:
        raise RuntimeError("target modules failed to import: %s" % broken)
    import sglang
    from npu_shim.runtime import activation

    out = {"release": release, "states": {}, "sglang_file": sglang.__file__, "missing_modules": sorted(failed)}
    for name, st in activation.RUNTIME.states().items():
        out["states"][name] = {"state": st["state"], "reason": st["reason"],
                               "details": st.get("details") or {}}
    # upstream/off: the shim has nothing of its own to show, except where the release's own code
    # can be driven the same way (DRIVE_UPSTREAM)
    names = [name for name, st in out["states"].items()
             if st["state"] == "applied" or (name in DRIVE_UPSTREAM and st["state"] == "upstream")]
    out["facts"] = {name: None for name in out["states"]}
    out["facts"].update(run_drivers(names))
    return out
