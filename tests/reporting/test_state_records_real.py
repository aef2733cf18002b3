"""The state record and the process-tagged log in a real release (0.5.11: real sglang modules,
simulated NPU, zbal's Python layer over its simulated native side): a scheduler process with zbal
on in full mode.  The program the release process runs: dev/shimdev/programs/scheduler_state_record.py."""
from __future__ import annotations

import json

import npu_shim
from shimdev import realsglang


def test_state_record_of_a_real_0_5_11_scheduler_with_zbal(release_venv, tmp_path):
    release_venv("0.5.11")
    env = {"SGLANG_ZBAL_LOCAL_MEM_SIZE": "49152", "NPU_SHIM_STATE_DIR": str(tmp_path / "state"),
           "NPU_SHIM_STRICT": None, "NPU_SHIM_ZBAL": None, "SGLANG_ZBAL_BOOTSTRAP_URL": None}
    out = realsglang.run_program("0.5.11", "scheduler_state_record", env=env, zbal=True)
    before, after = out["before"], out["after"]
    assert before["pid"] == out["pid"] and before["sglang"] == "0.5.11" and before["shim"] == npu_shim.__version__
    assert {name: p["state"] for name, p in before["patches"].items()} == {
        "zbal": "applied", "mla_weight_release": "applied", "dual_stream_experts": "upstream"}
    # decided while the scheduler's module was imported: sglang has not told who it is yet
    assert before["role"]["role"] == "unknown"
    assert before["patches"]["zbal"]["details"] == {}
    # run_scheduler_process then Scheduler.__init__ ran: the role (the shim's own target) and
    # zbal's heap are in the record at once
    assert after["role"] == {"role": "scheduler", "source": "run_scheduler_process", "tp_rank": 3,
                             "tp_size": 16, "pp_rank": 0, "pp_size": 1}
    assert after["patches"]["zbal"]["details"] == {"mode": "full", "gva_mib": 49152}
    assert after["patches"]["zbal"]["targets_applied"] == "10/10"
    assert out["files"] == [out["name"]] and out["name"].endswith("-%d.json" % out["pid"])
    assert after["uid"] == 0 and "argv" not in after
    # zbal's success line carries the process tag with the rank
    assert ("[npu-shim %s sglang 0.5.11 pid %d tp 3/16] zbal: rank 3 initialised a 49152 MiB heap "
            "in full mode (device 0, world 16)" % (npu_shim.__version__, out["pid"])) in out["lines"], out["lines"]
    json.dumps(after)  # plain JSON all through
