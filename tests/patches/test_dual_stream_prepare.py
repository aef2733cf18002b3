"""dual_stream_experts' fused forward_prepare in this process, with stand-ins for the attention
layer, the kernel and the batch: when the wrapper calls through and when it takes the fused path,
the exact call the kernel gets, when cos/sin are recomputed, what the path returns and counts; and
the report (``check_facts``, ``KernelProblem``)."""
import types

import pytest

from npu_shim.patches import dual_stream_experts as ds


class Shaped:
    """A tensor stand-in: only its shape (and ndim) are read."""

    def __init__(self, name, *shape):
        self.name, self.shape, self.ndim = name, shape, len(shape)

    def __repr__(self):
        return self.name


class Norm:
    def __init__(self, eps, weight, bias=None):
        self.variance_epsilon, self.weight = eps, weight
        if bias is not None:
            self.bias = bias


class Rope:
    """A neox rotary embedding whose cos/sin are recomputed by get_cos_sin_with_position."""

    def __init__(self, rotary_dim=8, cos=None):
        self.rotary_dim, self.is_neox_style = rotary_dim, True
        self.position_cos, self.position_sin = cos, None
        self.computed = []

    def get_cos_sin_with_position(self, positions):
        self.computed.append(positions)
        n = positions.shape[0]
        self.position_cos, self.position_sin = Shaped("cos%d" % n, n, 8), Shaped("sin%d" % n, n, 8)


class Proj:
    def __init__(self, qkv):
        self.qkv, self.inputs = qkv, []

    def __call__(self, hidden_states):
        self.inputs.append(hidden_states)
        return self.qkv, "bias"


def attn(tokens=3, layer_id=1, rope=None, q_norm=None, k_norm=None, **kw):
    a = types.SimpleNamespace(
        qkv_proj=Proj(Shaped("qkv", tokens, 48)), rotary_emb=rope or Rope(),
        attn=types.SimpleNamespace(layer_id=layer_id), q_size=32, kv_size=8, head_dim=16,
        use_qk_norm=True, q_norm=q_norm or Norm(1e-5, "qw"), k_norm=k_norm or Norm(1e-5, "kw"))
    for key, value in kw.items():
        setattr(a, key, value)
    return a


class Mode:
    def __init__(self, extend):
        self.extend = extend

    def is_extend_or_draft_extend_or_mixed(self):
        return self.extend


def batch(extend=False, start_layer=0):
    return types.SimpleNamespace(forward_mode=Mode(extend),
                                 token_to_kv_pool=types.SimpleNamespace(start_layer=start_layer))


class Kernel:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "q", "k", "v"


class Original:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "original"


@pytest.fixture
def state():
    """A state whose kernel is loaded (a recorder, with partial-rotary support)."""
    s = ds.DualStreamExpertsState()
    s.kernel, s.kernel_partial = Kernel(), True
    return s


# -- _forward_prepare_fused --------------------------------------------------------------------------

def test_fused_call_passes_the_layer_s_sizes_norms_and_the_rope_s_cos_sin(state):
    layer = attn(layer_id=0, q_norm=Norm(1e-6, "qw", "qb"), k_norm=Norm(1e-5, "kw", "kb"))
    positions, hidden, fb = Shaped("positions", 3), Shaped("hidden", 3, 64), batch()
    kernel = Kernel()
    result = state._forward_prepare_fused(layer, kernel, positions, hidden, fb)
    assert result == (None, fb, ("q", "k", "v", fb))
    assert result[1] is fb and result[2][3] is fb
    assert layer.qkv_proj.inputs == [hidden]
    rope = layer.rotary_emb
    assert rope.computed == [positions]
    assert kernel.calls == [((layer.qkv_proj.qkv, rope.position_sin, rope.position_cos, 32, 8, 16),
                             {"eps": 1e-6, "q_weight": "qw", "k_weight": "kw", "q_bias": "qb", "k_bias": "kb"})]
    assert kernel.calls[0][0][0] is layer.qkv_proj.qkv
    assert state.counts == {"dual_stream_python_calls": 0, "dual_stream_verify_python_calls": 0,
                            "fused_python_calls": 1}
    assert state.kernel.calls == []  # the kernel passed in is the one called


def test_norms_without_bias_pass_none(state):
    kernel = Kernel()
    state._forward_prepare_fused(attn(), kernel, Shaped("p", 3), Shaped("h", 3, 64), batch())
    assert kernel.calls[0][1]["q_bias"] is None and kernel.calls[0][1]["k_bias"] is None


@pytest.mark.parametrize("layer_id, start_layer, cos_rows, recomputed", [
    (0, 0, 3, True),      # the first layer of the step: always
    (5, 5, 3, True),      # the first layer of a pipeline stage
    (1, 0, None, True),   # no cos/sin yet
    (1, 0, 7, True),      # cos/sin of another batch size
    (1, 0, 3, False),     # a later layer of the step: the first layer's
])
def test_cos_sin_once_per_step(state, layer_id, start_layer, cos_rows, recomputed):
    cos = None if cos_rows is None else Shaped("old cos", cos_rows, 8)
    rope = Rope(cos=cos)
    rope.position_sin = Shaped("old sin", cos_rows or 0, 8)
    old = rope.position_sin, rope.position_cos
    layer, positions, kernel = attn(layer_id=layer_id, rope=rope), Shaped("positions", 3), Kernel()
    state._forward_prepare_fused(layer, kernel, positions, Shaped("h", 3, 64), batch(start_layer=start_layer))
    assert rope.computed == ([positions] if recomputed else [])
    sin, cos = kernel.calls[0][0][1:3]
    if recomputed:
        assert (sin.name, cos.name) == ("sin3", "cos3")
    else:
        assert (sin, cos) == old


def test_each_fused_call_counts_once(state):
    layer, kernel = attn(), Kernel()
    for _ in range(3):
        state._forward_prepare_fused(layer, kernel, Shaped("p", 3), Shaped("h", 3, 64), batch())
    assert state.counts["fused_python_calls"] == 3 and len(kernel.calls) == 3
    assert state.details["counts"] is state.counts


# -- forward_prepare_wrapper -------------------------------------------------------------------------

@pytest.mark.parametrize("call", ["positional", "keywords", "mixed"])
def test_wrapper_takes_the_fused_path_outside_extend(state, call):
    layer, original = attn(), Original()
    positions, hidden, fb = Shaped("positions", 3), Shaped("hidden", 3, 64), batch()
    args, kwargs = {"positional": ((positions, hidden, fb), {}),
                    "keywords": ((), {"positions": positions, "hidden_states": hidden, "forward_batch": fb}),
                    "mixed": ((positions,), {"forward_batch": fb, "hidden_states": hidden})}[call]
    result = state.forward_prepare_wrapper(original, layer, args, kwargs)
    assert result == (None, fb, ("q", "k", "v", fb))
    assert original.calls == []
    assert layer.qkv_proj.inputs == [hidden] and layer.rotary_emb.computed == [positions]
    assert state.kernel.calls[0][0][0] is layer.qkv_proj.qkv
    assert state.counts["fused_python_calls"] == 1
    assert state.layer_plans == {ds._layer_key(layer): None} and "fused_fallback" not in state.details


def _calls_through(state, layer, args, kwargs):
    original = Original()
    assert state.forward_prepare_wrapper(original, layer, args, kwargs) == "original"
    assert original.calls == [(args, kwargs)]
    assert state.kernel.calls == [] and state.counts["fused_python_calls"] == 0
    assert layer.qkv_proj.inputs == []


def test_wrapper_calls_through_in_extend(state):
    layer = attn()
    _calls_through(state, layer, (Shaped("p", 3),), {"hidden_states": Shaped("h", 3, 64),
                                                      "forward_batch": batch(extend=True)})
    assert state.layer_plans == {}  # no plan made for a call that never could be fused


def test_wrapper_calls_through_for_an_empty_batch(state):
    layer = attn()
    fb = types.SimpleNamespace(forward_mode=None)  # not even asked for its mode
    _calls_through(state, layer, (Shaped("p", 0), Shaped("h", 0, 64), fb), {})
    assert state.layer_plans == {}


def test_wrapper_calls_through_where_the_layer_keeps_the_original_path(state):
    layer = attn(use_qk_norm=False)
    _calls_through(state, layer, (Shaped("p", 3), Shaped("h", 3, 64), batch()), {})
    assert state.details["fused_fallback"] == "layer has no q/k RMSNorm (the kernel always normalises)"
    _calls_through(state, attn(), (Shaped("p", 3, 2), Shaped("h", 3, 64)), {"forward_batch": batch()})


def test_wrapper_calls_through_without_a_kernel(monkeypatch):
    state = ds.DualStreamExpertsState()
    monkeypatch.setattr(ds, "load_kernel", lambda: (None, None, "no kernel here"))
    state.kernel = None
    original, layer = Original(), attn()
    args = (Shaped("p", 3), Shaped("h", 3, 64), batch())
    assert state.forward_prepare_wrapper(original, layer, args, {}) == "original"
    assert original.calls == [(args, {})] and state.details["fused_fallback"] == "no kernel here"


# -- the report ----------------------------------------------------------------------------------------

def test_check_facts_of_a_usable_kernel(monkeypatch):
    monkeypatch.setattr(ds, "kernel_problem", lambda: None)
    assert ds.DualStreamExpertsReport().check_facts() == {
        "kernel": {"label": "sgl_kernel_npu", "ok": True, "text": "split_qkv_rmsnorm_rope usable"}}


@pytest.mark.parametrize("absent", [True, False])
def test_check_facts_of_an_unusable_kernel(monkeypatch, absent):
    monkeypatch.setattr(ds, "kernel_problem", lambda: ds.KernelProblem("why not", absent=absent))
    assert ds.DualStreamExpertsReport().check_facts() == {
        "kernel": {"label": "sgl_kernel_npu", "ok": False, "text": "why not"}}


def test_kernel_problem_text_and_repr():
    problem = ds.KernelProblem("it's old")
    assert (str(problem), problem.absent) == ("it's old", False)
    assert repr(problem) == "KernelProblem(\"it's old\", absent=False)"
    assert repr(ds._absent("gone")) == "KernelProblem('gone', absent=True)"
