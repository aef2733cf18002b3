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
import os
import sys

from npu_shim.cli.exit_codes import (  # noqa: F401 - the codes, importable from here too
    EXIT_BAD_ENV, EXIT_BROKEN_PIPE, EXIT_BUNDLE_FAILED, EXIT_CHECK_FAILED, EXIT_NO_DEVICE,
    EXIT_NO_SGLANG, EXIT_NPU_STACK, EXIT_SELFTEST_FAILED, EXIT_SELFTEST_REFUSED,
    EXIT_STRICT, EXIT_USAGE, config_exit_code)

# What verifying a bundle imports, loaded before any command: ``check`` verifies the bundle it runs
# from with only modules this process has loaded already (a file beside sitecustomize.py named like
# one it imported later would run before the verification could see it).
from npu_shim.cli import bundle_verify  # noqa: F401 - loaded now, for what it imports (above)

# Not read from __doc__: under -OO (PYTHONOPTIMIZE=2) there is none.
DESCRIPTION = "python -m npu_shim status|check|selftest|env|bundle."


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m npu_shim", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="what the shim would do here, per patch and variable")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    check = sub.add_parser("check", help="run the shim in a child process as a server would, "
                                         "import sglang's target modules and report what happened")
    check.add_argument("--json", action="store_true", help="machine-readable output")
    selftest = sub.add_parser("selftest", help="exercise each applied patch on this node's device, "
                                               "in child processes (one line per patch)")
    selftest.add_argument("--json", action="store_true", help="machine-readable output")
    from npu_shim.core.loading import load_all, selftest_step

    for patch in load_all():  # the options a patch's own step reads
        for flag, key, default, text in getattr(selftest_step(patch), "options", ()):
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
        from npu_shim.cli import env as env_command

        env_command.print_env(args.json)
        return 0
    from npu_shim.cli.children import stoppable

    if args.command == "bundle":
        from npu_shim.cli import bundle as bundle_command

        return stoppable("bundle", lambda: bundle_command.run(args), "pip and the staging directory are gone")
    if args.command == "check":
        from npu_shim.cli import check as check_command

        return stoppable("check", lambda: check_command.run(args), "its child process group is gone")
    if args.command == "selftest":
        from npu_shim.cli import selftest as selftest_command  # imports no torch: its children do

        return stoppable("selftest", lambda: selftest_command.main(args),
                         "its child process groups are gone")
    from npu_shim.cli import status as status_command

    return status_command.run(args)


def run(argv=None):
    """``main`` for a terminal: a reader that went away (``status | head``) ends the
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
