"""The zbal backport's own cost, side by side in one run (simulated NPU, memfabric-zbal's Python
layer over its simulated native side, medians).

zbal's wrappers run a handful of times per process (start-up memory queries, one Scheduler, one
ModelRunner), so what matters is that they add microseconds, not milliseconds, and that deciding
the patch from the release source stays well under a second.

* ``get_available_gpu_memory`` as sglang 0.5.11 wrote it, plain vs wrapped, in mix mode (the wrapper
  asks zbal for the mode, then calls the original) and in full mode (zbal's heap figure);
* ``decide`` of the zbal patch on a cold ``SourceView`` of 0.5.11 (parses the five target modules).

Usage: python scripts/bench_zbal.py [--rounds N] [--calls N]
"""

import argparse
import ast
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "dev"), REPO]  # shimdev (dev/shimdev/__init__.py), npu_shim

from shimdev.envs import sglang_envs  # noqa: E402 - after dev/ is put on sys.path

RELEASE = "0.5.11"


def _setup():
    from shimdev import simnpu, simzbal

    if simnpu.installed() is None:
        simnpu.install()
    layer = sglang_envs.ensure_zbal_layer()
    if str(layer) not in sys.path:
        sys.path.insert(0, str(layer))  # ``import zbal``: the wheel's Python layer, simulated native side
    os.environ.update(sglang_envs.zbal_env(layer))
    import zbal  # noqa: F401 - the wrapper imports it; loaded here, outside the timed calls

    return sglang_envs, simzbal


def _original(source_root, name):
    import torch

    path = os.path.join(source_root, "sglang", "srt", "utils", "common.py")
    tree = ast.parse(open(path, encoding="utf-8").read())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), namespace)
    return namespace[name]


def _per_call_us(func, calls, rounds):
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            func("npu", 0, empty_cache=False)
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def rows(rounds=15, calls=2000):
    envs, zbal = _setup()
    import wrapt

    from npu_shim.core import framework
    from npu_shim.source.codeview import SourceView
    from npu_shim.patches import zbal as zp

    saved = os.environ.get("SGLANG_ZBAL_LOCAL_MEM_SIZE")
    os.environ["SGLANG_ZBAL_LOCAL_MEM_SIZE"] = "61440"
    try:
        return _rows(envs, zbal, wrapt, framework, SourceView, zp, rounds, calls)
    finally:
        if saved is None:
            os.environ.pop("SGLANG_ZBAL_LOCAL_MEM_SIZE", None)
        else:
            os.environ["SGLANG_ZBAL_LOCAL_MEM_SIZE"] = saved


def _rows(envs, zbal, wrapt, framework, SourceView, zp, rounds, calls):
    root = str(envs.ensure_sources(RELEASE))
    original = _original(root, "get_available_gpu_memory")
    wrapped = wrapt.FunctionWrapper(original, zp.get_available_gpu_memory)
    result = []
    zbal.reset()
    for mode, mix in (("mix", True), ("full", False)):
        zbal.STATE.mix = mix
        plain, patched = [], []
        for _ in range(rounds):  # alternate the arms, one round each
            plain.append(_per_call_us(original, calls, 1))
            patched.append(_per_call_us(wrapped, calls, 1))
            del zbal.CALLS[:]  # zbal here: shimdev.simzbal, the native side's record
        p, w = statistics.median(plain), statistics.median(patched)
        result.append({
            "what": "get_available_gpu_memory('npu'), %s mode: added per call" % mode,
            "how": "sglang %s's function plain vs wrapped, %d rounds x %d calls, medians" % (
                RELEASE, rounds, calls),
            "measured": "%.1f us (plain %.1f us, wrapped %.1f us)" % (w - p, p, w),
            "target": "< 50 us (a few calls per process)",
            "ok": w - p < 50,
        })
    decide_s = []
    for _ in range(5):
        view = SourceView(os.path.join(root, "sglang"))
        start = time.perf_counter()
        decision = framework.decide(zp.PATCH, view, environ=dict(os.environ), on_npu=True)
        decide_s.append(time.perf_counter() - start)
    result.append({
        "what": "decide(zbal) on a cold SourceView of %s" % RELEASE,
        "how": "5 runs, median (reads the 5 target modules, parses the functions it checks, checks 10 targets)",
        "measured": "%.0f ms (%s)" % (statistics.median(decide_s) * 1e3, decision.state),
        "target": "< 1000 ms, state applied",
        "ok": statistics.median(decide_s) < 1.0 and decision.state == framework.APPLIED,
    })
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    for row in rows(args.rounds, args.calls):
        print("%-4s %-55s %s  [target %s]\n     %s" % (
            "ok" if row["ok"] else "FAIL", row["what"], row["measured"], row["target"], row["how"]))


if __name__ == "__main__":
    main()
