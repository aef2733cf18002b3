"""``python -m npu_shim check``: what the shim really does in this image, from a real process.

``status`` predicts from sglang's source; ``check`` starts a child interpreter with this
environment -- so the shim activates in it exactly as in a server process (``sitecustomize`` on
``PYTHONPATH``, or the ``.pth`` of a pip install) -- imports every sglang module a patch targets,
and reports what happened there: each patch's state and reason, the targets really wrapped,
where wrapt came from, torch_npu and the NPU, whether graphs will be captured (``graph_facts``),
and what each patch says about the image (``Report.check_facts``: the packages it needs, read from
their files).  Nothing initialises the
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


def command_line(proc, pid):
    """The process's command line as its arguments (a title sglang set is one), [] if unreadable."""
    try:
        with open(os.path.join(proc, pid, "cmdline"), "rb") as handle:
            data = handle.read(4096)
    except OSError:
        return []
    return [arg.decode("utf-8", "replace") for arg in data.rstrip(b"\0").split(b"\0")]


def is_sglang_server(argv):
    """Whether a command line is an sglang server process's: the title sglang gives its processes
    (``sglang::scheduler_TP0`` ...), ``-m sglang.launch_server``, sglang's ``launch_server.py``
    run as a script, or ``sglang serve``.  Its arguments are read as arguments: the name in a file
    name (``tail -f sglang.launch_server.log``) is none of them."""
    from npu_shim.reporting import procinfo

    if not argv:
        return False
    if procinfo.role_from_title(argv[0].split(" ", 1)[0]):
        return True
    for i, arg in enumerate(argv[:-1]):
        if (arg == "-m" and argv[i + 1] == "sglang.launch_server") or (
                os.path.basename(arg) == "sglang" and argv[i + 1] == "serve"):
            return True
    return any(arg == "-msglang.launch_server" or arg.replace(os.sep, "/").endswith("sglang/launch_server.py")
               for arg in argv)


# What sglang calls of torch_npu's graph API (its NPUGraphRunner; docs/torch-npu-versions.md).
GRAPH_API = ("graph", "NPUGraph", "graph_pool_handle", "is_current_stream_capturing")
GRAPH_FLAG = "--disable-cuda-graph"
GRAPH_DEFAULT = ("sglang captures decode graphs (target-verify too under speculative decoding) "
                 "unless the server is started with " + GRAPH_FLAG)


def graph_api(npu):
    """{"present": the names of GRAPH_API that torch.npu has, "usable": whether ``graph`` is a
    context-manager class and ``NPUGraph`` a class with ``replay`` (a stub is neither),
    "auto_dispatch_capture": whether ``graph`` takes the argument sglang passes}.  Reads
    attributes and a signature only: nothing touches the device."""
    import inspect

    present = [name for name in GRAPH_API if npu is not None and callable(getattr(npu, name, None))]
    graph, npu_graph = getattr(npu, "graph", None), getattr(npu, "NPUGraph", None)
    usable = (len(present) == len(GRAPH_API) and isinstance(graph, type) and hasattr(graph, "__enter__")
              and isinstance(npu_graph, type) and hasattr(npu_graph, "replay"))
    try:
        auto = usable and "auto_dispatch_capture" in inspect.signature(graph).parameters
    except (TypeError, ValueError):
        auto = False
    return {"present": present, "usable": usable, "auto_dispatch_capture": auto}


def sglang_graph_default():
    """``ServerArgs.disable_cuda_graph``'s default in this sglang, when its server_args module is
    imported here (the target modules import it); None otherwise."""
    import dataclasses

    server_args = getattr(sys.modules.get("sglang.srt.server_args"), "ServerArgs", None)
    if server_args is None or not dataclasses.is_dataclass(server_args):
        return None
    for field in dataclasses.fields(server_args):
        if field.name == "disable_cuda_graph" and field.default is not dataclasses.MISSING:
            return bool(field.default)
    return None


def sglang_servers(proc="/proc", skip=()):
    """[(pid, argv)] of the sglang server processes on this host, known by their readable command
    line (``is_sglang_server``), the pids in ``skip`` left out."""
    try:
        names = os.listdir(proc)
    except OSError:
        return []
    found = []
    for name in names:
        if name.isdigit() and int(name) not in skip:
            argv = command_line(proc, name)
            if is_sglang_server(argv):
                found.append((int(name), argv))
    return sorted(found)


def graph_servers(proc="/proc"):
    """[(pid, captures)] of the sglang server commands on this host whose arguments are readable
    (``-m sglang.launch_server ...``, ``sglang serve ...``): captures is whether GRAPH_FLAG is
    absent from them.  sglang's scheduler processes carry a title, not arguments: not listed."""
    return [(pid, GRAPH_FLAG not in argv) for pid, argv in sglang_servers(proc, skip={os.getpid()})
            if len(argv) > 1]


def graph_facts(npu, proc="/proc"):
    """Whether graphs will be captured, from what decides it here: torch_npu's graph API (``npu``:
    torch.npu, or None), sglang's default and the server commands running on this host (what a
    patch does about graphs is its own ``check_facts``).  The server's own arguments are not
    visible to ``check``: the verdict states the default."""
    api = graph_api(npu)
    default_off = sglang_graph_default()
    servers = graph_servers(proc)
    facts = {"api": api, "sglang_disable_cuda_graph_default": default_off,
             "servers": [{"pid": pid, "captures": captures} for pid, captures in servers]}
    if npu is None:
        facts["verdict"] = "no NPU torch here: no NPU graph is captured"
    elif not api["usable"]:
        facts["verdict"] = ("NOT possible: torch_npu's graph API is missing here (%s present of %s); "
                            "sglang's capture would fail at start-up: start it with %s"
                            % (", ".join(api["present"]) or "none", ", ".join(GRAPH_API), GRAPH_FLAG))
    elif default_off:
        facts["verdict"] = "off by default in this sglang (ServerArgs.disable_cuda_graph is True)"
    else:
        facts["verdict"] = GRAPH_DEFAULT
    parts = [facts["verdict"]]
    if npu is not None and api["usable"]:
        parts.append("torch_npu's graph API present (%s; auto_dispatch_capture %s)" % (
            ", ".join(GRAPH_API), "accepted" if api["auto_dispatch_capture"] else "NOT accepted"))
    if servers:
        parts.append("servers on this host: %s" % ", ".join(
            "pid %d %s" % (pid, "captures" if captures else "has " + GRAPH_FLAG) for pid, captures in servers[:8]))
    facts["text"] = "; ".join(parts)
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
        "graphs": graph_facts(getattr(sys.modules.get("torch"), "npu", None)),
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
    if report.get("graphs"):
        out("  graphs: %s\n" % report["graphs"]["text"])
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
