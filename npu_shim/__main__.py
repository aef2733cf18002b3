"""``python -m npu_shim status|env`` -- what the shim would do in this interpreter, without
importing sglang (its source is read from disk) or torch.

Exit codes: 0 fine; 2 an environment variable is invalid; 3 strict mode is on and a patch would
end ``unsupported`` or ``failed``; 64 bad usage.
"""

import argparse
import json
import os
import sys

import npu_shim
from npu_shim import config, patching
from npu_shim.codeview import SourceView

EXIT_BAD_ENV = 2
EXIT_STRICT = 3


def find_sglang():
    """The sglang package directory on sys.path, found without importing it, or None."""
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


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
    patches = []
    for patch in load_all():
        decision = patching.decide(patch, view)
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
    if any(var["error"] for var in info["env"]):
        return EXIT_BAD_ENV
    strict = next(v for v in info["env"] if v["name"] == config.STRICT.name)["value"]
    if strict and any(p["state"] in (patching.UNSUPPORTED, patching.FAILED) for p in info["patches"]):
        return EXIT_STRICT
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m npu_shim", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="what the shim would do here, per patch and variable")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser("env", help="list the environment variables with their docs")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 64 if exc.code else 0
    if args.command == "env":
        print_env()
        return 0
    info = collect()
    if args.json:
        json.dump(info, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print_status(info)
    return exit_code(info)


if __name__ == "__main__":
    sys.exit(main())
