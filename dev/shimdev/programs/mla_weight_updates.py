"""Weight-update requests after the MLA weights were released
(tests/patches/test_mla_weight_updates_real.py)."""
import atexit
import os
import shutil
import tempfile
import types

import torch
import torch.distributed as dist
from shimdev.beds import mla_kernels as K
from safetensors.torch import save_file
from npu_shim.runtime import activation
from sglang.srt.managers import io_struct as IO
from sglang.srt.managers import tp_worker as TW
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.utils import MultiprocessingSerializer
from shimdev.programs import emit

NEW = hasattr(__import__("sglang.srt.model_executor.model_runner", fromlist=["x"]).ModelRunner,
              "init_weight_updater")  # 0.5.16+: the runner's updates live in its WeightUpdater
# The TP barrier the tensor / IPC handlers reach after answering (torch's own needs a registered
# accelerator, which the simulated NPU is not): recorded, so each handler is seen to get there.
BARRIERS = []
dist.barrier = lambda group=None, **kw: BARRIERS.append(group)
release = activation.RUNTIME.record("mla_weight_release").process_state


class Model(torch.nn.Module):
    """A model whose load_weights is sglang's default_weight_loader per parameter (as
    DeepseekV2ForCausalLM does for the weights it does not stack)."""

    def __init__(self, attn):
        super().__init__()
        self.attn = attn
        for module in self.modules():  # what the loader calls after loading (unquantized: nothing)
            method = getattr(module, "quant_method", None)
            if method is not None and not hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading = lambda layer: None

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, weight in weights:
            default_weight_loader(params[name], weight)


def checkpoint(tensors):
    path = tempfile.mkdtemp(prefix="ckpt-")
    atexit.register(shutil.rmtree, path, True)  # the scenario's process is the checkpoint's only reader
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    return path


def runner_for(model):
    import sglang.srt.model_executor.model_runner as MR

    config = types.SimpleNamespace(model_path=None, revision=None, dtype=K.DTYPE, quantization=None,
                                   modelopt_quant=None, hf_config=types.SimpleNamespace(architectures=["X"]))
    runner = object.__new__(MR.ModelRunner)
    runner.__dict__.update(device="cpu", gpu_id=0, tp_rank=0, model=model, model_config=config,
                           server_args=types.SimpleNamespace(custom_weight_loader=[], weight_cache_mode="off"))
    if NEW:
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

        def update_fields(model, **fields):
            runner.model = model
        runner.weight_updater = WeightUpdater(
            tp_rank=0, device="cpu", gpu_id=0, model_config=config, custom_weight_loaders={},
            get_model=lambda: runner.model, update_model_fields=update_fields,
            recapture_cuda_graph=lambda: None, get_model_runner=lambda: runner)
    return runner


def worker_for(runner):
    worker = object.__new__(TW.TpModelWorker)
    worker.__dict__.update(_model_runner=runner, tp_rank=0, ps=types.SimpleNamespace(tp_rank=0))
    return worker


def scheduler_for(worker):
    """The release's real handler of the update requests, around ``worker``."""
    flushed = []
    try:
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    except ImportError:
        from sglang.srt.managers.scheduler_update_weights_mixin import SchedulerUpdateWeightsMixin

        handler = object.__new__(type("Scheduler", (SchedulerUpdateWeightsMixin,), {}))
        handler.__dict__.update(tp_worker=worker, draft_worker=None, tp_cpu_group=None,
                                flush_cache=lambda *a, **k: flushed.append(1) or True)
    else:
        handler = SchedulerWeightUpdaterManager(
            tp_worker=worker, draft_worker=None, tp_cpu_group=None, memory_saver_adapter=None,
            flush_cache=lambda *a, **k: flushed.append(1) or True, is_fully_idle=lambda: True,
            scheduler=types.SimpleNamespace(record_weight_version_change=lambda **k: None))
    return handler, flushed


def answer(output):
    return {"type": type(output).__name__, "success": output.success, "message": output.message}


def serve(m):
    """One more decode step through the release's npu_mla_preprocess (what the server does next)."""
    import importlib
    module = importlib.import_module(K.MLA_NPU)
    hidden, positions, batch, context = K.make_batch("glm-5")
    with context:
        out = module.npu_mla_preprocess(m, hidden, positions, batch, None)
    return [list(t.shape) for t in out if isinstance(t, torch.Tensor)][:2]


out = {}
c = K.CONFIGS["glm-5"]

# -- not released in this process (role null): the shim delegates, the real update loads.
release.reset()
K.publish_server_args("null")
r = K.run_layer("glm-5", 16)
model = Model(r["layer"])
handler, flushed = scheduler_for(worker_for(runner_for(model)))
gamma = torch.full((c["q_lora"],), 2.0, dtype=K.DTYPE)
req = IO.UpdateWeightFromDiskReqInput(model_path=checkpoint({"attn.q_a_layernorm.weight": gamma}),
                                      load_format="auto")
out["null"] = answer(handler.update_weights_from_disk(req))
out["null_loaded"] = bool(torch.equal(model.attn.q_a_layernorm.weight, gamma))
out["null_flushed"] = len(flushed)

# -- decode role: both weights released by the release's own path.
release.reset()
K.publish_server_args("decode")
r = K.run_layer("glm-5", 16)
m = r["layer"]
out["freed"] = r["freed"] == r["expected"]
model = Model(m)
runner = runner_for(model)
worker = worker_for(runner)
handler, flushed = scheduler_for(worker)
before = m.q_a_layernorm.weight.clone()
path = checkpoint({"attn.q_a_layernorm.weight": gamma,
                   "attn.fused_qkv_a_proj_with_mqa.weight": torch.zeros(
                       c["q_lora"] + c["kv_lora"] + c["rope"], c["hidden"], dtype=K.DTYPE)})
reads = []
import sglang.srt.model_loader.loader as L  # noqa: E402 - where its weight reads are counted
real_iter = L.DefaultModelLoader._get_weights_iterator
L.DefaultModelLoader._get_weights_iterator = lambda self, source: reads.append(1) or real_iter(self, source)

out["disk"] = answer(handler.update_weights_from_disk(
    IO.UpdateWeightFromDiskReqInput(model_path=path, load_format="auto")))
out["tensor"] = answer(handler.update_weights_from_tensor(IO.UpdateWeightsFromTensorReqInput(
    serialized_named_tensors=[MultiprocessingSerializer.serialize([("attn.q_a_layernorm.weight", gamma)])],
    load_format=None)))
out["init_group"] = answer(handler.init_weights_update_group(IO.InitWeightsUpdateGroupReqInput(
    master_address="127.0.0.1", master_port=29999, rank_offset=1, world_size=2, group_name="g")))
out["distributed"] = answer(handler.update_weights_from_distributed(IO.UpdateWeightsFromDistributedReqInput(
    names=["attn.q_a_layernorm.weight"], dtypes=["bfloat16"], shapes=[[c["q_lora"]]], group_name="g")))
out["ipc"] = answer(handler.update_weights_from_ipc(IO.UpdateWeightsFromIPCReqInput(zmq_handles={})))
out["again"] = answer(handler.update_weights_from_disk(
    IO.UpdateWeightFromDiskReqInput(model_path=path, load_format="auto")))
out["reads"] = len(reads)
out["flushed"] = len(flushed)
out["barriers"] = len(BARRIERS)
out["untouched"] = bool(torch.equal(m.q_a_layernorm.weight, before))
out["still_released"] = [type(m.fused_qkv_a_proj_with_mqa.weight).__name__, type(m.w_kc).__name__]
out["serves"] = serve(m)
out["details"] = dict(activation.RUNTIME.record("mla_weight_release").details)

# -- what the shim prevents: the release's own update on released weights (wrapper bypassed).
unwrapped = TW.BaseTpWorker.update_weights_from_disk.__wrapped__
try:
    unwrapped(worker, IO.UpdateWeightFromDiskReqInput(model_path=path, load_format="auto"))
    out["bypassed"] = "no error"
except Exception as exc:  # noqa: BLE001 - whatever the release's own update raises is the fact
    out["bypassed"] = [type(exc).__name__, str(exc)[:200], [type(e).__name__ for e in (exc.__context__,) if e]]
out["serves_after_bypass"] = serve(m)
emit(out)
