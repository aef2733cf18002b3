"""``python -m npu_shim status``: what the shim would do in this interpreter, read from sglang's
source on disk (nothing of sglang, torch or wrapt is imported), per patch and variable.  A running
server's own truth is in sglang's ``/metrics`` (docs/operations.md).  Its exit codes: npu_shim/cli/exit_codes.py."""

import os
import sys

from npu_shim import _paths, _version
from npu_shim.cli.exit_codes import EXIT_BAD_ENV, EXIT_UNAVAILABLE, config_exit_code, stood_down_variables
from npu_shim.core import config, framework
from npu_shim.runtime import wrapt_loader
from npu_shim.source.codeview import SourceView
from npu_shim.source.reading import find_package_dir


def find_sglang():
    """The sglang package directory as ``import sglang`` would find it (editable installs
    included), without importing it; None when there is none."""
    return find_package_dir("sglang")


def sitecustomize_facts():
    """Which sitecustomize Python loaded at start-up: (npu-shim's?, the file it loaded or None)."""
    loaded = sys.modules.get("sitecustomize")
    ours = os.path.join(_paths.ROOT, "sitecustomize.py")
    path = getattr(loaded, "__file__", None)
    return bool(path) and os.path.realpath(path) == os.path.realpath(ours), path


def collect():
    from npu_shim.core.loading import all_variables, load_all

    patches = load_all()
    variables = all_variables(patches)
    values = config.read_all(variables)
    package_dir = find_sglang()
    view = SourceView(package_dir) if package_dir else None
    wrapt = wrapt_loader.locate()
    rows = []
    for patch in patches:
        decision = framework.decide(patch, view)
        if wrapt.source == "missing":
            decision = framework.without_wrapt(decision, "wrapt is not available: " + wrapt.note)
        rows.append({
            "name": patch.name, "state": decision.state, "reason": decision.reason,
            # a patch the job asks for explicitly that cannot apply stops every sglang process
            "stops_server": decision.state in framework.PROBLEMS and _must_honour(patch),
            "title": patch.title, "upstream": str(patch.upstream), "switch": patch.switch.name,
            "backport_range": list(patch.upstream.backports), "remove_when": patch.upstream.remove_when,
        })
    # upstream's own variables that only stood-down patches read are sglang's to judge, not ours
    stood_down = stood_down_variables(patches, {row["name"]: row["state"] for row in rows})
    enabled, enabled_error = values[config.ENABLED.name]
    ours, loaded = sitecustomize_facts()
    return {
        "version": _version.__version__,
        "location": _paths.PACKAGE_DIR,
        "sitecustomize_active": ours,
        "sitecustomize_loaded": loaded,
        "master_switch": enabled if enabled_error is None else False,
        "sglang": {"path": package_dir, "version": view.version if view else None},
        "wrapt": wrapt.as_dict(),
        "patches": rows,
        "env": [
            {"name": var.name, "set": var.is_set(), "value": values[var.name][0],
             "error": None if var.name in stood_down else values[var.name][1], "set_as": var.name_set(),
             "read_by_sglang": var.name in stood_down and var.is_set()}
            for var in variables
        ],
        "unknown_variables": [{"name": n, "did_you_mean": m} for n, m in config.unknown_names(variables)],
    }


def _must_honour(patch):
    try:
        return bool(patch.must_honour(os.environ))
    except Exception:  # noqa: BLE001 - a broken patch cannot say; the server would log it
        return False


def activity_line(info):
    """Whether the shim is active in this interpreter, and if not, why (which sitecustomize won)."""
    if not info["master_switch"]:
        return "no (master switch NPU_SHIM_ENABLED is off)"
    if info["sitecustomize_active"]:
        return "yes"
    # Python never looked for a sitecustomize: PYTHONPATH is not the cause, and a server started
    # with the same flag is not patched either.
    if sys.flags.no_site:
        return "no: Python was started with -S (no site module, so no sitecustomize runs); a " \
               "server started so is not patched"
    if sys.flags.ignore_environment or sys.flags.isolated:
        return "no: Python was started with %s, so PYTHONPATH is ignored; a server started so is " \
               "not patched (npu_shim.install() in its code still patches it)" % (
                   "-I" if sys.flags.isolated else "-E")
    loaded = info["sitecustomize_loaded"]
    root = os.path.dirname(info["location"])
    if loaded:
        return ("no: another sitecustomize (%s) was loaded first and shadows npu-shim's; put %s "
                "before %s on PYTHONPATH" % (loaded, root, os.path.dirname(loaded)))
    return "no (its sitecustomize.py did not run: put %s on PYTHONPATH)" % root


def print_status(info):
    from npu_shim.reporting.terminal import terminal_writer

    out = terminal_writer()
    out("npu-shim %s  (%s)\n" % (info["version"], info["location"]))
    out("  active in this interpreter: %s\n" % activity_line(info))
    sg = info["sglang"]
    out("  sglang: %s\n" % ("%s at %s" % (sg["version"] or "unknown version", sg["path"])
                            if sg["path"] else "NOT FOUND: no 'sglang' package is importable with "
                                               "this interpreter and PYTHONPATH"))
    out("  wrapt: %s\n" % info["wrapt"]["text"])
    out("  NPU: checked when sglang is imported (this command imports neither sglang nor torch; "
        "`check` does)\n\n")
    out("  %-20s %-12s %s\n" % ("patch", "state", "reason"))
    for patch in info["patches"]:
        out("  %-20s %-12s %s\n" % (patch["name"], patch["state"], patch["reason"]))
        if patch["stops_server"]:
            out("  %-20s %-12s ^ requested explicitly: every sglang process will stop at import\n" % ("", ""))
    out("\n  %-30s %s\n" % ("variable", "value"))
    for var in info["env"]:
        if var["read_by_sglang"]:
            shown = "%r: read by sglang itself (the patch that reads it is upstream here)" % (
                os.environ.get(var["set_as"] or var["name"], ""),)
        elif var["error"]:
            shown = "INVALID: " + var["error"]
        else:
            shown = "%r%s" % (var["value"], "" if var["set"] else " (default)")
            if var["set_as"] not in (None, var["name"]):
                shown += " (set as %s, its older name)" % var["set_as"]
        out("  %-30s %s\n" % (var["name"], shown))
    for unknown in info["unknown_variables"]:
        out("  %-30s UNKNOWN: not a variable npu-shim reads (ignored)%s\n" % (
            unknown["name"], "; did you mean %s?" % unknown["did_you_mean"] if unknown["did_you_mean"] else ""))


def exit_code(info):
    """A bad variable first (it is why anything else looks wrong), then no sglang, then strict."""
    found = info["sglang"]["path"]
    code = config_exit_code({p["name"]: p["state"] for p in info["patches"]} if found else {},
                            stops=bool(found) and any(p["stops_server"] for p in info["patches"]))
    if code == EXIT_BAD_ENV or info["sglang"]["path"]:
        return code
    return EXIT_UNAVAILABLE


def run(args):
    """The ``status`` command with its parsed ``args``; its exit status."""
    from npu_shim.reporting.terminal import print_json

    info = collect()
    if args.json:
        print_json(info, default=str)
    else:
        print_status(info)
    return exit_code(info)
