"""``python -m npu_shim status|check|selftest|env|bundle``.

``status`` says what the shim would do in this interpreter without importing sglang (its source is
read from disk), torch or wrapt; ``check`` runs it in a child process and reports what really
happened (npu_shim/cli/check.py); ``selftest`` exercises the applied patches on the device
(npu_shim/cli/selftest.py); ``bundle`` builds the directory to mount into an image
(npu_shim/cli/bundle.py).

Exit codes: the ``EXIT_*`` constants (npu_shim/cli/exit_codes.py, imported here); what each one
means for each command is listed once, in docs/operations.md ("Exit codes"), and
tests/test_readme.py holds that list to these constants.
"""

import argparse
import json
import os
import sys

import npu_shim
from npu_shim import _paths
from npu_shim.core import config, framework
from npu_shim.runtime import wrapt_loader
from npu_shim.source.codeview import SourceView
from npu_shim.source.live import find_package_dir

from npu_shim.cli.exit_codes import (  # noqa: F401 - the codes, importable from here too
    EXIT_BAD_ENV, EXIT_BROKEN_PIPE, EXIT_BUNDLE_FAILED, EXIT_CHECK_FAILED, EXIT_NO_DEVICE, EXIT_NO_RECORDS,
    EXIT_NO_SGLANG, EXIT_NPU_STACK, EXIT_RUNNING_PROBLEM, EXIT_SELFTEST_FAILED, EXIT_SELFTEST_REFUSED,
    EXIT_STRICT, EXIT_USAGE, config_exit_code)

# Not read from __doc__: under -OO (PYTHONOPTIMIZE=2) there is none.
DESCRIPTION = "python -m npu_shim status|check|selftest|env|bundle."


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
            "title": patch.title, "upstream": patch.origin(), "switch": patch.switch.name,
            "backport_range": list(patch.backport_range), "remove_when": patch.remove_when,
        })
    enabled, enabled_error = values[config.ENABLED.name]
    ours, loaded = sitecustomize_facts()
    return {
        "version": npu_shim.__version__,
        "location": os.path.dirname(os.path.abspath(npu_shim.__file__)),
        "sitecustomize_active": ours,
        "sitecustomize_loaded": loaded,
        "master_switch": enabled if enabled_error is None else False,
        "sglang": {"path": package_dir, "version": view.version if view else None},
        "wrapt": wrapt.as_dict(),
        "patches": rows,
        "env": [
            {"name": var.name, "set": var.is_set(), "value": values[var.name][0],
             "error": values[var.name][1], "set_as": var.name_set()}
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
    from npu_shim.ops.terminal import terminal_writer

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
        if var["error"]:
            shown = "INVALID: " + var["error"]
        else:
            shown = "%r%s" % (var["value"], "" if var["set"] else " (default)")
            if var["set_as"] not in (None, var["name"]):
                shown += " (set as %s, its older name)" % var["set_as"]
        out("  %-30s %s\n" % (var["name"], shown))
    for unknown in info["unknown_variables"]:
        out("  %-30s UNKNOWN: not a variable npu-shim reads (ignored)%s\n" % (
            unknown["name"], "; did you mean %s?" % unknown["did_you_mean"] if unknown["did_you_mean"] else ""))


def env_rows():
    from npu_shim.core.loading import all_variables

    return [{"name": var.name, "kind": var.kind, "default": var.default, "doc": var.doc,
             "aliases": list(var.aliases)} for var in all_variables()]


def print_env(as_json=False):
    rows = env_rows()
    if as_json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    for row in rows:
        also = " (also read as %s)" % ", ".join(row["aliases"]) if row["aliases"] else ""
        sys.stdout.write("%s  [%s, default %r]%s\n    %s\n" % (row["name"], row["kind"], row["default"],
                                                             also, row["doc"]))


def exit_code(info):
    """A bad variable first (it is why anything else looks wrong), then no sglang, then strict."""
    found = info["sglang"]["path"]
    code = config_exit_code((p["state"] for p in info["patches"]) if found else (),
                            stops=bool(found) and any(p["stops_server"] for p in info["patches"]))
    if code == EXIT_BAD_ENV or info["sglang"]["path"]:
        return code
    return EXIT_NO_SGLANG


def run_bundle(args):
    from npu_shim.cli import bundle
    from npu_shim.ops.terminal import printable

    try:
        bundle.build(args.out_dir, args.python, args.wrapt_version or bundle.WRAPT_VERSION,
                     machines=tuple(args.platform) or bundle.MACHINES, force=args.force,
                     log=lambda line: sys.stderr.write("npu-shim bundle: %s\n" % printable(line)))
    except bundle.BundleError as exc:
        sys.stderr.write("npu-shim bundle: error: %s\n" % printable(exc))
        return EXIT_BUNDLE_FAILED
    return 0


def stoppable(command, body, gone):
    """``body()``'s exit status, with SIGTERM and SIGHUP raising (npu_shim/cli/children.py) so
    that the clean-up of every child runs, as for Ctrl-C; stopped: one line saying so (``gone``:
    what the clean-up removed) and 128 + the signal, as a shell reports it."""
    from npu_shim.cli import children

    restore = children.on_stop_signals()
    try:
        return body()
    except (children.Stopped, KeyboardInterrupt) as exc:
        children.hold_signals()  # to the exit: a second signal must not cut this line short
        sys.stderr.write("npu-shim %s: stopped by %s; %s\n" % (command, children.signal_name(exc), gone))
        sys.stderr.flush()
        return children.exit_status(exc)
    finally:
        restore()


def run_running(args):
    """``status --running [DIR]``: the state records of the running processes (running_records.py)."""
    from npu_shim.cli import running_records
    from npu_shim.ops.terminal import printable

    dir_ = args.running or args.dir
    if not dir_:
        try:
            dir_ = config.STATE_DIR.read()
        except config.ConfigError as exc:
            sys.stderr.write("npu-shim status --running: %s\n" % printable(exc))
            return EXIT_BAD_ENV
        if not dir_:
            sys.stderr.write("npu-shim status --running: give DIR or set %s (the directory the "
                             "server's processes write their records to)\n" % config.STATE_DIR.name)
            return EXIT_USAGE
    try:
        info = running_records.analyse(dir_)
    except OSError as exc:
        error = "no such directory" if isinstance(exc, FileNotFoundError) else \
            "cannot read it: %s" % (exc.strerror or exc)
        info = {"dir": dir_, "patches": [], "processes": [], "unreadable": [], "live": 0, "other": 0,
                "stale": 0, "suspect": 0, "problems": [], "error": error}
    code = EXIT_RUNNING_PROBLEM if info["problems"] else 0 if info["live"] else EXIT_NO_RECORDS
    info["exit"] = code
    if args.json:
        # strict JSON (a record's numbers are finite by the time they are read)
        json.dump(info, sys.stdout, indent=2, default=str, sort_keys=True, allow_nan=False)
        sys.stdout.write("\n")
    elif "error" in info:
        sys.stdout.write(printable("npu-shim status --running: %s: %s" % (dir_, info["error"])) + "\n")
    else:
        running_records.print_table(info)
    return code


def run_check(args):
    from npu_shim.cli import check

    facts = check.bundle_facts()
    if not facts["ok"]:
        if args.json:
            json.dump({"started": False, "bundle": facts}, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            check.print_not_started(facts)
        return EXIT_CHECK_FAILED
    report, error = check.run_child()
    if report is None:
        from npu_shim.ops.terminal import terminal_writer

        terminal_writer(sys.stderr)("npu-shim check: %s\n" % error)  # the child's own words
        return EXIT_CHECK_FAILED
    report["bundle"] = facts
    if args.json:
        json.dump(report, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        check.print_report(report)
    return check_exit_code(report)


def check_exit_code(report):
    """As ``exit_code`` for ``status``: a bad variable first, then no sglang, then strict; then
    EXIT_CHECK_FAILED when the shim was not active or a target module failed to import."""
    # Not active: no patch was decided, so the strict rule finds nothing and this says 4.
    code = config_exit_code(s["state"] for s in report["states"].values())
    problem = report.get("torch_problem")
    if problem and code != EXIT_BAD_ENV:  # nothing could be imported: the one finding that counts
        return EXIT_NPU_STACK if problem["kind"] == "cann" else EXIT_CHECK_FAILED
    failed_import = any(v not in ("ok", "absent") for v in report["imports"].values())
    if code == EXIT_BAD_ENV:
        return code
    # A target module whose import failed may be sglang itself: that is the failure to report.
    if not report["sglang"]["path"] and not failed_import:
        return EXIT_NO_SGLANG
    if not code and (not report["shim_active"] or failed_import):
        return EXIT_CHECK_FAILED
    return code


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m npu_shim", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="what the shim would do here, per patch and variable")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--running", nargs="?", const="", default=None, metavar="DIR",
                        help="instead: gather the state records of running processes from DIR "
                             "(default: NPU_SHIM_STATE_DIR) into one table; exit 6 if one has a "
                             "failed patch or they disagree, 7 if there is no live record")
    status.add_argument("dir", nargs="?", default=None, metavar="DIR",
                        help="with --running: the directory (the options may come in any order)")
    check = sub.add_parser("check", help="run the shim in a child process as a server would, "
                                         "import sglang's target modules and report what happened")
    check.add_argument("--json", action="store_true", help="machine-readable output")
    selftest = sub.add_parser("selftest", help="exercise each applied patch on this node's device, "
                                               "in child processes (one line per patch)")
    selftest.add_argument("--json", action="store_true", help="machine-readable output")
    from npu_shim.core.loading import load_all

    for patch in load_all():  # the options a patch's own step reads
        for flag, key, default, text in patch.selftest_options:
            selftest.add_argument(flag, dest=key, type=int, default=default, metavar="N",
                                  help="%s (default %d)" % (text, default))
    selftest.add_argument("--device-index", type=int, default=0, metavar="N",
                          help="the device to test (default 0, of those visible)")
    selftest.add_argument("--timeout", type=int, default=60, metavar="S",
                          help="bound on the whole run, in seconds (default 60)")
    selftest.add_argument("--patch", action="append", metavar="NAME",
                          help="run this patch's step whatever its state here (repeatable)")
    env = sub.add_parser("env", help="list the environment variables with their docs")
    env.add_argument("--json", action="store_true", help="machine-readable output")
    bundle = sub.add_parser("bundle", help="build a self-contained directory (shim + wrapt builds + "
                                           ".pyc) to mount into an image, and OUT_DIR.tar.gz")
    bundle.add_argument("out_dir", metavar="OUT_DIR")
    bundle.add_argument("--python", action="append", default=[], metavar="PATH",
                        help="interpreter to compile .pyc with (repeatable; default: this one "
                             "and every python3.9 .. python3.13 on PATH)")
    bundle.add_argument("--platform", action="append", default=[], choices=("x86_64", "aarch64"),
                        help="machines to bundle wrapt C builds for (default: both)")
    bundle.add_argument("--wrapt-version", default=None, help="wrapt release to bundle")
    bundle.add_argument("--force", action="store_true",
                        help="replace OUT_DIR if it is a previous bundle exactly as built (its "
                             "MANIFEST lists every file in it), and OUT_DIR.tar.gz")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else 0
    if args.command == "env":
        print_env(args.json)
        return 0
    if args.command == "bundle":
        return stoppable("bundle", lambda: run_bundle(args), "pip and the staging directory are gone")
    if args.command == "check":
        return stoppable("check", lambda: run_check(args), "its child process group is gone")
    if args.command == "selftest":
        from npu_shim.cli import selftest as selftest_command  # imports no torch: its children do

        return stoppable("selftest", lambda: selftest_command.main(args),
                         "its child process groups are gone")
    if args.running is not None:
        return run_running(args)
    if args.dir is not None:
        sys.stderr.write("npu-shim status: DIR is read only with --running\n")
        return EXIT_USAGE
    info = collect()
    if args.json:
        json.dump(info, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print_status(info)
    return exit_code(info)


def run(argv=None):
    """``main`` for a terminal: a reader that went away (``status --running | head``) ends the
    output quietly with EXIT_BROKEN_PIPE, never with a traceback.  Started with stdout or stderr
    closed (Python then has None for it), the output goes nowhere and the exit status still says
    what the command found."""
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))
    try:
        code = main(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(run())
