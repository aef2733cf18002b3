"""The runtime's side of the state record: the writer is loaded only where a record is asked for."""

import json
import os

from test_bootstrap import last_json, run, tree  # noqa: F401 - ``tree`` is a fixture

WRITER_MODULES = ["npu_shim.reporting.record_writer", "npu_shim.reporting.safe_dir"]  # sorted

REPORT = """
    import json, os, sys
    from sglang.srt.utils import get_npu_memory_capacity
    import npu_shim
    from npu_shim.reporting import state_record
    loaded = lambda: sorted(m for m in %r if m in sys.modules)
    out = {"value": get_npu_memory_capacity(), "after_import": loaded()}
    state_record.touch()              # something changed, but no record is kept: nothing to wake
    out["after_touch"] = loaded()
    if os.environ.get("LATE_STATE_DIR"):  # asked for once the patches are decided
        os.environ["NPU_SHIM_STATE_DIR"] = os.environ["LATE_STATE_DIR"]
        state_record.touch(now=True)
    out["at_end"] = loaded()
    print(json.dumps(out))
""" % (WRITER_MODULES,)


def test_without_a_state_dir_the_writer_is_never_loaded(tree):
    out = last_json(run(tree, REPORT))
    assert out["value"] == 1001  # the shim applied
    assert out["after_import"] == out["after_touch"] == out["at_end"] == []


def test_a_state_dir_asked_for_after_deciding_gets_the_decided_record(tree):
    state = tree / "state"
    out = last_json(run(tree, REPORT, env={"LATE_STATE_DIR": str(state)}))
    assert out["after_import"] == out["after_touch"] == [] and out["at_end"] == WRITER_MODULES
    (name,) = os.listdir(str(state))
    record = json.loads((state / name).read_text())
    assert record["patches"]["demo"]["state"] == "applied" and record["shim_enabled"] is True
    assert record["sglang_path"] == str(tree / "pkgs" / "sglang")


def test_with_a_state_dir_the_record_is_written_when_the_patches_are_decided(tree):
    state = tree / "state"
    out = last_json(run(tree, REPORT, env={"NPU_SHIM_STATE_DIR": str(state)}))
    assert out["after_import"] == WRITER_MODULES
    (name,) = os.listdir(str(state))
    assert json.loads((state / name).read_text())["patches"]["demo"]["state"] == "applied"
