"""npu_shim/runtime/targets.py: what a Wrap / Replace says about the source before anything changes.

A target that the source lacks must make the *decision* ``unsupported``, with the target named:
nothing may read ``applied`` and only learn at apply time (in a server process, when the hook
fires) that there was nothing to wrap.  Then: what ``prepare`` checks in the loaded code, what
applying and reverting a Change touch, and the wrappers pickling and copying like functions
(end to end, in fresh interpreters: tests/runtime/test_reliability.py, tests/test_bootstrap.py).
"""
from __future__ import annotations

import copy
import pickle
import sys
import types

import pytest

from npu_shim.core import config, framework
from npu_shim.runtime import targets
from npu_shim.source.reading import live_fingerprint


@pytest.fixture(autouse=True)
def fresh_wrapper_classes(monkeypatch):
    """The wrapper classes are made on the first wrapper a process builds: each test makes them."""
    monkeypatch.setattr(targets, "_WRAPPER_CLASSES", [])


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
        name="demo", upstream=framework.Upstream("sgl-project/sglang#1", "0.5.20", ("0.5.7", "0.5.19")),
        switch=config.switch("demo", "test switch"), modules=(A, "sglang.srt.b"),
        probe=lambda self, view: None, targets=lambda self, view, ctx: list(target_list),
        trigger=lambda self, environ, on_npu: None)
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


def test_a_bound_method_or_a_builtin_called_through_the_wrapper_keeps_wrapts_binding():
    """The wrapper gets wrapt's binding: a bound method's ``__self__`` is the instance it is
    given; a builtin is wrapped too."""
    seen = []

    def record(wrapped, instance, args, kwargs):
        seen.append(instance)
        return wrapped(*args, **kwargs)

    class Box:
        def get(self, x):
            return x * 2

    box = Box()
    assert targets.function_wrapper(box.get, record)(4) == 8
    assert targets.function_wrapper(len, record)([1, 2]) == 2
    assert seen[0] is box and len(seen) == 2


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


# -- decided on the source: the words of a reason -------------------------------------------------

def test_every_known_fingerprint_and_parameter_is_listed():
    two = wrap("f", pins={(A, "f"): {"fp-a": "0.5.7", "fp-b": "0.5.8"}})
    assert two.check_source(VIEW) == ("sglang.srt.a:f differs from the code the shim stands in for "
                                      "(source fingerprint fp-f, known: fp-a (0.5.7), fp-b (0.5.8))")
    params = View(functions={(A, "g"): (("x", "y"), "fp-g")})
    assert wrap("g", [("x",)]).check_source(params) == "sglang.srt.a:g has signature (x, y), known: (x)"


def test_a_replace_checks_its_pins_and_source_patterns_too():
    assert targets.Replace(A, "NAME", lambda original: 1, pins={(A, "helper"): {"fp": "0.5.9"}}
                           ).check_source(VIEW) == "sglang.srt.a:helper not found"
    assert targets.Replace(A, "NAME", lambda original: 1, source_has=[("absent", "the flag")]
                           ).check_source(VIEW) == "sglang.srt.a:NAME: the flag not found in the source"


# -- prepared on the loaded module ----------------------------------------------------------------

def loaded_f(x):
    return x


class Loaded:
    def method(self, x):
        return x


def loaded_module(**names):
    module = types.ModuleType(A)
    module.__dict__.update(names)
    return module


def test_the_loaded_codes_own_pin_is_checked_and_named_with_its_fingerprint():
    fingerprint = live_fingerprint(loaded_f)
    module = loaded_module(f=loaded_f)
    change = wrap("f", [("x",)], pins={(A, "f"): {fingerprint: "0.5.9"}}).prepare(module)
    assert change.original is loaded_f
    with pytest.raises(LookupError) as info:
        wrap("f", [("x",)], pins={(A, "f"): {"fp-a": "0.5.7", "fp-b": "0.5.8"}}).prepare(module)
    assert str(info.value) == ("sglang.srt.a:f differs from the code the shim stands in for (loaded "
                               "fingerprint %s, known: fp-a (0.5.7), fp-b (0.5.8))" % fingerprint)
    replace = targets.Replace(A, "f", lambda original: original, pins={(A, "f"): {fingerprint: "0.5.9"}})
    assert replace.prepare(module).replacement is loaded_f
    with pytest.raises(LookupError, match=r"^sglang\.srt\.a:f differs from the code the shim stands in "
                                          r"for \(loaded fingerprint "):
        targets.Replace(A, "f", lambda original: original, pins={(A, "f"): {"fp-a": "0.5.7"}}).prepare(module)


def test_loaded_code_whose_source_cannot_be_read_is_a_lookup_error_naming_why():
    namespace = {}
    exec(compile("def f(x):\n    return x\n", "<generated>", "exec"), namespace)
    with pytest.raises(LookupError) as info:
        wrap("f", [("x",)], pins={(A, "f"): {"fp": "0.5.9"}}).prepare(loaded_module(f=namespace["f"]))
    assert str(info.value) == "sglang.srt.a:f: cannot read the loaded code (OSError('could not get source code'))"


def test_a_target_without_its_own_pin_applies_whatever_the_fingerprint():
    """Pins on other defs were checked on the source; only a pin on the target is read again."""
    change = wrap("f", [("x",)], pins={(A, "helper"): {"fp": "0.5.9"}}).prepare(loaded_module(f=loaded_f))
    assert change.original is loaded_f


def test_loaded_code_with_another_signature_is_a_lookup_error():
    with pytest.raises(LookupError) as info:
        wrap("f", [("y",)]).prepare(loaded_module(f=loaded_f))
    assert str(info.value) == ("sglang.srt.a:f has signature (x), known: (y) "
                               "(loaded code differs from its source)")


def test_a_methods_signature_leaves_self_out():
    change = wrap("Cls.method", [("x",)]).prepare(loaded_module(Cls=Loaded))
    assert (change.owner, change.attr, change.original) == (Loaded, "method", Loaded.__dict__["method"])


def test_requires_runs_when_prepared_and_its_error_stops_the_change():
    def requires():
        raise RuntimeError("the wrapper needs pkg, which is missing")

    module = loaded_module(f=loaded_f, NAME=1)
    for target in (wrap("f", [("x",)], requires=requires),
                   targets.Replace(A, "NAME", lambda original: 2, requires=requires)):
        with pytest.raises(RuntimeError, match="^the wrapper needs pkg, which is missing$"):
            target.prepare(module)
    assert module.f is loaded_f and module.NAME == 1


def test_a_replace_factory_gets_the_current_value_and_the_change_names_the_target():
    seen = []
    module = loaded_module(NAME=1)
    change = targets.Replace(A, "NAME", lambda original: seen.append(original) or 2).prepare(module)
    assert seen == [1] and (change.original, change.replacement) == (1, 2)


# -- applying and reverting -----------------------------------------------------------------------

@pytest.fixture
def holder(monkeypatch):
    """A module imported before the shim that holds copies (from-imports) of ``sglang.srt.a``'s names."""
    owner, holder = types.ModuleType(A), types.ModuleType("npu_shim_test_holder")
    monkeypatch.setitem(sys.modules, owner.__name__, owner)
    monkeypatch.setitem(sys.modules, holder.__name__, holder)
    return owner, holder


def test_a_replace_rebinds_copies_only_when_asked(holder):
    owner, copies = holder
    value = ["shared"]
    owner.NAME = copies.NAME = value
    change = targets.Replace(A, "NAME", lambda original: ["new"]).prepare(owner)
    change.apply(imported_before=True)
    assert owner.NAME == ["new"] and copies.NAME is value  # a shared value: replaced in place only
    change.revert()
    change = targets.Replace(A, "NAME", lambda original: ["new"], rebind_copies=True).prepare(owner)
    change.apply(imported_before=True)
    assert owner.NAME == copies.NAME == ["new"]
    change.revert()
    assert owner.NAME is copies.NAME is value


def test_a_class_attribute_is_replaced_in_the_class_only(holder):
    """Copies are rebound for a module's names: a method's function object held elsewhere (e.g.
    ``helper = Cls.method`` at module level) keeps the original."""
    owner, copies = holder

    class Cls:
        def method(self):
            return 1

    owner.Cls = Cls
    copies.helper = Cls.__dict__["method"]
    change = targets.Wrap(A, "Cls.method", lambda wrapped, instance, args, kwargs: 2, [()]).prepare(owner)
    change.apply(imported_before=True)
    assert Cls().method() == 2 and copies.helper is change.original
    change.revert()
    change = targets.Replace(A, "Cls.method", lambda original: "other", rebind_copies=True).prepare(owner)
    change.apply(imported_before=True)
    assert Cls.method == "other" and copies.helper is change.original
    change.revert()
    assert Cls.__dict__["method"] is copies.helper


def test_the_owner_module_changes_in_the_targets_name_only(holder):
    """Copies are looked for outside the owner: another name the owner binds to the same function
    keeps what it had, on apply and on revert."""
    owner, copies = holder

    def f():
        return 1

    owner.f = owner.alias = copies.f = f
    change = targets.Wrap(A, "f", lambda wrapped, instance, args, kwargs: 2, [()]).prepare(owner)
    change.apply(imported_before=True)
    assert owner.f() == copies.f() == 2 and owner.alias is f
    owner.later = owner.f  # the owner takes the wrapper under another name
    change.revert()
    assert owner.f is copies.f is f and owner.later is change.replacement


def test_modules_without_a_dict_namespace_are_passed_over(holder, monkeypatch):
    owner, _ = holder

    def f():
        return 1

    class NamespaceIsAMappingProxy:
        g = f

    owner.f = f
    monkeypatch.setitem(sys.modules, "npu_shim_test_no_dict", 42)
    monkeypatch.setitem(sys.modules, "npu_shim_test_class", NamespaceIsAMappingProxy)
    change = targets.Wrap(A, "f", lambda wrapped, instance, args, kwargs: 2, [()]).prepare(owner)
    change.apply(imported_before=True)
    assert owner.f() == 2 and NamespaceIsAMappingProxy.__dict__["g"] is f
    change.revert()
    assert owner.f is f


def test_rebinding_changes_the_copies_of_the_original_and_no_other_name():
    """``rebind`` goes through every module in sys.modules: it points the names that hold the
    original at the replacement, in every module but the one skipped, and leaves every other
    name as it was.  While it runs, sys.modules holds only this test's modules, so that whatever
    else it changed shows here (and nothing else of this process is touched)."""
    def f():
        return 1

    def g():
        return 2

    def shimmed():
        return 3

    owner, holder = types.ModuleType(A), types.ModuleType("npu_shim_test_holder")
    owner.f, owner.g = f, g
    holder.f = holder.alias = f
    holder.g, holder.LIMIT = g, 5
    modules = sys.modules
    sys.modules = {owner.__name__: owner, holder.__name__: holder}
    try:
        targets.rebind(f, shimmed, skip=owner)
    finally:
        sys.modules = modules
    assert (owner.f, owner.g) == (f, g)
    assert (holder.f, holder.alias, holder.g, holder.LIMIT) == (shimmed, shimmed, g, 5)
    assert holder.__name__ == "npu_shim_test_holder"


def test_revert_leaves_a_name_someone_else_changed_since(holder):
    """Only what the change put there is put back -- even when its replacement is None."""
    owner, _ = holder
    owner.NAME = 1
    change = targets.Replace(A, "NAME", lambda original: None).prepare(owner)
    change.apply(imported_before=False)
    assert owner.NAME is None
    del owner.NAME
    change.revert()
    assert not hasattr(owner, "NAME")


# -- wrappers that pickle and copy like functions ---------------------------------------------------

PICKLED = """
def f():
    return 1


class Box:
    def __init__(self, n=2):
        self.n = n

    def get(self):
        return self.n


class Outer:
    class Inner:
        def get(self):
            return 3
"""


def passthrough(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


@pytest.fixture
def pickled(monkeypatch):
    """An importable module whose function and methods are wrapped."""
    return pickled_module(monkeypatch)


def pickled_module(monkeypatch):
    module = types.ModuleType("npu_shim_test_pickled")
    exec(compile(PICKLED, "<npu_shim_test_pickled>", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    for owner, name in ((module, "f"), (module.Box, "get"), (module.Outer.Inner, "get")):
        setattr(owner, name, targets.function_wrapper(owner.__dict__[name], passthrough))
    return module


def test_wrappers_pickle_by_reference_to_their_importable_name(pickled):
    assert pickle.loads(pickle.dumps(pickled.f)) is pickled.f
    box = pickled.Box(5)
    bound = pickle.loads(pickle.dumps(box.get))
    assert type(bound).__name__ == "BoundFunctionWrapper" and bound() == 5 and bound.__self__ is not box
    unbound = pickle.loads(pickle.dumps(pickled.Box.get))
    assert unbound(box) == 5
    nested = pickle.loads(pickle.dumps(pickled.Outer.Inner.get))
    assert nested(pickled.Outer.Inner()) == 3


def test_wrappers_pickle_where_wrapts_proxy_refuses_both_reduce_protocols(monkeypatch):
    """wrapt 1.x's proxies (the images' 1.14 - 1.17) refuse ``__reduce_ex__`` as well as
    ``__reduce__``: the shim's wrappers answer both themselves."""
    from npu_shim.runtime import wrapt_loader

    wrapt = wrapt_loader.load()

    def refuse(self, protocol):
        raise NotImplementedError("object proxy must define __reduce_ex__()")

    old = types.SimpleNamespace(**{name: type(name, (getattr(wrapt, name),), {"__reduce_ex__": refuse})
                                   for name in ("FunctionWrapper", "BoundFunctionWrapper")})
    monkeypatch.setattr(wrapt_loader, "load", lambda: old)
    module = pickled_module(monkeypatch)
    assert isinstance(module.f, old.FunctionWrapper)
    assert pickle.loads(pickle.dumps(module.f)) is module.f
    assert pickle.loads(pickle.dumps(module.Box(4).get))() == 4


def test_both_reduce_protocols_name_the_function(pickled):
    box = pickled.Box()
    method = box.get
    assert pickled.f.__reduce__() == pickled.f.__reduce_ex__(2) == "f"
    assert method.__reduce__() == method.__reduce_ex__(2) == (getattr, (box, "get"))
    assert pickled.Box.get.__reduce__() == (getattr, (pickled.Box, "get"))


def test_wrappers_copy_like_functions_and_bound_methods(pickled):
    box = pickled.Box(7)
    method = box.get
    assert copy.copy(pickled.f) is pickled.f and copy.deepcopy(pickled.f) is pickled.f
    assert copy.copy(method) is method
    box_copy, method_copy = copy.deepcopy([box, method])
    assert method_copy.__self__ is box_copy and box_copy is not box and method_copy() == 7


def test_a_method_of_a_class_defined_in_a_function_has_no_owner_to_name():
    class Local:
        def get(self):
            return 1

    assert targets._owner_class(Local.get) is None
    assert targets._owner_class(Loaded.method) is Loaded


def test_bind_arguments_names_positionals_by_the_parameters_before_star_args():
    assert targets.bind_arguments(("a", "*args", "b"), (1, 2), {"b": 3}) == {"a": 1, "b": 3}
    assert targets.bind_arguments(("a", "b"), (1,), {}) == {"a": 1}
