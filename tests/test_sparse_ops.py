"""The sparse MLA ops against references nobody here wrote and against each other: transformers'
DeepSeek-V3.2 indexer module, dense absorbed decode when the top-k covers the whole context, the
global-slot convention, and the sparse benchmark's rows. (Every op x backend x sample against its
oracle, the error inputs, opcheck and compile are in tests/test_cases.py.)"""
import json

import pytest
import torch

import mla_ops
from mla_ops.cli import main


def _one_request_layout(context: int, block_size: int, generator, *, num_blocks=None):
    """A shuffled block table for one request of `context` tokens."""
    blocks = -(-context // block_size)
    num_blocks = num_blocks or blocks + 3
    table = torch.randperm(num_blocks, generator=generator)[:blocks].to(torch.int32)[None]
    return table, num_blocks


def test_indexer_selects_what_transformers_deepseek_v32_indexer_selects():
    """The stock `DeepseekV32Indexer.forward` (no cache: keys of the prompt itself, causal mask) and
    mla.lightning_indexer on the same rotated q / k pick the same positions in the same order."""
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf

    config = DeepseekV32Config(hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
                               qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, index_topk=8,
                               index_head_dim=32, index_n_heads=8, num_hidden_layers=1, vocab_size=64)
    torch.manual_seed(0)
    indexer = hf.DeepseekV32Indexer(config, layer_idx=0).eval()
    rotary = hf.DeepseekV32RotaryEmbedding(config)
    seq = 21  # longer than index_topk: the choice matters
    hidden = torch.randn(1, seq, config.hidden_size)
    q_resid = torch.randn(1, seq, config.q_lora_rank)
    positions = torch.arange(seq)[None]
    cos, sin = rotary(hidden, positions)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()[None]
    stock = indexer(hidden, q_resid, (cos, sin), causal, positions)[0]  # [S, topk]

    with torch.no_grad():  # the indexer's own projections and its (half-split) RoPE, as stock computes them
        q = indexer.wq_b(q_resid).view(1, seq, config.index_n_heads, config.index_head_dim)
        k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
        rope = config.qk_rope_head_dim
        q_rot, k_rot = hf.apply_rotary_pos_emb(q[..., :rope], k[..., :rope], cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., rope:]], -1)[0]  # [S, H, D]
        k = torch.cat([k_rot, k[..., rope:]], -1)[0]  # [S, 1, D]
        weights = indexer.weights_proj(hidden).float()[0] * config.index_n_heads ** -0.5
    got = torch.ops.mla.lightning_indexer(q, weights, k.view(1, seq, 1, -1), torch.zeros(1, 1, dtype=torch.int32),
                                          torch.tensor([seq]), torch.tensor([0, seq]), config.index_topk,
                                          indexer.softmax_scale)
    for p in range(seq):
        seen = min(config.index_topk, p + 1)  # stock also lists masked (future) positions past these
        assert got[p, :seen].tolist() == stock[p, :seen].tolist(), p
        assert (got[p, seen:] == -1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_step_over_the_whole_context_is_dense_decode(dtype):
    """With top-k >= the context the indexer lists every position, and sparse attention over them is
    mla.mla_decode_attention over the same cache (up to the order of the sums)."""
    g = torch.Generator().manual_seed(1)
    heads, latent, rope, block_size, context = 8, 64, 16, 16, 150
    table, num_blocks = _one_request_layout(context, block_size, g)
    latent_pool = torch.randn(num_blocks, block_size, 1, latent, generator=g).to(dtype)
    k_pe_pool = torch.randn(num_blocks, block_size, 1, rope, generator=g).to(dtype)
    index_pool = torch.randn(num_blocks, block_size, 1, 32, generator=g).to(dtype)
    q_latent = torch.randn(1, heads, latent, generator=g).to(dtype)
    q_pe = torch.randn(1, heads, rope, generator=g).to(dtype)
    seq_lens, starts = torch.tensor([context], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    picked = torch.ops.mla.lightning_indexer(torch.randn(1, 4, 32, generator=g).to(dtype), torch.randn(1, 4),
                                             index_pool, table, seq_lens, starts, 256, 0.25)
    assert sorted(picked[0, :context].tolist()) == list(range(context)) and (picked[0, context:] == -1).all()
    sparse = torch.ops.mla.sparse_mla_attention(q_latent, q_pe, latent_pool, k_pe_pool, table, seq_lens, starts,
                                                picked, 0.1)
    dense = torch.ops.mla.mla_decode_attention(q_latent, q_pe, latent_pool, k_pe_pool, table, seq_lens, 0.1)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(sparse.float(), dense.float(), rtol=tolerance, atol=tolerance)


def test_global_slots_follow_the_block_table():
    tables = torch.tensor([[3, 0, -1], [5, 2, 4]], dtype=torch.int32)
    starts = torch.tensor([0, 1, 3], dtype=torch.int32)
    indices = torch.tensor([[0, 5, -1], [9, 4, -1], [3, 11, 0]], dtype=torch.int32)
    slots = mla_ops.to_global_slots(indices, tables, starts, 4)
    # request 0 (row 0): 0 -> block 3 offset 0, 5 -> block 0 offset 1; request 1: 9 -> block 4 offset 1 ...
    assert slots.tolist() == [[12, 1, -1], [17, 8, -1], [23, 19, 20]]
    assert slots.dtype == torch.int32
    # a position whose block-table entry is padding (-1) has no slot
    assert mla_ops.to_global_slots(torch.tensor([[9]]), tables, torch.tensor([0, 1, 1]), 4).tolist() == [[-1]]


@pytest.mark.slow
def test_bench_sparse_rows(tmp_path):
    path = tmp_path / "sparse.json"
    assert main(["bench", "sparse", "--contexts", "512,2500", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["decode"]
    assert [r["context"] for r in rows] == [512, 2500]
    assert all(r["dense_ms"] > 0 and r["sparse_step_ms"] > 0 and 0 < r["dense_memory_floor_fraction"] for r in rows)
