"""A real sglang MLA decode server on the simulated NPU, and what is read from it.

The tiny DSA model (``models.ensure_model("dsa", ...)``) served as a PD decode server with
sglang's ``fake`` transfer backend and ``SGLANG_NPU_USE_MLAPO=1`` reaches ``npu_mla_preprocess`` ->
``forward_mlaprolog`` at every decode step (docs/development.md, "A real MLA decode server").
Used by tests/test_real_server_mla.py and scripts/bench_mla_server.py.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import signal
import time
from pathlib import Path

from shimdev.envs.releases import version_key
from shimdev.server import models
from shimdev.server.process import Server, ServerError, current_states, schedulers, shim_metrics

#: sglang's stand-in bootstrap host of the fake transfer backend (sglang.srt.disaggregation.utils
#: FAKE_BOOTSTRAP_HOST; 0.5.11's decode server cannot take a request without a bootstrap host).
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
BOOTSTRAP_PORT = 8998  # sglang's --disaggregation-bootstrap-port default


def decode_args(tp: int) -> list[str]:
    return ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake",
            "--mem-fraction-static", "0.5", "--max-total-tokens", "4096",
            "--max-running-requests", "8", "--tp-size", str(tp)]


#: The batch sizes a graph-mode decode server captures.
GRAPH_BATCH_SIZES = (1, 2)


def graph_bs_flag(version: str) -> str:
    """The flag that sets the decode batch sizes captured: ``--cuda-graph-bs`` up to 0.5.13;
    ``--cuda-graph-bs-decode`` from 0.5.14 (0.5.14 - 0.5.19 keep ``--cuda-graph-bs`` as a
    deprecated alias, 0.5.20 drops it: argparse calls it ambiguous there)."""
    return "--cuda-graph-bs-decode" if version_key(version) >= version_key("0.5.14") else "--cuda-graph-bs"


def decode_server(version: str, tp: int, shim: str, workdir: Path, name: str,
                  device_mib: int = 1024, graphs: bool = False) -> Server:
    """A decode server (not started, ``--enable-metrics``): ``shim`` "on" or "absent"; every
    process of it writes its device counters to ``workdir/memory-<name>`` on SIGUSR2.  ``graphs``:
    NPU graphs on (the harness's ``--disable-cuda-graph`` dropped; GRAPH_BATCH_SIZES captured)."""
    memory = Path(workdir) / f"memory-{name}"
    memory.mkdir(parents=True, exist_ok=True)
    env = {"SIMNPU_TOTAL_MIB": device_mib, "SGLANG_NPU_USE_MLAPO": "1",
           "SIMNPU_TRACK_DERIVED": "1", "SIMNPU_MEMORY_DIR": str(memory)}
    model = models.ensure_model("dsa", version)
    server = Server(version, model, args=decode_args(tp) + ["--enable-metrics"], env=env, shim=shim,
                    log_path=Path(workdir) / f"mla-{name}.log")
    server.model_dir = model
    if graphs:  # in argv and in args, which the suite's cost report names the server by
        graph_args = [graph_bs_flag(version), *map(str, GRAPH_BATCH_SIZES)]
        server.argv = [a for a in server.argv if a != "--disable-cuda-graph"] + graph_args
        server.args = [a for a in server.args if a != "--disable-cuda-graph"] + graph_args
    return server


_rooms = itertools.count(1000)
_rids = itertools.count()


def fake_handoff_token(rid: str, vocab_size: int) -> int:
    """The first token a fake-backend decode server of sglang 0.5.20+ gives request ``rid``:
    ``_generate_fake_prefill_handoff_output_id`` (sglang.srt.disaggregation.decode) hashes the
    request id, where 0.5.9 - 0.5.19 take the metadata buffer's token, which the fake transfer
    leaves 0."""
    digest = hashlib.blake2b(rid.encode(), digest_size=8, person=b"fake-pd").digest()
    return int.from_bytes(digest, byteorder="little") % vocab_size


def zero_handoff_rid(vocab_size: int) -> str:
    """A fresh request id whose 0.5.20+ fake handoff token is 0, the token 0.5.9 - 0.5.19 start
    from: the same request then decodes the same tokens on both (the same model and path)."""
    while True:
        rid = "npu-shim-mla-%d" % next(_rids)
        if fake_handoff_token(rid, vocab_size) == 0:
            return rid


def decode(server: Server, input_ids, new_tokens: int = 8, rid: str | None = None) -> list[int]:
    """Greedy tokens of a request sent to the decode server as a PD router sends it (bootstrap
    host, port and a fresh room); ``rid``: the request id (sglang makes one when None)."""
    request = {
        "input_ids": list(input_ids),
        "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
        "bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_port": BOOTSTRAP_PORT,
        "bootstrap_room": next(_rooms)}
    if rid is not None:
        request["rid"] = rid
    status, out = server.post("/generate", request)
    if status != 200:
        raise ServerError(f"/generate answered {status}: {out}\n{server.log_tail()}")
    return out["output_ids"]


def expected_release(model_dir, tp: int) -> dict:
    """Bytes one TP rank releases, from the model's shapes: the fused qkv_a weight (replicated:
    ``hidden x (q_lora + kv_lora + rope)``) and ``w_kc`` (its heads split over TP: ``heads/tp x
    nope x kv_lora``), bf16, every layer."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    layers = c["num_hidden_layers"]
    qkv_a = c["hidden_size"] * (c["q_lora_rank"] + c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2
    w_kc = c["num_attention_heads"] // tp * c["qk_nope_head_dim"] * c["kv_lora_rank"] * 2
    return {"qkv_a": layers * qkv_a, "w_kc": layers * w_kc}


def device_memory(server: Server, pid: int, timeout: float = 30) -> dict:
    """The simulated device's counters in process ``pid`` (it writes them on SIGUSR2)."""
    path = os.path.join(server.env["SIMNPU_MEMORY_DIR"], f"{pid}.json")
    if os.path.exists(path):
        os.remove(path)
    os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as fh:
                return json.load(fh)
        time.sleep(0.1)
    raise ServerError(f"pid {pid} wrote no memory snapshot\n{server.log_tail()}")


def devices(server: Server) -> dict:
    """TP rank -> that scheduler's device counters now."""
    return {rank: device_memory(server, pid) for rank, pid in schedulers(server).items()}


def release_details(server: Server) -> dict:
    """TP rank -> mla_weight_release's ``state`` and numeric ``details`` in that scheduler, from
    the server's ``/metrics`` (each scheduler's pid from its process title)."""
    metrics = shim_metrics(server)
    states = current_states(metrics)
    return {rank: {"state": states[(pid, "mla_weight_release")],
                   "details": {k: int(v) if float(v).is_integer() else v
                               for k, v in metrics["detail"].get((pid, "mla_weight_release"), {}).items()}}
            for rank, pid in schedulers(server).items()}


def graph_events(snapshot: dict) -> list:
    """A rank's captures and device storage resizes, in order (``devices()``'s snapshot):
    ``["capture_begin", graph, stream, pool]``, ``["capture_end", ...]``, ``["storage_resize",
    bytes_before, bytes_after, graph live or None]``."""
    return snapshot["graph_events"]


def released_before_capture(snapshot: dict) -> list[int]:
    """The bytes each device storage resize to 0 freed before a rank's first capture, in order
    (``devices()``'s snapshot): what a release in the eager warm-up gave back, whoever did it --
    the shim's ``mla_weight_release`` or sglang 0.5.20's own ``resize_(0)``."""
    events = graph_events(snapshot)
    kinds = [e[0] for e in events]
    first = kinds.index("capture_begin") if "capture_begin" in kinds else len(events)
    return [e[1] - e[2] for e in events[:first] if e[0] == "storage_resize" and e[2] == 0]
