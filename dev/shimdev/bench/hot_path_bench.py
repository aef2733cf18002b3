"""The hot path's per-call costs, measured side by side (used by scripts/bench_hot_path.py).

Three measurements, each in persistent worker processes timed in alternating rounds
(shimdev.bench.interleave), each arm's figure the median over its rounds -- of the calling thread's CPU
time per call (``time.thread_time_ns``: what other jobs on a shared machine add is the time they
hold the core, which that clock leaves out; one torch thread), with the wall time beside it
(``arm@wall``):

* ``mla_eager`` -- one process of the real sglang 0.5.11 with the shim (every trigger of the demo
  set, the release environment's wrapt 2.5.2): two decode passes over three synthetic GLM-5 MLA
  layers through the real ``npu_mla_preprocess`` (the wrapper releases their weights, and stays);
  then, on a stand-in layer the wrapper has seen whose ``mla_preprocess.forward`` returns at once
  (so sglang's own function body runs and little else), calls through the name sglang's caller
  ``forward_dsa_prepare_npu`` looks up (the wrapper: checked by identity) and calls of sglang's own
  function, alternated within each round: the wrapper's cost per eager call.  A captured NPU graph
  replays its kernels without running Python, so nothing of the wrapper runs there.
* ``mla_function`` -- one process of this Python, no sglang: the shim's ``npu_mla_preprocess``
  function (a plain function since it replaced a wrapt wrapper) on a layer it has seen beside the
  function it replaces: what a host without the release environments measures (a device machine).
* ``dual_stream`` -- three release processes: 0.5.9 with the shim's dual-stream wrapper on its real
  ``Glm4MoeSparseMoeBlock.forward_deepep``, 0.5.10 with its own ``forward_deepep`` and
  ``process_shared_expert`` (the shim stands down there), and, to say where a difference comes
  from, 0.5.9's own with the patch switched off (single stream, no wrapper); the same synthetic block in both
  (``release_beds.glm4_moe_bed``: the real ``Glm4MoeGate``, the selftest's shared-expert MLP,
  stand-in top-k and experts; its weights re-drawn from one seed, the forward hooks of the tests
  removed), the simulated NPU, ``SGLANG_NPU_USE_MULTI_STREAM=1``, one torch thread; per MoE layer call on an extend
  batch (dual stream) and a decode batch (single stream: the wrapper calls through), the outputs'
  digests compared between the two processes, and the function calls (Python and C) one layer call
  makes, counted by a profile hook: a figure the machine's load does not move.

Each measurement returns plain JSON facts; the rows are made by scripts/bench_hot_path.py.
"""
from __future__ import annotations

import statistics
import sys

from shimdev import REPO

from shimdev.bench import interleave
MLA_RELEASE = "0.5.11"
DUAL_STREAM_SHIM, DUAL_STREAM_UPSTREAM = "0.5.9", "0.5.10"

_TIMER = r'''
import time as _time
def per_call_ns(fn, args, calls):
    """(CPU time of this thread, wall time) per call in ns: the thread's CPU time leaves out the
    time other jobs held the core (the arms run here with one torch thread)."""
    cpu, wall = _time.thread_time_ns(), _time.perf_counter_ns()
    for _ in range(calls):
        fn(*args)
    return (_time.thread_time_ns() - cpu) / calls, (_time.perf_counter_ns() - wall) / calls

def timed(arms, args, calls, round_):
    """{arm: CPU ns per call, arm + "@wall": wall ns per call}, the arms in turn, their order
    reversed every other round."""
    names = list(arms) if round_ % 2 == 0 else list(reversed(list(arms)))
    out = {}
    for name in names:
        out[name], out[name + "@wall"] = per_call_ns(arms[name], args, calls)
    return out
'''

_PRELUDE = r'''
import sys
from shimdev import simnpu
simnpu.install(release={release!r})
'''

# ---------------------------------------------------------------------------------------- MLA

_MLA = _TIMER + r'''
import re, types
from npu_shim.runtime import activation, wrapt_loader
from npu_shim.patches import mla_weight_release as RI
from shimdev.beds import mla_kernels as K
from sglang.srt.hardware_backend.npu.modules import deepseek_v2_attention_mla_npu as N

def called():
    # What a layer calls: the name its caller, sglang's forward_dsa_prepare_npu, looks up.
    return N.forward_dsa_prepare_npu.__globals__["npu_mla_preprocess"]

K.publish_server_args("decode")
K.install()
WRAPPER = N.npu_mla_preprocess
sglangs = WRAPPER.__wrapped__
layers = [K.build_attention("glm-5", 16, layer_id=i) for i in range(3)]
through = []
for _ in range(2):
    for m in layers:
        through.append(called() is WRAPPER)
        hidden, positions, batch, context = K.make_batch("glm-5")
        with context:
            called()(m, hidden, positions, batch, None)
state = activation.RUNTIME.states()["mla_weight_release"]
origin = wrapt_loader.loaded_origin()

class Preprocess:
    def forward(self, positions, hidden_states, forward_batch, zero_allocator):
        return None, None, None, None, None, forward_batch, positions, None

class Layer:  # what sglang's npu_mla_preprocess reads of a layer that has its preprocess
    pass

stand_in = Layer()
stand_in.mla_preprocess = Preprocess()
stand_in.quant_config = types.SimpleNamespace(ignore=["model.layers.0.self_attn.kv_b_proj"])
stand_in.__dict__[RI._DONE] = True  # a layer the wrapper has seen
ARGS = (stand_in, object(), object(), object(), object())
SETUP_INFO = {
    "state": state["state"], "layers": len(layers), "through_wrapper": through,
    "released_layers": state["details"].get("layers"),
    "caller_is_wrapper": called() is WRAPPER and WRAPPER is not sglangs,
    "wrapper_type": type(WRAPPER).__name__, "wrapt": origin.describe() if origin else None,
    "c_extension": "npu_shim._wrapt._wrappers" in sys.modules
                   or type(WRAPPER).__module__ in ("wrapt._wrappers", "_wrappers"),
}

def serve(request):
    arms = {"caller": called(), "sglang": sglangs}
    return timed(arms, ARGS, request["calls"], request["round"])
'''


def mla_eager(rounds=9, calls=100000):
    """{"info": set-up facts, "ns": {arm: [per round]}} in one real 0.5.11 process."""
    from shimdev.envs import realsglang
    from shimdev.beds.demo_features import DEMO_ENV

    argv, env = realsglang.release_command(MLA_RELEASE, DEMO_ENV, zbal=True)
    code = _PRELUDE.format(release=MLA_RELEASE) + _MLA
    with interleave.Worker("sglang %s" % MLA_RELEASE, argv, env, code) as worker:
        answers = interleave.alternate([worker], rounds, {"calls": calls})[worker.name]
        return {"info": worker.info, "ns": _by_arm(answers)}


# ------------------------------------------------------------------------------ the MLA function

_MLA_FUNCTION = _TIMER + r'''
import sys
sys.path[:0] = [REPO_DIR]
from npu_shim.patches import mla_weight_release as RI

def npu_mla_preprocess(m, hidden_states, positions, forward_batch, zero_allocator):
    return hidden_states

class Layer:
    pass
m = Layer()
m.__dict__[RI._DONE] = True  # a layer the shim's function has seen: its delegating path
ARGS = (m, object(), object(), object(), object())
ARMS = {"unwrapped": npu_mla_preprocess,
        "plain": RI.MlaWeightReleaseState().npu_mla_preprocess_for(npu_mla_preprocess)}
SETUP_INFO = {"python": sys.version.split()[0]}

def serve(request):
    names = list(ARMS) if request["round"] % 2 == 0 else list(reversed(list(ARMS)))
    out = {}
    for name in names:
        out[name], out[name + "@wall"] = per_call_ns(ARMS[name], ARGS, request["calls"])
    return out
'''


def mla_function(rounds=9, calls=100000, python=None):
    """The shim's ``npu_mla_preprocess`` function on a layer it has seen beside the function it
    replaces, in one process of this Python (no sglang, no wrapt: the function is plain);
    {"info", "ns": {arm: [...]}}."""
    (worker,) = interleave.start_all([("mla", [python or sys.executable], None,
                                       "REPO_DIR = %r\n" % str(REPO) + _MLA_FUNCTION)])
    try:
        answers = interleave.alternate([worker], rounds, {"calls": calls})[worker.name]
        return {"info": worker.info, "ns": _by_arm(answers)}
    finally:
        worker.close()


# ------------------------------------------------------------------------------- dual stream

_DUAL = _TIMER + r'''
import hashlib
import torch
# One intra-op thread in both arms: with two, on 2 cores other jobs share, a call of this small
# block took ~10x longer (1.3 ms -> 14 ms in 0.5.10, measured 2026-12-02), most of it waiting.
torch.set_num_threads(1)
from shimdev.beds.release_beds import glm4_moe_bed
from sglang.srt.model_executor.forward_batch_info import ForwardMode
bed = glm4_moe_bed("partial")
block = bed.block
for module in block.modules():  # the tests' event hooks: not part of a layer's call
    module._forward_pre_hooks.clear()
torch.manual_seed(1)
with torch.no_grad():
    for name, param in sorted(block.named_parameters()):
        param.copy_(torch.randn_like(param) * 0.2)

torch.manual_seed(2)
hidden = torch.randn(TOKENS, bed.H)
BATCHES = {"extend": bed.batch(ForwardMode.EXTEND), "decode": bed.batch(ForwardMode.DECODE)}

def digest(tensor):
    return hashlib.sha256(tensor.detach().contiguous().numpy().tobytes()).hexdigest()[:16]

def waits(mode):
    from shimdev import simnpu
    simnpu.clear_events()
    with torch.no_grad():
        out = block.forward_deepep(hidden, BATCHES[mode])
    return digest(out), sum(1 for e in simnpu.EVENTS if e[0] == "wait_stream")

def calls_per_call(mode, n=20):
    """Python and C function calls per layer call (a profile hook counting them): what the load on
    the machine does not move."""
    count = [0]
    def hook(frame, event, arg):
        if event in ("call", "c_call"):
            count[0] += 1
    batch = BATCHES[mode]
    with torch.no_grad():
        sys.setprofile(hook)
        try:
            for _ in range(n):
                block.forward_deepep(hidden, batch)
        finally:
            sys.setprofile(None)
    return count[0] / n

facts = {mode: waits(mode) for mode in BATCHES}
CALLS = {mode: calls_per_call(mode) for mode in BATCHES}
SETUP_INFO = {"wrapped": bed.wrapped_names(), "state": bed.state()["state"],
               "digests": {mode: f[0] for mode, f in facts.items()},
               "waits": {mode: f[1] for mode, f in facts.items()}, "calls": CALLS,
               "params": sorted(name for name, _ in block.named_parameters()),
               "tokens": TOKENS, "hidden": bed.H}

def call(mode):
    batch = BATCHES[mode]
    def one():
        block.forward_deepep(hidden, batch)  # looked up on each call, as a layer calls it
    return one

ARMS = {mode: call(mode) for mode in BATCHES}
from npu_shim.source.reading import unwrap
OWN = unwrap(type(block).__dict__["forward_deepep"])
if OWN is not type(block).__dict__["forward_deepep"]:
    # Where the method is wrapped: the release's own function under it, called as the layer would
    # without the shim, in the same process (decode: the same work, minus the wrapper).
    for mode in BATCHES:
        ARMS[mode + "_own"] = (lambda batch: lambda: OWN(block, hidden, batch))(BATCHES[mode])

def serve(request):
    from shimdev import simnpu
    with torch.no_grad():
        result = timed(ARMS, (), request["calls"], request["round"])
    simnpu.clear_events()  # the simulated NPU logs every stream operation
    return result
'''


def dual_stream(rounds=9, calls=2000, tokens=16):
    """{"shim" | "upstream" | "off": {"info", "ns": {"extend"|"decode"[@wall]: [...]}}}: 0.5.9 with
    the shim's wrapper, 0.5.10's own, and 0.5.9's own with the patch switched off
    (``NPU_SHIM_DUAL_STREAM_EXPERTS=0``: single stream, no wrapper -- what the other two differ
    from), the three processes asked in alternating rounds."""
    from shimdev.envs import realsglang

    env = {"SGLANG_NPU_USE_MULTI_STREAM": "1"}
    specs = []
    for arm, release, off in (("shim", DUAL_STREAM_SHIM, None), ("upstream", DUAL_STREAM_UPSTREAM, None),
                              ("off", DUAL_STREAM_SHIM, "0")):
        argv, run_env = realsglang.release_command(release, dict(env, NPU_SHIM_DUAL_STREAM_EXPERTS=off))
        specs.append((arm, argv, run_env, _PRELUDE.format(release=release) + "TOKENS = %d\n" % tokens + _DUAL))
    workers = interleave.start_all(specs)
    try:
        for worker in workers:
            worker.ask({"calls": max(1, calls // 10), "round": 0})  # warm-up, not counted
        answers = interleave.alternate(workers, rounds, {"calls": calls})
        return {w.name: {"info": w.info, "ns": _by_arm(answers[w.name])} for w in workers}
    finally:
        for worker in workers:
            worker.close()


# ---------------------------------------------------------------------------------- figures

def _by_arm(answers):
    """[{arm: ns}, ...] per round -> {arm: [ns per round]}."""
    return {arm: [a[arm] for a in answers] for arm in answers[0]}


def median(values):
    return statistics.median(values)


def round_ratios(numerators, denominators):
    """Each round's ratio, sorted, and (low, high) of the middle half of them."""
    ratios = sorted(n / d for n, d in zip(numerators, denominators))
    quarter = len(ratios) // 4
    middle = ratios[quarter:len(ratios) - quarter] or ratios
    return ratios, (middle[0], middle[-1])
