"""The shim's own cost, measured side by side in one run (alternating, medians).

* start-up of a process that never imports sglang: ``python -c pass`` with the shim on PYTHONPATH
  vs without, wall time and peak RSS of the child (from ``os.wait4``);
* import of the real sglang target modules in the 0.5.11 release environment (simulated NPU in both
  arms), with the shim on PYTHONPATH vs without.

Usage: python scripts/bench_shim_cost.py [--startup-runs N] [--import-runs N]
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUPPORT = os.path.join(REPO, "tests", "support")
IMPORT_RELEASE = "0.5.11"


def clean_env(pythonpath):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPU_SHIM_", "SGLANG_", "PYTHON"))}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    return env


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
    """Run each arm ``runs`` times, interleaved (A B A B ...), after one warm-up each."""
    results = {name: [] for name in arms}
    for argv, env in arms.values():
        timed_run(argv, env)
    for _ in range(runs):
        for name, (argv, env) in arms.items():
            results[name].append(timed_run(argv, env))
    return results


def startup_rows(runs):
    python = sys.executable
    no_pyc = {"PYTHONDONTWRITEBYTECODE": "1"}  # as on a read-only image: the shim compiles each time
    arms = {
        "without": ([python, "-c", "pass"], clean_env([])),
        "with": ([python, "-c", "pass"], clean_env([REPO])),
        "without-no-pyc": ([python, "-c", "pass"], dict(clean_env([]), **no_pyc)),
        "with-no-pyc": ([python, "-c", "pass"], dict(clean_env([REPO]), **no_pyc)),
    }
    res = alternate(runs, arms)
    wall = {k: statistics.median(w for w, _ in v) for k, v in res.items()}
    rss = {k: statistics.median(r for _, r in v) for k, v in res.items()}
    ratio = wall["with"] / wall["without"]
    ratio_no_pyc = wall["with-no-pyc"] / wall["without-no-pyc"]
    extra = rss["with"] - rss["without"]
    return [
        {"what": "start-up of `python -c pass`, shim on PYTHONPATH vs not",
         "how": "wall time, median of %d alternating runs each" % runs,
         "measured": "%.1f ms vs %.1f ms = %.3fx" % (wall["with"] * 1e3, wall["without"] * 1e3, ratio),
         "target": "<= 1.05x", "ok": ratio <= 1.05},
        {"what": "the same where .pyc files cannot be written (read-only image)",
         "how": "PYTHONDONTWRITEBYTECODE=1 in both arms, same runs",
         "measured": "%.1f ms vs %.1f ms = %.3fx" % (
             wall["with-no-pyc"] * 1e3, wall["without-no-pyc"] * 1e3, ratio_no_pyc),
         "target": "<= 1.05x", "ok": ratio_no_pyc <= 1.05},
        {"what": "peak memory of that process, shim vs not",
         "how": "ru_maxrss of the child (os.wait4), median",
         "measured": "%+.2f MiB (%.1f vs %.1f MiB)" % (extra, rss["with"], rss["without"]),
         "target": "<= +1 MiB", "ok": extra <= 1.0},
    ]


def import_rows(runs):
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    from shimdev import sglang_envs

    sys.path.insert(0, REPO)
    from npu_shim.patches import load_all

    target_modules = sorted({module for patch in load_all() for module in patch.modules})
    rel, layers = sglang_envs.release_env_paths(IMPORT_RELEASE)  # wrapt layer + the release's layers
    python = str(rel.python)
    code = "from shimdev import simnpu; simnpu.install(release=%r)\n%s" % (
        IMPORT_RELEASE, "".join("import %s\n" % m for m in target_modules))
    arms = {
        "without": ([python, "-c", code], clean_env([SUPPORT, *map(str, layers)])),
        "with": ([python, "-c", code], clean_env([REPO, SUPPORT, *map(str, layers)])),
    }
    res = alternate(runs, arms)
    wall = {k: statistics.median(w for w, _ in v) for k, v in res.items()}
    ratio = wall["with"] / wall["without"]
    return [
        {"what": "import of the real sglang %s target modules, shim vs not" % IMPORT_RELEASE,
         "how": "wall time of a fresh process (simulated NPU in both), median of %d alternating runs" % runs,
         "measured": "%.2f s vs %.2f s = %.3fx" % (wall["with"], wall["without"], ratio),
         "target": "<= 1.02x", "ok": ratio <= 1.02},
    ]


def rows(startup_runs=30, import_runs=5):
    return startup_rows(startup_runs) + import_rows(import_runs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--startup-runs", type=int, default=30)
    parser.add_argument("--import-runs", type=int, default=5)
    args = parser.parse_args()
    for row in rows(args.startup_runs, args.import_runs):
        print("%-60s %-40s target %-10s %s" % (row["what"], row["measured"], row["target"],
                                               "ok" if row["ok"] else "MISSED"))


if __name__ == "__main__":
    main()
