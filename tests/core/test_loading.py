"""core/loading.py: the registered patches, and each patch's selftest step found from its name."""

import copy
import sys
import types

import pytest

from npu_shim.core import config, loading
from npu_shim.patches import zbal as zbal_patch


def test_every_registered_patch_has_its_selftest_step_with_its_facts():
    steps = {patch.name: loading.selftest_step(patch) for patch in loading.load_all()}
    assert sorted(steps) == ["dual_stream_experts", "mla_weight_release", "zbal"]
    assert steps["zbal"].alone and steps["zbal"].options[0][:3] == ("--zbal-mib", "zbal_mib", 1024)
    assert steps["zbal"].mib({"zbal_mib": 1024}) == 1536 and steps["zbal"].devices == ("npu",)
    assert steps["dual_stream_experts"].devices == ("npu", "cuda") and not steps["dual_stream_experts"].alone
    assert steps["mla_weight_release"].mib({}) == 2048 and steps["mla_weight_release"].options == ()


def test_a_step_module_may_leave_out_what_it_does_not_need():
    step = loading.SelftestStep(types.SimpleNamespace(run=lambda step: (True, "", {})))
    assert (step.devices, step.alone, step.options, step.mib({})) == (("npu",), False, (), 0)


def test_a_broken_patch_has_no_step():
    assert loading.selftest_step(loading.BrokenPatch("gone", "cannot be loaded")) is None


def test_a_broken_patch_is_named_says_where_it_came_from_and_is_never_honoured():
    broken = loading.BrokenPatch("gone", "cannot be loaded")
    assert (broken.name, broken.broken, str(broken.upstream)) == ("gone", "cannot be loaded",
                                                                 "feature module npu_shim.patches.gone")
    assert (broken.upstream.backports, broken.upstream.remove_when) == ((), "")
    assert (broken.switch.name, broken.switch.doc, broken.switch.default) == ("NPU_SHIM_GONE", "", True)
    assert broken.must_honour({"NPU_SHIM_GONE": "1"}) is False


def test_a_feature_module_that_cannot_be_imported_is_a_broken_patch_with_the_error():
    broken = loading.load("npu_shim.patches.no_such_feature")
    assert (broken.name, broken.broken) == (
        "no_such_feature", "feature module npu_shim.patches.no_such_feature cannot be loaded: "
                           "ModuleNotFoundError(\"No module named 'npu_shim.patches.no_such_feature'\")")
    top = loading.load("json")  # a module of no package, without a PATCH
    assert (top.name, top.broken) == (
        "json", "feature module json cannot be loaded: AttributeError(\"module 'json' has no attribute 'PATCH'\")")


def test_a_patch_without_a_name_is_broken(monkeypatch):
    fake = types.ModuleType("npu_shim.patches.nameless")
    fake.PATCH = object()
    monkeypatch.setitem(sys.modules, "npu_shim.patches.nameless", fake)
    broken = loading.load("npu_shim.patches.nameless")
    assert (broken.name, broken.broken) == ("nameless", "npu_shim.patches.nameless.PATCH is named None, not 'nameless'")


def test_a_broken_patch_has_no_step_even_where_its_module_has_one():
    broken = copy.copy(zbal_patch.PATCH)
    broken.broken = "zbal cannot be loaded"
    assert loading.selftest_step(zbal_patch.PATCH) is not None and loading.selftest_step(broken) is None


@pytest.mark.parametrize("module", ["npu_shim.patches.no_step", "nowhere_package.no_step", "no_step"])
def test_a_patch_whose_package_has_no_step_module_has_no_step(module):
    """Its package has a ``_selftest`` without it, has none, or it is in no package at all."""
    patch = type("NoStep", (), {"__module__": module, "name": "no_step"})()
    assert loading.selftest_step(patch) is None


def test_target_modules_lists_each_module_once_in_declaration_order():
    first = types.SimpleNamespace(modules=("sglang.b", "sglang.a"))
    second = types.SimpleNamespace(modules=("sglang.a", "sglang.c", "sglang.b", "sglang.d"))
    assert loading.target_modules([first, second]) == ["sglang.b", "sglang.a", "sglang.c", "sglang.d"]
    assert loading.target_modules([]) == []


def test_all_variables_of_given_patches_are_the_shims_then_each_switch_and_read_once():
    size = config.mib("NPU_SHIM_DEMO_MIB", "a size")
    one = types.SimpleNamespace(switch=config.switch("one", ""), reads=[size])
    two = types.SimpleNamespace(switch=config.switch("two", ""), reads=(size, config.STRICT))
    assert loading.all_variables([one, two]) == list(config.SHIM_VARIABLES) + [one.switch, size, two.switch]
    assert loading.all_variables([]) == list(config.SHIM_VARIABLES)
    names = [var.name for var in loading.all_variables()]
    assert names[len(config.SHIM_VARIABLES):len(config.SHIM_VARIABLES) + 1] == ["NPU_SHIM_ZBAL"]
