#!/usr/bin/env python3
"""All benchmarks in one table: `python3 scripts/bench.py [--quick] [--write-docs]`.

Each row is measured side by side in this one run (ratios of medians over alternating runs; these
machines are noisy) by the script named in the row; the rows are declared in
dev/shimdev/bench/bench_rows.py.  Where this Python has no torch (a fresh clone's ``python3``) it re-runs
itself in the test runner's venv, built by the same code the test command uses
(dev/shimdev/envs/runner.py); the release environments it needs are built like the tests' (shimdev).
A missed target says MISSED; a row that cannot be measured here says "not measured: why"; a
benchmark that fails gives each of its rows a one-line "not measured: ... failed: ..." cell, and
the exit status is then 1.

The budgets (``bench_rows.BUDGETS``; after the table, one line each says whether the row that
holds it held): start-up of a process that never imports sglang (bundle) <= 1.03x in instructions;
an sglang import <= 1.05x in instructions; memory retained in an sglang process <= 2 MiB; a wrapper
in eager mode <= 1000 ns per call, 0 at graph replay.

``--write-docs`` (formerly ``--write-readme``) writes the table of this run into
docs/performance.md (between the bench-table markers, ``bench_rows.DOC``); with ``--only SCRIPT``
it replaces only that script's rows there and adds a line saying when they were measured
(``bench_rows.merge_doc``), the other rows staying those of the page's last run.
"""

import argparse
import datetime
import os
import platform
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "dev"), REPO]  # shimdev (dev/shimdev/__init__.py), npu_shim

from shimdev.bench import bench_rows  # noqa: E402 - after dev/ is put on sys.path


def machine():
    cores = os.cpu_count()
    try:
        with open("/proc/meminfo") as handle:
            mem = int(handle.readline().split()[1]) / 2**20
    except OSError:
        mem = 0
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return "%s, %d cores (load %.1f at the start), %.0f GiB, Python %s, %s" % (
        platform.machine(), cores, load, mem, platform.python_version(), accelerator())


def accelerator():
    """The machine's devices as its device files and nvidia-smi show them (no torch here)."""
    import glob
    import shutil
    import subprocess

    npus = glob.glob("/dev/davinci[0-9]*")
    if npus:
        return "%d Ascend NPU device%s" % (len(npus), "" if len(npus) == 1 else "s")
    if shutil.which("nvidia-smi"):
        try:
            gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout.split("\n")
        except (OSError, subprocess.SubprocessError):
            gpus = []
        gpus = [g.split(" (UUID")[0] for g in gpus if g.startswith("GPU ")]
        if gpus:
            return "; ".join(gpus[:2]) + (" (+%d more)" % (len(gpus) - 2) if len(gpus) > 2 else "")
    return "CPU only (simulated NPU)"


def sources(quick):
    """(script, rows function) in table order; each script is imported only when it runs."""
    def shim_cost():
        import bench_shim_cost
        return bench_shim_cost.rows(*((20, 3, 1, False) if quick else (30, 15, 2, True)))

    def drop_in():
        import bench_drop_in
        return bench_drop_in.rows(20 if quick else 40)

    def mla():
        import bench_mla_release
        return bench_mla_release.rows()

    def zbal():
        import bench_zbal
        return bench_zbal.rows(*((5, 1000) if quick else (15, 2000)))

    def mla_server():
        import bench_mla_server
        return bench_mla_server.rows()

    def dual_stream():
        import bench_dual_stream
        return bench_dual_stream.rows()

    def hot_path():
        import bench_hot_path
        return bench_hot_path.rows(*((5, 20000, 500) if quick else (15, 100000, 2000)))

    def moe_server():
        import bench_moe_server
        return bench_moe_server.rows(*((1, 2, 32) if quick else (2, 4, 64)))

    def graph_server():
        import bench_graph_server
        return bench_graph_server.rows(*((1, 4, 16) if quick else (2, 8, 32)))

    return [("bench_shim_cost", shim_cost), ("bench_drop_in", drop_in), ("bench_hot_path", hot_path),
            ("bench_mla_release", mla), ("bench_zbal", zbal), ("bench_dual_stream", dual_stream),
            ("bench_mla_server", mla_server), ("bench_moe_server", moe_server),
            ("bench_graph_server", graph_server)]


def collect(quick, only=None, log=print):
    """(rows in declared order, problems): shimdev.bench.bench_rows.collect over this run's benchmarks."""
    chosen = [(script, produce) for script, produce in sources(quick) if not only or script in only]
    return bench_rows.collect(chosen, log=log)


def in_runner_venv():
    """Re-run this script in the test runner's venv (torch, wrapt, pytest: built by the test
    command's own code when missing) unless this interpreter already has torch and wrapt."""
    import importlib.util

    if all(importlib.util.find_spec(name) for name in ("torch", "wrapt")):
        return  # found, not imported: this process stays small (its children's peak RSS is measured)
    from shimdev.envs import runner, sglang_envs

    try:
        python = str(runner.runner_python(log=lambda line: print("[bench] " + line, flush=True)))
    except sglang_envs.EnvError as exc:
        print("[bench] error: the runner venv cannot be built: %s" % bench_rows.one_line(exc))
        sys.exit(1)
    os.execv(python, [python, os.path.abspath(__file__)] + sys.argv[1:])


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="budgets (a line each after the table):\n" + "\n".join(
            "  %s: %s" % budget for budget in bench_rows.BUDGETS))
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--write-docs", "--write-readme", dest="write_docs", action="store_true",
                        help="write this run's table into %s (with --only: those scripts' rows)" % bench_rows.DOC)
    parser.add_argument("--only", action="append", metavar="SCRIPT",
                        help="run only this benchmark (repeatable)")
    args = parser.parse_args()
    known = [script for script, _ in sources(args.quick)]
    unknown = [script for script in args.only or () if script not in known]
    if unknown:
        parser.error("no benchmark %s (there are: %s)" % (", ".join(unknown), ", ".join(known)))
    in_runner_venv()
    started = datetime.datetime.utcnow()
    where = machine()
    rows, problems = collect(args.quick, args.only)
    header = ("`python3 scripts/bench.py%s` on %s UTC, %s; %.0f min, load %.1f at the end (other jobs "
              "share these cores: wall-time rows move with it)." % (
                  (" --quick" if args.quick else "") + "".join(" --only " + s for s in args.only or ()),
                  started.strftime("%Y-%m-%d %H:%M"), where,
                  (datetime.datetime.utcnow() - started).total_seconds() / 60, os.getloadavg()[0]))
    table = bench_rows.render(rows)
    print()
    print(header)
    print()
    print(table)
    print()
    for line in bench_rows.budget_lines(rows):
        print(line)
    for problem in problems:
        print("[bench] error: " + problem)
    if args.write_docs:
        path = os.path.join(REPO, bench_rows.DOC)
        if args.only:
            with open(path, encoding="utf-8") as handle:
                header, table = bench_rows.merge_doc(handle.read(), rows, header, args.only)
        bench_rows.write_doc(table, header, path)
        print("[bench] %s's table rewritten from this run%s" % (
            bench_rows.DOC, " (the rows of %s)" % ", ".join(args.only) if args.only else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
