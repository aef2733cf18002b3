"""dual_stream_experts at unit level: decisions on every release's source, the fingerprint guard,
the kernel check, the stream helpers on the simulated NPU and the per-layer fused-path plan.

Behaviour inside the real modules is in test_dual_stream_experts_real.py.
"""
import ast
import shutil
import sys
import types

import pytest

from npu_shim.core import framework
from npu_shim.runtime import targets
from npu_shim.source.codeview import SourceView
from npu_shim.patches import dual_stream_experts as ds
from shimdev.envs import realsglang

# The wrappers' per-process state, as a decision builds it (reset by the fixtures).
DS = ds.DualStreamExpertsState()

envs = realsglang.sglang_envs
BACKPORTED = ("0.5.7", "0.5.8", "0.5.9")
ON = {"SGLANG_NPU_USE_MULTI_STREAM": "1"}
OFF = {}


def view_of(version):
    return SourceView(str(envs.ensure_sources(version) / "sglang"), version=version)


def share_stream():
    """The side stream of the current (main) stream, None before its first use."""
    return DS.side_streams.get(ds._device_module().current_stream())


@pytest.fixture
def kernel(monkeypatch):
    """Set what the image's sgl_kernel_npu offers: kernel(None) present, kernel("why") missing."""
    def set_problem(problem):
        monkeypatch.setattr(ds, "kernel_problem", lambda: problem)
    set_problem(None)
    return set_problem


@pytest.fixture(autouse=True)
def fresh_state():
    DS.__init__()
    yield
    DS.__init__()


def targets_of(decision):
    return sorted(t.qualname for t in decision.targets)


# -- the release matrix (static: source of every wheel) -------------------------------------------

def test_every_release_backported_or_upstream(kernel):
    states = {}
    for version in envs.RELEASES:
        decision = framework.decide(ds.PATCH, view_of(version), environ=ON, on_npu=True)
        states[version] = decision.state
        if version in BACKPORTED:
            assert targets_of(decision) == [ds.PREPARE, ds.DEEPEP], (version, decision)
            assert "dual-stream experts on" in decision.reason
            assert "fused qkv-rmsnorm-rope decode path on" in decision.reason
        else:
            assert "process_shared_expert" in decision.reason, (version, decision)
    assert states == {v: ("applied" if v in BACKPORTED else "upstream") for v in envs.RELEASES}


def test_recorded_fingerprints_are_those_of_0_5_7_to_0_5_9_and_later_code_differs():
    for version in BACKPORTED:
        view = view_of(version)
        assert view.function(ds.GLM4_MOE, ds.DEEPEP).fingerprint in ds.DEEPEP_FINGERPRINTS
        assert view.function(ds.GLM4_MOE, ds.PREPARE).fingerprint in ds.PREPARE_FINGERPRINTS
    # 0.5.10 changed both bodies (it has the feature): the guard would refuse them.
    view = view_of("0.5.10")
    deepep = targets.Wrap(ds.GLM4_MOE, ds.DEEPEP, DS.forward_deepep_wrapper,
                           [ds.DEEPEP_PARAMS], pins={(ds.GLM4_MOE, ds.DEEPEP): ds.DEEPEP_FINGERPRINTS})
    assert "differs from the code the shim stands in for" in deepep.check_source(view)


# -- states -----------------------------------------------------------------------------------

@pytest.mark.parametrize("environ, problem, state, targets, words", [
    (ON, None, "applied", [ds.PREPARE, ds.DEEPEP], ["dual-stream experts on", "decode path on"]),
    (ON, "no kernel here", "applied", [ds.DEEPEP],
     ["dual-stream experts on", "decode path unsupported: no kernel here"]),
    (OFF, None, "applied", [ds.PREPARE],
     ["dual-stream experts off (SGLANG_NPU_USE_MULTI_STREAM is not on)", "decode path on"]),
    ({"SGLANG_NPU_USE_MULTI_STREAM": "0"}, "no kernel here", "unsupported", [],
     ["dual-stream experts off", "decode path unsupported: no kernel here"]),
])
def test_sub_features_map_onto_states(kernel, environ, problem, state, targets, words):
    kernel(problem)
    decision = framework.decide(ds.PATCH, view_of("0.5.9"), environ=environ, on_npu=True)
    assert decision.state == state, decision
    if state == "applied":
        assert targets_of(decision) == targets
    for word in words:
        assert word in decision.reason, decision


def test_switch_npu_and_bad_value(kernel):
    view = view_of("0.5.8")
    assert framework.decide(ds.PATCH, view, environ=dict(ON, NPU_SHIM_DUAL_STREAM="0"),
                           on_npu=True).state == "disabled"
    assert framework.decide(ds.PATCH, view, environ=ON, on_npu=False).state == "inactive"
    bad = framework.decide(ds.PATCH, view, environ={"SGLANG_NPU_USE_MULTI_STREAM": "maybe"}, on_npu=True)
    assert bad.state == "failed" and "SGLANG_NPU_USE_MULTI_STREAM='maybe'" in bad.reason


def test_static_question_assumes_streams_asked_and_forgets_earlier_decisions(kernel):
    view = view_of("0.5.7")
    kernel("no kernel here")
    # An earlier decide() with the streams off must not leak into the static question.
    assert framework.decide(ds.PATCH, view, environ=OFF, on_npu=True).state == "unsupported"
    static = framework.decide(ds.PATCH, view, environ=OFF, on_npu=None, assume_triggered=True)
    assert static.state == "applied" and targets_of(static) == [ds.DEEPEP], static


# -- the fingerprint guard ----------------------------------------------------------------------

def _tree_with(tmp_path, edit):
    """A copy of 0.5.9's glm4_moe.py + npu/utils.py with ``edit(text)`` applied to glm4_moe."""
    src = envs.ensure_sources("0.5.9") / "sglang"
    root = tmp_path / "sglang"
    for rel in ("srt/models/glm4_moe.py", "srt/hardware_backend/npu/utils.py", "version.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / rel, root / rel)
    path = root / "srt/models/glm4_moe.py"
    text = path.read_text()
    changed = edit(text)
    assert changed != text
    path.write_text(changed)
    return SourceView(str(root), version="0.5.9+edited")


def test_a_changed_body_is_unsupported_naming_the_method(tmp_path, kernel):
    view = _tree_with(tmp_path, lambda t: t.replace(
        "x.add_(final_hidden_states, alpha=self.routed_scaling_factor)",
        "x.add_(final_hidden_states, alpha=2 * self.routed_scaling_factor)"))
    decision = framework.decide(ds.PATCH, view, environ=ON, on_npu=True)
    assert decision.state == "unsupported"
    assert "Glm4MoeSparseMoeBlock.forward_deepep differs from the code the shim stands in for" in decision.reason


def test_comments_and_formatting_do_not_count(tmp_path, kernel):
    view = _tree_with(tmp_path, lambda t: t.replace(
        "        q, k = self.rotary_emb(positions, q, k)\n",
        "        # a comment an image vendor added\n        q, k = self.rotary_emb(\n"
        "            positions, q, k\n        )\n"))
    assert framework.decide(ds.PATCH, view, environ=ON, on_npu=True).state == "applied"


def _loaded_module(tmp_path, body_source):
    """A module whose Glm4MoeAttention.forward_prepare has ``body_source`` (a def)."""
    text = ("from __future__ import annotations\n\n\nclass Glm4MoeAttention:\n"
            + "\n".join("    " + line for line in body_source.splitlines()) + "\n")
    path = tmp_path / ("glm_loaded_%d.py" % abs(hash(body_source)))
    path.write_text(text)
    module = types.ModuleType(path.stem)
    module.__file__ = str(path)
    exec(compile(text, str(path), "exec"), module.__dict__)
    return module


def _original_prepare_source():
    module = view_of("0.5.9").module(ds.GLM4_MOE)
    tree = ast.parse(module.text)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Glm4MoeAttention")
    node = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward_prepare")
    import textwrap
    return textwrap.dedent(ast.get_source_segment(module.text, node, padded=True))



def test_loaded_code_is_fingerprinted_too(tmp_path):
    target = targets.Wrap("m", ds.PREPARE, DS.forward_prepare_wrapper, [ds.PREPARE_PARAMS],
                          pins={("m", ds.PREPARE): ds.PREPARE_FINGERPRINTS})
    original = _original_prepare_source()
    assert target.prepare(_loaded_module(tmp_path, original)).original.__name__ == "forward_prepare"
    edited = original.replace("q, k = self.rotary_emb(positions, q, k)", "q, k = q, k")
    with pytest.raises(LookupError, match="loaded fingerprint"):
        target.prepare(_loaded_module(tmp_path, edited))


# -- the kernel check (before anything is imported) ----------------------------------------------

def _fake_kernel_package(root, kernel_text):
    pkg = root / "sgl_kernel_npu"
    (pkg / "norm").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('the kernel check must not import me')\n")
    (pkg / "norm" / "__init__.py").write_text("")
    if kernel_text is not None:
        (pkg / "norm" / "split_qkv_rmsnorm_rope.py").write_text(kernel_text)


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    # Only the real import system: no simulated-NPU stub finder, no cached sgl_kernel_npu.
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if type(f).__name__ != "StubFinder"])
    for name in [n for n in sys.modules if n.split(".")[0] == "sgl_kernel_npu"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib
    importlib.invalidate_caches()
    yield tmp_path
    # A test that imported the package written here must not leave it to later tests (monkeypatch
    # then puts back the simulated NPU's own modules).
    for name in [n for n in sys.modules if n.split(".")[0] == "sgl_kernel_npu"]:
        del sys.modules[name]


# sgl-kernel-npu's split_qkv_rmsnorm_rope through its history (bodies reduced to what tells them
# apart; the Triton kernels they launch are left out).
HISTORY = {
    "2025-11-19": """
def split_qkv_rmsnorm_rope(input, sin, cos, q_weight, k_weight, q_hidden_size, kv_hidden_size,
                           head_dim, eps, q_bias, k_bias):
    HALF_HEAD_DIM = head_dim // 2
    return input, input, input
""",
    "2025-12-26": """
def split_qkv_rmsnorm_rope(input, sin, cos, q_hidden_size, kv_hidden_size, head_dim, eps=None,
                           q_weight=None, k_weight=None, q_bias=None, k_bias=None):
    HALF_HEAD_DIM = head_dim // 2  # rotates the whole head
    return input, input, input
""",
    "2026-03-05": """
def split_qkv_rmsnorm_rope(input, sin, cos, q_hidden_size, kv_hidden_size, head_dim, eps=None,
                           q_weight=None, k_weight=None, q_bias=None, k_bias=None):
    rope_dim = sin.shape[-1]
    return input, input, input
""",
    "2026-05-27": """
def split_qkv_rmsnorm_rope(input, sin, cos, q_hidden_size, kv_hidden_size, head_dim, eps=None,
                           q_weight=None, k_weight=None, q_bias=None, k_bias=None,
                           is_neox_style=True):
    rope_dim = sin.shape[-1]
    return input, input, input
""",
    # rope_dim in the file, but only in a helper: the wrapper still rotates the whole head
    "helper-only": """
def _kernel(x, ROPE_DIM):  # rope_dim = sin.shape[-1] would be needed here
    return x

def split_qkv_rmsnorm_rope(input, sin, cos, q_hidden_size, kv_hidden_size, head_dim, eps=None,
                           q_weight=None, k_weight=None, q_bias=None, k_bias=None):
    return input, input, input
""",
    "required extra": """
def split_qkv_rmsnorm_rope(input, sin, cos, q_hidden_size, kv_hidden_size, head_dim, eps=None,
                           q_weight=None, k_weight=None, q_bias=None, k_bias=None, *, stream):
    rope_dim = sin.shape[-1]
""",
}
NEW_KERNEL = HISTORY["2026-03-05"]
OLD_KERNEL = HISTORY["2025-12-26"]


def test_kernel_check_reads_the_installed_package_without_importing_it(on_path):
    _fake_kernel_package(on_path, NEW_KERNEL)
    assert ds.kernel_problem() is None
    assert "sgl_kernel_npu" not in sys.modules


def test_kernel_check_reasons(on_path):
    assert str(ds.kernel_problem()) == "sgl_kernel_npu is not installed"
    _fake_kernel_package(on_path, None)
    assert "has no norm/split_qkv_rmsnorm_rope.py" in str(ds.kernel_problem())
    (on_path / "sgl_kernel_npu" / "norm" / "split_qkv_rmsnorm_rope.py").write_text(OLD_KERNEL)
    assert "no partial-rotary support" in str(ds.kernel_problem())
    (on_path / "sgl_kernel_npu" / "norm" / "split_qkv_rmsnorm_rope.py").write_text("x = 1\n")
    assert "defines no split_qkv_rmsnorm_rope()" in str(ds.kernel_problem())


@pytest.mark.parametrize("when,decision,call_time", [
    ("2025-11-19", "parameter 4 is q_weight where the call passes q_hidden_size",
     "parameter 4 is q_weight where the call passes q_hidden_size"),
    ("2025-12-26", "no partial-rotary support", "rope rotates 8 of 16 head dims"),
    ("2026-03-05", None, None),
    ("2026-05-27", None, None),
    ("helper-only", "no partial-rotary support", "rope rotates 8 of 16 head dims"),
    ("required extra", "requires stream, which the call does not pass",
     "requires stream, which the call does not pass"),
])
def test_kernel_history_is_judged_by_signature_the_same_before_and_at_call_time(
        on_path, when, decision, call_time):
    """Each historical shape of the kernel, written as a file: what the decision reads from it
    and what the first call finds in the loaded function agree (a GLM-4.x layer: rope on 8 of
    16 head dims)."""
    _fake_kernel_package(on_path, HISTORY[when])
    problem = ds.kernel_problem()
    assert (problem is None) if decision is None else (decision in str(problem)), problem
    assert "sgl_kernel_npu" not in sys.modules  # read, not imported
    (on_path / "sgl_kernel_npu" / "__init__.py").write_text("")  # now the process imports it
    DS.__init__()
    plan = DS._plan_layer(_attn())  # imports the file written above
    assert (plan is None) if call_time is None else (call_time in plan), plan
    assert DS._plan_layer(_attn(rotary_emb=_Rope(16))) == (None if decision is None or "rotary" in
                                                          decision else plan)


def test_kernel_the_shim_cannot_read_keeps_the_original_path(monkeypatch):
    monkeypatch.setattr(ds, "importlib", types.SimpleNamespace(
        import_module=lambda name: types.SimpleNamespace(split_qkv_rmsnorm_rope=len)))  # a builtin
    assert "cannot read the source of the loaded split_qkv_rmsnorm_rope" in DS._plan_layer(_attn())


# -- stream helpers on the simulated NPU ------------------------------------------------------------

def test_side_stream_waits_main_runs_work_and_main_waits_side(simnpu_clean):
    sim = simnpu_clean
    DS.wait_share_stream()  # nothing queued on a side stream yet: a no-op
    assert sim.events() == []
    seen = []
    out = DS.process_shared_expert(3, lambda x: seen.append(sim.current_stream_name()) or x * 2)
    DS.wait_share_stream()
    assert out == 6 and seen == ["side-1"]
    assert sim.events() == [("stream_create", "side-1"), ("wait_stream", "side-1", "main"),
                            ("stream_enter", "side-1"), ("stream_exit", "side-1"),
                            ("wait_stream", "main", "side-1")]
    # One side stream per process, reused; a revert forgets it.
    DS.process_shared_expert(1, lambda x: x)
    assert len(sim.events("stream_create")) == 1 and sim.stream_name(share_stream()) == "side-1"
    DS.__init__()
    assert share_stream() is None


def _moe_layer(process, block, hidden):
    from shimdev.bench import dual_stream_bench

    batch = types.SimpleNamespace(num_token_non_padded=None)
    return process._forward_deepep_dual_stream(dual_stream_bench._serial_forward, block, hidden, batch)


def test_two_main_streams_feeding_side_streams_do_not_race(simnpu_clean):
    """Speculative decoding's target model on the default stream and its draft model on a stream of
    its own (spec v2's overlap plan stream, as in sglang#30965), one MoE layer each, under the
    stream sanitizer: the target's shared-experts output, used on its main stream and freed, must
    not be handed to the draft's shared experts while the target may still read it."""
    import torch
    from shimdev.bench import dual_stream_bench

    torch.manual_seed(0)
    params = dict(dual_stream_bench.DEFAULTS, tokens=6, hidden=8, shared_inter=8, experts=4, topk=2,
                  expert_inter=4)
    block = dual_stream_bench.build_block("cpu", torch.float32, params)
    draft = torch.npu.Stream()
    with simnpu_clean.sanitize() as san, torch.no_grad():
        hidden = torch.randn(6, 8)
        out = _moe_layer(DS, block, hidden)
        residual = out + hidden  # the target reads its layer output on its own stream
        del out
        with torch.npu.stream(draft):
            _moe_layer(DS, block, torch.randn(6, 8))
        _moe_layer(DS, block, residual)  # the target's next layer
    san.assert_clean()
    # each main stream has a side stream of its own; the target's is reused by its next layer
    assert sorted(DS.details["side_streams"].items()) == [
        ("<simnpu Stream main>", "<simnpu Stream side-2>"), ("<simnpu Stream side-1>", "<simnpu Stream side-3>")]
    assert DS.details["side_stream_count"] == 2  # the number sglang's metrics show


# -- which layers take the fused path -------------------------------------------------------------

class _Norm:
    def __init__(self, eps):
        self.variance_epsilon = eps


class _Rope:
    def __init__(self, rotary_dim, neox=True):
        self.rotary_dim, self.is_neox_style = rotary_dim, neox

    def get_cos_sin_with_position(self, positions):
        raise AssertionError("not called by the plan")


def _attn(**kw):
    a = types.SimpleNamespace(head_dim=16, use_qk_norm=True, q_norm=_Norm(1e-5), k_norm=_Norm(1e-5),
                              rotary_emb=_Rope(8))
    for key, value in kw.items():
        setattr(a, key, value)
    return a


def test_layer_plan(monkeypatch):
    from shimdev.beds import dual_stream_kernels as K

    monkeypatch.setattr(ds, "importlib", types.SimpleNamespace(
        import_module=lambda name: types.SimpleNamespace(split_qkv_rmsnorm_rope=K.split_qkv_rmsnorm_rope)))
    assert DS._plan_layer(_attn()) is None
    assert DS.kernel_partial is True
    assert "no q/k RMSNorm" in DS._plan_layer(_attn(use_qk_norm=False))
    assert "different eps" in DS._plan_layer(_attn(k_norm=_Norm(1e-6)))
    assert "not a neox-style" in DS._plan_layer(_attn(rotary_emb=_Rope(8, neox=False)))
    # The old kernel (whole-head rope) is fine only where the rope covers the whole head.
    DS.__init__()
    monkeypatch.setattr(ds, "importlib", types.SimpleNamespace(
        import_module=lambda name: types.SimpleNamespace(split_qkv_rmsnorm_rope=K.split_qkv_rmsnorm_rope_full_head)))
    assert "rotates 8 of 16 head dims" in DS._plan_layer(_attn())
    assert DS._plan_layer(_attn(rotary_emb=_Rope(16))) is None


def test_missing_kernel_at_call_time_keeps_the_original_path(monkeypatch):
    def missing(name):
        raise ImportError("No module named %r" % name)

    monkeypatch.setattr(ds, "importlib", types.SimpleNamespace(import_module=missing))
    import torch

    assert DS._fused_kernel_for(_attn(), torch.arange(3)) is None
    assert "cannot import sgl_kernel_npu.norm.split_qkv_rmsnorm_rope" in DS.details["fused_fallback"]
    # 2-D (multimodal) positions never take the fused path.
    assert DS._fused_kernel_for(_attn(), torch.zeros(3, 2, dtype=torch.long)) is None


# -- the benchmark script -------------------------------------------------------------------------

def _bench():
    from shimdev.bench import dual_stream_bench

    return dual_stream_bench


def test_bench_says_plainly_when_no_device_exists():
    bench = _bench()
    device, why = bench.find_device()
    (row,) = bench.rows()
    assert set(row) == {"what", "how", "measured", "target", "ok"}
    if device is None:
        assert row["ok"] is None and row["measured"] == "not measured: " + why
        assert why == "no CUDA or NPU device on this machine"
    else:  # a machine with a device measures (no timed assertion here)
        assert row["measured"].startswith("serial ") and isinstance(row["ok"], bool)


def test_bench_cpu_smoke_runs_the_shims_dual_stream_body_with_equal_output():
    (row,) = _bench().rows("cpu", tokens=16, hidden=32, shared_inter=64, expert_inter=16,
                           samples=1, reps=1, warmup=1)
    assert row["ok"] is None
    assert "outputs equal: True" in row["measured"] and "CPU smoke run" in row["measured"]
    assert share_stream() is None  # the bench leaves no stream state behind


def test_bench_wrapper_cost_runs_the_wrapper_as_the_shim_installs_it_cpu_plumbing():
    """scripts/bench_dual_stream.py --wrapper-cost (device_check.sh's moe_wrapper step) on the CPU:
    the wrapped method sends extend calls down the dual-stream path and decode calls through; the
    figures' shape only (nothing timed is asserted)."""
    import wrapt

    bench = _bench()
    out = bench.wrapper_cost("cpu", wrapt, tokens=4, calls=2, rounds=3, hidden=16, shared_inter=16,
                             expert_inter=8, experts=4, topk=2)
    assert set(out["ms"]) == {"plain", "extend", "decode"}
    assert all(len(values) == 3 and all(v > 0 for v in values) for values in out["ms"].values())
    assert out["dual_stream_python_calls"] == 3 + 3 * 2  # warm-up, then 3 rounds x 2 calls: extend only
    row = bench.wrapper_cost_row("cpu", "cpu", wrapt, "wrapt %s" % wrapt.__version__, tokens=4, calls=2,
                                 rounds=3, hidden=16, shared_inter=16, expert_inter=8, experts=4, topk=2)
    assert row["what"] == bench.WRAPPER_WHAT and row["ok"] is None and "CPU dry run" in row["measured"]
    assert share_stream() is None


def test_the_forward_starts_no_thread_and_writes_no_metric_per_call(monkeypatch):
    """A global-mode NPU graph capture fails on another thread's NPU work, and a gauge written per
    call is too dear for the wrapper's budget: the forward only counts (sglang's metrics get the
    counts when its scheduler logs its stats); its one write is the side stream made for the main
    stream, once.  Before the fix a call published once a second, and the calls in between started
    a ``threading.Timer`` that published a second later."""
    import threading

    import wrapt

    from npu_shim.reporting import metrics

    started, published = [], []
    real_start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self), real_start(self))[1])
    monkeypatch.setattr(metrics, "publish", lambda: published.append(True))
    out = _bench().wrapper_cost("cpu", wrapt, tokens=4, calls=5, rounds=2, hidden=16, shared_inter=16,
                                expert_inter=8, experts=4, topk=2)
    assert out["dual_stream_python_calls"] == 3 + 2 * 5  # the calls counted, every one
    assert started == [] and published == [True]  # the side stream, made at the first call
