"""The shim's own cost, measured side by side in one run (alternating, medians).

* start-up of a process that never imports sglang: ``python -c pass`` with the shim on PYTHONPATH
  vs without -- once on a compiled copy of the shim (its ``.pyc`` present), once on a copy of its
  sources with no ``__pycache__`` and ``PYTHONDONTWRITEBYTECODE=1`` (nothing compiled, nothing
  written: a read-only checkout); peak RSS of the child (``os.wait4``);
* import overhead: the real sglang 0.5.11 target modules imported in a fresh process on the
  simulated NPU, every patch that applies on (zbal with a size and the zbal layer on PYTHONPATH,
  MLA release, multi-stream), with the shim on PYTHONPATH vs without; the median of each
  alternating round's ratio, and the same two processes' instructions under valgrind (cachegrind),
  which do not vary with the machine's speed;
* memory the shim retains there: ``tracemalloc`` (``PYTHONTRACEMALLOC=1``, from interpreter
  start) traced memory after the imports and a ``gc.collect()``, shim vs not.

Budgets (shimdev/bench/bench_rows.py): an sglang import <= 1.05x in instructions, <= 2 MiB retained; the
wall-time rows, the start-up rows here and the shim's own time are references (the start-up budget
is counted in instructions by scripts/bench_drop_in.py, on the bundle).

Usage: python3 scripts/bench_shim_cost.py [--startup-runs N] [--import-runs N]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "dev"), REPO]  # shimdev (dev/shimdev/__init__.py), npu_shim

from shimdev import DEV  # noqa: E402 - after dev/ is put on sys.path
from shimdev.envs import sglang_envs  # noqa: E402 - after dev/ is put on sys.path
from shimdev.bench.bench_rows import (  # noqa: E402 - after dev/ is put on sys.path
    IMPORT_INSTRUCTIONS, RETAINED_MIB, STARTUP_INSTRUCTIONS, clean_env, instructions_side_by_side)
from shimdev.beds.demo_features import DEMO_ENV  # noqa: E402 - after dev/ is put on sys.path

IMPORT_RELEASE = "0.5.11"
# What the zbal integration itself loads when it is on (upstream 0.5.12's does the same): imported
# in both arms, so the rows measure the shim, not the feature it turns on.
FEATURE_IMPORTS = ("zbal", "zbal.zbal_buffer", "zbal.zbal.deepep_adaptor")
MIB = 1 << 20


def timed_run(argv, env):
    """(wall seconds, peak RSS in MiB) of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode()
    proc.stderr.close()
    if proc.returncode != 0:
        raise RuntimeError("%s failed (%d): %s" % (" ".join(argv), proc.returncode, err[-2000:]))
    return wall, usage.ru_maxrss / 1024.0


def alternate(runs, arms):
    """Run each arm ``runs`` times, interleaved, after one warm-up each: rounds alternate the
    order (A B C, then C B A, ...) so no arm always runs first or last in its round."""
    results = {name: [] for name in arms}
    for argv, env in arms.values():
        timed_run(argv, env)
    for round_ in range(runs):
        order = list(arms.items())
        for name, (argv, env) in (order if round_ % 2 == 0 else order[::-1]):
            results[name].append(timed_run(argv, env))
    return results


def quartiles(values):
    """(lower quartile, upper quartile) of ``values``: where the middle half of them lies."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 4], ordered[-1 - (len(ordered) - 1) // 4]


def shim_copy(workdir, name, compiled):
    """sitecustomize.py and npu_shim/ (sources, no ``__pycache__``) copied to workdir/name;
    ``compiled``: then compiled with this interpreter, as a writable checkout ends up."""
    out = os.path.join(workdir, name)
    os.makedirs(out)
    shutil.copy(os.path.join(REPO, "sitecustomize.py"), out)  # the link's target, as a file
    shutil.copytree(os.path.join(REPO, "npu_shim"), os.path.join(out, "npu_shim"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "_vendor"))
    if compiled:
        subprocess.run([sys.executable, "-m", "compileall", "-q", out], check=True)
    return out


def pyc_files(root):
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".pyc")]


_HWM = ("import sys\nfor line in open('/proc/self/status'):\n"
        "    if line.startswith('VmHWM:'):\n        sys.stdout.write(line.split()[1])\n")


def peak_rss(arms, runs):
    """{arm: [peak RSS MiB]}: each child prints its own ``VmHWM`` (its memory map's high-water mark,
    which starts afresh at exec) as its only work after start-up.  Not ``ru_maxrss`` from wait4: a
    child's starts from the RSS of the process that spawned it (this one may hold torch)."""
    out = {name: [] for name in arms}
    for _ in range(runs):
        for name, (argv, env) in arms.items():
            proc = subprocess.run(argv[:-2] + ["-c", _HWM], env=env, capture_output=True, text=True, check=True)
            out[name].append(int(proc.stdout) / 1024.0)
    return out


REFERENCE_STARTUP = ("none: a reference (the start-up budget, <= %.2fx, is counted in instructions on the "
                     "bundle: bench_drop_in)" % STARTUP_INSTRUCTIONS)


def startup_rows(runs):
    python = sys.executable
    no_pyc = {"PYTHONDONTWRITEBYTECODE": "1"}
    with tempfile.TemporaryDirectory(prefix="npu-shim-startup-") as work:
        compiled, sources = shim_copy(work, "compiled", True), shim_copy(work, "sources", False)
        empty = os.path.join(work, "empty")  # Python's own cost of one more PYTHONPATH entry
        os.makedirs(empty)
        arms = {
            "without": ([python, "-c", "pass"], clean_env([])),
            "compiled": ([python, "-c", "pass"], clean_env([compiled])),
            "without-no-pyc": ([python, "-c", "pass"], dict(clean_env([]), **no_pyc)),
            "sources": ([python, "-c", "pass"], dict(clean_env([sources]), **no_pyc)),
            "empty": ([python, "-c", "pass"], clean_env([empty])),
        }
        res = alternate(runs, arms)
        peaks = peak_rss({k: arms[k] for k in ("without", "compiled")}, max(5, runs // 3))
        leaked = pyc_files(sources)
        if leaked or not pyc_files(compiled):
            raise RuntimeError("the start-up copies are not what they name (.pyc in the sources copy: %d, "
                               "in the compiled copy: %d)" % (len(leaked), len(pyc_files(compiled))))
    wall = {k: statistics.median(w for w, _ in v) for k, v in res.items()}
    rss = {k: statistics.median(v) for k, v in peaks.items()}
    ratio = wall["compiled"] / wall["without"]
    ratio_src = wall["sources"] / wall["without-no-pyc"]
    extra = rss["compiled"] - rss["without"]
    ratio_empty = wall["empty"] / wall["without"]
    return [
        {"what": "start-up of `python -c pass`, shim compiled (.pyc present) on PYTHONPATH vs no shim",
         "how": "a compiled copy of sitecustomize.py + npu_shim/; wall time, median of %d alternating runs" % runs,
         "measured": "%.1f ms vs %.1f ms = %.3fx" % (wall["compiled"] * 1e3, wall["without"] * 1e3, ratio),
         "target": REFERENCE_STARTUP, "ok": None},
        {"what": "start-up of `python -c pass`, shim sources with no .pyc anywhere vs no shim",
         "how": "a copy with no __pycache__, PYTHONDONTWRITEBYTECODE=1 in both arms (checked: no .pyc "
                "written), same runs",
         "measured": "%.1f ms vs %.1f ms = %.3fx" % (
             wall["sources"] * 1e3, wall["without-no-pyc"] * 1e3, ratio_src),
         "target": REFERENCE_STARTUP, "ok": None},
        {"what": "start-up of `python -c pass`, an empty directory on PYTHONPATH vs none (reference)",
         "how": "same runs: Python's own cost of one more PYTHONPATH entry, which any delivery on "
                "PYTHONPATH pays before the shim runs a line",
         "measured": "%.1f ms vs %.1f ms = %.3fx" % (wall["empty"] * 1e3, wall["without"] * 1e3, ratio_empty),
         "target": "none: the floor under the two rows above", "ok": None},
        {"what": "peak memory of that process (compiled shim), shim vs not",
         "how": "VmHWM of the child, read by itself as its only work after start-up (the same "
                "`python -c` reading /proc/self/status in both arms), median of %d runs" % max(5, runs // 3),
         "measured": "%+.2f MiB (%.1f vs %.1f MiB)" % (extra, rss["compiled"], rss["without"]),
         "target": "none: a reference (no budget on a process that never imports sglang)", "ok": None},
    ]


_IMPORTS = """import gc, json, os, sys, time
shim_env = {{k: v for k, v in os.environ.items() if k.startswith("NPU_SHIM_")}}
t0 = time.perf_counter()
from shimdev.beds import dual_stream_kernels
from shimdev import simnpu
simnpu.install(release={release!r})
dual_stream_kernels.install(simnpu, kernel="partial")
{imports}
elapsed = time.perf_counter() - t0
gc.collect()
out = {{"elapsed": elapsed}}
try:
    import tracemalloc
    out["traced"] = tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else None
except ImportError:
    out["traced"] = None
rt = sys.modules.get("npu_shim.runtime.activation")
out["states"] = {{n: s["state"] for n, s in rt.RUNTIME.states().items()}} if rt else None
out["handed_on"] = sorted(k for k, v in os.environ.items()
                         if k.startswith("NPU_SHIM_") and shim_env.get(k) != v)
print(json.dumps(out))
"""


# The shim's own work in an import process, timed inside it: activation (the first ``import
# sglang``), deciding and applying (the post-import hooks) -- each entry point wrapped with a timer
# before sglang is imported.  What is not inside them (two meta-path finders asked about every
# import, well under a microsecond each; the start-up bootstrap) is not counted here; the
# alternating runs and the instruction counts include it.
_OWN_TIMERS = """
import time as _time
from npu_shim.runtime.activation import RUNTIME as _runtime
_spent = {}
def _timed(name, function):
    def timed(*args, **kwargs):
        start = _time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            _spent[name] = _spent.get(name, 0.0) + _time.perf_counter() - start
    return timed
for _name in ("activate", "decide_all", "apply_module"):
    setattr(_runtime, _name, _timed(_name, getattr(_runtime, _name)))
"""
_KERNELS = 'dual_stream_kernels.install(simnpu, kernel="partial")\n'


def _with_own_timers(argv):
    code, report = argv[-1], "print(json.dumps(out))"
    if _KERNELS not in code or report not in code:
        raise RuntimeError("could not put the timers into the import process")
    code = code.replace(_KERNELS, _KERNELS + _OWN_TIMERS).replace(report, "out['own'] = _spent\n" + report)
    return argv[:-1] + [code]


def _import_arms():
    from npu_shim.core import loading

    modules = loading.target_modules(loading.load_all())
    rel, layers = sglang_envs.release_env_paths(IMPORT_RELEASE)  # wrapt layer + the release's layers
    code = _IMPORTS.format(release=IMPORT_RELEASE,
                           imports="".join("import %s\n" % m for m in FEATURE_IMPORTS + tuple(modules)))
    trigger = {k: v for k, v in DEMO_ENV.items() if v is not None}  # every patch's trigger set
    zbal_layer = sglang_envs.ensure_zbal_layer()
    rest = [str(DEV), str(zbal_layer)] + [str(p) for p in layers]
    argv = [str(rel.python), "-c", code]
    trigger.update(sglang_envs.zbal_env(zbal_layer))
    return {
        "without": (argv, dict(clean_env(rest), **trigger)),
        "with": (argv, dict(clean_env([REPO] + rest), **trigger)),
    }


def _child(argv, env):
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError("the import process failed (%d): %s" % (
            proc.returncode, (proc.stderr.strip().splitlines() or ["?"])[-1]))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _states(out):
    if not out["states"]:
        raise RuntimeError("the shim was not active in the 'with' arm")
    return ", ".join("%s %s" % kv for kv in out["states"].items())


def import_rows(runs, memory_runs, count_instructions=True):
    arms = _import_arms()
    first = _child(*arms["with"])
    states = _states(first)
    if first["handed_on"]:
        raise RuntimeError("deciding changed the environment a child inherits: %s" % ", ".join(first["handed_on"]))
    # A child of that process (a scheduler, the detokenizer: 8-16 per node) inherits its environment,
    # unchanged by deciding (checked above), and decides from the source itself: an arm of its own,
    # measured alongside.
    arms["child"] = arms["with"]
    res = alternate(runs, arms)
    wall = {k: statistics.median(w for w, _ in v) for k, v in res.items()}
    # The ratio within each round (arms run back to back), then the median over rounds: this
    # machine's speed drifts by several % over minutes, which a ratio of medians takes in whole.
    rounds = {k: [a[0] / b[0] for a, b in zip(res[k], res["without"])] for k in ("with", "child")}
    ratio = {k: statistics.median(v) for k, v in rounds.items()}
    spread = {k: quartiles(v) for k, v in rounds.items()}
    traced = {name: [] for name in arms}
    for _ in range(memory_runs):
        for name, (argv, env) in arms.items():
            traced[name].append(_child(argv, dict(env, PYTHONTRACEMALLOC="1"))["traced"])
    kept = {k: statistics.median(v) for k, v in traced.items()}
    retained = {k: (kept[k] - kept["without"]) / MIB for k in ("with", "child")}
    own = {k: statistics.median(sum(_child(_with_own_timers(arms[k][0]), arms[k][1])["own"].values())
                                for _ in range(memory_runs + 1))
           for k in ("with", "child")}
    own_ratio = {k: 1 + own[k] / wall["without"] for k in own}
    counts = instructions_side_by_side({k: arms[k] for k in ("without", "with")}) if count_instructions else None
    if counts:
        counted = {"measured": "%.2f G vs %.2f G = %.4fx" % (counts["with"] / 1e9, counts["without"] / 1e9,
                                                             counts["with"] / counts["without"]),
                   "ok": counts["with"] / counts["without"] <= IMPORT_INSTRUCTIONS}
    else:
        counted = {"measured": "not measured: %s" % ("valgrind is not installed" if count_instructions
                                                     else "--quick"), "ok": None}
    return [
        {"what": "import overhead: real sglang 0.5.11 target modules, every applicable patch on, shim vs not",
         "how": "wall time of a fresh process that decides from the sglang source (simulated NPU and "
                "the zbal layer in both, zbal's own modules imported in both as the feature itself loads "
                "them; DEMO_ENV triggers: %s), %d alternating rounds (the order reversed every other "
                "round): medians, the median of each round's ratio and where the middle half of the "
                "rounds' ratios lie (this machine's speed varies by ~2 %% from one run to the next)"
                % (states, runs),
         "measured": "%.2f s vs %.2f s, %.3fx (middle half of rounds %.3f-%.3fx)" % (
             wall["with"], wall["without"], ratio["with"], spread["with"][0], spread["with"][1]),
         "target": "none: a reference (the budget is counted in instructions, next row)", "ok": None},
        dict({"what": "the same import overhead in instructions executed",
              "how": "the same two processes under valgrind --tool=cachegrind --cache-sim=no, run side by "
                     "side, each once, with PYTHONHASHSEED=0, one BLAS/OpenMP thread and setarch -R in "
                     "both: counts that do not depend on the machine's speed (two runs of one arm "
                     "differed by 0.02 %); the shim's own code runs more instructions per second than "
                     "the import around it, so this ratio reads above the time ratio",
              "target": "<= %.2fx (budget: an sglang import)" % IMPORT_INSTRUCTIONS}, **counted),
        {"what": "the shim's own time in that process, and in a child, timed inside it",
         "how": "perf_counter around activation, deciding and applying (the runtime's entry points, "
                "wrapped before sglang is imported), median of %d runs each, over the median wall "
                "time of the shim-off arm" % (memory_runs + 1),
         "measured": "%.0f ms = %.4fx; child %.0f ms = %.4fx" % (
             own["with"] * 1e3, own_ratio["with"], own["child"] * 1e3, own_ratio["child"]),
         "target": "none: a reference (what of the overhead is the shim's own work)", "ok": None},
        {"what": "memory the shim retains in an sglang 0.5.11 process, every applicable patch on",
         "how": "tracemalloc from interpreter start (PYTHONTRACEMALLOC=1), traced memory after the same "
                "imports (zbal's own modules in both arms) and gc.collect(), shim vs not, median of %d "
                "runs each; wrapt %s is the image's, of which the shim loads only its C extension (the "
                "post-import hooks are the shim's own)" % (memory_runs, sglang_envs.WRAPT_DEFAULT),
         "measured": "%+.2f MiB (%.1f vs %.1f MiB traced)" % (
             retained["with"], kept["with"] / MIB, kept["without"] / MIB),
         "target": "<= %g MiB (budget: memory retained in an sglang process)" % RETAINED_MIB,
         "ok": retained["with"] <= RETAINED_MIB},
        {"what": "the same two in a spawned child process (decides from the sglang source itself)",
         "how": "the same process with the environment the first arm left (as spawned children "
                "inherit it; checked: deciding changed no NPU_SHIM_* variable), an arm of its own in "
                "the same alternation and memory runs",
         "measured": "%.2f s vs %.2f s, %.3fx (middle half of rounds %.3f-%.3fx); %+.2f MiB" % (
             wall["child"], wall["without"], ratio["child"], spread["child"][0], spread["child"][1],
             retained["child"]),
         "target": "<= %g MiB (the time: a reference)" % RETAINED_MIB,
         "ok": retained["child"] <= RETAINED_MIB},
    ]


def rows(startup_runs=30, import_runs=15, memory_runs=2, count_instructions=True):
    return startup_rows(startup_runs) + import_rows(import_runs, memory_runs, count_instructions)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--startup-runs", type=int, default=30)
    parser.add_argument("--import-runs", type=int, default=15)
    parser.add_argument("--memory-runs", type=int, default=2)
    args = parser.parse_args()
    for row in rows(args.startup_runs, args.import_runs, args.memory_runs):
        print("%-60s %-40s target %-10s %s" % (row["what"], row["measured"], row["target"],
                                               {True: "ok", False: "MISSED", None: "-"}[row["ok"]]))


if __name__ == "__main__":
    main()
