"""core/loading.py: the registered patches, and each patch's selftest step found from its name."""

import types

from npu_shim.core import loading


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
