"""The GLM-4 MoE job the real-server tests and the benchmark serve (tests/test_real_server_moe.py,
scripts/bench_moe_server.py): ``--moe-a2a-backend deepep`` with the streams on, one EP rank.

* One EP rank: deep_ep's and zbal's Buffers recommend configs only for 2+ ranks, so sglang is
  given them (``--deepep-config``: their normal-mode configs for two ranks).
* ``SGLANG_DEEPEP_BF16_DISPATCH=1``: bf16 tokens into the low-latency dispatch (the NPU's "fp8"
  dispatch quantises to int8, which the bf16 expert path cannot take).
* ``SIMNPU_FUSED_KERNEL=1``: sgl-kernel-npu's ``norm.split_qkv_rmsnorm_rope`` in the image.
* ``SPEC_ARGS``: the same job with its MTP layer as the draft (``models.ensure_model("glm4_moe_mtp")``;
  NEXTN is EAGLE with the draft path = the model path): one draft step, top-1, two tokens per
  verify -- each decode step one target-verify batch (two tokens per request) and one draft
  extend; no draft decode batch (that needs two or more steps).  With NPU graphs on (the server's
  ``graphs=True``) the target-verify batch is the one captured and replayed; the draft extend runs
  eagerly (0.5.8 never captures draft-extend on NPU).
"""
import json

DEVICE_MIB = 512
DEEPEP_CONFIG = {
    "normal_dispatch": {"num_sms": 20, "num_max_nvl_chunked_send_tokens": 24,
                        "num_max_nvl_chunked_recv_tokens": 256, "num_max_rdma_chunked_send_tokens": 6,
                        "num_max_rdma_chunked_recv_tokens": 128},
    "normal_combine": {"num_sms": 20, "num_max_nvl_chunked_send_tokens": 10,
                       "num_max_nvl_chunked_recv_tokens": 256, "num_max_rdma_chunked_send_tokens": 6,
                       "num_max_rdma_chunked_recv_tokens": 128},
}
NPU_ARGS = ("--mem-fraction-static", "0.5", "--moe-a2a-backend", "deepep",
            "--deepep-config", json.dumps(DEEPEP_CONFIG))
NPU_ENV = {"SIMNPU_TOTAL_MIB": DEVICE_MIB, "SGLANG_NPU_USE_MULTI_STREAM": "1",
           "SGLANG_DEEPEP_BF16_DISPATCH": "1", "SIMNPU_FUSED_KERNEL": "1"}
#: ``--device cpu``: sglang's CPU engine, a KV cache bounded in tokens (its default is a fraction
#: of the machine's memory), no NPU in the processes at all.
CPU_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens", "4096")
CPU_ENV = {"SIMNPU_SERVER_DEVICE": "cpu", "SGLANG_USE_CPU_ENGINE": "1"}
#: Speculative decoding with the checkpoint's NextN (MTP) layer as the draft (0.5.8 turns NEXTN into
#: EAGLE and, for Glm4MoeForCausalLM, takes the model path as the draft's).
SPEC_ARGS = ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "1",
             "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2")
