"""npu_shim/core/framework.py: declarations that cannot be wrong, deciding, switches and the allow-list."""
from __future__ import annotations

import types

import pytest

from npu_shim.core import config, framework
from npu_shim.runtime import targets
from npu_shim.core import loading
from npu_shim.core import registry as patch_registry
from npu_shim.patches import zbal as zbal_patch


def upstream(pr="sgl-project/sglang#1", release="0.5.20", backports=("0.5.7", "0.5.19")):
    return framework.Upstream(pr, release, backports)


def declare(omit=(), **overrides):
    """Define a Patch subclass with a complete declaration, ``overrides`` applied and the
    attributes named in ``omit`` left to the base class's defaults."""
    attrs = dict(
        name="demo", upstream=upstream(), switch=config.switch("demo", "test switch"),
        modules=("sglang.srt.a",), probe=lambda self, view: None,
        targets=lambda self, view, ctx: [targets.Wrap("sglang.srt.a", "f", lambda *a: None, [()])],
        trigger=lambda self, environ, on_npu: None)  # works off an NPU too
    attrs.update(overrides)
    for name in omit:
        del attrs[name]
    return type("DemoPatch", (framework.Patch,), attrs)


class View:
    """A stand-in SourceView: module ``sglang.srt.a`` with ``f()``, and whatever ``extra`` adds."""

    version = "0.5.9"

    def __init__(self, **functions):
        self.functions = {("sglang.srt.a", "f"): types.SimpleNamespace(params=(), fingerprint="x")}
        self.functions.update(functions)

    def function(self, dotted, qualname):
        return self.functions.get((dotted, qualname))

    def module(self, dotted):
        return object() if any(d == dotted for d, _ in self.functions) else None

    def has(self, dotted, qualname):
        return (dotted, qualname) in self.functions


# -- declarations ----------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, words", [
    ({"switch": None}, "switch must be its doc (a string) or a config.EnvVar"),
    ({"switch": config.boolean("NPU_SHIM_OTHER", True, "x")}, "switch is NPU_SHIM_OTHER, expected NPU_SHIM_DEMO"),
    ({"name": "Demo-Patch"}, "is not a lower-case identifier"),
    ({"upstream": upstream(pr="")}, "upstream.pr is required"),
    ({"upstream": upstream(backports=("0.5.7",))}, "upstream.backports must be (first, last)"),
    ({"upstream": upstream(release="latest")}, "and upstream.release a release number"),
    ({"upstream": upstream(backports=("0.5.7", "0.5.21"))}, "must end before upstream.release 0.5.20"),
    ({"upstream": ("sgl-project/sglang#1", "0.5.20", ("0.5.7", "0.5.19"))}, "upstream must be an Upstream("),
    ({"modules": ()}, "modules must list the sglang modules"),
    ({"reads": ("SGLANG_X",)}, "reads must hold config.EnvVar only"),
])
def test_a_wrong_declaration_fails_when_the_class_is_defined(overrides, words):
    with pytest.raises(TypeError) as info:
        declare(**overrides)
    assert words in str(info.value) and "DemoPatch" in str(info.value)


@pytest.mark.parametrize("omitted, words", [
    ("upstream", "upstream must be an Upstream(pr, release, backports=(first, last))"),
    ("switch", "switch must be its doc (a string) or a config.EnvVar"),
    ("modules", "modules must list the sglang modules its targets live in"),
])
def test_a_declaration_that_leaves_out_a_required_attribute_fails(omitted, words):
    """Left out altogether (the base class's default), not set to a wrong value: a Patch without
    an ``upstream`` cannot be defined, so no reason ever reads 'backport of ; upstream ...'."""
    with pytest.raises(TypeError) as info:
        declare(omit=(omitted,))
    assert words in str(info.value)


def test_a_patch_is_named_after_its_module_and_its_switch_made_from_its_doc():
    """Its name is spelled once, by its module's file name: left out, the name is the module's and
    the switch NPU_SHIM_<NAME> is made from ``switch`` given as its doc; a name given wrongly
    still fails."""
    module = __name__.rpartition(".")[2]
    patch = declare(omit=("name",), switch="test switch")()
    assert patch.name == module and patch.switch.name == config.switch_name(module)
    assert patch.switch.doc == "test switch" and patch.switch.aliases == ()
    with pytest.raises(TypeError) as info:
        declare(name="")
    assert "name '' is not a lower-case identifier" in str(info.value)


def test_the_defaults_a_declaration_may_leave_out():
    patch = declare(omit=("trigger",))()
    assert (patch.reads, patch.error, type(patch.report)) == ((), framework.ShimError, framework.Report)
    assert patch.trigger({}, True) is None and patch.trigger({}, None) is None and patch.must_honour({}) is False
    with pytest.raises(framework.Inactive) as info:
        patch.trigger({}, False)  # by default a patch needs an NPU
    assert info.value.reason == "not running on an NPU (torch.npu is unavailable)"
    with pytest.raises(NotImplementedError):
        framework.Patch.probe(patch, View())
    with pytest.raises(NotImplementedError):
        framework.Patch.targets(patch, View(), None)


def test_the_applied_reason_names_the_backport_and_the_notes():
    assert framework.decide(declare()(), View(), environ={}).reason == (
        "backport of sgl-project/sglang#1; upstream since 0.5.20")

    def noting(self, view, ctx):
        ctx.note("fused path")
        ctx.note("2 layers")
        return [targets.Wrap("sglang.srt.a", "f", lambda *a: None, [()])]

    decision = framework.decide(declare(targets=noting)(), View(), environ={})
    assert decision.reason == "backport of sgl-project/sglang#1; upstream since 0.5.20 (fused path; 2 layers)"


def test_a_target_outside_the_declared_modules_fails_the_patch_instead_of_never_applying():
    patch = declare(targets=lambda self, view, ctx: [
        targets.Wrap("sglang.srt.a", "f", lambda *a: None, [()]),
        targets.Wrap("sglang.srt.b", "g", lambda *a: None, [()])])()
    view = View(**{"sglang.srt.b": None})
    view.functions[("sglang.srt.b", "g")] = types.SimpleNamespace(params=(), fingerprint="y")
    decision = framework.decide(patch, view, environ={})
    assert decision.state == framework.FAILED
    assert decision.reason.startswith("declaration error: targets in sglang.srt.b, which DemoPatch.modules "
                                      "does not list")


def test_every_registered_patch_is_declared_consistently():
    for patch in loading.load_all():
        assert not getattr(patch, "broken", None), patch.broken
        assert framework.declaration_problems(type(patch)) == []
        assert patch.switch.name == "NPU_SHIM_" + patch.name.upper()


# -- one broken feature module fails only its patch -------------------------------------------------

def test_a_feature_module_that_cannot_load_fails_only_its_own_patch(monkeypatch):
    monkeypatch.setattr(patch_registry, "PATCH_MODULES",
                        ["npu_shim.patches.zbal", "npu_shim.patches.no_such_feature"])
    zbal, broken = loading.load_all()
    assert zbal is zbal_patch.PATCH
    assert broken.name == "no_such_feature" and broken.switch.name == "NPU_SHIM_NO_SUCH_FEATURE"
    decision = framework.decide(broken, View(), environ={})
    assert decision.state == framework.FAILED
    assert "feature module npu_shim.patches.no_such_feature cannot be loaded" in decision.reason
    assert framework.decide(broken, View(), environ={"NPU_SHIM_ENABLED": "0"}).state == framework.DISABLED


def test_a_patch_named_unlike_its_module_is_broken(monkeypatch):
    fake = types.ModuleType("npu_shim.patches.renamed")
    fake.PATCH = zbal_patch.PATCH
    monkeypatch.setitem(__import__("sys").modules, "npu_shim.patches.renamed", fake)
    broken = loading.load("npu_shim.patches.renamed")
    assert broken.broken == "npu_shim.patches.renamed.PATCH is named 'zbal', not 'renamed'"


# -- switches: master, allow-list, the patch's own (and its older name) ------------------------------

@pytest.mark.parametrize("environ, state, reason", [
    ({}, framework.APPLIED, None),
    ({"NPU_SHIM_ENABLED": "0"}, framework.DISABLED, "NPU_SHIM_ENABLED=0"),
    ({"NPU_SHIM_PATCHES": "zbal"}, framework.DISABLED, "not in NPU_SHIM_PATCHES"),
    ({"NPU_SHIM_PATCHES": "zbal, demo"}, framework.APPLIED, None),
    ({"NPU_SHIM_DEMO": "off"}, framework.DISABLED, "NPU_SHIM_DEMO=0"),
    ({"NPU_SHIM_OLD_DEMO": "0"}, framework.DISABLED, "NPU_SHIM_OLD_DEMO=0"),
    ({"NPU_SHIM_OLD_DEMO": "0", "NPU_SHIM_DEMO": "1"}, framework.APPLIED, None),  # the name wins
])
def test_switches(environ, state, reason, monkeypatch):
    monkeypatch.setattr(patch_registry, "known_names", lambda: ["zbal", "demo"])
    patch = declare(switch=config.switch("demo", "test", aliases=("NPU_SHIM_OLD_DEMO",)))()
    decision = framework.decide(patch, View(), environ=environ)
    assert decision.state == state
    if reason:
        assert decision.reason == reason


def test_an_allow_list_naming_no_patch_is_an_invalid_variable():
    with pytest.raises(config.ConfigError) as info:
        config.PATCHES.read({"NPU_SHIM_PATCHES": "zbal,dual_stream"})
    assert str(info.value) == ("NPU_SHIM_PATCHES='zbal,dual_stream' is invalid: expected patch names "
                               "separated by commas, out of: zbal, mla_weight_release, dual_stream_experts")
    decision = framework.decide(zbal_patch.PATCH, View(), environ={"NPU_SHIM_PATCHES": "zbal,dual_stream"})
    assert decision.state == framework.FAILED and "NPU_SHIM_PATCHES=" in decision.reason


def test_dual_stream_switch_is_named_after_the_patch_and_the_old_name_still_works():
    from npu_shim.patches import dual_stream_experts as ds

    assert ds.PATCH.switch.name == "NPU_SHIM_DUAL_STREAM_EXPERTS"
    for name in ("NPU_SHIM_DUAL_STREAM_EXPERTS", "NPU_SHIM_DUAL_STREAM"):
        decision = framework.decide(ds.PATCH, View(), environ={name: "0"})
        assert (decision.state, decision.reason) == (framework.DISABLED, name + "=0")


def test_unknown_shim_variables_are_named_with_a_suggestion():
    environ = {"NPU_SHIM_ENABLE": "0", "NPU_SHIM_DUAL_STREAM": "0", "NPU_SHIM_CACHE": "/x",
               "NPU_SHIM_ZBAL_SIZE": "1", "SGLANG_OTHER": "1"}
    found = dict(config.unknown_names(loading.all_variables(), environ))
    assert found == {"NPU_SHIM_ENABLE": "NPU_SHIM_ENABLED", "NPU_SHIM_ZBAL_SIZE": "NPU_SHIM_ZBAL"}


def test_the_retired_source_answers_are_an_unknown_name():
    """NPU_SHIM_SOURCE_ANSWERS, which a launcher once handed its children, is read by nothing: left
    in an environment, it is named as a variable the shim does not read (ignored)."""
    assert config.INTERNAL_NAMES == ("NPU_SHIM_CACHE",)
    found = dict(config.unknown_names(loading.all_variables(), {"NPU_SHIM_SOURCE_ANSWERS": "{}"}))
    assert found == {"NPU_SHIM_SOURCE_ANSWERS": None}  # not "did you mean NPU_SHIM_CACHE?"


def test_a_suggestion_is_a_users_variable_close_after_the_prefix():
    """The test cache's variable is never suggested, and a name that only shares the prefix gets
    no suggestion."""
    environ = {"NPU_SHIM_CACH": "/x", "NPU_SHIM_SOURCE": "1", "NPU_SHIM_STICT": "1"}
    found = dict(config.unknown_names(loading.all_variables(), environ))
    assert found == {"NPU_SHIM_CACH": None, "NPU_SHIM_SOURCE": None, "NPU_SHIM_STICT": "NPU_SHIM_STRICT"}


# -- states: nothing to do (inactive) vs should apply but cannot (unsupported) -----------------------

def test_nothing_to_do_is_inactive_and_cannot_is_unsupported():
    def say(verdict):
        def targets_(self, view, ctx):
            raise verdict("why")

        return targets_

    for verdict, state in ((framework.Inactive, framework.INACTIVE), (framework.Unsupported, framework.UNSUPPORTED),
                           (framework.Failed, framework.FAILED)):
        decision = framework.decide(declare(targets=say(verdict))(), View(), environ={})
        assert (decision.state, decision.reason) == (state, "why")
    assert framework.PROBLEMS == (framework.UNSUPPORTED, framework.FAILED)


def test_expected_state_follows_the_declaration():
    patch = declare(upstream=upstream(release="0.5.13", backports=("0.5.9", "0.5.11")))()
    got = {v: framework.expected_state(patch, v) for v in
           ("0.5.8.post1", "0.5.9", "0.5.10.post2.dev3+g5d1c3a7", "0.5.11", "0.5.12", "0.5.13", "0.5.20")}
    assert got == {"0.5.8.post1": "inactive", "0.5.9": "applied", "0.5.10.post2.dev3+g5d1c3a7": "applied",
                   "0.5.11": "applied", "0.5.12": "unsupported", "0.5.13": "upstream", "0.5.20": "upstream"}


def test_decisions_hand_the_wrappers_their_details_and_process_state():
    state = object()

    def targets_(self, view, ctx):
        ctx.process_state = state
        ctx.details["seen"] = True
        return [targets.Wrap("sglang.srt.a", "f", lambda *a: None, [()])]

    decision = framework.decide(declare(targets=targets_)(), View(), environ={})
    assert decision.process_state is state and decision.details == {"seen": True}


def test_backports_of_one_release_are_a_valid_declaration():
    patch = declare(upstream=upstream(backports=("0.5.9", "0.5.9")))()
    assert [framework.expected_state(patch, v) for v in ("0.5.8", "0.5.9", "0.5.10", "0.5.20")] == [
        "inactive", "applied", "unsupported", "upstream"]


def test_without_wrapt_only_a_patch_that_would_apply_fails():
    applied = framework.Decision(framework.APPLIED, "backport", ["t"], {"d": 1})
    failed = framework.without_wrapt(applied, "wrapt is not available: x")
    assert failed.state == framework.FAILED and failed.targets == []
    assert failed.reason == ("wrapt is not available: x (use an npu-shim bundle: 'python -m npu_shim "
                             "bundle DIR', or install wrapt>=1.14 in the image)")
    for state in (framework.UPSTREAM, framework.DISABLED, framework.INACTIVE, framework.UNSUPPORTED):
        decision = framework.Decision(state, "why")
        assert framework.without_wrapt(decision, "wrapt is not available: x") is decision


def test_the_details_readers_return_only_the_type_asked_for():
    """Details are read through typed readers: a report never formats a value of the wrong type."""
    details = framework.Details({"mode": "full" * 10, "gva_mib": 49152, "flag": True, "neg": -1,
                                 "mib": 12.5, "text_number": "12"})
    assert details.text("mode", 16) == "fullfullfullfull" and details.text("gva_mib") is None
    assert details.count("gva_mib") == 49152 and details.count("flag") is None and details.count("neg") is None
    assert details.number("mib") == 12.5 and details.number("flag") is None and details.number("text_number") is None
    assert framework.Details(None).text("mode") is None and framework.Details(["x"]).count("x") is None
    report = framework.Report()
    assert (report.check_facts(), report.summary(details)) == ({}, [])


# -- what each decision says, word for word -----------------------------------------------------------

class Target:
    """A stand-in target: its module, what ``check_source`` says of the view, its own ``requires``."""

    def __init__(self, module="sglang.srt.a", problem=None, requires=None):
        self.module = module
        self.problem = problem
        self.requires = requires
        self.views = []

    def check_source(self, view):
        self.views.append(view)
        return self.problem


def test_a_patch_whose_probe_finds_the_feature_stands_down_with_the_evidence():
    patch = declare(probe=lambda self, view: "def forward_mlaprolog")()
    assert framework.decide(patch, View(), environ={}).reason == "sglang 0.5.9 has it: def forward_mlaprolog"
    view = View()
    view.version = None
    decision = framework.decide(patch, view, environ={})
    assert (decision.state, decision.reason) == (framework.UPSTREAM, "sglang ? has it: def forward_mlaprolog")


def test_an_upstream_variable_the_backport_rejects_stands_down_word_for_word_without_a_version():
    """A variable of upstream's (not ``NPU_SHIM_*``) set to what the backport cannot accept, on an
    sglang that has the feature but says no version: ``upstream``, "?" for the version, and what
    the backport would have said."""
    var = config.boolean("SGLANG_DEMO_FLAG", False, "upstream's flag")
    patch = declare(reads=(var,), probe=lambda self, view: "def forward_mlaprolog")()
    view = View()
    view.version = None
    decision = framework.decide(patch, view, environ={"SGLANG_DEMO_FLAG": "maybe"})
    assert (decision.state, decision.reason) == (
        framework.UPSTREAM,
        "sglang ? has it: def forward_mlaprolog; upstream reads SGLANG_DEMO_FLAG itself (to the backport, "
        "SGLANG_DEMO_FLAG='maybe' is invalid: expected a boolean: one of 1/0, true/false, yes/no, on/off)")


def test_no_sglang_is_unsupported_and_no_npu_inactive_for_a_patch_that_needs_one():
    decision = framework.decide(declare()(), None, environ={})
    assert (decision.state, decision.reason) == (framework.UNSUPPORTED, "sglang not found")
    needs = declare(omit=("trigger",))()
    decision = framework.decide(needs, View(), environ={}, on_npu=False)
    assert (decision.state, decision.reason) == (framework.INACTIVE,
                                                 "not running on an NPU (torch.npu is unavailable)")
    assert framework.decide(needs, View(), environ={}, on_npu=None).state == framework.APPLIED  # not known
    assert framework.decide(needs, View(), environ={}, on_npu=True).state == framework.APPLIED
    assert framework.decide(declare()(), View(), environ={}, on_npu=False).state == framework.APPLIED


def test_the_trigger_reads_the_environ_given_and_is_skipped_when_assumed():
    seen = []

    def trigger(self, environ, on_npu):
        seen.append(environ)
        raise framework.Inactive("SGLANG_X is not set")

    patch = declare(trigger=trigger)()
    environ = {"SGLANG_Y": "1"}
    decision = framework.decide(patch, View(), environ=environ)
    assert (decision.state, decision.reason) == (framework.INACTIVE, "SGLANG_X is not set") and seen == [environ]
    assert framework.decide(patch, View(), environ=environ, assume_triggered=True).state == framework.APPLIED
    assert seen == [environ]


def test_the_targets_get_the_view_and_a_context_of_the_decision():
    got = []
    view = View()

    def targets_(self, view_, ctx):
        got.append((view_, ctx.environ, ctx.assume_triggered, ctx.details, ctx.process_state, ctx.notes))
        return [Target()]

    environ = {"SGLANG_Y": "1"}
    decision = framework.decide(declare(targets=targets_)(), view, environ=environ)
    assert got == [(view, environ, False, {}, None, [])]
    assert decision.details == {} and decision.process_state is None and len(decision.targets) == 1
    framework.decide(declare(targets=targets_)(), view, environ=environ, assume_triggered=True)
    assert got[1][2] is True
    ctx, found = framework.targets_for(declare(targets=targets_)(), view, environ)
    assert ctx.environ is environ and ctx.assume_triggered is True and got[2][2] is True


def test_every_target_is_checked_on_the_source_and_its_problems_make_it_unsupported():
    first, second, fine = Target(problem="f() has changed"), Target(problem="g() is gone"), Target()
    view = View()
    patch = declare(targets=lambda self, view_, ctx: [first, fine, second])()
    decision = framework.decide(patch, view, environ={})
    assert (decision.state, decision.reason) == (framework.UNSUPPORTED, "f() has changed; g() is gone")
    assert first.views == [view] and fine.views == [view] and second.views == [view]


def test_a_source_that_does_not_parse_leaves_the_patch_unsupported_with_the_reason():
    def targets_(self, view, ctx):
        raise framework.SourceError("sglang/srt/a.py: line 3: invalid syntax")

    decision = framework.decide(declare(targets=targets_)(), View(), environ={})
    assert (decision.state, decision.reason) == (framework.UNSUPPORTED, "sglang/srt/a.py: line 3: invalid syntax")


def test_targets_in_undeclared_modules_are_all_named_in_the_declaration_error():
    patch = declare(targets=lambda self, view, ctx: [
        Target("sglang.srt.c"), Target(), Target("sglang.srt.b"), Target("sglang.srt.c")])()
    decision = framework.decide(patch, View(), environ={})
    assert (decision.state, decision.reason) == (
        framework.FAILED, "declaration error: targets in sglang.srt.b, sglang.srt.c, which DemoPatch.modules "
                          "does not list (no hook would apply them)")


def test_a_bad_value_of_a_variable_the_patch_reads_fails_it():
    size = config.mib("NPU_SHIM_DEMO_MIB", "a size")
    patch = declare(reads=(size,))()
    decision = framework.decide(patch, View(), environ={"NPU_SHIM_DEMO_MIB": "12G"})
    assert (decision.state, decision.reason) == (
        framework.FAILED, "NPU_SHIM_DEMO_MIB='12G' is invalid: expected a whole number of MiB, e.g. 12288 for 12 GiB "
                          "(no unit suffix; ASCII digits)")
    assert framework.decide(patch, View(), environ={"NPU_SHIM_DEMO_MIB": "12"}).state == framework.APPLIED


def test_targets_for_lists_the_patchs_targets_as_they_are():
    own, bare = Target(requires=lambda: None), Target()
    ctx, found = framework.targets_for(declare(targets=lambda self, v, c: [own, bare])(), View())
    assert found == [own, bare] and bare.requires is None and isinstance(ctx, framework.DecideContext)


def test_a_decision_and_a_verdict_say_what_they_are():
    assert repr(framework.Decision(framework.INACTIVE, "no NPU")) == "Decision(inactive: no NPU)"
    verdict = framework.Unsupported("f() has changed")
    assert (str(verdict), verdict.reason, verdict.state) == ("f() has changed", "f() has changed", "unsupported")
    decision = framework.Decision(framework.APPLIED, "why", (t for t in ["a", "b"]))
    assert decision.targets == ["a", "b"] and decision.details == {} and decision.process_state is None


def test_a_release_is_read_up_to_its_first_part_that_is_no_number():
    assert framework.version_tuple("0.5.10.post1") == (0, 5, 10)
    assert framework.version_tuple("12.0rc1.3") == (12,)
    assert framework.version_tuple(None) == () and framework.version_tuple("") == ()
    assert framework.version_tuple("x.1") == ()


def test_a_patch_declared_in_a_package_is_named_after_the_last_part_of_its_module():
    patch = type("Feature", (framework.Patch,), dict(
        __module__="npu_shim.patches.some_feature", upstream=upstream(), switch="its switch",
        modules=("sglang.srt.a",)))
    assert patch.name == "some_feature" and patch.switch.name == "NPU_SHIM_SOME_FEATURE"


def test_a_switch_given_outright_is_kept_with_its_aliases():
    given = config.switch("demo", "the given doc", aliases=("NPU_SHIM_OLD_DEMO",))
    patch = declare(switch=given)
    assert patch.switch is given and patch.switch.aliases == ("NPU_SHIM_OLD_DEMO",)


def test_a_patch_whose_module_defines_no_targets_says_which_module():
    patch = declare(omit=("targets", "name"), __module__="npu_shim.patches.no_such_feature",
                    switch="its switch")()
    with pytest.raises(NotImplementedError) as info:
        patch.targets(View(), None)
    assert str(info.value) == ("patch no_such_feature's module npu_shim.patches.no_such_feature defines no "
                               "targets(view, ctx)")


def test_a_wrong_declaration_names_every_problem_in_one_message():
    with pytest.raises(TypeError) as info:
        declare(name="Bad", switch=None, reads=("SGLANG_X",), upstream=None, modules=())
    assert str(info.value) == (
        "patch DemoPatch is declared wrongly: name 'Bad' is not a lower-case identifier; switch must be its "
        "doc (a string) or a config.EnvVar (config.switch(name, doc)); reads must hold config.EnvVar only; "
        "upstream must be an Upstream(pr, release, backports=(first, last)); modules must list the sglang "
        "modules its targets live in")
    with pytest.raises(TypeError) as info:
        declare(switch=config.boolean("NPU_SHIM_OTHER", True, "x"), upstream=upstream(backports=("0.5.7", "0.5.20")))
    assert str(info.value) == ("patch DemoPatch is declared wrongly: switch is NPU_SHIM_OTHER, expected NPU_SHIM_DEMO; "
                               "upstream.backports 0.5.7 - 0.5.20 must end before upstream.release 0.5.20")


@pytest.mark.parametrize("fact, problem", [
    (upstream(pr=""), "upstream.pr is required (e.g. sgl-project/sglang#19246)"),
    (upstream(pr=None), "upstream.pr is required (e.g. sgl-project/sglang#19246)"),
    (upstream(backports=("0.5.7",)),
     "upstream.backports must be (first, last) and upstream.release a release number"),
    (upstream(release="latest"),
     "upstream.backports must be (first, last) and upstream.release a release number"),
], ids=["empty pr", "no pr", "one backport", "release not a number"])
def test_each_upstream_problem_word_for_word_in_the_declarations_type_error(fact, problem):
    """What the author of a patch reads when ``upstream`` is wrong: the problem alone, and the
    TypeError the class definition raises."""
    assert fact.problems() == [problem]
    with pytest.raises(TypeError) as info:
        declare(upstream=fact)
    assert str(info.value) == "patch DemoPatch is declared wrongly: " + problem


def test_the_backports_must_not_end_before_they_start():
    with pytest.raises(TypeError) as info:
        declare(upstream=upstream(backports=("0.5.9", "0.5.8")))
    assert str(info.value) == ("patch DemoPatch is declared wrongly: upstream.backports 0.5.9 - 0.5.8 must end "
                               "before upstream.release 0.5.20")


def test_a_decide_context_keeps_the_details_it_is_given():
    details = {"mode": "full"}
    ctx = framework.DecideContext({}, False, details)
    assert ctx.details is details and framework.DecideContext({}, False).details == {}


def test_a_patch_takes_its_targets_from_its_module(monkeypatch):
    """A patch's ``targets`` is its module's ``targets(view, ctx)``, looked up when it is decided."""
    seen = []
    monkeypatch.setattr(zbal_patch, "targets", lambda view, ctx: seen.append((view, ctx)) or ["t"])
    assert zbal_patch.PATCH.targets("view", "ctx") == ["t"] and seen == [("view", "ctx")]


def test_a_count_may_be_zero():
    details = framework.Details({"released": 0, "mode": "full"})
    assert details.count("released") == 0 and details.text("mode") == "full" and details.text("mode", 2) == "fu"


def test_the_upstream_fact_says_where_a_patch_comes_from_and_when_it_goes():
    fact = upstream(pr="sgl-project/sglang#7", release="0.5.13", backports=["0.5.9", "0.5.11"])
    assert (fact.pr, fact.release, fact.backports) == ("sgl-project/sglang#7", "0.5.13", ("0.5.9", "0.5.11"))
    assert fact.remove_when == "every supported image runs sglang >= 0.5.13"
    assert str(fact) == "backport of sgl-project/sglang#7; upstream since 0.5.13" and fact.problems() == []


def test_a_patch_title_is_its_module_docstring_first_line():
    """Written once, where a reader of the patch sees it first; a leading '<name>: ' and the full
    stop are left out."""
    module = types.ModuleType("npu_shim.patches.titled", "titled: does one thing well.\n\nWhy: ...\n")
    import sys
    sys.modules[module.__name__] = module
    try:
        patch = declare(omit=("name",), __module__=module.__name__, switch="test switch")()
        assert patch.name == "titled" and patch.title == "does one thing well"
        module.__doc__ = "Another thing, said plainly.\n"
        assert patch.title == "Another thing, said plainly"
    finally:
        del sys.modules[module.__name__]
    assert zbal_patch.PATCH.title == ("memfabric's zero-buffer allocator on Ascend NPUs (backport of sglang "
                                      "0.5.12's integration)")


def test_assuming_the_trigger_assumes_an_npu_too():
    """The release table's question, "would it apply if switched on, on an NPU?"."""
    patch = declare(omit=("trigger",))()
    assert framework.decide(patch, View(), environ={}, on_npu=False).state == framework.INACTIVE
    assert framework.decide(patch, View(), environ={}, on_npu=False, assume_triggered=True).state == framework.APPLIED
