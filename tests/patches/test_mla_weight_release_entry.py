"""mla_weight_release's entry (``MlaWeightReleaseState.npu_mla_preprocess_for``): what replaces
sglang's ``npu_mla_preprocess``, each one built inside its test as a decision builds it (a wrapper
built at import time would be the one the module was imported with, whatever a test changes after).

What sglang relies on: every call reaches its own function with the layer's arguments as given
(the first call of a layer, and every later one on the hot path), its result comes back
unchanged, the layer's ``w_kc`` goes on the first call that built ``m.mla_preprocess`` (decode),
and the function looks like sglang's (name, module, ``__wrapped__``) for pickling and copies."""
import types

import pytest
import torch

from npu_shim.patches import mla_weight_release as R

ARGS = ("m", "hidden_states", "positions", "forward_batch", "zero_allocator")


class Preprocess:
    """The parts of NPUFusedMLAPreprocess free_w_kc reads: the fused qkv_a projection, the
    quantisation config and its own contiguous copy of w_kc."""

    def __init__(self, m):
        self.qkv_a_proj = types.SimpleNamespace(weight=torch.randn(24, 32),
                                                quant_method=types.SimpleNamespace())
        self.quant_config = m.quant_config
        self.w_kc = m.w_kc.contiguous()
        self.layer_id = m.layer_id


def sglang_function(calls):
    """sglang's npu_mla_preprocess as far as the entry sees it: builds ``m.mla_preprocess`` on a
    layer's first call, records each call's arguments in ``calls`` and answers with something of
    its own."""
    def npu_mla_preprocess(m, hidden_states, positions, forward_batch, zero_allocator):
        calls.append((m, hidden_states, positions, forward_batch, zero_allocator))
        if not hasattr(m, "mla_preprocess"):
            m.mla_preprocess = Preprocess(m)
        return ("sglang's answer", len(calls))

    return npu_mla_preprocess


def attention(layer_id):
    m = torch.nn.Module()
    m.layer_id = layer_id
    m.w_kc = torch.randn(4, 8, 12).transpose(1, 2).contiguous().transpose(1, 2)  # as sglang lays it out
    m.quant_config = types.SimpleNamespace(ignore=["model.layers.%d.self_attn.kv_b_proj" % layer_id])
    return m


@pytest.fixture
def decode(monkeypatch):
    """A fresh state in a decode process whose server can neither reload nor adapt weights."""
    state = R.MlaWeightReleaseState()
    monkeypatch.setattr(state, "disagg_role", lambda: ("decode", None))
    monkeypatch.setattr(R, "server_args", lambda: types.SimpleNamespace())
    monkeypatch.delenv("NPU_SHIM_MLA_RELEASE_FORCE", raising=False)
    return state


def inputs():
    """Distinct objects for every argument but m, so that each is seen to arrive where it belongs."""
    return (torch.ones(2, 32), object(), object(), object())


def test_entry_looks_like_sglangs_function_and_leads_back_to_it(decode):
    """Pickling and copies go by the module and name (sglang's), and ``__wrapped__`` is the way
    back to sglang's own function."""
    original = sglang_function([])
    entry = decode.npu_mla_preprocess_for(original)
    assert callable(entry) and entry.__wrapped__ is original
    assert (entry.__name__, entry.__qualname__, entry.__module__) == (
        original.__name__, original.__qualname__, original.__module__)


def test_first_call_hands_sglang_the_layers_arguments_and_releases_w_kc(decode):
    calls = []
    entry = decode.npu_mla_preprocess_for(sglang_function(calls))
    m = attention(0)
    w_kc = m.w_kc
    args = inputs()
    assert entry(m, *args) == ("sglang's answer", 1)
    assert len(calls) == 1 and all(a is b for a, b in zip(calls[0], (m,) + args))
    assert R.is_released(w_kc) and decode.guarded["w_kc"] == {0}  # released on the call that built it
    assert decode.released_bytes == {"qkv_a": 0, "w_kc": 4 * 8 * 12 * 4} and R._FIRST in m.__dict__
    # and the status says so (npu_shim.states())
    assert (decode.details["w_kc_bytes"], decode.details["qkv_a_bytes"], decode.details["layers"]) == (
        4 * 8 * 12 * 4, 0, 1)


def test_first_call_takes_every_argument_as_a_keyword(decode):
    calls = []
    entry = decode.npu_mla_preprocess_for(sglang_function(calls))
    m = attention(0)
    args = inputs()
    assert entry(**dict(zip(ARGS, (m,) + args))) == ("sglang's answer", 1)
    assert all(a is b for a, b in zip(calls[0], (m,) + args)) and R.is_released(m.w_kc)


@pytest.mark.parametrize("keywords", [False, True])
def test_every_later_call_hands_sglang_the_arguments_unchanged(decode, keywords):
    """Once the first pass is done, a layer's calls take the hot path: straight to sglang's
    function, each argument where sglang's signature has it, its answer returned as is."""
    calls = []
    entry = decode.npu_mla_preprocess_for(sglang_function(calls))
    layers = [attention(0), attention(1)]
    for m in layers + layers[:1]:  # the first pass, closed by layer 0 coming round again
        entry(m, *inputs())
    assert all(R._DONE in m.__dict__ for m in layers) and decode.summary_logged
    for n, m in enumerate(layers, start=4):
        args = inputs()
        answer = entry(**dict(zip(ARGS, (m,) + args))) if keywords else entry(m, *args)
        assert answer == ("sglang's answer", n)
        assert len(calls[-1]) == 5 and all(a is b for a, b in zip(calls[-1], (m,) + args))


def test_a_layer_first_seen_takes_the_first_call_path_not_the_hot_path(decode, monkeypatch):
    """A layer without the done marker is decided on (the release), one with it is only
    delegated: the marker, not the order of calls, picks the path."""
    calls = []
    entry = decode.npu_mla_preprocess_for(sglang_function(calls))
    decided = []
    monkeypatch.setattr(decode, "free_w_kc", lambda m: decided.append(m))
    fresh, seen = attention(0), attention(1)
    seen.__dict__[R._DONE] = True
    entry(seen, *inputs())
    assert decided == [] and calls[-1][0] is seen
    entry(fresh, *inputs())
    assert decided == [fresh]
