"""A collective inside an NPU graph capture on the simulated NPU: sglang's TP decode all-reduces
each layer's output inside the captured forward (HCCL collectives are captured on a device); the
simulation's stand-in (Gloo over the CPU tensors) must be recorded like any device op and run again,
and waited for, at each replay -- it handed its ``Work`` to the host and failed the capture of every
TP 2 server."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from shimdev import DEV

CODE = """
import json, os
from shimdev import simnpu
simnpu.install(server=True)
import torch, torch_npu
import torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
s = torch.npu.Stream()
x = torch.zeros(4, device="npu")
g = torch.npu.NPUGraph()
with torch.npu.graph(g, pool=torch.npu.graph_pool_handle(), stream=s):
    x.add_(1)
    dist.all_reduce(x)
    x.mul_(2)
at_capture = x.tolist()
g.replay()
once = x.tolist()
g.replay()
print(json.dumps({"capture": at_capture, "once": once, "twice": x.tolist()}))
dist.destroy_process_group()
"""


def test_a_collective_is_captured_and_run_again_at_each_replay():
    from shimdev.server.process import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("TASK_QUEUE_ENABLE", "ASCEND_LAUNCH_BLOCKING")}
    env.update(PYTHONPATH=str(DEV), PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo")
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(CODE)], capture_output=True, text=True,
                       timeout=240, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    # nothing lands at capture; each replay adds 1, all-reduces (one rank: the sum is itself) and
    # doubles, in that order
    assert out == {"capture": [0.0] * 4, "once": [2.0] * 4, "twice": [6.0] * 4}
