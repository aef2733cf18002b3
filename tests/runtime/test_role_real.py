"""The scheduler's role from the shim's own target in a real release (0.5.11, simulated NPU), zbal
off: a scheduler spawned as sglang spawns it (multiprocessing spawn, target the real
``run_scheduler_process``) logs one summary line that carries its role (with its size) -- before
the body of ``run_scheduler_process`` ran (its first read of the server
arguments ends the child: ``shimdev.beds.release_beds.StopAtBody``).  The program the release process
runs: dev/shimdev/programs/scheduler_role_spawn.py."""
from __future__ import annotations

import re

import npu_shim
from shimdev.envs import realsglang


def test_a_spawned_scheduler_with_zbal_off_logs_its_role_in_its_summary_line(release_venv):
    release_venv("0.5.11")
    env = {"NPU_SHIM_ZBAL": "0",
           "SGLANG_ZBAL_LOCAL_MEM_SIZE": None, "NPU_SHIM_STRICT": None, "NPU_SHIM_LOG_FORMAT": None}
    out = realsglang.run_program("0.5.11", "scheduler_role_spawn", env=env)
    assert out["exitcode"] == 0, out["lines"]
    tag = "[npu-shim %s sglang 0.5.11 pid %d" % (npu_shim.__version__, out["pid"])
    mine = [line for line in out["lines"] if line.startswith(tag)]
    summaries = [line for line in mine if re.search(r"\] zbal=\w+ ", line)]
    # one summary line, the child's first, tagged with its role
    assert summaries == mine[:1], out["lines"]
    assert summaries[0].startswith(tag + " tp 3/16] zbal=disabled mla_weight_release="), summaries
