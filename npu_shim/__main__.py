"""``python -m npu_shim status|check|env|bundle``.

``status`` says what the shim would do in this interpreter without importing sglang (its source is
read from disk), torch or wrapt; ``check`` runs it in a child process and reports what really
happened (npu_shim/check.py); ``bundle`` builds the directory to mount into an image
(npu_shim/bundle.py).

Exit codes: 0 fine; 1 ``bundle`` failed; 2 an environment variable is invalid; 3 strict mode is on
and a patch would end ``unsupported`` or ``failed``; 4 ``check`` could not run, the shim was not
active in its process, a target module failed to import or the bundle's files differ from its
MANIFEST; 64 bad usage.
"""

import argparse
import json
import os
import sys

import npu_shim
from npu_shim import config, patching, wrapt_loader
from npu_shim.codeview import SourceView, find_package_dir

EXIT_BUNDLE_FAILED = 1
EXIT_BAD_ENV = 2
EXIT_STRICT = 3
EXIT_CHECK_FAILED = 4
EXIT_USAGE = 64


def find_sglang():
    """The sglang package directory as ``import sglang`` would find it (editable installs
    included), without importing it; None when there is none."""
    return find_package_dir("sglang")


def shim_on_path():
    """Whether the sitecustomize Python loaded at start-up is npu-shim's."""
    loaded = sys.modules.get("sitecustomize")
    ours = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(npu_shim.__file__))), "sitecustomize.py")
    path = getattr(loaded, "__file__", None)
    return bool(path) and os.path.realpath(path) == os.path.realpath(ours)


def collect():
    from npu_shim.patches import load_all

    values = config.read_all()
    package_dir = find_sglang()
    view = SourceView(package_dir) if package_dir else None
    wrapt = wrapt_loader.locate()
    patches = []
    for patch in load_all():
        decision = patching.decide(patch, view)
        if wrapt.source == "missing":
            decision = patching.without_wrapt(decision, "wrapt is not available: " + wrapt.note)
        patches.append({
            "name": patch.name, "state": decision.state, "reason": decision.reason,
            "title": patch.title, "upstream": patch.origin(),
        })
    enabled, enabled_error = values[config.ENABLED.name]
    return {
        "version": npu_shim.__version__,
        "location": os.path.dirname(os.path.abspath(npu_shim.__file__)),
        "sitecustomize_active": shim_on_path(),
        "master_switch": enabled if enabled_error is None else False,
        "sglang": {"path": package_dir, "version": view.version if view else None},
        "wrapt": wrapt.as_dict(),
        "patches": patches,
        "env": [
            {"name": var.name, "set": var.is_set(), "value": values[var.name][0],
             "error": values[var.name][1]}
            for var in config.ALL
        ],
    }


def print_status(info):
    out = sys.stdout.write
    out("npu-shim %s  (%s)\n" % (info["version"], info["location"]))
    out("  active in this interpreter: %s\n" % (
        "yes" if info["sitecustomize_active"] and info["master_switch"] else
        "no (master switch NPU_SHIM_ENABLED is off)" if not info["master_switch"] else
        "no (its sitecustomize.py did not run: put the npu-shim directory on PYTHONPATH)"))
    sg = info["sglang"]
    out("  sglang: %s\n" % ("%s at %s" % (sg["version"] or "unknown version", sg["path"])
                            if sg["path"] else "not found on sys.path"))
    out("  wrapt: %s\n" % info["wrapt"]["text"])
    out("  NPU: checked when sglang is imported (this command imports neither sglang nor torch)\n\n")
    out("  %-20s %-12s %s\n" % ("patch", "state", "reason"))
    for patch in info["patches"]:
        out("  %-20s %-12s %s\n" % (patch["name"], patch["state"], patch["reason"]))
    out("\n  %-30s %s\n" % ("variable", "value"))
    for var in info["env"]:
        if var["error"]:
            shown = "INVALID: " + var["error"]
        else:
            shown = "%r%s" % (var["value"], "" if var["set"] else " (default)")
        out("  %-30s %s\n" % (var["name"], shown))


def print_env():
    for var in config.ALL:
        sys.stdout.write("%s  [%s, default %r]\n    %s\n" % (var.name, var.kind, var.default, var.doc))


def exit_code(info):
    return config_exit_code(p["state"] for p in info["patches"])


def config_exit_code(states):
    """EXIT_BAD_ENV for an invalid variable, EXIT_STRICT when strict mode is on and a patch is
    ``unsupported`` or ``failed``, else 0 (the same rule for ``status`` and ``check``)."""
    values = config.read_all()
    if any(error for _value, error in values.values()):
        return EXIT_BAD_ENV
    if values[config.STRICT.name][0] and any(
            state in (patching.UNSUPPORTED, patching.FAILED) for state in states):
        return EXIT_STRICT  # in a server the process stops at import, as the check process did
    return 0


def run_bundle(args):
    from npu_shim import bundle

    try:
        bundle.build(args.out_dir, args.python, args.wrapt_version or bundle.WRAPT_VERSION,
                     machines=tuple(args.platform) or bundle.MACHINES, force=args.force,
                     log=lambda line: sys.stderr.write("npu-shim bundle: %s\n" % line))
    except bundle.BundleError as exc:
        sys.stderr.write("npu-shim bundle: error: %s\n" % exc)
        return EXIT_BUNDLE_FAILED
    return 0


def run_check(args):
    from npu_shim import check

    report, error = check.run_child()
    if report is None:
        sys.stderr.write("npu-shim check: %s\n" % error)
        return EXIT_CHECK_FAILED
    if args.json:
        json.dump(report, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        check.print_report(report)
    # Not active: no patch was decided, so the strict rule finds nothing and this says 4.
    code = config_exit_code(s["state"] for s in report["states"].values())
    failed_import = any(v not in ("ok", "absent") for v in report["imports"].values())
    if not code and (not report["shim_active"] or failed_import or not report["bundle"]["ok"]):
        return EXIT_CHECK_FAILED
    return code


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m npu_shim", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="what the shim would do here, per patch and variable")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    check = sub.add_parser("check", help="run the shim in a child process as a server would, "
                                         "import sglang's target modules and report what happened")
    check.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser("env", help="list the environment variables with their docs")
    bundle = sub.add_parser("bundle", help="build a self-contained directory (shim + wrapt builds + "
                                           ".pyc) to mount into an image, and OUT_DIR.tar.gz")
    bundle.add_argument("out_dir", metavar="OUT_DIR")
    bundle.add_argument("--python", action="append", default=[], metavar="PATH",
                        help="interpreter to compile .pyc with (repeatable; default: this one "
                             "and every python3.9 .. python3.13 on PATH)")
    bundle.add_argument("--platform", action="append", default=[], choices=("x86_64", "aarch64"),
                        help="machines to bundle wrapt C builds for (default: both)")
    bundle.add_argument("--wrapt-version", default=None, help="wrapt release to bundle")
    bundle.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else 0
    if args.command == "env":
        print_env()
        return 0
    if args.command == "bundle":
        return run_bundle(args)
    if args.command == "check":
        return run_check(args)
    info = collect()
    if args.json:
        json.dump(info, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print_status(info)
    return exit_code(info)


if __name__ == "__main__":
    sys.exit(main())
