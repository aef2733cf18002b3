"""dual_stream_experts inside a real sglang server: GLM-4 MoE served by ``sglang.launch_server``
of 0.5.8 with ``--moe-a2a-backend deepep`` and ``SGLANG_NPU_USE_MULTI_STREAM=1`` on the simulated
NPU (dev/shimdev/server/, the MoE ops of simnpu/_ops/, DeepEP of simnpu/_deepep.py), with NPU
graphs on as production runs it (sglang's default on Ascend: batch sizes 1 and 2, each warmed up
twice and captured into one pool, then replayed).

Why 0.5.8 and not 0.5.9: 0.5.9's bf16 DeepEP expert path on NPU hands ``npu_grouped_matmul`` its
expert weights in the wrong orientation (``unquant.py`` transposes them at load time, new in 0.5.9;
``npu_fused_moe_without_routing_weights_bf16`` still permutes them back, as 0.5.7/0.5.8 needed;
0.5.10 dropped the permute): a bf16 GLM-4 MoE with DeepEP does not serve on a 0.5.9 image, with or
without the shim -- the simulated grouped matmul stops it as the device does (docs/development.md,
"GLM-4 MoE in a real server").  0.5.8 is in the backport's range and serves it.

One server per configuration, on one xdist worker, at most two alive, shared by the tests through
the module's fixture (answers are kept when a server is stopped to make room):

* ``on``: the shim, graphs on (decode captured), zbal in full mode (so DeepEP goes through zbal's
  ``Buffer``), the fused kernel in the image (``SIMNPU_FUSED_KERNEL``), the stream sanitizer in
  every spawned process for its whole life (``SIMNPU_SANITIZE_DIR``), a journal of each process's
  graph events and stream forks and joins (``SIMNPU_JOURNAL_DIR``, shimdev.server.journal);
* ``cpu``: ``--device cpu`` (sglang's CPU MoE, no DeepEP), the reference tokens;
* ``spec-on`` / ``spec-off``: with a draft model -- the checkpoint's NextN (MTP) layer,
  ``--speculative-algorithm NEXTN`` (moe_job.SPEC_ARGS) -- graphs on, so the target-verify forward
  is captured (0.5.8's CudaGraphRunner captures TARGET_VERIFY under speculative decoding), shim on
  (as ``on``) and without the shim (sgl-kernel-npu's ``deep_ep``);
* ``spec-eager``: ``spec-on`` with graphs off -- the one eager server, for the graphs-off tokens and
  the per-verify counts of an eager target-verify.  No ``--device cpu`` arm with the draft: 0.5.8's
  DraftBackendFactory has no CPU attention backend (torch_native / intel_amx raise "EAGLE is not
  supported in attention backend ...").

Checked: the same tokens graphs on, graphs off and without the shim, and as on the CPU (where a
request parts, only at a near-tie of the reference's two best tokens, ``NEAR_TIE``); decode
captured with the fused ``split_qkv_rmsnorm_rope`` in each attention layer and replayed once per
decode step; the target-verify captures, each with the side stream forked from
the capture stream and joined back inside it, the side stream made in a warm-up before any
capture, its allocations in the captures' pool (zbal's graph pool in its heap); each replay
forking and joining it on the replaying stream; the sanitizer on in the scheduler for the whole
run, following those edges, silent.  The patch's
counts in sglang's ``/metrics`` (the shim arms run with ``--enable-metrics --decode-log-interval
1``: published after every decode batch) are Python calls: eager forwards, warm-ups and captures;
a replay adds nothing.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from shimdev.server import journal, models, moe_job
from shimdev.server.pool import ServerPool
from shimdev.server.process import GRAPH_ARGS, Server, current_states, free_port, schedulers, shim_metrics

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
#: The batch sizes captured (process.GRAPH_ARGS), each warmed up twice and captured once: the
#: Python calls of a captured forward pass, per size.
GRAPH_BS = [int(b) for b in GRAPH_ARGS[1:]]
CALLS_PER_SIZE = 3
#: The tiny GLM-4 MoE (models.py): two decoder layers, the second one MoE (first_k_dense_replace=1).
ATTENTION_LAYERS, MOE_LAYERS = 2, 1

#: The tests share their servers: one xdist worker runs them all.
ON_ONE_WORKER = pytest.mark.xdist_group("server-moe-" + VERSION)


#: How close the CPU's two best next tokens may be where the NPU path picks the second: the NPU
#: ops accumulate and round in their own order (float32 sums, bf16 outputs), so a near-tie of a
#: random tiny model may go either way; anything wider is a different computation.
NEAR_TIE = 0.05  # nats


def answers(server: Server) -> dict:
    """The fixed greedy requests: the two ``/generate`` prompts and the openai chat, each as its
    output tokens (ids; the chat's as token strings) with, per generated token, the two best next
    tokens and their log-probabilities; and how many tokens were decoded (each request's output
    tokens but the first, which its prefill gives)."""
    client = server.openai()
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": CHAT}],
                                          max_tokens=NEW_TOKENS, temperature=0, logprobs=True, top_logprobs=2)
    tokens, top2 = [], []
    for prompt in TOKEN_PROMPTS:
        status, out = server.post("/generate", {
            "input_ids": list(prompt), "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}})
        assert status == 200, out
        tokens.append(out["output_ids"])
        top2.append([[(float(e[0]), int(e[1])) for e in step[:2]]
                     for step in out["meta_info"]["output_top_logprobs"]])
    steps = chat.choices[0].logprobs.content
    tokens.append([step.token for step in steps])
    top2.append([[(float(t.logprob), t.token) for t in step.top_logprobs[:2]] for step in steps])
    outputs = [len(t) for t in tokens[:-1]] + [chat.usage.completion_tokens]
    return {"tokens": tokens, "chat": chat.choices[0].message.content, "top2": top2,
            "decode_steps": sum(n - 1 for n in outputs), "prefills": len(outputs)}


def same_or_near_tie(npu_tokens, ref_tokens, ref_top2):
    """The greedy tokens are the reference's, or they part where the reference's two best were
    within NEAR_TIE and the other took the second; returns where they part (None: nowhere)."""
    for i, (a, b) in enumerate(zip(npu_tokens, ref_tokens)):
        if a != b:
            (best, first), (second, runner_up) = ref_top2[i]
            # an exact tie may list the two either way round: greedy took one of them
            assert {first, runner_up} == {a, b} and best - second <= NEAR_TIE, (
                "step %d: took %r where the reference's best two were %r" % (i, a, ref_top2[i]))
            return i
    assert len(npu_tokens) == len(ref_tokens)
    return None


def assert_same_tokens(got: dict, ref: dict, parting: int = 1) -> list:
    """Every request's tokens are the reference's, but at most ``parting`` requests parting at a
    near-tie of the reference's two best tokens (this tiny random model's chat meets a tie at its
    sixth token: its two best within 1e-4 nats on the NPU, which another order of summation or
    rounding -- the CPU's, the fused kernel's -- may turn either way); returns where each parts."""
    parted = [same_or_near_tie(a, b, t) for a, b, t in zip(got["tokens"], ref["tokens"], ref["top2"])]
    assert sum(p is not None for p in parted) <= parting, parted
    return parted


class Servers:
    """The module's servers by name (``on``, ``cpu``, ``spec-on``, ``spec-off``, ``spec-eager``),
    started on first use, and the answers each gave."""

    def __init__(self, tmp):
        self.tmp, self.pool, self.answers = tmp, ServerPool(MAX_LIVE), {}

    def get(self, name):
        return self.pool.get(name, lambda: self._start(name))

    def _start(self, name):
        spec = name.startswith("spec-")
        model = models.ensure_model("glm4_moe_mtp" if spec else "glm4_moe", VERSION)
        arm = name[len("spec-"):] if spec else name
        workdir = self.tmp / name
        workdir.mkdir()
        if arm == "cpu":
            env, args, shim, zbal, graphs = dict(CPU_ENV), CPU_ARGS, "absent", False, False
        else:
            shim_on = arm in ("on", "eager")
            env, args = dict(NPU_ENV), NPU_ARGS + (SPEC_ARGS if spec else [])
            shim, zbal, graphs = "on" if shim_on else "absent", shim_on, arm != "eager"
            (workdir / "journal").mkdir()
            env.update({"SIMNPU_JOURNAL_DIR": str(workdir / "journal"),
                        "SIMNPU_JOURNAL_KINDS": "stream_create,wait_stream"})
            if shim_on:
                args = args + METRICS_ARGS
                env.update({"SGLANG_ZBAL_LOCAL_MEM_SIZE": HEAP_MIB,
                            "SGLANG_ZBAL_BOOTSTRAP_URL": "tcp://127.0.0.1:%d" % free_port(),
                            # a directory each: one server's sanitizer files only
                            "SIMNPU_SANITIZE_DIR": str(workdir / "sanitizer")})
        server = Server(VERSION, model, args=args, env=env, zbal=zbal, shim=shim, graphs=graphs,
                        log_path=self.tmp / f"moe-{name}.log", ready_timeout=420)
        server.start()
        server.journal_dir = workdir / "journal"
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


def settled_counts(server, done=lambda counts: True):
    """The dual-stream patch's state and counts in ``/metrics`` once ``done(counts)`` holds
    (published after each decode batch), or as they stand after 15 s."""
    deadline = time.monotonic() + 15
    while True:
        state, counts = scheduler_counts(server)
        if done(counts) or time.monotonic() > deadline:
            return state, counts
        time.sleep(1)


def sanitizer_files(server) -> dict:
    """{process title: its sanitizer file} of the server's live processes."""
    out = {}
    for path in Path(server.env["SIMNPU_SANITIZE_DIR"]).glob("sanitizer-*.json"):
        data = json.loads(path.read_text())
        out[data["title"]] = data
    return out


def assert_sanitizer_followed_the_scheduler_and_stayed_silent(server, streams=()):
    """The scheduler's sanitizer saw its main stream and side streams (``streams`` among them) over
    a whole run (more than a thousand launches), and no process's sanitizer reported anything."""
    files = sanitizer_files(server)
    (scheduler,) = [d for title, d in files.items() if title.startswith("sglang::scheduler")]
    side = [s for s in scheduler["streams"] if s.startswith("side-")]
    assert "main" in scheduler["streams"] and side, scheduler["streams"]
    assert set(streams) <= set(scheduler["streams"]), (streams, scheduler["streams"])
    assert scheduler["launches"] > 1000, scheduler["launches"]
    for title, data in files.items():
        assert data["reports"] == [], (title, [r["message"] for r in data["reports"]])


def scheduler_journal(server) -> list[dict]:
    """The journal of the server's scheduler, the one process that captured graphs."""
    (entries,) = [entries for entries in journal.read(server.journal_dir).values()
                  if any(e["event"][0] == "capture_begin" for e in entries)]
    return entries


def captures(entries) -> list[dict]:
    """Each capture of a scheduler's journal: its stream, pool, the stream events inside it (made,
    forked, joined) and what it allocated by stream (``capture_allocations``)."""
    events = [e["event"] for e in entries]
    out = []
    for begin, event in enumerate(events):
        if event[0] != "capture_begin":
            continue
        end = events.index(["capture_end", *event[1:]], begin)
        inside = events[begin + 1:end]
        (allocated,) = [e[3] for e in inside if e[0] == "capture_allocations"]
        out.append({"stream": event[2], "pool": event[3], "begin": begin,
                    "streams": [e for e in inside if e[0] in ("stream_create", "wait_stream")],
                    "allocated": allocated})
    return out


def replays(entries) -> int:
    return sum(e["event"][0] == "replay" for e in entries)


def generate_one(server, prompt):
    status, out = server.post("/generate", {
        "input_ids": list(prompt),
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}})
    assert status == 200, out
    return out


# -- the target alone: decode captured --------------------------------------------------------------

@ON_ONE_WORKER
def test_decode_is_captured_with_the_fused_kernel_and_the_counts_are_python_calls_not_replays(servers):
    done = servers.answers_of("on")
    server = servers.get("on")
    state, counts = settled_counts(server, lambda c: c.get("dual_stream_python_calls", 0) >= done["prefills"])
    assert state == "applied", state
    entries = scheduler_journal(server)
    graphs = captures(entries)
    # decode of each batch size captured once, into one pool; decode stays single-stream (no fork
    # inside a decode capture), and every decode step of the requests was a replay
    assert len(graphs) == len(GRAPH_BS) and len({tuple(g["pool"]) for g in graphs}) == 1, graphs
    assert all(g["streams"] == [] for g in graphs), graphs
    assert replays(entries) == done["decode_steps"] > 0, (replays(entries), done)
    # the fused split_qkv_rmsnorm_rope ran Python in both attention layers of each warm-up and
    # capture -- and never again: the decode steps were replays of the captured kernel
    assert counts["fused_python_calls"] == CALLS_PER_SIZE * len(GRAPH_BS) * ATTENTION_LAYERS, counts
    # the dual-stream forward_deepep once per prefill (eager; the readiness probe's included)
    assert counts["dual_stream_python_calls"] >= done["prefills"], counts
    assert counts["dual_stream_verify_python_calls"] == 0, counts
    assert counts["side_stream_count"] == 1, counts  # the default stream's, made by a prefill


@ON_ONE_WORKER
def test_the_stream_sanitizer_followed_the_scheduler_and_stayed_silent(servers):
    servers.answers_of("on")
    assert_sanitizer_followed_the_scheduler_and_stayed_silent(servers.get("on"))


@ON_ONE_WORKER
def test_graphs_on_serve_the_cpu_s_tokens_through_zbal_s_deepep_buffer(servers):
    # the CPU sums and rounds in other orders than the NPU path, and two of the three requests
    # meet a near-tie (the first prompt at its second token, the chat at its sixth): those may
    # part there, at the CPU's runner-up; the third is the CPU's exactly
    assert_same_tokens(servers.answers_of("on"), servers.answers_of("cpu"), parting=2)
    # DeepEP went through zbal's Buffer with the shim
    on_log = servers.get("on").log_text()
    assert re.search(r"^\[simzbal\] deepep_adaptor\.Buffer: rank 0 of 1", on_log, re.M), on_log[-3000:]
    assert "[simnpu] deep_ep.Buffer" not in on_log


# -- with a draft model (MTP / NextN): target-verify captured -----------------------------------------

@ON_ONE_WORKER
def test_target_verify_is_captured_with_the_side_stream_forked_and_joined_inside_into_the_pool(servers):
    servers.answers_of("spec-on")
    server = servers.get("spec-on")
    entries = scheduler_journal(server)
    events = [e["event"] for e in entries]
    graphs = captures(entries)
    assert len(graphs) == len(GRAPH_BS) and len({tuple(g["pool"]) for g in graphs}) == 1, graphs
    sides = set()
    for g in graphs:
        cap = g["stream"]
        # the target's one MoE layer: the side stream waits for the capture stream and the capture
        # stream waits for it (before forward_deepep returns: the join precedes the combine),
        # and no stream is made inside a capture
        ((fork, side, waited), join) = g["streams"]
        assert (fork, waited) == ("wait_stream", cap) and join == ["wait_stream", cap, side], g
        sides.add(side)
        # what the side stream allocated inside the capture (the shared experts' activations and
        # output) is the capture pool's, as is what the capture stream allocated
        assert g["allocated"].get(side, 0) > 0 and set(g["allocated"]) <= {cap, side}, g
    (side,) = sides
    # the side stream was made once, outside any capture: in the first warm-up
    made = [i for i, e in enumerate(events) if e == ["stream_create", side]]
    assert len(made) == 1 and made[0] < graphs[0]["begin"] and not entries[made[0]]["capturing"], made
    # the pool is zbal's (the shim set ZBAL_ENABLE_GRAPH): every capture placed in the GVA heap
    pools = [e[2] for e in events if e[0] == "zbal" and e[1] == "pool_begin"]
    assert [p["source"] for p in pools] == ["gva_heap"] * len(GRAPH_BS) and all(p["filter"] for p in pools)
    # each replay forks the graph's side stream from the replaying stream and joins it back
    after = [i for i, e in enumerate(events) if e[0] == "replay"]
    assert after, "no target-verify batch was replayed"
    for i in after:
        stream = events[i][2]
        edges = [e for e in events[i + 1:] if e[0] == "wait_stream"][:2]
        assert edges == [["wait_stream", side, stream], ["wait_stream", stream, side]], (i, edges)
    # the sanitizer, on for the whole run, followed the graph's side stream and stayed silent
    assert_sanitizer_followed_the_scheduler_and_stayed_silent(server, streams=[side])


@ON_ONE_WORKER
def test_with_graphs_the_counts_are_warm_ups_and_captures_a_verify_replay_adds_nothing(servers):
    servers.answers_of("spec-on")
    server = servers.get("spec-on")
    _, before = settled_counts(server, lambda c: c.get("fused_python_calls", 0) > 0)
    time.sleep(2)  # the requests above are answered: the counts stand still once published
    _, before = settled_counts(server)
    replayed = replays(scheduler_journal(server))
    out = generate_one(server, [11, 12, 13, 14, 15])
    verifies = out["meta_info"]["spec_verify_ct"]
    assert verifies >= 1, out["meta_info"]
    # Python ran for the target's prefill and the draft's extends: one after the prefill, one after
    # each verify but the last (eagle_worker skips it once the verify finished the request)
    state, after = settled_counts(
        server, lambda c: c["dual_stream_python_calls"] >= before["dual_stream_python_calls"] + 1 + verifies)
    delta = {k: after[k] - before[k] for k in after}
    assert state == "applied", state
    assert delta["dual_stream_python_calls"] == 1 + verifies, (delta, out["meta_info"])
    # ... and not for the verify batches: each was a replay of a captured graph
    assert replays(scheduler_journal(server)) - replayed == verifies
    assert delta["dual_stream_verify_python_calls"] == 0 and delta["fused_python_calls"] == 0, delta
    # what they hold: the warm-ups and captures of TARGET_VERIFY, per batch size -- the MoE layer
    # on two streams once, the fused kernel in each attention layer
    calls = CALLS_PER_SIZE * len(GRAPH_BS)
    assert after["dual_stream_verify_python_calls"] == calls * MOE_LAYERS, after
    assert after["fused_python_calls"] == calls * ATTENTION_LAYERS, after
    # two main streams, a side stream each: the default stream (eager prefills and draft extends)
    # and the capture stream (warm-ups and captures; a replay forks the graph's own)
    assert after["side_stream_count"] == 2, after


@ON_ONE_WORKER
def test_target_verify_captured_serves_the_same_tokens_as_graphs_off_and_as_without_the_shim(servers):
    on = servers.answers_of("spec-on")
    off = servers.answers_of("spec-off")
    eager = servers.answers_of("spec-eager")
    assert_same_tokens(on, off)
    assert_same_tokens(on, eager)
    # DeepEP through zbal's Buffer with the shim, through sgl-kernel-npu's deep_ep without it
    on_log, off_log = servers.get("spec-on").log_text(), servers.get("spec-off").log_text()
    assert on_log.count("[simzbal] deepep_adaptor.Buffer") >= 1 and "[simnpu] deep_ep.Buffer" not in on_log
    assert "[simnpu] deep_ep.Buffer: rank 0 of 1" in off_log and "[simzbal]" not in off_log
    # the verify batches were replays with graphs on, shim or not; the eager server captured nothing
    for name in ("spec-on", "spec-off"):
        assert replays(scheduler_journal(servers.get(name))) > 0, name
    journals = journal.read(servers.get("spec-eager").journal_dir)
    assert not [e for entries in journals.values() for e in entries if e["event"][0] == "capture_begin"]


@ON_ONE_WORKER
def test_eager_each_verify_batch_runs_the_dual_stream_and_fused_paths_in_python(servers):
    """The graphs-off server: every target-verify batch runs Python, so each is counted."""
    servers.answers_of("spec-eager")
    server = servers.get("spec-eager")
    assert "spec-eager" in servers.pool.live
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
    # extends (its NextN layer is an MoE layer too)
    assert delta["dual_stream_verify_python_calls"] == verifies, (delta, out["meta_info"])
    assert delta["dual_stream_python_calls"] == 1 + 1 + verifies + (verifies - 1), (delta, out["meta_info"])
    # the fused kernel: in the target's two layers of each verify batch (draft extends are extend)
    assert delta["fused_python_calls"] == ATTENTION_LAYERS * verifies, (delta, out["meta_info"])
    # the target and the draft run on one main stream (the scheduler's), so one side stream serves
    # both: 0.5.8's EAGLE worker makes no stream of its own
    assert after["side_stream_count"] == 1, after
    assert_sanitizer_followed_the_scheduler_and_stayed_silent(server)


@ON_ONE_WORKER
def test_with_a_draft_model_the_tokens_are_the_target_s_alone(servers):
    # the MTP checkpoint's target layers are the glm4_moe model's, bit for bit (one seed, one
    # config but the extra layer): greedy speculative decoding gives the target's greedy tokens --
    # or parts at a near-tie (a verify batch attends through the TND fused attention, a decode
    # step through the captured BSH one: two orders of summation)
    spec = servers.answers_of("spec-on")
    alone = servers.answers_of("on")
    assert_same_tokens(spec, alone)


def _moe_bench():
    import importlib
    import sys

    scripts = str(Path(__file__).resolve().parent.parent / "scripts")
    sys.path.insert(0, scripts)
    try:
        return importlib.import_module("bench_moe_server")
    finally:
        sys.path.remove(scripts)


#: The lines each release logs (from real logs of the benchmark's servers): the capture's end and
#: a decode batch -- 0.5.8 says "cuda graph end" and, off CUDA, "cpu graph"; 0.5.10 says "npu".
BENCH_LOGS = {
    "0.5.8": ("[2026-12-06 12:30:04] Capture cuda graph end. Time elapsed: 2.30 s. mem usage=0.00 GB. "
              "avail mem=0.21 GB.",
              "[2026-12-06 12:30:05] Decode batch, #running-req: 1, #token: 128, token usage: 0.00, "
              "cpu graph: %s, gen throughput (token/s): 1.04, #queue-req: 0"),
    "0.5.10": ("[2026-12-06 12:06:08] Capture npu graph end. Time elapsed: 2.40 s. mem usage=0.00 GB. "
               "avail mem=0.21 GB.",
               "[2026-12-06 12:09:31] Decode batch, #running-req: 1, #token: 128, token usage: 0.00, "
               "npu graph: %s, gen throughput (token/s): 1.04, #queue-req: 0"),
}


@pytest.mark.parametrize("version", sorted(BENCH_LOGS))
def test_the_moe_benchmark_counts_only_decode_replayed_from_a_captured_graph(version, tmp_path):
    """scripts/bench_moe_server.py measures graph mode or nothing: each server's log must show its
    decode capture ended and every decode batch it logged run from a graph (no server started)."""
    import types

    bench = _moe_bench()
    capture, decode = BENCH_LOGS[version]
    log = tmp_path / "server.log"
    server = types.SimpleNamespace(version=version, log_path=log)
    log.write_text("\n".join([capture, decode % "True", decode % "True"]) + "\n")
    assert bench.check_graphs("upstream", server) == 2
    for lines in ([decode % "True"],                                   # never captured
                  [capture],                                          # no decode batch logged
                  [capture, decode % "True", decode % "False"]):      # one batch eager
        log.write_text("\n".join(lines) + "\n")
        with pytest.raises(RuntimeError, match="did not decode from its graphs"):
            bench.check_graphs("upstream", server)
