"""The state record and the process-tagged log in a real release (0.5.11: real sglang modules,
simulated NPU, zbal's Python layer over its simulated native side): a scheduler process with zbal on in full mode."""
from __future__ import annotations

import json

import npu_shim
from shimdev import realsglang

SNIPPET = r'''
import json, logging, os, socket
import sglang.srt.managers.scheduler  # the scheduler's module: every patch is decided here
import sglang.srt.model_executor.model_runner, sglang.srt.utils.common
import sglang.srt.layers.moe.token_dispatcher.deepep, sglang.srt.distributed.parallel_state
from npu_shim.ops import log
from shimdev.release_beds import zbal_fresh, make_scheduler, enter_scheduler_process

from npu_shim.ops import procinfo, statefile
path = os.path.join(os.environ["NPU_SHIM_STATE_DIR"],
                    statefile.record_name(socket.gethostname(), procinfo.pid_namespace(), os.getpid()))
before = json.load(open(path))
lines = []
class Capture(logging.Handler):
    def emit(self, record):
        lines.append(log.TextFormatter().format(record))
log.logger.addHandler(Capture())
zbal_fresh()
enter_scheduler_process(tp=16, tp_rank=3)  # the real (wrapped) run_scheduler_process, to its body
make_scheduler(tp=16, tp_rank=3)   # the real wrapped Scheduler.__init__ (stub body), full mode
after = json.load(open(path))
emit({"before": before, "after": after, "lines": lines, "pid": os.getpid(),
      "files": os.listdir(os.environ["NPU_SHIM_STATE_DIR"]), "name": os.path.basename(path)})
'''


def test_state_record_of_a_real_0_5_11_scheduler_with_zbal(release_venv, tmp_path):
    release_venv("0.5.11")
    env = {"SGLANG_ZBAL_LOCAL_MEM_SIZE": "49152", "NPU_SHIM_STATE_DIR": str(tmp_path / "state"),
           "NPU_SHIM_STRICT": None, "NPU_SHIM_ZBAL": None, "SGLANG_ZBAL_BOOTSTRAP_URL": None}
    out = realsglang.run_in_release("0.5.11", SNIPPET, env=env, zbal=True)
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
