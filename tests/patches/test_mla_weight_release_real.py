"""mla_weight_release inside the real sglang releases (their venvs, simulated NPU kernels only).

A synthetic MLA attention layer of GLM-5 / DeepSeek-V3 shape (real CPU tensors, dev/shimdev/
mla_kernels.py) goes through the release's own ``npu_mla_preprocess`` -> ``NPUFusedMLAPreprocess``
-> ``forward_mlaprolog`` / ``mlaprolog_preprocess_weight`` (or the absorb path), with the
disaggregation role published through real ``ServerArgs`` the way the scheduler does.  Freed memory
is measured as ``untyped_storage().nbytes()`` before / after.  One subprocess per release holds all
the role / guard cases (each case resets the patch's per-process state).
"""
import pytest

from shimdev import realsglang

SCENARIOS = r'''
import logging, os
import torch
from shimdev import mla_kernels as K
from npu_shim.runtime import activation
from npu_shim.patches import mla_weight_release as R
from npu_shim.patches._impl import mla_weight_release as RI
from sglang.srt.hardware_backend.npu.attention import mla_preprocess as P
from sglang.srt.hardware_backend.npu.modules import deepseek_v2_attention_mla_npu as N

LOG = []
class Capture(logging.Handler):
    def emit(self, record):
        LOG.append(record.getMessage())
logging.getLogger("npu_shim").addHandler(Capture())

def case(role, model="glm-5", tp=16, args=None, force=False, **build):
    activation.RUNTIME.record("mla_weight_release").process.reset()
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

# sglang's own function, under the wrapper; in a list, as a module-level copy of it would be
# rebound to the wrapper when reset() puts the wrapper back, as the first apply rebinds copies.
SGLANGS = [N.npu_mla_preprocess.__wrapped__]

def is_sglangs(fn):
    return fn is SGLANGS[0]

def called():
    # What a layer calls: the name its caller, sglang's forward_dsa_prepare_npu, looks up.
    return N.forward_dsa_prepare_npu.__globals__["npu_mla_preprocess"]

def passes(layers=3, count=2):
    # ``count`` forward passes over ``layers`` decode layers, each call made through what the
    # caller would look up at that moment.
    activation.RUNTIME.record("mla_weight_release").process.reset()
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
            "touch": touch(lambda: ms[-1].w_kc.sum()), "retired": state["retired"],
            "wrappers": state["wrappers"], "details": state["details"]}

from sglang.srt.managers import tp_worker as TW
out = {"state": activation.RUNTIME.states()["mla_weight_release"]["state"],
       "wrapped": type(N.npu_mla_preprocess).__name__,
       "updates_wrapped": sorted(op for op in R.UPDATE_OPS
                                 if type(TW.BaseTpWorker.__dict__[op]).__name__ == "FunctionWrapper"),
       "method_is_predicate": P.NPUFusedMLAPreprocess.uses_mlaprolog.__code__
                              is RI.make_uses_mlaprolog_method("x").__code__}
out["decode"], m = case("decode")
out["decode_retired"] = is_sglangs(called())
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
activation.RUNTIME.record("mla_weight_release").process.reset()
out["alt_stream"] = K.run_alt_stream_step()

from shimdev import simnpu
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
attr = activation.RUNTIME.record("mla_weight_release").process.w8a8_attr
out["w8a8_attr"] = attr
out["predicate_w8a8"] = predicate(attr)
other = {"quant_config": "quantization_config", "quantization_config": "quant_config"}
out["predicate_other_attr"] = predicate(other[attr])
out["passes"] = passes()
# A layer first seen after the retirement: the weight wrapper still frees its qkv_a; its w_kc,
# which only npu_mla_preprocess's wrapper frees, is kept, and the log says so.
del LOG[:]
unseen = K.build_attention("glm-5", 16, layer_id=9)
for _ in range(2):
    hidden, positions, batch, context = K.make_batch("glm-5")
    with context:
        called()(unseen, hidden, positions, batch, None)
out["unseen"] = {"types": [type(unseen.fused_qkv_a_proj_with_mqa.weight).__name__, type(unseen.w_kc).__name__],
                 "log": list(LOG)}
out["after_reset"] = case("decode", layer_id=7)[0]  # reset() starts over: the wrapper is back
# Retired, then uninstalled: every original back, nothing of the shim left on the classes.
passes(layers=2)
import npu_shim
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
'''

MIB = 1 << 20
R_UPDATE_OPS = ("update_weights_from_disk", "update_weights_from_tensor", "update_weights_from_distributed",
                "update_weights_from_ipc", "init_weights_update_group")


@pytest.fixture(scope="module", params=["0.5.9", "0.5.11", "0.5.19"])
def scenarios(request):
    return request.param, realsglang.run_in_release(request.param, SCENARIOS)


def freed(case):
    return case["freed"]["qkv_a"], case["freed"]["w_kc"]


def test_applied_and_predicate_installed(scenarios):
    version, out = scenarios
    assert out["state"] == "applied", version
    assert out["wrapped"] == "FunctionWrapper"
    assert out["method_is_predicate"] is True
    assert out["updates_wrapped"] == sorted(R_UPDATE_OPS), version


def test_decode_frees_exactly_qkv_a_and_w_kc_and_forward_keeps_working(scenarios):
    version, out = scenarios
    for key in ("decode", "decode_v3_tp8"):
        case = out[key]
        assert case["after"] == {"qkv_a": 0, "w_kc": 0}, (version, key)
        assert case["freed"] == case["expected"], (version, key)
        assert case["uses_mlaprolog"] is True
        assert case["qkv_type"] == "ReleasedParameter" and case["w_kc_type"] == "ReleasedTensor"
        # Both steps ran through mlaprolog on the copies, the second after the release.
        assert case["kernels"] == ["npu_mla_prolog_v3", "npu_mla_prolog_v3"]
        assert case["outputs"][0] == case["outputs"][1]
    glm = out["decode"]
    c_q_a, c_kv_a = [6144, 2048], [6144, 576]  # GLM-5: hidden x q_lora, hidden x (kv_lora + rope)
    assert glm["prolog_weights"] == [{"weight_dq": c_q_a, "weight_dkv_kr": c_kv_a,
                                      "weight_uk": [4, 192, 512]}] * 2
    assert glm["expected"] == {"qkv_a": (2048 + 512 + 64) * 6144 * 2, "w_kc": 4 * 192 * 512 * 2}
    assert glm["details"]["released_mib"] == round(sum(glm["expected"].values()) / MIB, 3)
    assert glm["details"]["layers"] == 1 and glm["details"]["role"] == "decode"
    assert any("31.5 MiB in 1 layers" in line for line in glm["log"]), glm["log"]


WRAPPER = "sglang.srt.hardware_backend.npu.modules.deepseek_v2_attention_mla_npu:npu_mla_preprocess"


def test_npu_mla_preprocess_wrapper_retires_after_one_pass_and_the_release_stays(scenarios):
    """Pass 1 goes through the wrapper; the first layer coming round retires it (that call still
    through it); from then on the layers call sglang's own function, and every weight stays
    released and guarded."""
    version, out = scenarios
    assert out["decode_retired"] is True, version
    passes = out["passes"]
    assert passes["sglangs"] == [False, False, False, False, True, True] and passes["after"] is True
    assert passes["types"] == [["ReleasedParameter", "ReleasedTensor"]], version  # JSON: lists
    assert "w_kc of layer 2" in passes["touch"] and "NPU_SHIM_MLA_WEIGHT_RELEASE=0" in passes["touch"]
    assert passes["retired"] == [WRAPPER] and WRAPPER not in passes["wrappers"]
    assert passes["details"]["retired"] == [WRAPPER] and passes["details"]["layers"] == 3
    assert len(passes["wrappers"]) == 1 + len(R_UPDATE_OPS)  # the weight and update wrappers stay
    unseen = out["unseen"]
    assert unseen["types"] == ["ReleasedParameter", "Tensor"], version
    assert any("layer 9 first ran after the first pass" in line and "w_kc kept" in line
               for line in unseen["log"]), unseen["log"]
    after = out["after_reset"]  # reset() starts over: the wrapper is back, and frees as before
    assert after["freed"] == after["expected"] and after["details"]["layers"] == 1, version


def test_uninstall_after_a_retirement_puts_every_original_back(scenarios):
    version, out = scenarios
    assert out["uninstalled"] == {"called": True, "module": True, "weight": "function",
                                  "updates": ["function"], "uses_mlaprolog": False}, version


def test_released_weight_raises_a_clear_error(scenarios):
    version, out = scenarios
    for key in ("touch_qkv", "touch_w_kc", "touch_shape"):
        message = out[key]
        assert "layer 0" in message and "NPU_SHIM_MLA_WEIGHT_RELEASE=0" in message, (version, message)
    assert "qkv_a_proj.weight of layer 0" in out["touch_qkv"]
    assert "w_kc of layer 0" in out["touch_w_kc"]
    assert out["isinstance_param"] is True


def test_prefill_frees_only_qkv_a_and_null_frees_nothing(scenarios):
    version, out = scenarios
    prefill = out["prefill"]
    assert freed(prefill) == (prefill["expected"]["qkv_a"], 0), version
    assert prefill["w_kc_type"] == "Tensor"
    assert freed(out["null"]) == (0, 0)
    assert out["null"]["kernels"] == ["npu_mla_prolog_v3", "npu_mla_prolog_v3"]


#: What upstream's own npu_mla_preprocess raises on its alt-stream path (0.5.9 - 0.5.23:
#: ``torch.npu.current_stream().wait_event(m.alt_stream)``; torch_npu's Stream.wait_event calls
#: ``event.wait(self)``, and a Stream has no wait()).  The same with the patch on and off.
UPSTREAM_ALT_STREAM_ERROR = ["AttributeError", "'Stream' object has no attribute 'wait'"]


def test_upstream_alt_stream_path_fails_the_same_with_the_patch_on(scenarios):
    """A backport must not make upstream's failure worse: the wrapper lets the same error through,
    frees nothing on that path, and the next call is upstream's again (test_switch_off_touches_nothing
    shows the same error with the patch off)."""
    version, out = scenarios
    assert out["alt_stream"] == {"error": UPSTREAM_ALT_STREAM_ERROR, "freed": 0, "built_preprocess": True}, version


def test_non_mlaprolog_path_frees_nothing(scenarios):
    version, out = scenarios
    case = out["non_mlaprolog"]
    assert freed(case) == (0, 0), version
    assert case["uses_mlaprolog"] is False
    assert "npu_kv_rmsnorm_rope_cache" in case["kernels"] and "npu_mla_prolog_v3" not in case["kernels"]


def _kinds(case):
    return sorted({r["kind"] for r in case["reports"]})


def test_release_and_mlaprolog_path_are_race_free_under_the_stream_sanitizer(scenarios):
    """The release frees weights on the stream that loaded and last read them; the mlaprolog path
    runs on the current stream whether the layer has an alt stream or not."""
    version, out = scenarios
    for key in ("sanitized_decode", "sanitized_decode_alt_stream"):
        case = out[key]
        assert case["reports"] == [], (version, key, case["reports"])
        assert case["freed"] == out["decode"]["freed"] and sum(case["freed"].values()) > 0, (version, key)


def test_the_absorb_paths_alt_stream_has_no_wait_back_to_the_main_stream(scenarios):
    """sglang's own npu_mla_preprocess (0.5.9 - 0.5.23, not a shim change): outside mlaprolog it runs
    the preprocessing on ``m.alt_stream`` and then calls ``current_stream().wait_event(m.alt_stream)``
    with the stream itself.  torch-npu's Stream.wait_event calls ``event.wait(self)``, which a
    Stream lacks: on a device that line raises AttributeError, and so it does here.  Were it to
    make no wait instead of raising, the main stream would never wait: it reads what the alt stream
    wrote (q_pe, q_nope, the caches), and the
    blocks the alt stream read (hidden states, positions, slots) can be handed to the main
    stream's next allocations.  With the wait the line means, nothing is left to report."""
    version, out = scenarios
    assert "wait" in out["sanitized_alt_stream_absorb"]["raised"], (version, out["sanitized_alt_stream_absorb"])
    waiting = out["sanitized_alt_stream_absorb_waiting"]
    assert waiting["reports"] == [], (version, waiting)
    case = out["sanitized_alt_stream_absorb_unwaited"]
    assert _kinds(case) == ["read-after-write", "unsafe-reuse"], (version, case["reports"])
    raw = [r for r in case["reports"] if r["kind"] == "read-after-write"]
    assert {r["streams"][1] for r in raw} == {"main"} and "main" not in {r["streams"][0] for r in raw}, raw
    assert {"npu_kv_rmsnorm_rope_cache", "npu_interleave_rope"} & {r["ops"][0] for r in raw}, raw
    assert case["freed"] == {"qkv_a": 0, "w_kc": 0}


def test_unknown_role_frees_nothing_and_warns_once(scenarios):
    version, out = scenarios
    case = out["unknown"]
    assert freed(case) == (0, 0), version
    warnings = [line for line in case["log"] if "role is unknown" in line]
    assert len(warnings) == 1, case["log"]
    assert case["details"]["role"] is None


def test_weight_update_guard_and_force(scenarios):
    version, out = scenarios
    for key in ("lora", "refit"):
        assert freed(out[key]) == (0, 0), (version, key)
    assert any("LoRA" in line and "NPU_SHIM_MLA_RELEASE_FORCE=1" in line for line in out["lora"]["log"])
    assert any("load_format=dummy" in line for line in out["refit"]["log"])
    forced = out["lora_forced"]
    assert freed(forced) == (forced["expected"]["qkv_a"], forced["expected"]["w_kc"])
    assert any("releasing although" in line for line in forced["log"])


def test_speculative_decoding_keeps_weights_even_forced(scenarios):
    version, out = scenarios
    case = out["spec_forced"]
    assert freed(case) == (0, 0), version
    assert any("speculative decoding" in line for line in case["log"])


def test_w_kc_shared_with_preprocessor_is_kept(scenarios):
    version, out = scenarios
    case = out["shared_w_kc"]
    assert freed(case) == (case["expected"]["qkv_a"], 0), version
    assert any("shares its memory" in line for line in case["log"])
    assert case["kernels"] == ["npu_mla_prolog_v3", "npu_mla_prolog_v3"]


def test_predicate_follows_the_release_w8a8_routing(scenarios):
    version, out = scenarios
    assert out["w8a8_attr"] == ("quant_config" if version == "0.5.9" else "quantization_config")
    assert out["predicate_w8a8"] is False  # forward() takes forward_mlapo first
    assert out["predicate_other_attr"] is True  # the attribute this release does not read


TOUCH = r'''
from shimdev import mla_kernels as K
K.publish_server_args("decode")
r = K.run_layer("glm-5", 16)
assert r["freed"] == r["expected"], r
m = r["layer"]
print("released; touching", flush=True)
{touch}
emit({{"survived": True}})
'''


@pytest.mark.parametrize("version,touch", [
    ("0.5.11", "m.fused_qkv_a_proj_with_mqa(K.torch.zeros(1, 6144, dtype=K.DTYPE))"),
    ("0.5.19", "m.w_kc.sum()"),
])
def test_touching_a_released_weight_exits_with_the_error_not_a_signal(version, touch):
    with pytest.raises(realsglang.ReleaseRunError) as info:
        realsglang.run_in_release(version, TOUCH.format(touch=touch))
    error = info.value
    assert error.returncode == 1, (error.returncode, error.stderr[-2000:])  # < 0 would be a signal
    assert "released; touching" in error.stdout
    last = error.stderr.strip().splitlines()[-1]
    assert last.startswith("npu_shim.patches.mla_weight_release.ReleasedWeightError: npu-shim released")
    assert "layer 0" in last and "NPU_SHIM_MLA_WEIGHT_RELEASE=0" in last


ALIASES = r'''
import torch
from shimdev import mla_kernels as K
K.publish_server_args("decode")
KINDS = {
    "qkv.detach()": lambda m: m.fused_qkv_a_proj_with_mqa.weight.detach(),
    "qkv.view(-1)": lambda m: m.fused_qkv_a_proj_with_mqa.weight.view(-1),
    "qkv.data": lambda m: m.fused_qkv_a_proj_with_mqa.weight.data,
    "qkv.t()": lambda m: m.fused_qkv_a_proj_with_mqa.weight.t(),
    "w_kc.detach()": lambda m: m.w_kc.detach(),
    "w_kc._base": lambda m: m.w_kc._base,
}
out = {}
from npu_shim.runtime import activation
for kind, hold in KINDS.items():
    print("holding", kind, flush=True)  # a signal would show which kind
    # Each kind a fresh layer 0: start over, or it would be a layer first seen after the first
    # pass (the wrapper retired), whose w_kc is kept.
    activation.RUNTIME.record("mla_weight_release").process.reset()
    r = K.run_layer("glm-5", 16, hold=hold)
    weight = "qkv_a" if kind.startswith("qkv") else "w_kc"
    other = "w_kc" if weight == "qkv_a" else "qkv_a"
    with torch._C.DisableTorchFunctionSubclass():
        base = r["layer"].w_kc._base
    out[kind] = {"kept": r["freed"][weight] == 0, "other_freed": r["freed"][other] == r["expected"][other],
                 "sum_is_finite": bool(torch.isfinite(r["held"].float().sum())),
                 "w_kc_base": None if base is None else base.numel()}
emit(out)
'''


def test_aliases_taken_before_the_first_step_keep_their_weight_in_a_release():
    """Each alias read after the decode step used to segfault the process."""
    out = realsglang.run_in_release("0.5.11", ALIASES)
    for kind, result in out.items():
        assert result["kept"] and result["sum_is_finite"], (kind, result)
        assert result["other_freed"], (kind, result)  # the weight nobody else holds still goes
        # a released w_kc has no _base left, even to code that bypasses the guard
        assert (result["w_kc_base"] is None) is kind.startswith("qkv"), (kind, result)


SWITCHED_OFF = r'''
from shimdev import mla_kernels as K
from npu_shim.runtime import activation
from sglang.srt.hardware_backend.npu.attention import mla_preprocess as P
from sglang.srt.hardware_backend.npu.modules import deepseek_v2_attention_mla_npu as N
K.publish_server_args("decode")
r = K.run_layer("glm-5", 16)
from sglang.srt.managers import tp_worker as TW
emit({"state": activation.RUNTIME.states()["mla_weight_release"], "freed": r["freed"],
      "alt_stream": K.run_alt_stream_step(), "wrapped": type(N.npu_mla_preprocess).__name__,
      "update_fn": type(TW.BaseTpWorker.__dict__["update_weights_from_disk"]).__name__,
      "has_method": hasattr(P.NPUFusedMLAPreprocess, "uses_mlaprolog")})
'''


def test_switch_off_touches_nothing():
    out = realsglang.run_in_release("0.5.19", SWITCHED_OFF, env={"NPU_SHIM_MLA_WEIGHT_RELEASE": "0"})
    assert out["state"]["state"] == "disabled"
    assert out["alt_stream"] == {"error": UPSTREAM_ALT_STREAM_ERROR, "freed": 0, "built_preprocess": True}
    assert out["freed"] == {"qkv_a": 0, "w_kc": 0}
    assert out["wrapped"] == "function" and out["has_method"] is False
    assert out["update_fn"] == "function"


UPSTREAM = r'''
from npu_shim.runtime import activation
from sglang.srt.hardware_backend.npu.attention import mla_preprocess as P
from sglang.srt.hardware_backend.npu.modules import deepseek_v2_attention_mla_npu as N
emit({"state": activation.RUNTIME.states()["mla_weight_release"],
      "wrapped": type(N.npu_mla_preprocess).__name__,
      "weight_fn": type(P.NPUFusedMLAPreprocess.__dict__["mlaprolog_preprocess_weight"]).__name__,
      "uses_module": P.NPUFusedMLAPreprocess.uses_mlaprolog.__module__})
'''


def test_upstream_release_stands_down():
    out = realsglang.run_in_release("0.5.23", UPSTREAM)
    assert out["state"]["state"] == "upstream"
    assert out["state"]["targets"] == {}
    assert out["wrapped"] == "function" and out["weight_fn"] == "function"
    assert out["uses_module"] == "sglang.srt.hardware_backend.npu.attention.mla_preprocess"
