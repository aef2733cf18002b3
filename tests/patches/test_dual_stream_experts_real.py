"""dual_stream_experts inside the real sglang releases (their venvs, simulated NPU).

0.5.9 (the newest release the patch backports to; 0.5.7/0.5.8 have byte-identical target bodies,
checked by fingerprint in the unit tests): the real ``Glm4MoeSparseMoeBlock.forward_deepep`` and
``Glm4MoeAttention.forward_prepare`` are patched on import; a small synthetic block is run with
the real methods (real ``Glm4MoeGate``, ``RMSNorm``, ``get_rope`` rotary embedding; pure-torch
stand-ins for what needs a device or a distributed setup: qkv projection, topk, experts, shared
experts).  The stream order is read from ``simnpu.EVENTS``; numerics are compared with the
original (unwrapped) methods on the same objects.  The stream sanitizer of the simulated NPU is
on in every dual-stream call, and dev/shimdev/beds/stream_races.py drives the races this kind of code
has had (two layers, in-place routed experts, a draft model on a stream of its own).  0.5.11
reports ``upstream``.

One subprocess per environment (a real import is slow); the programs they run:
dev/shimdev/programs/glm4_moe.py and glm4_moe_upstream.py.
"""
import pytest

from shimdev.envs.realsglang import run_program

RELEASE = "0.5.9"
SIDE = "side-1"


def _run(scenario, kernel, env):
    """``scenario`` of dev/shimdev/programs/glm4_moe.py on the synthetic MoE block and two attention
    layers of release_beds.glm4_moe_bed; ``kernel`` is "partial", "full_head" or None (see
    dev/shimdev/beds/dual_stream_kernels.py)."""
    return run_program(RELEASE, "glm4_moe", kernel, scenario, env=env)


def _order(events):
    return [tuple(e) for e in events]


@pytest.fixture(scope="module")
def streams_and_fused():
    """One release process for the stream order, numerics, fused decode and races."""
    return _run("streams_and_fused", "partial", {"SGLANG_NPU_USE_MULTI_STREAM": "1"})


def test_real_0_5_9_dual_stream_order_numerics_and_fused_decode(streams_and_fused):
    res = streams_and_fused
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
    assert st["details"]["counts"]["dual_stream_python_calls"] == 3
    # of which one target-verify batch, counted apart (a speculative server's record shows it)
    assert st["details"]["counts"]["dual_stream_verify_python_calls"] == 1
    assert st["details"]["side_streams"] == {"<simnpu Stream main>": "<simnpu Stream side-1>"}
    # The stream sanitizer was on in every call above and found nothing.
    assert res["sanitizer"] == [], res["sanitizer"]

    # Fused decode: matches split -> RMSNorm -> rope of the original (float32), on both layers,
    # with cos/sin computed once per step (at the first layer).
    steps = res["decode_steps"]
    for step in steps:
        assert max(step["diffs"]) < 1e-5, steps
    assert [s["cos_sin_calls"] for s in steps] == [1, 2], steps
    assert st["details"]["counts"]["fused_python_calls"] == 4
    assert "fused_fallback" not in st["details"], st["details"]
    # Extend keeps the original path (bitwise the original's output, no fused call).
    assert res["extend_equal"] is True and res["extend_fused_calls"] == 0


def test_real_0_5_9_dual_stream_is_race_free_under_the_stream_sanitizer(streams_and_fused):
    """Extend and target-verify over two layers, and speculative decoding's draft (on a stream of
    its own) between two target layers: nothing to report.  Before the backport had a side stream
    per main stream, ``draft_and_target`` reported unsafe reuse of the shared-experts output (as
    upstream's code still does, tests/test_real_sglang_import.py).  Routed experts that wrote their
    input in place would race with the side stream (``in_place_routed``); sglang's NPU routed
    path does not (dev/shimdev/beds/stream_races.py)."""
    from shimdev.beds import stream_races

    res = streams_and_fused
    assert stream_races.problems(res["races"], "backport") == []
    (race,) = res["races"]["in_place_routed"]
    assert race["streams"] == ["side-1", "main"] and race["ops"] == ["mm", "copy_"], race
    assert "glm4_moe.py" in race["message"] and "dual_stream_experts.py" in race["message"], race


def test_real_0_5_9_streams_off_keeps_original_experts_fused_still_on():
    res = _run("streams_off", "partial", {"SGLANG_NPU_USE_MULTI_STREAM": "0"})
    st = res["state"]
    assert st["state"] == "applied", st
    assert "dual-stream experts off (SGLANG_NPU_USE_MULTI_STREAM is not on)" in st["reason"], st
    # forward_deepep is not touched at all; forward_prepare is (upstream gates it on NPU only).
    assert res["wrapped"] == {"forward_deepep": "function", "forward_prepare": "FunctionWrapper"}
    assert not [e for e in res["events"] if e[0] in ("wait_stream", "stream_enter", "stream_create")]
    assert res["equal"] is True
    assert res["fused_diff"] < 1e-5
    assert st["details"]["counts"]["fused_python_calls"] == 1


def test_real_0_5_9_kernel_missing_and_streams_off_is_inactive_with_reason():
    """Nothing to do (no kernel in the image, streams not asked for) is not "should apply but
    cannot": strict mode passes on such a healthy image."""
    res = _run("nothing_applies", None, {"SGLANG_NPU_USE_MULTI_STREAM": None})
    st = res["state"]
    assert st["state"] == "inactive", st
    assert "fused qkv-rmsnorm-rope decode path off: sgl_kernel_npu has no " \
           "norm.split_qkv_rmsnorm_rope" in st["reason"], st
    assert res["wrapped"] == {"forward_deepep": "function", "forward_prepare": "function"}


def test_real_0_5_9_old_kernel_is_refused_per_layer_and_streams_still_apply():
    # A kernel without partial rotary would rotate whole heads (wrong for GLM-4.x): the layer keeps
    # its original path, the reason is in the details; the streams are unaffected.
    res = _run("old_kernel", "full_head", {"SGLANG_NPU_USE_MULTI_STREAM": "1"})
    st = res["state"]
    assert st["state"] == "applied", st
    assert res["wrapped"] == {"forward_deepep": "FunctionWrapper", "forward_prepare": "FunctionWrapper"}
    assert res["equal"] is True and res["fused_equal"] is True
    assert res["waits"] == [["wait_stream", SIDE, "main"], ["wait_stream", "main", SIDE]]
    assert "rope rotates 8 of 16 head dims" in st["details"]["fused_fallback"], st["details"]
    assert st["details"]["counts"]["fused_python_calls"] == 0


def test_real_0_5_9_switch_off_leaves_glm4_moe_untouched():
    res = _run("nothing_applies", "partial",
               {"SGLANG_NPU_USE_MULTI_STREAM": "1", "NPU_SHIM_DUAL_STREAM": "0"})
    assert res["state"]["state"] == "disabled"
    assert res["wrapped"] == {"forward_deepep": "function", "forward_prepare": "function"}


def test_real_0_5_11_stands_down_upstream():
    res = run_program("0.5.11", "glm4_moe_upstream", env={"SGLANG_NPU_USE_MULTI_STREAM": "1"})
    assert res["state"]["state"] == "upstream", res
    assert "process_shared_expert" in res["state"]["reason"]
    assert res["deepep"] == "function" and res["prepare"] == "function"
