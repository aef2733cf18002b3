"""A scheduler spawned as sglang spawns it, zbal off (tests/runtime/test_role_real.py, 0.5.11):
its summary line carries its role.  The spawned child runs this module too (as
``__mp_main__``), so the simulated NPU is installed first at module level."""
from shimdev import simnpu

simnpu.install(release="0.5.11")  # the spawned child runs this too (as __mp_main__), first

if __name__ == "__main__":
    import json
    import multiprocessing as mp
    import os
    import sys

    import sglang.srt.managers.scheduler as sch
    from shimdev.beds.release_beds import scheduler_process_args
    log_path = os.path.join(os.getcwd(), "child.log")
    saved = os.dup(2)
    os.dup2(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)  # the child's stderr
    try:
        child = mp.get_context("spawn").Process(
            target=sch.run_scheduler_process, args=scheduler_process_args(tp=16, tp_rank=3))
        child.start()
        child.join(300)
    finally:
        os.dup2(saved, 2)
    sys.stdout.write("\n" + json.dumps({
        "exitcode": child.exitcode, "pid": child.pid, "lines": open(log_path).read().splitlines()}) + "\n")
