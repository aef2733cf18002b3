"""The rows of scripts/bench.py's table, declared once: which script measures each, in table order.

bench.py refuses a row a script produces that is not declared here, and gives every declared row a
cell even when its script failed ("not measured: ..."); tests/dev/test_bench_table.py checks that
``DOC``'s table has exactly these rows, in this order, between ``TABLE_START`` and ``TABLE_END``
(``python3 scripts/bench.py --write-docs`` writes it from a run).
"""
import os
import shutil
import subprocess

DOC = "docs/performance.md"  # the page that shows the table, relative to the repository
TABLE_START = "<!-- bench-table -->"
TABLE_END = "<!-- /bench-table -->"
HEADER = ("| what | how | measured | target | result | script |", "|---|---|---|---|---|---|")

# The budgets: what a user of the shim feels, each held by one row of the table (``BUDGET_ROWS``);
# every other row is a reference (how the time moves on this machine) or a feature's own figure.
# Instructions rather than wall time where a process is measured: a count repeats on a shared
# machine, a time does not.  A trick in the shim's code stays only where one of these rows fails
# without it.
STARTUP_INSTRUCTIONS = 1.03  # start-up of a process that never imports sglang, bundle on PYTHONPATH
IMPORT_INSTRUCTIONS = 1.05   # an sglang import, every applicable patch on
RETAINED_MIB = 2.0           # memory the shim retains in an sglang process
EAGER_NS = 1000              # a wrapper on a layer's path, per eager call (0 at graph replay)
BUDGETS = (
    ("start-up of a Python process that never imports sglang (bundle)", "<= %.2fx in instructions"
     % STARTUP_INSTRUCTIONS),
    ("an sglang import", "<= %.2fx in instructions" % IMPORT_INSTRUCTIONS),
    ("memory retained in an sglang process", "<= %g MiB" % RETAINED_MIB),
    ("a wrapper in eager mode", "<= %d ns per call; 0 at graph replay" % EAGER_NS),
)

MLA_CASES = tuple((model, tp, "decode") for model in ("DeepSeek-V3", "GLM-5") for tp in (1, 8, 16)) + \
    (("DeepSeek-V3", 8, "prefill"), ("GLM-5", 8, "prefill"))



def clean_env(pythonpath):
    """This process's environment for a measured child: without the shim's, sglang's and Python's
    variables, ``pythonpath`` (a list) its PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPU_SHIM_", "SGLANG_", "PYTHON"))}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    return env

# What makes a count repeat: one hash seed, one BLAS/OpenMP thread (idle worker threads spin for
# as long as the scheduler lets them), and no address randomisation (setarch -R).
_REPEATABLE = {"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1"}


def instructions_side_by_side(arms):
    """{arm: instructions executed} under valgrind (cachegrind, no cache simulation: it only
    counts), the arms run at the same time (a count does not depend on the machine's load);
    None without valgrind."""
    if not shutil.which("valgrind"):
        return None
    fixed = ["setarch", "-R"] if shutil.which("setarch") else []
    procs = {}
    for name, (argv, env) in arms.items():
        procs[name] = subprocess.Popen(
            fixed + ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"] + argv,
            env=dict(env, **_REPEATABLE), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    counts = {}
    try:
        for name, proc in procs.items():
            # Generous: a count does not depend on the machine's load, only the time it takes does
            # (an sglang import under valgrind took over 30 minutes on two cores shared by several jobs).
            err = proc.communicate(timeout=4 * 3600)[1]
            refs = [line.split()[-1] for line in err.splitlines() if "I   refs:" in line or "I refs:" in line]
            if proc.returncode != 0 or not refs:
                raise RuntimeError("%s under valgrind failed (%d): %s" % (name, proc.returncode, err.strip()[-300:]))
            counts[name] = int(refs[-1].replace(",", ""))
    finally:
        for proc in procs.values():  # a timeout or a failed arm leaves no valgrind running on
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return counts


def mla_row(model, tp, role):
    return "MLA weights freed by the real sglang 0.5.11 npu_mla_preprocess, %s, TP %d, %s" % (model, tp, role)


ROWS = (
    ("bench_shim_cost", "start-up of `python -c pass`, shim compiled (.pyc present) on PYTHONPATH vs no shim"),
    ("bench_shim_cost", "start-up of `python -c pass`, shim sources with no .pyc anywhere vs no shim"),
    ("bench_shim_cost", "start-up of `python -c pass`, an empty directory on PYTHONPATH vs none (reference)"),
    ("bench_shim_cost", "peak memory of that process (compiled shim), shim vs not"),
    ("bench_shim_cost", "import overhead: real sglang 0.5.11 target modules, every applicable patch on, shim vs not"),
    ("bench_shim_cost", "the same import overhead in instructions executed"),
    ("bench_shim_cost", "the shim's own time in that process, and in a child, timed inside it"),
    ("bench_shim_cost", "memory the shim retains in an sglang 0.5.11 process, every applicable patch on"),
    ("bench_shim_cost", "the same two in a spawned child process (decides from the sglang source itself)"),
    ("bench_drop_in", "start-up of `python -c pass`, read-only bundle (its .pyc) on PYTHONPATH vs no shim"),
    ("bench_drop_in", "start-up of `python -c pass`, read-only bundle vs no shim, in instructions executed"),
    ("bench_hot_path", "npu_mla_preprocess wrapper in eager mode, a layer it has seen: added ns/call (real sglang "
                       "0.5.11)"),
    ("bench_hot_path", "npu_mla_preprocess in eager mode, a layer it has seen: added ns/call, the shim's function "
                       "in a process of its own (no sglang)"),
    ("bench_hot_path", "dual-stream experts per MoE layer call, extend batch: the shim on real sglang 0.5.9 vs "
                       "sglang 0.5.10's own"),
    ("bench_hot_path", "the same, decode batch (single stream: the shim's wrapper calls through)"),
) + tuple(("bench_mla_release", mla_row(*case)) for case in MLA_CASES) + (
    ("bench_zbal", "get_available_gpu_memory('npu'), mix mode: added per call"),
    ("bench_zbal", "get_available_gpu_memory('npu'), full mode: added per call"),
    ("bench_zbal", "decide(zbal) on a cold SourceView of 0.5.11"),
    ("bench_dual_stream", "dual-stream overlap (CUDA or NPU when present)"),
    ("bench_mla_server", "MLA bytes freed per decode server: real sglang 0.5.11 DSA decode server "
                         "(simulated NPU), shim on vs off"),
    ("bench_moe_server", "GLM-4 MoE server (simulated NPU, DeepEP, dual-stream on), decode tokens per second, "
                         "shim on sglang 0.5.8 vs sglang 0.5.10's own"),
    ("bench_moe_server", "the same shim server vs sglang 0.5.8 without the shim (neither path), decode tokens "
                         "per second"),
    ("bench_graph_server", "real sglang 0.5.11 server in graph mode (simulated NPU, decode captured at batch "
                           "sizes 1 and 2), start-up to ready with the capture, shim on (zbal) vs off"),
    ("bench_graph_server", "the same graph-mode servers under `python -m sglang.bench_serving` (random-ids, fixed "
                           "seed, every request completed), output tokens per second, shim on vs off"),
    ("bench_graph_server", "the same load: median TTFT and median ITL, shim on vs off"),
)

# The row that holds each budget of ``BUDGETS``, in its order.
BUDGET_ROWS = (
    "start-up of `python -c pass`, read-only bundle vs no shim, in instructions executed",
    "the same import overhead in instructions executed",
    "memory the shim retains in an sglang 0.5.11 process, every applicable patch on",
    "npu_mla_preprocess wrapper in eager mode, a layer it has seen: added ns/call (real sglang 0.5.11)",
)

RESULT = {True: "ok", False: "MISSED", None: "-"}


def cell(text):
    """One table cell: one line, no pipe."""
    return " ".join(str(text).split()).replace("|", "/")


def one_line(exc):
    """An exception as one short line (a table cell is never a traceback)."""
    return cell("%s: %s" % (type(exc).__name__, exc))[:240]


def collect(sources, log=print):
    """Run each ``(script, rows function)`` of ``sources``; return (rows in declared order, problems).

    A benchmark that raises, a declared row it did not produce, a row it produced that is not
    declared, or a row it marks ``failed`` (a one-line why; its cell says "not measured") is a
    problem (bench.py then exits 1); each declared row of a script that raised still gets a
    one-line cell, "not measured: <script> failed: <error>"."""
    declared = [what for _, what in ROWS]
    ran = [script for script, _ in sources]
    got, problems = {}, []
    for script, produce in sources:
        log("[bench] %s ..." % script)
        failure = None
        try:
            produced = list(produce())
        except Exception as exc:  # noqa: BLE001 - one line in the table, then the other benchmarks
            failure = "%s failed: %s" % (script, one_line(exc))
            problems.append(failure)
            produced = []
        for row in produced:
            if row.get("what") not in declared:
                problems.append("%s produced an undeclared row %r" % (script, row.get("what")))
                continue
            if row.get("failed"):  # a script that measures its rows apart says which part failed
                problems.append("%s: %s: %s" % (script, row["what"], row["failed"]))
            got[row["what"]] = dict(row, script=script)
        for owner, what in ROWS:
            if owner == script and what not in got:
                why = failure or "%s did not produce this row" % script
                if not failure:
                    problems.append(why + ": " + what)
                got[what] = {"what": what, "how": "", "measured": "not measured: " + why,
                             "target": "", "ok": False, "script": script}
    rows = [got[what] for owner, what in ROWS if owner in ran]
    return rows, problems


def budget_lines(rows):
    """One line per budget (``BUDGETS``) for a run's ``rows``: the budget, then the verdict of the
    row that holds it (ok, MISSED, or "not measured in this run")."""
    got = {row["what"]: row for row in rows}
    lines = []
    for (what, limit), held_by in zip(BUDGETS, BUDGET_ROWS):
        row = got.get(held_by)
        if row is None:
            verdict = "not measured in this run"
        elif row["ok"] is None:
            verdict = row["measured"]
        else:
            verdict = "%s (%s)" % (RESULT[row["ok"]], row["measured"])
        lines.append("budget: %s %s: %s" % (what, limit, cell(verdict)))
    return lines


def render(rows):
    """The table (header + one line per row) for rows with what/how/measured/target/ok/script; a
    ``how`` or ``target`` cell that repeats the row above's says "the same" (the page is read)."""
    lines, above = list(HEADER), {}
    for row in rows:
        cells = []
        for k in ("what", "how", "measured", "target", "ok", "script"):
            text = RESULT[row["ok"]] if k == "ok" else cell(row[k])
            cells.append("the same" if k in ("how", "target") and text and text == above.get(k) else text)
            above[k] = text
        lines.append("| %s |" % " | ".join(cells))
    return "\n".join(lines)


def doc_rows(text):
    """The ``what`` cells of the bench table in ``text`` (DOC's), in order."""
    block = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0]
    lines = [line for line in block.splitlines() if line.startswith("| ")]
    return [line.split(" | ")[0][2:] for line in lines[1:]]


def merge_doc(text, rows, header, scripts):
    """(header, table) for DOC's ``text`` after a run of only ``scripts`` (``bench.py --only ...
    --write-docs``): their rows from ``rows``, every other declared row as the page had it (a row
    declared since the page's last run says so), in declared order; the page's header lines kept
    but the one an earlier run of the same scripts left, and a line for this run added:
    "Rows of `script`: <header>"."""
    block = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0]
    lines = block.strip("\n").splitlines()
    old = {line.split(" | ")[0][2:]: line for line in lines[2:] if line.startswith("| ")} if lines else {}
    new = dict((row["what"], row) for row in rows)
    table = list(HEADER)
    for script, what in ROWS:
        if script in scripts:
            table.append(render([new[what]]).splitlines()[-1])
        elif what in old:
            table.append(old[what])
        else:
            table.append(render([{"what": what, "how": "", "measured": "not measured: declared after the "
                                  "table's last run", "target": "", "ok": None, "script": script}]).splitlines()[-1])
    label = "Rows of %s: " % ", ".join("`%s`" % script for script in scripts)
    kept = [line for line in block.split(HEADER[0], 1)[0].strip("\n").split("\n\n")
            if line.strip() and not line.startswith(label)]
    return "\n\n".join(kept + ([label + header] if scripts else [])), "\n".join(table)


def write_doc(table, header, path):
    """Put a run's header line and table between the markers of the page at ``path`` (``DOC``)."""
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    if TABLE_START not in text or TABLE_END not in text:
        raise SystemExit("%s has no %s ... %s markers" % (path, TABLE_START, TABLE_END))
    head, rest = text.split(TABLE_START, 1)
    tail = rest.split(TABLE_END, 1)[1]
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("%s%s\n%s\n\n%s\n%s%s" % (head, TABLE_START, header, table, TABLE_END, tail))
