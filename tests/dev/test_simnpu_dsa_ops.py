"""The reference math of the DSA decode path's stand-ins (dev/shimdev/simnpu/_ops/), against the
same computation written out plainly: a paged cache read through its block table, the indexer's
top-k, attention over what it selected, the W8A8 matmul, MLA's prolog."""
from __future__ import annotations

import torch

from shimdev.simnpu import _ops

PAGE = 4


def paged(rows, table):
    """``rows`` [n, d] of one request laid out in a [blocks, PAGE, 1, d] cache through ``table``."""
    cache = torch.zeros(8, PAGE, 1, rows.shape[-1])
    for i, row in enumerate(rows):
        cache[int(table[i // PAGE]), i % PAGE, 0] = row
    return cache


def test_lightning_indexer_picks_the_best_visible_keys_and_pads_with_minus_one():
    torch.manual_seed(0)
    keys = torch.randn(6, 8)
    table = torch.tensor([[3, 5]], dtype=torch.int32)
    q, w = torch.randn(1, 2, 8), torch.rand(1, 2)
    idx, _ = _ops.npu_lightning_indexer(
        q, paged(keys, table[0]), w, actual_seq_lengths_query=torch.tensor([1]),
        actual_seq_lengths_key=torch.tensor([6]), block_table=table, layout_query="TND",
        layout_key="PA_BSND", sparse_count=8)
    scores = (torch.relu(q[0] @ keys.T) * w[0][:, None]).sum(0)
    assert idx[0, 0, :6].tolist() == torch.topk(scores, 6).indices.tolist()
    assert idx[0, 0, 6:].tolist() == [-1, -1]


def test_sparse_attention_over_every_key_is_plain_mla_attention():
    torch.manual_seed(1)
    n, heads, kv_lora, rope = 5, 2, 8, 4
    latent, k_rope = torch.randn(n, kv_lora), torch.randn(n, rope)
    table = torch.tensor([[2, 6]], dtype=torch.int32)
    q, q_rope = torch.randn(1, heads, kv_lora), torch.randn(1, heads, rope)
    out, _, _ = _ops.npu_sparse_flash_attention(
        q, paged(latent, table[0]), paged(latent, table[0]), torch.arange(n).view(1, 1, n).int(), 0.5,
        block_table=table, actual_seq_lengths_query=torch.tensor([1]), actual_seq_lengths_kv=torch.tensor([n]),
        query_rope=q_rope, key_rope=paged(k_rope, table[0]), layout_query="TND", layout_kv="PA_BSND",
        attention_mode=2)
    probs = ((q[0] @ latent.T + q_rope[0] @ k_rope.T) * 0.5).softmax(-1)
    assert torch.allclose(out[0], probs @ latent, atol=1e-5)


def test_quant_matmul_dequantises_per_channel_and_per_token():
    x, w = torch.randint(-8, 8, (3, 4), dtype=torch.int8), torch.randint(-8, 8, (4, 5), dtype=torch.int8)
    scale, token = torch.rand(5), torch.rand(3)
    out = _ops.npu_quant_matmul(x, w, scale, pertoken_scale=token, output_dtype=torch.float32)
    assert torch.allclose(out, (x.float() @ w.float()) * scale * token[:, None])
    q, s = _ops.npu_dynamic_quant(torch.tensor([[1.0, -2.0, 0.5]]))
    assert q.tolist() == [[64, -127, 32]] and torch.allclose(s, torch.tensor([2.0 / 127]))


def test_mla_prolog_absorbs_w_uk_and_writes_both_caches_at_the_slots():
    torch.manual_seed(2)
    t, hidden, q_lora, heads, nope, rope, kv_lora = 2, 8, 4, 2, 3, 2, 4
    x = torch.randn(t, hidden)
    w_dq, w_uq = torch.randn(hidden, q_lora), torch.randn(q_lora, heads * (nope + rope))
    w_uk = torch.randn(heads, nope, kv_lora)
    w_dkv = torch.randn(hidden, kv_lora + rope)
    cos, sin = torch.ones(t, rope), torch.zeros(t, rope)  # rope the identity here
    kv, kr = torch.zeros(3, PAGE, 1, kv_lora), torch.zeros(3, PAGE, 1, rope)
    q_nope, q_pe, _, _, _ = _ops.npu_mla_prolog_v3(
        x, w_dq, w_uq, w_uk, w_dkv, torch.ones(q_lora), torch.ones(kv_lora), sin, cos, kv, kr,
        cache_index=torch.tensor([5, 9]), rmsnorm_epsilon_cq=1e-6, rmsnorm_epsilon_ckv=1e-6)
    cq = _ops._rms(x @ w_dq, torch.ones(q_lora), 1e-6)[0]
    q = (cq @ w_uq).view(t, heads, nope + rope)
    assert torch.allclose(q_nope, torch.einsum("thn,hnk->thk", q[..., :nope], w_uk), atol=1e-4)
    assert torch.allclose(q_pe, q[..., nope:], atol=1e-4)
    ckv = x @ w_dkv
    normed = _ops._rms(ckv[:, :kv_lora], torch.ones(kv_lora), 1e-6)[0]
    assert torch.allclose(kv.view(-1, kv_lora)[[5, 9]], normed, atol=1e-4)
    assert torch.allclose(kr.view(-1, rope)[[5, 9]], ckv[:, kv_lora:], atol=1e-4)
    assert kv.view(-1, kv_lora)[[0, 6]].abs().sum() == 0  # nothing else written


def test_batch_matmul_transpose_is_a_per_head_product_into_its_output():
    a, b = torch.randn(3, 2, 4), torch.randn(2, 4, 5)
    c = torch.empty(3, 2, 5)
    assert _ops.batch_matmul_transpose(a, b, c) is None
    assert torch.allclose(c, torch.bmm(a.transpose(0, 1), b).transpose(0, 1), atol=1e-5)
