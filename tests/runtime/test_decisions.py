"""npu_shim/runtime/decisions.py: what a record keeps of its decision, the lines a process says
about invalid and unknown variables, enforcing, undoing a record, deciding every patch and the
guarded publishing steps -- in this process, each with patches and records of the test's own."""
from __future__ import annotations

import logging
import os
import sys
import types

import pytest

from npu_shim.core import config, framework
from npu_shim.reporting import log
from npu_shim.runtime import decisions, targets
from test_framework import declare


@pytest.fixture
def logged(caplog, monkeypatch):
    """The shim's log lines of this test, [(level, message)]: nothing reported before counts as said
    (a fresh ``error_once`` memory), every ``NPU_SHIM_*`` variable unset to begin with."""
    for name in [n for n in os.environ if n.startswith("NPU_SHIM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(log, "_reported", set())
    log.configure()  # sets the logger's level once per process: before caplog lowers it
    caplog.set_level(logging.DEBUG, logger=log.LOGGER_NAME)
    return lambda: [(r.levelname, r.getMessage()) for r in caplog.records if r.name == log.LOGGER_NAME]


def record_of(state, reason="because", patch=None, **decision):
    patch = patch or types.SimpleNamespace(name="p", must_honour=lambda environ: False)
    return decisions.PatchRecord(patch, framework.Decision(state, reason, **decision))


# -- a record ---------------------------------------------------------------------------------------------

def test_a_record_keeps_what_its_decision_handed_out_and_has_applied_nothing_yet():
    """The details and the process state are the very objects the patch's wrappers were handed
    (ctx.details, ctx.process_state): what they write later is what the record says."""
    details, shared = {"released_mib": 0}, object()
    wrap = targets.Wrap("sglang.srt.a", "f", lambda *a: None, [()])
    record = record_of(framework.APPLIED, "ok", targets=[wrap], details=details, process_state=shared)
    assert (record.state, record.reason, record.targets) == (framework.APPLIED, "ok", [wrap])
    assert record.details is details and record.process_state is shared
    assert (record.changes, record.applied) == ([], set())


# -- strict mode and the variables' lines ------------------------------------------------------------------

STRICT_INVALID = ("NPU_SHIM_STRICT='maybe' is invalid: expected a boolean: one of 1/0, true/false, yes/no, "
                  "on/off")


def test_an_invalid_strict_mode_is_off_and_said_once(logged, monkeypatch):
    monkeypatch.setenv("NPU_SHIM_STRICT", "maybe")
    assert decisions.strict() is False
    assert decisions.strict() is False
    assert logged() == [("ERROR", STRICT_INVALID + " (strict mode off)")]
    monkeypatch.setenv("NPU_SHIM_STRICT", "1")
    assert decisions.strict() is True


def test_an_invalid_strict_mode_is_said_once_at_activation_as_strict_mode_off(logged, monkeypatch):
    """``report_invalid_variables`` reads strict mode like every shim variable: its line is the one
    ``strict()`` says, never a second ``(ignored)`` one."""
    monkeypatch.setenv("NPU_SHIM_STRICT", "maybe")
    patch = declare()()
    decisions.report_invalid_variables(decisions.decide_each([patch], None, None, None), [patch])
    assert logged() == [("ERROR", STRICT_INVALID + " (strict mode off)")]


EXTRA = config.boolean("NPU_SHIM_DEMO_EXTRA", False, "a variable the demo patch reads")


def test_invalid_variables_no_failed_line_said_are_each_said_once_as_ignored(logged, monkeypatch):
    """A switched-off patch never reads its other variables, so no line of it names one; the shim's
    own (NPU_SHIM_ACTIVATE) is read by nothing at activation: both are said here, once each."""
    monkeypatch.setenv("NPU_SHIM_DEMO", "0")
    monkeypatch.setenv("NPU_SHIM_DEMO_EXTRA", "maybe")
    monkeypatch.setenv("NPU_SHIM_ACTIVATE", "perhaps")
    patch = declare(reads=(EXTRA,))()
    records = decisions.decide_each([patch], None, None, None)
    assert (records["demo"].state, records["demo"].reason) == (framework.DISABLED, "NPU_SHIM_DEMO=0")
    decisions.report_invalid_variables(records, [patch])
    decisions.report_invalid_variables(records, [patch])  # a second activation says nothing new
    assert logged() == [
        ("ERROR", "NPU_SHIM_ACTIVATE='perhaps' is invalid: expected a boolean: one of 1/0, true/false, yes/no, "
                  "on/off (ignored)"),
        ("ERROR", "NPU_SHIM_DEMO_EXTRA='maybe' is invalid: expected a boolean: one of 1/0, true/false, yes/no, "
                  "on/off (ignored)")]


def test_a_variable_the_failed_line_names_already_is_not_said_again(logged, monkeypatch):
    monkeypatch.setenv("NPU_SHIM_DEMO_EXTRA", "maybe")
    patch = declare(reads=(EXTRA,))()
    records = decisions.decide_each([patch], None, None, None)
    assert records["demo"].state == framework.FAILED
    assert records["demo"].reason == ("NPU_SHIM_DEMO_EXTRA='maybe' is invalid: expected a boolean: one of 1/0, "
                                      "true/false, yes/no, on/off")
    decisions.report_invalid_variables(records, [patch])
    assert logged() == []


def test_unknown_npu_shim_names_are_each_warned_once_with_the_name_they_may_mean(logged, monkeypatch):
    """The patches' own variables are known (NPU_SHIM_DEMO is the demo's switch), a typo of one
    names it, a name like none of them is only said to be ignored."""
    monkeypatch.setenv("NPU_SHIM_DEMO", "1")
    monkeypatch.setenv("NPU_SHIM_DEMOO", "1")
    monkeypatch.setenv("NPU_SHIM_QWXZKJVBQWXZKJVB", "1")
    patch = declare()()
    records = decisions.decide_each([patch], None, None, None)
    decisions.report_invalid_variables(records, [patch])
    decisions.report_invalid_variables(records, [patch])
    assert logged() == [
        ("WARNING", "NPU_SHIM_DEMOO is not a variable npu-shim reads (ignored); did you mean NPU_SHIM_DEMO?"),
        ("WARNING", "NPU_SHIM_QWXZKJVBQWXZKJVB is not a variable npu-shim reads (ignored)")]


# -- enforcing --------------------------------------------------------------------------------------------

class DemoError(framework.ShimError):
    """A patch's own error (``Patch.error``): what its process raises when it cannot honour it."""


def test_a_requested_patch_raises_its_own_error_asked_with_the_process_environment(monkeypatch):
    asked = []

    def must_honour(self, environ):
        asked.append(environ)
        return environ.get("NPU_SHIM_DEMO") == "1"

    patch = declare(must_honour=must_honour, error=DemoError)()
    monkeypatch.delenv("NPU_SHIM_STRICT", raising=False)
    monkeypatch.setenv("NPU_SHIM_DEMO", "1")
    with pytest.raises(DemoError, match=r"^npu-shim: demo was requested but is failed: because$"):
        decisions.enforce(record_of(framework.FAILED, patch=patch))
    assert asked == [os.environ]
    monkeypatch.delenv("NPU_SHIM_DEMO")
    decisions.enforce(record_of(framework.UNSUPPORTED, patch=patch))  # not asked for: logged only


# -- undoing a record --------------------------------------------------------------------------------------

class Change:
    def __init__(self, what, undone):
        self.what, self.undone = what, undone

    def revert(self):
        self.undone.append(self.what)


def test_reverting_a_record_undoes_its_changes_last_first_and_forgets_what_was_applied():
    undone = []
    record = record_of(framework.APPLIED, details={"released_mib": 2})
    record.changes = [Change("m:f", undone), Change("m:h", undone)]
    record.applied = {"m:f", "m:h"}
    record.replaced = [Change("m:f before a reload", undone), Change("m:h before a reload", undone)]
    decisions.revert_record(record)
    # the old code's changes after the new code's
    assert undone == ["m:h", "m:f", "m:h before a reload", "m:f before a reload"]
    assert (record.changes, record.applied, record.replaced) == ([], set(), [])
    assert record.details == {"released_mib": 2}
    assert record.as_dict()["wrappers"] == []


# -- the changes of code loaded again ---------------------------------------------------------------------

def _module(name, **names):
    module = types.ModuleType(name)
    module.__dict__.update(names)
    return module


def test_a_replaced_value_in_the_module_the_new_change_holds_has_nothing_left_to_put_back():
    """``use_deepep = True`` in a reloaded module: the reload set the name, the new change holds it."""
    module = _module("sglang.fake_v", FLAG=False)
    old = targets.Change(module, "FLAG", False, True, rebind_copies=False, what="m:FLAG")
    new = targets.Change(module, "FLAG", False, True, rebind_copies=False, what="m:FLAG")
    staying, replaced = decisions.take_over([old], [], [new])
    assert staying == [] and len(replaced) == 1 and decisions.pruned(replaced) == []


@pytest.mark.parametrize("original", [{"a": 1}, None], ids=["a dict", "None"])
def test_a_replaced_value_in_another_owner_is_put_back_while_that_owner_lives(original):
    """A dict (no weak reference) set on the class of the old code: put back at uninstall() while
    that class lives, held no longer than it -- a dict, and None (a replacement without
    ``__wrapped__`` is no wrapper of it)."""
    import gc

    class Old:
        TABLE = original

    table = {"b": 2}
    old = targets.Change(Old, "TABLE", original, table, what="m:Old.TABLE")
    old.apply(False)
    new = targets.Change(type("New", (), {}), "TABLE", original, table, what="m:Old.TABLE")
    staying, replaced = decisions.take_over([old], [], [new])
    del old
    assert staying == [] and decisions.pruned(replaced) == replaced
    replaced[0].revert()
    assert Old.TABLE is original
    del Old
    gc.collect()
    assert decisions.pruned(replaced) == []
    replaced[0].revert()  # nothing left: nothing done


def _a_purge_left_a_wrapped_module_whose_wrapper_a_third_module_copied(monkeypatch):
    """(f, the old module object, its wrapper, the module holding a copy of the wrapper, what
    take_over returned) after a purge and a new import of ``sglang.fake_old``."""
    def f():
        return 1

    old_module = _module("sglang.fake_old", f=f)
    wrapper = targets.function_wrapper(f, lambda wrapped, instance, args, kwargs: wrapped() + 1)
    old = targets.Change(old_module, "f", f, wrapper, what="m:f")
    old.apply(False)
    holder = _module("sglang.fake_holder", f=wrapper)
    monkeypatch.setitem(sys.modules, holder.__name__, holder)
    new_module = _module("sglang.fake_old", f=lambda: 1)
    new = targets.Change(new_module, "f", new_module.f, object(), what="m:f")
    return f, old_module, wrapper, holder, decisions.take_over([old], [], [new])


def test_the_copies_of_a_replaced_wrapper_are_put_back_once_its_module_object_is_gone(monkeypatch):
    """A purge left the old module object, whose wrapper a third module copied: the old module
    gone, the copy still gets the original back."""
    import gc

    f, old_module, wrapper, holder, (staying, replaced) = (
        _a_purge_left_a_wrapped_module_whose_wrapper_a_third_module_copied(monkeypatch))
    del old_module, wrapper
    gc.collect()
    assert decisions.pruned(replaced) == replaced and holder.f() == 2
    replaced[0].revert()
    assert holder.f is f
    del holder.f
    gc.collect()
    assert decisions.pruned(replaced) == []  # the wrapper gone with its last copy


def test_a_replaced_wrapper_in_a_module_object_that_lives_on_is_put_back_there_and_in_its_copies(monkeypatch):
    """A purge left the old module object, which something still holds, and a third module copied its
    wrapper: both get the original back."""
    import gc

    f, old_module, wrapper, holder, (staying, replaced) = (
        _a_purge_left_a_wrapped_module_whose_wrapper_a_third_module_copied(monkeypatch))
    del wrapper
    gc.collect()
    assert staying == [] and decisions.pruned(replaced) == replaced
    assert old_module.f() == holder.f() == 2
    replaced[0].revert()
    assert old_module.f is f and holder.f is f


def test_a_replaced_shared_value_in_a_module_object_that_lives_on_is_put_back_there_alone(monkeypatch):
    """A value replaced in place only (``rebind_copies`` off: a dict other code holds too), in the old
    module object a purge left: put back there, and another module that holds the same dict keeps it."""
    original, shared = {"mode": "sglang's"}, {"mode": "the shim's"}
    old_module = _module("sglang.fake_cfg", CONFIG=original)
    old = targets.Change(old_module, "CONFIG", original, shared, rebind_copies=False, what="m:CONFIG")
    old.apply(False)
    other = _module("sglang.fake_other", CONFIG=shared)
    monkeypatch.setitem(sys.modules, other.__name__, other)
    new_module = _module("sglang.fake_cfg", CONFIG={"mode": "sglang's"})
    new = targets.Change(new_module, "CONFIG", new_module.CONFIG, shared, rebind_copies=False, what="m:CONFIG")
    staying, replaced = decisions.take_over([old], [], [new])
    assert staying == [] and decisions.pruned(replaced) == replaced
    replaced[0].revert()
    assert old_module.CONFIG is original and other.CONFIG is shared


def test_a_replaced_wrapper_of_a_method_that_uses_super_keeps_nothing_of_the_old_class_alive():
    """A reload's class took over from the old one, whose method (calling ``super()``: its code holds
    its class) is wrapped.  What is still to put back holds the old class and the wrapper weakly and
    the original only through the wrapper: once nothing else holds the old class it is collected,
    and nothing is left to put back (held strongly, the original kept its class, and so itself, alive
    for ever: one class more each reload)."""
    import gc
    import weakref

    def load():
        class Base:
            def get(self):
                return 1

        class Box(Base):
            def get(self):
                return super().get()

        return Box

    Old = load()
    original = Old.__dict__["get"]
    wrapper = targets.function_wrapper(original, lambda wrapped, instance, args, kwargs: wrapped(*args) + 1)
    old = targets.Change(Old, "get", original, wrapper, what="m:Box.get")
    old.apply(False)
    assert Old().get() == 2
    New = load()
    new = targets.Change(New, "get", New.__dict__["get"], object(), what="m:Box.get")
    staying, replaced = decisions.take_over([old], [], [new])
    assert staying == [] and decisions.pruned(replaced) == replaced  # the old class lives
    old_class = weakref.ref(Old)
    del old, Old, original, wrapper
    gc.collect()
    assert old_class() is None and decisions.pruned(replaced) == []


# -- deciding every patch -----------------------------------------------------------------------------------

def test_a_patch_whose_deciding_raised_is_failed_and_the_others_are_decided(monkeypatch):
    monkeypatch.delenv("NPU_SHIM_DEMO", raising=False)

    def probe(self, view):
        raise RuntimeError("probe bug")

    broken = declare(name="broken", switch=config.switch("broken", "test switch"), probe=probe)()
    fine = declare(probe=lambda self, view: "it is there")()
    view = types.SimpleNamespace(version="0.5.9")
    records = decisions.decide_each([broken, fine], view, None, None)
    assert list(records) == ["broken", "demo"]
    assert (records["broken"].state, records["broken"].reason) == (
        framework.FAILED, "deciding raised RuntimeError('probe bug')")
    assert records["broken"].patch is broken and records["broken"].targets == []
    assert (records["demo"].state, records["demo"].reason) == (framework.UPSTREAM, "sglang 0.5.9 has it: it is there")
    without = decisions.decide_each([broken, fine], view, None, "wrapt is not available: test")
    assert without["broken"].reason == "deciding raised RuntimeError('probe bug')"
    assert without["demo"].state == framework.UPSTREAM  # only a patch that would apply fails without wrapt


# -- the walk goes one way ------------------------------------------------------------------------------

def test_nothing_here_calls_back_what_the_runtime_handed_it():
    """From activation to a wrapper the walk goes one way: decisions.py calls no function it was
    handed (a step, a view maker: the runtime's own methods, so deciding went back and forth
    between the two modules five times) and imports nothing of activation."""
    import ast

    with open(decisions.__file__, encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    called_back = []
    for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.Lambda))]:
        handed = {a.arg for a in function.args.args + function.args.kwonlyargs}
        called_back += ["%s(%s)" % (getattr(function, "name", "lambda"), call.func.id)
                        for call in ast.walk(function) if isinstance(call, ast.Call)
                        and isinstance(call.func, ast.Name) and call.func.id in handed]
    assert called_back == []
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names} | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any("activation" in (name or "") for name in imported)
    assert not hasattr(decisions, "published")  # the guard of the runtime's own steps is the runtime's


def test_the_version_is_noted_only_where_there_is_a_view(monkeypatch):
    from npu_shim.reporting import procinfo

    monkeypatch.setattr(procinfo, "_sglang_version", "before")
    decisions.note_version(None)
    assert procinfo.sglang_version() == "before"
    decisions.note_version(types.SimpleNamespace(version="0.5.9"))
    assert procinfo.sglang_version() == "0.5.9"


def test_a_view_is_read_only_where_there_is_a_directory_and_from_the_source_itself(monkeypatch, tmp_path):
    """Whatever the environment holds: a child decides from the source as its parent does (the
    record a parent once handed its children, NPU_SHIM_SOURCE_ANSWERS, is not read)."""
    from npu_shim.source.codeview import SourceView

    (tmp_path / "version.py").write_text('__version__ = "0.5.9"\n')
    monkeypatch.setenv("NPU_SHIM_SOURCE_ANSWERS", '{"format": 2, "dir": "%s", "version": "9.9.9"}' % tmp_path)
    assert decisions.view_of(None) is None and decisions.view_of("") is None
    view = decisions.view_of(str(tmp_path))
    assert type(view) is SourceView and view.package_dir == str(tmp_path) and view.version == "0.5.9"
