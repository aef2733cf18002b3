"""NPU graphs in the simulated NPU (dev/shimdev/simnpu/_graphs.py), held to torch-npu 2.13.0:
capture records without running, replay re-runs on the same storages, update re-issues the handled
attention ops, the refusals, the pools, the pluggable allocator's hooks, the sanitizer at replay.

Each test runs in a process of its own: server mode (npu tensors on the CPU) changes torch for the
process's life.  Messages quoted from the wheel are held to it by test_simnpu_conformance.py."""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from shimdev import DEV

PRELUDE = """
import json, threading
from shimdev import simnpu
simnpu.install(server=True)
import torch, torch_npu
from shimdev.simnpu import _graphs

def refused(fn):
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return None
"""


def run(*parts, env=None, timeout=240):
    extra = env or {}
    env = {k: v for k, v in os.environ.items() if k not in ("TASK_QUEUE_ENABLE", "ASCEND_LAUNCH_BLOCKING")}
    env.update(PYTHONPATH=str(DEV), **extra)
    code = PRELUDE + "".join(textwrap.dedent(part) for part in parts)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=timeout, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


MODULE = """
calls = []

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        calls.append(1)  # a Python side effect: once at capture, never at replay
        y = self.lin(x).relu()
        z = torch.zeros(x.shape[0], 8, device="npu")
        z += y
        return z * 2

torch.manual_seed(0)
m = Tiny().to("npu")
x = torch.randn(3, 8, device="npu")
s = torch.npu.Stream()
"""


def test_capture_records_without_running_and_replay_reruns_on_the_same_storages_without_python():
    out = run(MODULE, """
    with torch.no_grad():
        for _ in range(2):  # sglang's two eager warm-ups
            with torch.npu.stream(s):
                m(x)
        g = torch.npu.NPUGraph()
        with torch.npu.graph(g, pool=torch.npu.graph_pool_handle(), stream=s, auto_dispatch_capture=True):
            static = m(x)
        before = bool(static.isnan().all())
        calls_after_capture = len(calls)
        equal, same = [], []
        for _ in range(3):
            new = torch.randn(3, 8)
            x.copy_(new)
            ptr = static.data_ptr()
            g.replay()
            equal.append(torch.allclose(static, m.lin(new).relu() * 2))
            same.append(static.data_ptr() == ptr)
    print(json.dumps({"nan_before_replay": before, "calls": [calls_after_capture, len(calls)],
                      "equal": equal, "same": same}))
    """)
    assert out["nan_before_replay"] is True
    # two warm-ups and the capture ran the forward; three replays (and the reference) did not
    assert out["calls"] == [3, 3]
    assert out["equal"] == [True, True, True] and out["same"] == [True, True, True]


def test_an_in_place_write_does_not_land_at_capture_and_lands_at_each_replay():
    out = run("""
    s = torch.npu.Stream()
    x = torch.zeros(4, device="npu")
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=s):
        x.add_(1)
    at_capture = x.tolist()
    g.replay(); g.replay()
    print(json.dumps({"capture": at_capture, "replayed": x.tolist()}))
    """)
    assert out == {"capture": [0.0] * 4, "replayed": [2.0] * 4}


def test_update_reissues_the_attention_op_with_the_new_lengths_while_replay_waits_for_it():
    """sglang's NPUGraphRunner.replay: a thread calls update(cpu_update_input=[{...}]) while
    replay() runs; the capture holds npu_fused_infer_attention_score.out (forward_decode_graph)."""
    out = run("""
    heads, kvh, dim, page = 4, 2, 8, 4
    kc = torch.randn(8, page, kvh * dim, device="npu")
    vc = torch.randn(8, page, kvh * dim, device="npu")
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32, device="npu")
    q = torch.randn(2, 1, heads * dim, device="npu")
    kw = dict(block_table=table, block_size=page, num_heads=heads, num_key_value_heads=kvh,
              input_layout="BSH", scale=0.3)

    def decode(lens):
        ws = torch_npu._npu_fused_infer_attention_score_get_max_workspace(q, kc, vc, actual_seq_lengths_kv=lens, **kw)
        o = torch.empty(2, 1, heads * dim, device="npu")
        lse = torch.empty(1, device="npu")
        torch_npu.npu_fused_infer_attention_score.out(q, kc, vc, actual_seq_lengths_kv=lens, workspace=ws,
                                                      out=[o, lse], **kw)
        return o * 1

    def functional(lens):  # what the handler turns into .out
        return torch_npu.npu_fused_infer_attention_score(q, kc, vc, actual_seq_lengths_kv=lens, **kw)[0] * 1

    s = torch.npu.Stream()
    results = {}
    for name, fn in (("out", decode), ("default", functional)):
        g = torch.npu.NPUGraph()
        with torch.npu.graph(g, pool=torch.npu.graph_pool_handle(), stream=s, auto_dispatch_capture=True):
            static = fn([5, 3])
        rows = []
        for lens in ([7, 1], [2, 6], [8, 0]):
            t = threading.Thread(target=g.update, kwargs={"cpu_update_input": [{"actual_seq_lengths_kv": lens}]})
            t.start(); g.replay(); t.join()
            with torch.npu.stream(s):
                rows.append(torch.allclose(static, decode(lens), atol=1e-6))
        results[name] = {"records": len(g.graph_dispatch_mode.graph_dispatch_records), "equal": rows,
                         "recorded": g.graph_dispatch_mode.graph_dispatch_records[0].op_cache_entry.__name__}
    results["update_events"] = simnpu.events("graph_update")[:1]
    print(json.dumps(results))
    """)
    for name in ("out", "default"):
        assert out[name]["records"] == 1
        assert out[name]["equal"] == [True, True, True], name
        assert out[name]["recorded"] == "npu_fused_infer_attention_score.out"
    assert out["update_events"] == [["graph_update", 1, 1]]


def test_a_replay_nobody_updates_fails_at_the_handled_op_and_update_needs_auto_dispatch():
    out = run("""
    s = torch.npu.Stream()
    q = torch.randn(1, 1, 8, device="npu"); kc = torch.randn(2, 4, 8, device="npu")
    table = torch.tensor([[0, 1]], dtype=torch.int32, device="npu")
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=s, auto_dispatch_capture=True):
        torch_npu.npu_fused_infer_attention_score(q, kc, kc, block_table=table, block_size=4, num_heads=1,
                                                  input_layout="BSH", actual_seq_lengths_kv=[3])
    stale = refused(g.replay)
    plain = torch.npu.NPUGraph()
    with torch.npu.graph(plain, stream=s):
        q * 2
    print(json.dumps({"stale": stale, "update": refused(lambda: plain.update([{"actual_seq_lengths_kv": [1]}]))}))
    """, env={"SIMNPU_EXTERNAL_EVENT_TIMEOUT": "1"})
    assert "npu_fused_infer_attention_score.out" in out["stale"] and "update" in out["stale"]
    assert out["update"] == _msg("MSG_UPDATE")


def _msg(name):
    from shimdev.simnpu import _graphs

    return getattr(_graphs, name)


def test_torch_npu_s_refusals_with_its_messages():
    out = run("""
    s, t = torch.npu.Stream(), torch.npu.Stream()
    x = torch.ones(2, device="npu")
    got = {}
    got["default_stream"] = refused(lambda: torch.npu.NPUGraph().capture_begin())
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=s):
        x * 2
    got["second_capture"] = refused(lambda: torch.npu.graph(g, stream=s).__enter__())
    got["replay_before_capture"] = refused(torch.npu.NPUGraph().replay)
    got["pool_before_capture"] = refused(torch.npu.NPUGraph().pool)
    h = torch.npu.NPUGraph()
    with torch.npu.stream(s):
        h.capture_begin()
        with torch.npu.stream(t):
            got["end_on_other_stream"] = refused(h.capture_end)
        h.capture_end()
    k = torch.npu.NPUGraph()
    with torch.npu.stream(s):
        k.capture_begin()
        torch.npu.manual_seed(67280421310721)  # the seed it has: allowed
        got["other_seed"] = refused(lambda: torch.npu.manual_seed(1))
        k.capture_end()
    lib = torch.library.Library("simtest", "DEF")
    lib.define("old_op(Tensor x) -> Tensor")
    lib.impl("old_op", lambda x: x + 1, "CompositeExplicitAutograd")
    _graphs.declare_aclop("simtest::old_op")
    got["aclop_eager"] = torch.ops.simtest.old_op(x).tolist()  # outside a capture it runs
    a = torch.npu.NPUGraph()
    with torch.npu.stream(s):
        a.capture_begin()
        got["aclop"] = refused(lambda: torch.ops.simtest.old_op(x))
        a.capture_end()
    print(json.dumps(got))
    """)
    assert out["aclop_eager"] == [2.0, 2.0]
    assert out["aclop"] == _msg("MSG_ACLOP") + "simtest::old_op"
    assert out["default_stream"] == _msg("MSG_DEFAULT_STREAM")
    assert out["second_capture"] == _msg("MSG_ALREADY_CAPTURED")
    assert out["replay_before_capture"] == _msg("MSG_REPLAY")
    assert out["pool_before_capture"] == _msg("MSG_POOL")
    assert out["end_on_other_stream"] == _msg("MSG_END_STREAM")
    assert out["other_seed"] == _msg("MSG_SEED")


def test_a_new_npu_generator_is_refused_while_the_current_stream_is_captured():
    """NPUGeneratorImpl's constructor asserts no capture on the current stream
    (``assertNotCapturing``), as does ``clone_impl``; ``set_current_seed`` keeps the seed it has."""
    out = run("""
    got = {}
    g = torch.Generator(device="npu")
    got["eager"] = [str(g.device), g.initial_seed(), isinstance(g, torch.Generator),
                    isinstance(torch.default_generator, torch.Generator), str(torch.Generator().device)]
    got["draws"] = torch.randn(3, device="npu", generator=torch.Generator(device="npu").manual_seed(5)).tolist()
    got["cpu_draws"] = torch.randn(3, generator=torch.Generator().manual_seed(5)).tolist()
    got["bad_index"] = refused(lambda: torch.Generator(device="npu:8"))
    s = torch.npu.Stream()
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph, stream=s):
        got["new"] = refused(lambda: torch.Generator(device="npu"))
        got["new_index"] = refused(lambda: torch.Generator(torch.device("npu", 0)))
        got["clone"] = refused(g.clone_state)
        got["other_seed"] = refused(lambda: g.manual_seed(7))
        got["same_seed"] = refused(lambda: g.manual_seed(g.initial_seed()))
        got["cpu"] = str(torch.Generator(device="cpu").device)  # a CPU generator: no NPU stream involved
        with torch.npu.stream(torch.npu.default_stream()):  # the capturing thread off the capture
            got["off_stream"] = str(torch.Generator(device="npu").device)
        other = []
        t = threading.Thread(target=lambda: other.append(str(torch.Generator(device="npu").device)))
        t.start()
        t.join()
        got["other_thread"] = other
    got["after"] = [str(torch.Generator(device="npu").device), str(g.clone_state().device)]
    print(json.dumps(got))
    """)
    assert out["eager"] == ["npu:0", 67280421310721, True, True, "cpu"]
    assert out["draws"] == out["cpu_draws"]
    assert out["bad_index"] == _msg("MSG_GENERATOR_DEVICE")
    refusal = _msg("MSG_NOT_CAPTURING") + _msg("CAPTURE_STATUS_ACTIVE")
    assert out["new"] == out["new_index"] == _msg("MSG_NEW_GENERATOR") + refusal
    assert out["clone"] == _msg("MSG_CLONE_GENERATOR") + refusal
    assert out["other_seed"] == _msg("MSG_SEED") and out["same_seed"] is None
    assert out["cpu"] == "cpu" and out["off_stream"] == "npu:0" and out["other_thread"] == ["npu:0"]
    assert out["after"] == ["npu:0", "npu:0"]


def test_task_queue_enable_is_read_as_torch_npu_reads_it():
    """capture_begin keeps the level it read at the process's first capture (a function-local
    static in NPUGraph.cpp): TASK_QUEUE_ENABLE=2 refuses every capture, set_task_queue_enable
    changes only what get_task_queue_enable answers."""
    out = run("""
    import os
    s = torch.npu.Stream()
    got = {"level": torch.npu.get_task_queue_enable(),
           "capture": refused(lambda: torch.npu.graph(torch.npu.NPUGraph(), stream=s).__enter__())}
    torch.npu.set_task_queue_enable(1)
    os.environ["TASK_QUEUE_ENABLE"] = "1"
    with torch.npu.stream(s):
        got["again"] = refused(torch.npu.NPUGraph().capture_begin)
    got["set"] = torch.npu.get_task_queue_enable()
    got["bad_set"] = refused(lambda: torch.npu.set_task_queue_enable(3))
    print(json.dumps(got))
    """, env={"TASK_QUEUE_ENABLE": "2"})
    assert out == {"level": 2, "capture": _msg("MSG_TASK_QUEUE"), "again": _msg("MSG_TASK_QUEUE"), "set": 1,
                   "bad_set": _msg("MSG_SET_TASK_QUEUE").format(3)}
    out = run("""
    s = torch.npu.Stream()
    g = torch.npu.NPUGraph()
    with torch.npu.stream(s):
        g.capture_begin()
        g.capture_end()
    print(json.dumps(torch.npu.get_task_queue_enable()))
    """, env={"TASK_QUEUE_ENABLE": "1"})
    assert out == 1
    out = run("""
    s = torch.npu.Stream()
    print(json.dumps(refused(lambda: torch.npu.graph(torch.npu.NPUGraph(), stream=s).__enter__())))
    """, env={"TASK_QUEUE_ENABLE": "7"})
    assert out == _msg("MSG_TASK_QUEUE_VALUE") + "7"
    out = run("""print(json.dumps(torch.npu.get_task_queue_enable()))""",
              env={"TASK_QUEUE_ENABLE": "2", "ASCEND_LAUNCH_BLOCKING": "1"})
    assert out == 0


def test_cann_s_refusals_name_the_operation():
    out = run("""
    s, side = torch.npu.Stream(), torch.npu.Stream()
    x = torch.ones(4, device="npu")
    calls = {
        "synchronize": lambda: torch.npu.synchronize(),
        "stream_synchronize": lambda: s.synchronize(),
        "stream_query": lambda: s.query(),
        "event_query": lambda: torch.npu.Event().query(),
        "event_synchronize": lambda: torch.npu.Event().synchronize(),
        "item": lambda: (x * 2).sum().item(),
        "tolist": lambda: (x * 2).tolist(),
        "cpu": lambda: (x * 2).cpu(),
        "bool": lambda: bool((x * 2).sum() > 0),
        "mem_get_info": lambda: torch.npu.mem_get_info(),
    }
    got = {}
    for name, call in calls.items():
        g = torch.npu.NPUGraph()
        with torch.npu.stream(s):
            g.capture_begin()
            got[name] = refused(call)
            g.capture_end()
    # a stream that never waited on the capture
    g = torch.npu.NPUGraph()
    with torch.npu.stream(s):
        g.capture_begin()
        with torch.npu.stream(side):
            got["unjoined"] = refused(lambda: x * 3)
        g.capture_end()
    # joined, but its work never joined back
    g = torch.npu.NPUGraph()
    def fork_without_join():
        with torch.npu.graph(g, stream=s):
            side.wait_stream(s)
            with torch.npu.stream(side):
                x * 3
    got["not_joined_back"] = refused(fork_without_join)
    # outside a capture all of them run
    after = {name: refused(call) for name, call in calls.items()}
    print(json.dumps({"got": got, "after": after, "live": _graphs.live_capture() is None}))
    """)
    got = out["got"]
    for name, said in (("synchronize", "torch.npu.synchronize()"), ("stream_synchronize", "Stream.synchronize()"),
                       ("stream_query", "Stream.query()"), ("event_query", "Event.query()"),
                       ("event_synchronize", "Event.synchronize()"), ("item", "Tensor.item()"),
                       ("tolist", "Tensor.tolist()"), ("cpu", "Tensor.cpu()"), ("bool", "_local_scalar_dense"),
                       ("mem_get_info", "torch.npu.mem_get_info()")):
        assert got[name] and said in got[name], (name, got[name])
    assert got["unjoined"].startswith(_msg("MSG_UNJOINED")) and "side-2" in got["unjoined"]
    assert "not joined back" in got["not_joined_back"] and "side-2" in got["not_joined_back"]
    assert out["after"] == {name: None for name in out["after"]}
    assert out["live"] is True


def test_a_global_capture_refuses_other_threads_a_thread_local_one_does_not():
    out = run("""
    s = torch.npu.Stream()
    got = {}
    for mode in ("global", "thread_local", "relaxed"):
        g = torch.npu.NPUGraph()
        seen = {}
        def other():
            seen["sync"] = refused(torch.npu.synchronize)
            seen["mem"] = refused(torch.npu.mem_get_info)
            seen["capturing"] = torch.npu.is_current_stream_capturing()
        with torch.npu.graph(g, stream=s, capture_error_mode=mode):
            t = threading.Thread(target=other); t.start(); t.join()
            seen["capturing_here"] = torch.npu.is_current_stream_capturing()
        got[mode] = seen
    bad = torch.npu.graph(torch.npu.NPUGraph(), stream=s, capture_error_mode="x")
    got["bad_mode"] = refused(bad.__enter__)
    got["capturing_after"] = torch.npu.is_current_stream_capturing()
    print(json.dumps(got))
    """)
    assert "from thread" in out["global"]["sync"] and "torch.npu.synchronize()" in out["global"]["sync"]
    assert "torch.npu.mem_get_info()" in out["global"]["mem"]
    for mode in ("thread_local", "relaxed"):
        assert out[mode]["sync"] is None and out[mode]["mem"] is None
    for mode in ("global", "thread_local", "relaxed"):
        assert out[mode]["capturing"] is False and out[mode]["capturing_here"] is True
    assert out["bad_mode"] == _msg("MSG_CAPTURE_MODE") + "x"
    assert out["capturing_after"] is False


def test_graph_enter_synchronises_and_empties_the_caches_before_capture_begin_and_events_are_logged():
    out = run(MODULE, """
    simnpu.clear_events()
    pool = torch.npu.graph_pool_handle()
    g = torch.npu.NPUGraph()
    with torch.no_grad(), torch.npu.graph(g, pool=pool, stream=s):
        m(x)
    g.replay()
    g.reset()
    kinds = [e for e in simnpu.EVENTS if e[0] in ("synchronize", "empty_cache", "host_empty_cache", "stream_enter",
                                                  "capture_begin", "capture_end", "replay", "graph_reset")]
    print(json.dumps(kinds))
    """)
    assert [e[0] for e in out] == ["synchronize", "empty_cache", "host_empty_cache", "stream_enter", "capture_begin",
                                   "capture_end", "replay", "graph_reset"]
    assert out[4] == ["capture_begin", 1, "side-1", [0, 1]]
    assert out[5] == ["capture_end", 1, "side-1", [0, 1]]
    assert out[6] == ["replay", 1, "main", [0, 1]]
    assert out[7] == ["graph_reset", 1, [0, 1]]


def test_pool_ids_sharing_and_memory_held_until_the_last_reset():
    out = run(MODULE, """
    got = {"handles": [torch.npu.graph_pool_handle(), torch.npu.graph_pool_handle()]}
    free = lambda: torch.npu.mem_get_info()[0]
    with torch.no_grad():
        start = free()
        pool = torch.npu.graph_pool_handle()
        a, b = torch.npu.NPUGraph(), torch.npu.NPUGraph()
        with torch.npu.graph(a, pool=pool, stream=s):
            m(x)
        after_a = free()
        with torch.npu.graph(b, pool=pool, stream=s):
            m(x[:2])
        after_b = free()
        got["pools"] = [a.pool(), b.pool()]
        got["accounting"] = simnpu.graph_pools()[tuple(pool)]
        from shimdev.simnpu import _server
        got["snapshot"] = _server.memory_snapshot()["graph_pools"]
        got["use_count"] = _graphs.pool_of(pool).use_count
        a.reset()
        after_reset_a = free()
        b.reset()
        after_reset_b = free()
        c = torch.npu.NPUGraph()
        with torch.npu.graph(c, stream=s):
            m(x)
        got["own_pool"] = c.pool()
        got["own_pool_again"] = torch.npu.NPUGraph().pool if False else None
        del c
        import gc; gc.collect()
        got["freed_by_collection"] = free() == start
        mp = torch.npu.MemPool()
        got["mempool"] = [mp.id, mp.use_count()]
    got["held"] = [start - after_a, start - after_b, start - after_reset_a, start - after_reset_b]
    got["releases"] = simnpu.events("pool_release")
    print(json.dumps(got))
    """)
    assert out["handles"] == [[0, 1], [0, 2]]
    assert out["pools"] == [[0, 3], [0, 3]] and out["use_count"] == 2
    assert out["accounting"] == {"use_count": 2, "graph_pool_bytes": 4 * 3 * 8 * 4 + 4 * 2 * 8 * 4}
    assert out["snapshot"] == {"0,3": out["accounting"]}
    held = out["held"]
    # four [3, 8] fp32 captures (linear, relu, zeros, *2), then four [2, 8] ones into the same pool
    assert held[0] == 4 * 3 * 8 * 4 and held[1] == held[0] + 4 * 2 * 8 * 4
    assert held[2] == held[1] and held[3] == 0  # held until the last graph of the pool is reset
    assert out["own_pool"] == [1, 0] and out["freed_by_collection"] is True
    assert out["mempool"] == [[0, 4], 1]
    assert [r[1] for r in out["releases"]] == [[0, 3], [1, 0]]


HOOKS = """
import ctypes, ctypes.util
hooks = []
BEGIN = ctypes.CFUNCTYPE(None, ctypes.c_int, _graphs._PoolId, _graphs._FILTER)
END = ctypes.CFUNCTYPE(None, ctypes.c_int, _graphs._PoolId)
def begin(device, pool, flt):
    hooks.append(["begin", device, [pool.first, pool.second], bool(flt(id(s))),
                  bool(flt(id(torch.npu.default_stream())))])
def end(device, pool):
    hooks.append(["end", device, [pool.first, pool.second]])
def release(device, pool):
    hooks.append(["release", device, [pool.first, pool.second]])
keep = [BEGIN(begin), END(end), END(release)]
alloc = torch.npu.memory.NPUPluggableAllocator(ctypes.util.find_library("c"), "malloc", "free")
torch.npu.memory.change_current_allocator(alloc)
s = torch.npu.Stream()
"""


def test_a_pluggable_allocator_s_pool_hooks_are_called_when_set_and_mempool_is_refused():
    out = run(HOOKS, """
    a = alloc.allocator()
    a.set_begin_allocate_to_pool(ctypes.cast(keep[0], ctypes.c_void_p).value)
    a.set_end_allocate_to_pool_fn(ctypes.cast(keep[1], ctypes.c_void_p).value)
    a.set_release_pool(ctypes.cast(keep[2], ctypes.c_void_p).value)
    x = torch.ones(4, device="npu")
    pool = torch.npu.graph_pool_handle()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, pool=pool, stream=s):
        hooks.append(["inside"])
        x * 2
    g.reset()
    print(json.dumps({"hooks": hooks, "mempool": refused(torch.npu.MemPool)}))
    """)
    assert out["hooks"] == [["begin", 0, [0, 1], True, False], ["inside"], ["end", 0, [0, 1]],
                            ["release", 0, [0, 1]]]
    assert out["mempool"] == _msg("MSG_MEMPOOL")


def test_a_pluggable_allocator_without_hooks_gets_no_call_and_holds_the_capture_s_memory():
    out = run(HOOKS, """
    x = torch.ones(4, device="npu")
    before = _graphs._device.STATE.live_npu_bytes
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=s):
        x * 2
    during = _graphs._device.STATE.live_npu_bytes
    accounting = simnpu.graph_pools()[g.pool()]
    g.reset()
    print(json.dumps({"hooks": hooks, "pool_hook_events": simnpu.events("pool_hook"),
                      "held": [during - before, _graphs._device.STATE.live_npu_bytes - before],
                      "graph_pool_bytes": _graphs._device.STATE.graph_pool_bytes, "accounting": accounting}))
    """)
    assert out["hooks"] == [] and out["pool_hook_events"] == []
    assert out["held"] == [16, 0] and out["graph_pool_bytes"] == 0
    # before zbal's heap is bootstrapped the pluggable allocator's memory is plain device memory
    assert out["accounting"] == {"use_count": 1, "live_npu_bytes": 16}


def test_the_sanitizer_follows_the_event_edges_inside_a_graph_at_each_replay():
    out = run("""
    s, side = torch.npu.Stream(), torch.npu.Stream()
    x = torch.ones(64, device="npu")
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=s):
        a = x * 2                        # capture stream
        side.wait_stream(s)              # fork
        with torch.npu.stream(side):
            b = a + 1                    # side stream reads a
        s.wait_stream(side)              # join
        c = b * 3
    with simnpu.sanitize() as san:
        g.replay(); g.replay()
    clean = [r.kind for r in san.reports]
    # the graph's input written on another stream without a wait: the replay's first op races it
    other = torch.npu.Stream()
    with simnpu.sanitize() as san:
        with torch.npu.stream(other):
            x.fill_(2)
        g.replay()
    raced = [(r.kind, r.streams) for r in san.reports]
    print(json.dumps({"clean": clean, "raced": raced, "c": c.tolist()[:2], "other": simnpu.stream_name(other),
                      "replay_edges": [e for e in simnpu.events() if e[0] in ("wait_stream",)][-2:]}))
    """)
    assert out["clean"] == []
    assert ["read-after-write", [out["other"], "main"]] in [[k, list(s)] for k, s in out["raced"]]
    assert out["c"] == [15.0, 15.0]
    assert out["replay_edges"] == [["wait_stream", "side-2", "main"], ["wait_stream", "main", "side-2"]]


def test_the_graph_only_ops_compute_and_refuse_a_short_workspace():
    import torch

    from shimdev.simnpu import _ops

    torch.manual_seed(0)
    heads, kv_heads, dim, page = 4, 2, 8, 4
    k_cache, v_cache = torch.randn(4, page, kv_heads * dim), torch.randn(4, page, kv_heads * dim)
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    q = torch.randn(2, 1, heads * dim)
    kw = dict(block_table=table, block_size=page, num_heads=heads, num_key_value_heads=kv_heads,
              input_layout="BSH", scale=0.3, actual_seq_lengths_kv=[6, 0])
    out, lse = _ops.npu_fused_infer_attention_score(q, k_cache, v_cache, **kw)
    slots = torch.cat([torch.arange(page) + int(blk) * page for blk in table[0]])[:6]
    k = k_cache.reshape(-1, kv_heads, dim)[slots].repeat_interleave(2, dim=1)
    v = v_cache.reshape(-1, kv_heads, dim)[slots].repeat_interleave(2, dim=1)
    qh = q[0, 0].reshape(heads, dim)
    w = (torch.einsum("hd,mhd->hm", qh, k) * 0.3).softmax(-1)
    assert torch.allclose(out[0, 0], torch.einsum("hm,mhd->hd", w, v).reshape(-1), atol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # a padded entry (no tokens)
    ws = _ops._npu_fused_infer_attention_score_get_max_workspace(q, k_cache, v_cache, **kw)
    assert ws.dtype == torch.uint8 and ws.numel() == max(512, 4 * q.numel())
    o, lse2 = _ops._npu_fused_infer_attention_score_infer_output(q, v_cache, input_layout="BSH", block_table=table,
                                                                   num_heads=heads, num_key_value_heads=kv_heads)
    assert o.shape == out.shape and lse2.shape == (1,)
    res = _ops._npu_fused_infer_attention_score_out(q, k_cache, v_cache, workspace=ws, out=[o, lse2], **kw)
    assert res[0] is o and torch.equal(o, out)

    big = torch.randn(64, 1, heads * dim)
    with pytest.raises(RuntimeError, match="workspace of 512 bytes"):
        _ops._npu_fused_infer_attention_score_out(big, k_cache, v_cache, workspace=ws,
                                                  out=[torch.empty(64, 1, 32), torch.empty(1)],
                                                  **dict(kw, block_table=table.repeat(32, 1),
                                                         actual_seq_lengths_kv=[1] * 64))


# -- a real sglang server's NPUGraphRunner on the simulated NPU ------------------------------------------

#: The requests: 45 new tokens in the last, as sglang logs a decode batch (with whether it replayed
#: a graph) every 40 steps.
GRAPH_REQUESTS = (([5, 6, 7, 8], 8), ([100, 200, 300, 400, 500], 8), ([9, 10, 11], 45))


@pytest.mark.xdist_group("server-0.5.11")
def test_a_real_sglang_server_captures_replays_and_answers_as_without_graphs(servers):
    """sglang's NPUGraphRunner (two warm-ups, torch.npu.graph with the global pool and
    auto_dispatch_capture, update from a thread while replay runs) comes up and decodes by replay,
    with the same greedy tokens as with graphs off.  Both servers are tests/test_real_server.py's
    (the release's group runs both files on one worker, this test first): ``off`` (the shim absent,
    batch sizes 1 and 2 captured) and ``full-eager`` (graphs off; that the shim's tokens are the
    shim-absent server's is that file's check).  0.5.9's graph runner is held to graphs-off tokens
    there too: test_two_nodes_answer_as_one (TP 2 eager beside TP 2 captured)."""
    from test_real_server import HEAP_MIB

    version = "0.5.11"
    server = servers.live("off", version, shim="absent")
    assert "--cuda-graph-bs" in server.argv and "--disable-cuda-graph" not in server.argv
    for prompt, new_tokens in GRAPH_REQUESTS:
        server.generate(prompt, new_tokens)
    log = server.log_text()
    assert "Capture npu graph end" in log and "Capture cuda graph bs [1, 2]" in log
    assert re.search(r"Decode batch.*(npu|cuda) graph: True", log), "no decode step replayed a graph"
    graphs_on = servers.answers_of("off", version)
    eager = servers.get("full-eager", version, zbal_mib=HEAP_MIB, graphs=False)
    assert "--disable-cuda-graph" in eager.argv
    assert servers.answers_of("full-eager", version) == graphs_on
    assert "Capture" not in eager.log_text()


def test_the_sanitizer_takes_no_edge_from_a_capture_as_it_is_captured():
    """A join captured into a graph happens at replay: it must not order, now, an eager write on
    the side stream before an eager read on the capture stream."""
    out = run("""
    s, side = torch.npu.Stream(), torch.npu.Stream()
    x = torch.ones(64, device="npu")
    g = torch.npu.NPUGraph()
    with simnpu.sanitize() as san:
        with torch.npu.stream(side):
            x.fill_(2)                   # eager, on the side stream
        with torch.npu.stream(s):
            g.capture_begin()            # (no synchronize: graph.__enter__ would order everything)
            side.wait_stream(s)
            with torch.npu.stream(side):
                y = x + 1
            s.wait_stream(side)          # captured: happens at each replay
            g.capture_end()
            x * 3                        # eager read on s: unordered with the side stream's write
    print(json.dumps([(r.kind, list(r.streams)) for r in san.reports]))
    """)
    assert ["read-after-write", ["side-2", "side-1"]] in out


def test_a_free_of_a_block_with_stream_uses_waits_for_the_capture_s_end():
    out = run("""
    import gc
    s, side = torch.npu.Stream(), torch.npu.Stream()
    used = torch.ones(1024, device="npu")
    used.record_stream(side)             # sglang's MLA path records q on its alt stream
    plain = torch.ones(1024, device="npu")
    live = lambda: _graphs._device.STATE.live_npu_bytes
    g = torch.npu.NPUGraph()
    with torch.npu.stream(s):
        g.capture_begin()
        start = live()
        del plain; gc.collect()
        after_plain = live()
        del used; gc.collect()
        after_used = live()
        g.capture_end()
    print(json.dumps({"freed": [start - after_plain, start - after_used, start - live()],
                      "events": simnpu.events("deferred_free")}))
    """)
    assert out["freed"] == [4096, 4096, 8192]  # the plain block at once, the used one at the end
    assert out["events"] == [["deferred_free", 1, 1, 4096]]
