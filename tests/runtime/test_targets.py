"""npu_shim/runtime/targets.py: what a Wrap / Replace says about the source before anything changes.

A target that the source lacks must make the *decision* ``unsupported``, with the target named:
nothing may read ``applied`` and only learn at apply time (in a server process, when the hook
fires) that there was nothing to wrap.  Applying, reverting and pickling the wrappers are covered
in process by tests/runtime/test_reliability.py and in fresh interpreters by tests/test_bootstrap.py.
"""
from __future__ import annotations

import types

import pytest

from npu_shim.core import config, framework
from npu_shim.runtime import targets


class View:
    """A stand-in SourceView: ``functions`` {(module, qualname): (params, fingerprint)}; a module
    exists when it has a function or is in ``names``; ``names`` {(module, name)} answers ``has``."""

    version = "0.5.9"

    def __init__(self, functions=(), names=()):
        self.functions = {key: types.SimpleNamespace(params=tuple(params), fingerprint=fp)
                          for key, (params, fp) in dict(functions).items()}
        self.names = set(names) | set(self.functions)

    def function(self, dotted, qualname):
        return self.functions.get((dotted, qualname))

    def module(self, dotted):
        if any(d == dotted for d, _ in self.names):
            return types.SimpleNamespace(contains=lambda pattern: pattern == "present")
        return None

    def has(self, dotted, qualname):
        return (dotted, qualname) in self.names


A = "sglang.srt.a"
VIEW = View(functions={(A, "f"): ((), "fp-f"), (A, "Cls.method"): (("x",), "fp-m")},
            names={(A, "NAME")})


def patch_with(*target_list):
    """An instance of a complete Patch whose targets are ``target_list``."""
    attrs = dict(
        name="demo", title="a test patch", upstream_pr="sgl-project/sglang#1",
        upstream_release="0.5.20", backport_range=("0.5.7", "0.5.19"), remove_when="never",
        switch=config.switch("demo", "test switch"), modules=(A, "sglang.srt.b"),
        probe=lambda self, view: None, targets=lambda self, view, ctx: list(target_list),
        needs_npu=False)
    return type("DemoPatch", (framework.Patch,), attrs)()


def wrap(qualname, signatures=((),), **checks):
    return targets.Wrap(A, qualname, lambda *a: None, signatures, **checks)


# -- "not found" is said when deciding, in the target's own words --------------------------------------

@pytest.mark.parametrize("target, reason", [
    (wrap("missing"), "sglang.srt.a:missing not found"),
    (wrap("Cls.gone", [("x",)]), "sglang.srt.a:Cls.gone not found"),
    (targets.Wrap("sglang.srt.b", "f", None, [()]), "sglang.srt.b:f not found"),
    (targets.Replace(A, "ABSENT", lambda original: 1), "sglang.srt.a:ABSENT not found"),
    (targets.Replace("sglang.srt.b", "NAME", lambda original: 1, must_exist=False),
     "module sglang.srt.b not found"),
    (wrap("f", pins={(A, "helper"): {"fp-h": "0.5.9"}}), "sglang.srt.a:helper not found"),
    (wrap("f", source_has=[("absent", "the branch it needs")]),
     "sglang.srt.a:f: the branch it needs not found in the source"),
])
def test_a_target_the_source_lacks_is_unsupported_when_decided(target, reason):
    assert target.check_source(VIEW) == reason
    decision = framework.decide(patch_with(wrap("f"), target), VIEW, environ={})
    assert (decision.state, decision.reason) == (framework.UNSUPPORTED, reason)
    assert decision.targets == []  # nothing for the runtime to apply


def test_every_missing_target_is_named_in_one_reason():
    decision = framework.decide(patch_with(wrap("missing"), wrap("f"), wrap("also_missing")), VIEW,
                                environ={})
    assert decision.state == framework.UNSUPPORTED
    assert decision.reason == "sglang.srt.a:missing not found; sglang.srt.a:also_missing not found"


def test_targets_the_source_has_apply():
    present = [wrap("f", pins={(A, "f"): {"fp-f": "0.5.9"}}), wrap("Cls.method", [("x",)]),
               targets.Replace(A, "NAME", lambda original: 1),
               targets.Replace(A, "NOT_YET_THERE", lambda original: 1, must_exist=False),
               wrap("f", source_has=[("present", "what it needs")])]
    assert [t.check_source(VIEW) for t in present] == [None] * len(present)
    decision = framework.decide(patch_with(*present), VIEW, environ={})
    assert decision.state == framework.APPLIED and decision.targets == present


def test_code_that_differs_is_named_with_its_fingerprint():
    own = wrap("f", pins={(A, "f"): {"fp-old": "0.5.8"}})
    relied = wrap("f", pins={(A, "Cls.method"): {"fp-old": "0.5.8"}})
    assert own.check_source(VIEW) == ("sglang.srt.a:f differs from the code the shim stands in for "
                                      "(source fingerprint fp-f, known: fp-old (0.5.8))")
    assert relied.check_source(VIEW) == ("sglang.srt.a:Cls.method differs from the code the shim "
                                         "relies on (source fingerprint fp-m, known: fp-old (0.5.8))")
    assert wrap("f", [("y",), ("y", "z")]).check_source(VIEW) == (
        "sglang.srt.a:f has signature (), known: (y) or (y, z)")


def test_a_target_missing_from_the_loaded_module_is_a_lookup_error_naming_it():
    module = types.ModuleType(A)
    with pytest.raises(LookupError, match=r"^sglang\.srt\.a:f not found in the loaded module$"):
        wrap("f").prepare(module)
    with pytest.raises(LookupError, match=r"^sglang\.srt\.a:NAME not found in the loaded module$"):
        targets.Replace(A, "NAME", lambda original: 1).prepare(module)
    seen = []
    change = targets.Replace(A, "NAME", lambda original: seen.append(original) or 5,
                             must_exist=False).prepare(module)
    change.apply(imported_before=False)
    assert seen == [None] and module.NAME == 5
    change.revert()
    assert not hasattr(module, "NAME")


def test_the_wrappers_types_read_as_wrapts_and_live_in_the_shim():
    """What reports a wrapper's type (log lines, the tests of the patches) reads as wrapt's."""
    def passthrough(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs)

    class Box:
        def get(self):
            return 2

    def f():
        return 1

    wrapped = targets.function_wrapper(f, passthrough)
    Box.get = targets.function_wrapper(Box.__dict__["get"], passthrough)
    bound = Box().get
    assert (type(wrapped).__name__, type(bound).__name__) == ("FunctionWrapper", "BoundFunctionWrapper")
    assert type(wrapped).__module__ == type(bound).__module__ == "npu_shim.runtime.targets"
    assert wrapped() == 1 and bound() == 2


def test_copies_are_rebound_only_for_a_module_imported_before_the_shim(monkeypatch):
    """``late``: the module was imported before the shim, so other modules may hold copies of the
    original (``from m import f``); they are pointed at the wrapper, and back on revert.  A module
    just imported has none: nothing else is touched (a shared object stays as it is)."""
    import sys

    def f():
        return 1

    owner, holder = types.ModuleType("sglang.srt.a"), types.ModuleType("npu_shim_test_holder")
    owner.f = holder.f = holder.alias = f
    monkeypatch.setitem(sys.modules, owner.__name__, owner)
    monkeypatch.setitem(sys.modules, holder.__name__, holder)
    target = targets.Wrap(A, "f", lambda wrapped, instance, args, kwargs: wrapped() + 1, [()])

    change = target.prepare(owner)
    change.apply(imported_before=False)
    assert owner.f() == 2 and holder.f is f and holder.alias is f
    change.revert()
    assert owner.f is f

    change = target.prepare(owner)
    change.apply(imported_before=True)
    assert owner.f() == holder.f() == holder.alias() == 2 and holder.f is owner.f
    change.revert()
    assert owner.f is holder.f is holder.alias is f
