"""The shim's own target (no patch's): a scheduler's role and ranks, from the arguments sglang
starts it with.

Every scheduler process runs ``sglang.srt.managers.scheduler.run_scheduler_process`` (spawned by
the launcher or the data-parallel controller).  Whenever the shim is enabled and that module is
imported, whatever patch is on (all off included), the runtime wraps it -- before any patch's
target in that module, and undoes it after them -- and the wrapper tells ``procinfo`` the ranks
(``tp 3/16``) before the body runs: log lines then carry them.  Its parameters are read by name
(``server_args``, ``tp_rank``, ``pp_rank``, ``dp_rank``), so every release's signature fits; one
without them is left alone (DEBUG line) and the role comes from the process title as before.

A spawned child decides its patches before its target runs (while it re-imports the parent's main
module or unpickles the target), before any call says who it is; its summary line waits
(``Runtime.say_summary``) until the child starts that target: for this wrapper, when it is
called (with the role); for any other target, just before it runs; at exit if the child never
gets that far (a child killed before it starts its target says none).
"""

import os
import sys

from npu_shim.reporting import log, procinfo
from npu_shim.runtime.targets import Change, bind_arguments, function_wrapper, resolve
from npu_shim.source.reading import live_params

MODULE = "sglang.srt.managers.scheduler"
ENTRY = "run_scheduler_process"
NEEDS = ("server_args", "tp_rank", "pp_rank", "dp_rank")


def prepare(module, started):
    """The Change wrapping ``run_scheduler_process`` in ``module``; ``started()`` is called after
    the role is noted.  LookupError when the function or one of ``NEEDS`` is absent."""
    owner, attr, original = resolve(module, ENTRY)
    if not callable(original):  # absent, or not a function
        raise LookupError("%s:%s not found" % (MODULE, ENTRY))
    params = live_params(original, False)
    missing = [name for name in NEEDS if name not in params]
    if missing:
        raise LookupError("%s:%s has no parameter %s" % (MODULE, ENTRY, ", ".join(missing)))

    def scheduler_process(wrapped, instance, args, kwargs):
        try:
            note(bind_arguments(params, args, kwargs))
            started()
        except Exception as exc:  # noqa: BLE001 - the scheduler starts whatever happens here
            log.error_once("role:note", "noting the scheduler's role failed: %r" % (exc,))
        return wrapped(*args, **kwargs)

    return Change(owner, attr, original, function_wrapper(original, scheduler_process))


def note(bound):
    server_args = bound.get("server_args")
    dp_rank = bound.get("dp_rank")
    if dp_rank is None and os.environ.get("SGLANG_DP_RANK", "").isdigit():
        dp_rank = int(os.environ["SGLANG_DP_RANK"])  # sglang's own rule (a router's DP rank)
    procinfo.note_scheduler(
        ENTRY, tp_rank=bound.get("tp_rank"), tp_size=getattr(server_args, "tp_size", None),
        pp_rank=bound.get("pp_rank"), pp_size=getattr(server_args, "pp_size", None),
        dp_rank=dp_rank, dp_size=getattr(server_args, "dp_size", None))


def child_unpickling():
    """True in a multiprocessing child (spawn, forkserver) that has not started its target yet:
    CPython's ``spawn._main`` marks the process ``_inheriting`` while it re-imports the parent's
    main module and unpickles the target."""
    process = sys.modules.get("multiprocessing.process")
    return bool(process and getattr(process.current_process(), "_inheriting", False))


def when_child_starts(starts, exits):
    """``starts(target)`` when the child is about to run its target, ``exits()`` at its exit;
    True once both are set.  A spawned child runs no after-fork callbacks: ``BaseProcess.run`` is
    wrapped for that one call (put back by it).  False, with nothing changed, where
    ``BaseProcess`` has no ``run`` of its own to put back (something else replaced the class or
    its method): the caller then says what it would have said at once."""
    import atexit
    from multiprocessing import process

    base = getattr(process, "BaseProcess", None)
    original = getattr(base, "__dict__", {}).get("run")
    if not callable(original):
        return False

    def run(self):
        if base.__dict__.get("run") is run:
            base.run = original
        try:
            starts(getattr(self, "_target", None))
        except Exception as exc:  # noqa: BLE001 - the child's target runs whatever happens here
            log.error_once("role:start", "saying the summary line failed: %r" % (exc,))
        return original(self)

    base.run = run
    atexit.register(exits)
    return True
