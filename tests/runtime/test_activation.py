"""npu_shim/runtime/activation.py: what the runtime answers before it has decided anything, and how it
decides when there is no sglang source to read.  Hooks, applying, reverting and reloads are
tested in fresh interpreters by tests/test_bootstrap.py and tests/runtime/test_reliability.py."""
from __future__ import annotations

import os
import shutil
import sys
import types

import pytest

from npu_shim.core import framework
from npu_shim.reporting import procinfo, state_record, summary
from npu_shim.runtime import activation, decisions, role
from npu_shim.source import inherited
from test_bootstrap import DEMO_PATCH, last_json, run, tree  # noqa: F401 - ``tree`` is a fixture
from test_framework import declare


# -- before the shim started --------------------------------------------------------------------------

def test_states_and_record_before_the_shim_started(tree):
    """Armed at start-up, sglang not imported yet: nothing decided, nothing raised."""
    proc = run(tree, """
        import json, sys
        import npu_shim
        from npu_shim.runtime import activation, decisions
        print(json.dumps({"states": npu_shim.states(), "runtime_states": activation.RUNTIME.states(),
                          "record": activation.RUNTIME.record("demo"), "records": activation.RUNTIME.records,
                          "installed": activation.RUNTIME.installed, "sglang": "sglang" in sys.modules}))
    """)
    assert last_json(proc) == {"states": {}, "runtime_states": {}, "record": None, "records": None,
                               "installed": False, "sglang": False}
    assert proc.stderr == ""


def test_states_and_record_in_process_while_nothing_is_decided(undecided, monkeypatch):
    runtime = activation.Runtime()
    assert runtime.states() == {} and runtime.record("zbal") is None and runtime.decided_records() == []
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    runtime = activation.Runtime(patches=[])
    runtime.decide_all()  # decided, no patch registered
    assert runtime.records == {}
    assert runtime.states() == {} and runtime.record("zbal") is None and runtime.decided_records() == []


# -- no sglang to read ----------------------------------------------------------------------------------

@pytest.fixture
def undecided(monkeypatch):
    """A runtime of the test's own with one test patch (the demo of test_framework: needs no NPU,
    wraps sglang.srt.a:f), nothing decided; the global state deciding touches is restored after."""
    for name in ("source", "sglang_path", "shim_enabled"):
        monkeypatch.setattr(state_record.ATTACHED, name, getattr(state_record.ATTACHED, name))
    monkeypatch.setattr(procinfo, "_sglang_version", "before")
    for name in (inherited.ENV, "NPU_SHIM_STATE_DIR", "NPU_SHIM_STRICT", "NPU_SHIM_DEMO"):
        monkeypatch.setenv(name, "")  # so that the undo also removes what deciding exports
        monkeypatch.delenv(name)
    return activation.Runtime(patches=[declare()()])


def test_sglang_view_is_none_without_an_sglang_module(monkeypatch):
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    assert decisions.sglang_view() is None
    namespace = types.ModuleType("sglang")  # a namespace package: no __file__
    namespace.__file__ = None
    monkeypatch.setitem(sys.modules, "sglang", namespace)
    assert decisions.sglang_view() is None


def test_sglang_view_reads_the_directory_of_the_imported_package(monkeypatch, tmp_path):
    package = types.ModuleType("sglang")
    package.__file__ = str(tmp_path / "sglang" / "__init__.py")
    monkeypatch.setitem(sys.modules, "sglang", package)
    monkeypatch.setenv(inherited.ENV, "")
    view = decisions.sglang_view()
    assert isinstance(view, inherited.InheritedView)
    assert view.package_dir == str(tmp_path / "sglang")


def test_deciding_without_sglang_says_sglang_not_found_and_exports_nothing(undecided, monkeypatch):
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    undecided.decide_all()
    record = undecided.record("demo")
    assert (record.state, record.reason) == (framework.UNSUPPORTED, "sglang not found")
    assert undecided.states()["demo"]["targets"] == {}
    assert undecided.decided_from == "sglang source"
    assert inherited.ENV not in os.environ  # no answers to hand to children
    assert procinfo.sglang_version() == "before"  # no version read
    assert state_record.ATTACHED.sglang_path is None and state_record.ATTACHED.source is not None


def test_without_wrapt_and_without_sglang_on_disk_nothing_reads_applied(undecided, monkeypatch):
    """``fail_without_wrapt`` at ``import sglang`` when the package directory cannot be found."""
    monkeypatch.setattr(activation, "find_package_dir", lambda name: None)
    undecided.fail_without_wrapt("wrapt is not available: test")
    record = undecided.record("demo")
    assert (record.state, record.reason) == (framework.UNSUPPORTED, "sglang not found")
    assert inherited.ENV not in os.environ and procinfo.sglang_version() == "before"


def test_without_wrapt_a_patch_that_would_apply_is_failed(undecided, monkeypatch, tmp_path):
    package = tmp_path / "sglang"
    (package / "srt").mkdir(parents=True)
    (package / "version.py").write_text('__version__ = "0.5.9"\n')
    (package / "srt" / "a.py").write_text("def f():\n    return 1\n")
    monkeypatch.setattr(activation, "find_package_dir", lambda name: str(package))
    undecided.fail_without_wrapt("wrapt is not available: test")
    record = undecided.record("demo")
    assert record.state == framework.FAILED
    assert record.reason.startswith("wrapt is not available: test (use an npu-shim bundle")
    assert procinfo.sglang_version() == "0.5.9"
    assert state_record.ATTACHED.sglang_path == str(package)


def test_an_sglang_directory_gone_from_disk_is_unsupported_naming_the_target(undecided, monkeypatch,
                                                                             tmp_path):
    package = tmp_path / "sglang"
    package.mkdir()
    module = types.ModuleType("sglang")
    module.__file__ = str(package / "__init__.py")
    shutil.rmtree(str(package))
    monkeypatch.setitem(sys.modules, "sglang", module)
    undecided.decide_all()
    record = undecided.record("demo")
    assert (record.state, record.reason) == (framework.UNSUPPORTED, "sglang.srt.a:f not found")


# -- publishing a decision failing ---------------------------------------------------------------------

def boom(*args, **kwargs):
    raise RuntimeError("boom")


@pytest.fixture
def requested(undecided, monkeypatch, tmp_path):
    """The runtime with one patch the user asked for (``must_honour``) that cannot apply: sglang's
    directory is gone, so a view exists (the answers are exported) and the patch is unsupported."""
    module = types.ModuleType("sglang")
    module.__file__ = str(tmp_path / "gone" / "__init__.py")
    monkeypatch.setitem(sys.modules, "sglang", module)
    monkeypatch.setattr(summary, "report_all", lambda records: None)  # no lines in the test's log
    return activation.Runtime(patches=[declare(must_honour=lambda self, environ: True)()])


FAILURE_POINTS = {
    "inherited.export": lambda mp: mp.setattr(inherited, "export", boom),
    "procinfo.note_sglang_version": lambda mp: mp.setattr(procinfo, "note_sglang_version", boom),
    "summary.report_all": lambda mp: mp.setattr(summary, "report_all", boom),
    "report_invalid_variables": lambda mp: mp.setattr(activation, "report_invalid_variables", boom),
    "role.when_child_starts": lambda mp: (mp.setattr(role, "child_unpickling", lambda: True),
                                          mp.setattr(role, "when_child_starts", boom)),
    "state_record.attach": lambda mp: mp.setattr(state_record, "attach", boom),
    "state_record.write": lambda mp: mp.setattr(state_record, "write", boom),
}


@pytest.mark.parametrize("point", sorted(FAILURE_POINTS))
def test_a_requested_patch_that_failed_stops_the_process_whatever_publishing_raised(requested, monkeypatch,
                                                                                     point):
    FAILURE_POINTS[point](monkeypatch)
    with pytest.raises(framework.ShimError, match=r"^npu-shim: demo was requested but is unsupported: "
                                                 r"sglang\.srt\.a:f not found$"):
        requested.decide_all()
    assert requested.record("demo").state == framework.UNSUPPORTED


@pytest.mark.parametrize("point", sorted(FAILURE_POINTS))
def test_publishing_that_raised_is_logged_and_raised_only_in_strict_mode(undecided, monkeypatch, point):
    """A patch that has nothing to enforce (upstream): deciding goes on (the hook then applies);
    strict mode stops."""
    runtime = activation.Runtime(patches=[declare(probe=lambda self, view: "it is there")()])
    monkeypatch.setattr(summary, "report_all", lambda records: None)
    monkeypatch.setattr(activation, "sglang_view", lambda: types.SimpleNamespace(
        version="0.5.9", package_dir=None, function=lambda *a: None, module=lambda d: None))
    FAILURE_POINTS[point](monkeypatch)
    runtime.decide_all()
    assert runtime.record("demo").state == framework.UPSTREAM
    if point == "role.when_child_starts":
        return  # the line is said at once instead (the next test): nothing was lost
    monkeypatch.setenv("NPU_SHIM_STRICT", "1")
    with pytest.raises(framework.ShimError, match=r"^npu-shim \(strict\): "):
        runtime.decide_all()


@pytest.mark.parametrize("hook", ["raises", "cannot be set"])
def test_a_child_whose_start_cannot_be_hooked_says_its_summary_line_at_once(undecided, monkeypatch, hook):
    said = []
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    monkeypatch.setattr(summary, "report_all", said.append)
    monkeypatch.setattr(role, "child_unpickling", lambda: True)
    monkeypatch.setattr(role, "when_child_starts", boom if hook == "raises" else lambda starts, exits: False)
    undecided.decide_all()
    assert said == [undecided.records] and undecided.summary_due is None


# -- activation failing ---------------------------------------------------------------------------------

def test_an_activation_that_fails_is_raised_only_in_strict_mode(monkeypatch):
    def boom(watcher=None):
        raise RuntimeError("boom")

    runtime = activation.Runtime()
    monkeypatch.setattr(runtime, "activate", boom)
    monkeypatch.delenv("NPU_SHIM_STRICT", raising=False)
    runtime.activate_guarded()  # logged once, the application goes on
    monkeypatch.setenv("NPU_SHIM_STRICT", "1")
    with pytest.raises(framework.ShimError, match=r"^npu-shim activation failed: RuntimeError\('boom'\)$"):
        runtime.activate_guarded()


def test_without_wrapt_before_torch_is_imported_the_npu_is_unknown(undecided, monkeypatch, tmp_path):
    """At ``import sglang`` torch is usually not imported yet: a patch that needs an NPU is then
    decided as if it might have one (``failed`` without wrapt), never ``inactive`` for want of one."""
    package = tmp_path / "sglang"
    (package / "srt").mkdir(parents=True)
    (package / "srt" / "a.py").write_text("def f():\n    return 1\n")
    monkeypatch.setattr(activation, "find_package_dir", lambda name: str(package))
    runtime = activation.Runtime(patches=[declare(needs_npu=True)()])
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    runtime.fail_without_wrapt("wrapt is not available: test")
    assert runtime.record("demo").state == framework.FAILED
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace())  # imported, and no NPU
    runtime.fail_without_wrapt("wrapt is not available: test")
    record = runtime.record("demo")
    assert (record.state, record.reason) == (framework.INACTIVE,
                                             "not running on an NPU (torch.npu is unavailable)")


# -- a wrapper that retires ------------------------------------------------------------------------------

RETIRING = DEMO_PATCH.replace(
    "def add_one(wrapped, instance, args, kwargs):\n    return wrapped(*args, **kwargs) + 1\n",
    "RETIREMENT = targets.Retirement()\n"
    "CALLS = []\n\n"
    "def add_one(wrapped, instance, args, kwargs):\n"
    "    CALLS.append(1)\n"
    "    if len(CALLS) == 50:\n"
    "        RETIREMENT.retire()  # done: the original goes back while the other threads call\n"
    "    return wrapped(*args, **kwargs) + 1\n").replace(
    'targets.Wrap("sglang.srt.utils.common", "get_npu_memory_capacity", add_one, [()])',
    'targets.Wrap("sglang.srt.utils.common", "get_npu_memory_capacity", add_one, [()], retirement=RETIREMENT)')


def test_a_retired_wrapper_leaves_the_module_and_its_copies_while_threads_call_it(tree):
    assert RETIRING.count("RETIREMENT") == 3
    (tree / "image" / "demo.py").write_text(RETIRING)
    proc = run(tree, """
        import json, sys, threading
        import npu_shim
        from sglang.srt.utils import common
        import sglang.srt.utils as star  # its star import took a copy of the wrapper
        demo = sys.modules["demo"]
        original = common.get_npu_memory_capacity.__wrapped__
        copy_was_wrapper = star.get_npu_memory_capacity is common.get_npu_memory_capacity
        values, errors = [], []
        def call():
            try:
                for _ in range(2000):
                    values.append(star.get_npu_memory_capacity())
            except Exception as exc:
                errors.append(repr(exc))
        threads = [threading.Thread(target=call) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        out = {"copy_was_wrapper": copy_was_wrapper, "errors": errors, "values": sorted(set(values)),
               "calls": len(demo.CALLS), "module": common.get_npu_memory_capacity is original,
               "copy": star.get_npu_memory_capacity is original, "state": npu_shim.states()["demo"],
               "again": demo.RETIREMENT.retire()}
        out["reinstated"] = [demo.RETIREMENT.reinstate(), star.get_npu_memory_capacity(),
                             common.get_npu_memory_capacity(), npu_shim.states()["demo"]["retired"]]
        demo.RETIREMENT.retire()
        npu_shim.uninstall()
        out["uninstalled"] = [common.get_npu_memory_capacity is original,
                              star.get_npu_memory_capacity is original,
                              type(common.Scheduler.__init__).__name__,
                              demo.RETIREMENT.reinstate(), common.get_npu_memory_capacity()]
        print(json.dumps(out))
    """)
    out = last_json(proc)
    assert out["copy_was_wrapper"] is True and out["errors"] == []
    assert out["values"] == [1000, 1001] and 50 <= out["calls"] < 8000  # wrapped, then the original
    assert out["module"] is True and out["copy"] is True
    state, what = out["state"], "sglang.srt.utils.common:get_npu_memory_capacity"
    assert state["state"] == "applied" and state["retired"] == [what]
    assert state["wrappers"] == ["sglang.srt.utils.common:Scheduler.__init__"]
    assert state["details"]["retired"] == [what] and state["targets"][what] is True
    assert out["again"] is False  # retired already
    assert out["reinstated"] == [True, 1001, 1001, []]
    assert out["uninstalled"] == [True, True, "function", False, 1000]
