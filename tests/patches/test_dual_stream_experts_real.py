"""dual_stream_experts inside the real sglang releases (their venvs, simulated NPU).

0.5.9 (the newest release the patch backports to; 0.5.7/0.5.8 have byte-identical target bodies,
checked by fingerprint in the unit tests): the real ``Glm4MoeSparseMoeBlock.forward_deepep`` and
``Glm4MoeAttention.forward_prepare`` are patched on import; a small synthetic block is run with
the real methods (real ``Glm4MoeGate``, ``RMSNorm``, ``get_rope`` rotary embedding; pure-torch
stand-ins for what needs a device or a distributed setup: qkv projection, topk, experts, shared
experts).  The stream order is read from ``simnpu.EVENTS``; numerics are compared with the
original (unwrapped) methods on the same objects.  0.5.11 reports ``upstream``.

One subprocess per environment (a real import costs ~8 s).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

from realsglang import run_in_release  # noqa: E402

RELEASE = "0.5.9"
SIDE = "side-1"

# Builds the synthetic MoE block and two attention layers; defines run helpers.  {kernel} is
# "partial", "full_head" or None (see tests/support/dual_stream_kernels.py).
BED = r'''
import types
import torch
import torch.nn.functional as F
import simnpu
import dual_stream_kernels as K

K.install(simnpu, kernel={kernel!r})

import sglang.srt.models.glm4_moe as m
import sglang.srt.server_args as server_args
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from torch.overrides import TorchFunctionMode
from npu_shim import runtime
from npu_shim.codeview import unwrap

# What the real constructors would read from a launched server.
server_args._global_server_args = types.SimpleNamespace(rl_on_policy_target=None)
# ExpertLocationDispatchInfo.init_new needs EPLB metadata of a launched server; both the original
# and the patched body read it from the module globals, so both see this stand-in.
m.ExpertLocationDispatchInfo = types.SimpleNamespace(init_new=lambda layer_id: None)

torch.manual_seed(0)
H, I, E, TOPK = 16, 8, 4, 2

def where():
    return simnpu.current_stream_name()

def logged(name):
    def hook(module, args):
        simnpu.log("compute", name, where())
    return hook

class SharedMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up = torch.nn.Linear(H, 2 * I, bias=False)
        self.down = torch.nn.Linear(I, H, bias=False)
    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)

class TopKRef:
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
block.shared_experts = SharedMLP()
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
        return func(*args, **(kwargs or {{}}))

def batch(mode):
    return types.SimpleNamespace(forward_mode=mode, num_token_non_padded=None,
                                 token_to_kv_pool=types.SimpleNamespace(start_layer=0))

ORDER_KINDS = ("stream_create", "wait_stream", "stream_enter", "stream_exit", "compute", "op")

def moe(hidden, mode):
    """(patched output, original output, ordered events of the patched call)."""
    simnpu.clear_events()
    with InPlaceLog():
        out = block.forward_deepep(hidden, batch(mode))
    events = [list(e) for e in simnpu.EVENTS if e[0] in ORDER_KINDS]
    ref = unwrap(m.Glm4MoeSparseMoeBlock.forward_deepep)(block, hidden, batch(mode))
    return out, ref, events

HD, NH, NKV = 16, 4, 2
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
    return runtime.states()["dual_stream_experts"]

def wrapped_names():
    return {{
        "forward_deepep": type(m.Glm4MoeSparseMoeBlock.__dict__["forward_deepep"]).__name__,
        "forward_prepare": type(m.Glm4MoeAttention.__dict__["forward_prepare"]).__name__,
    }}
'''

STREAMS_AND_FUSED = r'''
result = {"wrapped": wrapped_names()}
h = torch.randn(5, H)
runs = {}
for name in ("EXTEND", "TARGET_VERIFY", "MIXED", "DECODE"):
    out, ref, events = moe(h, getattr(ForwardMode, name))
    runs[name] = {"equal": bool(torch.equal(out, ref)), "events": events}
out, ref, events = moe(torch.empty(0, H), ForwardMode.EXTEND)
runs["EMPTY_EXTEND"] = {"equal": bool(torch.equal(out, ref)), "events": events}
result["moe"] = runs

steps = []
for step, positions in enumerate((torch.tensor([3, 9, 17]), torch.tensor([4, 10, 18]))):
    hidden = torch.randn(3, H)
    diffs = [max_diff(*prepare(layer, positions, hidden, ForwardMode.DECODE)) for layer in layers]
    steps.append({"diffs": diffs, "cos_sin_calls": len(cos_sin_calls)})
result["decode_steps"] = steps
fused_before = state()["details"]["counts"]["fused_calls"]
got, ref = prepare(layers[0], torch.tensor([1, 2, 3, 4]), torch.randn(4, H), ForwardMode.EXTEND)
result["extend_equal"] = all(bool(torch.equal(g, r)) for g, r in zip(got, ref))
result["extend_fused_calls"] = state()["details"]["counts"]["fused_calls"] - fused_before
result["state"] = state()
emit(result)
'''


def _run(code, kernel, env):
    return run_in_release(RELEASE, BED.format(kernel=kernel) + code, env=env)


def _order(events):
    return [tuple(e) for e in events]


def test_real_0_5_9_dual_stream_order_numerics_and_fused_decode():
    res = _run(STREAMS_AND_FUSED, "partial", {"SGLANG_NPU_USE_MULTI_STREAM": "1"})
    st = res["state"]
    assert st["state"] == "applied", st
    assert "dual-stream experts on" in st["reason"] and "decode path on" in st["reason"], st
    assert res["wrapped"] == {"forward_deepep": "FunctionWrapper", "forward_prepare": "FunctionWrapper"}

    moe = res["moe"]
    # Extend: the side stream waits for main, shared experts run on it, gate -> topk -> routed
    # experts on main, main waits for the side stream, then the combine (add_) on main.
    assert _order(moe["EXTEND"]["events"]) == [
        ("stream_create", SIDE),
        ("wait_stream", SIDE, "main"),
        ("stream_enter", SIDE),
        ("compute", "shared", SIDE),
        ("stream_exit", SIDE),
        ("compute", "gate", "main"),
        ("compute", "topk", "main"),
        ("compute", "experts", "main"),
        ("wait_stream", "main", SIDE),
        ("op", "add_", "main"),
    ]
    # Target-verify and mixed (an extend) overlap too, reusing the one side stream.
    for mode in ("TARGET_VERIFY", "MIXED"):
        assert _order(moe[mode]["events"]) == _order(moe["EXTEND"]["events"])[1:], mode
    # Decode stays single-stream; so does an empty batch (upstream's own path).
    assert _order(moe["DECODE"]["events"]) == [
        ("compute", "gate", "main"), ("compute", "shared", "main"), ("compute", "topk", "main"),
        ("compute", "experts", "main"), ("op", "add_", "main")]
    assert _order(moe["EMPTY_EXTEND"]["events"]) == [
        ("compute", "empty_topk", "main"), ("compute", "experts", "main"), ("op", "mul_", "main")]
    # Every path gives the single-stream result bit for bit.
    assert all(run["equal"] for run in moe.values()), {k: v["equal"] for k, v in moe.items()}
    assert st["details"]["counts"]["dual_stream_calls"] == 3
    assert st["details"]["side_stream"] == "<simnpu Stream side-1>"

    # Fused decode: matches split -> RMSNorm -> rope of the original (float32), on both layers,
    # with cos/sin computed once per step (at the first layer).
    steps = res["decode_steps"]
    for step in steps:
        assert max(step["diffs"]) < 1e-5, steps
    assert [s["cos_sin_calls"] for s in steps] == [1, 2], steps
    assert st["details"]["counts"]["fused_calls"] == 4
    assert "fused_fallback" not in st["details"], st["details"]
    # Extend keeps the original path (bitwise the original's output, no fused call).
    assert res["extend_equal"] is True and res["extend_fused_calls"] == 0


STREAMS_OFF = r'''
h = torch.randn(5, H)
out, ref, events = moe(h, ForwardMode.EXTEND)
got, fref = prepare(layers[0], torch.tensor([3, 9, 17]), torch.randn(3, H), ForwardMode.DECODE)
emit({"wrapped": wrapped_names(), "state": state(), "equal": bool(torch.equal(out, ref)),
      "events": events, "fused_diff": max_diff(got, fref)})
'''


def test_real_0_5_9_streams_off_keeps_original_experts_fused_still_on():
    res = _run(STREAMS_OFF, "partial", {"SGLANG_NPU_USE_MULTI_STREAM": "0"})
    st = res["state"]
    assert st["state"] == "applied", st
    assert "dual-stream experts off (SGLANG_NPU_USE_MULTI_STREAM is not on)" in st["reason"], st
    # forward_deepep is not touched at all; forward_prepare is (upstream gates it on NPU only).
    assert res["wrapped"] == {"forward_deepep": "function", "forward_prepare": "FunctionWrapper"}
    assert not [e for e in res["events"] if e[0] in ("wait_stream", "stream_enter", "stream_create")]
    assert res["equal"] is True
    assert res["fused_diff"] < 1e-5
    assert st["details"]["counts"]["fused_calls"] == 1


NOTHING_APPLIES = r'''
emit({"wrapped": wrapped_names(), "state": state()})
'''


def test_real_0_5_9_kernel_missing_and_streams_off_is_unsupported_with_reason():
    res = _run(NOTHING_APPLIES, None, {"SGLANG_NPU_USE_MULTI_STREAM": None})
    st = res["state"]
    assert st["state"] == "unsupported", st
    assert "fused qkv-rmsnorm-rope decode path unsupported: sgl_kernel_npu has no " \
           "norm.split_qkv_rmsnorm_rope" in st["reason"], st
    assert res["wrapped"] == {"forward_deepep": "function", "forward_prepare": "function"}


OLD_KERNEL = r'''
h = torch.randn(5, H)
out, ref, events = moe(h, ForwardMode.EXTEND)
got, fref = prepare(layers[0], torch.tensor([3, 9, 17]), torch.randn(3, H), ForwardMode.DECODE)
emit({"wrapped": wrapped_names(), "state": state(), "equal": bool(torch.equal(out, ref)),
      "fused_equal": all(bool(torch.equal(g, r)) for g, r in zip(got, fref)),
      "waits": [e for e in events if e[0] == "wait_stream"]})
'''


def test_real_0_5_9_old_kernel_is_refused_per_layer_and_streams_still_apply():
    # A kernel without partial rotary would rotate whole heads (wrong for GLM-4.x): the layer keeps
    # its original path, the reason is in the details; the streams are unaffected.
    res = _run(OLD_KERNEL, "full_head", {"SGLANG_NPU_USE_MULTI_STREAM": "1"})
    st = res["state"]
    assert st["state"] == "applied", st
    assert res["wrapped"] == {"forward_deepep": "FunctionWrapper", "forward_prepare": "FunctionWrapper"}
    assert res["equal"] is True and res["fused_equal"] is True
    assert res["waits"] == [["wait_stream", SIDE, "main"], ["wait_stream", "main", SIDE]]
    assert "rope rotates 8 of 16 head dims" in st["details"]["fused_fallback"], st["details"]
    assert st["details"]["counts"]["fused_calls"] == 0


def test_real_0_5_9_switch_off_leaves_glm4_moe_untouched():
    res = _run(NOTHING_APPLIES, "partial",
               {"SGLANG_NPU_USE_MULTI_STREAM": "1", "NPU_SHIM_DUAL_STREAM": "0"})
    assert res["state"]["state"] == "disabled"
    assert res["wrapped"] == {"forward_deepep": "function", "forward_prepare": "function"}


def test_real_0_5_11_stands_down_upstream():
    code = r'''
import sglang.srt.models.glm4_moe as m
from npu_shim import runtime
emit({"state": runtime.states()["dual_stream_experts"],
      "deepep": type(m.Glm4MoeSparseMoeBlock.__dict__["forward_deepep"]).__name__,
      "prepare": type(m.Glm4MoeAttention.__dict__["forward_prepare"]).__name__})
'''
    res = run_in_release("0.5.11", code, env={"SGLANG_NPU_USE_MULTI_STREAM": "1"})
    assert res["state"]["state"] == "upstream", res
    assert "process_shared_expert" in res["state"]["reason"]
    assert res["deepep"] == "function" and res["prepare"] == "function"
