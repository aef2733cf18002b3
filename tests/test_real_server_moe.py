"""dual_stream_experts inside a real sglang server: GLM-4 MoE served by ``sglang.launch_server``
of 0.5.8 with ``--moe-a2a-backend deepep`` and ``SGLANG_NPU_USE_MULTI_STREAM=1`` on the simulated
NPU (dev/shimdev/server/, the MoE ops of simnpu/_ops.py, DeepEP of simnpu/_deepep.py).

Why 0.5.8 and not 0.5.9: 0.5.9's bf16 DeepEP expert path on NPU hands ``npu_grouped_matmul`` its
expert weights in the wrong orientation (``unquant.py`` transposes them at load time, new in 0.5.9;
``npu_fused_moe_without_routing_weights_bf16`` still permutes them back, as 0.5.7/0.5.8 needed;
0.5.10 dropped the permute): a bf16 GLM-4 MoE with DeepEP does not serve on a 0.5.9 image, with or
without the shim -- the simulated grouped matmul stops it as the device does (docs/development.md,
"GLM-4 MoE in a real server").  0.5.8 is in the backport's range and serves it.

One server per configuration, on one xdist worker, at most two alive:

* ``on``: the shim, zbal in full mode (so DeepEP goes through zbal's ``Buffer``), the fused
  kernel in the image (``SIMNPU_FUSED_KERNEL``), the stream sanitizer in every spawned process for
  its whole life (``SIMNPU_SANITIZE_DIR``);
* ``off``: the same job without the shim (sgl-kernel-npu's ``deep_ep``);
* ``cpu``: ``--device cpu`` (sglang's CPU MoE, no DeepEP), the reference tokens;
* ``spec-on`` / ``spec-off``: the ``on`` / ``off`` job with a draft model: the checkpoint's NextN
  (MTP) layer, ``--speculative-algorithm NEXTN`` (moe_job.SPEC_ARGS).  No ``--device cpu`` arm:
  0.5.8's DraftBackendFactory has no CPU attention backend (torch_native / intel_amx raise "EAGLE
  is not supported in attention backend ...").

Checked: the same tokens on all three (against the CPU: or one request parting at a near-tie of the
CPU's two best tokens, ``NEAR_TIE``); on ``on`` the dual-stream forward_deepep ran once per
prefill of the MoE layer and the fused split_qkv_rmsnorm_rope once per decode step of each
layer, read from the patch's counts in sglang's ``/metrics`` (the shim arms run with
``--enable-metrics --decode-log-interval 1``: the counts are published after every decode batch);
the sanitizer followed the
scheduler's kernels on the main and side streams and reported nothing.  With the draft: the same
tokens shim on and off, and the target's (speculative greedy decoding is the target's greedy
decoding); each target-verify batch once through the dual-stream forward_deepep and twice through
the fused kernel, counted per request in ``/metrics``; the sanitizer silent; one main stream (and
so one side stream, ``side_stream_count``) for the target and the draft.
"""
from __future__ import annotations

import json
import re
import time

import pytest

from shimdev.server import models, moe_job
from shimdev.server.pool import ServerPool
from shimdev.server.process import Server, current_states, free_port, schedulers, shim_metrics

VERSION = "0.5.8"
HEAP_MIB = 256
TOKEN_PROMPTS = ([5, 6, 7, 8], [100, 200, 300, 400, 500, 600, 700])
CHAT = "Hello, who are you?"
NEW_TOKENS = 8
NPU_ARGS, NPU_ENV = list(moe_job.NPU_ARGS), moe_job.NPU_ENV   # the job: dev/shimdev/server/moe_job.py
CPU_ARGS, CPU_ENV = list(moe_job.CPU_ARGS), moe_job.CPU_ENV
SPEC_ARGS = list(moe_job.SPEC_ARGS)
#: Where the shim is on: sglang's metrics, logged (and so the shim's counts published) after every
#: decode batch instead of every 40th.
METRICS_ARGS = ["--enable-metrics", "--decode-log-interval", "1"]
MAX_LIVE = 2

#: The tests share their servers: one xdist worker runs them all.
ON_ONE_WORKER = pytest.mark.xdist_group("server-moe-" + VERSION)


#: How close the CPU's two best next tokens may be where the NPU path picks the second: the NPU
#: ops accumulate and round in their own order (float32 sums, bf16 outputs), so a near-tie of a
#: random tiny model may go either way; anything wider is a different computation.
NEAR_TIE = 0.05  # nats


def answers(server: Server) -> dict:
    """The fixed greedy requests; with how many tokens each decoded (its output tokens but the
    first, which its prefill gives) and, per generated token, the two best next tokens and their
    log-probabilities."""
    client = server.openai()
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": CHAT}],
                                          max_tokens=NEW_TOKENS, temperature=0)
    generated, top2 = [], []
    for prompt in TOKEN_PROMPTS:
        status, out = server.post("/generate", {
            "input_ids": list(prompt), "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}})
        assert status == 200, out
        generated.append(out["output_ids"])
        top2.append([[(float(e[0]), int(e[1])) for e in step[:2]]
                     for step in out["meta_info"]["output_top_logprobs"]])
    outputs = [len(g) for g in generated] + [chat.usage.completion_tokens]
    return {"generate": generated, "chat": chat.choices[0].message.content, "top2": top2,
            "decode_steps": sum(n - 1 for n in outputs), "prefills": len(outputs)}


def same_or_near_tie(npu_tokens, cpu_tokens, cpu_top2):
    """The NPU's greedy tokens are the CPU's, or they part where the CPU's two best were within
    NEAR_TIE and the NPU took the second; returns where they part (None: nowhere)."""
    for i, (a, b) in enumerate(zip(npu_tokens, cpu_tokens)):
        if a != b:
            (best, first), (second, runner_up) = cpu_top2[i]
            # an exact tie may list the two either way round: greedy took one of them
            assert {first, runner_up} == {a, b} and best - second <= NEAR_TIE, (
                "step %d: the NPU path took %d where the CPU's best two were %r" % (i, a, cpu_top2[i]))
            return i
    assert len(npu_tokens) == len(cpu_tokens)
    return None


class Servers:
    def __init__(self, tmp):
        self.tmp, self.pool, self.answers = tmp, ServerPool(MAX_LIVE), {}

    def get(self, name):
        return self.pool.get(name, lambda: self._start(name))

    def _start(self, name):
        spec = name.startswith("spec-")
        model = models.ensure_model("glm4_moe_mtp" if spec else "glm4_moe", VERSION)
        arm = name[len("spec-"):] if spec else name
        if arm == "cpu":
            env, args, shim, zbal = dict(CPU_ENV), CPU_ARGS, "absent", False
        else:
            env, args, zbal = dict(NPU_ENV), NPU_ARGS + (SPEC_ARGS if spec else []), arm == "on"
            if arm == "on":
                args = args + METRICS_ARGS
            shim = "on" if arm == "on" else "absent"
        if arm == "on":
            (self.tmp / name).mkdir()
            env.update({"SGLANG_ZBAL_LOCAL_MEM_SIZE": HEAP_MIB,
                        "SGLANG_ZBAL_BOOTSTRAP_URL": "tcp://127.0.0.1:%d" % free_port(),
                        # a directory each: one server's sanitizer files only
                        "SIMNPU_SANITIZE_DIR": str(self.tmp / name / "sanitizer")})
        server = Server(VERSION, model, args=args, env=env, zbal=zbal, shim=shim,
                        log_path=self.tmp / f"moe-{name}.log", ready_timeout=420)
        server.start()
        return server

    def answers_of(self, name):
        if name not in self.answers:
            server = self.get(name)
            assert name in self.pool.live, "%s was stopped before it answered" % name
            self.answers[name] = answers(server)
        return self.answers[name]

    def stop_all(self):
        self.pool.stop_all()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    bed = Servers(tmp_path_factory.mktemp("moe-servers"))
    yield bed
    bed.stop_all()


def scheduler_counts(server) -> tuple[str, dict]:
    """The dual-stream patch's state and numbers in the scheduler (its counts, ``side_stream_count``),
    from the server's ``/metrics`` (the scheduler's pid from its process title, ``sglang::scheduler``)."""
    (pid,) = schedulers(server).values()
    metrics = shim_metrics(server)
    counts = metrics["detail"].get((pid, "dual_stream_experts"), {})
    return current_states(metrics)[(pid, "dual_stream_experts")], {k: int(v) for k, v in counts.items()}


def sanitizer_files(server) -> dict:
    """{process title: its sanitizer file} of the server's live processes."""
    from pathlib import Path

    out = {}
    for path in Path(server.env["SIMNPU_SANITIZE_DIR"]).glob("sanitizer-*.json"):
        data = json.loads(path.read_text())
        out[data["title"]] = data
    return out


@ON_ONE_WORKER
def test_the_dual_stream_and_fused_paths_ran_and_sglangs_metrics_say_how_often(servers):
    done = servers.answers_of("on")
    # published after each decode batch: polled, bounded (the scheduler is live: this file's
    # tests run in order, the server with the most checks first)
    deadline = time.monotonic() + 15
    while True:
        state, counts = scheduler_counts(servers.get("on"))
        if counts.get("fused_python_calls", 0) >= 2 * done["decode_steps"] or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert state == "applied", state
    # one MoE layer (first_k_dense_replace=1): the dual-stream forward_deepep once per prefill
    # (the readiness probe's /health_generate included); two attention layers: the fused kernel
    # twice per decode step
    # (no NPU graphs here: every forward runs Python, so every one is counted)
    assert counts["dual_stream_python_calls"] >= done["prefills"], counts
    assert counts["fused_python_calls"] == 2 * done["decode_steps"] > 0, (counts, done)


@ON_ONE_WORKER
def test_the_stream_sanitizer_followed_the_scheduler_and_stayed_silent(servers):
    servers.answers_of("on")
    assert_sanitizer_followed_the_scheduler_and_stayed_silent(servers.get("on"))


def assert_sanitizer_followed_the_scheduler_and_stayed_silent(server):
    """The scheduler's sanitizer saw its main stream and side streams over a whole run (more than
    a thousand launches), and no process's sanitizer reported anything."""
    files = sanitizer_files(server)
    (scheduler,) = [d for title, d in files.items() if title.startswith("sglang::scheduler")]
    side = [s for s in scheduler["streams"] if s.startswith("side-")]
    assert "main" in scheduler["streams"] and side, scheduler["streams"]
    assert scheduler["launches"] > 1000, scheduler["launches"]
    for title, data in files.items():
        assert data["reports"] == [], (title, [r["message"] for r in data["reports"]])


@ON_ONE_WORKER
def test_the_same_tokens_with_the_shim_without_it_and_on_the_cpu(servers):
    on = servers.answers_of("on")
    off = servers.answers_of("off")
    assert {k: on[k] for k in ("generate", "chat")} == {k: off[k] for k in ("generate", "chat")}
    cpu = servers.answers_of("cpu")
    parted = [same_or_near_tie(a, b, top2) for a, b, top2 in zip(on["generate"], cpu["generate"], cpu["top2"])]
    # at most one request parts at a near-tie; the rest, and the chat, are the CPU's exactly
    assert sum(p is not None for p in parted) <= 1, parted
    assert on["chat"] == cpu["chat"]
    # DeepEP went through zbal's Buffer with the shim, through sgl-kernel-npu's deep_ep without
    on_log, off_log = servers.get("on").log_text(), servers.get("off").log_text()
    assert re.search(r"^\[simzbal\] deepep_adaptor\.Buffer: rank 0 of 1", on_log, re.M), on_log[-3000:]
    assert "[simnpu] deep_ep.Buffer" not in on_log
    assert "[simnpu] deep_ep.Buffer: rank 0 of 1" in off_log and "[simzbal]" not in off_log


# -- with a draft model (MTP / NextN) ---------------------------------------------------------------

def generate_one(server, prompt):
    status, out = server.post("/generate", {
        "input_ids": list(prompt),
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}})
    assert status == 200, out
    return out


def settled_counts(server, done=lambda counts: True):
    """The dual-stream patch's state and counts in ``/metrics`` once ``done(counts)`` holds
    (published after each decode batch), or as they stand after 15 s."""
    deadline = time.monotonic() + 15
    while True:
        state, counts = scheduler_counts(server)
        if done(counts) or time.monotonic() > deadline:
            return state, counts
        time.sleep(1)


@ON_ONE_WORKER
def test_with_a_draft_model_each_verify_batch_takes_the_dual_stream_and_fused_paths(servers):
    done = servers.answers_of("spec-on")
    server = servers.get("spec-on")
    assert "spec-on" in servers.pool.live
    # the requests above are answered: the counts stand still once published
    _, before = settled_counts(server, lambda c: c.get("fused_python_calls", 0) > 0)
    time.sleep(2)
    _, before = settled_counts(server)
    out = generate_one(server, [11, 12, 13, 14, 15])
    verifies = out["meta_info"]["spec_verify_ct"]
    assert verifies >= 1, out["meta_info"]
    state, after = settled_counts(
        server, lambda c: c["fused_python_calls"] >= before["fused_python_calls"] + 2 * verifies)
    delta = {k: after[k] - before[k] for k in after}
    assert state == "applied", state
    # one target-verify batch per verify step (one request at a time), each through the MoE layer
    # once on two streams; the other dual-stream calls are the target's prefill and the draft's
    # extends (its NextN layer is an MoE layer too): one after the prefill and one after each
    # verify but the last -- eagle_worker.forward_batch_generation skips the draft extend once the
    # verify finished the request (``verified_id`` empty)
    assert delta["dual_stream_verify_python_calls"] == verifies, (delta, out["meta_info"])
    assert delta["dual_stream_python_calls"] == 1 + 1 + verifies + (verifies - 1), (delta, out["meta_info"])
    # the fused kernel: in the target's two layers of each verify batch (draft extends are extend)
    assert delta["fused_python_calls"] == 2 * verifies, (delta, out["meta_info"])
    assert after["dual_stream_verify_python_calls"] >= done["prefills"] > 0, after
    # the target and the draft run on one main stream (the scheduler's), so one side stream serves
    # both: 0.5.8's EAGLE worker makes no stream of its own
    assert after["side_stream_count"] == 1, after


@ON_ONE_WORKER
def test_with_a_draft_model_the_stream_sanitizer_stayed_silent(servers):
    servers.answers_of("spec-on")
    assert_sanitizer_followed_the_scheduler_and_stayed_silent(servers.get("spec-on"))


@ON_ONE_WORKER
def test_with_a_draft_model_the_same_tokens_with_and_without_the_shim_and_as_the_target_alone(servers):
    on = servers.answers_of("spec-on")
    off = servers.answers_of("spec-off")
    assert {k: on[k] for k in ("generate", "chat")} == {k: off[k] for k in ("generate", "chat")}
    # the MTP checkpoint's target layers are the glm4_moe model's, bit for bit (one seed, one
    # config but the extra layer): greedy speculative decoding gives the target's greedy tokens --
    # or parts at a near-tie (a verify batch attends through npu_fused_infer_attention_score, a
    # decode step through _npu_paged_attention: two orders of summation)
    alone = servers.answers_of("off")
    parted = [same_or_near_tie(a, b, top2) for a, b, top2 in zip(on["generate"], alone["generate"], alone["top2"])]
    assert sum(p is not None for p in parted) <= 1, parted
    assert servers.get("spec-on").log_text().count("[simzbal] deepep_adaptor.Buffer") >= 1
