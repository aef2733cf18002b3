"""mla_weight_release inside the real sglang releases (their venvs, simulated NPU kernels only).

A synthetic MLA attention layer of GLM-5 / DeepSeek-V3 shape (real CPU tensors, dev/shimdev/
mla_kernels.py) goes through the release's own ``npu_mla_preprocess`` -> ``NPUFusedMLAPreprocess``
-> ``forward_mlaprolog`` / ``mlaprolog_preprocess_weight`` (or the absorb path), with the
disaggregation role published through real ``ServerArgs`` the way the scheduler does.  Freed memory
is measured as ``untyped_storage().nbytes()`` before / after.  One subprocess per release holds all
the role / guard cases (each case resets the patch's per-process state).  The programs they run:
dev/shimdev/programs/mla_release_*.py.
"""
import pytest

from shimdev.envs import realsglang

MIB = 1 << 20
R_UPDATE_OPS = ("update_weights_from_disk", "update_weights_from_tensor", "update_weights_from_distributed",
                "update_weights_from_ipc", "init_weights_update_group")


@pytest.fixture(scope="module", params=["0.5.9", "0.5.11", "0.5.19"])
def scenarios(request):
    return request.param, realsglang.run_program(request.param, "mla_release_scenarios")


def freed(case):
    return case["freed"]["qkv_a"], case["freed"]["w_kc"]


def test_applied_and_predicate_installed(scenarios):
    version, out = scenarios
    assert out["state"] == "applied", version
    assert out["wrapped"] == "function over sglang's"  # a plain function, not a wrapt proxy
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


ENTRY = "sglang.srt.hardware_backend.npu.modules.deepseek_v2_attention_mla_npu:npu_mla_preprocess"


def test_npu_mla_preprocess_wrapper_stays_and_the_release_stays(scenarios):
    """Every call goes through the replacement (it stays for the life of the process: a layer it
    has seen costs one dict lookup, measured by scripts/bench_hot_path.py); every weight stays released
    and guarded; a layer first seen after the first pass has both weights released at its first
    call."""
    version, out = scenarios
    assert out["decode_through_wrapper"] is True, version
    passes = out["passes"]
    assert passes["sglangs"] == [False] * 6 and passes["after"] is False
    assert passes["types"] == [["ReleasedParameter", "ReleasedTensor"]], version  # JSON: lists
    assert "w_kc of layer 2" in passes["touch"] and "NPU_SHIM_MLA_WEIGHT_RELEASE=0" in passes["touch"]
    assert passes["targets"][ENTRY] is True and passes["details"]["layers"] == 3
    # the weight and update wrappers; the entry is replaced by a plain function, not wrapped
    assert ENTRY not in passes["wrappers"] and len(passes["wrappers"]) == 1 + len(R_UPDATE_OPS)
    unseen = out["unseen"]
    assert unseen["types"] == ["ReleasedParameter", "ReleasedTensor"], version  # issue 32: w_kc too
    assert unseen["sglangs"] is False, unseen
    after = out["after_reset"]  # reset() starts over, and frees as before
    assert after["freed"] == after["expected"] and after["details"]["layers"] == 1, version


def test_uninstall_puts_every_original_back(scenarios):
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


@pytest.mark.parametrize("version,touch", [
    ("0.5.11", "fused_qkv_a_proj_with_mqa(x)"),
    ("0.5.19", "w_kc.sum()"),
])
def test_touching_a_released_weight_exits_with_the_error_not_a_signal(version, touch):
    with pytest.raises(realsglang.ReleaseRunError) as info:
        realsglang.run_program(version, "mla_release_touch", touch)
    error = info.value
    assert error.returncode == 1, (error.returncode, error.stderr[-2000:])  # < 0 would be a signal
    assert "released; touching" in error.stdout
    last = error.stderr.strip().splitlines()[-1]
    assert last.startswith("npu_shim.patches.mla_weight_release.ReleasedWeightError: npu-shim released")
    assert "layer 0" in last and "NPU_SHIM_MLA_WEIGHT_RELEASE=0" in last


def test_aliases_taken_before_the_first_step_keep_their_weight_in_a_release():
    """Each alias read after the decode step used to segfault the process."""
    out = realsglang.run_program("0.5.11", "mla_release_aliases")
    for kind, result in out.items():
        assert result["kept"] and result["sum_is_finite"], (kind, result)
        assert result["other_freed"], (kind, result)  # the weight nobody else holds still goes
        # a released w_kc has no _base left, even to code that bypasses the guard
        assert (result["w_kc_base"] is None) is kind.startswith("qkv"), (kind, result)


def test_switch_off_touches_nothing():
    out = realsglang.run_program("0.5.19", "mla_release_switched_off", env={"NPU_SHIM_MLA_WEIGHT_RELEASE": "0"})
    assert out["state"]["state"] == "disabled"
    assert out["alt_stream"] == {"error": UPSTREAM_ALT_STREAM_ERROR, "freed": 0, "built_preprocess": True}
    assert out["freed"] == {"qkv_a": 0, "w_kc": 0}
    assert out["wrapped"] == "function" and out["has_method"] is False
    assert out["update_fn"] == "function"


def test_upstream_release_stands_down():
    out = realsglang.run_program("0.5.23", "mla_release_upstream")
    assert out["state"]["state"] == "upstream"
    assert out["state"]["targets"] == {}
    assert out["wrapped"] == "function" and out["weight_fn"] == "function"
    assert out["uses_module"] == "sglang.srt.hardware_backend.npu.attention.mla_preprocess"
