"""``python -m npu_shim selftest``: do the patches that apply here work on this node's device?

Run it like ``check``: with the server's ``PYTHONPATH`` and variables, on the node, while no server
uses the device.  For each patch ``applied`` in that environment it exercises, at small scale and on
the device, what the patch relies on -- each patch's own step (its module npu_shim/patches/_selftest/<name>.py,
``core.loading.selftest_step``; npu_shim/cli/selftest_child.py runs them) -- and prints one line per
patch.  On an NPU whose torch_npu has the graph API each step also drives its path through a graph
capture and a replay, as sglang's graph runner does (npu_shim/patches/_selftest/_graphs.py).
docs/rolling-out.md says what each patch's step checks.

The work is done in child processes (a patch whose step must run alone, its module's ``ALONE``,
gets a second one: its allocator goes in before anything touches the device), so nothing stays on
the device.  A patch's step runs on the device kinds it names (its module's ``DEVICES``); on
another it says ``n/a on <kind>``.  ``--patch NAME`` runs a patch's step whatever its state (e.g.
a device-agnostic step on a CUDA machine without sglang).  The whole run is bounded
(``TIMEOUT_S``, 60 s; ``--timeout``); a progress line per step goes to stderr.

Exit codes: ``check``'s (``npu_shim/cli/exit_codes.py``): a step that failed is a problem found, a
run refused or without a device has nothing to check; what each means is listed once, in
docs/operations.md.
"""

import json
import os
import subprocess
import sys
import time

# How a server's command line is read and known: check's (it lists the servers' graph flags too).
from npu_shim.cli.check import sglang_servers

TIMEOUT_S = 60
MAX_TIMEOUT_S = 86400  # a day: past it time.monotonic() + bound is no bound an operator means
MAX_NUMBER = 1 << 40   # the other numbers' bound: JSON and the child's arithmetic stay exact
CHILD_CODE = ("from npu_shim import _bootstrap; from npu_shim.cli import selftest_child; "
              "selftest_child.main(_bootstrap.WATCHER)")
PREFIX = "npu-shim selftest: "


# -- refusal: sglang's own processes hold the device ------------------------------------------------

# Device files a process that uses the device has open: Ascend's, NVIDIA's.
DEVICE_FILES = ("/dev/davinci", "/dev/nvidia")


def _holds_device(proc, pid):
    """Whether the process has a device file open; True where its descriptors cannot be read
    (another user's process: assume it may)."""
    fd_dir = os.path.join(proc, pid, "fd")
    try:
        fds = os.listdir(fd_dir)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    for fd in fds:
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        if target.startswith(DEVICE_FILES) and target[len("/dev/"):] not in ("nvidiactl", "nvidia-uvm"):
            return True
    return False


def sglang_processes(proc="/proc"):
    """(pid, command line) of the sglang server processes on this host that have a device open:
    known by their command line (``is_sglang_server``); this process and its parent excluded."""
    return [(pid, " ".join(argv).strip()[:120])
            for pid, argv in sglang_servers(proc, skip={os.getpid(), os.getppid()})
            if _holds_device(proc, str(pid))]


def holders(proc="/proc"):
    """Why the device is taken, or None: the sglang server processes seen on this host."""
    seen = sglang_processes(proc)
    if seen:
        return ("%d sglang process%s on this host hold%s the device (pid %s: %s)"
                % (len(seen), "" if len(seen) == 1 else "es", "s" if len(seen) == 1 else "",
                   ", ".join(str(p) for p, _ in seen[:8]), seen[0][1]))
    return None


# -- the children --------------------------------------------------------------------------------

def run_stage(stage, options, deadline, log, bound=TIMEOUT_S):
    """(report or None, error or None) of one child; progress lines go to ``log`` as they come.
    The child runs in its own process group (npu_shim/cli/children.py), killed with whatever it
    started on every way out of here."""
    from npu_shim.cli import children
    from npu_shim.cli import selftest_child as child

    lines, errors, last, readers = [], [], ["starting"], []

    def read_out():
        for raw in proc.stdout:
            line = children.decode(raw).rstrip("\n")
            if line.startswith(child.PROGRESS):
                last[0] = line[len(child.PROGRESS):]
                log(last[0])
            lines.append(line)

    def read_err():
        errors.extend(children.decode(raw) for raw in proc.stderr)

    proc = children.start(children.python_command(CHILD_CODE, stage, json.dumps(options)))
    try:  # at once: a signal that comes while the readers are made must find the child killed
        readers = [children.helper_thread(read_out), children.helper_thread(read_err)]
        for reader in readers:
            reader.start()
        try:
            children.wait(proc, timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None, "did not finish within the %d s bound (at: %s)" % (bound, last[0])
    finally:
        children.stop(proc, close=False)  # the group: the child's own children too
        for reader in readers:
            if reader.ident is not None:
                reader.join(5)
        children.stop(proc)
    report, problem = children.find_report("\n".join(lines), child.MARK)
    if report is not None:
        return report, None
    return None, "the selftest process exited %d %s: %s" % (
        proc.returncode, problem, children.last_words("".join(errors), "\n".join(lines)))


def run(options, log=None):
    """The whole selftest as one dict (its ``exit`` the exit status); nothing printed but ``log``."""
    from npu_shim.cli import exit_codes as cli

    log = log or (lambda line: None)
    started = time.monotonic()
    bound = options.get("timeout") or TIMEOUT_S
    deadline = started + bound
    result = {"options": options, "patches": {}, "refused": None, "error": None}

    def done(code, **extra):
        result.update(extra, exit=code, seconds=round(time.monotonic() - started, 2))
        return result

    if cli.config_exit_code({}) == cli.EXIT_BAD_ENV and cli.config_exit_code(cli.states_here()) == cli.EXIT_BAD_ENV:
        return done(cli.EXIT_BAD_ENV, error="an NPU_SHIM_* or SGLANG_* variable is invalid or unknown "
                                            "(`python -m npu_shim status` says which)")
    from npu_shim.cli import check

    bundle = check.bundle_facts()  # as ``check``: what changed in a bundle would run in the children
    if not bundle["ok"]:
        return done(cli.EXIT_PROBLEM, error="the selftest processes were not started: this bundle "
                                                 "does not match its MANIFEST (%s)" % bundle["text"])
    taken = holders()
    if taken:
        return done(cli.EXIT_UNAVAILABLE, refused=taken)
    log("starting the selftest process (sglang's target modules, then the device)")
    report, error = run_stage("main", options, deadline, log, bound)
    if report is None:
        return done(cli.EXIT_PROBLEM, error=error)
    result["main"] = report
    if report.get("error"):  # the child's own words, in one line
        return done(cli.EXIT_PROBLEM, error=str(report["error"]))
    problem = report.get("torch_problem")
    if problem:
        return done(cli.EXIT_PROBLEM, error=problem["text"])
    result["device"] = report["device"]
    result["graphs"] = report.get("graphs")
    states = report["states"]
    for name, why in report["plan"].items():
        state = states.get(name) or {}
        result["patches"][name] = {"state": state.get("state"), "reason": state.get("reason"),
                                   "forced": name in options["patches"], "result": "skipped",
                                   "line": why}
    if not options["patches"]:
        if not report["sglang"]["path"]:
            return done(cli.EXIT_UNAVAILABLE, error="no sglang is importable with this interpreter and "
                                                  "PYTHONPATH (--patch NAME runs a step without it)")
        if not report["shim_active"]:
            return done(cli.EXIT_PROBLEM, error="the shim was not active in the selftest process "
                                                     "(PYTHONPATH / NPU_SHIM_ENABLED): run `check`")
    if report["device"]["kind"] is None:
        return done(cli.EXIT_UNAVAILABLE, error=report["device"]["name"])
    if report.get("bad_index"):
        return done(cli.EXIT_USAGE, error=report["bad_index"])
    if report.get("refused"):
        return done(cli.EXIT_UNAVAILABLE, refused=report["refused"])
    outcomes = dict(report.get("results") or {})
    for name in report.get("alone_next") or ():
        log("starting a process for %s's step alone (before anything else touches the device)" % name)
        alone, error = run_stage(name, dict(options, kind=report["device"]["kind"],
                                            graphs=(report.get("graphs") or {}).get("skipped")), deadline, log, bound)
        outcomes.update((alone or {}).get("results") or
                        {name: {"result": "FAILED", "line": error, "facts": {}}})
    for name, outcome in outcomes.items():
        result["patches"][name].update(outcome)
    failed = any(p["result"] == "FAILED" for p in result["patches"].values())
    return done(cli.EXIT_PROBLEM if failed else 0)


# -- output --------------------------------------------------------------------------------------

def device_line(device):
    if not device or device.get("kind") is None:
        return "none"
    text = "%s %d (%s)" % (device["kind"], device["index"], device["name"])
    if "free_mib" in device:
        text += ", %d of %d MiB free" % (device["free_mib"], device["total_mib"])
    if device.get("simulated"):
        text += "; simulated: the flow is real, timings and allocator figures are not"
    return text


def graphs_line(graphs):
    """Whether the server would capture graphs (``check``'s facts) and whether the steps drove
    their paths through a capture and a replay."""
    return "graphs: %s\n  capture and replay: %s" % (graphs["text"], (
        "each step below drives its path through an NPU graph capture and a replay"
        if graphs.get("skipped") is None else "not exercised (%s)" % graphs["skipped"]))


def print_result(result, out):
    if result["refused"]:
        out(PREFIX + "refused: %s\n" % result["refused"])
        return
    if result["error"] and all(p["result"] == "skipped" for p in result["patches"].values()):
        out(PREFIX + "%s\n" % result["error"])  # nothing ran: the reason is the whole answer
        return
    out("npu-shim selftest on %s\n" % device_line(result.get("device")))
    if result.get("graphs"):
        out("  %s\n" % graphs_line(result["graphs"]))
    if result["error"]:
        out("  %s\n" % result["error"])
    out("\n  %-20s %-8s %-12s %s\n" % ("patch", "selftest", "state", "what was checked"))
    for name, patch in result["patches"].items():
        result_text = patch["result"] if patch["result"] != "skipped" else "-"
        state = patch["state"] or "-"
        if patch["forced"]:
            state += " (--patch)"
        out("  %-20s %-8s %-12s %s\n" % (name, result_text, state, patch["line"]))
    out("  %.1f s\n" % result["seconds"])


def main(args):
    from npu_shim.cli import exit_codes as cli
    from npu_shim.core.loading import load_all, selftest_step
    from npu_shim.core.registry import known_names
    from npu_shim.reporting.terminal import print_json, terminal_writer

    unknown = [n for n in args.patch or () if n not in known_names()]
    options = [option for patch in load_all() for option in (getattr(selftest_step(patch), "options", ()))]
    sized = {key: getattr(args, key) for _flag, key, _d, _h in options}
    flags = [flag for flag, _k, _d, _h in options]
    if unknown or min(list(sized.values()) + [args.timeout]) <= 0 or args.device_index < 0 \
            or args.timeout > MAX_TIMEOUT_S or max(list(sized.values()) + [args.device_index]) > MAX_NUMBER:
        sys.stderr.write(PREFIX + ("--patch %s: no such patch (%s)" % (unknown[0], ", ".join(known_names()))
                                   if unknown else "%s take a positive number (--timeout at most %d), "
                                   "--device-index one of 0 or more" % (", ".join(flags + ["--timeout"]),
                                                                       MAX_TIMEOUT_S)) + "\n")
        return cli.EXIT_USAGE

    options = dict(sized, device_index=args.device_index, patches=list(args.patch or ()),
                   timeout=args.timeout)
    err = terminal_writer(sys.stderr)

    def log(line):
        err(PREFIX + line + "\n")
        sys.stderr.flush()

    result = run(options, log=log)
    if args.json:
        print_json(result, default=str)
    else:
        print_result(result, terminal_writer())
    return result["exit"]
