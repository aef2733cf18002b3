"""``python -m npu_shim check``: what the shim really does in this image, from a real process.

``status`` predicts from sglang's source; ``check`` starts a child interpreter with this
environment -- so the shim activates in it exactly as in a server process (``sitecustomize`` on
``PYTHONPATH``, or the ``.pth`` of a pip install) -- imports every sglang module a patch targets,
and reports what happened there: each patch's state and reason, the targets really wrapped,
where wrapt came from, torch_npu and the NPU, and what each patch says about the image
(``Report.check_facts``: the packages it needs, read from their files).  Nothing initialises the
device or a patch's package: the child imports modules and reads files; no tensor is allocated.

A bundle is verified against its MANIFEST in the parent first (``bundle_facts``), with only
modules every npu_shim command has loaded: a bundle that does not match is reported and no child
is started, since what was changed or added to it would run there (``tarfile.py`` at its top
shadows the standard library's in any process it is on ``PYTHONPATH`` of).
"""

import os
import re
import sys

from npu_shim import _paths
from npu_shim.cli.exit_codes import EXIT_BAD_ENV, EXIT_PROBLEM, EXIT_UNAVAILABLE, config_exit_code

CHILD_TIMEOUT_S = 300
_MARK = "npu-shim-check:"
# What print_report reads of the child's report (the parent adds "bundle").
REPORT_KEYS = ("pid", "python", "sitecustomize", "shim_active", "imports", "states", "wrapped",
               "wrapt", "sglang", "npu", "seconds")


def _one_line(text):
    """``text`` on one line (reporting.log, imported only once the bundle is verified: see
    bundle_facts)."""
    from npu_shim.reporting.log import one_line

    return one_line(text)


# -- in the child ---------------------------------------------------------------------------------

# What the dynamic loader says of a library it cannot find (the cause torch chains to its own
# "Failed to load the backend extension" when torch_npu's C extension cannot load).
_MISSING_LIBRARY = re.compile(r"(lib[\w.+-]*\.so[\w.]*): cannot open shared object file")
CANN_FIX = ("source CANN's set_env.sh (e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh) or put "
            "CANN's lib64 on LD_LIBRARY_PATH; TORCH_DEVICE_BACKEND_AUTOLOAD=0 imports torch without "
            "torch_npu")


def _chain(exc):
    """``exc`` and the exceptions it was raised from or during, innermost last."""
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def torch_problem():
    """None when ``import torch`` works.  Else what sglang's first import would die of, in one
    line: ``kind`` "cann" when torch_npu (loaded by torch's ``torch.backends`` entry point) cannot
    find a CANN library, naming it and the fix; "torch" for any other failure.  No torch installed
    at all is None too: the target modules' own imports then say what is missing."""
    try:
        import torch  # noqa: F401 - sglang's first import does the same
    except ModuleNotFoundError as exc:
        if exc.name == "torch":
            return None  # no torch at all: the target modules' imports say what is absent
        return diagnose_torch_error(exc)
    except BaseException as exc:  # noqa: BLE001 - RuntimeError from the entry point, ImportError, ...
        return diagnose_torch_error(exc)
    return None


def diagnose_torch_error(exc):
    """``torch_problem``'s answer for the exception ``import torch`` raised."""
    error = _one_line("%s: %s" % (type(exc).__name__, exc))
    for link in _chain(exc):
        found = _MISSING_LIBRARY.search(str(link))
        if found:
            return {"kind": "cann", "library": found.group(1), "error": error,
                    "text": "import torch fails: torch_npu cannot load %s (CANN's libraries are not "
                            "on the library path); %s" % (found.group(1), CANN_FIX)}
    return {"kind": "torch", "error": error, "text": "import torch fails: %s" % error}

def import_target_modules():
    """Import every module a patch targets (so the shim patches them, as in a server) and say how
    each went: "ok", "absent" (a module this release does not have) or the error in one line."""
    import importlib

    from npu_shim.core.loading import load_all, target_modules

    imports = {}
    for name in target_modules(load_all()):
        try:
            importlib.import_module(name)
            imports[name] = "ok"
        except ModuleNotFoundError as exc:
            imports[name] = "absent" if exc.name and name.startswith(exc.name) else _one_line(repr(exc))
        except BaseException as exc:  # noqa: BLE001 - ShimError included: report, don't die
            imports[name] = _one_line("%s: %s" % (type(exc).__name__, exc))
    return imports


def npu_facts():
    from npu_shim.source import reading
    from npu_shim.source.reading import find_package_dir

    torch = sys.modules.get("torch")
    loaded = sys.modules.get("torch_npu")  # sglang imports it on an NPU image
    facts = {"torch_npu": getattr(loaded, "__file__", None) or find_package_dir("torch_npu"),
             "torch": getattr(torch, "__version__", None)}
    if facts["torch_npu"]:
        facts["torch_npu_version"] = getattr(loaded, "__version__", None) or reading.module_version(
            ("torch_npu", "torch-npu"), os.path.dirname(facts["torch_npu"]))
    npu = getattr(torch, "npu", None)
    try:
        # Counts devices through the driver; no device is set and nothing is allocated.
        facts["npu_available"] = bool(npu is not None and npu.is_available())
        facts["npu_count"] = int(npu.device_count()) if facts["npu_available"] else 0
    except Exception as exc:  # noqa: BLE001 - whatever the driver raises is a fact check reports
        facts["npu_available"], facts["npu_error"] = False, _one_line(repr(exc))
    return facts


def wrapped_targets(records):
    """{target: True/False}: whether the live attribute really is the shim's wrapper."""
    from npu_shim.runtime import targets, wrapt_loader

    origin = wrapt_loader.loaded_origin()
    wrapper_type = wrapt_loader.load().FunctionWrapper if origin else None
    found = {}
    for record in records:
        for target in record.targets:
            if not isinstance(target, targets.Wrap):
                continue
            module = sys.modules.get(target.module)
            try:
                _owner, _attr, live = targets.resolve(module, target.qualname)
            except AttributeError:
                live = None
            found[target.describe()] = bool(wrapper_type and isinstance(live, wrapper_type))
    return found


def bundle_facts():
    """Whether this npu-shim is a bundle and, if so, whether its files still match its MANIFEST
    (none missing, changed or extra; the MANIFEST itself there and whole)."""
    from npu_shim.cli import bundle_verify

    root = _paths.ROOT
    problems = bundle_verify.verify(root)
    if problems is None:
        return {"is_bundle": False, "ok": True, "text": "not a bundle (%s)" % root}
    if problems and problems[0].startswith("MANIFEST: "):
        text = "a damaged bundle: MANIFEST %s" % problems[0][len("MANIFEST: "):]
    else:
        text = ("files match its MANIFEST" if not problems else "%d files differ from its MANIFEST: %s"
                % (len(problems), "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else "")))
    return {"is_bundle": True, "ok": not problems, "problems": problems[:20],
            "text": "%s: %s" % (root, text), "checked_by": checked_by(root),
            "outside": "cd %s && sha256sum -c --quiet SHA256SUMS" % root}


def checked_by(root):
    """Which process read the bundle, and so what its answer proves.  Code that runs before the
    reading (the bundle's sitecustomize and its .pyc, in every process it is on PYTHONPATH of) can
    make any in-process answer say "match": an answer from a process that ran none of the bundle's
    code before it is not open to that, one from this process is only as good as that code."""
    loaded = getattr(sys.modules.get("sitecustomize"), "__file__", None) or ""
    if os.path.dirname(os.path.abspath(loaded)) == os.path.abspath(root) if loaded else False:
        return ("this process, after the bundle's own sitecustomize ran in it: it proves the files "
                "intact only if that code is -- the proof that runs none of it is sha256sum "
                "(coreutils) against SHA256SUMS, with SHA256SUMS's own sha256 the one `bundle` printed")
    return "this process, which ran none of the bundle's start-up code before reading it"


def print_not_started(facts):
    """What ``check`` says instead of a report when the bundle does not match its MANIFEST."""
    from npu_shim.reporting.terminal import terminal_writer

    out = terminal_writer()
    out("npu-shim check: the check process was not started: this bundle does not match its "
        "MANIFEST, and what changed in it would run there (rebuild it, or copy it again)\n")
    out("  bundle: %s\n" % facts["text"])


def sglang_facts():
    from npu_shim.source.reading import read_version

    path = getattr(sys.modules.get("sglang"), "__file__", None)
    path = os.path.dirname(path) if path else None
    return {"path": path, "version": read_version(path) if path else None}


def child_main(watcher):
    """Runs in the child: import every target module, then print one JSON line.  ``watcher``: the
    start-up watcher (npu_shim/_bootstrap.py), handed in by the child's command line."""
    import time

    started = time.monotonic()
    sitecustomize = getattr(sys.modules.get("sitecustomize"), "__file__", None)
    from npu_shim.core.loading import load_all
    from npu_shim.runtime import activation, wrapt_loader

    # With NPU_SHIM_ENABLED=0 the watcher is armed only to say "off" at ``import sglang``.
    activated_at_start = watcher.activates_the_shim()
    # Every target module imports torch first: when that fails, the reason is told once and no
    # module is tried (each would fail the same way, and later ones with Python's own KeyError).
    broken = torch_problem()
    imports = import_target_modules() if broken is None else {}
    records = activation.RUNTIME.decided_records()
    origin = wrapt_loader.loaded_origin() or wrapt_loader.locate()
    facts = {}
    for patch in load_all():
        facts.update(patch.report.check_facts())
    report = {
        "pid": os.getpid(),
        "python": "%d.%d.%d" % sys.version_info[:3],
        "executable": sys.executable,
        "sitecustomize": sitecustomize,
        "shim_active": bool(activated_at_start),
        "imports": imports,
        "states": activation.RUNTIME.states(),
        "wrapped": wrapped_targets(records),
        "wrapt": origin.as_dict(),
        "sglang": sglang_facts(),
        "npu": npu_facts(),
        "torch_problem": broken,
        "seconds": round(time.monotonic() - started, 2),
        "patch_facts": list(facts),  # the patches' own facts, each under its key, in this order
    }
    report.update(facts)
    from npu_shim.cli import children

    children.write_report(_MARK, report)


# -- in the parent --------------------------------------------------------------------------------

def run_child(timeout=CHILD_TIMEOUT_S):
    """(report dict or None, error text or None) from a child with this process's environment and
    interpreter flags (npu_shim/cli/children.py: its own process group, its output as bytes)."""
    import subprocess

    from npu_shim.cli import children

    code = "from npu_shim import _bootstrap; from npu_shim.cli import check; check.child_main(_bootstrap.WATCHER)"
    try:
        returncode, out, err = children.run(children.python_command(code), timeout)
    except subprocess.TimeoutExpired:
        return None, "the check process did not finish in %ds" % timeout
    report, problem = children.find_report(out, _MARK, REPORT_KEYS)
    if report is not None:
        return report, None
    return None, "the check process exited %d %s: %s" % (returncode, problem, children.last_words(err, out))


def sglang_line(sglang, import_failed):
    if sglang["path"]:
        return "%s at %s" % (sglang["version"] or "unknown version", sglang["path"])
    if import_failed:
        return "not imported (the import failed, below)"
    return ("NOT FOUND: no 'sglang' package is importable with this interpreter and PYTHONPATH "
            "(put the directory that holds it on PYTHONPATH, or install sglang)")


def print_report(report):
    from npu_shim.reporting.terminal import terminal_writer

    out = terminal_writer()
    out("npu-shim check: a child process (pid %d, Python %s) imported sglang's target modules\n"
        % (report["pid"], report["python"]))
    out("  shim active at start-up: %s\n" % (
        "yes (%s)" % report["sitecustomize"] if report["shim_active"] else
        "NO: npu-shim's sitecustomize did not arm it (PYTHONPATH / NPU_SHIM_ENABLED)"))
    bad = {k: v for k, v in report["imports"].items() if v not in ("ok", "absent")}
    out("  sglang: %s\n" % sglang_line(report["sglang"], bool(bad)))
    out("  bundle: %s\n" % report["bundle"]["text"])
    if report["bundle"].get("checked_by"):
        out("          checked by %s: %s\n" % (report["bundle"]["checked_by"], report["bundle"]["outside"]))
    out("  wrapt: %s\n" % report["wrapt"]["text"])
    npu = report["npu"]
    problem = report.get("torch_problem")
    if problem:
        out("  %s BROKEN: %s\n" % ("NPU stack" if problem["kind"] == "cann" else "torch", problem["text"]))
    out("  torch %s, torch_npu %s, NPU: %s\n" % (
        npu["torch"] or ("failed to import" if problem else "not imported"),
        (npu.get("torch_npu_version") or "?") if npu["torch_npu"] else "not installed",
        "%d visible" % npu["npu_count"] if npu["npu_available"] else
        "none visible" + (" (%s)" % npu["npu_error"] if npu.get("npu_error") else "")))
    for key in report.get("patch_facts", ()):
        out("  %s: %s\n" % (report[key].get("label", key), report[key]["text"]))
    for name, error in sorted(bad.items()):
        out("  import %s FAILED: %s\n" % (name, error))
    out("\n  %-20s %-12s %s\n" % ("patch", "state", "reason"))
    for name, state in report["states"].items():
        out("  %-20s %-12s %s\n" % (name, state["state"], state["reason"]))
        for target, applied in sorted(state["targets"].items()):
            if applied:
                out("  %-20s %-12s %s %s\n" % ("", "", "wrapped:" if report["wrapped"].get(target)
                                               else "set:", target))
    if not report["states"]:
        out("  (no patch was decided: %s)\n" % (
            "torch does not import, so no sglang module was tried" if problem else
            "sglang's target modules were not imported with the shim on"))
    out("\n  %.1f s in the child\n" % report["seconds"])


# -- the command ----------------------------------------------------------------------------------

def run(args):
    """The ``check`` command with its parsed ``args``; its exit status."""
    facts = bundle_facts()
    from npu_shim.reporting.terminal import print_json  # once the bundle is verified (bundle_facts)

    if not facts["ok"]:
        if args.json:
            print_json({"started": False, "bundle": facts})
        else:
            print_not_started(facts)
        return EXIT_PROBLEM
    report, error = run_child()
    if report is None:
        from npu_shim.reporting.terminal import terminal_writer

        terminal_writer(sys.stderr)("npu-shim check: %s\n" % error)  # the child's own words
        return EXIT_PROBLEM
    report["bundle"] = facts
    if args.json:
        print_json(report, default=str)
    else:
        print_report(report)
    return exit_code(report)


def exit_code(report):
    """As ``status``'s exit code: a bad variable first, then no sglang, then strict; then
    EXIT_PROBLEM when the shim was not active or a target module (or torch) failed to import."""
    # Not active: no patch was decided, so the strict rule finds nothing and this says 4.
    code = config_exit_code({name: s["state"] for name, s in report["states"].items()})
    if report.get("torch_problem") and code != EXIT_BAD_ENV:  # nothing could be imported: the one finding
        return EXIT_PROBLEM
    failed_import = any(v not in ("ok", "absent") for v in report["imports"].values())
    if code == EXIT_BAD_ENV:
        return code
    # A target module whose import failed may be sglang itself: that is the failure to report.
    if not report["sglang"]["path"] and not failed_import:
        return EXIT_UNAVAILABLE
    if not code and (not report["shim_active"] or failed_import):
        return EXIT_PROBLEM
    return code
