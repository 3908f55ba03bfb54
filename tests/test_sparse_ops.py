"""The sparse MLA ops against references nobody here wrote and against each other: transformers'
DeepSeek-V3.2 indexer module, dense absorbed decode when the top-k covers the whole context, the
global-slot convention, and the sparse benchmark's rows. (Every op x backend x sample against its
oracle, the error inputs, opcheck and compile are in tests/test_cases.py.)"""
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mla_ops
from mla_ops.cli import main
from mla_ops.ops.sparse_attention import lightning_indexer_sync_free, sparse_mla_attention_sync_free
from mla_ops.testing import suites
from mla_ops.testing.cases import CASES, Sample
from mla_ops.testing.oracles import (
    lightning_indexer_oracle,
    scatter_pa_cache_oracle,
    sparse_mla_attention_oracle,
)


def _one_request_layout(context: int, block_size: int, generator, *, num_blocks=None):
    """A shuffled block table for one request of `context` tokens."""
    blocks = -(-context // block_size)
    num_blocks = num_blocks or blocks + 3
    table = torch.randperm(num_blocks, generator=generator)[:blocks].to(torch.int32)[None]
    return table, num_blocks


def test_indexer_selects_what_transformers_deepseek_v32_indexer_selects():
    """The stock `DeepseekV32Indexer.forward` (no cache: keys of the prompt itself, causal mask) and
    mla.lightning_indexer on the same rotated q / k pick the same positions in the same order: random
    scores, no exact ties. Where scores tie exactly the op keeps the lower positions (the case
    database's tie samples) and torch.topk follows no rule, so the two can differ there."""
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
    # an integer that is not a Python int (numpy, a one-element tensor) is the block size it stands for
    for block_size in (np.int64(4), torch.tensor(4)):
        assert torch.equal(mla_ops.to_global_slots(indices, tables, starts, block_size), slots)


def test_global_slots_map_what_addresses_nothing_to_minus_one():
    """A negative position, one past the request's table, a padding block id (-1) and a table without
    columns address no cached token: -1, whatever the value."""
    tables = torch.tensor([[3, -1]], dtype=torch.int32)
    starts = torch.tensor([0, 1])
    got = mla_ops.to_global_slots(torch.tensor([[-4, -1, 1, 5, 8, 2**40]]), tables, starts, 4)
    assert got.tolist() == [[-1, -1, 13, -1, -1, -1]]
    empty = torch.zeros(1, 0, dtype=torch.int32)
    assert mla_ops.to_global_slots(torch.tensor([[0, -1, 3]]), empty, starts, 4).tolist() == [[-1, -1, -1]]


GLOBAL_SLOT_BASE = dict(topk_indices=torch.tensor([[0, 5]]), block_tables=torch.tensor([[3, 1]]),
                        query_start_loc=torch.tensor([0, 1]), block_size=4)


@pytest.mark.parametrize("changes,error,match", [
    (dict(topk_indices=torch.tensor([[0.7, 8.7, -0.3]])), RuntimeError, r"topk_indices must be an int32 or int64"),
    (dict(topk_indices=torch.tensor([0, 5])), RuntimeError, r"topk_indices must be 2-D \[tokens, topk\]"),
    (dict(topk_indices=torch.zeros(1, 2, 1, dtype=torch.int64)), RuntimeError, r"topk_indices must be 2-D"),
    (dict(block_tables=torch.tensor([3, 1])), RuntimeError, r"block_tables must be 2-D"),
    (dict(block_tables=torch.tensor([[3.0, 1.0]])), RuntimeError, r"block_tables must be an int32 or int64"),
    (dict(query_start_loc=torch.tensor([1])), RuntimeError,
     r"query_start_loc must have one entry per request plus one .*expected 2, got 1"),
    (dict(query_start_loc=torch.tensor([[0, 1]])), RuntimeError, r"query_start_loc must be 1-D"),
    (dict(block_size=0), RuntimeError, r"block_size must be a positive int .*got 0"),
    (dict(block_size=-64), RuntimeError, r"block_size must be a positive int"),
    (dict(block_size=4.0), RuntimeError, r"block_size must be a positive int .*got 4.0"),
    (dict(query_start_loc=torch.tensor([0, 2])), ValueError,
     r"query_start_loc\[-1\] = 2 must equal the number of query tokens \(1\)"),
    (dict(query_start_loc=torch.tensor([1, 1])), ValueError, r"query_start_loc must start at 0"),
    # block 2**26 x block size 64 = slot 2**32: refused, never wrapped around into [[0, 65]]
    (dict(block_tables=torch.tensor([[2**26, 1]]), block_size=64, topk_indices=torch.tensor([[0, 65]])), ValueError,
     r"topk_indices\[0, 0\] = 0 addresses slot 4294967296 .* which int32 cannot hold"),
    (dict(block_tables=torch.tensor([[2**62, 1]])), ValueError,
     r"topk_indices\[0, 0\] = 0 addresses slot 18446744073709551616"),
])
def test_global_slots_refuse_bad_arguments_naming_them(changes, error, match):
    args = {**GLOBAL_SLOT_BASE, **changes}
    with pytest.raises(error, match=r"mla\.to_global_slots: " + match):
        mla_ops.to_global_slots(**args)


# ------------------------------------------------------------------------------------------ fuzzers
def _requests(data, max_requests=3, block_size=None):
    """Random requests: (cached lengths, query counts, block size, block_tables, pool blocks), the pool
    shuffled, unused table columns -1; a batch of empty requests has a table without columns."""
    block_size = block_size or data.draw(st.sampled_from([1, 2, 4]))
    lens = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=max_requests))
    q_lens = [data.draw(st.integers(0, n)) for n in lens]
    columns = max(-(-n // block_size) for n in lens)
    num_blocks = sum(-(-n // block_size) for n in lens) + data.draw(st.integers(1, 3))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 10**6)))
    pool = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(lens), columns), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        for j in range(-(-n // block_size)):
            tables[b, j] = pool.pop()
    starts = torch.tensor([0, *torch.cumsum(torch.tensor(q_lens), 0).tolist()], dtype=torch.int32)
    return lens, q_lens, block_size, tables, num_blocks, starts, g


# scales a double holds but float32 does not (inf, zero, subnormal), beside ordinary ones
SCALES = st.sampled_from([0.25, 2.0 ** -7, 3.0, 1e39, 1e-46, 1e-40])
SCALE_REFUSED = r"softmax_scale must be a positive normal float32 number"


def _run_every_variant(op, sample, oracle_outputs, exact):
    """Every kernel variant serving `op` here against the oracle's outputs (bit-exact or within the op's
    fp32 bound), or, for a refused scale, each raising the error naming softmax_scale."""
    for variant in suites.variants():
        if not variant.has_kernel(op) or variant.not_supported_reasons(op, sample):
            continue
        if oracle_outputs is None:
            with pytest.raises(RuntimeError, match=SCALE_REFUSED):
                variant.run(op, sample)
            continue
        got = variant.run(op, sample)
        for g, w in zip(got, oracle_outputs):
            if exact:
                assert torch.equal(g, w.to(g.dtype)), (variant.name, g, w)
            else:
                assert suites.normalised_error(g, w) <= CASES[op].bound(variant.backend, torch.float32), variant.name


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_fuzz_indexer_ties_and_scales_on_every_variant(data):
    """Random request layouts (empty requests, tables without columns), 1 to 4 heads of small-integer q / k
    (exact scores: many tie, most at 0 after the ReLU), random top-k and scale: every variant (reference,
    sync-free path, each native ISA build) returns the oracle's positions bit for bit, equal scores in
    ascending position order, or refuses a scale float32 cannot hold."""
    lens, q_lens, block_size, tables, num_blocks, starts, g = _requests(data)
    heads, dim = data.draw(st.integers(1, 4)), data.draw(st.sampled_from([4, 16]))
    tokens = int(starts[-1])
    grid = lambda *shape: torch.randint(-2, 3, shape, generator=g).float()  # noqa: E731
    q, weights, k_cache = grid(tokens, heads, dim), grid(tokens, heads), grid(num_blocks, block_size, 1, dim)
    topk, scale = data.draw(st.integers(1, 12)), data.draw(SCALES)
    sample = Sample("fuzz", (q, weights, k_cache, tables, torch.tensor(lens, dtype=torch.int32), starts, topk, scale))
    refused = not (torch.finfo(torch.float32).tiny <= scale <= torch.finfo(torch.float32).max)
    want = None if refused else lightning_indexer_oracle(*sample.args)
    _run_every_variant("lightning_indexer", sample, want, exact=True)
    # the sync-free path (no value check) on a table without columns: nothing to read, every entry -1
    if tokens and not refused:
        empty = lightning_indexer_sync_free(q, weights, k_cache, tables[:, :0], torch.zeros_like(tables[:, 0]),
                                            starts, topk, scale)
        assert torch.equal(empty, torch.full((tokens, topk), -1, dtype=torch.int32))


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_fuzz_sparse_attention_lists_and_scales_on_every_variant(data):
    """Random request layouts and index lists (duplicates, -1, empty lists, tables without columns): every
    variant within the op's bound of the fp64 oracle, or the scale refused naming softmax_scale."""
    lens, q_lens, block_size, tables, num_blocks, starts, g = _requests(data)
    heads, lora, rope = 2, 8, 4
    tokens, width = int(starts[-1]), data.draw(st.integers(0, 6))
    indices = torch.full((tokens, width), -1, dtype=torch.int32)
    t = 0
    for n, q_len in zip(lens, q_lens):
        for i in range(q_len):
            seen = n - q_len + i + 1
            if width:
                indices[t] = torch.randint(-1, seen, (width,), generator=g)
            t += 1
    key_cache = torch.randn(num_blocks, block_size, 1, lora, generator=g)
    value_cache = torch.randn(num_blocks, block_size, 1, rope, generator=g)
    q_latent, q_pe = torch.randn(tokens, heads, lora, generator=g), torch.randn(tokens, heads, rope, generator=g)
    scale = data.draw(SCALES)
    sample = Sample("fuzz", (q_latent, q_pe, key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int32),
                             starts, indices, scale))
    refused = not (torch.finfo(torch.float32).tiny <= scale <= torch.finfo(torch.float32).max)
    want = None if refused else sparse_mla_attention_oracle(*sample.args)
    with torch.no_grad():
        _run_every_variant("sparse_mla_attention", sample, want, exact=False)
        # the sync-free path (no value check) on a table without columns: whatever is listed, zeros
        if tokens and not refused:
            empty = sparse_mla_attention_sync_free(q_latent, q_pe, key_cache, value_cache, tables[:, :0],
                                                   torch.zeros_like(tables[:, 0]), starts, indices, scale)
            assert torch.equal(empty, torch.zeros_like(q_latent))


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_fuzz_scatter_rows_that_are_views_of_the_pool(data):
    """The rows written are a random strided view of the pool itself (overlapping the written slots or
    not): every variant writes what the rows held before the call (the oracle reads them unwritten)."""
    blocks, block_size, dim = 4, data.draw(st.sampled_from([1, 2, 4])), 4
    slots_total = blocks * block_size
    tokens = data.draw(st.integers(0, slots_total // 2))
    first = data.draw(st.integers(0, slots_total - tokens))
    # distinct slots with padding (-1) among them: which of two rows for one slot stays is not promised
    slots = [max(s, -1) for s in data.draw(st.permutations(range(-tokens, slots_total)))[:tokens]]
    cache = torch.arange(slots_total * dim, dtype=torch.float32).view(blocks, block_size, 1, dim)

    def rebuild(args):
        return (args[1].view(slots_total, 1, dim)[first:first + tokens], *args[1:])

    sample = Sample("fuzz", rebuild((None, cache, torch.tensor(slots, dtype=torch.int64))), rebuild=rebuild)
    _run_every_variant("scatter_pa_cache", sample, scatter_pa_cache_oracle(*sample.args), exact=True)


@pytest.mark.slow
def test_bench_sparse_rows(tmp_path):
    path = tmp_path / "sparse.json"
    assert main(["bench", "sparse", "--contexts", "512,2500", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["decode"]
    assert [r["context"] for r in rows] == [512, 2500]
    assert all(r["dense_ms"] > 0 and r["sparse_step_ms"] > 0 and 0 < r["dense_memory_floor_fraction"] for r in rows)
