"""mla_weight_release inside a real sglang 0.5.11 decode server (dev/shimdev/server/).

A tiny DeepSeek-V3.2 / GLM-5 style model (DSA: MLA with the lightning indexer; a modelslim W8A8
checkpoint whose ``kv_b_proj`` is in ``ignore``: ``models.ensure_model("dsa", ...)``) served by
``python -m sglang.launch_server --device npu --disaggregation-mode decode
--disaggregation-transfer-backend fake`` with ``SGLANG_NPU_USE_MLAPO=1``, TP 2, on the simulated
NPU: every decode step goes through ``npu_mla_preprocess`` -> ``NPUFusedMLAPreprocess.
forward_mlaprolog`` (``custom::npu_mla_prolog_v3``), the indexer (``npu_lightning_indexer``) and
the sparse attention (``npu_sparse_flash_attention``), sglang's own code throughout.

Requests reach a decode server as a PD router sends them: with ``bootstrap_host`` /
``bootstrap_port`` / ``bootstrap_room``.  With sglang's ``fake`` transfer backend the host is
sglang's own ``FAKE_BOOTSTRAP_HOST`` and no prefill server exists: the KV "transfer" succeeds at
once and the decode server decodes from its (untransferred) cache -- the first token is the
metadata buffer's -- so the tokens are a deterministic function of the decode path, not of the
prompt (docs/development.md, "A real MLA decode server").

Four servers on one xdist worker: the shim on with NPU graphs on (sglang's NPUGraphRunner
captures batch sizes 1 and 2 and decodes by replay), the shim absent (not on PYTHONPATH) with
graphs on, the shim on in eager mode (``--disable-cuda-graph``), and -- beside the backport --
sglang 0.5.20's own release (the shim installed and standing down: ``mla_weight_release``
``upstream``) on the same model, role and TP, graphs on.  Checked on them:

* the same tokens for the same requests, graphs on and off, shim on and absent;
* every device storage resize of the release done with no capture live, before the first
  capture (the simulation's order of events in each rank), and the graphs replayed;
* the bytes released, from the patch's details on each TP rank (sglang's ``/metrics``), equal
  to what the model's shapes say and to eager mode's; the simulated device of each rank holds exactly that much less
  than the same rank of the server without the shim, after the same requests
  (``SIMNPU_TRACK_DERIVED``: what sglang derives from npu weights counts as npu memory);
* ``/update_weights_from_disk`` refused with the clear answer by every rank with the graphs
  captured, and the server still serving the same tokens afterwards (it counts a refusal);
* sglang 0.5.20's own release frees, on each rank, what the backport frees (the same storages'
  bytes, resized to 0 in the eager warm-up before the first capture) and decodes the same tokens.
  Each request carries a request id whose 0.5.20 fake handoff token is 0, the token 0.5.11 starts
  from (``mla.zero_handoff_rid``): 0.5.20's fake backend hashes the request id into the first
  token, 0.5.11 takes the metadata buffer's 0.
"""
from __future__ import annotations

import json
import re
import time

import pytest

from shimdev.server import mla
from shimdev.server.pool import ServerPool
from shimdev.server.process import Server

VERSION = "0.5.11"
#: The first release with the MLA release of its own (sgl-project/sglang#38807): the shim stands down.
UPSTREAM = "0.5.20"
TP = 2
PROMPTS = ([5, 6, 7, 8], [100, 200, 300, 400, 500, 600, 700], [9])
NEW_TOKENS = 8

pytestmark = pytest.mark.xdist_group("server-mla-" + VERSION)


class Bed:
    """The four servers ("on": shim on, graphs on; "off": shim absent, graphs on; "eager": shim
    on, graphs off; "upstream": sglang 0.5.20, shim on, graphs on), started on first use, with the
    answers each gave to the fixed requests, its ranks' device counters and its release details
    right after.  At most two run at once: a test that needs "eager" asks for it before the others
    (the oldest is stopped to make room); "upstream" is asked for last, when "on" has served its
    own tests (its answers and counters stay)."""

    def __init__(self, tmp):
        self.tmp, self.pool, self.after = tmp, ServerPool(max_live=2), {}

    def get(self, name) -> Server:
        return self.pool.get(name, lambda: self._start(name))

    def _start(self, name) -> Server:
        server = mla.decode_server(UPSTREAM if name == "upstream" else VERSION, TP,
                                   "absent" if name == "off" else "on", self.tmp, name, graphs=name != "eager")
        server.start()
        try:
            vocab = json.loads((server.model_dir / "config.json").read_text())["vocab_size"]
            answers = [mla.decode(server, p, NEW_TOKENS, rid=mla.zero_handoff_rid(vocab)) for p in PROMPTS]
            details = mla.release_details(server) if name != "off" else {}
            self.after[name] = (answers, mla.devices(server), details)
        except BaseException:
            server.stop()  # not in the pool yet: nothing else would stop it
            raise
        return server

    def answers(self, name):
        self.get(name)
        return self.after[name][0]

    def memory(self, name):
        self.get(name)
        return self.after[name][1]

    def details(self, name):
        self.get(name)
        return self.after[name][2]

    def stop_all(self):
        self.pool.stop_all()


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    b = Bed(tmp_path_factory.mktemp("mla-servers"))
    yield b
    b.stop_all()


def test_the_graph_mode_decode_server_serves_the_same_tokens_as_eager_and_as_without_the_shim(bed):
    eager = bed.answers("eager")  # first: the oldest, stopped when "off" needs room
    assert bed.answers("on") == eager == bed.answers("off")
    assert all(len(a) == NEW_TOKENS for a in eager)
    on = bed.get("on")
    log = on.log_text()
    assert "Capture npu graph end" in log and "Capture cuda graph bs [1, 2]" in log
    lines = [ln for ln in log.splitlines() if ln.startswith("[npu-shim ")]
    layers = json.loads((on.model_dir / "config.json").read_text())["num_hidden_layers"]
    for rank in range(TP):
        assert any(re.search(r"tp %d/%d\] .*mla_weight_release=applied" % (rank, TP), ln) for ln in lines), lines
        assert any(re.search(r"tp %d/%d\] mla_weight_release: released: .* in %d layers" % (rank, TP, layers), ln)
                   for ln in lines), lines


def test_every_release_resize_happens_with_no_capture_live_before_the_first_capture(bed):
    """From each rank's simulated device: the order of captures, replays and device storage
    resizes.  The release frees qkv_a and w_kc of every layer (2 per layer) in warm-up 1, eager."""
    layers = json.loads((bed.get("on").model_dir / "config.json").read_text())["num_hidden_layers"]
    memory = bed.memory("on")
    assert sorted(memory) == list(range(TP)), memory
    for rank, snapshot in memory.items():
        events = mla.graph_events(snapshot)
        kinds = [e[0] for e in events]
        assert kinds.count("capture_begin") == len(mla.GRAPH_BATCH_SIZES), (rank, kinds)
        assert "replay" in kinds, (rank, kinds)  # the decode steps ran the captured graphs
        first_capture = kinds.index("capture_begin")
        resizes = [(i, e) for i, e in enumerate(events) if e[0] == "storage_resize"]
        assert all(e[3] is None for _, e in resizes), (rank, resizes)  # none with a capture live
        released = [e for i, e in resizes if e[2] == 0 and i < first_capture]
        assert len(released) >= 2 * layers, (rank, events[:first_capture + 1])


def test_the_bytes_released_on_each_rank_are_what_the_shapes_say_and_eager_s(bed):
    eager = bed.details("eager")
    expected = mla.expected_release(bed.get("on").model_dir, TP)
    details = bed.details("on")
    assert sorted(details) == sorted(eager) == list(range(TP)), (details, eager)
    for rank, patch in details.items():
        assert patch["state"] == "applied"
        d = patch["details"]
        assert (d["qkv_a_bytes"], d["w_kc_bytes"]) == (expected["qkv_a"], expected["w_kc"]), (rank, d)
        assert d["released_bytes"] == sum(expected.values())
        e = eager[rank]["details"]
        assert (e["qkv_a_bytes"], e["w_kc_bytes"], e["released_bytes"]) == \
            (d["qkv_a_bytes"], d["w_kc_bytes"], d["released_bytes"]), (rank, d, e)


def test_each_ranks_simulated_device_holds_that_much_less_than_without_the_shim(bed):
    expected = sum(mla.expected_release(bed.get("on").model_dir, TP).values())
    on, off = bed.memory("on"), bed.memory("off")
    assert sorted(on) == sorted(off) == list(range(TP)), (on, off)
    for rank in range(TP):
        assert on[rank]["track_derived"] and off[rank]["track_derived"]
        assert off[rank]["live_npu_bytes"] - on[rank]["live_npu_bytes"] == expected, (rank, on, off)


def test_update_weights_from_disk_is_refused_by_every_rank_with_graphs_captured_and_it_keeps_serving(bed):
    on = bed.get("on")
    before = bed.answers("on")
    status, out = on.post("/update_weights_from_disk", {"model_path": str(on.model_dir)})
    assert status == 400 and out["success"] is False, out
    assert out["message"].startswith("npu-shim refused update_weights_from_disk: loading weights "
                                     "from disk would write into MLA weights"), out
    assert "NPU_SHIM_MLA_WEIGHT_RELEASE=0" in out["message"]
    pids = mla.schedulers(on)
    refusals = [ln for ln in on.log_text().splitlines()
                if "refused update_weights_from_disk: MLA weights are released in pid" in ln]
    assert sorted(int(re.search(r"in pid (\d+)", ln).group(1)) for ln in refusals) == sorted(pids.values()), refusals
    # each rank's metrics say so, written as it refused (a rank may answer after the response:
    # polled, bounded)
    deadline = time.monotonic() + 30
    while True:
        refused = {rank: patch["details"].get("updates_refused")
                   for rank, patch in mla.release_details(on).items()}
        if refused == {rank: 1 for rank in range(TP)} or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert refused == {rank: 1 for rank in range(TP)}, refused
    assert [mla.decode(on, p, NEW_TOKENS) for p in PROMPTS] == before


def test_sglang_0_5_20_s_own_release_frees_on_each_rank_what_the_backport_frees(bed):
    """Upstream beside the backport: the same model (the same weights), decode role, TP 2, graphs
    on.  On 0.5.20 the shim stands down (``upstream``) and sglang's own ``resize_(0)``s free the
    fused qkv_a weight and ``w_kc``; on 0.5.11 the backport does.  Per rank, the storages resized
    to 0 before the first capture hold the same bytes on both, which are the backport's reported
    figure and the shapes'; upstream's, too, are all done with no capture live, and both decode
    the same tokens (asked last: starting it stops the oldest server)."""
    on = bed.get("on")
    expected = mla.expected_release(on.model_dir, TP)
    backport, backport_details = bed.memory("on"), bed.details("on")
    upstream, upstream_details = bed.memory("upstream"), bed.details("upstream")
    assert sorted(upstream) == sorted(backport) == list(range(TP)), (upstream, backport)
    up = bed.get("upstream")
    assert json.loads((up.model_dir / "config.json").read_text())["num_hidden_layers"] == \
        json.loads((on.model_dir / "config.json").read_text())["num_hidden_layers"]
    assert (up.model_dir / "model.safetensors").read_bytes() == (on.model_dir / "model.safetensors").read_bytes()
    assert "Capture target decode NPU graph end" in up.log_text()
    for rank in range(TP):
        assert upstream_details[rank]["state"] == "upstream", upstream_details
        events = mla.graph_events(upstream[rank])
        kinds = [e[0] for e in events]
        assert kinds.count("capture_begin") == len(mla.GRAPH_BATCH_SIZES) and "replay" in kinds, (rank, kinds)
        assert all(e[3] is None for e in events if e[0] == "storage_resize"), (rank, events)
        freed_upstream = mla.released_before_capture(upstream[rank])
        freed_backport = mla.released_before_capture(backport[rank])
        assert sorted(freed_upstream) == sorted(freed_backport), (rank, freed_upstream, freed_backport)
        assert sum(freed_upstream) == backport_details[rank]["details"]["released_bytes"] == \
            sum(expected.values()), (rank, freed_upstream, backport_details[rank])
    assert bed.answers("upstream") == bed.answers("on")
