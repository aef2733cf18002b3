"""The shim inside a real sglang server: ``sglang.launch_server`` of 0.5.9 and 0.5.11, its real
process tree (launcher with the HTTP server and tokenizer manager, one scheduler per TP rank, the
detokenizer), on the simulated NPU, answering the real ``openai`` client and sglang's own endpoints
(dev/shimdev/server/).

One server per configuration serves every check that does not disturb another; the servers of a
release run on one xdist worker (``xdist_group``), the two releases side by side.  The servers run
as production ones do, with NPU graphs (sglang's default on Ascend: decode of batch sizes 1 and 2
warmed up, captured into one pool, replayed), except where a check needs eager mode (the same
server with graphs off, the two nodes; a server that never comes up captures nothing).  What is
checked:

* zbal in full mode (TP 1) and mix mode (TP 2, two schedulers bootstrapping one zbal world):
  the same tokens as the same server without the shim for a fixed set of greedy requests, and as
  the same server with graphs off (full mode; the two nodes, eager, for TP 2); the KV cache's
  token count the one that follows from the heap (computed here from the sizes); in mix mode the
  heap initialised after weights and KV cache, before the first capture, once per scheduler, of
  the size the shim computed (the order of events, from each process's journal:
  ``shimdev.server.journal``);
* where graph memory comes from: with zbal, zbal's graph-pool hooks installed by the shim and
  called by every capture, the pool in the GVA heap (full mode, and mix mode whose heap precedes
  the captures); without the shim, the native allocator's graph pool; no zbal call of the shim's
  while a capture is live (the simulated NPU refuses the NPU work, synchronising calls and memory
  queries a capture forbids, so a server that serves proves the rest);
* the backport against upstream's own: a 0.5.12 server (zbal upstream, the shim standing down)
  with the same settings serves the same tokens from the same heap and KV cache, but captures
  unpooled (upstream never sets ``ZBAL_ENABLE_GRAPH``); in mix mode (TP 2, on a 64 GB card of
  which little is free: the KV cache is real memory) the same tokens, KV cache and order of
  events, the GVA size differing by design (upstream's in use is 61.2 GB - free, the shim's the
  device total - free);
* with a draft model (GLM-4 MoE and its NextN layer, 0.5.8, zbal mix mode, graphs on): zbal set up
  once in the scheduler -- heap, allocator swap, pool hooks -- by the target's ModelRunner before
  its target-verify captures, none by the draft worker's; the verify graphs replayed per step;
* every process named with its role in its summary line (the launcher, each scheduler with
  ``tp r/n``, the detokenizer), and the states it logs in sglang's own ``/metrics`` (every server
  runs with ``--enable-metrics``), read as an operator reads them;
* the same TP 2 job as two nodes (``--nnodes 2 --node-rank 0|1``), answers equal to one node's;
* bad input and faults: the server does not come up, says why in one line, exits non-zero in a
  bound; ``NPU_SHIM_ENABLED=0`` serves exactly as without the shim; ``kill -9`` of a scheduler,
  and a server started again on the kept metrics directory serves none of the dead one's states.
"""
from __future__ import annotations

import json
import os
import re
import signal
import tempfile
import time
from pathlib import Path

import pytest

from shimdev.server import journal, models, moe_job
from shimdev.server.pool import ServerPool
from shimdev.server.process import Server, current_states, free_port, session_pids, shim_metrics, summaries

RELEASES = ("0.5.9", "0.5.11")
DEVICE_MIB = 512           # the simulated device (SIMNPU_TOTAL_MIB); its KV cache is real memory
MEM_FRACTION = 0.5         # --mem-fraction-static (sglang's default needs a bigger device)
HEAP_MIB = 256             # SGLANG_ZBAL_LOCAL_MEM_SIZE in full mode
#: Mix mode runs on a 64 GB card (SIMNPU_TOTAL_MIB) with DEVICE_MIB of it free at start
#: (SIMNPU_FREE_MIB; the simulation allocates nothing for the rest): sglang sizes the KV cache
#: from free memory, so it is the same real memory as on a DEVICE_MIB device, while zbal's GVA size
#: is taken against a card's total -- the shim's from the device's, upstream's (0.5.12) from a
#: hard-coded 61.2 GB, right only on a 64 GB card (npu_shim/patches/zbal.py).
CARD_MIB = 65536
MIX_HEAP_MIB = CARD_MIB    # SGLANG_ZBAL_LOCAL_MEM_SIZE in mix mode: the card
UPSTREAM_TOTAL_GB = 61.2   # upstream's lazy_init_zbal_gva_mem: "in use" = this - free (GiB)
PAGE = 128                 # sglang's NPU page size
#: The fixed greedy requests: /generate on token ids, the openai chat and completions clients.
TOKEN_PROMPTS = ([5, 6, 7, 8], [100, 200, 300, 400, 500, 600, 700])
CHAT = "Hello, who are you?"
COMPLETION = "The capital of France is"
NEW_TOKENS = 8


def answers(server: Server) -> dict:
    """What the server answers to the fixed requests (greedy, so a pure function of the model)."""
    client = server.openai()
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": CHAT}],
                                          max_tokens=NEW_TOKENS, temperature=0)
    completion = client.completions.create(model="m", prompt=COMPLETION, max_tokens=NEW_TOKENS,
                                           temperature=0)
    return {"generate": [server.generate(p, NEW_TOKENS) for p in TOKEN_PROMPTS],
            "chat": chat.choices[0].message.content,
            "completion": completion.choices[0].text}


def kv_tokens(server: Server) -> int:
    (found,) = set(re.findall(r"max_total_num_tokens=(\d+)", server.log_text()))
    return int(found)


def weight_bytes(model_dir, tp: int) -> int:
    """Bytes of the model's weights on one rank (from the safetensors header; TP splits all but
    the norms)."""
    raw = (model_dir / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        total += (end - start) // (1 if "norm" in name else tp)
    return total


def kv_bytes_per_token(model_dir, tp: int) -> int:
    """One token's K and V (bf16) over every layer, on one rank."""
    config = json.loads((model_dir / "config.json").read_text())
    kv_heads = config["num_key_value_heads"] // tp
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    return kv_heads * head_dim * config["num_hidden_layers"] * 2 * 2


def expected_kv_tokens(memory_mib: float, tp: int, model_dir, weights=True) -> int:
    """sglang's profile_max_num_token: (available - total * (1 - fraction)) / bytes per token, with
    total = ``memory_mib`` measured before the weights and available = total - the weights,
    rounded down to a page."""
    cell = kv_bytes_per_token(model_dir, tp)
    total = memory_mib * (1 << 20)
    available = (total - (weight_bytes(model_dir, tp) if weights else 0)) / (1 << 30)
    rest = available - total / (1 << 30) * (1 - MEM_FRACTION)
    return int(rest * (1 << 30)) // cell // PAGE * PAGE


def shim_lines(server: Server) -> list[str]:
    return [ln for ln in server.log_text().splitlines() if ln.startswith("[npu-shim ")]


#: Servers kept running at once on one worker: each holds ~2 GB (the KV cache is real memory),
#: and a 24 GB machine runs two workers and the rest of the suite.
MAX_LIVE = 2


class Servers:
    """The servers of one worker, started on first use; the oldest is stopped when a new one would
    make more than MAX_LIVE (its answers and log stay), the rest at the end of the session.  The
    tests of a release run in file order, each using the servers the one before started."""

    def __init__(self, tmp):
        self.tmp, self.pool, self.answers = tmp, ServerPool(MAX_LIVE), {}

    def get(self, name, version, **options):
        return self.pool.get((name, version), lambda: self._start(name, version, **options))

    def _start(self, name, version, *, shim="on", tp=1, env=None, zbal_mib=None, mix=False,
               args=(), graphs=True, model_kind="qwen2"):
        model = models.ensure_model(model_kind, version)
        journal_dir = Path(tempfile.mkdtemp(prefix=f"journal-{name}-{version}-", dir=self.tmp))
        env = {"SIMNPU_TOTAL_MIB": DEVICE_MIB, "SIMNPU_JOURNAL_DIR": str(journal_dir), **(env or {})}
        if zbal_mib:
            env["SGLANG_ZBAL_LOCAL_MEM_SIZE"] = zbal_mib
            env["SGLANG_ZBAL_BOOTSTRAP_URL"] = "tcp://127.0.0.1:%d" % free_port()
        if mix:
            env.update(SIMZBAL_MIX="1", SIMNPU_TOTAL_MIB=CARD_MIB, SIMNPU_FREE_MIB=DEVICE_MIB)
        all_args = ["--mem-fraction-static", str(MEM_FRACTION), "--tp-size", str(tp), "--enable-metrics", *args]
        server = Server(version, model, args=all_args, env=env, zbal=bool(zbal_mib), shim=shim,
                        log_path=self.tmp / f"{name}-{version}.log", graphs=graphs)
        started = time.monotonic()
        server.start()
        server.name, server.model_dir, server.journal_dir = name, model, journal_dir
        server.ready_s = time.monotonic() - started
        return server

    def live(self, name, version, **options):
        """The server, running: started again if the pool stopped it (a test that talks to it,
        run after the worker needed room for other servers)."""
        self.pool.stopped.pop((name, version), None)
        return self.get(name, version, **options)

    def answers_of(self, name, version, **kwargs):
        key = (name, version)
        if key not in self.answers:
            server = self.live(name, version, **kwargs)
            assert key in self.pool.live, "%s was stopped before it answered" % (key,)
            self.answers[key] = answers(server)
        return self.answers[key]

    def stop_all(self):
        self.pool.stop_all()

# (the ``servers`` fixture, one bed per worker that tests/dev/test_simnpu_graphs.py shares: tests/conftest.py)


def scheduler_journals(server) -> list[list[dict]]:
    """The journal of each process that captured graphs or bootstrapped zbal (the schedulers)."""
    found = [entries for entries in journal.read(server.journal_dir).values()
             if any(kind(e) in ("capture_begin", "zbal:zbal_bootstrap") for e in entries)]
    return found


def kind(entry) -> str:
    event = entry["event"]
    return "zbal:" + event[1] if event[0] == "zbal" else event[0]


def kinds_of(entries) -> list[str]:
    return [kind(e) for e in entries]


POOL_HOOKS = ["set_begin_allocate_to_pool", "set_end_allocate_to_pool_fn", "set_release_pool"]


def mix_heaps_before_capture(server):
    """[(journal, heap bootstrap)] of a TP 2 mix-mode server's schedulers, each asserted to make one
    heap after the KV cache (on device memory then) and before its first capture."""
    ranks = scheduler_journals(server)
    assert len(ranks) == 2
    kv_bytes = kv_tokens(server) * kv_bytes_per_token(server.model_dir, 2)
    out = []
    for entries in ranks:
        order = kinds_of(entries)
        assert order.count("zbal:zbal_bootstrap") == 1
        assert order.index("zbal:zbal_bootstrap") < order.index("capture_begin")
        (boot,) = [e for e in entries if kind(e) == "zbal:zbal_bootstrap"]
        assert boot["live_npu_bytes"] >= kv_bytes and not boot["capturing"]
        out.append((entries, boot))
    return out


def assert_captured_into_zbal_s_heap(entries, sizes=2):
    """One scheduler's graphs: zbal's pool hooks installed with its allocator, before any capture;
    each batch size captured once, every capture into the one shared pool, placed by zbal in its
    GVA heap, nothing on plain device memory; no call of the shim's into zbal while capturing."""
    order = kinds_of(entries)
    hooks = [e["event"][1] for e in entries if kind(e) == "allocator_fn"]
    assert hooks[-3:] == POOL_HOOKS, hooks
    assert order.index("allocator_fn") < order.index("capture_begin")
    begins = [e for e in entries if kind(e) == "capture_begin"]
    assert len(begins) == sizes and len({tuple(e["event"][3]) for e in begins}) == 1, begins
    pools = [e["event"][2] for e in entries if kind(e) == "zbal:pool_begin"]
    assert [p["source"] for p in pools] == ["gva_heap"] * sizes and all(p["filter"] for p in pools)
    ends = [e["event"][2] for e in entries if kind(e) == "zbal:pool_end"]
    assert len(ends) == sizes and ends[-1]["bytes"] > 0
    assert all(end["grown"]["device"] == 0 for end in ends), ends
    during = [kind(e) for e in entries if e["capturing"] and kind(e).startswith("zbal:")]
    assert set(during) <= {"zbal:pool_begin", "zbal:pool_end"}, during
    return ends[-1]["bytes"]


def tags(server: Server) -> dict:
    """pid -> the role in its summary line, the launcher's (the server's own process, which
    decides before it knows it is the HTTP server: no role in its tag) named ``launcher``."""
    return {pid: "launcher" if pid == server.proc.pid else said["role"] for pid, said in summaries(server).items()}


def roles(server: Server) -> list[str]:
    """The role of each process that logged a summary line (one per process that decided)."""
    return sorted(tags(server).values())


# -- zbal, full mode, TP 1 ---------------------------------------------------------------------------

def per_release(test):
    """The test once per release, ``<name>_<release>``: the tests of one release share its
    servers, so one xdist worker (``xdist_group``) runs them all.  The mark is the function's own:
    pytest-xdist 3.8 splits a group given as a ``pytest.param`` mark from the function marks of
    the same name over both workers (each then starts the release's servers again)."""
    for version in RELEASES:
        def one(servers, _version=version):
            test(servers, _version)

        one.__name__ = "%s_%s" % (test.__name__, version.replace(".", "_"))
        one.__doc__ = test.__doc__
        test.__globals__[one.__name__] = pytest.mark.xdist_group("server-" + version)(one)
    return None  # the unparametrised test itself is not collected


@per_release
def test_full_mode_serves_the_same_tokens_with_the_kv_cache_sized_from_the_heap(servers, version):
    off = servers.get("off", version, shim="absent")
    on = servers.get("full", version, zbal_mib=HEAP_MIB)
    assert servers.answers_of("full", version) == servers.answers_of("off", version)
    assert kv_tokens(off) == expected_kv_tokens(DEVICE_MIB, 1, off.model_dir)
    assert kv_tokens(on) == expected_kv_tokens(HEAP_MIB, 1, on.model_dir) < kv_tokens(off)
    lines = shim_lines(on)
    assert any(re.search(r"tp 0/1\] zbal: rank 0 initialised a %d MiB heap in full mode "
                         r"\(device 0, world 1\)" % HEAP_MIB, ln) for ln in lines), lines
    assert not shim_lines(off)
    # both captured decode and served it from the graphs (a replay per decode step)
    for server in (on, off):
        (entries,) = scheduler_journals(server)
        assert kinds_of(entries).count("replay") >= NEW_TOKENS - 1, server.name


@per_release
def test_graph_memory_comes_from_zbal_s_heap_and_the_shim_stays_out_of_captures(servers, version):
    on = servers.get("full", version, zbal_mib=HEAP_MIB)
    (entries,) = scheduler_journals(on)
    assert_captured_into_zbal_s_heap(entries)
    # without the shim: torch_npu's native allocator, its own graph pool, no hook to call
    off = servers.get("off", version, shim="absent")
    (entries,) = scheduler_journals(off)
    assert "pool_hook" not in kinds_of(entries) and "change_allocator" not in kinds_of(entries)
    ends = [e for e in entries if kind(e) == "capture_end"]
    assert len(ends) == 2 and ends[-1]["graph_pool_bytes"] > 0


@pytest.mark.xdist_group("server-0.5.11")
def test_graphs_on_serve_the_same_tokens_as_graphs_off(servers):
    version = "0.5.11"
    eager = servers.get("full-eager", version, zbal_mib=HEAP_MIB, graphs=False)
    assert servers.answers_of("full-eager", version) == servers.answers_of("full", version, zbal_mib=HEAP_MIB)
    (entries,) = scheduler_journals(eager)
    assert "capture_begin" not in kinds_of(entries)
    assert kv_tokens(eager) == expected_kv_tokens(HEAP_MIB, 1, eager.model_dir)


@per_release
def test_every_process_says_its_role_and_sglangs_metrics_carry_its_states(servers, version):
    on = servers.live("full", version, zbal_mib=HEAP_MIB)
    said = summaries(on)
    assert roles(on) == ["detokenizer", "launcher", "tp 0/1"], said
    assert {s["states"]["zbal"] for s in said.values()} == {"applied"}
    # the processes where sglang keeps metrics (not the detokenizer): each patch in each of them
    # at 1 in the state its summary line says, 0 in the five others
    states = current_states(shim_metrics(on))
    assert sorted(tags(on)[pid] for pid, _ in states) == ["launcher"] * 3 + ["tp 0/1"] * 3, states
    for (pid, patch), state in states.items():
        assert said[pid]["states"][patch] == state, (pid, patch, state)


@per_release
def test_the_shims_details_are_in_sglangs_own_metrics(servers, version):
    from prometheus_client.parser import text_string_to_metric_families

    on = servers.live("full", version, zbal_mib=HEAP_MIB)
    servers.answers_of("full", version)  # some traffic first: sglang's own metrics then exist
    status, text = on.get("/metrics")
    assert status == 200
    assert any(f.name.startswith("sglang:") for f in text_string_to_metric_families(text))
    pids = {tag: pid for pid, tag in tags(on).items()}
    details = shim_metrics(on)["detail"]
    # the heap, and zbal's graph-pool hooks the shim had installed (graphs are captured)
    assert details[(pids["tp 0/1"], "zbal")] == {"gva_mib": HEAP_MIB, "graph_pool_hooks": 1}
    assert (pids["launcher"], "zbal") not in details  # the heap is the scheduler's
    # a dense model: no MLA weight to release, so nothing released is said
    assert not [key for key in details if key[1] == "mla_weight_release"]


# -- zbal, mix mode, TP 2 ----------------------------------------------------------------------------

@per_release
def test_mix_mode_tp2_one_world_heap_after_the_kv_cache(servers, version):
    servers.get("off-tp2", version, shim="absent", tp=2)  # the answers to compare
    mix = servers.get("mix-tp2", version, tp=2, zbal_mib=MIX_HEAP_MIB, mix=True)
    assert servers.answers_of("mix-tp2", version) == servers.answers_of("off-tp2", version)
    # mix mode: the KV cache sized from the device (not the heap), as without the shim.  With
    # TP 2 the simulated device does not always see a rank's weights go (not understood yet:
    # docs/development.md), so the count lies between the two figures a page apart.
    assert (expected_kv_tokens(DEVICE_MIB, 2, mix.model_dir) <= kv_tokens(mix)
            <= expected_kv_tokens(DEVICE_MIB, 2, mix.model_dir, weights=False))
    log = mix.log_text()
    heaps = re.findall(r"tp (\d)/2\] zbal: rank (\d) initialised a (\d+) MiB GVA heap "
                       r"\((\d+) MiB configured, (\d+) of (\d+) MiB in use\)", log)
    assert sorted((h[0], h[1]) for h in heaps) == [("0", "0"), ("1", "1")], heaps
    for _, _, heap, configured, used, total in heaps:
        assert int(configured) == MIX_HEAP_MIB and int(total) == CARD_MIB
        # the shim's rule: configured - in use, aligned down to 128 MiB
        assert int(heap) == (MIX_HEAP_MIB - int(used)) // 128 * 128
        # in use: at least the rank's KV cache, placed before the heap was made
        kv_mib = kv_tokens(mix) * kv_bytes_per_token(mix.model_dir, 2) / (1 << 20)
        assert int(used) >= kv_mib
    assert log.index("KV Cache is allocated") < log.index("GVA heap")
    # upstream's own line, which operators' log scrapers look for, once per rank
    assert sorted(re.findall(r"^\[ZBAL\] rank (\d) allocated (\d+) MB gva space\.$", log, re.M)) == sorted(
        (h[1], h[2]) for h in heaps)
    assert roles(mix) == ["detokenizer", "launcher", "tp 0/2", "tp 1/2"]
    # each scheduler's metrics carry the heap it made, once made (mix mode: after the KV cache)
    tag = tags(mix)
    details = shim_metrics(mix)["detail"]
    assert sorted((tag[pid], values["gva_mib"]) for (pid, patch), values in details.items() if patch == "zbal") == (
        sorted(("tp %s/2" % h[0], float(h[2])) for h in heaps)), details
    # graphs: in each scheduler, one heap, made after the KV cache (on device memory then) and
    # before the first capture, whose pool zbal then places in that heap
    for entries, _ in mix_heaps_before_capture(mix):
        assert_captured_into_zbal_s_heap(entries)


def upstream_gva_mib(configured_mib, free_bytes) -> int:
    """sglang 0.5.12's ``lazy_init_zbal_gva_mem``: free memory from ``get_available_gpu_memory``
    (the MIN over the ranks, through a float32 tensor, in GiB), in use = 61.2 - free GiB, the
    size = configured - in use (whole MiB), aligned down to 128 MiB."""
    import torch

    free_gib = torch.tensor(free_bytes, dtype=torch.float32).item() / (1 << 30)
    size = configured_mib - int((UPSTREAM_TOTAL_GB - free_gib) * 1024)
    return size - size % 128


@pytest.mark.xdist_group("server-0.5.11")
def test_upstream_0_5_12_mix_mode_differs_from_the_backport_by_the_documented_gva_size(servers):
    """sglang 0.5.12's own mix mode (the shim standing down) beside the backport's on 0.5.11, both
    TP 2 with graphs on the same 64 GB card and settings: the same tokens, the KV cache sized alike
    from the device, the heap made once per rank after the KV cache and before the first capture.
    What differs by design is the GVA size: upstream takes in use as 61.2 GB - free, the shim as
    the device's total - free, so on this card upstream's heap is the 2.8 GB between them larger
    (more than the device has free); and upstream captures unpooled (no ZBAL_ENABLE_GRAPH)."""
    version = "0.5.11"
    backport = servers.get("mix-tp2", version, tp=2, zbal_mib=MIX_HEAP_MIB, mix=True)
    upstream = servers.get("upstream-mix-tp2", "0.5.12", tp=2, zbal_mib=MIX_HEAP_MIB, mix=True)
    assert servers.answers_of("upstream-mix-tp2", "0.5.12") == servers.answers_of("mix-tp2", version)
    for server in (upstream, backport):  # sized from the device before the heap, as without zbal
        assert (expected_kv_tokens(DEVICE_MIB, 2, server.model_dir) <= kv_tokens(server)
                <= expected_kv_tokens(DEVICE_MIB, 2, server.model_dir, weights=False)), server.name
    assert any(re.search(r"tp [01]/2\] zbal=upstream ", ln) for ln in shim_lines(upstream))
    assert "GVA heap" not in upstream.log_text()  # the backport's own line: upstream's runs
    boots = []
    for entries, boot in mix_heaps_before_capture(upstream):
        order = kinds_of(entries)
        boots.append(boot)
        # upstream never sets ZBAL_ENABLE_GRAPH: zbal gets no pool hooks, its captures no pool
        hooks = [e["event"][1] for e in entries if kind(e) == "allocator_fn"]
        assert not set(POOL_HOOKS) & set(hooks) and "zbal:pool_begin" not in order
        assert order.count("capture_begin") == 2
    # upstream's size, from the free memory each rank had when it asked (the MIN over the ranks)
    free = min(DEVICE_MIB * (1 << 20) - b["live_npu_bytes"] - b["graph_pool_bytes"] for b in boots)
    up_mib = upstream_gva_mib(MIX_HEAP_MIB, free)
    assert {b["event"][2]["deviceMemorySize"] for b in boots} == {up_mib << 20}
    assert sorted(re.findall(r"^\[ZBAL\] rank (\d) allocated (\d+) MB gva space\.$", upstream.log_text(),
                             re.M)) == [("0", str(up_mib)), ("1", str(up_mib))]
    # the backport's, from the device total: smaller by the card's 64 GB - 61.2 GB (to the
    # 128 MiB alignment and the few MiB the two releases' processes hold differently)
    ((shim_mib, used, total),) = {tuple(map(int, h)) for h in re.findall(
        r"initialised a (\d+) MiB GVA heap \(\d+ MiB configured, (\d+) of (\d+) MiB in use\)",
        backport.log_text())}
    gap = CARD_MIB - UPSTREAM_TOTAL_GB * 1024
    assert abs(up_mib - shim_mib - gap) <= 128 + 16, (up_mib, shim_mib)
    # the shim's heap fits in what the device has free; upstream's is larger than that
    assert shim_mib <= total - used and up_mib << 20 > free


# -- a draft model ---------------------------------------------------------------------------------------

#: Speculative decoding: GLM-4 MoE with its NextN (MTP) layer as the draft (moe_job.SPEC_ARGS: one
#: draft step, two tokens per verify) on 0.5.8, the release that serves that job
#: (tests/test_real_server_moe.py), here without DeepEP (its simulated low-latency dispatch reads
#: its counts to the host, which no capture takes).
SPEC_VERSION = "0.5.8"
SPEC_ENV = {k: v for k, v in moe_job.NPU_ENV.items() if k != "SIMNPU_TOTAL_MIB"}


@pytest.mark.xdist_group("server-0.5.9")
def test_with_a_draft_model_zbal_is_set_up_once_and_the_target_verify_capture_runs(servers):
    """zbal in mix mode with graphs on and a draft worker: the target's ModelRunner makes the heap
    after its KV cache and before its captures; the draft worker's ModelRunner, initialised after
    the target's captures in the same scheduler, makes no second heap, no second allocator swap,
    no second set of pool hooks.  A speculative target captures TARGET_VERIFY (sglang's
    CudaGraphRunner), here of batch sizes 1 and 2, each into zbal's heap; one draft step captures
    no draft graph.  Each decode step replays a verify graph."""
    spec = servers.get("spec-mix", SPEC_VERSION, model_kind="glm4_moe_mtp", zbal_mib=MIX_HEAP_MIB, mix=True,
                       env=SPEC_ENV, args=list(moe_job.SPEC_ARGS))
    (entries,) = scheduler_journals(spec)
    before = kinds_of(entries).count("replay")
    assert len(spec.generate(TOKEN_PROMPTS[0], NEW_TOKENS)) == NEW_TOKENS
    (entries,) = scheduler_journals(spec)
    order = kinds_of(entries)
    # each verify step gives one or two tokens: the 7 after the prefill's need 4 to 7 replays
    assert NEW_TOKENS // 2 <= order.count("replay") - before <= NEW_TOKENS - 1
    # zbal: one heap, one allocator swap, one set of hooks, all before the first capture
    assert order.count("zbal:zbal_bootstrap") == 1 and order.count("change_allocator") == 1
    hooks = [e["event"][1] for e in entries if kind(e) == "allocator_fn"]
    assert all(hooks.count(h) == 1 for h in POOL_HOOKS), hooks
    assert order.index("zbal:zbal_bootstrap") < order.index("capture_begin")
    assert_captured_into_zbal_s_heap(entries)
    # the log: the target's KV cache, its heap, its captures, then the draft's weights and KV cache
    # -- and no second heap
    log = spec.log_text()
    heaps = re.findall(r"zbal: rank 0 initialised a (\d+) MiB GVA heap", log)
    assert len(heaps) == 1 and len(re.findall(r"^\[ZBAL\] rank 0 allocated", log, re.M)) == 1
    draft = log.index("Load weight end. type=Glm4MoeForCausalLMNextN")
    assert log.index("KV Cache is allocated") < log.index("GVA heap") < log.index("Capture cuda graph end") < draft
    assert "KV Cache is allocated" in log[draft:]  # the draft worker's own KV cache
    assert log.count("Capture cuda graph begin") == 1 and "draft cuda graph" not in log.lower()
    # sglang's /metrics: the heap once, in the scheduler, with zbal's pool hooks
    details = shim_metrics(spec)["detail"]
    (zbal,) = [values for (pid, patch), values in details.items() if patch == "zbal"]
    assert (zbal["gva_mib"], zbal["graph_pool_hooks"], zbal["device_total_mib"]) == (int(heaps[0]), 1, CARD_MIB)


# -- two nodes -----------------------------------------------------------------------------------------

@pytest.mark.xdist_group("server-0.5.9")
def test_two_nodes_answer_as_one(servers, tmp_path):
    version = "0.5.9"
    one_node = servers.answers_of("off-tp2", version, shim="absent", tp=2)
    model = models.ensure_model("qwen2", version)
    dist_port, zbal_port = free_port(), free_port()
    common_env = {"SIMNPU_TOTAL_MIB": DEVICE_MIB, "SGLANG_ZBAL_LOCAL_MEM_SIZE": HEAP_MIB,
                  "SGLANG_ZBAL_BOOTSTRAP_URL": "tcp://127.0.0.1:%d" % zbal_port}
    args = ["--mem-fraction-static", str(MEM_FRACTION), "--tp-size", "2", "--nnodes", "2",
            "--dist-init-addr", "127.0.0.1:%d" % dist_port]
    # eager: with one_node (graphs on), the same TP 2 job with graphs off answers the same
    node1 = Server(version, model, args=args + ["--node-rank", "1"], env=common_env, zbal=True,
                   log_path=tmp_path / "node1.log", wait_ready=False)
    node0 = Server(version, model, args=args + ["--node-rank", "0"], env=common_env, zbal=True,
                   log_path=tmp_path / "node0.log")
    try:
        node1.start()
        node0.start()
        assert answers(node0) == one_node
        lines = shim_lines(node0) + shim_lines(node1)
        for rank in (0, 1):
            assert any("tp %d/2] zbal: rank %d initialised a %d MiB heap in full mode (device 0, world 2)"
                       % (rank, rank, HEAP_MIB) in ln for ln in lines), lines
        assert {"tp 0/2", "tp 1/2"} <= set(roles(node0) + roles(node1))
    finally:
        node0.stop()
        node1.stop()


# -- the backport against upstream's own ----------------------------------------------------------------

@pytest.mark.xdist_group("server-0.5.9")
def test_upstream_0_5_12_sizes_heap_and_kv_cache_as_the_backport(servers):
    """sglang 0.5.12 has zbal upstream (the shim stands down): the same settings give the heap and
    KV cache the backport gives on 0.5.9 / 0.5.11 (full mode; in mix mode the GVA size differs by
    design: upstream takes in-use memory as 61.2 GB minus free, the shim from the device total)
    and the same tokens -- but upstream leaves ZBAL_ENABLE_GRAPH unset, so its captures reach
    zbal unpooled, where the backport's have zbal's pool hooks."""
    upstream = servers.get("upstream-full", "0.5.12", zbal_mib=HEAP_MIB)
    assert servers.answers_of("upstream-full", "0.5.12") == servers.answers_of(
        "full", "0.5.9", zbal_mib=HEAP_MIB)
    assert kv_tokens(upstream) == expected_kv_tokens(HEAP_MIB, 1, upstream.model_dir) == kv_tokens(
        servers.get("full", "0.5.9", zbal_mib=HEAP_MIB))
    assert any(re.search(r"tp 0/1\] zbal=upstream ", ln) for ln in shim_lines(upstream))
    (entries,) = scheduler_journals(upstream)
    (boot,) = [e["event"][2] for e in entries if kind(e) == "zbal:zbal_bootstrap"]
    assert boot["deviceMemorySize"] == HEAP_MIB << 20
    hooks = [e["event"][1] for e in entries if kind(e) == "allocator_fn"]
    assert not set(POOL_HOOKS) & set(hooks) and "zbal:pool_begin" not in kinds_of(entries)
    assert kinds_of(entries).count("capture_begin") == 2


# -- bad input and faults ----------------------------------------------------------------------------

def _refused(tmp_path, version, env, why, timeout=150, zbal=True):
    model = models.ensure_model("qwen2", version)
    server = Server(version, model, args=["--mem-fraction-static", str(MEM_FRACTION)],
                    env={"SIMNPU_TOTAL_MIB": DEVICE_MIB, **env}, zbal=zbal,
                    log_path=tmp_path / "refused.log", wait_ready=False)
    started = time.monotonic()
    server.start()
    try:
        code = server.wait_exit(timeout)
        assert code is not None, "the server neither came up nor exited\n" + server.log_tail()
        assert code != 0
        assert time.monotonic() - started < timeout
        said = [ln for ln in server.log_text().splitlines() if re.search(why, ln)]
        assert said, server.log_tail()
        return said
    finally:
        server.stop()


@pytest.mark.parametrize("env, why, zbal", [
    ({"SGLANG_ZBAL_LOCAL_MEM_SIZE": 4 * DEVICE_MIB}, r"zbal_init failed .*%d MiB" % (4 * DEVICE_MIB), True),
    ({"SGLANG_ZBAL_LOCAL_MEM_SIZE": HEAP_MIB, "SGLANG_ZBAL_BOOTSTRAP_URL": "udp://nowhere"},
     r"SGLANG_ZBAL_BOOTSTRAP_URL", True),
    # zbal asked for on an image without memfabric-zbal
    ({"NPU_SHIM_STRICT": "1", "SGLANG_ZBAL_LOCAL_MEM_SIZE": HEAP_MIB}, r"npu-shim.*zbal", False),
], ids=["zbal larger than the device", "malformed bootstrap URL", "strict, a patch that cannot apply"])
def test_a_server_that_cannot_start_right_says_why_and_exits(tmp_path, env, why, zbal):
    _refused(tmp_path, "0.5.11", env, why, zbal=zbal)


@pytest.mark.xdist_group("server-0.5.11")
def test_shim_disabled_serves_exactly_as_without_it(servers):
    version = "0.5.11"
    disabled = servers.get("disabled", version, shim="disabled", zbal_mib=HEAP_MIB)
    assert servers.answers_of("disabled", version) == servers.answers_of("off", version, shim="absent")
    assert kv_tokens(disabled) == kv_tokens(servers.get("off", version, shim="absent"))
    assert [ln.split("] ", 1)[1] for ln in shim_lines(disabled)] == [
        "off (NPU_SHIM_ENABLED=0): sglang is not patched in this process"] * 3


def test_a_killed_scheduler_takes_the_server_down_and_a_restart_serves_none_of_its_states(tmp_path):
    """A kept ``PROMETHEUS_MULTIPROC_DIR`` (the operator's): sglang never marks a process dead, so
    before the fix a killed scheduler's states were served by every later server on it."""
    version = "0.5.11"
    model = models.ensure_model("qwen2", version)
    kept = tmp_path / "metrics"
    kept.mkdir(mode=0o700)

    def server(name):
        return Server(version, model, args=["--mem-fraction-static", str(MEM_FRACTION), "--enable-metrics"],
                      env={"SIMNPU_TOTAL_MIB": DEVICE_MIB, "PROMETHEUS_MULTIPROC_DIR": str(kept)},
                      log_path=tmp_path / f"{name}.log", graphs=True)

    first = server("killed")
    first.start()
    try:
        dead = {pid for pid, _ in shim_metrics(first)["state"]}
        (scheduler,) = [pid for pid, said in summaries(first).items() if said["role"] == "tp 0/1"]
        assert scheduler in dead
        os.kill(scheduler, signal.SIGKILL)
        code = first.wait_exit(120)
        assert code is not None, "the launcher outlived its killed scheduler\n" + first.log_tail()
        deadline = time.monotonic() + 30
        while session_pids(first.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        first.stop()
    assert "gauge_liveall_%d.db" % scheduler in os.listdir(kept)  # killed: it could not clean up
    with server("again") as again:
        served = {pid for pid, _ in shim_metrics(again)["state"]}
        assert served and not served & dead, (served, dead)
        assert served == {pid for pid, said in summaries(again).items() if said["role"] != "detokenizer"}
