"""A scheduler process with zbal on in full mode (tests/reporting/test_state_records_real.py, 0.5.11): its
state record and its process-tagged log."""
import json
import logging
import os
import socket

import sglang.srt.managers.scheduler  # the scheduler's module: every patch is decided here
# target modules, imported as a scheduler does
import sglang.srt.model_executor.model_runner
import sglang.srt.utils.common
import sglang.srt.layers.moe.token_dispatcher.deepep
import sglang.srt.distributed.parallel_state  # noqa: F401 - (pyflakes counts only the last of these)
from npu_shim.reporting import log
from npu_shim.reporting import procinfo, record_writer
from shimdev.programs import emit
from shimdev.release_beds import zbal_fresh, make_scheduler, enter_scheduler_process

path = os.path.join(os.environ["NPU_SHIM_STATE_DIR"],
                    record_writer.record_name(socket.gethostname(), procinfo.pid_namespace(), os.getpid()))
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
