"""npu_shim/runtime/activation.py: what the runtime answers before it has decided anything, and how it
decides when there is no sglang source to read, and (on Runtimes and fake modules of the tests'
own) activating, the hooks, applying, retiring, reloads, install() and uninstall().  The same in
fresh interpreters: tests/test_bootstrap.py and tests/runtime/test_reliability.py."""
from __future__ import annotations

import os
import shutil
import sys
import types

import pytest

from npu_shim.core import framework, loading
from npu_shim.reporting import metrics, procinfo, summary
from npu_shim.runtime import activation, decisions, metrics_hook, role, targets, wrapt_loader
from npu_shim.source.codeview import SourceView
from test_bootstrap import DEMO_PATCH, last_json, run, tree  # noqa: F401 - ``tree`` is a fixture
from test_decisions import logged  # noqa: F401 - a fixture
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
    monkeypatch.setattr(procinfo, "_sglang_version", "before")
    for name in ("NPU_SHIM_STRICT", "NPU_SHIM_DEMO"):
        monkeypatch.setenv(name, "")  # so that the undo also removes what a test sets
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
    view = decisions.sglang_view()
    assert type(view) is SourceView
    assert view.package_dir == str(tmp_path / "sglang")


def test_deciding_without_sglang_says_sglang_not_found_and_notes_no_version(undecided, monkeypatch):
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    environ = dict(os.environ)
    undecided.decide_all()
    record = undecided.record("demo")
    assert (record.state, record.reason) == (framework.UNSUPPORTED, "sglang not found")
    assert undecided.states()["demo"]["targets"] == {}
    assert dict(os.environ) == environ
    assert procinfo.sglang_version() == "before"  # no version read


def test_without_wrapt_and_without_sglang_on_disk_nothing_reads_applied(undecided, monkeypatch):
    """``fail_without_wrapt`` at ``import sglang`` when the package directory cannot be found."""
    monkeypatch.setattr(activation, "find_package_dir", lambda name: None)
    undecided.fail_without_wrapt("wrapt is not available: test")
    record = undecided.record("demo")
    assert (record.state, record.reason) == (framework.UNSUPPORTED, "sglang not found")
    assert procinfo.sglang_version() == "before"


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
    directory is gone, so a view exists (its version is noted) and the patch is unsupported."""
    module = types.ModuleType("sglang")
    module.__file__ = str(tmp_path / "gone" / "__init__.py")
    monkeypatch.setitem(sys.modules, "sglang", module)
    monkeypatch.setattr(summary, "report_all", lambda records: None)  # no lines in the test's log
    return activation.Runtime(patches=[declare(must_honour=lambda self, environ: True)()])


FAILURE_POINTS = {
    "procinfo.note_sglang_version": lambda mp: mp.setattr(procinfo, "note_sglang_version", boom),
    "summary.report_all": lambda mp: mp.setattr(summary, "report_all", boom),
    "report_invalid_variables": lambda mp: mp.setattr(activation, "report_invalid_variables", boom),
    "role.when_child_starts": lambda mp: (mp.setattr(role, "child_unpickling", lambda: True),
                                          mp.setattr(role, "when_child_starts", boom)),
    "metrics.publish": lambda mp: mp.setattr(metrics, "publish", boom),
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
    def boom(watcher):
        raise RuntimeError("boom")

    runtime = activation.Runtime()
    monkeypatch.setattr(runtime, "activate", boom)
    monkeypatch.delenv("NPU_SHIM_STRICT", raising=False)
    runtime.activate_guarded(Watcher())  # logged once, the application goes on
    monkeypatch.setenv("NPU_SHIM_STRICT", "1")
    with pytest.raises(framework.ShimError, match=r"^npu-shim activation failed: RuntimeError\('boom'\)$"):
        runtime.activate_guarded(Watcher())


def test_without_wrapt_before_torch_is_imported_the_npu_is_unknown(undecided, monkeypatch, tmp_path):
    """At ``import sglang`` torch is usually not imported yet: a patch that needs an NPU is then
    decided as if it might have one (``failed`` without wrapt), never ``inactive`` for want of one."""
    package = tmp_path / "sglang"
    (package / "srt").mkdir(parents=True)
    (package / "srt" / "a.py").write_text("def f():\n    return 1\n")
    monkeypatch.setattr(activation, "find_package_dir", lambda name: str(package))
    runtime = activation.Runtime(patches=[declare(omit=("trigger",))()])
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    runtime.fail_without_wrapt("wrapt is not available: test")
    assert runtime.record("demo").state == framework.FAILED
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace())  # imported, and no NPU
    runtime.fail_without_wrapt("wrapt is not available: test")
    record = runtime.record("demo")
    assert (record.state, record.reason) == (framework.INACTIVE,
                                             "not running on an NPU (torch.npu is unavailable)")


# -- a runtime of the test's own, activated in this process -------------------------------------------

HOOKED = ["sglang.srt.a", role.MODULE] + list(metrics_hook.MODULES)
UNWRAPT = " (use an npu-shim bundle: 'python -m npu_shim bundle DIR', or install wrapt>=1.14 in the image)"


def add_one(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) + 1


class Watcher:
    """The start-up watcher as the runtime calls it (npu_shim/_bootstrap.py), answering as told:
    ``waiting`` (armed for the first ``import sglang``), ``off_only`` (armed only to say "off");
    it hands imports on to the hook table once told to (``hand_on``)."""

    def __init__(self, waiting=False, off_only=False):
        self.answers = (waiting, off_only)
        self.calls = []

    def waiting(self):
        return self.answers[0]

    def says_off_only(self):
        return self.answers[1]

    def take_over(self):
        self.calls.append("take_over")

    def arm(self):
        self.calls.append("arm")

    def disarm(self):
        self.calls.append("disarm")

    def hand_on(self, find_spec):
        self.calls.append(("hand_on", find_spec))

    def stop_handing_on(self):
        self.calls.append("stop_handing_on")


def fake_module(name, source):
    module = types.ModuleType(name)
    exec(source, module.__dict__)
    return module


@pytest.fixture
def sglang_tree(monkeypatch, tmp_path):
    """An sglang package on disk whose ``srt/a.py`` has ``f()`` (the demo patch's target), imported:
    ``sglang`` in sys.modules, and ``find_package_dir`` finds it."""
    package = tmp_path / "sglang"
    (package / "srt").mkdir(parents=True)
    (package / "version.py").write_text('__version__ = "0.5.9"\n')
    (package / "srt" / "a.py").write_text("def f():\n    return 1\n")
    module = types.ModuleType("sglang")
    module.__file__ = str(package / "__init__.py")
    monkeypatch.setitem(sys.modules, "sglang", module)
    monkeypatch.setattr(activation, "find_package_dir", {"sglang": str(package)}.get)
    return package


@pytest.fixture
def activating(undecided, monkeypatch):
    """``make()`` -> a Runtime whose activation loads one patch, the demo (``Wrap`` of
    sglang.srt.a:f adding 1); none of the modules it hooks imported yet; the finders of these
    runtimes never in sys.meta_path."""
    patch = declare(targets=lambda self, view, ctx: [targets.Wrap("sglang.srt.a", "f", add_one, [()])])()
    monkeypatch.setattr(loading, "load_all", lambda: [patch])
    monkeypatch.setattr(summary, "report_all", lambda records: None)
    monkeypatch.setattr(procinfo, "_noted", None)
    for name in HOOKED + ["sglang"]:
        monkeypatch.delitem(sys.modules, name, raising=False)
    made = []

    def make():
        made.append(activation.Runtime())
        return made[-1]

    yield make
    assert not [runtime for runtime in made if runtime.finder in sys.meta_path]  # never there


def test_a_new_runtime_has_activated_hooked_and_decided_nothing():
    runtime = activation.Runtime()
    assert (runtime.installed, runtime.patches, runtime.records) == (False, None, None)
    assert (runtime.imported_before, runtime.hooked, runtime.watcher, runtime.own_changes) == (set(), set(), None, [])
    assert runtime.summary_due is None and runtime.finder.waiting() == []
    assert runtime.watches("sglang.srt.a") is False


def test_activation_hooks_each_module_a_patch_or_the_shim_itself_touches_once(activating, monkeypatch):
    """The shim's own modules (the scheduler's, the metrics collectors') are hooked whatever patch
    is on, each once where a patch lists one too; nothing is decided before a hook fires."""
    patch = declare(modules=("sglang.srt.a", role.MODULE))()
    monkeypatch.setattr(loading, "load_all", lambda: [patch])
    runtime, watcher = activating(), Watcher()
    runtime.activate(watcher)
    patches = runtime.patches
    assert runtime.installed is True and patches == [patch] and runtime.records is None
    assert runtime.watcher is watcher and watcher.calls == [("hand_on", runtime.finder.find_spec)]
    assert runtime.finder not in sys.meta_path  # it answers through the watcher, never itself
    assert runtime.hooked == set(HOOKED) and runtime.imported_before == set()
    assert runtime.finder.waiting() == sorted(HOOKED)
    assert runtime.watches("sglang.srt.a") is False  # nothing decided: a reload is not re-applied
    runtime.activate(Watcher())  # active already: nothing changes
    assert runtime.watcher is watcher and runtime.patches is patches and len(watcher.calls) == 1


def test_activation_after_sglang_arms_the_start_up_watcher_alone_in_sys_meta_path(activating, monkeypatch):
    """install() after sglang was imported, the watcher not in sys.meta_path: it goes first and
    hands imports on to the hook table, which never goes there; uninstall() takes it out again."""
    from npu_shim import _bootstrap

    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if f is not _bootstrap.WATCHER])
    monkeypatch.setattr(_bootstrap, "_saw_sglang", False)
    monkeypatch.setattr(_bootstrap, "_hand_on_to", None)
    before = list(sys.meta_path)
    runtime = activating()
    runtime.activate(_bootstrap.WATCHER)
    assert sys.meta_path == [_bootstrap.WATCHER] + before and runtime.watcher is _bootstrap.WATCHER
    assert _bootstrap.handing_on_to() == runtime.finder.find_spec
    runtime.uninstall(_bootstrap.WATCHER)
    assert sys.meta_path == before and _bootstrap.handing_on_to() is None


def test_a_module_imported_before_activation_is_decided_and_patched_at_once_copies_included(
        activating, sglang_tree, monkeypatch):
    """install() after sglang: the hook of a module imported already fires at once; the copies
    other modules took (``from sglang.srt.a import f``) get the wrapper too."""
    module = fake_module("sglang.srt.a", "def f():\n    return 1\n")
    copy = types.ModuleType("sglang.srt.b")
    copy.f = module.f
    monkeypatch.setitem(sys.modules, "sglang.srt.a", module)
    monkeypatch.setitem(sys.modules, "sglang.srt.b", copy)
    runtime = activating()
    runtime.activate(Watcher())
    assert runtime.imported_before == {"sglang.srt.a"}
    record = runtime.record("demo")
    assert record.state == framework.APPLIED and record.applied == {"sglang.srt.a:f"}
    assert module.f() == 2 and copy.f() == 2
    assert runtime.finder.waiting() == sorted(set(HOOKED) - {"sglang.srt.a"})
    assert runtime.watches("sglang.srt.a") is True and runtime.watches("sglang.srt.b") is False
    records = runtime.records
    runtime.finder.run_hooks(types.ModuleType(metrics_hook.MODULES[0]))  # a later hook: decided already
    assert runtime.records is records and module.f() == 2


def test_uninstall_restores_every_original_and_hooks_of_earlier_activations_stay_silent(
        activating, sglang_tree, monkeypatch):
    """Each activation's hooks belong to it: uninstall() drops those still waiting, and one that
    runs after all (an earlier activation's) changes nothing (the demo's wrapper is put once)."""
    runtime, watcher = activating(), Watcher()
    for _ in range(2):
        runtime.activate(watcher)
        runtime.uninstall(watcher)
    assert watcher.calls[1:3] == ["disarm", "stop_handing_on"]
    assert runtime.finder.waiting() == []
    assert runtime.installed is False and (runtime.records, runtime.patches) == (None, None)
    runtime.activate(watcher)
    module = fake_module("sglang.srt.a", "def f():\n    return 1\n")
    original = module.f
    monkeypatch.setitem(sys.modules, "sglang.srt.a", module)
    runtime.finder.run_hooks(module)
    assert module.f() == 2
    runtime.uninstall(watcher)
    assert module.f is original and runtime.own_changes == []
    assert runtime.installed is False and (runtime.records, runtime.patches) == (None, None)
    assert runtime.watches("sglang.srt.a") is False and runtime.states() == {}


def test_install_cycles_leave_one_hook_waiting_per_module(activating, sglang_tree):
    """25 uninstall()/install() cycles grew the finder's waiting hooks from 4 to 104 here: each
    install added one per module, and none was dropped."""
    runtime, watcher = activating(), Watcher()

    def waiting_hooks():
        return sum(len(hooks) for hooks in runtime.finder._hooks.values())

    runtime.activate(watcher)
    assert waiting_hooks() == len(HOOKED)
    for _ in range(25):
        runtime.uninstall(watcher)
        assert waiting_hooks() == 0
        runtime.activate(watcher)
    assert waiting_hooks() == len(HOOKED) and runtime.finder.waiting() == sorted(HOOKED)
    module = fake_module("sglang.srt.a", "def f():\n    return 1\n")
    runtime.finder.run_hooks(module)
    assert module.f() == 2  # wrapped once


def test_a_hook_an_earlier_install_left_behind_does_nothing_in_a_later_one(activating, sglang_tree, monkeypatch):
    """A hook held across uninstall() (popped by ``run_hooks`` in another thread, or handed out by an
    activation that raced uninstall() and install()) that runs in a later install neither decides
    nor patches: each install's hooks are its own, however many cycles came before."""
    runtime, watcher = activating(), Watcher()
    earlier = []
    for _ in range(2):
        runtime.activate(watcher)
        earlier += runtime.finder._hooks["sglang.srt.a"]
        runtime.uninstall(watcher)
    runtime.activate(watcher)
    module = fake_module("sglang.srt.a", "def f():\n    return 1\n")
    monkeypatch.setitem(sys.modules, "sglang.srt.a", module)
    for hook in earlier:
        hook(module)
    assert module.f() == 1 and runtime.records is None
    runtime.finder.run_hooks(module)  # this install's own hook
    assert module.f() == 2 and runtime.record("demo").applied == {"sglang.srt.a:f"}
    runtime.uninstall(watcher)
    assert module.f() == 1


@pytest.mark.parametrize("error, reason", [
    (wrapt_loader.WraptUnavailable("wrapt is not available: test"), "wrapt is not available: test"),
    (RuntimeError("broken build"), "wrapt could not be loaded: RuntimeError('broken build')")])
def test_activation_without_wrapt_fails_each_patch_that_would_apply_and_hooks_nothing(
        activating, sglang_tree, monkeypatch, error, reason):
    def load():
        raise error

    monkeypatch.setattr(wrapt_loader, "load", load)
    runtime, watcher = activating(), Watcher()
    runtime.activate(watcher)
    record = runtime.record("demo")
    assert (record.state, record.reason) == (framework.FAILED, reason + UNWRAPT)
    assert runtime.hooked == set() and runtime.finder.waiting() == [] and watcher.calls == []


def test_an_activation_that_fails_is_logged_once_and_a_shim_error_goes_through(logged, activating):
    runtime, watcher = activating(), Watcher()
    runtime.activate_guarded(watcher)
    assert runtime.watcher is watcher and runtime.installed is True

    def boom(watcher):
        raise RuntimeError("boom")

    failing = activation.Runtime()
    failing.activate = boom
    failing.activate_guarded(watcher)
    failing.activate_guarded(watcher)
    assert logged() == [("ERROR", "shim off: activation failed: RuntimeError('boom')")]

    def refuse(watcher):
        raise framework.ShimError("npu-shim: demo was requested")

    failing.activate = refuse
    with pytest.raises(framework.ShimError, match=r"^npu-shim: demo was requested$"):
        failing.activate_guarded(watcher)


# -- install() -----------------------------------------------------------------------------------------

def test_install_before_sglang_arms_the_watcher(activating):
    runtime, watcher = activating(), Watcher()
    assert runtime.install(watcher) is True
    assert watcher.calls == ["take_over", "arm"] and runtime.watcher is watcher and runtime.installed is False


def test_install_after_sglang_activates_at_once_and_only_once(activating, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", types.ModuleType("sglang"))
    runtime, watcher = activating(), Watcher()
    assert runtime.install(watcher) is True
    assert watcher.calls == ["take_over", ("hand_on", runtime.finder.find_spec)]
    assert runtime.installed is True and runtime.watcher is watcher
    again = Watcher()
    assert runtime.install(again) is False and again.calls == []


def test_install_leaves_a_watcher_armed_to_activate_alone_and_takes_over_one_armed_to_say_off(activating):
    runtime = activating()
    armed = Watcher(waiting=True)
    assert runtime.install(armed) is False and armed.calls == []
    says_off = Watcher(waiting=True, off_only=True)
    assert runtime.install(says_off) is True and says_off.calls == ["take_over", "arm"]


# -- deciding and saying it ------------------------------------------------------------------------------

def test_deciding_asks_whether_this_process_runs_on_an_npu(undecided, sglang_tree, monkeypatch):
    runtime = activation.Runtime(patches=[declare(omit=("trigger",))()])
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace())  # imported, and no NPU
    runtime.decide_all()
    record = runtime.record("demo")
    assert (record.state, record.reason) == (framework.INACTIVE, "not running on an NPU (torch.npu is unavailable)")


def test_a_child_says_its_summary_line_when_its_target_starts(undecided, monkeypatch):
    said, hooked = [], []
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    monkeypatch.setattr(summary, "report_all", said.append)
    monkeypatch.setattr(role, "child_unpickling", lambda: True)
    monkeypatch.setattr(role, "when_child_starts", lambda starts, exits: hooked.append((starts, exits)) or True)
    undecided.decide_all()
    assert said == [] and undecided.summary_due == os.getpid()
    assert hooked == [(undecided.child_starts, undecided.say_summary)]
    hooked[0][1]()  # the child exits before its target starts: said then
    assert said == [undecided.records]


def test_without_wrapt_a_child_says_its_summary_line_at_once(undecided, monkeypatch):
    """Nothing can wrap the child's start without wrapt: the line is said while deciding."""
    said, hooked = [], []
    monkeypatch.setattr(activation, "find_package_dir", lambda name: None)
    monkeypatch.setattr(summary, "report_all", said.append)
    monkeypatch.setattr(role, "child_unpickling", lambda: True)
    monkeypatch.setattr(role, "when_child_starts", lambda starts, exits: hooked.append(starts) or True)
    undecided.fail_without_wrapt("wrapt is not available: test")
    assert said == [undecided.records] and hooked == []


def test_a_child_start_hook_that_raised_is_logged(logged, undecided, monkeypatch):
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    monkeypatch.setattr(summary, "report_all", lambda records: None)
    monkeypatch.setattr(role, "child_unpickling", lambda: True)
    monkeypatch.setattr(role, "when_child_starts", boom)
    undecided.decide_all()
    assert logged() == [("ERROR", "the child-start hook failed: RuntimeError('boom')")]


def test_the_summary_line_is_followed_by_the_unknown_variables_of_the_patches_read(logged, undecided, monkeypatch):
    """The demo's switch is a variable the shim reads (through the runtime's patches); a typo is not."""
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    monkeypatch.setattr(summary, "report_all", lambda records: None)
    monkeypatch.setenv("NPU_SHIM_DEMO", "1")
    monkeypatch.setenv("NPU_SHIM_DEMOO", "1")
    undecided.decide_all()
    assert logged() == [
        ("WARNING", "NPU_SHIM_DEMOO is not a variable npu-shim reads (ignored); did you mean NPU_SHIM_DEMO?")]


PUBLISHING_STEPS = {"procinfo.note_sglang_version": "noting sglang's version",
                    "summary.report_all": "the summary line", "report_invalid_variables": "the summary line",
                    "metrics.publish": "the metrics"}


@pytest.mark.parametrize("point", sorted(PUBLISHING_STEPS))
def test_a_publishing_step_that_raised_is_named_in_its_line_and_in_strict_mode(logged, undecided, monkeypatch,
                                                                                point):
    runtime = activation.Runtime(patches=[declare(probe=lambda self, view: "it is there")()])
    monkeypatch.setattr(summary, "report_all", lambda records: None)
    monkeypatch.setattr(activation, "sglang_view", lambda: types.SimpleNamespace(
        version="0.5.9", package_dir=None, function=lambda *a: None, module=lambda d: None))
    FAILURE_POINTS[point](monkeypatch)
    runtime.decide_all()
    step = PUBLISHING_STEPS[point]
    assert logged() == [("ERROR", "%s failed: RuntimeError('boom')" % step)]
    monkeypatch.setenv("NPU_SHIM_STRICT", "1")
    with pytest.raises(framework.ShimError, match=r"^npu-shim \(strict\): publishing the decisions failed: %s$" % step):
        runtime.decide_all()


def test_strict_mode_names_every_publishing_step_that_raised(undecided, monkeypatch):
    runtime = activation.Runtime(patches=[declare(probe=lambda self, view: "it is there")()])
    monkeypatch.setattr(summary, "report_all", lambda records: None)
    monkeypatch.setattr(activation, "sglang_view", lambda: types.SimpleNamespace(
        version="0.5.9", package_dir=None, function=lambda *a: None, module=lambda d: None))
    FAILURE_POINTS["procinfo.note_sglang_version"](monkeypatch)
    FAILURE_POINTS["metrics.publish"](monkeypatch)
    monkeypatch.setenv("NPU_SHIM_STRICT", "1")
    with pytest.raises(framework.ShimError, match=r"^npu-shim \(strict\): publishing the decisions failed: "
                                                 r"noting sglang's version, the metrics$"):
        runtime.decide_all()


def test_deciding_notes_the_views_version_and_hands_nothing_on_through_the_environment(undecided, monkeypatch):
    """A process that decided leaves the environment its children inherit as it was: each of them
    reads sglang's source itself."""
    view = types.SimpleNamespace(version="0.5.9", package_dir=None, function=lambda *a: None,
                                 module=lambda dotted: None)
    monkeypatch.setattr(activation, "sglang_view", lambda: view)
    environ = dict(os.environ)
    undecided.decide_all()
    assert undecided.record("demo").state == framework.UNSUPPORTED
    assert procinfo.sglang_version() == "0.5.9" and dict(os.environ) == environ


def test_a_step_of_saying_the_decisions_says_whether_it_ran_and_a_failure_is_logged_once(logged):
    ran = []
    assert activation.said("the summary line", lambda: ran.append(1)) is True
    assert ran == [1] and logged() == []
    assert activation.said("the summary line", boom) is False
    assert activation.said("the summary line", boom) is False
    assert activation.said("the metrics", boom) is False
    assert logged() == [("ERROR", "the summary line failed: RuntimeError('boom')"),
                        ("ERROR", "the metrics failed: RuntimeError('boom')")]


# -- what a spawned child says when its target starts ---------------------------------------------------

SCHEDULER = "def run_scheduler_process(server_args, tp_rank, pp_rank, dp_rank):\n    return 'ran'\n"


@pytest.fixture
def spawned_child(undecided, monkeypatch):
    """``undecided`` decided as in a spawned child whose start is hooked; the summary lines it says,
    each with the role it has then."""
    said = []
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    monkeypatch.setattr(procinfo, "_noted", None)
    monkeypatch.setattr(summary, "report_all", lambda records: said.append((procinfo.role_label(), records)))
    monkeypatch.setattr(role, "child_unpickling", lambda: True)
    monkeypatch.setattr(role, "when_child_starts", lambda starts, exits: True)
    undecided.decide_all()
    return said


def test_a_scheduler_child_says_its_summary_line_with_its_role_when_its_entry_runs(undecided, spawned_child,
                                                                                   monkeypatch):
    said, writes = spawned_child, []
    scheduler = fake_module(role.MODULE, SCHEDULER)
    original = scheduler.run_scheduler_process
    copy = types.ModuleType("sglang.srt.entry")
    copy.run_scheduler_process = original
    monkeypatch.setitem(sys.modules, "sglang.srt.entry", copy)
    undecided.imported_before = {role.MODULE}
    undecided.apply_module(scheduler)
    assert copy.run_scheduler_process is scheduler.run_scheduler_process is not original
    monkeypatch.setattr(metrics, "publish", lambda: writes.append(True))
    undecided.child_starts(scheduler.run_scheduler_process)  # the wrapper says the line itself
    assert said == [] and writes == [] and procinfo.role()["role"] == "unknown"
    assert scheduler.run_scheduler_process(types.SimpleNamespace(tp_size=4, pp_size=1, dp_size=1), 3, 0, None) == "ran"
    assert said == [("tp 3/4", undecided.records)]
    undecided.uninstall(Watcher())
    assert scheduler.run_scheduler_process is original and copy.run_scheduler_process is original


def test_any_other_child_notes_its_target_and_says_its_line_at_once(undecided, spawned_child):
    said = spawned_child

    def run_detokenizer_process():
        pass

    undecided.child_starts(run_detokenizer_process)
    assert said == [("detokenizer", undecided.records)]


def test_the_shims_own_targets_that_cannot_be_set_are_said_at_debug_and_the_patches_apply(logged, monkeypatch):
    record = applied_record([targets.Wrap(role.MODULE, "run_scheduler_process", add_one, [()])])
    runtime = activation.Runtime()
    runtime.records = {"demo": record}
    scheduler = fake_module(role.MODULE, "def run_scheduler_process():\n    return 1\n")
    runtime.apply_module(scheduler)
    assert scheduler.run_scheduler_process() == 2 and runtime.own_changes == []
    collector = fake_module(metrics_hook.MODULES[0], "")
    monkeypatch.setattr(metrics_hook, "prepare", boom)
    runtime.apply_module(collector)
    assert logged() == [
        ("DEBUG", "the scheduler's role comes from its process title: sglang.srt.managers.scheduler:"
                  "run_scheduler_process has no parameter server_args, tp_rank, pp_rank, dp_rank"),
        ("DEBUG", "the shim's metrics are not published: boom")]


def test_a_metrics_collector_made_starts_the_shims_gauges_from_the_records(monkeypatch):
    started = []
    monkeypatch.setattr(metrics, "start", started.append)
    runtime = activation.Runtime()
    runtime.records = {"demo": applied_record([])}
    collector = fake_module(metrics_hook.MODULES[1], "class SchedulerMetricsCollector:\n"
                                                      "    def __init__(self):\n        self.made = True\n")
    runtime.apply_module(collector)
    assert collector.SchedulerMetricsCollector().made is True
    assert len(started) == 1 and started[0]() == runtime.state_snapshot()
    runtime.uninstall(Watcher())
    collector.SchedulerMetricsCollector()
    assert len(started) == 1


# -- applying, failing, retiring ------------------------------------------------------------------------

def applied_record(targets_, must_honour=False, details=None):
    patch = types.SimpleNamespace(name="demo", must_honour=lambda environ: must_honour)
    return decisions.PatchRecord(patch, framework.Decision(framework.APPLIED, "ok", targets_, details=details))


def test_the_state_snapshot_says_each_patchs_state_details_and_targets_applied():
    record = applied_record([targets.Wrap("m", "f", add_one, [()]), targets.Wrap("m", "g", add_one, [()])],
                            details={"released_mib": 1.5})
    record.applied = {"m:f"}
    runtime = activation.Runtime()
    assert runtime.state_snapshot() == {}
    runtime.records = {"demo": record}
    snapshot = runtime.state_snapshot()
    assert snapshot == {"demo": {"state": "applied", "reason": "ok", "details": {"released_mib": 1.5},
                                 "targets_applied": "1/2"}}
    assert snapshot["demo"]["details"] is not record.details


FAKE_A = "def f():\n    return 1\n\ndef g():\n    return 10\n\nLIMIT = 5\n"


@pytest.fixture
def fake_a(monkeypatch):
    """sglang.fake_a (f, g, LIMIT) imported, and a module that took a copy of its f."""
    module = fake_module("sglang.fake_a", FAKE_A)
    copy = types.ModuleType("sglang.fake_copy")
    copy.f = module.f
    monkeypatch.setitem(sys.modules, "sglang.fake_a", module)
    monkeypatch.setitem(sys.modules, "sglang.fake_copy", copy)
    return module, copy


def test_a_target_that_does_not_match_reverts_its_whole_patch_and_says_so_at_once(logged, fake_a, monkeypatch):
    """A patch applied in one module fails in the next: reverted everywhere, its failed line said
    (no summary line is still to come)."""
    module, copy = fake_a
    other = fake_module("sglang.fake_b", "def g(x):\n    return x\n")
    writes = []
    monkeypatch.setattr(metrics, "publish", lambda: writes.append(record.state))
    record = applied_record([targets.Wrap("sglang.fake_a", "f", add_one, [()]),
                             targets.Wrap("sglang.fake_b", "g", add_one, [()])])
    runtime = activation.Runtime()
    runtime.records = {"demo": record}
    runtime.apply_module(module)
    assert module.f() == 2 and record.applied == {"sglang.fake_a:f"}
    runtime.apply_module(other)
    reason = ("while patching sglang.fake_b: sglang.fake_b:g has signature (x), known: () "
              "(loaded code differs from its source)")
    assert (record.state, record.reason) == (framework.FAILED, reason)
    assert module.f() == 1 and other.g(3) == 3 and record.applied == set() and record.changes == []
    assert logged() == [("ERROR", "demo: failed (%s)" % reason)]
    assert writes == ["applied", "failed", "failed"]  # module a applied, the failure, module b done


def test_a_failure_while_the_summary_line_is_due_is_left_to_it_and_strict_mode_says_it_first(
        logged, fake_a, monkeypatch):
    module, _ = fake_a
    said = []
    monkeypatch.setattr(summary, "report_all", said.append)
    record = applied_record([targets.Wrap("sglang.fake_a", "g", add_one, [("x",)])])
    runtime = activation.Runtime()
    runtime.records, runtime.summary_due = {"demo": record}, os.getpid()
    runtime.apply_module(module)
    assert record.state == framework.FAILED and logged() == [] and said == []
    record.state = framework.APPLIED
    monkeypatch.setenv("NPU_SHIM_STRICT", "1")
    with pytest.raises(framework.ShimError, match=r"^npu-shim \(strict\): demo is failed: while patching "):
        runtime.apply_module(module)
    assert said == [runtime.records]


# -- hooks and reloads that fail -------------------------------------------------------------------------

def test_a_hook_that_raised_is_logged_once_per_module_and_raised_in_strict_mode(logged, monkeypatch):
    runtime = activation.Runtime()
    runtime.records, runtime.installed = {}, True
    runtime.apply_module = boom
    hook = runtime.import_hook(runtime.generation)
    for name in ("sglang.fake_a", "sglang.fake_a", "sglang.fake_b"):
        hook(types.ModuleType(name))
    assert logged() == [("ERROR", "hook on sglang.fake_a failed: RuntimeError('boom')"),
                        ("ERROR", "hook on sglang.fake_b failed: RuntimeError('boom')")]
    monkeypatch.setenv("NPU_SHIM_STRICT", "1")
    with pytest.raises(framework.ShimError, match=r"^npu-shim hook on sglang\.fake_a failed: RuntimeError\('boom'\)$"):
        hook(types.ModuleType("sglang.fake_a"))


def test_a_reload_of_a_module_is_patched_again_and_the_copies_keep_what_they_took(fake_a):
    module, copy = fake_a
    runtime = activation.Runtime()
    runtime.imported_before = {"sglang.fake_a"}
    runtime.reapply_after_reload(module)  # nothing decided: nothing to do
    assert module.f() == 1
    runtime.records = {"demo": applied_record([targets.Wrap("sglang.fake_a", "f", add_one, [()])])}
    runtime.reapply_after_reload(module)
    assert module.f() == 2 and copy.f() == 1


def test_a_reload_whose_patching_raised_is_logged_once_per_module_and_a_requested_patch_stops(
        logged, fake_a):
    module, _ = fake_a
    runtime = activation.Runtime()
    runtime.records = {}
    runtime.apply_module = boom
    for name in ("sglang.fake_a", "sglang.fake_a", "sglang.fake_b"):
        runtime.reapply_after_reload(types.ModuleType(name))
    assert logged() == [("ERROR", "re-applying after reload of sglang.fake_a failed: RuntimeError('boom')"),
                        ("ERROR", "re-applying after reload of sglang.fake_b failed: RuntimeError('boom')")]
    requested = activation.Runtime()
    requested.records = {"demo": applied_record([targets.Wrap("sglang.fake_a", "f", add_one, [("x",)])],
                                                must_honour=True)}
    with pytest.raises(framework.ShimError, match=r"^npu-shim: demo was requested but is failed: while patching "
                                                 r"sglang\.fake_a: "):
        requested.reapply_after_reload(module)


def test_importlib_reload_through_the_finder_patches_the_new_code(monkeypatch, tmp_path):
    import importlib

    (tmp_path / "shim_reload_demo.py").write_text("def f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "shim_reload_demo", raising=False)
    module = importlib.import_module("shim_reload_demo")
    monkeypatch.setitem(sys.modules, "shim_reload_demo", module)
    runtime = activation.Runtime()
    runtime.records = {"demo": applied_record([targets.Wrap("shim_reload_demo", "f", add_one, [()])])}
    runtime.hooked = {"shim_reload_demo"}
    runtime.apply_module(module)
    (tmp_path / "shim_reload_demo.py").write_text("def f():\n    return 10\n")
    importlib.invalidate_caches()
    from npu_shim import _bootstrap

    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(_bootstrap, "_saw_sglang", False)
    monkeypatch.setattr(_bootstrap, "_hand_on_to", None)
    runtime.finder.install(_bootstrap.WATCHER)
    try:
        importlib.reload(module)
    finally:
        runtime.finder.uninstall(_bootstrap.WATCHER)
    assert module.f() == 11


def test_a_child_forked_while_another_thread_holds_the_runtimes_lock_reloads(fake_a):
    """The runtime's lock is made anew in a forked child: the thread that held it in the parent
    (inside an import hook) is not there to release it (a reload waited for ever)."""
    from test_finder import in_a_child_forked_while_held

    module, _ = fake_a
    runtime = activation.Runtime()
    runtime.records = {"demo": applied_record([targets.Wrap("sglang.fake_a", "f", add_one, [()])])}

    def check():
        runtime.reapply_after_reload(module)
        return module.f() == 2

    assert in_a_child_forked_while_held(runtime.lock, check) == 0
    assert module.f() == 1  # the parent's module: the child's change is the child's


def test_after_a_fork_the_runtime_takes_a_new_lock_and_reloads_while_the_old_one_is_held(fake_a):
    """What the fork handler runs in the child, here in this process: ``forked`` gives the runtime a
    lock of its own, free while another thread still holds the one it had, so a reload is patched."""
    from test_finder import held_by_another_thread

    module, _ = fake_a
    runtime = activation.Runtime()
    runtime.records = {"demo": applied_record([targets.Wrap("sglang.fake_a", "f", add_one, [()])])}
    with held_by_another_thread(runtime.lock):
        runtime.forked()
        assert runtime.lock.acquire(timeout=10)
        runtime.lock.release()
        runtime.reapply_after_reload(module)
        assert module.f() == 2
    runtime.uninstall(Watcher())
    assert module.f() == 1


def reload_in_place(module, source):
    """What importlib.reload does to a module: its code run again in the same module object."""
    exec(source, module.__dict__)


def test_reloads_keep_one_change_per_target_and_none_of_the_old_code_alive(fake_a):
    """36 reloads grew the kept changes from 3 to 111, each holding an old f and g alive.  A
    reload's changes take over from the old code's: the old original lives only while a copy of
    its wrapper does (sglang.fake_copy's, taken before the reload), which uninstall() restores."""
    import gc
    import weakref

    module, copy = fake_a
    record = applied_record([targets.Wrap("sglang.fake_a", "f", add_one, [()]),
                             targets.Wrap("sglang.fake_a", "g", add_one, [()]),
                             targets.Replace("sglang.fake_a", "LIMIT", lambda limit: limit + 1)])
    runtime = activation.Runtime()
    runtime.records, runtime.imported_before = {"demo": record}, {"sglang.fake_a"}
    first = module.f
    runtime.apply_module(module)
    assert copy.f() == 2 and copy.f.__wrapped__ is first
    olds = []
    for _ in range(36):
        reload_in_place(module, FAKE_A)
        olds.append((weakref.ref(module.f), weakref.ref(module.g)))
        runtime.reapply_after_reload(module)
        assert (module.f(), module.g(), module.LIMIT) == (2, 11, 6)
    gc.collect()
    assert [c.what for c in record.changes] == ["sglang.fake_a:f", "sglang.fake_a:g", "sglang.fake_a:LIMIT"]
    assert [entry.what for entry in record.replaced] == ["sglang.fake_a:f"]  # the copy's wrapper
    assert [(f() is None, g() is None) for f, g in olds] == [(True, True)] * 35 + [(False, False)]
    assert copy.f() == 2  # the copy keeps what it took, as after any reload
    runtime.uninstall(Watcher())
    assert module.f is olds[-1][0]() and module.g is olds[-1][1]() and module.LIMIT == 5
    assert copy.f is first and record.replaced == []


RELOADED_CLASS = "class Box:\n    def get(self):\n        return 1\n"


def test_a_reloaded_class_is_restored_while_it_lives_and_kept_by_nothing(monkeypatch):
    """A method's change of the old code holds its class weakly: an instance of it that lives
    on gets the original back at uninstall(); once none does, nothing of it is kept."""
    import gc
    import weakref

    module = fake_module("sglang.fake_box", RELOADED_CLASS)
    monkeypatch.setitem(sys.modules, "sglang.fake_box", module)
    record = applied_record([targets.Wrap("sglang.fake_box", "Box.get", add_one, [()])])
    runtime = activation.Runtime()
    runtime.records = {"demo": record}
    runtime.apply_module(module)
    kept = module.Box()
    classes = [weakref.ref(module.Box)]
    for _ in range(5):
        reload_in_place(module, RELOADED_CLASS)
        classes.append(weakref.ref(module.Box))
        runtime.reapply_after_reload(module)
    gc.collect()
    assert [c() is None for c in classes] == [False] + [True] * 4 + [False]
    assert [entry.alive() for entry in record.replaced] == [True] + [False] * 4
    # a class outlives its module's reload until the collector runs: its entry goes at the next
    reload_in_place(module, RELOADED_CLASS)
    runtime.reapply_after_reload(module)
    assert len(record.changes) == 1 and len(record.replaced) == 2
    assert kept.get() == 2 and module.Box().get() == 2
    runtime.uninstall(Watcher())
    assert kept.get() == 1 and module.Box().get() == 1


def test_code_changed_twice_without_a_reload_is_undone_twice():
    """A change that wraps one of the same target's (no reload between: its original is the old
    replacement) does not take over from it: both stay, and uninstall() undoes both."""
    module = fake_module("sglang.fake_twice", "def f():\n    return 1\n")
    original = module.f
    record = applied_record([targets.Wrap("sglang.fake_twice", "f", add_one, [()])])
    runtime = activation.Runtime()
    runtime.records = {"demo": record}
    runtime.apply_module(module)
    runtime.apply_module(module)
    assert module.f() == 3 and len(record.changes) == 2 and record.replaced == []
    runtime.uninstall(Watcher())
    assert module.f is original


def test_reloads_of_the_schedulers_module_keep_one_change_of_the_shims_own(undecided, monkeypatch):
    undecided.decide_all()
    scheduler = fake_module(role.MODULE, SCHEDULER)
    monkeypatch.setitem(sys.modules, role.MODULE, scheduler)
    undecided.apply_module(scheduler)
    for _ in range(10):
        reload_in_place(scheduler, SCHEDULER)
        undecided.reapply_after_reload(scheduler)
    assert len(undecided.own_changes) == 1 and undecided.own_replaced == []
    assert scheduler.run_scheduler_process.__wrapped__ is not None
    reloaded = scheduler.run_scheduler_process.__wrapped__
    undecided.uninstall(Watcher())
    assert scheduler.run_scheduler_process is reloaded


def test_reloaded_code_that_sets_the_replaced_literal_itself_keeps_one_change(monkeypatch):
    """``use_deepep = True`` replaced by True, the module's new code setting True too: the same
    object, but no sign of code changed twice (a literal): the reload's change takes over."""
    source = "FLAG = True\n"
    module = fake_module("sglang.fake_flag", source)
    record = applied_record([targets.Replace("sglang.fake_flag", "FLAG", lambda original: True)])
    runtime = activation.Runtime()
    runtime.records = {"demo": record}
    runtime.apply_module(module)
    for _ in range(10):
        reload_in_place(module, source)
        runtime.reapply_after_reload(module)
    assert len(record.changes) == 1 and record.replaced == [] and module.FLAG is True
