"""``python -m npu_shim selftest``'s step of mla_weight_release: one layer's fused qkv_a weight and
``w_kc`` of DeepSeek-V3 and of GLM-5 on the device, freed through the patch's own path:
``memory_allocated`` (and ``memory_reserved`` after ``empty_cache``) drop by what the weights
added, a touch raises ``ReleasedWeightError``, a weight with a live view is kept.  On an NPU with
the graph API, a released weight is refused inside a live capture and a kept weight's projection
is captured and replayed (npu_shim/patches/_selftest/_graphs.py).

On the tests' simulated NPU the bytes held by the weights' storages stand in for the allocator's
statistics (it keeps none), and the line says so.
"""

MIB = 1 << 20
# Dims of one MLA layer of two public configs (config.json of each model, TP 1).
MLA_CONFIGS = {
    "DeepSeek-V3": dict(hidden=7168, heads=128, q_lora=1536, kv_lora=512, nope=128, rope=64),
    "GLM-5": dict(hidden=6144, heads=64, q_lora=2048, kv_lora=512, nope=192, rope=64),
}


class _Meter:
    """Device memory as the allocator counts it: ``memory_allocated``, and ``memory_reserved`` after
    ``empty_cache``.  The simulated NPU keeps no allocator statistics: there the bytes held by the
    weights' own storages are read instead (0 once released)."""

    def __init__(self, torch, dm, simulated, index):
        self.torch, self.dm, self.simulated, self.index = torch, dm, simulated, index

    def read(self, weights=()):
        if self.simulated:
            with self.torch._C.DisableTorchFunctionSubclass():  # a released weight raises otherwise
                held = sum(w.untyped_storage().nbytes() for w in weights)
            return held, held
        self.dm.synchronize()
        allocated = self.dm.memory_allocated(self.index)
        self.dm.empty_cache()
        return allocated, self.dm.memory_reserved(self.index)


def mla_layer(torch, config, device):
    """One layer's fused qkv_a weight ([q_lora + kv_lora + rope, hidden], a Parameter) and ``w_kc``
    laid out as sglang's loader leaves it (``transpose(1, 2).contiguous().transpose(1, 2)`` of
    [heads, nope, kv_lora]), bf16."""
    c = MLA_CONFIGS[config]
    qkv = torch.nn.Parameter(torch.randn(c["q_lora"] + c["kv_lora"] + c["rope"], c["hidden"],
                                         dtype=torch.bfloat16, device=device), requires_grad=False)
    w_kc = torch.randn(c["heads"], c["nope"], c["kv_lora"], dtype=torch.bfloat16,
                       device=device).transpose(1, 2).contiguous().transpose(1, 2)
    return qkv, w_kc


def mib(options):
    """Free device memory (MiB) the step needs: two layers' weights, one at a time, with room to
    spare."""
    return 2048


def _graph_part(step, mla, once):
    """(ok, text, facts) where the step's device does graphs: a released weight is refused inside a
    live capture (the guard works at capture: a replay runs no Python), the capture ends cleanly,
    and then a decode-shaped projection with a kept weight is captured and replayed on new inputs,
    equal to eager."""
    from npu_shim.patches._selftest import _graphs

    why = _graphs.skipped(step)
    if why:
        return True, why, {"skipped": step.graphs}
    torch, device = step.torch, _graphs.device(step)
    config = "DeepSeek-V3"
    step.progress("%s layer: a released weight inside an NPU graph capture, then capture and replay" % config)
    qkv, w_kc = mla_layer(torch, config, device)
    hidden = MLA_CONFIGS[config]["hidden"]
    x = torch.randn(4, hidden, dtype=torch.bfloat16, device=device)
    fresh = torch.randn(4, hidden, dtype=torch.bfloat16, device=device)
    mla.free_weight(w_kc, "w_kc of the graph check", once)
    refused, facts = _graphs.refused_at_capture(step, lambda h: h.sum() + w_kc.sum(), [x], mla.ReleasedWeightError)
    equal, replay = _graphs.capture_and_replay(step, lambda h: h @ qkv.t(), [x], [fresh])
    facts.update(replay)
    return refused and equal, "graph: a released weight %s inside a capture; the kept qkv_a weight's " \
        "projection captured and replayed, output %s eager" % (
            "refused" if refused else "NOT refused", "equal to" if equal else "DIFFERS from"), facts


def run(step):
    """Each config's layer freed through the shim's own ``free_weight``; (ok, line, facts)."""
    from npu_shim.patches import mla_weight_release as mla

    torch, device, simulated, progress = step.torch, step.device, step.simulated, step.progress

    facts, parts, ok = {}, [], True
    said = []
    once = lambda key, level, message: said.append(message)  # noqa: E731 - release's ``once``
    meter = _Meter(torch, step.dm, simulated, step.index)
    for config in MLA_CONFIGS:
        progress("%s layer: allocate, release, touch" % config)
        said.clear()
        base_alloc, base_res = meter.read()
        qkv, w_kc = mla_layer(torch, config, device)
        weights = (qkv, w_kc)
        nbytes = sum(w.untyped_storage().nbytes() for w in weights)
        if simulated:
            base_alloc = base_res = 0
        up_alloc, up_res = meter.read(weights)
        view = qkv[:1]  # a live view: the weight must be kept whole
        kept = mla.free_weight(qkv, "qkv_a_proj.weight (with a live view)", once)
        kept_ok = kept == 0 and not mla.is_released(qkv) and bool(said)
        del view
        freed = mla.free_weight(qkv, "qkv_a_proj.weight of the %s layer" % config, once) + \
            mla.free_weight(w_kc, "w_kc of the %s layer" % config, once)
        after_alloc, after_res = meter.read(weights)
        touches = []
        for name, touch in (("qkv_a.sum()", lambda: qkv.sum()),  # noqa: F821 - called before the del below
                            ("w_kc @ x", lambda: w_kc @ w_kc)):  # noqa: F821 - called before the del below
            try:
                touch()
                touches.append("%s did not raise" % name)
            except mla.ReleasedWeightError:
                pass
        rise, drop = up_alloc - base_alloc, up_alloc - after_alloc
        rise_res, drop_res = up_res - base_res, up_res - after_res
        case_ok = (freed == nbytes and drop == rise and rise >= nbytes and drop_res == rise_res
                   and not touches and kept_ok)
        ok = ok and case_ok
        facts[config] = {"bytes": nbytes, "released": freed, "allocated_rise": rise,
                         "allocated_drop": drop, "reserved_rise": rise_res, "reserved_drop": drop_res,
                         "touch_raises": not touches, "view_kept": kept_ok, "ok": case_ok,
                         "problems": touches}
        parts.append("%s %.1f MiB freed%s" % (config, freed / MIB, "" if case_ok else " (MISMATCH: "
                     "freed %d of %d bytes, allocated -%d of +%d, reserved -%d of +%d%s%s)" % (
                         freed, nbytes, drop, rise, drop_res, rise_res,
                         "" if kept_ok else ", a weight with a live view was not kept",
                         "".join("; " + t for t in touches))))
        del qkv, w_kc, weights
    graph_ok, graph_text, facts["graph"] = _graph_part(step, mla, once)
    ok = ok and graph_ok
    parts.append(graph_text)
    how = ("storage bytes (the simulated NPU keeps no allocator statistics)" if simulated else
           "memory_allocated and memory_reserved after empty_cache dropped by what the weights added")
    line = ("%s; checked: %s, a touch raises ReleasedWeightError, a weight with a live view is kept"
            % ("; ".join(parts), how))
    return ok, line, facts
