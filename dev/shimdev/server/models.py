"""Tiny random-weight models and a tokenizer, made locally (no hub is reachable here).

``ensure_model("qwen2", version)`` returns a directory sglang's ``--model-path`` takes: a
transformers config with tiny sizes, weights from ``torch.manual_seed(0)`` saved as safetensors,
and a byte-level BPE tokenizer (vocabulary 1024) trained with ``tokenizers`` on a corpus made here
from a seeded generator, saved as a ``PreTrainedTokenizerFast`` with a chat template.

It is built by the release's own interpreter and layers (the release's transformers writes the
config it will read) and cached by content: ``CACHE/models/<kind>-<digest>``, the digest over the
spec below, this file and the transformers version -- a changed spec builds a new directory and
never replaces one a server is reading.
"""
from __future__ import annotations

import functools
import hashlib
import json
import subprocess
from pathlib import Path

from shimdev.envs import realsglang, sglang_envs

#: kind -> (transformers config class, its keyword arguments).  The sizes are the smallest that
#: sglang's NPU paths accept (head_dim 16: the attention stand-ins take any; 2 layers so that a
#: layer list has more than one entry).
SPECS = {
    "qwen2": ("Qwen2Config", dict(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")),
    # DeepSeek-V3.2 / GLM-5 style attention (DSA: MLA with the lightning indexer: ``index_*`` in
    # config.json makes sglang's is_deepseek_nsa true), all layers dense, as a modelslim W8A8
    # checkpoint whose q_b_proj (and the indexer's wq_b) are INT8 and whose kv_b_proj is in
    # ``ignore`` -- what routes 0.5.9 - 0.5.19's npu_mla_preprocess to forward_mlaprolog
    # (docs/mla-weight-release.md).  Everything else is "FLOAT" (bf16).
    "dsa": ("DeepseekV3Config", dict(
        vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=2, moe_layer_freq=1,
        max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6,
        rope_scaling={"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 2048,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
        architectures=["DeepseekV3ForCausalLM"],
        index_topk=16, index_head_dim=32, index_n_heads=4)),
    # GLM-4.5-shaped MoE (head_dim 64: 0.5.7/0.5.8 take the NPU rope only for 64/128/256/512):
    # layer 0 dense (first_k_dense_replace), layer 1 MoE with 8 routed experts
    # (top 2, sigmoid scores, one group) and one shared expert; q/k RMSNorm and half of each head
    # rotated, as GLM-4.5/4.6/4.7 (what the fused split_qkv_rmsnorm_rope path is for).  The
    # experts' gate_up is not square (2 x 48 != 64): tensors on the simulated npu say they are on
    # the cpu, so sglang's loader runs its device_loading_context round trip, which copies a
    # weight onto its own transposed view (0.5.10's load-time transpose) when the shape is square
    "glm4_moe": ("Glm4MoeConfig", dict(
        vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        partial_rotary_factor=0.5, use_qk_norm=True, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        norm_topk_prob=True, routed_scaling_factor=1.0, max_position_embeddings=2048,
        rope_theta=10000.0, rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, torch_dtype="bfloat16")),
}
# The same GLM-4 MoE with one MTP (NextN) layer, as GLM-4.5/4.6 checkpoints ship it: config.json's
# ``num_nextn_predict_layers: 1`` and the layer as ``model.layers.<num_hidden_layers>`` (an MoE
# decoder layer plus ``eh_proj``, ``enorm``, ``hnorm``, ``shared_head``).  sglang's target
# ``Glm4MoeForCausalLM.load_weights`` skips that layer; with ``--speculative-algorithm NEXTN`` the
# draft (``Glm4MoeForCausalLMNextN``, draft path = model path) loads only it.  transformers does
# not make it from Glm4MoeConfig: the "glm4_nextn_layer" step of _BUILD adds it.
SPECS["glm4_moe_mtp"] = (SPECS["glm4_moe"][0], dict(SPECS["glm4_moe"][1], num_nextn_predict_layers=1))

#: kind -> what is done to the saved checkpoint after ``save_pretrained`` (in _BUILD).
POST = {"dsa": "modelslim_w8a8_dsa", "glm4_moe_mtp": "glm4_nextn_layer"}

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

_BUILD = r'''
import json, random, sys
import torch, transformers
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

out, kind, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
cls_name, kwargs = spec["config"]
config = getattr(transformers, cls_name)(**kwargs)
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
model.save_pretrained(out, safe_serialization=True)


def take_shards():
    """Every tensor save_pretrained wrote, its shard files and index removed: a post step saves
    the checkpoint again as one model.safetensors."""
    import glob, os
    from safetensors.torch import load_file
    tensors = {}
    for f in sorted(glob.glob(out + "/*.safetensors")):
        tensors.update(load_file(f))
        os.remove(f)
    for f in glob.glob(out + "/*.safetensors.index.json"):
        os.remove(f)
    return tensors


if spec.get("post") == "modelslim_w8a8_dsa":
    # The DSA indexer's weights (transformers' DeepseekV3 has none), then modelslim W8A8: q_b_proj
    # and indexer.wq_b INT8 per output channel (weight_scale / weight_offset [out, 1]), the rest
    # FLOAT; kv_b_proj listed in "ignore" (what sends npu_mla_preprocess to forward_mlaprolog).
    from safetensors.torch import save_file
    tensors = take_shards()
    gen = torch.Generator().manual_seed(1)
    heads, head_dim, hidden = kwargs["index_n_heads"], kwargs["index_head_dim"], kwargs["hidden_size"]
    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.05).to(torch.bfloat16)
    for i in range(kwargs["num_hidden_layers"]):
        p = "model.layers.%d.self_attn.indexer." % i
        tensors[p + "wq_b.weight"] = rand(heads * head_dim, kwargs["q_lora_rank"])
        tensors[p + "wk.weight"] = rand(head_dim, hidden)
        tensors[p + "weights_proj.weight"] = rand(heads, hidden)
        tensors[p + "k_norm.weight"] = torch.ones(head_dim)
        tensors[p + "k_norm.bias"] = torch.zeros(head_dim)
    description, ignore = {}, []
    for name in sorted(tensors):
        if not name.endswith(".weight") or tensors[name].dim() != 2 or "embed" in name or "lm_head" in name:
            continue
        prefix = name[:-len(".weight")]
        if prefix.endswith(("self_attn.q_b_proj", "indexer.wq_b")):
            w = tensors[name].float()
            scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-8)
            tensors[name] = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
            tensors[prefix + ".weight_scale"] = scale.to(torch.bfloat16)
            tensors[prefix + ".weight_offset"] = torch.zeros_like(scale).to(torch.bfloat16)
            description[name] = "W8A8_DYNAMIC"
        else:
            description[name] = "FLOAT"
            if prefix.endswith("kv_b_proj"):
                ignore.append(prefix)
    description["ignore"] = ignore
    save_file(tensors, out + "/model.safetensors", metadata={"format": "pt"})
    json.dump(description, open(out + "/quant_model_description.json", "w"), indent=1, sort_keys=True)
if spec.get("post") == "glm4_nextn_layer":
    # The MTP layer, under the names a GLM-4.5 checkpoint gives it (model.layers.<n>, n =
    # num_hidden_layers): a decoder layer shaped as the last (MoE) one, with random weights of its
    # own, plus the NextN parts (eh_proj [hidden, 2*hidden], enorm, hnorm, shared_head.norm) and,
    # as the real checkpoints have them, shared_head.head and embed_tokens (sglang's draft takes
    # both from the target and skips these).
    from safetensors.torch import save_file
    tensors = take_shards()
    n, hidden = kwargs["num_hidden_layers"], kwargs["hidden_size"]
    gen = torch.Generator().manual_seed(2)
    last, mtp = "model.layers.%d." % (n - 1), "model.layers.%d." % n
    for name in sorted(tensors):
        if name.startswith(last):
            t = tensors[name]
            if name.endswith("norm.weight"):
                new = torch.ones_like(t)
            elif name.endswith("e_score_correction_bias"):
                new = torch.zeros_like(t)
            else:
                new = (torch.randn(t.shape, generator=gen) * 0.02).to(t.dtype)
            tensors[mtp + name[len(last):]] = new
    tensors[mtp + "eh_proj.weight"] = (torch.randn(hidden, 2 * hidden, generator=gen) * 0.02).to(torch.bfloat16)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[mtp + norm + ".weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, out + "/model.safetensors", metadata={"format": "pt"})

rng = random.Random(0)
syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "an", "el", "is", "or", "un", "th",
             "er", "ing", "the", "and", "of", "to", " ", ", ", ". ", "\n"]
corpus = ["".join(rng.choice(syllables) for _ in range(400)) for _ in range(400)]
corpus += ["The capital of France is", "Count to five:", "Hello, who are you?"] * 20
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=kwargs["vocab_size"], special_tokens=spec["special"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
tok.train_from_iterator(corpus, trainer)
fast = transformers.PreTrainedTokenizerFast(
    tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
    pad_token="<|end|>")
fast.chat_template = spec["chat_template"]
fast.save_pretrained(out)
json.dump({"kind": kind, "transformers": transformers.__version__}, open(out + "/tiny-model.json", "w"))
'''


@functools.lru_cache(maxsize=None)
def _transformers_version(version: str) -> str:
    """The release's transformers (a subprocess importing it: once per release and process)."""
    argv, env = realsglang.release_command(version, wrapt=None, env={"NPU_SHIM_ENABLED": "0"})
    out = subprocess.run(argv + ["-c", "import transformers; print(transformers.__version__)"],
                         env=env, capture_output=True, text=True, timeout=300, check=True)
    return out.stdout.strip()


def ensure_model(kind: str, version: str) -> Path:
    """The model directory of ``kind`` for release ``version`` (built once, under a file lock)."""
    cls_name, kwargs = SPECS[kind]
    spec = {"config": [cls_name, kwargs], "special": SPECIAL_TOKENS, "chat_template": CHAT_TEMPLATE,
            "post": POST.get(kind)}
    key = {"spec": spec, "code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
           "transformers": _transformers_version(version)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    d = sglang_envs.cache_dir() / "models" / f"{kind}-{digest}"

    def build(tmp: Path) -> dict:
        tmp.mkdir(parents=True)
        argv, env = realsglang.release_command(version, wrapt=None, env={"NPU_SHIM_ENABLED": "0"})
        p = subprocess.run(argv + ["-c", _BUILD, str(tmp), kind, json.dumps(spec)], env=env,
                           capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            raise sglang_envs.EnvError(f"building the tiny {kind} model failed:\n{p.stderr[-3000:]}")
        return {"model": key}

    return sglang_envs.build_once(d, f"model-{d.name}", build)
