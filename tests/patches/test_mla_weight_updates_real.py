"""Weight updates on a server whose MLA weights the shim released, in real releases.

The request goes through the release's own update path as far as it runs on CPU: the scheduler's
real handler (``SchedulerUpdateWeightsMixin`` in 0.5.9 - 0.5.12, ``SchedulerWeightUpdaterManager``
from 0.5.13), the real (wrapped) ``BaseTpWorker`` method of a real ``TpModelWorker`` and, where the
shim delegates, the real model-runner update (``ModelRunner.update_weights_from_disk`` /
``WeightUpdater`` from 0.5.16) with sglang's real ``DefaultModelLoader`` reading a safetensors
checkpoint from disk into a model that holds a synthetic MLA layer (dev/shimdev/beds/mla_kernels.py)
whose weights went through the release's real ``npu_mla_preprocess``.  Only the scheduler's and the
worker's constructors are skipped (their attributes set by hand) and torch.distributed is a
1-process gloo group.  The program the release process runs: dev/shimdev/programs/mla_weight_updates.py.
"""
import pytest

from shimdev.envs import realsglang


@pytest.fixture(scope="module", params=["0.5.11", "0.5.19"])
def updates(request):
    return request.param, realsglang.run_program(request.param, "mla_weight_updates")


REFUSED = {  # the handler, and what the request's answer is in that release
    "disk": "UpdateWeightFromDiskReqOutput", "tensor": "UpdateWeightsFromTensorReqOutput",
    "init_group": "InitWeightsUpdateGroupReqOutput", "distributed": "UpdateWeightsFromDistributedReqOutput",
    "ipc": "UpdateWeightsFromIPCReqOutput", "again": "UpdateWeightFromDiskReqOutput",
}
OPS = {"disk": "update_weights_from_disk", "tensor": "update_weights_from_tensor",
       "init_group": "init_weights_update_group", "distributed": "update_weights_from_distributed",
       "ipc": "update_weights_from_ipc", "again": "update_weights_from_disk"}


def test_without_a_release_the_update_is_delegated_and_loads(updates):
    version, out = updates
    assert out["null"] == {"type": "UpdateWeightFromDiskReqOutput", "success": True,
                           "message": "Succeeded to update model weights."}, version
    assert out["null_loaded"] is True and out["null_flushed"] == 1


def test_every_update_request_is_answered_with_a_clean_refusal(updates):
    version, out = updates
    assert out["freed"] is True, version
    for key, output_type in REFUSED.items():
        answer = out[key]
        assert answer["type"] == output_type and answer["success"] is False, (version, key, answer)
        message = answer["message"]
        assert message.startswith("npu-shim refused %s: " % OPS[key]), message
        assert "qkv_a_proj.weight of layer 0, w_kc of layer 0; 31.5 MiB freed" in message
        assert "nothing was loaded" in message and "NPU_SHIM_MLA_WEIGHT_RELEASE=0" in message
    assert out["details"]["updates_refused"] == len(REFUSED)


def test_nothing_was_read_or_loaded_and_the_server_keeps_serving(updates):
    version, out = updates
    assert out["reads"] == 0, version  # the checkpoint was never opened
    assert out["untouched"] is True and out["flushed"] == 0
    assert out["barriers"] == 2  # tensor and IPC handlers still reach their TP barrier
    assert out["still_released"] == ["ReleasedParameter", "ReleasedTensor"]
    assert out["serves"] == [[4, 4, 64], [4, 16, 1, 64]]  # the next decode step runs


def test_what_the_refusal_prevents_the_release_own_rollback_raises_again(updates):
    """Bypassing the shim's wrapper: the release's update touches a released weight, and its
    failure path ("Rolling back to original weights") loads again outside its try, so the error
    leaves the update -- in a server, the scheduler's event loop."""
    version, out = updates
    kind, message, context = out["bypassed"]
    assert kind == "ReleasedWeightError" and context == ["ReleasedWeightError"], (version, out["bypassed"])
    assert "qkv_a_proj.weight of layer 0" in message
    assert out["serves_after_bypass"] == out["serves"]
