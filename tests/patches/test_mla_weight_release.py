"""mla_weight_release, unit level: decisions from every release's source, the guard, the predicate,
the role / weight-update gates and the wrappers' first-call / hot-path logic (CPU torch, fakes where
sglang would be; the real-release behaviour is in test_mla_weight_release_real.py)."""
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import types

import pytest
import torch
import wrapt

from npu_shim.core import framework
from npu_shim.source.codeview import SourceView
from npu_shim.patches import mla_weight_release as R
from npu_shim.runtime import tensor_release
from shimdev.envs import sglang_envs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# The wrappers' per-process state, as a decision builds it for 0.5.10 - 0.5.16 (each test afresh).
REL = R.MlaWeightReleaseState("quantization_config", "server_args")


@pytest.fixture(autouse=True)
def fresh_state():
    """A fresh state and a fresh entry built on it, in the test, as a decision builds them (an entry
    built at import time would keep the code it was built with)."""
    global WRAPPED
    REL.__init__("quantization_config", "server_args")
    WRAPPED = REL.npu_mla_preprocess_for(npu_mla_preprocess)
    yield
    REL.__init__("quantization_config", "server_args")


@pytest.fixture
def logs():
    records = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Capture()
    logger = logging.getLogger("npu_shim")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old)


def view_of(version):
    return SourceView(os.path.join(str(sglang_envs.ensure_sources(version)), "sglang"))


# --------------------------------------------------------------------------- decisions per release

def test_states_across_every_release():
    states = {}
    for version in sglang_envs.RELEASES:
        decision = framework.decide(R.PATCH, view_of(version), environ={}, on_npu=True)
        states[version] = decision.state
        if decision.state == framework.APPLIED:
            attr = "quant_config" if version == "0.5.9" else "quantization_config"
            release = decision.process_state  # what the code said reaches the wrappers, not a global
            assert release.w8a8_attr == attr, version
            newer = sglang_envs.RELEASES.index(version) >= sglang_envs.RELEASES.index("0.5.17")
            assert release.role_source == ("get_disagg" if newer else "server_args"), version
            assert all(getattr(t, "wrapper", None) is None or t.wrapper.__self__ is release
                       for t in decision.targets) and release.details is decision.details
            assert view_of(version).function(R.MLA_NPU, "npu_mla_preprocess").params == R.PREPROCESS_SIG
            assert sorted(t.describe().split(":")[1] for t in decision.targets
                          if t.module != R.TP_WORKER) == [
                "NPUFusedMLAPreprocess.mlaprolog_preprocess_weight",
                "NPUFusedMLAPreprocess.uses_mlaprolog", "npu_mla_preprocess"]
            assert sorted(t.qualname for t in decision.targets if t.module == R.TP_WORKER) == sorted(
                "BaseTpWorker." + op for op in R.UPDATE_OPS), version
        elif decision.state == framework.INACTIVE:  # nothing to do: not "should apply but cannot"
            assert "no mlaprolog path" in decision.reason and "0.5.9" in decision.reason
        else:
            assert "uses_mlaprolog exists" in decision.reason
    assert [v for v, s in states.items() if s == "inactive"] == ["0.5.7", "0.5.8"]
    applied = [v for v, s in states.items() if s == "applied"]
    assert applied[0] == "0.5.9" and applied[-1] == "0.5.19" and len(applied) == 11
    assert [v for v, s in states.items() if s == "upstream"] == ["0.5.20", "0.5.21", "0.5.22", "0.5.23"]


def test_weight_update_targets_pin_the_worker_and_the_scheduler_side_of_every_release():
    """Each 0.5.9 - 0.5.19 release's BaseTpWorker.<op> (wrapped) and the scheduler
    method that answers the request with its (success, message) are code the shim has read."""
    for version in sglang_envs.ALL_RELEASES:
        key = sglang_envs.version_key(version)
        if not sglang_envs.version_key("0.5.9") <= key <= sglang_envs.version_key("0.5.19"):
            continue
        view = view_of(version)
        decision = framework.decide(R.PATCH, view, environ={}, on_npu=True)
        assert decision.state == framework.APPLIED, (version, decision.reason)
        caller = R.SCHEDULER_MIXIN if key < sglang_envs.version_key("0.5.13") else R.SCHEDULER_UPDATER
        updates = {t.qualname.split(".")[1]: t for t in decision.targets if t.module == R.TP_WORKER}
        assert set(updates) == set(R.UPDATE_OPS), version
        for op, target in updates.items():
            assert target.signatures == (("recv_req",),) and target.wrapper == decision.process_state.wrap_weight_update
            assert set(target.pins) == {(R.TP_WORKER, "BaseTpWorker." + op), (caller[0], caller[1] + "." + op)}
            assert target.check_source(view) is None, (version, op)
            assert view.function(caller[0], caller[1] + "." + op).fingerprint in R.PINNED[
                (caller[0], caller[1] + "." + op)]


def decide_edited(tmp_path, version, relpath, old, new):
    """The patch decided on a copy of the release's source with ``old`` replaced by ``new`` once
    in ``srt/<relpath>``."""
    src = os.path.join(str(sglang_envs.ensure_sources(version)), "sglang")
    dest = tmp_path / "sglang"
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("*.so", "*.pyc"))
    path = dest / "srt" / relpath
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    return framework.decide(R.PATCH, SourceView(str(dest)), environ={}, on_npu=True)


@pytest.mark.parametrize("version,edit", [
    # the worker no longer returns the runner's (success, message)
    ("0.5.11", ("managers/tp_worker.py", "            recapture_cuda_graph=recv_req.recapture_cuda_graph,\n"
                "        )\n        return success, message",
                "            recapture_cuda_graph=recv_req.recapture_cuda_graph,\n"
                "        )\n        return success")),
    # the scheduler side answers a failed update differently (0.5.9 - 0.5.12: the mixin)
    ("0.5.11", ("managers/scheduler_update_weights_mixin.py",
                "        if not success:\n            logger.error(message)\n"
                "        return UpdateWeightFromDiskReqOutput",
                "        if not success:\n            raise RuntimeError(message)\n"
                "        return UpdateWeightFromDiskReqOutput")),
    # 0.5.13 - 0.5.19: the scheduler's weight_updater component
    ("0.5.19", ("managers/scheduler_components/weight_updater.py",
                "            success, message = worker.update_weights_from_tensor(recv_req)\n",
                "            success, message = worker.update_weights_from_tensor(recv_req)\n"
                "            assert success, message\n")),
])
def test_changed_weight_update_code_is_unsupported(tmp_path, version, edit):
    decision = decide_edited(tmp_path, version, *edit)
    assert decision.state == framework.UNSUPPORTED
    assert "fingerprint" in decision.reason and edit[0].split("/")[-1][:-3] in decision.reason


def test_no_scheduler_update_method_releases_nothing(tmp_path):
    decision = decide_edited(tmp_path, "0.5.19", "managers/scheduler_components/weight_updater.py",
                             "def update_weights_from_disk(", "def load_from_disk(")
    assert decision.state == framework.UNSUPPORTED and decision.targets == []
    assert "update_weights_from_disk was not found" in decision.reason


def test_switch_and_bad_force_value():
    view = view_of("0.5.11")
    off = framework.decide(R.PATCH, view, environ={"NPU_SHIM_MLA_WEIGHT_RELEASE": "0"}, on_npu=True)
    assert off.state == framework.DISABLED and off.targets == []
    bad = framework.decide(R.PATCH, view, environ={"NPU_SHIM_MLA_RELEASE_FORCE": "maybe"}, on_npu=True)
    assert bad.state == framework.FAILED and "NPU_SHIM_MLA_RELEASE_FORCE" in bad.reason
    assert framework.decide(R.PATCH, view, environ={}, on_npu=False).state == framework.INACTIVE
    # The shim's own variable stays the shim's to judge where upstream has the release (only
    # upstream's variables are upstream's to read)
    upstream = framework.decide(R.PATCH, view_of("0.5.20"), environ={"NPU_SHIM_MLA_RELEASE_FORCE": "maybe"},
                                on_npu=True)
    assert upstream.state == framework.FAILED and upstream.reason.startswith("NPU_SHIM_MLA_RELEASE_FORCE='maybe'")


@pytest.mark.parametrize("edit", [
    # forward() routing changed (e.g. a vendor patch that reorders the branches)
    ("attention/mla_preprocess.py", "if _is_w8a8:", "if _is_w8a8 and False:"),
    # the preprocess weight step now keeps a view instead of a clone
    ("attention/mla_preprocess.py",
     "qkv_a_proj_weight_q = self.qkv_a_proj.weight.data[:, : self.q_lora_rank].clone()",
     "qkv_a_proj_weight_q = self.qkv_a_proj.weight.data[:, : self.q_lora_rank]"),
    # forward_mlaprolog reads the fused weight
    ("attention/mla_preprocess.py", '"weight_dq": self.q_a_proj_weight,',
     '"weight_dq": self.qkv_a_proj.weight,'),
    ("modules/deepseek_v2_attention_mla_npu.py", "dynamic_scale = None\n    if not hasattr",
     "dynamic_scale = 0\n    if not hasattr"),
])
def test_unknown_code_shape_is_unsupported(tmp_path, edit):
    decision = decide_edited(tmp_path, "0.5.11", "hardware_backend/npu/" + edit[0], edit[1], edit[2])
    assert decision.state == framework.UNSUPPORTED
    assert "fingerprint" in decision.reason and edit[0].split("/")[-1][:-3] in decision.reason


def test_fingerprints_ignore_comments_and_formatting(tmp_path):
    src = os.path.join(str(sglang_envs.ensure_sources("0.5.19")), "sglang")
    dest = tmp_path / "sglang"
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("*.so", "*.pyc"))
    path = dest / "srt" / "hardware_backend" / "npu" / "attention" / "mla_preprocess.py"
    text = path.read_text().replace("        _is_w8a8 = (\n", "        # a comment\n        _is_w8a8 = (  \n")
    path.write_text(text)
    assert framework.decide(R.PATCH, SourceView(str(dest)), environ={}, on_npu=True).state == "applied"


# --------------------------------------------------------------------------- the guard

class SglangLikeParameter(torch.nn.Parameter):
    """Like sglang's ModelWeightParameter: a Parameter subclass with a weight_loader."""

    def __new__(cls, data, weight_loader=None):
        param = super().__new__(cls, data, requires_grad=False)
        param._weight_loader = weight_loader
        return param


@pytest.mark.parametrize("make", [
    lambda: torch.nn.Parameter(torch.randn(32, 16, dtype=torch.bfloat16), requires_grad=False),
    lambda: torch.randn(4, 16, 8).transpose(1, 2).contiguous().transpose(1, 2),
    lambda: SglangLikeParameter(torch.randn(8, 8), weight_loader="loader"),
])
def test_release_frees_the_storage_and_guards_every_reference(make):
    tensor = make()
    cls = type(tensor)
    alias = tensor  # another holder of the same object (e.g. a module attribute)
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    assert R.free_weight(tensor, "w_kc of layer 7", REL.once) == nbytes > 0
    assert storage.nbytes() == 0
    assert isinstance(alias, cls) and R.is_released(alias)
    for touch in (lambda: alias.sum(), lambda: alias + 1, lambda: alias.shape, lambda: alias.data,
                  lambda: torch.nn.functional.linear(torch.ones(1, 8), alias), lambda: alias.copy_(alias),
                  lambda: torch.ops.aten.add(alias, 1), lambda: alias.untyped_storage(),
                  lambda: alias.to(torch.float16), lambda: alias[0],
                  lambda: torch.where(torch.tensor(True), 1.0, alias)):  # a float before it
        with pytest.raises(R.ReleasedWeightError) as info:
            touch()
        assert "w_kc of layer 7" in str(info.value)
        assert "NPU_SHIM_MLA_WEIGHT_RELEASE=0" in str(info.value)
    with pytest.raises(R.ReleasedWeightError, match="`sum` touched it"):
        alias.sum()
    assert "released by npu-shim: w_kc of layer 7" in repr(alias) == str(alias)
    assert R.free_weight(alias, "again", REL.once) == 0  # idempotent
    if isinstance(tensor, SglangLikeParameter):
        assert tensor._weight_loader == "loader"  # attributes survive


def test_released_parameter_in_a_module_fails_state_dict_and_loading_clearly():
    linear = torch.nn.Linear(8, 4, bias=False)
    R.free_weight(linear.weight, "qkv_a_proj.weight of layer 3", REL.once)
    assert [name for name, _ in linear.named_parameters()] == ["weight"]
    with pytest.raises(R.ReleasedWeightError, match="qkv_a_proj.weight of layer 3"):
        linear(torch.ones(2, 8))
    with pytest.raises(R.ReleasedWeightError):
        linear.state_dict()
    with pytest.raises(R.ReleasedWeightError):
        linear.weight.data.copy_(torch.ones(4, 8))  # what a weight loader does


def _run(code):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
                          timeout=120)


def test_touching_a_released_weight_exits_with_an_exception_not_a_signal():
    shim = _run("""
        import torch
        from npu_shim.patches import mla_weight_release as R
        t = torch.randn(64, 64)
        R.free_weight(t, "w_kc of layer 5")
        print("released", flush=True)
        t.sum()
    """)
    assert shim.returncode == 1, shim.stderr
    assert "released" in shim.stdout
    last = shim.stderr.strip().splitlines()[-1]
    assert last.startswith("npu_shim.patches.mla_weight_release.ReleasedWeightError")
    assert "w_kc of layer 5" in last and "NPU_SHIM_MLA_WEIGHT_RELEASE=0" in last
    # What upstream leaves behind (storage resized to 0, shape kept) kills the process instead.
    upstream = _run("""
        import torch
        t = torch.randn(64, 64)
        t.untyped_storage().resize_(0)
        print(float(t.sum()))
    """)
    assert upstream.returncode < 0, (upstream.returncode, upstream.stderr[-500:])


ALIAS = """
import json, torch
from npu_shim.patches import mla_weight_release as R
qkv = torch.nn.Parameter(torch.randn(24, 32), requires_grad=False)          # as the fused qkv_a
w_kc = torch.randn(4, 8, 12).transpose(1, 2).contiguous().transpose(1, 2)  # as sglang lays out w_kc
weight = {weight}
alias = {alias}
freed = R.free_weight(weight, "w_kc of layer 3")
print("released", freed, flush=True)
with torch._C.DisableTorchFunctionSubclass():  # what C++ / subclass-blind code sees
    base = weight._base
    seen = {{"numel": weight.numel(), "base": None if base is None else base.numel()}}
print(json.dumps({{"freed": freed, "released": R.is_released(weight), "seen": seen,
                  "alias_sum": None if alias is None else float(
                      sum(alias.tolist()) if isinstance(alias, torch.UntypedStorage) else alias.sum())}}),
      flush=True)
"""


@pytest.mark.parametrize("weight,alias", [
    ("qkv", "weight.detach()"),
    ("qkv", "weight.view(-1)"),
    ("qkv", "weight.data"),
    ("qkv", "weight.t()"),
    ("w_kc", "weight.detach()"),
    ("w_kc", "weight.transpose(1, 2)"),
    ("w_kc", "weight._base"),                # the base of sglang's w_kc layout, held elsewhere
    ("w_kc", "weight._base.view(-1)"),
    ("w_kc", "weight.untyped_storage()"),    # a storage object: sees 0 bytes, never freed memory
    ("w_kc", "None"),
])
def test_alias_taken_before_the_release_never_reads_freed_memory(weight, alias):
    """The weight is freed only when it (and its own _base chain) is the storage's sole holder;
    otherwise it is kept whole.  Run in a subprocess: a wrong free here is a segfault."""
    run = _run(ALIAS.format(weight=weight, alias=alias))
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])  # < 0 would be a signal
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if alias in ("None", "weight.untyped_storage()"):
        assert out["freed"] > 0 and out["released"]
        assert out["seen"] == {"numel": 0, "base": None}  # the _base chain is dropped as well
        if alias != "None":
            assert out["alias_sum"] == 0.0  # an empty storage, not freed memory
    else:
        assert out["freed"] == 0 and not out["released"]  # kept: something else reads that memory
        assert out["seen"]["numel"] > 0
        assert "keeping w_kc of layer 3: its memory has 1 other holder (" in run.stderr


def test_keeping_an_aliased_weight_warns_once_with_the_holder_count(logs):
    weight = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)
    views = [weight.view(-1), weight.t(), weight.detach()]
    for _ in range(2):
        assert R.free_weight(weight, "qkv_a_proj.weight of layer 1", REL.once) == 0
    warnings = [line for line in logs if "other holder" in line]
    assert len(warnings) == 1 and "has 3 other holders" in warnings[0]
    assert float(sum(v.sum() for v in views)) == pytest.approx(3 * float(weight.sum()), rel=1e-4)
    del views
    assert R.free_weight(weight, "qkv_a_proj.weight of layer 1", REL.once) == 8 * 8 * 4


# --------------------------------------------------------------------------- predicate

def fake_preprocess(ignore=("model.layers.0.self_attn.kv_b_proj",), w8a8_attr=None, has_ignore=True):
    quant_method = types.SimpleNamespace()
    if w8a8_attr:
        setattr(quant_method, w8a8_attr, types.SimpleNamespace(get_name=lambda: "modelslim"))
    quant_config = types.SimpleNamespace(ignore=list(ignore)) if has_ignore else types.SimpleNamespace()
    return types.SimpleNamespace(qkv_a_proj=types.SimpleNamespace(quant_method=quant_method),
                                 quant_config=quant_config)


@pytest.mark.parametrize("attr", ["quant_config", "quantization_config"])
def test_predicate_is_forwards_routing(attr):
    other = "quantization_config" if attr == "quant_config" else "quant_config"
    assert R.uses_mlaprolog(fake_preprocess(), attr) is True
    assert R.uses_mlaprolog(fake_preprocess(ignore=("kv_b_proj",)), attr) is True  # fullmatch of .*kv_b_proj
    assert R.uses_mlaprolog(fake_preprocess(ignore=("model.layers.0.self_attn.kv_b_proj.weight",)), attr) is False
    assert R.uses_mlaprolog(fake_preprocess(ignore=("model.layers.0.mlp.gate",)), attr) is False
    assert R.uses_mlaprolog(fake_preprocess(has_ignore=False), attr) is False
    assert R.uses_mlaprolog(fake_preprocess(w8a8_attr=attr), attr) is False  # forward_mlapo wins
    assert R.uses_mlaprolog(fake_preprocess(w8a8_attr=other), attr) is True


# --------------------------------------------------------------------------- role and gates

@pytest.fixture
def server(monkeypatch):
    """Drive the role and the server args the gates read."""
    state = {"role": "decode", "args": types.SimpleNamespace(), "role_error": None}

    def role():
        if state["role_error"]:
            return None, state["role_error"]
        return state["role"], None

    def args():
        if isinstance(state["args"], Exception):
            raise state["args"]
        return state["args"]

    monkeypatch.setattr(REL, "disagg_role", role)
    monkeypatch.setattr(R, "server_args", args)
    monkeypatch.delenv("NPU_SHIM_MLA_RELEASE_FORCE", raising=False)
    return state


def test_role_gates(server):
    for role, qkv, wkc in (("null", False, False), ("prefill", True, False), ("decode", True, True)):
        server["role"] = role
        assert (REL.free_allowed("qkv_a")[1] is None) is qkv, role
        assert (REL.free_allowed("w_kc")[1] is None) is wkc, role


def test_unknown_role_warns_once(server, logs):
    server["role_error"] = "ValueError('config namespace disagg not published')"
    for _ in range(3):
        assert REL.free_allowed("qkv_a") == (None, server["role_error"])
    warnings = [line for line in logs if "role is unknown" in line]
    assert len(warnings) == 1 and "not published" in warnings[0]


@pytest.mark.parametrize("field,value,word", [
    ("enable_lora", True, "LoRA"), ("lora_paths", ["a=/x"], "LoRA"),
    ("enable_memory_saver", True, "enable_memory_saver"),
    ("enable_weights_cpu_backup", True, "enable_weights_cpu_backup"),
    ("load_format", "dummy", "load_format=dummy"),
    ("checkpoint_engine_wait_weights_before_ready", True, "checkpoint engine"),
    ("custom_weight_loader", ["pkg.loader"], "custom_weight_loader"),
    ("remote_instance_weight_loader_start_seed_via_transfer_engine", True, "seeds"),
])
def test_weight_updates_block_unless_forced(server, logs, monkeypatch, field, value, word):
    setattr(server["args"], field, value)
    assert REL.free_allowed("w_kc")[1] == "weight updates"
    assert any(word in line and "NPU_SHIM_MLA_RELEASE_FORCE=1" in line for line in logs)
    monkeypatch.setenv("NPU_SHIM_MLA_RELEASE_FORCE", "1")
    assert REL.free_allowed("w_kc") == ("decode", None)
    assert any("releasing although" in line for line in logs)


def test_speculative_decoding_blocks_even_forced(server, logs, monkeypatch):
    server["args"].speculative_algorithm = "EAGLE"
    monkeypatch.setenv("NPU_SHIM_MLA_RELEASE_FORCE", "1")
    assert REL.free_allowed("qkv_a")[1] == "other readers"
    assert any("speculative decoding (EAGLE)" in line for line in logs)


def test_unreadable_server_args_release_nothing(server, logs):
    server["args"] = ValueError("Global server args is not set yet!")
    assert REL.free_allowed("qkv_a")[1] == "server args unknown"
    assert any("server args cannot be read" in line for line in logs)


def test_every_other_reader_is_named_in_the_warning_and_the_status(server, logs, monkeypatch):
    monkeypatch.setattr(R, "other_reader_reasons", lambda args: ["speculative decoding (EAGLE)", "a draft model"])
    for _ in range(2):
        assert REL.free_allowed("qkv_a") == ("decode", "other readers")
    assert logs == ["mla_weight_release: releasing nothing: speculative decoding (EAGLE); a draft model"]
    assert REL.details == {"role": "decode", "skipped": "speculative decoding (EAGLE); a draft model"}


def test_a_role_frees_only_the_weights_upstream_frees_in_it(server):
    """The kinds are the two weights; anything else is a programming error, not a 'no'."""
    server["role"] = "prefill"
    assert REL.free_allowed("qkv_a") == ("prefill", None)
    assert REL.free_allowed("w_kc") == ("prefill", "role prefill")
    with pytest.raises(KeyError):
        REL.free_allowed("kv_b")


# --------------------------------------------------------------------------- the wrappers

class FakePreprocess:
    """The parts of NPUFusedMLAPreprocess the release reads, doing what 0.5.9 - 0.5.19 do."""

    def __init__(self, m):
        self.qkv_a_proj = m.fused_qkv_a_proj_with_mqa
        self.w_kc = m.w_kc.contiguous()
        self.layer_id = m.layer_id
        self.quant_config = m.quant_config
        self.q_lora_rank = 16
        self.prepared = False

    def mlaprolog_preprocess_weight(self):
        self.qkv_a_proj.weight.data = self.qkv_a_proj.weight.data.transpose(0, 1)
        self.q_a_proj_weight = self.qkv_a_proj.weight.data[:, : self.q_lora_rank].clone()
        self.kv_a_proj_weight = self.qkv_a_proj.weight.data[:, self.q_lora_rank:].clone()


FakePreprocess.mlaprolog_preprocess_weight = wrapt.FunctionWrapper(
    FakePreprocess.mlaprolog_preprocess_weight, REL.wrap_preprocess_weight)


def npu_mla_preprocess(m, hidden_states, positions, forward_batch, zero_allocator):
    if not hasattr(m, "mla_preprocess"):
        m.mla_preprocess = FakePreprocess(m)
    pre = m.mla_preprocess
    if not pre.prepared:
        pre.mlaprolog_preprocess_weight()
        pre.prepared = True
    return hidden_states @ pre.q_a_proj_weight, pre.w_kc.sum()


WRAPPED = None  # the entry: fresh_state builds it for each test, on REL


def test_the_entry_is_a_plain_function_of_sglangs_parameters_that_pickles_by_name(monkeypatch):
    """npu_mla_preprocess is replaced by a plain function (not a wrapt proxy: every eager layer
    call goes through it) with sglang's parameters, its name, and a way back to sglang's."""
    import inspect
    import pickle

    assert type(WRAPPED) is types.FunctionType and WRAPPED.__wrapped__ is npu_mla_preprocess
    assert tuple(inspect.signature(WRAPPED, follow_wrapped=False).parameters) == R.PREPROCESS_SIG
    assert (WRAPPED.__name__, WRAPPED.__qualname__, WRAPPED.__module__) == (
        "npu_mla_preprocess", "npu_mla_preprocess", __name__)
    monkeypatch.setitem(globals(), "npu_mla_preprocess", WRAPPED)  # as the module attribute is
    assert pickle.loads(pickle.dumps(WRAPPED)) is WRAPPED


def layer(layer_id, contiguous_w_kc=False, mlaprolog=True):
    m = torch.nn.Module()
    m.layer_id = layer_id
    m.fused_qkv_a_proj_with_mqa = torch.nn.Linear(32, 16 + 8, bias=False)
    w = torch.randn(4, 8, 12)
    m.w_kc = w.contiguous() if contiguous_w_kc else w.transpose(1, 2).contiguous().transpose(1, 2)
    ignore = ["model.layers.%d.self_attn.kv_b_proj" % layer_id] if mlaprolog else []
    m.quant_config = types.SimpleNamespace(ignore=ignore)
    m.fused_qkv_a_proj_with_mqa.quant_method = types.SimpleNamespace()
    return m


def step(layers):
    return [WRAPPED(m, torch.ones(2, 32), None, None, None) for m in layers]


def test_decode_releases_once_per_layer_then_only_delegates(server, logs, monkeypatch):
    layers = [layer(i) for i in range(3)]
    qkv = [m.fused_qkv_a_proj_with_mqa.weight.untyped_storage() for m in layers]
    wkc = [m.w_kc.untyped_storage() for m in layers]
    expected = sum(s.nbytes() for s in qkv + wkc)
    first = step(layers)
    assert all(s.nbytes() == 0 for s in qkv + wkc)
    assert sum(REL.released_bytes.values()) == expected and len(REL.layers) == 3
    assert not [line for line in logs if "MiB in" in line]  # summary waits for a full pass

    calls = []
    monkeypatch.setattr(REL, "free_w_kc", lambda m: calls.append(m))
    monkeypatch.setattr(REL, "_first_calls", lambda *a: calls.append(a))
    second = step(layers[1:])
    for a, b in zip(first[1:], second):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # forward unchanged after release
    assert calls == []  # layers 1, 2: the hot path never reaches the decision code
    step(layers[:1])
    assert len(calls) == 1  # layer 0 comes round once more: that call closes the first pass


def test_summary_logged_once_after_first_pass(server, logs):
    layers = [layer(i) for i in range(2)]
    step(layers)
    step(layers)
    step(layers)
    summaries = [line for line in logs if "MiB in 2 layers" in line]
    assert len(summaries) == 1 and "pid" in summaries[0]
    assert all(R._DONE in m.__dict__ for m in layers)


def test_prefill_releases_qkv_only_and_null_nothing(server):
    server["role"] = "prefill"
    m = layer(0)
    wkc = m.w_kc.untyped_storage()
    step([m])
    assert R.is_released(m.fused_qkv_a_proj_with_mqa.weight) and not R.is_released(m.w_kc)
    assert wkc.nbytes() > 0
    REL.reset()
    server["role"] = "null"
    m = layer(1)
    step([m])
    assert not R.is_released(m.fused_qkv_a_proj_with_mqa.weight) and not R.is_released(m.w_kc)


def test_not_mlaprolog_releases_nothing(server):
    m = layer(0, mlaprolog=False)
    step([m])
    assert not R.is_released(m.fused_qkv_a_proj_with_mqa.weight) and not R.is_released(m.w_kc)


def test_shared_w_kc_is_kept(server, logs):
    m = layer(0, contiguous_w_kc=True)  # .contiguous() returns the same tensor
    out = step([m])[0]
    assert R.is_released(m.fused_qkv_a_proj_with_mqa.weight)
    assert not R.is_released(m.w_kc) and m.mla_preprocess.w_kc is m.w_kc
    assert torch.equal(step([m])[0][1], out[1])
    assert any("shares its memory" in line for line in logs)


def test_w_kc_constructed_elsewhere_is_not_released(server):
    m = layer(0)
    m.mla_preprocess = FakePreprocess(m)  # built by forward_mla_prepare_npu, not here
    step([m])
    assert not R.is_released(m.w_kc)


def test_decision_errors_never_break_the_forward(server, logs, monkeypatch):
    def boom(*a):
        raise RuntimeError("boom")

    monkeypatch.setattr(REL, "free_allowed", boom)
    m = layer(0)
    out = step([m])[0]
    assert out[0].shape == (2, 16)
    assert not R.is_released(m.w_kc) and not R.is_released(m.fused_qkv_a_proj_with_mqa.weight)
    assert any("boom" in line for line in logs)


def test_status_details_and_revert(server, monkeypatch):
    record = types.SimpleNamespace(details=REL.details)  # the record's dict, handed to the Release
    m = layer(0)
    step([m])
    total = sum(REL.released_bytes.values())
    assert record.details["released_mib"] == round(total / R.MIB, 3)
    assert record.details["layers"] == 1 and record.details["role"] == "decode"
    REL.reset()
    assert REL.released_bytes == {"qkv_a": 0, "w_kc": 0} and not REL.layers


# --------------------------------------------------------------------------- weight updates

class FakeWorker:
    """BaseTpWorker's update methods as 0.5.9 - 0.5.19 have them: (success, message) from the
    model runner, which here records what it was asked to load."""

    def __init__(self):
        self.loaded = []

    def update_weights_from_disk(self, recv_req):
        self.loaded.append(("disk", recv_req))
        return True, "Succeeded to update model weights."

    def init_weights_update_group(self, recv_req):
        self.loaded.append(("group", recv_req))
        return True, "Succeeded to initialize custom process group."


for _op in ("update_weights_from_disk", "init_weights_update_group"):
    setattr(FakeWorker, _op, wrapt.FunctionWrapper(getattr(FakeWorker, _op), REL.wrap_weight_update))


def test_a_weight_update_called_with_keywords_gets_them_while_nothing_is_released(server):
    worker = FakeWorker()
    assert worker.update_weights_from_disk(recv_req="req") == (True, "Succeeded to update model weights.")
    assert worker.loaded == [("disk", "req")]


def test_weight_updates_delegate_untouched_until_a_weight_is_released(server, logs):
    worker = FakeWorker()
    assert worker.update_weights_from_disk("req") == (True, "Succeeded to update model weights.")
    server["role"] = "null"  # nothing released in this process: still delegated
    step([layer(0)])
    assert worker.update_weights_from_disk("req2")[0] is True
    assert worker.loaded == [("disk", "req"), ("disk", "req2")]
    assert "updates_refused" not in REL.details and not [line for line in logs if "refused" in line]


def test_weight_updates_are_refused_once_weights_are_released(server, logs, monkeypatch):
    worker = FakeWorker()
    layers = [layer(i) for i in range(3)]
    step(layers)
    touched = []
    monkeypatch.setattr(R.metrics, "publish", lambda: touched.append(True))
    for op, call in (("update_weights_from_disk", worker.update_weights_from_disk),
                     ("init_weights_update_group", worker.init_weights_update_group)):
        success, message = call("req")
        assert success is False and message.startswith("npu-shim refused %s: " % op)
        assert "qkv_a_proj.weight of layers 0-2, w_kc of layers 0-2" in message
        assert "NPU_SHIM_MLA_WEIGHT_RELEASE=0" in message and "nothing was loaded" in message
        assert "%.1f MiB freed" % (sum(REL.released_bytes.values()) / R.MIB) in message
    assert worker.loaded == []  # the runner was never asked: nothing read, nothing loaded
    assert REL.details["updates_refused"] == 2
    assert len(touched) == 2  # each refusal reaches sglang's metrics at once
    refused = [line for line in logs if "refused" in line]
    assert len(refused) == 2 and all("NPU_SHIM_MLA_WEIGHT_RELEASE=0" in line for line in refused)
    assert all(torch.isfinite(out[0]).all() for out in step(layers))  # the layers keep serving


def test_prefill_refusal_names_only_qkv_a_and_a_kept_weight_is_not_named(server):
    server["role"] = "prefill"
    step([layer(0), layer(1, contiguous_w_kc=True)])
    message = FakeWorker().update_weights_from_disk("req")[1]
    assert "qkv_a_proj.weight of layers 0-1" in message and "w_kc" not in message


def test_guarded_but_still_held_weight_refuses_updates_too(server, monkeypatch):
    """A guarded weight whose memory something else still holds raises on a touch all the same:
    updates are refused although none of its bytes was counted as freed."""
    m = layer(0)
    base = torch.randn(4, 12, 8)
    m.w_kc = base.transpose(1, 2)  # the base, held here, outlives the release
    monkeypatch.setattr(tensor_release, "_base_held_elsewhere", lambda chain: False)
    step([m])
    assert R.is_released(m.w_kc) and base.untyped_storage().nbytes() > 0
    assert REL.released_bytes["w_kc"] == 0 and REL.guarded["w_kc"] == {0}
    success, message = FakeWorker().update_weights_from_disk("req")
    assert success is False and "w_kc of layer 0" in message


@pytest.mark.parametrize("fail", ["numpy", "resize"])
def test_a_weight_whose_memory_cannot_be_freed_is_kept_whole_and_updates_run(server, logs, monkeypatch, fail):
    """w_kc on memory torch cannot resize (``torch.from_numpy``), or a resize that fails all the
    same: the layer keeps its w_kc untouched and readable, nothing is counted or guarded, one line
    says so, and weight updates run: no weight is left raising on a touch while it keeps its
    memory."""
    numpy = pytest.importorskip("numpy")
    m = layer(0)
    if fail == "numpy":
        m.w_kc = torch.from_numpy(numpy.random.rand(4, 12, 8).astype("float32")).transpose(1, 2)
        m.fused_qkv_a_proj_with_mqa.weight = torch.nn.Parameter(
            torch.from_numpy(numpy.random.rand(24, 32).astype("float32")), requires_grad=False)
    else:
        put_back = []
        monkeypatch.setattr(tensor_release, "_put_back",
                            lambda *args, real=tensor_release._put_back: put_back.append(real(*args)))
        monkeypatch.setattr(torch.UntypedStorage, "resize_", _refuse_resize)
    values = m.w_kc.clone()
    out = step([m])
    monkeypatch.setattr(torch.UntypedStorage, "resize_", _REAL_RESIZE)
    assert not R.is_released(m.w_kc) and torch.equal(m.w_kc, values)
    assert not R.is_released(m.fused_qkv_a_proj_with_mqa.weight)
    assert REL.guarded == {"qkv_a": set(), "w_kc": set()} and REL.released_bytes == {"qkv_a": 0, "w_kc": 0}
    assert "released_bytes" not in REL.details
    kept = [line for line in logs if "keeping" in line]
    if fail == "numpy":
        assert kept == ["mla_weight_release: keeping qkv_a_proj.weight of layer 0: its memory is owned "
                        "outside torch (torch.from_numpy, a DLPack or shared-memory buffer), so it cannot "
                        "be freed"]  # said once per process, not once per weight
    else:
        assert kept == ["mla_weight_release: keeping qkv_a_proj.weight of layer 0: its memory cannot be "
                        "freed (no)"] and len(put_back) == 2  # both weights put back, said once
    worker = FakeWorker()
    assert worker.update_weights_from_disk("req") == (True, "Succeeded to update model weights.")
    assert worker.loaded == [("disk", "req")] and "updates_refused" not in REL.details
    assert torch.equal(step([m])[0][1], out[0][1])  # the layer still reads its w_kc


_REAL_RESIZE = torch.UntypedStorage.resize_


def _refuse_resize(self, size):
    raise RuntimeError("no. really")


def test_layer_list():
    assert R._layer_list({3}) == "layer 3"
    assert R._layer_list(set(range(61))) == "layers 0-60"
    assert R._layer_list({0, 1, 2, 5, 7, 8, "?"}) == "layers 0-2, 5, 7-8, ?"


def test_reset_forgets_guarded_weights(server):
    step([layer(0)])
    assert REL.released_weights()
    REL.reset()
    assert REL.released_weights() == [] and FakeWorker().update_weights_from_disk("r")[0] is True


def _prepared(m, copy):
    """A preprocessor after mlaprolog_preprocess_weight, its q_a/kv_a copies made by ``copy``."""
    pre = FakePreprocess(m)
    weight = pre.qkv_a_proj.weight.data.transpose(0, 1)
    pre.qkv_a_proj.weight.data = weight
    pre.q_a_proj_weight = copy(weight[:, :16])
    pre.kv_a_proj_weight = copy(weight[:, 16:])
    return pre


@pytest.mark.parametrize("copy,word", [
    (lambda t: t, "q_a/kv_a copies share its memory"),                # views, not copies
    (lambda t: t.clone() if t.shape[1] == 16 else None, "q_a/kv_a copies share its memory"),
])
def test_qkv_a_whose_copies_share_its_memory_is_kept(server, logs, copy, word):
    pre = _prepared(layer(0), copy)
    assert REL.free_qkv_a(pre) == 0
    assert not R.is_released(pre.qkv_a_proj.weight)
    assert any(word in line for line in logs)
    assert not any("other holder" in line for line in logs)  # decided before the holder count


def test_qkv_a_that_is_part_of_a_larger_storage_is_kept(server, logs):
    m = layer(0)
    big = torch.randn(24 * 32 + 100)
    m.fused_qkv_a_proj_with_mqa.weight.data = big[:24 * 32].view(24, 32)
    del big  # the weight is the storage's only holder, but holds 100 values besides itself
    pre = _prepared(m, lambda t: t.clone())
    assert REL.free_qkv_a(pre) == 0 and not R.is_released(pre.qkv_a_proj.weight)
    assert any("storage holds more than this weight" in line for line in logs)


@pytest.mark.parametrize("own", [
    lambda w: w.view(w.shape),                     # another tensor object on the same memory
    lambda w: w[:, :, :].contiguous().clone()[:0],  # a copy of the wrong (empty) size: distinct memory
])
def test_w_kc_shared_with_or_distinct_from_the_preprocessors(server, logs, own):
    m = layer(0)
    m.mla_preprocess = FakePreprocess(m)
    m.mla_preprocess.w_kc = own(m.w_kc)
    shares = m.mla_preprocess.w_kc.numel() > 0
    assert (REL.free_w_kc(m) == 0) is shares
    assert R.is_released(m.w_kc) is not shares
    assert any("preprocessor's w_kc shares its memory" in line for line in logs) is shares


def test_w_kc_that_is_part_of_a_larger_storage_is_kept(server, logs):
    m = layer(0)
    m.w_kc = torch.randn(4 * 8 * 12 + 10)[:4 * 8 * 12].view(4, 8, 12)
    m.mla_preprocess = FakePreprocess(m)
    assert REL.free_w_kc(m) == 0 and not R.is_released(m.w_kc)
    assert any("storage holds more than this weight" in line for line in logs)


def test_accounting_in_status_details_and_summary_lines(server, logs, monkeypatch):
    record = types.SimpleNamespace(details=REL.details)  # the record's dict, handed to the Release
    monkeypatch.setattr(R.log, "pid_text", lambda: "pid 42")
    layers = [layer(0), layer(1)]
    step(layers)
    step(layers)  # layer 0 again: the first pass is done, the summary is logged
    qkv, wkc = 2 * 24 * 32 * 4, 2 * 4 * 8 * 12 * 4  # float32 bytes of two layers
    assert record.details["qkv_a_mib"] == round(qkv / R.MIB, 3) == 0.006
    assert record.details["w_kc_mib"] == round(wkc / R.MIB, 3) == 0.003
    # and in bytes, exact (a small model's release rounds to 0.0 MiB)
    assert (record.details["qkv_a_bytes"], record.details["w_kc_bytes"]) == (qkv, wkc)
    assert record.details["released_bytes"] == qkv + wkc
    assert [line for line in logs if "MiB in" in line] == [
        "mla_weight_release: released: 0.0 MiB in 2 layers (qkv_a 0.0 MiB, w_kc 0.0 MiB) in pid 42"]
    step([layer(2)])  # a layer first seen after the summary
    assert logs[-1] == ("mla_weight_release: more layers released: 0.0 MiB in 3 layers "
                        "(qkv_a 0.0 MiB, w_kc 0.0 MiB) in pid 42")


def test_nothing_to_release_returns_zero_bytes(server, logs):
    m = layer(0)
    pre = _prepared(m, lambda t: t.clone())
    m.mla_preprocess = pre
    server["role"] = "null"
    assert REL.free_qkv_a(pre) == 0 and REL.free_w_kc(m) == 0  # role
    server["role"] = "decode"
    no_mlaprolog = layer(1, mlaprolog=False)
    no_mlaprolog.mla_preprocess = _prepared(no_mlaprolog, lambda t: t.clone())
    assert REL.free_qkv_a(no_mlaprolog.mla_preprocess) == 0 and REL.free_w_kc(no_mlaprolog) == 0
    assert any("keeping qkv_a_proj.weight of layer 1: mlaprolog_preprocess_weight ran although "
               "forward() would not route to mlaprolog" in line for line in logs)
    assert REL.free_qkv_a(pre) > 0 and REL.free_w_kc(m) > 0
    assert "released by npu-shim: qkv_a_proj.weight of layer 0;" in repr(pre.qkv_a_proj.weight)
    assert "released by npu-shim: w_kc of layer 0;" in repr(m.w_kc)
    assert REL.free_qkv_a(pre) == 0 and REL.free_w_kc(m) == 0  # already released
    m.w_kc = None
    pre.qkv_a_proj.weight = None
    assert REL.free_qkv_a(pre) == 0 and REL.free_w_kc(m) == 0
    # neither an already released w_kc nor a missing one is looked at further (no warning about it)
    assert not any("keeping w_kc" in line for line in logs), logs


def test_weight_that_cannot_be_swapped_or_guarded_is_kept_whole(logs, monkeypatch):
    import weakref

    weight = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)
    values = weight.clone()
    ref = weakref.ref(weight)  # swap_tensors refuses a tensor that has weakrefs
    assert R.free_weight(weight, "w_kc of layer 4", REL.once) == 0 and not R.is_released(weight)
    assert torch.equal(weight, values) and ref() is weight
    assert any("keeping w_kc of layer 4: it is held where it cannot be replaced" in line for line in logs)
    other = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)
    values = other.clone()
    slotted = type("Slotted", (torch.nn.Parameter,), {"__slots__": ("x",)})
    monkeypatch.setattr(tensor_release, "guarded_class", lambda cls, guard: slotted)  # __class__ assignment fails
    assert R.free_weight(other, "w_kc of layer 5", REL.once) == 0 and type(other) is torch.nn.Parameter
    assert torch.equal(other, values)
    assert any("keeping w_kc of layer 5: its class Parameter cannot be guarded" in line for line in logs)


def test_memory_still_held_after_the_swap_is_not_freed(logs, monkeypatch):
    """Defence in depth: should the holder check miss a base held elsewhere, the storage is not
    resized under it (the base stays readable) and nothing is counted as freed."""
    base = torch.randn(4, 12, 8)
    weight = base.transpose(1, 2)
    monkeypatch.setattr(tensor_release, "_base_held_elsewhere", lambda chain: False)
    assert R.free_weight(weight, "w_kc of layer 6", REL.once) == 0 and R.is_released(weight)
    assert base.untyped_storage().nbytes() == 4 * 12 * 8 * 4
    assert any("w_kc of layer 6 is guarded but its memory still has 1 holder;" in line for line in logs)


def test_storage_that_cannot_be_compared_counts_as_shared():
    assert tensor_release.shares_storage(object(), torch.ones(1)) is True
    assert tensor_release.shares_storage(torch.ones(1), torch.ones(1)) is False


# --------------------------------------------------------------------------- the patch module's helpers

class FakeView:
    """A SourceView's answers for the definitions ``targets`` asks about: ``functions`` maps
    (module, qualname) to its fingerprint; ``names`` are the further names ``has`` finds."""

    def __init__(self, functions, names=()):
        self.functions = dict(functions)
        self.names = set(names)

    def function(self, dotted, qualname):
        if (dotted, qualname) not in self.functions:
            return None
        return types.SimpleNamespace(fingerprint=self.functions[(dotted, qualname)])

    def has(self, dotted, name):
        return (dotted, name) in self.names or (dotted, name) in self.functions


FORWARD = (R.MLA_PRE, R.CLASS + ".forward")
PROLOG = (R.MLA_PRE, R.CLASS + ".forward_mlaprolog")
ENTRY = (R.MLA_NPU, "npu_mla_preprocess")
WEIGHT = (R.MLA_PRE, R.CLASS + ".mlaprolog_preprocess_weight")


def release_view(caller=R.SCHEDULER_UPDATER, forward="011dc459e9706bff", drop=(), names=()):
    """The definitions of a 0.5.10 - 0.5.19 release as ``targets`` reads them, less ``drop``."""
    functions = {FORWARD: forward, PROLOG: "96dc2446cff765c4", ENTRY: "38ffc9242c8f71f7",
                 WEIGHT: "09fdb1454d8689bd"}
    if caller is not None:
        functions[(caller[0], caller[1] + ".update_weights_from_disk")] = "fp"
    for key in drop:
        del functions[key]
    return FakeView(functions, names)


def test_fingerprint_is_the_definitions_or_none():
    view = FakeView({FORWARD: "abc"})
    assert R.fingerprint(view, *FORWARD) == "abc"
    assert R.fingerprint(view, *PROLOG) is None


def test_pins_are_the_pinned_fingerprints_of_the_definitions_asked_for():
    assert R.pins(FORWARD, WEIGHT) == {FORWARD: R.PINNED[FORWARD], WEIGHT: R.PINNED[WEIGHT]}
    assert R.pins() == {}


def test_probe_names_the_upstream_predicate_when_the_release_has_it():
    assert R.PATCH.probe(FakeView({}, names=[(R.MLA_PRE, R.CLASS + ".uses_mlaprolog")])) == (
        "NPUFusedMLAPreprocess.uses_mlaprolog exists (and the release with it)")
    assert R.PATCH.probe(FakeView({}, names=[(R.MLA_NPU, R.CLASS + ".uses_mlaprolog")])) is None
    assert R.PATCH.probe(release_view()) is None


@pytest.mark.parametrize("details,summary", [
    ({"released_mib": 1.5}, ["released 1.5 MiB"]),
    ({"released_mib": 0}, ["released 0 MiB"]),  # released, if only a little
    ({}, []),
    ({"released_mib": "1.5"}, []),  # only a number is shown
])
def test_report_shows_the_released_mib(details, summary):
    assert R.PATCH.report.summary(framework.Details(details)) == summary


# --------------------------------------------------------------------------- the targets

def test_targets_of_a_release_with_the_mlaprolog_path():
    ctx = framework.DecideContext(environ={}, assume_triggered=False, details={"kept": 1})
    targets = R.targets(release_view(names=[(R.RUNTIME_CONTEXT, "get_disagg")]), ctx)
    release = ctx.process_state
    assert isinstance(release, R.MlaWeightReleaseState) and release.details is ctx.details
    assert (release.w8a8_attr, release.role_source) == ("quantization_config", "get_disagg")
    assert ctx.notes == ["frees memory only where the disaggregation role is prefill (qkv_a) or decode "
                         "(qkv_a, w_kc), and not with LoRA, weight updates or speculative decoding; once "
                         "it has, update_weights_* requests are refused"]
    entry, weight, predicate = targets[:3]
    assert isinstance(entry, framework_targets().Replace) and entry.rebind_copies and entry.must_exist
    assert (entry.module, entry.qualname, entry.factory) == (R.MLA_NPU, "npu_mla_preprocess",
                                                             release.npu_mla_preprocess_for)
    assert entry.pins == {ENTRY: R.PINNED[ENTRY]}
    assert (weight.module, weight.qualname, weight.wrapper) == (R.MLA_PRE, WEIGHT[1],
                                                                release.wrap_preprocess_weight)
    assert weight.signatures == ((),)
    assert weight.pins == {key: R.PINNED[key] for key in (WEIGHT, FORWARD, PROLOG)}
    assert isinstance(predicate, framework_targets().Replace) and predicate.must_exist is False
    assert (predicate.module, predicate.qualname) == (R.MLA_PRE, R.CLASS + ".uses_mlaprolog")
    method = predicate.factory(None)
    assert method.__name__ == "uses_mlaprolog"
    assert method(fake_preprocess(w8a8_attr="quantization_config")) is False  # the release's W8A8 check
    assert method(fake_preprocess(w8a8_attr="quant_config")) is True
    updates = targets[3:]
    assert [t.qualname for t in updates] == ["BaseTpWorker." + op for op in R.UPDATE_OPS]
    for op, target in zip(R.UPDATE_OPS, updates):
        assert target.module == R.TP_WORKER and target.wrapper == release.wrap_weight_update
        assert target.signatures == (R.UPDATE_SIG,)
        caller = (R.SCHEDULER_UPDATER[0], R.SCHEDULER_UPDATER[1] + "." + op)
        assert target.pins == {(R.TP_WORKER, "BaseTpWorker." + op): R.PINNED[(R.TP_WORKER, "BaseTpWorker." + op)],
                               caller: R.PINNED[caller]}


def framework_targets():
    from npu_shim.runtime import targets

    return targets


def test_targets_read_the_w8a8_attribute_and_role_source_from_the_code():
    ctx = framework.DecideContext(environ={}, assume_triggered=False)
    targets = R.targets(release_view(caller=R.SCHEDULER_MIXIN, forward="d010fbeaf53c20ee"), ctx)
    assert (ctx.process_state.w8a8_attr, ctx.process_state.role_source) == ("quant_config", "server_args")
    mixin = {(R.SCHEDULER_MIXIN[0], R.SCHEDULER_MIXIN[1] + "." + op) for op in R.UPDATE_OPS}
    assert all(set(t.pins) & mixin for t in targets[3:])
    ctx = framework.DecideContext(environ={}, assume_triggered=False)
    R.targets(release_view(forward="0000000000000000"), ctx)
    assert ctx.process_state.w8a8_attr is None  # an unknown forward(): its target's pin refuses it


def test_targets_of_a_release_without_the_mlaprolog_path_are_inactive():
    ctx = framework.DecideContext(environ={}, assume_triggered=False)
    with pytest.raises(framework.Inactive) as info:
        R.targets(release_view(drop=(PROLOG, ENTRY)), ctx)
    assert str(info.value) == ("this sglang has no mlaprolog path (it appears in 0.5.9), so there is "
                               "nothing to release")
    assert ctx.process_state is None


@pytest.mark.parametrize("drop,missing", [
    ((ENTRY,), "sglang.srt.hardware_backend.npu.modules.deepseek_v2_attention_mla_npu:npu_mla_preprocess"),
    ((WEIGHT,), "sglang.srt.hardware_backend.npu.attention.mla_preprocess:"
                "NPUFusedMLAPreprocess.mlaprolog_preprocess_weight"),
    ((PROLOG, WEIGHT), "sglang.srt.hardware_backend.npu.attention.mla_preprocess:"
                       "NPUFusedMLAPreprocess.mlaprolog_preprocess_weight"),
])
def test_targets_without_a_wrapped_definition_are_unsupported(drop, missing):
    ctx = framework.DecideContext(environ={}, assume_triggered=False)
    with pytest.raises(framework.Unsupported) as info:
        R.targets(release_view(drop=drop), ctx)
    assert str(info.value) == ("%s not found, although this sglang has the mlaprolog path "
                               "(NPUFusedMLAPreprocess.forward_mlaprolog): renamed or moved in this image, so "
                               "the shim cannot tell what would still read the weights" % missing)


def test_targets_without_the_schedulers_update_method_are_unsupported():
    ctx = framework.DecideContext(environ={}, assume_triggered=False)
    with pytest.raises(framework.Unsupported) as info:
        R.targets(release_view(caller=None), ctx)
    assert str(info.value) == (
        "the scheduler's update_weights_from_disk was not found "
        "(sglang.srt.managers.scheduler_update_weights_mixin.SchedulerUpdateWeightsMixin or "
        "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager): the shim "
        "cannot tell how a refused weight update would be answered, so it releases nothing")
    assert ctx.notes == []


# --------------------------------------------------------------------------- the rules

def sglang_modules(monkeypatch, **published):
    """sglang's runtime_context / server_args modules as a server publishes them."""
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    for name, functions in (("runtime_context", {"get_disagg": published.get("get_disagg")}),
                            ("server_args", {"get_global_server_args": published.get("server_args")})):
        module = types.ModuleType("sglang.srt." + name)
        for attr, value in functions.items():
            if value is not None:
                setattr(module, attr, value)
        monkeypatch.setitem(sys.modules, module.__name__, module)


def test_disagg_role_from_where_the_release_publishes_it(monkeypatch):
    sglang_modules(monkeypatch, get_disagg=lambda: types.SimpleNamespace(disaggregation_mode="decode"),
                   server_args=lambda: types.SimpleNamespace(disaggregation_mode="prefill"))
    assert R.disagg_role("get_disagg") == ("decode", None)
    assert R.disagg_role("server_args") == ("prefill", None)
    REL.role_source = "get_disagg"
    assert REL.disagg_role() == ("decode", None)


def test_disagg_role_that_is_no_role_says_where_it_was_read(monkeypatch):
    sglang_modules(monkeypatch, get_disagg=lambda: types.SimpleNamespace(disaggregation_mode="Decode"),
                   server_args=lambda: types.SimpleNamespace(disaggregation_mode=None))
    assert R.disagg_role("get_disagg") == (None, "runtime_context.get_disagg() is 'Decode'")
    assert R.disagg_role("server_args") == (None, "server_args.disaggregation_mode is None")


def test_disagg_role_not_published_says_why(monkeypatch):
    sglang_modules(monkeypatch, server_args=lambda: None)
    assert R.disagg_role("server_args") == (
        None, "reading the disaggregation role failed: "
              "AttributeError(\"'NoneType' object has no attribute 'disaggregation_mode'\")")
    role, why = R.disagg_role("get_disagg")
    assert role is None and why.startswith("reading the disaggregation role failed: ImportError(")
    assert "get_disagg" in why


def test_server_args_are_the_published_ones(monkeypatch):
    args = types.SimpleNamespace(enable_lora=False)
    sglang_modules(monkeypatch, server_args=lambda: args)
    assert R.server_args() is args
    sglang_modules(monkeypatch, server_args=lambda: None)
    with pytest.raises(ValueError) as info:
        R.server_args()
    assert str(info.value) == "server args are not published"


def test_weight_update_reasons_name_every_flag_in_order():
    every = types.SimpleNamespace(
        enable_lora=True, lora_paths=None, enable_memory_saver=True, enable_weights_cpu_backup=True,
        load_format="dummy", checkpoint_engine_wait_weights_before_ready=True,
        custom_weight_loader=["pkg.loader"], remote_instance_weight_loader_start_seed_via_transfer_engine=True)
    assert R.weight_update_reasons(every) == [
        "LoRA (enable_lora / lora_paths)",
        "enable_memory_saver (release/resume of weights for RL refit)",
        "enable_weights_cpu_backup (weights are restored in place)",
        "load_format=dummy (weights arrive later through update_weights_*)",
        "checkpoint engine pushes weights",
        "custom_weight_loader (update_weights_from_tensor)",
        "this instance seeds other instances' weights",
    ]
    assert R.weight_update_reasons(types.SimpleNamespace(lora_paths=["a=/x"])) == [
        "LoRA (enable_lora / lora_paths)"]
    quiet = types.SimpleNamespace(
        enable_lora=False, lora_paths=[], enable_memory_saver=False, enable_weights_cpu_backup=False,
        load_format="auto", checkpoint_engine_wait_weights_before_ready=False, custom_weight_loader=[],
        remote_instance_weight_loader_start_seed_via_transfer_engine=False)
    assert R.weight_update_reasons(quiet) == [] == R.weight_update_reasons(types.SimpleNamespace())


def test_other_reader_reasons_name_speculative_decoding():
    assert R.other_reader_reasons(types.SimpleNamespace(speculative_algorithm="NEXTN")) == [
        "speculative decoding (NEXTN): target-verify / draft-extend batches take the unfused path of "
        "forward_dsa_prepare_npu, which reads qkv_a_proj.weight and w_kc"]
    assert R.other_reader_reasons(types.SimpleNamespace(speculative_algorithm=None)) == []
    assert R.other_reader_reasons(types.SimpleNamespace()) == []


def test_uses_mlaprolog_method_is_upstreams_name_for_the_predicate():
    method = R.make_uses_mlaprolog_method("quant_config")
    assert (method.__name__, method.__qualname__) == ("uses_mlaprolog", "NPUFusedMLAPreprocess.uses_mlaprolog")
    assert method.__doc__ == ("Whether this layer's forward() takes the mlaprolog path (npu-shim backport "
                              "of 0.5.20).")
    assert method(fake_preprocess()) is True
    assert method(fake_preprocess(w8a8_attr="quant_config")) is False
    assert method(fake_preprocess(w8a8_attr="quantization_config")) is True


def test_w8a8_of_another_quantisation_method_keeps_the_mlaprolog_route():
    pre = fake_preprocess()
    pre.qkv_a_proj.quant_method.quantization_config = types.SimpleNamespace(get_name=lambda: "compressed")
    assert R.uses_mlaprolog(pre, "quantization_config") is True


# --------------------------------------------------------------------------- the state's own parts

def test_state_defaults_and_fresh_details():
    a, b = R.MlaWeightReleaseState(), R.MlaWeightReleaseState()
    assert (a.w8a8_attr, a.role_source) == ("quantization_config", "server_args")
    assert a.details == {} and a.details is not b.details
    details = {}
    assert R.MlaWeightReleaseState(details=details).details is details
    assert (a.summary_logged, a.first_marked) == (False, False)


def test_reset_starts_over(server, logs):
    layers = [layer(0), layer(1)]
    step(layers)
    step(layers[:1])
    assert REL.summary_logged and REL.first_marked
    REL.once("k", logging.INFO, "said")
    REL.reset()
    assert (REL.summary_logged, REL.first_marked) == (False, False)
    assert REL.released_bytes == {"qkv_a": 0, "w_kc": 0} and REL.layers == set()
    assert REL.guarded == {"qkv_a": set(), "w_kc": set()} and REL.said == set()
    REL.once("k", logging.INFO, "said")
    assert logs.count("mla_weight_release: said") == 2


def test_once_says_each_key_once_with_the_patchs_name(logs):
    REL.once("a", logging.WARNING, "first")
    REL.once("a", logging.WARNING, "first again")
    REL.once("b", logging.INFO, "second")
    assert logs == ["mla_weight_release: first", "mla_weight_release: second"]


def test_free_weight_without_a_say_warns_every_time(logs):
    weight = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)
    view = weight.view(-1)
    for _ in range(2):
        assert R.free_weight(weight, "w_kc of layer 9") == 0
    warnings = [line for line in logs if "other holder" in line]
    assert len(warnings) == 2 and all(line.startswith("mla_weight_release: keeping w_kc of layer 9: its memory "
                                                      "has 1 other holder (") for line in warnings)
    del view


def test_layer_list_of_single_and_unordered_ids():
    assert R._layer_list({"?"}) == "layer ?"
    assert R._layer_list({5, 3, 4, 1}) == "layers 1, 3-5"
    assert R._layer_list({2, 0}) == "layers 0, 2"
    assert R._layer_list({"b", 7, "a"}) == "layers 7, a, b"


# --------------------------------------------------------------------------- the gates, word for word

def test_unknown_role_is_skipped_in_the_details_and_the_log(server, logs):
    server["role_error"] = "server_args.disaggregation_mode is 'x'"
    assert REL.free_allowed("w_kc") == (None, "server_args.disaggregation_mode is 'x'")
    assert REL.details == {"role": None, "skipped": "role unknown: server_args.disaggregation_mode is 'x'"}
    assert logs == ["mla_weight_release: releasing nothing: the disaggregation role is unknown when the layer "
                    "decides (server_args.disaggregation_mode is 'x')"]


def test_roles_that_keep_a_weight_say_so_without_a_warning(server, logs):
    server["role"] = "null"
    assert REL.free_allowed("qkv_a") == ("null", "role null")
    assert REL.details == {"role": "null"}
    server["role"] = "prefill"
    assert REL.free_allowed("w_kc") == ("prefill", "role prefill")
    assert REL.free_allowed("qkv_a") == ("prefill", None)
    assert REL.details == {"role": "prefill"} and logs == []


def test_unreadable_server_args_word_for_word(server, logs):
    server["args"] = ValueError("server args are not published")
    assert REL.free_allowed("qkv_a") == ("decode", "server args unknown")
    assert REL.details == {"role": "decode", "skipped": "server args unknown"}
    assert logs == ["mla_weight_release: releasing nothing: the server args cannot be read "
                    "(ValueError('server args are not published')), so LoRA / weight updates cannot be ruled out"]


def test_speculative_decoding_word_for_word(server, logs):
    server["args"].speculative_algorithm = "EAGLE"
    reason = ("speculative decoding (EAGLE): target-verify / draft-extend batches take the unfused path of "
              "forward_dsa_prepare_npu, which reads qkv_a_proj.weight and w_kc")
    assert REL.free_allowed("w_kc") == ("decode", "other readers")
    assert REL.details == {"role": "decode", "skipped": reason}
    assert logs == ["mla_weight_release: releasing nothing: " + reason]


def test_weight_updates_word_for_word_and_forced(server, logs, monkeypatch):
    server["args"].enable_lora = True
    server["args"].load_format = "dummy"
    updates = ("LoRA (enable_lora / lora_paths), load_format=dummy (weights arrive later through "
               "update_weights_*)")
    assert REL.free_allowed("qkv_a") == ("decode", "weight updates")
    assert REL.details == {"role": "decode", "skipped": "weights can change: " + updates}
    assert logs == ["mla_weight_release: releasing nothing: the server can reload or adapt weights (%s); set "
                    "NPU_SHIM_MLA_RELEASE_FORCE=1 to release anyway" % updates]
    monkeypatch.setenv("NPU_SHIM_MLA_RELEASE_FORCE", "1")
    assert REL.free_allowed("qkv_a") == ("decode", None) == REL.free_allowed("w_kc")
    assert logs[1:] == ["mla_weight_release: releasing although the server can reload or adapt weights (%s), "
                        "because NPU_SHIM_MLA_RELEASE_FORCE=1: a later update of these weights raises "
                        "ReleasedWeightError" % updates]


def test_each_reason_to_release_nothing_is_warned_once_on_its_own(server, logs):
    server["role_error"] = "unknown"
    REL.free_allowed("qkv_a")
    server["role_error"] = None
    server["args"] = ValueError("no args")
    REL.free_allowed("qkv_a")
    server["args"] = types.SimpleNamespace(speculative_algorithm="EAGLE")
    REL.free_allowed("qkv_a")
    server["args"] = types.SimpleNamespace(enable_memory_saver=True)
    REL.free_allowed("qkv_a")
    for _ in range(2):
        REL.free_allowed("qkv_a")
    assert [line.split("releasing nothing: ")[1][:20] for line in logs] == [
        "the disaggregation r", "the server args cann", "speculative decoding", "the server can reloa"]


# --------------------------------------------------------------------------- releasing, word for word

def test_release_is_accounted_in_the_details_the_log_and_the_metrics(server, logs, monkeypatch):
    touched = []
    monkeypatch.setattr(R.metrics, "publish", lambda: touched.append(dict(REL.details)))
    m = layer(4)
    step([m])
    qkv, wkc = 24 * 32 * 4, 4 * 8 * 12 * 4
    assert REL.details == {"role": "decode", "released_mib": round((qkv + wkc) / R.MIB, 3), "layers": 1,
                           "qkv_a_mib": round(qkv / R.MIB, 3), "w_kc_mib": round(wkc / R.MIB, 3),
                           "released_bytes": qkv + wkc, "qkv_a_bytes": qkv, "w_kc_bytes": wkc}
    assert logs == ["mla_weight_release: released qkv_a_proj.weight of layer 4 (0.00 MiB)",
                    "mla_weight_release: released w_kc of layer 4 (0.00 MiB)"]
    assert [t["released_bytes"] for t in touched] == [qkv, qkv + wkc]  # each weight, as it goes
    assert REL.layers == {4} and REL.guarded == {"qkv_a": {4}, "w_kc": {4}}


def test_release_of_a_mib_sized_weight_logs_its_size(server, logs):
    m = layer(0)
    m.w_kc = torch.zeros(64, 64, 64).transpose(1, 2)  # 1 MiB of float32, sglang's layout
    m.mla_preprocess = FakePreprocess(m)
    assert REL.free_w_kc(m) == R.MIB
    assert logs == ["mla_weight_release: released w_kc of layer 0 (1.00 MiB)"]
    assert REL.details["w_kc_mib"] == 1.0 and REL.details["released_mib"] == 1.0


def test_summary_line_in_mib(server, logs, monkeypatch):
    monkeypatch.setattr(R.log, "pid_text", lambda: "pid 7")
    REL.released_bytes = {"qkv_a": 3 * R.MIB, "w_kc": R.MIB // 2}
    REL.layers = {0, 1, 2}
    REL._log_summary()
    assert REL.summary_logged
    assert logs == ["mla_weight_release: released: 3.5 MiB in 3 layers (qkv_a 3.0 MiB, w_kc 0.5 MiB) in pid 7"]


def test_refusal_message_word_for_word(server):
    REL.guarded = {"qkv_a": {0, 1}, "w_kc": {1}}
    REL.released_bytes = {"qkv_a": 2 * R.MIB, "w_kc": R.MIB // 2}
    assert REL.update_refusal("update_weights_from_tensor") == (
        "npu-shim refused update_weights_from_tensor: loading the tensors would write into MLA weights this "
        "process released to free NPU memory (qkv_a_proj.weight of layers 0-1, w_kc of layer 1; 2.5 MiB freed), "
        "so nothing was loaded and the server keeps serving its current weights. To update weights on this "
        "server, start it with NPU_SHIM_MLA_WEIGHT_RELEASE=0 (keeps the MLA weights)")
    assert REL.update_refusal("reload").startswith(
        "npu-shim refused reload: the update would write into MLA weights this process released")


def test_refusal_once_only_w_kc_is_guarded_and_its_log_line(server, logs, monkeypatch):
    monkeypatch.setattr(R.log, "pid_text", lambda: "pid 42")
    REL.guarded["w_kc"].add(3)
    loaded = []
    update = wrapt.FunctionWrapper(lambda recv_req: loaded.append(recv_req), REL.wrap_weight_update)
    success, message = update("req")
    assert success is False and loaded == []
    assert message.startswith("npu-shim refused <lambda>: the update would write into MLA weights")
    assert "(w_kc of layer 3; 0.0 MiB freed)" in message
    assert logs == ["mla_weight_release: refused <lambda>: MLA weights are released in pid 42 "
                    "(NPU_SHIM_MLA_WEIGHT_RELEASE=0 keeps them)"]
    # a callable without a name is refused all the same
    assert REL.wrap_weight_update(object(), None, (), {})[1].startswith("npu-shim refused the weight update: ")
    assert REL.details["updates_refused"] == 2


def test_qkv_a_kept_where_its_copies_are_missing_or_it_is_not_exclusive_word_for_word(server, logs):
    pre = _prepared(layer(0), lambda t: t.clone())
    del pre.kv_a_proj_weight  # a copy mlaprolog_preprocess_weight did not make
    assert REL.free_qkv_a(pre) == 0 and not R.is_released(pre.qkv_a_proj.weight)
    assert logs == ["mla_weight_release: keeping qkv_a_proj.weight of layer 0: its q_a/kv_a copies share its "
                    "memory, or its storage holds more than this weight"]


def test_qkv_a_of_a_preprocessor_without_a_layer_id(server, logs):
    pre = _prepared(layer(0), lambda t: t.clone())
    del pre.layer_id
    assert REL.free_qkv_a(pre) > 0
    assert logs == ["mla_weight_release: released qkv_a_proj.weight of layer ? (0.00 MiB)"]
    assert REL.guarded["qkv_a"] == {"?"} and REL.layers == {"?"}


def test_qkv_a_not_routed_to_mlaprolog_word_for_word(server, logs):
    m = layer(2, mlaprolog=False)
    pre = _prepared(m, lambda t: t.clone())
    for _ in range(2):
        assert REL.free_qkv_a(pre) == 0
    assert logs == ["mla_weight_release: keeping qkv_a_proj.weight of layer 2: mlaprolog_preprocess_weight ran "
                    "although forward() would not route to mlaprolog"]
    assert REL.details == {}  # decided before the role was read


def test_qkv_a_kept_by_the_role_is_not_looked_at_further(server, logs):
    server["role"] = "null"
    pre = _prepared(layer(0), lambda t: t)  # copies that share its memory: no warning about them
    assert REL.free_qkv_a(pre) == 0 and logs == []


def test_w_kc_registered_as_a_buffer_is_released(server, logs):
    m = layer(0)
    w_kc = m.__dict__.pop("w_kc")
    m.register_buffer("w_kc", w_kc)  # not in the module's __dict__: found as an attribute
    m.mla_preprocess = FakePreprocess(m)
    assert REL.free_w_kc(m) == 4 * 8 * 12 * 4 and R.is_released(m.w_kc)


def test_w_kc_of_a_layer_without_a_layer_id_or_a_preprocessors_copy(server, logs):
    m = layer(0)
    m.mla_preprocess = FakePreprocess(m)
    del m.layer_id
    del m.mla_preprocess.w_kc  # the preprocessor made no copy of its own
    assert REL.free_w_kc(m) == 0 and not R.is_released(m.w_kc)
    assert logs == ["mla_weight_release: keeping w_kc of layer ?: the preprocessor's w_kc shares its memory, "
                    "or its storage holds more than this weight"]
    m.mla_preprocess.w_kc = m.w_kc  # the very same tensor
    REL.said.clear()
    assert REL.free_w_kc(m) == 0 and not R.is_released(m.w_kc) and len(logs) == 2


def test_w_kc_kept_by_the_role_or_the_route_says_nothing(server, logs):
    m = layer(0)
    m.mla_preprocess = FakePreprocess(m)
    m.mla_preprocess.w_kc = m.w_kc  # shared: would warn if it were looked at
    server["role"] = "prefill"
    assert REL.free_w_kc(m) == 0
    server["role"] = "decode"
    m.quant_config.ignore = []
    assert REL.free_w_kc(m) == 0
    assert logs == [] and not R.is_released(m.w_kc)


def test_a_layer_without_w_kc_has_nothing_to_release(server, logs):
    m = layer(0)
    m.mla_preprocess = FakePreprocess(m)
    del m.w_kc
    assert REL.free_w_kc(m) == 0 and logs == [] and REL.details == {}


def test_a_guarded_weight_that_freed_nothing_is_noted_but_not_accounted(server, logs, monkeypatch):
    m = layer(0)
    base = torch.randn(4, 12, 8)
    m.w_kc = base.transpose(1, 2)
    m.mla_preprocess = FakePreprocess(m)
    monkeypatch.setattr(tensor_release, "_base_held_elsewhere", lambda chain: False)
    assert REL.free_w_kc(m) == 0
    assert REL.guarded["w_kc"] == {0} and REL.layers == set() and "released_bytes" not in REL.details


# --------------------------------------------------------------------------- the entry wrapper

def by_keyword(m):
    return WRAPPED(m=m, hidden_states=torch.ones(2, 32), positions=None, forward_batch=None, zero_allocator=None)


def test_entry_wrapper_takes_m_as_a_keyword_on_every_path(server):
    """sglang may call npu_mla_preprocess with keywords: each path hands them on."""
    m = layer(0)
    out = by_keyword(m)  # the first call
    assert out[0].shape == (2, 16) and R.is_released(m.w_kc) and R._FIRST in m.__dict__
    assert by_keyword(m)[0].shape == (2, 16)  # the first layer again: the pass is done
    assert R._DONE in m.__dict__
    assert by_keyword(m)[0].shape == (2, 16)  # a layer the wrapper has seen
    later = layer(1)
    assert by_keyword(later)[0].shape == (2, 16) and R.is_released(later.w_kc)  # a layer seen after the pass


class SlottedPreprocess:
    """A preprocessor with no ``__dict__`` (no marker can be set on it): the wrapper passes its
    layer's calls on."""
    __slots__ = ("prepared", "q_a_proj_weight", "w_kc")

    def __init__(self):
        self.prepared = True
        self.q_a_proj_weight = torch.ones(32, 16)
        self.w_kc = torch.ones(2)


def test_a_layer_whose_preprocessor_has_no_dict_is_passed_on(server, logs):
    m = layer(0)
    m.mla_preprocess = SlottedPreprocess()
    out = step([m])[0]
    assert out[0].shape == (2, 16) and float(out[1]) == 2.0
    assert not R.is_released(m.w_kc) and R._FIRST in m.__dict__ and logs == []


def test_errors_are_said_once_per_process_whichever_wrapper_raised(server, logs, monkeypatch):
    def boom(*a):
        raise RuntimeError("boom")

    monkeypatch.setattr(REL, "free_allowed", boom)
    step([layer(0)])  # the weight wrapper raises first, then the entry wrapper
    step([layer(1)])  # and again for the next layer
    assert [line for line in logs if "raised" in line] == [
        "mla_weight_release: keeping qkv_a_proj.weight: deciding the release raised RuntimeError('boom')"]


def test_aliased_qkv_a_is_warned_about_once_and_a_released_one_not_at_all(server, logs):
    pre = _prepared(layer(0), lambda t: t.clone())
    alias = pre.qkv_a_proj.weight.t()  # another holder of its memory
    for _ in range(2):
        assert REL.free_qkv_a(pre) == 0
    assert len([line for line in logs if "other holder" in line]) == 1
    del alias
    assert REL.free_qkv_a(pre) > 0
    said = list(logs)
    assert REL.free_qkv_a(pre) == 0 and logs == said  # already released: not looked at again


def test_first_pass_marks_the_first_layer_then_says_what_was_released(server, logs, monkeypatch):
    monkeypatch.setattr(R.log, "pid_text", lambda: "pid 1")
    layers = [layer(0), layer(1), layer(2)]
    step(layers)
    assert R._FIRST in layers[0].__dict__ and R._DONE not in layers[0].__dict__
    assert all(R._DONE in m.__dict__ and R._FIRST not in m.__dict__ for m in layers[1:])
    assert not REL.summary_logged
    step(layers[:1])
    assert R._DONE in layers[0].__dict__ and REL.summary_logged
    assert logs[-1].startswith("mla_weight_release: released: 0.0 MiB in 3 layers")
    said = list(logs)
    step(layers)  # every layer seen: only delegated, nothing more said
    assert logs == said


def test_first_pass_without_a_release_logs_no_summary(server, logs):
    server["role"] = "null"
    layers = [layer(0), layer(1)]
    step(layers)
    step(layers)
    assert not REL.summary_logged and logs == []


def test_layer_first_seen_after_the_first_pass_is_released_by_its_first_call(server, logs):
    """The wrapper stays for the life of the process: a layer met later (a layer list that
    changes) has both weights released at its first call, as the first pass's layers had, and
    the summary line says so again."""
    layers = [layer(0), layer(1)]
    step(layers)
    step(layers[:1])
    later = layer(2)
    out = step([later])[0]
    assert out[0].shape == (2, 16)
    assert R.is_released(later.fused_qkv_a_proj_with_mqa.weight) and R.is_released(later.w_kc)
    assert REL.guarded["w_kc"] == {0, 1, 2} and R._DONE in later.__dict__
    assert logs[-1].startswith("mla_weight_release: more layers released: 0.0 MiB in 3 layers")
    step([later])  # done: only delegated
    assert REL.guarded["w_kc"] == {0, 1, 2}


def test_a_first_call_whose_release_raises_still_forwards_and_marks_the_layer(server, logs, monkeypatch):
    def boom(m):
        raise RuntimeError("boom")

    monkeypatch.setattr(REL, "free_w_kc", boom)
    first, second = layer(0), layer(1)
    assert step([first, second])[1][0].shape == (2, 16)
    assert R._FIRST in first.__dict__ and R._DONE in second.__dict__
    assert not R.is_released(second.w_kc)
    assert logs.count("mla_weight_release: keeping w_kc: deciding the release raised RuntimeError('boom')") == 1


def test_weight_wrapper_error_keeps_the_weight_and_says_which(server, logs, monkeypatch):
    def boom(*a):
        raise RuntimeError("boom")

    monkeypatch.setattr(REL, "free_allowed", boom)
    pre = _prepared(layer(0), lambda t: t.clone())
    assert REL.wrap_preprocess_weight(lambda *a, **k: (a, k), pre, (1,), {"x": 2}) == ((1,), {"x": 2})
    assert logs == ["mla_weight_release: keeping qkv_a_proj.weight: deciding the release raised RuntimeError('boom')"]


def test_entry_wrapper_error_keeps_w_kc_word_for_word(server, logs, monkeypatch):
    def boom(*a):
        raise RuntimeError("boom")

    monkeypatch.setattr(REL, "free_w_kc", boom)
    m = layer(0)
    assert step([m])[0][0].shape == (2, 16)
    assert logs[-1] == "mla_weight_release: keeping w_kc: deciding the release raised RuntimeError('boom')"
