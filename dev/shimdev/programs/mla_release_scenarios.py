"""mla_weight_release's role and guard cases in one release process
(tests/patches/test_mla_weight_release_real.py, 0.5.9, 0.5.11, 0.5.19)."""
import logging
import os

import npu_shim
import torch
from shimdev.beds import mla_kernels as K
from shimdev import simnpu
from shimdev.programs import emit
from npu_shim.runtime import activation
from npu_shim.patches import mla_weight_release as R
from sglang.srt.hardware_backend.npu.attention import mla_preprocess as P
from sglang.srt.hardware_backend.npu.modules import deepseek_v2_attention_mla_npu as N

LOG = []
class Capture(logging.Handler):
    def emit(self, record):
        LOG.append(record.getMessage())
logging.getLogger("npu_shim").addHandler(Capture())

def case(role, model="glm-5", tp=16, args=None, force=False, **build):
    activation.RUNTIME.record("mla_weight_release").process_state.reset()
    del LOG[:]
    K.publish_server_args(role, **(args or {}))
    if force:
        os.environ["NPU_SHIM_MLA_RELEASE_FORCE"] = "1"
    try:
        r = K.run_layer(model, tp, **build)
    finally:
        os.environ.pop("NPU_SHIM_MLA_RELEASE_FORCE", None)
    m = r.pop("layer")
    r["log"] = list(LOG)
    r["details"] = dict(activation.RUNTIME.record("mla_weight_release").details)
    return r, m

def touch(fn):
    try:
        fn()
    except R.ReleasedWeightError as exc:
        return str(exc)
    return "no error"

# sglang's own function, under the wrapper.
SGLANGS = [N.npu_mla_preprocess.__wrapped__]

def is_sglangs(fn):
    return fn is SGLANGS[0]

def called():
    # What a layer calls: the name its caller, sglang's forward_dsa_prepare_npu, looks up.
    return N.forward_dsa_prepare_npu.__globals__["npu_mla_preprocess"]

def passes(layers=3, count=2):
    # ``count`` forward passes over ``layers`` decode layers, each call made through what the
    # caller would look up at that moment.
    activation.RUNTIME.record("mla_weight_release").process_state.reset()
    K.publish_server_args("decode")
    K.install()
    ms = [K.build_attention("glm-5", 16, layer_id=i) for i in range(layers)]
    sglangs = []
    for _ in range(count):
        for m in ms:
            fn = called()
            sglangs.append(is_sglangs(fn))
            hidden, positions, batch, context = K.make_batch("glm-5")
            with context:
                fn(m, hidden, positions, batch, None)
    state = activation.RUNTIME.states()["mla_weight_release"]
    return {"sglangs": sglangs, "after": is_sglangs(called()),
            "types": sorted({(type(m.fused_qkv_a_proj_with_mqa.weight).__name__, type(m.w_kc).__name__)
                             for m in ms}),
            "touch": touch(lambda: ms[-1].w_kc.sum()),
            "wrappers": state["wrappers"], "targets": state["targets"], "details": state["details"]}

from sglang.srt.managers import tp_worker as TW  # noqa: E402 - imported where the update ops are checked
out = {"state": activation.RUNTIME.states()["mla_weight_release"]["state"],
       "wrapped": type(N.npu_mla_preprocess).__name__
                  + (" over sglang's" if hasattr(N.npu_mla_preprocess, "__wrapped__") else ""),
       "updates_wrapped": sorted(op for op in R.UPDATE_OPS
                                 if type(TW.BaseTpWorker.__dict__[op]).__name__ == "FunctionWrapper"),
       "method_is_predicate": P.NPUFusedMLAPreprocess.uses_mlaprolog.__code__
                              is R.make_uses_mlaprolog_method("x").__code__}
out["decode"], m = case("decode")
out["decode_through_wrapper"] = called() is N.npu_mla_preprocess and not is_sglangs(called())
c = K.CONFIGS["glm-5"]
out["touch_qkv"] = touch(lambda: m.fused_qkv_a_proj_with_mqa(torch.zeros(1, c["hidden"], dtype=K.DTYPE)))
out["touch_w_kc"] = touch(lambda: m.w_kc.sum())
out["touch_shape"] = touch(lambda: m.w_kc.shape)
out["isinstance_param"] = isinstance(m.fused_qkv_a_proj_with_mqa.weight, torch.nn.Parameter)
out["decode_v3_tp8"] = case("decode", "deepseek-v3", 8)[0]
out["prefill"] = case("prefill")[0]
out["null"] = case("null")[0]
out["non_mlaprolog"] = case("decode", mlaprolog=False)[0]
out["unknown"] = case(None)[0]
out["lora"] = case("decode", args={"enable_lora": True})[0]
out["lora_forced"] = case("decode", args={"enable_lora": True}, force=True)[0]
out["refit"] = case("decode", args={"load_format": "dummy"})[0]
out["spec_forced"] = case("decode", args={"speculative_algorithm": "EAGLE"}, force=True)[0]
out["shared_w_kc"] = case("decode", w_kc_contiguous=True)[0]
activation.RUNTIME.record("mla_weight_release").process_state.reset()
out["alt_stream"] = K.run_alt_stream_step()

def sanitized(role, **build):
    # The same case under the stream sanitizer, the layer's output read by the current stream as
    # the attention after it does.
    try:
        with simnpu.sanitize() as san:
            r = case(role, consume=True, **build)[0]
    except AttributeError as exc:  # a simulated NPU that refuses Stream.wait_event(stream) as torch-npu does
        return {"raised": "AttributeError: %s" % exc}
    return {"freed": r["freed"], "kernels": r["kernels"], "reports": [x.as_dict() for x in san.reports]}
out["sanitized_decode"] = sanitized("decode")
out["sanitized_decode_alt_stream"] = sanitized("decode", alt_stream=True)
out["sanitized_alt_stream_absorb"] = sanitized("decode", mlaprolog=False, alt_stream=True)
real_wait_event = torch.npu.Stream.wait_event
def with_stream_wait(given_a_stream):
    # The absorb path again, with Stream.wait_event(a_stream) doing ``given_a_stream(stream, event)``.
    def wait_event(stream, event):
        if isinstance(event, torch.npu.Stream):
            return given_a_stream(stream, event)
        return real_wait_event(stream, event)
    torch.npu.Stream.wait_event = wait_event
    try:
        return sanitized("decode", mlaprolog=False, alt_stream=True)
    finally:
        torch.npu.Stream.wait_event = real_wait_event
# The wait the line means (the main stream waits for the alt stream) ...
out["sanitized_alt_stream_absorb_waiting"] = with_stream_wait(lambda stream, event: stream.wait_stream(event))
# ... and no wait at all, where the line did not raise (a stack as loose as the old simulation).
out["sanitized_alt_stream_absorb_unwaited"] = with_stream_wait(lambda stream, event: None)

def predicate(attr):
    m = K.build_attention("glm-5", 16, w8a8_attr=attr)
    pre = P.NPUFusedMLAPreprocess(m.fused_qkv_a_proj_with_mqa, m.q_a_layernorm, m.kv_a_layernorm,
                                  m.q_b_proj, m.w_kc, m.rotary_emb, m.layer_id, m.num_local_heads,
                                  m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim,
                                  m.quant_config)
    return pre.uses_mlaprolog()
attr = activation.RUNTIME.record("mla_weight_release").process_state.w8a8_attr
out["w8a8_attr"] = attr
out["predicate_w8a8"] = predicate(attr)
other = {"quant_config": "quantization_config", "quantization_config": "quant_config"}
out["predicate_other_attr"] = predicate(other[attr])
out["passes"] = passes()
# A layer first seen after the first pass: the wrappers, still in place, free its qkv_a and its
# w_kc at its first call.
del LOG[:]
unseen = K.build_attention("glm-5", 16, layer_id=9)
for _ in range(2):
    hidden, positions, batch, context = K.make_batch("glm-5")
    with context:
        called()(unseen, hidden, positions, batch, None)
out["unseen"] = {"types": [type(unseen.fused_qkv_a_proj_with_mqa.weight).__name__, type(unseen.w_kc).__name__],
                 "log": list(LOG), "sglangs": is_sglangs(called())}
out["after_reset"] = case("decode", layer_id=7)[0]  # reset() starts over: frees as before
# After a pass, uninstalled: every original back, nothing of the shim left on the classes.
passes(layers=2)
npu_shim.uninstall()
out["uninstalled"] = {
    "called": is_sglangs(called()), "module": is_sglangs(N.npu_mla_preprocess),
    "weight": type(P.NPUFusedMLAPreprocess.__dict__["mlaprolog_preprocess_weight"]).__name__,
    "updates": sorted({type(TW.BaseTpWorker.__dict__[op]).__name__ for op in R.UPDATE_OPS}),
    "uses_mlaprolog": "uses_mlaprolog" in P.NPUFusedMLAPreprocess.__dict__}
for value in out.values():
    if isinstance(value, dict):
        value.pop("before", None)
emit(out)
