"""npu_shim/runtime/role.py: the shim's own target on ``run_scheduler_process`` -- the role before
the body runs, whatever patch is on; a spawned child's summary line when its target starts; the
target applied before a patch's and undone after.  In-process for the wrapper, in fresh
interpreters (the fake sglang tree of tests/test_bootstrap.py) for the runtime.  A real release:
tests/runtime/test_role_real.py."""
from __future__ import annotations

import re
import types

import pytest

from npu_shim.reporting import procinfo
from npu_shim.runtime import role
from test_bootstrap import TAG, last_json, run, tree  # noqa: F401 - ``tree`` is a fixture

SHIM_SGLANG = TAG.split(" pid ")[0]  # \[npu-shim VERSION sglang 0\.5\.9

# run_scheduler_process's parameters in the releases (0.5.7; 0.5.11 - 0.5.19; 0.5.20 - 0.5.22; 0.5.23)
SIGNATURES = {
    "0.5.7": "server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank, pipe_writer",
    "0.5.11": "server_args, port_args, gpu_id, tp_rank, attn_cp_rank, moe_dp_rank, moe_ep_rank, pp_rank, "
              "dp_rank, pipe_writer",
    "0.5.20": "server_args, port_args, gpu_id, tp_rank, attn_cp_rank, moe_dp_rank, moe_ep_rank, pp_rank, "
              "dp_rank, pipe_writer, display_tp_rank=None, display_dp_rank=None, display_moe_ep_rank=None",
    "0.5.23": "server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank, pipe_writer, "
              "display_tp_rank=None, display_dp_rank=None, display_moe_ep_rank=None",
}


def scheduler_module(params):
    module = types.ModuleType(role.MODULE)
    exec("def run_scheduler_process(%s):\n    return procinfo.role()\n" % params,
         {"procinfo": procinfo}, module.__dict__)
    module.run_scheduler_process.__module__ = role.MODULE
    return module


@pytest.fixture
def no_role(monkeypatch):
    monkeypatch.setattr(procinfo, "_noted", None)
    monkeypatch.delenv("SGLANG_DP_RANK", raising=False)


@pytest.mark.parametrize("release", sorted(SIGNATURES))
def test_the_role_is_noted_before_the_body_runs_in_every_release(release, no_role):
    module = scheduler_module(SIGNATURES[release])
    started = []
    change = role.prepare(module, lambda: started.append(procinfo.role()["role"]))
    change.apply(False)
    names = [p.split("=")[0] for p in SIGNATURES[release].split(", ") if "=" not in p]
    values = dict.fromkeys(names, 0)
    values.update(server_args=types.SimpleNamespace(tp_size=16, pp_size=2, dp_size=2), tp_rank=3,
                  pp_rank=1, dp_rank=None)
    seen = module.run_scheduler_process(*[values[n] for n in names[:4]], **{n: values[n] for n in names[4:]})
    assert seen == {"role": "scheduler", "source": "run_scheduler_process", "tp_rank": 3, "tp_size": 16,
                    "pp_rank": 1, "pp_size": 2, "dp_size": 2}
    assert started == ["scheduler"]
    assert procinfo.role_label() == "pp 1/2 tp 3/16"
    change.revert()
    assert not hasattr(module.run_scheduler_process, "__wrapped__")


def test_a_routers_dp_rank_comes_from_sglang_dp_rank(no_role, monkeypatch):
    monkeypatch.setenv("SGLANG_DP_RANK", "5")
    module = scheduler_module(SIGNATURES["0.5.23"])
    role.prepare(module, lambda: None).apply(False)
    seen = module.run_scheduler_process(types.SimpleNamespace(tp_size=4, pp_size=1, dp_size=8), None, 0, 1, 0,
                                        None, None)
    assert (seen["dp_rank"], procinfo.role_label(seen)) == (5, "dp 5/8 tp 1/4")


def test_a_given_dp_rank_is_noted_and_wins_over_sglang_dp_rank(no_role, monkeypatch):
    """The scheduler's own ``dp_rank`` argument is the rank; SGLANG_DP_RANK counts only without it."""
    monkeypatch.setenv("SGLANG_DP_RANK", "5")
    module = scheduler_module(SIGNATURES["0.5.23"])
    role.prepare(module, lambda: None).apply(False)
    seen = module.run_scheduler_process(types.SimpleNamespace(tp_size=4, pp_size=1, dp_size=8), None, 0, 1, 0,
                                        dp_rank=2, pipe_writer=None)
    assert (seen["dp_rank"], procinfo.role_label(seen)) == (2, "dp 2/8 tp 1/4")


def test_a_function_without_the_ranks_or_no_function_is_left_alone():
    """The reasons are the DEBUG line an operator reads: exact."""
    with pytest.raises(LookupError) as missing:
        role.prepare(scheduler_module("server_args, port_args, pp_rank"), lambda: None)
    assert str(missing.value) == "sglang.srt.managers.scheduler:run_scheduler_process has no parameter tp_rank, dp_rank"
    with pytest.raises(LookupError) as absent:
        role.prepare(types.ModuleType(role.MODULE), lambda: None)
    assert str(absent.value) == "sglang.srt.managers.scheduler:run_scheduler_process not found"


def test_reverting_puts_the_original_function_back(no_role):
    module = scheduler_module(SIGNATURES["0.5.23"])
    original = module.run_scheduler_process
    change = role.prepare(module, lambda: None)
    change.apply(False)
    assert module.run_scheduler_process is not original
    change.revert()
    assert module.run_scheduler_process is original


@pytest.fixture
def errors(caplog, monkeypatch):
    """The shim's ERROR lines of the test; nothing said once before in this process counts."""
    import logging

    from npu_shim.reporting import log

    monkeypatch.setattr(log, "_reported", set())
    log.configure()  # sets the logger's level once per process: before caplog lowers it
    caplog.set_level(logging.ERROR, logger="npu_shim")
    return lambda: [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]


def test_the_wrapper_never_stops_the_scheduler_and_says_why_once(no_role, errors):
    from npu_shim.reporting import log

    module = scheduler_module(SIGNATURES["0.5.23"])
    role.prepare(module, lambda: 1 / 0).apply(False)
    assert module.run_scheduler_process(None, None, 0, 0, 0, 0, None)["role"] == "scheduler"
    assert module.run_scheduler_process(None, None, 0, 0, 0, 0, None)["role"] == "scheduler"
    assert errors() == ["noting the scheduler's role failed: ZeroDivisionError('division by zero')"]
    assert log._reported == {"role:note"}  # once per process, under the role's own key


def test_only_a_child_unpickling_its_target_is_waited_for(monkeypatch):
    import multiprocessing

    assert role.child_unpickling() is False
    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    assert role.child_unpickling() is True


@pytest.fixture
def child_start(monkeypatch):
    """``BaseProcess.run`` as it was put back after the test; what ``atexit.register`` was handed,
    collected instead of registered."""
    import atexit
    from multiprocessing import process

    monkeypatch.setattr(process.BaseProcess, "run", process.BaseProcess.__dict__["run"])
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    return types.SimpleNamespace(registered=registered, original=process.BaseProcess.__dict__["run"],
                                 current=lambda: process.BaseProcess.__dict__["run"])


def test_a_child_says_who_it_is_once_as_its_target_starts_and_puts_run_back(child_start):
    """``run()`` is what a spawned child's bootstrap calls: called here in-process."""
    import multiprocessing

    started, ran = [], []

    def exits():
        pass

    def target(*args):
        ran.append((args, list(started), child_start.current() is child_start.original))

    assert role.when_child_starts(started.append, exits) is True
    assert child_start.registered == [exits] and child_start.current() is not child_start.original
    child = multiprocessing.Process(target=target, args=(1, 2))
    child.run()
    assert started == [target] and ran == [((1, 2), [target], True)]
    assert child_start.current() is child_start.original
    child.run()  # the original run from now on
    assert started == [target] and len(ran) == 2


def test_a_child_whose_run_was_replaced_again_keeps_the_replacement(child_start):
    """Something wrapped ``BaseProcess.run`` after the shim did: the shim's run, called through
    it, leaves that one in place."""
    import multiprocessing
    from multiprocessing import process

    started, ran = [], []
    role.when_child_starts(started.append, lambda: None)
    ours = child_start.current()

    def theirs(self):
        return ours(self)

    process.BaseProcess.run = theirs
    multiprocessing.Process(target=ran.append, args=("ran",)).run()
    assert ran == ["ran"] and len(started) == 1 and child_start.current() is theirs


def test_a_process_object_without_a_target_starts_as_having_none(child_start):
    import multiprocessing

    started = []
    role.when_child_starts(started.append, lambda: None)
    child = multiprocessing.Process(target=print)
    del child._target
    with pytest.raises(AttributeError):
        child.run()  # the original run needs it
    assert started == [None]


def test_a_failing_summary_line_is_said_once_and_the_target_still_runs(child_start, errors):
    import multiprocessing

    from npu_shim.reporting import log

    ran = []
    role.when_child_starts(lambda target: 1 / 0, lambda: None)
    multiprocessing.Process(target=ran.append, args=("ran",)).run()
    assert ran == ["ran"] and child_start.current() is child_start.original
    assert errors() == ["saying the summary line failed: ZeroDivisionError('division by zero')"]
    assert log._reported == {"role:start"}  # once per process, under the start's own key


def test_a_multiprocessing_without_base_process_is_not_hooked(child_start, monkeypatch):
    from multiprocessing import process

    monkeypatch.delattr(process, "BaseProcess")
    assert role.when_child_starts(lambda target: None, lambda: None) is False
    assert child_start.registered == []


def test_a_process_class_without_its_own_run_is_not_hooked(monkeypatch):
    """Something replaced ``BaseProcess`` (or its ``run``): nothing to put back, so nothing is
    changed and the caller says the summary line at once."""
    from multiprocessing import process

    replaced = type("BaseProcess", (process.BaseProcess,), {})
    monkeypatch.setattr(process, "BaseProcess", replaced)
    assert role.when_child_starts(lambda target: None, lambda: None) is False
    assert "run" not in replaced.__dict__


# -- in the runtime: fresh interpreters, the fake sglang tree ---------------------------------------

ENTRY = '''
import os, sys

def %s(server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank, pipe_writer):
    import multiprocessing.process as mp
    from npu_shim.reporting import procinfo
    sys.stderr.write("BODY %%d\\n" %% os.getpid())
    sys.stderr.flush()
    pipe_writer.put({"role": procinfo.role(), "pid": os.getpid(),
                     "run_put_back": mp.BaseProcess.run.__module__ == "multiprocessing.process"})
'''
# a scheduler's module, and another process's entry: both import the demo patch's module first
FAKE_SCHEDULER = "import sglang.srt.utils.common\n" + ENTRY % "run_scheduler_process"
OTHER = "import sglang.srt.utils.common\n" + ENTRY % "run_detokenizer_process"

SPAWN = """
import json, multiprocessing as mp, types
import sglang.srt.managers.scheduler as sch
import sglang.srt.utils.common as common
if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    target = %s
    child = ctx.Process(target=target, args=(types.SimpleNamespace(tp_size=4, pp_size=1, dp_size=2),
                                             None, 0, 2, 0, 1, queue))
    child.start()
    seen = queue.get(timeout=60)
    child.join()
    print(json.dumps(seen))
"""


@pytest.fixture
def sched_tree(tree):
    managers = tree / "pkgs" / "sglang" / "srt" / "managers"
    managers.mkdir()
    (managers / "__init__.py").write_text("")
    (managers / "scheduler.py").write_text(FAKE_SCHEDULER)
    (managers / "detokenizer_manager.py").write_text(OTHER)
    return tree


def run_spawn(tree, code, main, env=None):
    """``main``: the code is the parent's main script, which the child re-imports first (as with
    ``python -m sglang.launch_server``: it decides then); else ``-c`` (it decides unpickling)."""
    if not main:
        return run(tree, code, env=env)
    script = tree / "image" / "spawn_main.py"
    script.write_text(code)
    return run(tree, "import runpy; runpy.run_path(%r, run_name='__main__')" % str(script), env=env)


def child_lines(stderr, pid):
    return [line for line in stderr.splitlines() if re.search(r"pid %d\b" % pid, line)]


@pytest.mark.parametrize("switch, main", [("1", False), ("0", False), ("1", True)])
def test_a_spawned_scheduler_logs_one_summary_line_with_its_role_before_its_body(sched_tree, switch, main):
    proc = run_spawn(sched_tree, SPAWN % "sch.run_scheduler_process", main, env={"NPU_SHIM_DEMO": switch})
    out = last_json(proc)
    assert out["role"] == {"role": "scheduler", "source": "run_scheduler_process", "tp_rank": 2,
                           "tp_size": 4, "pp_rank": 0, "pp_size": 1, "dp_rank": 1, "dp_size": 2}
    assert out["run_put_back"] is True
    lines = child_lines(proc.stderr, out["pid"])
    state = "applied" if switch == "1" else "disabled"
    assert re.fullmatch(SHIM_SGLANG + r" pid %d dp 1/2 tp 2/4\] demo=%s" % (out["pid"], state), lines[0]), lines
    assert [line for line in lines if "] demo=" in line] == lines[:1]
    assert proc.stderr.index(lines[0]) < proc.stderr.index("BODY %d" % out["pid"])


@pytest.mark.parametrize("main", [False, True])
def test_a_spawned_child_of_another_target_logs_its_summary_before_that_target_runs(sched_tree, main):
    code = SPAWN.replace("import sglang.srt.managers.scheduler as sch",
                         "import sglang.srt.managers.scheduler as sch\n"
                         "import sglang.srt.managers.detokenizer_manager as detok")
    proc = run_spawn(sched_tree, code % "detok.run_detokenizer_process", main)
    out = last_json(proc)
    # named by the target it starts (sglang sets the title only inside it)
    assert out["role"] == {"role": "detokenizer", "source": "process target run_detokenizer_process"}
    assert out["run_put_back"] is True
    lines = child_lines(proc.stderr, out["pid"])
    assert re.fullmatch(SHIM_SGLANG + r" pid %d detokenizer\] demo=applied" % out["pid"], lines[0]), lines
    assert proc.stderr.index(lines[0]) < proc.stderr.index("BODY %d" % out["pid"])


STACKED = """
import json, os, npu_shim
import sglang.srt.managers.scheduler as sch
from npu_shim.runtime import activation, decisions
original = sch.run_scheduler_process.__wrapped__.__wrapped__
stacked = [type(sch.run_scheduler_process).__name__, type(sch.run_scheduler_process.__wrapped__).__name__]
calls = []
class Queue:
    def put(self, item):
        calls.append(item)
sch.run_scheduler_process(None, None, 0, 1, 0, None, Queue())
decisions.revert_record(activation.RUNTIME.record("demo"))  # the patch fails: it alone is undone
after_patch = sch.run_scheduler_process.__wrapped__ is original
npu_shim.uninstall()
print(json.dumps({"stacked": stacked, "marked": os.environ["DEMO_MARK"], "source": calls[0]["role"]["source"],
                  "after_patch": after_patch, "restored": sch.run_scheduler_process is original}))
"""


def test_a_patch_wrapping_the_same_function_stacks_on_the_role_target_and_is_undone_first(sched_tree):
    """The role target is applied before any patch's target in its module and undone after them."""
    demo = (sched_tree / "image" / "demo.py").read_text()
    demo = demo.replace('modules = ("sglang.srt.utils.common",)',
                        'modules = ("sglang.srt.utils.common", "sglang.srt.managers.scheduler")')
    demo = demo.replace("        return [\n", """        def mark(wrapped, instance, args, kwargs):
            from npu_shim.reporting import procinfo
            os.environ["DEMO_MARK"] = procinfo.role()["role"]  # outside the role target's wrapper
            return wrapped(*args, **kwargs)
        return [
            targets.Wrap("sglang.srt.managers.scheduler", "run_scheduler_process", mark,
                         [("server_args", "port_args", "gpu_id", "tp_rank", "pp_rank", "dp_rank", "pipe_writer")]),
""", 1)
    (sched_tree / "image" / "demo.py").write_text(demo)
    out = last_json(run(sched_tree, STACKED))
    assert out == {"stacked": ["FunctionWrapper", "FunctionWrapper"], "marked": "unknown",
                   "source": "run_scheduler_process", "after_patch": True, "restored": True}
