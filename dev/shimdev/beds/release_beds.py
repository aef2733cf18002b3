"""Set-ups over a release's real sglang modules, run inside a release process (simulated NPU):
what the demo's drivers (dev/shimdev/beds/demo_features.py) and the real-release tests drive.

* zbal: ``zbal_fresh`` (a fresh process's patch state, device and zbal native side),
  ``event_order`` (simnpu.EVENTS as names), ``make_scheduler`` (the real, wrapped
  ``Scheduler.__init__`` with a stub body that allocates), ``stub_model_runner`` (the release's real
  ``ModelRunner.initialize`` over stubbed heavy steps that take simulated device memory) --
  tests/patches/test_zbal_real.py;
* a scheduler process's start: ``scheduler_process_args``, the real (wrapped)
  ``run_scheduler_process``'s arguments for a spawned child, with ``StopAtBody`` server arguments
  that end the call where the body first reads them -- tests/runtime/test_role_real.py;
* dual_stream_experts: ``glm4_moe_bed`` (a synthetic GLM-4 MoE block and two attention layers over
  the release's real ``glm4_moe`` classes) -- tests/patches/test_dual_stream_experts_real.py,
  dev/shimdev/beds/stream_races.py.

Nothing heavy at module level: the outer test process imports this module too.
"""
from __future__ import annotations

import contextlib
import types

GIB, MIB = 1 << 30, 1 << 20


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
    from npu_shim.patches import zbal as zbal_impl

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
            self.server_args, self.device, self.gpu_id, self.tp_rank = _Args(), "npu", 0, 0
            self.tp_size, self.dp_size, self.moe_ep_rank, self.is_draft_worker = 1, 1, 0, draft
            self.enable_hisparse, self.spec_algorithm = False, _Falsy()
            self.eagle_use_aux_hidden_state, self.max_total_num_tokens = False, 64
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


# ----------------------------------------------------------------------- dual_stream_experts

def glm4_moe_bed(kernel="partial", head_dim=16):
    """A small synthetic GLM-4 MoE block and two attention layers over the release's real
    ``glm4_moe`` classes, with run helpers; returns every name as a namespace.  ``kernel`` is
    "partial", "full_head" or None (see dev/shimdev/beds/dual_stream_kernels.py).  ``head_dim``: 0.5.7
    and 0.5.8 build their NPU rotary embedding only for head sizes 64/128/256/512 (others take a
    vllm kernel)."""
    import torch
    from npu_shim.patches._selftest import _synthetic_moe
    from shimdev import simnpu
    from shimdev.beds import dual_stream_kernels as K
    from shimdev.beds import mla_kernels

    K.install(simnpu, kernel=kernel)

    import sglang.srt.models.glm4_moe as m
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.rotary_embedding import get_rope
    from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: F401 - the bed's, through locals()
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
    H, INTER, E, TOPK = 16, 8, 4, 2  # hidden, shared-expert intermediate, experts, top-k

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
    block.shared_experts = _synthetic_moe.mlp_class()(H, INTER)  # the selftest's shared-expert MLP
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
