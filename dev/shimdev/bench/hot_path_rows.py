"""scripts/bench_hot_path.py's rows (its docstring says what each measures; hot_path_bench.py
how): each measurement turned into the table's row, with what its result rests on."""

from shimdev.bench.bench_rows import EAGER_NS

WHAT_EAGER = "npu_mla_preprocess wrapper in eager mode, a layer it has seen: added ns/call (real sglang 0.5.11)"
WHAT_FUNCTION = ("npu_mla_preprocess in eager mode, a layer it has seen: added ns/call, the shim's function in a "
                 "process of its own (no sglang)")
# The budget of a wrapper on a layer's path (bench_rows.EAGER_NS): what an eager call may add; a
# captured NPU graph replays its kernels without running Python, so the wrapper adds nothing there.
EAGER_TARGET = "<= %d ns per eager call (0 at graph replay: no Python runs there)" % EAGER_NS
WHAT_EXTEND = ("dual-stream experts per MoE layer call, extend batch: the shim on real sglang 0.5.9 vs "
               "sglang 0.5.10's own")
WHAT_DECODE = "the same, decode batch (single stream: the shim's wrapper calls through)"
MOE_TARGET = 1.05


def _failed(whats, exc):
    from shimdev.bench.bench_rows import one_line

    return [{"what": what, "how": "", "measured": "not measured: failed: %s" % one_line(exc), "target": "",
             "ok": False, "failed": one_line(exc)} for what in whats]


def mla_eager_row(rounds, calls):
    from shimdev.bench import hot_path_bench as H

    out = H.mla_eager(rounds, calls)
    info, ns = out["info"], out["ns"]
    caller, sglang = (H.median(ns[arm]) for arm in ("caller", "sglang"))
    added = caller - sglang
    held = info["state"] == "applied" and info["caller_is_wrapper"] \
        and info["through_wrapper"] == [True] * (2 * info["layers"]) and info["released_layers"] == info["layers"]
    return {
        "what": WHAT_EAGER,
        "how": "one process, the shim on (demo triggers, decode): 2 passes over %d synthetic GLM-5 layers through "
               "the real function (their weights released; the wrapper stays); then a stand-in layer the wrapper "
               "has seen (its mla_preprocess returns at once: sglang's own body runs) called through the name the "
               "caller forward_dsa_prepare_npu looks up (the wrapper, checked by identity) and through sglang's "
               "function; %d rounds x %dk calls, arms alternated, medians of the thread's CPU time per call"
               % (info["layers"], rounds, calls // 1000),
        "measured": "%+.0f ns (%.0f ns through the wrapper vs %.0f ns sglang's function, %s)%s"
                    % (added, caller, sglang, info["wrapt"], "" if held else "; NOT held: %r" % info),
        "target": EAGER_TARGET,
        "ok": bool(held) and added <= EAGER_NS,
    }


def mla_function_row(rounds, calls):
    from shimdev.bench import hot_path_bench as H

    out = H.mla_function(rounds, calls)
    plain, unwrapped = (H.median(out["ns"][arm]) for arm in ("plain", "unwrapped"))
    added = plain - unwrapped
    return {
        "what": WHAT_FUNCTION,
        "how": "Python %s: the shim's function vs the function it replaces; %d rounds x %dk calls, arms "
               "alternated, medians of the thread's CPU time per call" % (out["info"]["python"], rounds, calls // 1000),
        "measured": "%+.0f ns (%.0f vs %.0f ns)" % (added, plain, unwrapped),
        "target": EAGER_TARGET,
        "ok": added <= EAGER_NS,
    }


def moe_rows(rounds, calls, tokens=16):
    from shimdev.bench import hot_path_bench as H

    out = H.dual_stream(rounds, calls, tokens)
    shim, up, off = out["shim"], out["upstream"], out["off"]
    si, ui, oi = shim["info"], up["info"], off["info"]
    problems = []
    if si["state"] != "applied" or si["wrapped"]["forward_deepep"] != "FunctionWrapper":
        problems.append("0.5.9: dual_stream_experts %s, forward_deepep %s" % (si["state"], si["wrapped"]))
    if ui["state"] != "upstream" or ui["wrapped"]["forward_deepep"] != "function":
        problems.append("0.5.10: dual_stream_experts %s, forward_deepep %s" % (ui["state"], ui["wrapped"]))
    if oi["wrapped"]["forward_deepep"] != "function":
        problems.append("0.5.9 with the patch off: forward_deepep %s" % oi["wrapped"])
    if not si["params"] == ui["params"] == oi["params"]:
        problems.append("the blocks differ: %s vs %s" % (si["params"], ui["params"]))
    rows = []
    for mode, what in (("extend", WHAT_EXTEND), ("decode", WHAT_DECODE)):
        a, b, c = shim["ns"][mode], up["ns"][mode], off["ns"][mode]
        ratio = H.median(a) / H.median(b)
        _, (low, high) = H.round_ratios(a, b)
        wall = H.median(shim["ns"][mode + "@wall"]) / H.median(up["ns"][mode + "@wall"])
        equal = si["digests"][mode] == ui["digests"][mode] == oi["digests"][mode]
        calls_ = (si["calls"][mode], ui["calls"][mode], oi["calls"][mode])
        own = H.median(shim["ns"][mode + "_own"]) if mode + "_own" in shim["ns"] else None
        waits = (si["waits"][mode], ui["waits"][mode])
        rows.append({
            "what": what,
            "how": "three processes, the simulated NPU, SGLANG_NPU_USE_MULTI_STREAM=1: 0.5.9's forward_deepep under "
                   "the shim's wrapper, 0.5.10's own (the shim stands down there), and 0.5.9's own with the patch "
                   "off (NPU_SHIM_DUAL_STREAM_EXPERTS=0: single stream, no wrapper); the same synthetic block "
                   "(release_beds.glm4_moe_bed: real Glm4MoeGate, the selftest's shared MLP, stand-in top-k and "
                   "experts; hidden %d, weights from one seed), %d tokens; the processes asked in alternating "
                   "rounds, %d rounds x %d calls, one torch thread, medians of the thread's CPU time per call"
                   % (si["hidden"], tokens, rounds, calls),
            "measured": "%.1f us vs %.1f us = %.3fx (middle half of rounds %.3f-%.3fx; wall time %.3fx); function "
                        "calls per layer call %.0f vs %.0f (%.3fx: what the load does not move); 0.5.9 with the "
                        "patch off %.1f us, %.0f calls; in the shim's process 0.5.9's own function unwrapped "
                        "(single stream) %s; outputs equal bit for bit (all three): %s; stream waits per call "
                        "%d / %d%s"
                        % (H.median(a) / 1e3, H.median(b) / 1e3, ratio, low, high, wall, calls_[0], calls_[1],
                           calls_[0] / calls_[1], H.median(c) / 1e3, calls_[2],
                           "%.1f us (the wrapped call %+.1f us)" % (own / 1e3, (H.median(a) - own) / 1e3)
                           if own is not None else "not measured", "yes" if equal else "NO",
                           waits[0], waits[1], "; " + "; ".join(problems) if problems else ""),
            "target": "<= %.2fx" % MOE_TARGET,
            "ok": ratio <= MOE_TARGET and equal and not problems,
        })
    return rows


def rows(rounds=15, calls=100000, moe_calls=2000):
    """The table's rows: each measurement in its own try, so one that fails leaves the others."""
    result = []
    try:
        result.append(mla_eager_row(rounds, calls))
    except Exception as exc:  # noqa: BLE001 - one line in the table
        result += _failed([WHAT_EAGER], exc)
    try:
        result.append(mla_function_row(rounds, calls))
    except Exception as exc:  # noqa: BLE001 - one line in the table
        result += _failed([WHAT_FUNCTION], exc)
    try:
        result += moe_rows(rounds, moe_calls)
    except Exception as exc:  # noqa: BLE001 - one line in the table
        result += _failed([WHAT_EXTEND, WHAT_DECODE], exc)
    return result
