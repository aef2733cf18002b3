"""dual_stream_experts, layer by layer in this process: which ``forward_deepep`` calls the wrapper
sends down the two streams (forward modes, empty and one-token batches, the ways sglang passes the
arguments) and what the two-stream body computes, calls and counts next to 0.5.9's single-stream
method; the side streams' creation under the lock; which attention layers share a fused-path plan
(``_layer_key``) and why each layer keeps or leaves the original path; the kernel checks' exact
answers and problem texts (what ``status`` and the decision show an operator); and the decision's
state and reason for each combination of the two sub-features."""
import ast
import enum
import importlib
import inspect
import shutil
import sys
import threading
import types
import zipfile

import pytest

from npu_shim.core import framework
from npu_shim.patches import dual_stream_experts as ds
from npu_shim.source.codeview import SourceView
from shimdev.envs import realsglang
from test_dual_stream_experts import HISTORY, _fake_kernel_package, on_path  # noqa: F401 - a fixture

KERNEL_FILE = "split_qkv_rmsnorm_rope.py"


# == which attention layers take the fused path, and which share a plan ===========================

class Norm:
    def __init__(self, eps):
        self.variance_epsilon = eps


class Rope:
    """A neox RotaryEmbedding with get_cos_sin_with_position (what the fused path calls)."""

    def __init__(self, rotary_dim=16, neox=True):
        self.rotary_dim, self.is_neox_style = rotary_dim, neox

    def get_cos_sin_with_position(self, positions):
        raise AssertionError("a plan never computes cos/sin")


class PlainRope:
    """A rotary embedding without get_cos_sin_with_position (same dims and style as Rope)."""

    def __init__(self):
        self.rotary_dim, self.is_neox_style = 16, True


class BareRope:
    """A rotary embedding that has get_cos_sin_with_position and says nothing of its width or style:
    it rotates the whole head, neox-style (what the plan assumes)."""

    def get_cos_sin_with_position(self, positions):
        raise AssertionError("a plan never computes cos/sin")


def layer(**kw):
    """A GLM-4.x attention layer the fused kernel fits (whole-head rope, as an old kernel does it)."""
    a = types.SimpleNamespace(head_dim=16, use_qk_norm=True, q_norm=Norm(1e-5), k_norm=Norm(1e-5),
                              rotary_emb=Rope())
    for key, value in kw.items():
        if value is _GONE:
            delattr(a, key)
        else:
            setattr(a, key, value)
    return a


_GONE = object()
POSITIONS = types.SimpleNamespace(ndim=1, shape=(3,))  # a decode batch's positions: one per token
NO_QK_NORM = "layer has no q/k RMSNorm (the kernel always normalises)"
OTHER_EPS = "q_norm and k_norm use different eps (the kernel takes one)"

# Layers that differ from ``layer()`` in one respect, and why each keeps the original path.
KEPT = {
    "no qk-norm": (dict(use_qk_norm=False), NO_QK_NORM),
    # sglang's Glm4MoeAttention without qk-norm has neither the flag's truth nor the norms
    "no qk-norm attributes": (dict(use_qk_norm=_GONE, q_norm=_GONE, k_norm=_GONE), NO_QK_NORM),
    # the plan goes by the flag alone (the original forward_prepare normalises only where it is set)
    "norms without the flag": (dict(use_qk_norm=_GONE), NO_QK_NORM),
    "q eps": (dict(q_norm=Norm(1e-6)), OTHER_EPS),
    "k eps": (dict(k_norm=Norm(1e-6)), OTHER_EPS),
    "not neox": (dict(rotary_emb=Rope(neox=False)),
                 "Rope is not a neox-style RotaryEmbedding with get_cos_sin_with_position"),
    "no get_cos_sin_with_position": (dict(rotary_emb=PlainRope()),
                                     "PlainRope is not a neox-style RotaryEmbedding with get_cos_sin_with_position"),
    "partial rope": (dict(rotary_emb=Rope(8)),
                     "rope rotates 8 of 16 head dims and this split_qkv_rmsnorm_rope has no partial-rotary support"),
}


@pytest.fixture
def whole_head_kernel():
    """A state whose loaded kernel rotates whole heads only (kernel_partial False)."""
    state = ds.DualStreamExpertsState()
    state.kernel, state.kernel_partial = "the kernel", False
    return state


@pytest.mark.parametrize("name", sorted(KEPT))
def test_a_layer_differing_in_one_respect_gets_its_own_plan(whole_head_kernel, name):
    """Plans are cached by layer configuration: a layer the kernel would compute differently from
    one it fits (planned first) must not reuse that layer's plan, and keeps the original path with
    its reason in the status details; the fitting layer keeps the fused path."""
    state = whole_head_kernel
    positions = POSITIONS
    changes, reason = KEPT[name]
    assert state._fused_kernel_for(layer(), positions) == "the kernel"
    assert state._fused_kernel_for(layer(**changes), positions) is None
    assert state.details["fused_fallback"] == reason
    assert sorted(state.layer_plans.values(), key=str) == [None, reason]
    assert state._fused_kernel_for(layer(), positions) == "the kernel"


def test_layers_of_one_configuration_share_one_plan(whole_head_kernel, monkeypatch):
    state = whole_head_kernel
    planned = []
    real = ds.DualStreamExpertsState._plan_layer
    monkeypatch.setattr(ds.DualStreamExpertsState, "_plan_layer", lambda self, a: planned.append(a) or real(self, a))
    layers = [layer() for _ in range(4)]
    assert [state._fused_kernel_for(a, POSITIONS) for a in layers] == ["the kernel"] * 4
    assert planned == layers[:1] and list(state.layer_plans.values()) == [None]
    assert "fused_fallback" not in state.details


def test_a_rope_that_says_nothing_of_width_or_style_is_taken_as_whole_head_neox(whole_head_kernel):
    """RotaryEmbedding subclasses without ``rotary_dim``/``is_neox_style`` rotate the whole head,
    neox-style: a whole-head kernel fits them."""
    state = whole_head_kernel
    assert state._fused_kernel_for(layer(rotary_emb=BareRope()), POSITIONS) == "the kernel"
    assert state._plan_layer(layer(rotary_emb=BareRope())) is None
    assert state.layer_plans == {ds._layer_key(layer(rotary_emb=BareRope())): None}


def test_the_kernel_is_imported_once_per_process(monkeypatch):
    """Whether it imports or not, the kernel is looked for once: later layer configurations get
    the same kernel, or the same reason."""
    from shimdev.beds import dual_stream_kernels as K

    for found in (True, False):
        imports = []

        def import_module(name):
            imports.append(name)
            if not found:
                raise ImportError("No module named 'sgl_kernel_npu'")
            return types.SimpleNamespace(split_qkv_rmsnorm_rope=K.split_qkv_rmsnorm_rope_full_head)

        monkeypatch.setattr(ds, "importlib", types.SimpleNamespace(import_module=import_module))
        state = ds.DualStreamExpertsState()
        plans = [state._fused_kernel_for(layer(**changes), POSITIONS)
                 for changes in ({}, {"q_norm": Norm(1e-6), "k_norm": Norm(1e-6)}, {"rotary_emb": BareRope()})]
        assert imports == [ds.KERNEL_MODULE]
        if found:
            assert plans == [K.split_qkv_rmsnorm_rope_full_head] * 3 and state.kernel_partial is False
        else:
            assert plans == [None] * 3 and set(state.layer_plans.values()) == {state.kernel_error}


def test_a_kernel_that_cannot_be_imported_is_named_with_the_error(monkeypatch):
    def missing(name):
        raise ImportError("No module named 'sgl_kernel_npu'")

    monkeypatch.setattr(ds, "importlib", types.SimpleNamespace(import_module=missing))
    assert ds.load_kernel() == (None, None, "cannot import sgl_kernel_npu.norm.split_qkv_rmsnorm_rope."
                                            "split_qkv_rmsnorm_rope: ImportError(\"No module named 'sgl_kernel_npu'\")")


# == the kernel's signature: exact answers ======================================================

def _def(source):
    return ast.parse(source).body[0]


FULL = ("input, sin, cos, q_hidden_size, kv_hidden_size, head_dim, eps=None, q_weight=None, "
        "k_weight=None, q_bias=None, k_bias=None")
SHIM_WAS_NOT_WRITTEN_FOR = "(a kernel signature the shim was not written for)"


@pytest.mark.parametrize("signature, body, answer", [
    (FULL, "rope_dim = sin.shape[-1]", (None, True)),
    (FULL, "return input", (None, False)),
    # other dims of sin are not the rotary width
    (FULL, "n = sin.shape[0]; w = sin.shape[1]; v = sin.shape[-2]; u = sin.shape[+1]", (None, False)),
    (FULL, "rope_dim = cos.shape[-1]", (None, False)),
    ("input, sin", "pass", ("K: parameter 3 is nothing where the call passes cos " + SHIM_WAS_NOT_WRITTEN_FOR, False)),
    ("input, sin, cos, q_hidden_size, kv_hidden_size", "pass",
     ("K: parameter 6 is nothing where the call passes head_dim " + SHIM_WAS_NOT_WRITTEN_FOR, False)),
    ("input, sin, cos, q_weight, k_weight, q_hidden_size, kv_hidden_size, head_dim, eps, q_bias, k_bias",
     "rope_dim = sin.shape[-1]",
     ("K: parameter 4 is q_weight where the call passes q_hidden_size " + SHIM_WAS_NOT_WRITTEN_FOR, False)),
    ("input, sin, cos, q_hidden_size, kv_hidden_size, head_dim, q_weight=None, k_weight=None, q_bias=None, "
     "k_bias=None", "rope_dim = sin.shape[-1]", ("K takes no keyword argument eps", False)),
    ("input, sin, cos, q_hidden_size, kv_hidden_size, head_dim, eps=None, q_weight=None, k_weight=None, "
     "q_bias=None, /, k_bias=None", "rope_dim = sin.shape[-1]", ("K takes no keyword argument eps", False)),
    (FULL + ", *, stream, device", "rope_dim = sin.shape[-1]",
     ("K requires stream, device, which the call does not pass", False)),
    ("input, sin, cos, q_hidden_size, kv_hidden_size, head_dim, workspace, eps=None, q_weight=None, "
     "k_weight=None, q_bias=None, k_bias=None, *, stream=None", "rope_dim = sin.shape[-1]",
     ("K requires workspace, which the call does not pass", False)),
])
def test_kernel_support_answers(signature, body, answer):
    """(problem, partial) of a kernel ``def``: the problem in words, and partial-rotary support only
    for a usable kernel that reads ``sin.shape[-1]``."""
    assert ds.kernel_support(_def("def split_qkv_rmsnorm_rope(%s):\n    %s\n" % (signature, body)), "K") == answer


@pytest.mark.parametrize("index", ["-1", "-2", "1", "0", "+1", "-x", "~1", "-1.5"])
def test_only_minus_one_is_the_last_dim(index):
    node = ast.parse(index, mode="eval").body
    assert ds._is_minus_one(node) is (index == "-1")


def test_a_folded_minus_one_is_the_last_dim_too():
    """An AST whose constants were folded (``ast.parse(optimize=1)`` from Python 3.13, an optimizer's
    output) has ``-1`` as one constant."""
    assert ds._is_minus_one(ast.Constant(-1)) is True
    assert ds._is_minus_one(ast.Constant(1)) is False
    assert ds._is_minus_one(ast.Constant(-2)) is False


# -- the loaded kernel (at its first call) -------------------------------------------------------

def kernel_of_2025_11_19(input, sin, cos, q_weight, k_weight, q_hidden_size, kv_hidden_size, head_dim, eps,
                         q_bias, k_bias):
    return input, input, input


class ClassKernel:
    """A kernel exported as a class, not a function."""

    def __call__(self, *args, **kwargs):
        return args[0], args[0], args[0]


def test_loaded_kernel_with_an_old_signature_is_named_as_loaded():
    assert ds.loaded_kernel_support(kernel_of_2025_11_19) == (
        "the loaded split_qkv_rmsnorm_rope: parameter 4 is q_weight where the call passes q_hidden_size "
        + SHIM_WAS_NOT_WRITTEN_FOR, False)


def test_loaded_kernel_that_is_no_function():
    assert ds.loaded_kernel_support(ClassKernel) == ("the loaded split_qkv_rmsnorm_rope is not a plain function",
                                                     False)


def test_loaded_kernel_without_source():
    try:
        inspect.getsource(len)
    except TypeError as exc:
        why = repr(exc)
    assert ds.loaded_kernel_support(len) == (
        "cannot read the source of the loaded split_qkv_rmsnorm_rope to check its signature (%s)" % why, False)


def test_loaded_kernel_whose_file_was_rewritten_after_import(tmp_path, monkeypatch):
    """An image whose sgl-kernel-npu was replaced on disk under the running process: the source
    found for the loaded function holds no statement, and the kernel is refused, not crashed on."""
    import linecache

    path = tmp_path / "replaced_kernel.py"
    path.write_text("# sgl-kernel-npu\n\n\n\ndef split_qkv_rmsnorm_rope(" + FULL + "):\n"
                    "    rope_dim = sin.shape[-1]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("replaced_kernel")
    try:
        path.write_text("".join("# line %d\n" % n for n in range(1, 9)))
        linecache.checkcache(str(path))
        assert ds.loaded_kernel_support(module.split_qkv_rmsnorm_rope) == (
            "the loaded split_qkv_rmsnorm_rope is not a plain function", False)
    finally:
        del sys.modules["replaced_kernel"]
        linecache.checkcache(str(path))


# == kernel_problem: what the decision and ``status`` say of the image's kernel ==================

def _problem():
    problem = ds.kernel_problem()
    return None if problem is None else (str(problem), problem.absent)


def _kernel_path(root):
    return str(root / "sgl_kernel_npu" / "norm" / KERNEL_FILE)


def test_kernel_problem_texts(on_path):
    """Each problem as an operator reads it, and whether the image simply lacks the kernel (absent:
    the fused path is off) or has one the shim cannot call (unsupported)."""
    assert _problem() == ("sgl_kernel_npu is not installed", True)
    _fake_kernel_package(on_path, None)
    assert _problem() == ("sgl_kernel_npu at %s has no norm/split_qkv_rmsnorm_rope.py (an older sgl-kernel-npu)"
                          % (on_path / "sgl_kernel_npu"), True)
    path = _kernel_path(on_path)
    for text, answer in [
        ("x = 1\n", ("%s defines no split_qkv_rmsnorm_rope()" % path, True)),
        (HISTORY["2025-12-26"], ("%s has no partial-rotary support (GLM-4.x rotates half of each head; this "
                                 "kernel would rotate all of it)" % path, True)),
        (HISTORY["2025-11-19"], ("%s split_qkv_rmsnorm_rope(): parameter 4 is q_weight where the call passes "
                                 "q_hidden_size %s" % (path, SHIM_WAS_NOT_WRITTEN_FOR), False)),
        (HISTORY["2026-05-27"], None),
    ]:
        with open(path, "w") as handle:
            handle.write(text)
        assert _problem() == answer, text


def test_kernel_file_that_does_not_parse_is_unsupported_with_the_parse_error(on_path):
    _fake_kernel_package(on_path, "def split_qkv_rmsnorm_rope(input, sin:\n")
    text, absent = _problem()
    assert text.startswith("cannot parse %s line 1: SyntaxError: " % _kernel_path(on_path)) and absent is False


def test_kernel_package_that_cannot_be_located(on_path, monkeypatch):
    """A module object put in sys.modules under the package's name without a spec (a stub of an
    image's own): the import system cannot say where the package is."""
    monkeypatch.setitem(sys.modules, "sgl_kernel_npu", types.ModuleType("sgl_kernel_npu"))
    assert _problem() == ("sgl_kernel_npu cannot be located: ValueError('sgl_kernel_npu.__spec__ is None')", False)


def test_a_search_location_that_is_gone_is_skipped(tmp_path, monkeypatch):
    """A package whose search path lists a directory that no longer exists (a stale editable
    install) before the one that holds it: the kernel in the later one is read."""
    _fake_kernel_package(tmp_path, HISTORY["2026-03-05"])
    locations = [str(tmp_path / "gone" / "sgl_kernel_npu"), str(tmp_path / "sgl_kernel_npu")]
    specs = {"sgl_kernel_npu": types.SimpleNamespace(submodule_search_locations=locations)}
    monkeypatch.setattr(ds, "importlib", types.SimpleNamespace(
        util=types.SimpleNamespace(find_spec=lambda name: specs.get(name))))
    assert ds.kernel_problem() is None


def _zipped_package(root, with_norm, with_kernel):
    archive = root / "sgl_kernel_npu.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("sgl_kernel_npu/__init__.py", "")
        if with_norm:
            zf.writestr("sgl_kernel_npu/norm/__init__.py", "")
        if with_kernel:
            zf.writestr("sgl_kernel_npu/norm/" + KERNEL_FILE, HISTORY["2026-03-05"])
    return archive


@pytest.mark.parametrize("with_norm, with_kernel, answer", [
    (True, True, None),
    (True, False, ("sgl_kernel_npu has no norm.split_qkv_rmsnorm_rope", True)),
    (False, False, ("sgl_kernel_npu has no norm.split_qkv_rmsnorm_rope", True)),
])
def test_a_zipped_package_is_asked_through_the_import_system(on_path, monkeypatch, with_norm, with_kernel,
                                                             answer):
    """sgl_kernel_npu in a zip (no directory to read): the import system says whether the kernel
    module is there."""
    archive = _zipped_package(on_path, with_norm, with_kernel)
    monkeypatch.syspath_prepend(str(archive))
    importlib.invalidate_caches()
    assert _problem() == answer


# == the decision: state and reason for each combination ========================================

def view_of(version):
    return SourceView(str(realsglang.sglang_envs.ensure_sources(version) / "sglang"), version=version)


UPSTREAM = "backport of sgl-project/sglang#19246; upstream since 0.5.10"
STREAMS_ON, STREAMS_OFF = "dual-stream experts on", "dual-stream experts off (SGLANG_NPU_USE_MULTI_STREAM is not on)"
FUSED_ON = "fused qkv-rmsnorm-rope decode path on"
ABSENT = ds.KernelProblem("sgl_kernel_npu is not installed", absent=True)
UNUSABLE = ds.KernelProblem("its signature is new")


@pytest.mark.parametrize("streams, problem, state, reason", [
    (True, None, "applied", UPSTREAM + " (%s; %s)" % (STREAMS_ON, FUSED_ON)),
    (False, None, "applied", UPSTREAM + " (%s; %s)" % (STREAMS_OFF, FUSED_ON)),
    (True, ABSENT, "applied", UPSTREAM + " (%s; fused qkv-rmsnorm-rope decode path off: sgl_kernel_npu is not "
                                         "installed)" % STREAMS_ON),
    (True, UNUSABLE, "applied", UPSTREAM + " (%s; fused qkv-rmsnorm-rope decode path unsupported: its signature "
                                           "is new)" % STREAMS_ON),
    # nothing to do: no kernel in the image and no streams asked for
    (False, ABSENT, "inactive", STREAMS_OFF + "; fused qkv-rmsnorm-rope decode path off: sgl_kernel_npu is not "
                                              "installed"),
    (False, UNUSABLE, "unsupported", STREAMS_OFF + "; fused qkv-rmsnorm-rope decode path unsupported: its "
                                                   "signature is new"),
])
def test_decision_state_and_reason(monkeypatch, streams, problem, state, reason):
    monkeypatch.setattr(ds, "kernel_problem", lambda: problem)
    environ = {"SGLANG_NPU_USE_MULTI_STREAM": "1"} if streams else {}
    decision = framework.decide(ds.PATCH, view_of("0.5.9"), environ=environ, on_npu=True)
    assert (decision.state, decision.reason) == (state, reason)


def test_upstream_reason_names_the_evidence():
    decision = framework.decide(ds.PATCH, view_of("0.5.10"), environ={}, on_npu=True)
    assert (decision.state, decision.reason) == (
        "upstream", "sglang 0.5.10 has it: glm4_moe runs shared experts through "
                    "hardware_backend.npu.utils.process_shared_expert")


def test_npu_utils_with_the_helper_but_a_model_not_calling_it_is_backported(tmp_path, monkeypatch):
    """Upstream is the model calling hardware_backend.npu.utils.process_shared_expert: the helper
    alone in npu/utils.py (a release or image between the two changes) is not the feature."""
    monkeypatch.setattr(ds, "kernel_problem", lambda: None)
    view = _tree_with(tmp_path, "srt/hardware_backend/npu/utils.py", lambda t: t + (
        "\n\ndef process_shared_expert(hidden_states, forward_func):\n    return forward_func(hidden_states)\n"))
    assert view.has(ds.NPU_UTILS, "process_shared_expert")
    decision = framework.decide(ds.PATCH, view, environ={"SGLANG_NPU_USE_MULTI_STREAM": "1"}, on_npu=True)
    assert decision.state == "applied", decision


def _tree_with(tmp_path, rel, edit):
    """A copy of 0.5.9's glm4_moe.py, npu/utils.py and version.py with ``edit(text)`` applied to ``rel``."""
    src, root = realsglang.sglang_envs.ensure_sources("0.5.9") / "sglang", tmp_path / "sglang"
    for name in ("srt/models/glm4_moe.py", "srt/hardware_backend/npu/utils.py", "version.py"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / name, root / name)
    text = (root / rel).read_text()
    assert edit(text) != text
    (root / rel).write_text(edit(text))
    return SourceView(str(root), version="0.5.9+edited")


def test_a_changed_forward_prepare_body_is_unsupported(tmp_path, monkeypatch):
    """The fused path stands in for 0.5.7-0.5.9's forward_prepare: an image whose body differs
    (here the rope call) is refused even with the streams off."""
    monkeypatch.setattr(ds, "kernel_problem", lambda: None)
    view = _tree_with(tmp_path, "srt/models/glm4_moe.py", lambda t: t.replace(
        "q, k = self.rotary_emb(positions, q, k)", "q, k = self.rotary_emb(positions, k, q)"))
    decision = framework.decide(ds.PATCH, view, environ={}, on_npu=True)
    assert decision.state == "unsupported"
    assert "Glm4MoeAttention.forward_prepare differs from the code the shim stands in for" in decision.reason


def test_the_targets_wrap_with_the_decisions_own_state(monkeypatch):
    """Each decision builds one state: its targets call that state's wrappers, and the patch
    record's details show that state's counts."""
    monkeypatch.setattr(ds, "kernel_problem", lambda: None)
    decision = framework.decide(ds.PATCH, view_of("0.5.9"), environ={"SGLANG_NPU_USE_MULTI_STREAM": "1"},
                                on_npu=True)
    state = decision.process_state
    assert isinstance(state, ds.DualStreamExpertsState)
    assert {t.qualname: t.wrapper for t in decision.targets} == {
        ds.DEEPEP: state.forward_deepep_wrapper, ds.PREPARE: state.forward_prepare_wrapper}
    assert state.details is decision.details and decision.details["counts"] is state.counts


# == forward_deepep: which calls take two streams, and what they compute ==========================

ASKED = []  # the forward modes whose predicates were asked, in order


class ForwardMode(enum.IntEnum):
    """sglang's ForwardMode: the members and the two predicates ``_dual_stream_modes`` asks."""
    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4
    TARGET_VERIFY = 5
    DRAFT_EXTEND = 6

    def is_extend(self):
        ASKED.append(self)
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND)

    def is_target_verify(self):
        return self is ForwardMode.TARGET_VERIFY


class ExpertLocationDispatchInfo:
    """What forward_deepep's module has under this name; the dual-stream body reads it from the
    globals of the method it stands in for (this module's ``forward_deepep``)."""

    @staticmethod
    def init_new(layer_id):
        return ("dispatch info", layer_id)


ORIGINAL_CALLS = []  # (hidden_states, forward_batch) of each call that reached the original method


def forward_deepep(self, hidden_states, forward_batch):
    """0.5.9's Glm4MoeSparseMoeBlock.forward_deepep (single stream), as the wrapper wraps it."""
    ORIGINAL_CALLS.append((hidden_states, forward_batch))
    shared_output = None
    if hidden_states.shape[0] > 0:
        router_logits = self.gate(hidden_states)
        shared_output = self._forward_shared_experts(hidden_states)
        topk_output = self.topk(
            hidden_states,
            router_logits,
            num_token_non_padded=forward_batch.num_token_non_padded,
            expert_location_dispatch_info=ExpertLocationDispatchInfo.init_new(layer_id=self.layer_id),
        )
    else:
        topk_output = self.topk.empty_topk_output(hidden_states.device)
    final_hidden_states = self.experts(hidden_states=hidden_states, topk_output=topk_output)
    if shared_output is not None:
        x = shared_output
        if self.experts.should_fuse_routed_scaling_factor_in_topk:
            x.add_(final_hidden_states)
        else:
            x.add_(final_hidden_states, alpha=self.routed_scaling_factor)
        final_hidden_states = x
    else:
        if not self.experts.should_fuse_routed_scaling_factor_in_topk:
            final_hidden_states *= self.routed_scaling_factor
    return final_hidden_states


def moe_block(sim, fuse=False, shared=True, layer_id=7, hidden=8):
    """A GLM-4.x MoE block (0.5.9's attribute names) whose parts note the stream they run on and
    what top-k was given.  ``shared=False``: its shared experts are fused into the routed ones
    (``num_fused_shared_experts``), so ``_forward_shared_experts`` returns None."""
    import torch

    torch.manual_seed(0)
    ran = []

    class TopK:
        def __init__(self):
            self.calls = []

        def __call__(self, hidden_states, router_logits, **kwargs):
            ran.append(("topk", sim.current_stream_name()))
            self.calls.append(kwargs)
            weights, ids = torch.softmax(router_logits, dim=-1).topk(2, dim=-1)
            return weights, ids

        def empty_topk_output(self, device):
            return (torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long))

    class Experts:
        should_fuse_routed_scaling_factor_in_topk = fuse

        def __init__(self):
            self.weight = torch.randn(4, hidden, hidden)

        def __call__(self, hidden_states, topk_output):
            ran.append(("experts", sim.current_stream_name()))
            weights, ids = topk_output
            out = torch.zeros_like(hidden_states)
            for slot in range(ids.shape[1]):
                out += weights[:, slot:slot + 1] * torch.einsum("th,thk->tk", hidden_states,
                                                                  self.weight[ids[:, slot]])
            return out

    class Block:
        def __init__(self):
            self.layer_id = layer_id
            self.routed_scaling_factor = 2.5
            self.num_fused_shared_experts = 0 if shared else 1
            self.gate_weight = torch.randn(hidden, 4)
            self.shared_weight = torch.randn(hidden, hidden)
            self.topk = TopK()
            self.experts = Experts()
            self.ran = ran

        def gate(self, hidden_states):
            ran.append(("gate", sim.current_stream_name()))
            return hidden_states @ self.gate_weight

        def _forward_shared_experts(self, hidden_states):  # 0.5.9's
            if hidden_states.shape[0] > 0 and self.num_fused_shared_experts == 0:
                ran.append(("shared", sim.current_stream_name()))
                return hidden_states @ self.shared_weight
            return None

    return Block()


def batch(mode, num_token_non_padded="non-padded count"):
    return types.SimpleNamespace(forward_mode=mode, num_token_non_padded=num_token_non_padded)


@pytest.fixture
def deepep(simnpu_clean):
    """(state, block, call): a fresh per-process state, a MoE block and ``call(*args, **kwargs)``,
    which calls the block's forward_deepep through the wrapper as wrapt does for sglang."""
    del ASKED[:], ORIGINAL_CALLS[:]
    state, block = ds.DualStreamExpertsState(), moe_block(simnpu_clean)

    def call(*args, **kwargs):
        return state.forward_deepep_wrapper(types.MethodType(forward_deepep, block), block, args, kwargs)

    yield state, block, call
    del ASKED[:], ORIGINAL_CALLS[:]


def hidden(tokens, width=8):
    import torch

    torch.manual_seed(tokens)
    return torch.randn(tokens, width)


def _as_called(style, hidden_states, fb):
    return {"positional": ((hidden_states, fb), {}),
            "keywords": ((), {"hidden_states": hidden_states, "forward_batch": fb}),
            "mixed": ((hidden_states,), {"forward_batch": fb})}[style]


@pytest.mark.parametrize("style", ["positional", "keywords", "mixed"])
@pytest.mark.parametrize("mode, tokens, two_streams", [
    (ForwardMode.EXTEND, 5, True),
    (ForwardMode.EXTEND, 1, True),           # one token is still a batch: only an empty one is not
    (ForwardMode.MIXED, 5, True),            # is_extend(): mixed and draft-extend too
    (ForwardMode.DRAFT_EXTEND, 5, True),
    (ForwardMode.TARGET_VERIFY, 5, True),
    (ForwardMode.DECODE, 5, False),          # decode stays single-stream (and in its graphs)
    (ForwardMode.IDLE, 0, False),
    (ForwardMode.EXTEND, 0, False),          # an empty extend batch: the original's empty path
])
def test_which_forward_deepep_calls_take_two_streams(deepep, simnpu_clean, style, mode, tokens, two_streams):
    """Extend-like and target-verify batches with tokens run shared experts on the side stream; the
    others reach the original method with the arguments exactly as sglang passed them."""
    state, block, call = deepep
    h, fb = hidden(tokens), batch(mode)
    args, kwargs = _as_called(style, h, fb)
    out = call(*args, **kwargs)
    assert out.shape == (tokens, 8)
    if two_streams:
        assert ORIGINAL_CALLS == []
        assert ("shared", "side-1") in block.ran and ("gate", "main") in block.ran
        assert state.counts["dual_stream_python_calls"] == 1
    else:
        assert ORIGINAL_CALLS == [(h, fb)] and ORIGINAL_CALLS[0][0] is h and ORIGINAL_CALLS[0][1] is fb
        assert simnpu_clean.events("stream_create") == [] and state.side_streams == {}
        assert state.counts["dual_stream_python_calls"] == 0
    assert state.counts["dual_stream_verify_python_calls"] == (1 if mode is ForwardMode.TARGET_VERIFY else 0)


def test_sglangs_positional_call_is_read_without_binding(deepep, monkeypatch):
    """sglang's forward calls ``forward_deepep(hidden_states, forward_batch)``: the wrapper reads the
    two by position (every MoE layer of every step pays the wrapper); only a call with keywords is
    bound by name."""
    state, block, call = deepep
    bound = []
    real = ds.bind_arguments
    monkeypatch.setattr(ds, "bind_arguments", lambda *a: bound.append(a) or real(*a))
    call(hidden(3), batch(ForwardMode.EXTEND))
    call(hidden(3), batch(ForwardMode.DECODE))
    assert bound == []
    h, fb = hidden(3), batch(ForwardMode.DECODE)
    call(h, forward_batch=fb)
    assert bound == [(ds.DEEPEP_PARAMS, (h,), {"forward_batch": fb})]


def test_modes_are_read_from_the_release_once(deepep):
    """The set of two-stream modes comes from the release's ForwardMode predicates at the first call;
    later calls (decode ones included) ask only whether their mode is in it."""
    state, block, call = deepep
    call(hidden(3), batch(ForwardMode.DECODE))
    assert sorted(ASKED) == sorted(ForwardMode)
    assert state.dual_stream_modes == {ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND,
                                       ForwardMode.TARGET_VERIFY}
    assert state.verify_mode is ForwardMode.TARGET_VERIFY
    for mode in (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        call(hidden(3), batch(mode))
    assert len(ASKED) == len(ForwardMode)


def test_verify_calls_are_counted_apart_from_prefills(deepep):
    """``dual_stream_verify_python_calls`` (speculative decoding's target-verify batches) counts
    only those; ``dual_stream_python_calls`` every two-stream call; decode neither."""
    state, block, call = deepep
    for mode in (ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY,
                 ForwardMode.MIXED, ForwardMode.TARGET_VERIFY):
        call(hidden(2), batch(mode))
    assert state.counts == {"dual_stream_python_calls": 5, "dual_stream_verify_python_calls": 3,
                            "fused_python_calls": 0}


@pytest.mark.parametrize("fuse", [False, True], ids=["scale-here", "scale-in-topk"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared-experts", "shared-fused"])
def test_two_stream_output_and_calls_equal_the_single_stream_method(deepep, simnpu_clean, fuse, shared):
    """The two-stream body computes what 0.5.9's method computes, bit for bit, with the routed
    scaling factor applied where the original applies it, and gives top-k the same arguments
    (non-padded count, the layer's expert-location dispatch info); shared experts run on the side
    stream after it waited for the main one, the rest on the main stream, which waits for the side
    stream before the combine."""
    import torch

    state, _, call = deepep
    h, fb = hidden(6), batch(ForwardMode.EXTEND)
    single = moe_block(simnpu_clean, fuse=fuse, shared=shared)
    expected = forward_deepep(single, h.clone(), fb)
    del ORIGINAL_CALLS[:]
    simnpu_clean.reset()
    block = moe_block(simnpu_clean, fuse=fuse, shared=shared)
    out = state.forward_deepep_wrapper(types.MethodType(forward_deepep, block), block, (h, fb), {})
    assert ORIGINAL_CALLS == []
    assert torch.equal(out, expected)
    assert block.topk.calls == single.topk.calls == [
        {"num_token_non_padded": "non-padded count", "expert_location_dispatch_info": ("dispatch info", 7)}]
    parts = [("gate", "main"), ("topk", "main"), ("experts", "main")]
    assert block.ran == ([("shared", "side-1")] if shared else []) + parts
    streams = [e for e in simnpu_clean.events() if e[0] in ("stream_create", "wait_stream", "stream_enter")]
    assert streams == [("stream_create", "side-1"), ("wait_stream", "side-1", "main"),
                       ("stream_enter", "side-1"), ("wait_stream", "main", "side-1")]


# == the side streams, made once under the lock =================================================

class _RacingLock:
    """The state's lock, as a thread finds it that waited while another thread made the side
    stream of the same main stream: that stream is there once the lock is taken."""

    def __init__(self, state, main, made):
        self.state, self.main, self.made, self.taken = state, main, made, 0

    def __enter__(self):
        self.taken += 1
        self.state.side_streams.setdefault(self.main, self.made)

    def __exit__(self, *exc):
        return False


def test_a_side_stream_made_by_another_thread_meanwhile_is_used(simnpu_clean):
    """Two threads running the first MoE layer on one main stream get one side stream: the one
    that took the lock second uses the first one's (two side streams would break the pool
    argument of ``side_stream_for``)."""
    import torch

    state = ds.DualStreamExpertsState()
    main, made = torch.npu.current_stream(), torch.npu.Stream()
    simnpu_clean.reset()
    state.lock = _RacingLock(state, main, made)
    assert state.side_stream_for(main) is made
    assert simnpu_clean.events("stream_create") == [] and state.side_streams == {main: made}


def test_the_lock_is_taken_only_to_make_a_side_stream(simnpu_clean):
    """Once a main stream has its side stream, a call takes no lock (every extend layer asks)."""
    import torch

    state = ds.DualStreamExpertsState()
    taken = []

    class CountingLock:
        def __init__(self):
            self.lock = threading.Lock()

        def __enter__(self):
            taken.append(True)
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)

    state.lock = CountingLock()
    main = torch.npu.current_stream()
    sides = {state.side_stream_for(main) for _ in range(3)}
    assert len(sides) == 1 and taken == [True]
    assert state.details["side_stream_count"] == 1


def test_a_state_records_into_the_details_it_is_given():
    """A decision hands the patch record's details to its state: the counts show there, live."""
    details = {"earlier": 1}
    state = ds.DualStreamExpertsState(details)
    assert state.details is details and details["counts"] is state.counts
    assert details["counts"] == {"dual_stream_python_calls": 0, "dual_stream_verify_python_calls": 0,
                                 "fused_python_calls": 0}
    assert state.kernel is None and state.kernel_error is None and state.layer_plans == {}
