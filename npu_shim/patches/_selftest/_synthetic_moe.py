"""A synthetic GLM-4.x-style MoE block and the dual-stream overlap measured on it, with device events.

Used by ``python -m npu_shim selftest`` (dual_stream_experts.py beside this) and by the benchmark row
(scripts/bench_dual_stream.py, dev/shimdev/bench/dual_stream_bench.py): one piece of code, so the row and
the selftest measure the same thing.  The block has a router gate, top-k, routed experts run expert
by expert, and one shared-expert MLP; it runs

* serial     -- 0.5.9's ``forward_deepep`` order, everything on the current (main) stream;
* overlapped -- the shim's own dual-stream body (``DualStreamExpertsState._forward_deepep_dual_stream``:
  shared experts on the side stream, gate -> topk -> routed experts on the main one, main waits
  for the side stream before the combine);
* each part alone -- shared only, routed only: ideal = max(shared, routed).

Times are device time between two events recorded on the main stream
(``Event(enable_timing=True)``, ``elapsed_time``: torch.cuda and torch_npu alike), medians of
samples of ``reps`` calls.  A device module without ``Event`` (CPU) is timed with the wall clock
after ``synchronize``.  The stream helpers go through ``torch.get_device_module()`` as upstream's,
so the same code runs on CUDA and on an NPU.  ``measure_graph`` times the same arms under device
graphs (each captured once by ``capture``, its replays timed: the production mode), and
``crossover`` finds, over a sweep of sizes, the smallest from which two streams win.  Imports torch
only when called.
"""

import contextlib
import statistics
import time

# GLM-4.5-Air's MoE layer (hidden 4096, expert and shared MLP 1408, top-8 of 128 routed experts,
# one shared expert), with 16 routed experts run one by one: the selftest's shape.
GLM4_AIR = dict(hidden=4096, shared_inter=1408, experts=16, topk=8, expert_inter=1408)
SELFTEST_TOKENS = (256, 1024, 4096)
DEFAULTS = dict(tokens=512, hidden=2048, shared_inter=4096, experts=8, topk=2, expert_inter=1024,
                samples=15, reps=10, warmup=5, routed="per-expert")
# How the routed experts run: "per-expert" gathers each expert's tokens (``nonzero``: the host
# waits for the main stream once per expert, as an eager loop over experts does); "masked" runs
# each expert over every token with its routing weight (zero where it was not chosen): the same
# sums, no host wait, as a grouped matmul queues the routed work without stopping the host.
ROUTED = ("per-expert", "masked")
TARGET_FRACTION = 0.9


class _NoDispatchInfo:
    """What ExpertLocationDispatchInfo.init_new returns without EPLB: None."""

    @staticmethod
    def init_new(layer_id):
        return None


# The dual-stream body reads ExpertLocationDispatchInfo from the globals of the function it stands
# in for; serial_forward (below) is that function here.
ExpertLocationDispatchInfo = _NoDispatchInfo


_MLP = []


def mlp_class():
    """``Mlp(hidden, inter)``: a gated SiLU MLP (``gate_up``, ``down``), a GLM-4.x expert's shape
    (the class is made on first use: importing this module imports no torch)."""
    if not _MLP:
        import torch
        import torch.nn.functional as F

        class Mlp(torch.nn.Module):
            def __init__(self, hidden, inter):
                super().__init__()
                self.gate_up = torch.nn.Linear(hidden, 2 * inter, bias=False)
                self.down = torch.nn.Linear(inter, hidden, bias=False)

            def forward(self, x):
                gate, up = self.gate_up(x).chunk(2, dim=-1)
                return self.down(F.silu(gate) * up)

        _MLP.append(Mlp)
    return _MLP[0]


def build_block(device, dtype, p):
    import torch

    torch.manual_seed(0)
    H, E, K = p["hidden"], p["experts"], p["topk"]
    Mlp = mlp_class()

    class TopK:
        def __call__(self, hidden_states, router_logits, num_token_non_padded=None,
                     expert_location_dispatch_info=None):
            weights, ids = torch.softmax(router_logits.float(), dim=-1).topk(K, dim=-1)
            return (weights / weights.sum(dim=-1, keepdim=True)).to(hidden_states.dtype), ids

    if p["routed"] not in ROUTED:
        raise ValueError("routed must be one of %s, not %r" % (", ".join(ROUTED), p["routed"]))
    masked = p["routed"] == "masked"

    class Experts(torch.nn.Module):
        """Routed experts, one expert at a time (small GEMMs: the device is far from full)."""
        should_fuse_routed_scaling_factor_in_topk = False

        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleList(Mlp(H, p["expert_inter"]) for _ in range(E))

        def forward(self, hidden_states, topk_output):
            weights, ids = topk_output
            out = torch.zeros_like(hidden_states)
            for e, mlp in enumerate(self.experts):
                if masked:
                    weight = (weights * (ids == e)).sum(dim=-1, keepdim=True)
                    out.add_(mlp(hidden_states) * weight)
                    continue
                token, slot = (ids == e).nonzero(as_tuple=True)
                if token.numel():
                    y = mlp(hidden_states[token]) * weights[token, slot].unsqueeze(-1)
                    out.index_add_(0, token, y)
            return out

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer_id = 0
            self.num_fused_shared_experts = 0
            self.routed_scaling_factor = 2.5
            self.gate = torch.nn.Linear(H, E, bias=False)
            self.topk = TopK()
            self.experts = Experts()
            self.shared_experts = Mlp(H, p["shared_inter"])

        def _forward_shared_experts(self, hidden_states):
            return self.shared_experts(hidden_states)

    return Block().to(device=device, dtype=dtype)


def serial_forward(self, hidden_states, forward_batch):
    """0.5.9's forward_deepep order, single stream (the shim's dual-stream body mirrors it)."""
    router_logits = self.gate(hidden_states)
    shared_output = self._forward_shared_experts(hidden_states)
    topk_output = self.topk(hidden_states, router_logits,
                            num_token_non_padded=forward_batch.num_token_non_padded,
                            expert_location_dispatch_info=ExpertLocationDispatchInfo.init_new(
                                layer_id=self.layer_id))
    final = self.experts(hidden_states=hidden_states, topk_output=topk_output)
    shared_output.add_(final, alpha=self.routed_scaling_factor)
    return shared_output


def routed_only(self, hidden_states, forward_batch):
    router_logits = self.gate(hidden_states)
    topk_output = self.topk(hidden_states, router_logits)
    final = self.experts(hidden_states=hidden_states, topk_output=topk_output)
    return final.mul_(self.routed_scaling_factor)


def sample_ms(fn, device_module, reps):
    """Mean milliseconds of one of ``reps`` calls of ``fn``: device time between two events on the
    current stream where the device module has timing events, else wall time after synchronize."""
    try:
        begin, end = device_module.Event(enable_timing=True), device_module.Event(enable_timing=True)
    except (AttributeError, TypeError):  # torch.cpu: an Event without timing
        begin = None
    if begin is None:
        device_module.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        device_module.synchronize()
        return (time.perf_counter() - start) * 1000.0 / reps
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return float(begin.elapsed_time(end)) / reps


def median_ms(fn, device_module, p):
    for _ in range(p["warmup"]):
        fn()
    device_module.synchronize()
    return statistics.median(sample_ms(fn, device_module, p["reps"]) for _ in range(p["samples"]))


def measure(device, device_module=None, dtype=None, **overrides):
    """{serial, serial_again, overlapped, shared, routed, ideal (ms), equal (bool), params} for the
    block on ``device`` (a torch device string); ``device_module`` the module whose streams and
    events to use (default ``torch.get_device_module(device)``)."""
    import types

    import torch

    from npu_shim.patches import dual_stream_experts as ds

    p = dict(DEFAULTS, **overrides)
    dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
    dm = device_module or torch.get_device_module(device)
    block = build_block(device, dtype, p)
    hidden = torch.randn(p["tokens"], p["hidden"], device=device, dtype=dtype)
    batch = types.SimpleNamespace(num_token_non_padded=None)
    with device_module_named(torch, dm), torch.no_grad():
        process = ds.DualStreamExpertsState()  # the shim's per-process state, as a decision builds it
        fns = {
            "serial": lambda: serial_forward(block, hidden, batch),
            "overlapped": lambda: process._forward_deepep_dual_stream(serial_forward, block, hidden, batch),
            "shared": lambda: block._forward_shared_experts(hidden),
            "routed": lambda: routed_only(block, hidden, batch),
        }
        equal = bool(torch.equal(fns["serial"](), fns["overlapped"]()))
        result = {name: median_ms(fn, dm, p) for name, fn in fns.items()}
        # Serial once more after the rest: a drift between the two would show up here.
        result["serial_again"] = median_ms(fns["serial"], dm, p)
    result["ideal"] = max(result["shared"], result["routed"])
    result["equal"] = equal
    result["params"] = p
    return summarise(result)


def graph_support(dm):
    """(graph class, None) where the device module captures and replays graphs (``torch.cuda``'s
    ``CUDAGraph``, torch_npu's ``NPUGraph``, each with ``graph(...)``), else (None, why not)."""
    cls = getattr(dm, "CUDAGraph", None) or getattr(dm, "NPUGraph", None)
    if cls is None or not callable(getattr(dm, "graph", None)):
        return None, "no device graphs (%s has no CUDAGraph or NPUGraph with graph())" % (
            getattr(dm, "__name__", type(dm).__name__))
    return cls, None


def capture(dm, fn, warmup=3):
    """(graph, output): ``fn``'s device work captured once into a graph of ``dm``: ``warmup`` eager
    calls first on the capture stream (a stream of its own, forked from and joined back to the
    current one), then the capture on it (``dm.graph(graph, stream=...)``: torch.cuda.graph and
    torch.npu.graph alike).  Where ``fn`` forks a side stream from the capture stream and joins it
    back (the dual-stream body's ``wait_stream``: an event recorded and waited on), the fork and
    the join are captured too.  ``graph.replay()`` re-runs the work into ``output``."""
    cls, why = graph_support(dm)
    if cls is None:
        raise RuntimeError(why)
    stream = dm.Stream()
    stream.wait_stream(dm.current_stream())
    with dm.stream(stream):
        for _ in range(warmup):
            fn()
    dm.current_stream().wait_stream(stream)
    dm.synchronize()
    graph = cls()
    with dm.graph(graph, stream=stream):
        out = fn()
    dm.synchronize()
    return graph, out


def measure_graph(device, device_module=None, dtype=None, **overrides):
    """``measure``'s figures (same keys) with each of serial, overlapped, shared-only and
    routed-only captured once into a device graph (``capture``) and timed by its replays: the
    production mode, where a replay runs no Python.  The routed experts run "masked": "per-expert"
    reads the host (``nonzero``), which a capture refuses (ValueError if asked for).  ``equal``:
    the serial and the overlapped graphs' replayed outputs are the same."""
    import types

    import torch

    from npu_shim.patches import dual_stream_experts as ds

    p = dict(DEFAULTS, **dict({"routed": "masked"}, **overrides))
    if p["routed"] != "masked":
        raise ValueError("routed %r cannot be captured into a graph: it reads the host (nonzero) per "
                         "expert; graphs run the masked path" % p["routed"])
    dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
    dm = device_module or torch.get_device_module(device)
    block = build_block(device, dtype, p)
    hidden = torch.randn(p["tokens"], p["hidden"], device=device, dtype=dtype)
    batch = types.SimpleNamespace(num_token_non_padded=None)
    graphs, outs = {}, {}
    with device_module_named(torch, dm), torch.no_grad():
        process = ds.DualStreamExpertsState()
        fns = {
            "serial": lambda: serial_forward(block, hidden, batch),
            "overlapped": lambda: process._forward_deepep_dual_stream(serial_forward, block, hidden, batch),
            "shared": lambda: block._forward_shared_experts(hidden),
            "routed": lambda: routed_only(block, hidden, batch),
        }
        try:
            for name, fn in fns.items():
                graphs[name], outs[name] = capture(dm, fn, p["warmup"])
            graphs["serial"].replay()
            graphs["overlapped"].replay()
            dm.synchronize()
            equal = bool(torch.equal(outs["serial"], outs["overlapped"]))
            result = {name: median_ms(graph.replay, dm, p) for name, graph in graphs.items()}
            result["serial_again"] = median_ms(graphs["serial"].replay, dm, p)
        finally:
            for graph in graphs.values():
                graph.reset()
    result["ideal"] = max(result["shared"], result["routed"])
    result["equal"] = equal
    result["params"] = p
    return summarise(result)


def crossover(points):
    """Where two streams start to win, from ``points`` ({tokens, serial_median, overlapped}, the
    sizes of one sweep): {"verdict", "tokens", "text"}.  The crossover is the smallest measured
    size from which the overlapped block is faster than the serial one at that size and at every
    larger size measured.  verdict "always" (it wins at every size measured), "from" (``tokens``:
    it loses below), "never" (it loses at the largest size measured), "not measured" (no points)."""
    pts = sorted(points, key=lambda point: point["tokens"])
    if not pts:
        return {"verdict": "not measured", "tokens": None, "text": "not measured: no sizes"}
    span = ("%d tokens" % pts[0]["tokens"] if len(pts) == 1
            else "%d-%d tokens" % (pts[0]["tokens"], pts[-1]["tokens"]))
    wins = [point["overlapped"] < point["serial_median"] for point in pts]
    start = len(pts)
    while start > 0 and wins[start - 1]:
        start -= 1
    if start == 0:
        return {"verdict": "always", "tokens": pts[0]["tokens"],
                "text": "always: two streams win at every size measured (%s)" % span}
    if start < len(pts):
        return {"verdict": "from", "tokens": pts[start]["tokens"],
                "text": "from %d tokens: two streams win from there up to %d, lose below (%s)"
                        % (pts[start]["tokens"], pts[-1]["tokens"], span)}
    won = [str(point["tokens"]) for point, win in zip(pts, wins) if win]
    return {"verdict": "never", "tokens": None,
            "text": "never: two streams lose at %d tokens, the largest measured (%s)%s"
                    % (pts[-1]["tokens"], span, "; they win at %s only" % ", ".join(won) if won else "")}


def graph_check(step, **overrides):
    """(equal, facts): the shim's dual-stream body captured into an NPU graph and replayed
    (``_graphs.capture_and_replay``) on new hidden states, against the serial forward run eagerly.
    The routed experts run "masked": "per-expert" waits on the host (``nonzero``), which a capture
    refuses.  The side stream is made and joined inside the capture, as in a captured
    ``TARGET_VERIFY`` forward."""
    import types

    from npu_shim.patches import dual_stream_experts as ds
    from npu_shim.patches._selftest import _graphs

    torch, dm, device = step.torch, step.dm, _graphs.device(step)
    p = dict(DEFAULTS, **dict(overrides, routed="masked"))
    dtype = torch.float32 if step.simulated else torch.bfloat16
    block = build_block(device, dtype, p)
    hidden = torch.randn(p["tokens"], p["hidden"], device=device, dtype=dtype)
    fresh = torch.randn(p["tokens"], p["hidden"], device=device, dtype=dtype)
    batch = types.SimpleNamespace(num_token_non_padded=None)
    with device_module_named(torch, dm), torch.no_grad():
        process = ds.DualStreamExpertsState()
        equal, facts = _graphs.capture_and_replay(
            step, lambda h: process._forward_deepep_dual_stream(serial_forward, block, h, batch),
            [hidden], [fresh], reference=lambda h: serial_forward(block, h, batch))
    facts["tokens"] = p["tokens"]
    return equal, facts


@contextlib.contextmanager
def device_module_named(torch, dm):
    """The stream helpers ask torch.get_device_module() (no argument, as upstream): make it name
    ``dm`` even where the accelerator default differs (``--device cpu`` on a GPU box)."""
    real_get = torch.get_device_module
    torch.get_device_module = lambda d=None: dm if d is None else real_get(d)
    try:
        yield
    finally:
        torch.get_device_module = real_get


def summarise(result):
    """Adds ``serial_median`` (of the two serial runs), ``possible`` (serial - ideal) and
    ``fraction`` (the achieved share of it; None where there is nothing to save: zero times)."""
    serial = statistics.median([result["serial"], result["serial_again"]])
    possible = serial - result["ideal"]
    result["serial_median"] = serial
    result["possible"] = possible
    result["fraction"] = (serial - result["overlapped"]) / possible if possible > 0 else None
    return result
