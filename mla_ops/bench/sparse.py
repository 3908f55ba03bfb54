"""Sparse MLA decode vs dense absorbed decode over the same paged cache (`mla-ops bench sparse`).

One attention layer of DeepSeek-V3.2 (128 heads, kv_lora 512, rope 64; indexer 64 heads x 128,
top-2048), bf16, B requests each at `context` cached tokens, one query token per request:

* dense: `mla.mla_decode_attention` over every cached token (what an MLA model without an indexer
  runs, and what a DSA model costs when its indexer is ignored);
* sparse: `mla.lightning_indexer` over the indexer-key cache, then `mla.sparse_mla_attention` over
  the 2048 positions it picked (the DSA decode step), plus each of the two alone.

Every variant reads its own cache bytes from memory each step; `bytes` and the memory floor (those
bytes at the machine's read bandwidth, measured here by `read_bandwidth_gb_s`) say how close each
comes. Prefill (`prefill_rows`): T query tokens of one request over their own causal context.
"""
from __future__ import annotations

import time

import torch

from .timing import interleaved_medians, median_ratio

HEADS, LATENT, ROPE = 128, 512, 64
INDEX_HEADS, INDEX_DIM, TOPK = 64, 128, 2048
BLOCK_SIZE = 64


def read_bandwidth_gb_s(megabytes: int = 512, repeats: int = 3) -> float:
    """Read bandwidth of this machine with torch's threads: the best of `repeats` sums over a buffer
    far larger than any cache (sum reads each byte once and writes nothing)."""
    buffer = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best / 1e9


def _layer(batch: int, context: int, dtype, generator, *, heads: int = HEADS):
    """Pools, tables and queries of one layer: `batch` requests of `context` tokens, one query each."""
    blocks = -(-context // BLOCK_SIZE)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    latent_pool = rand(batch * blocks, BLOCK_SIZE, 1, LATENT)
    k_pe_pool = rand(batch * blocks, BLOCK_SIZE, 1, ROPE)
    index_pool = rand(batch * blocks, BLOCK_SIZE, 1, INDEX_DIM)
    tables = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    return dict(latent_pool=latent_pool, k_pe_pool=k_pe_pool, index_pool=index_pool, tables=tables,
                seq_lens=seq_lens, q_latent=rand(batch, heads, LATENT), q_pe=rand(batch, heads, ROPE),
                q_index=rand(batch, INDEX_HEADS, INDEX_DIM), weights=rand(batch, INDEX_HEADS, scale=INDEX_HEADS ** -0.5)
                .float(), query_start_loc=torch.arange(batch + 1, dtype=torch.int32))


def _bytes(batch: int, context: int, element: int) -> dict:
    """Cache bytes each variant reads per step."""
    picked = min(TOPK, context)
    return {"dense": batch * context * (LATENT + ROPE) * element,
            "indexer": batch * context * INDEX_DIM * element,
            "sparse_attention": batch * picked * (LATENT + ROPE) * element}


def decode_rows(contexts=(4096, 32768), *, batch: int = 1, dtype=torch.bfloat16, rounds: int = 5,
                min_run_time: float = 0.3, seed: int = 0) -> list[dict]:
    scale = (128 + ROPE) ** -0.5  # DeepSeek-V3.2's qk_head_dim ** -0.5 (no YaRN factor: timing only)
    bandwidth = read_bandwidth_gb_s()
    rows = []
    for context in contexts:
        g = torch.Generator().manual_seed(seed)
        c = _layer(batch, context, dtype, g)

        def dense():
            return torch.ops.mla.mla_decode_attention(c["q_latent"], c["q_pe"], c["latent_pool"], c["k_pe_pool"],
                                                      c["tables"], c["seq_lens"], scale)

        def indexer():
            return torch.ops.mla.lightning_indexer(c["q_index"], c["weights"], c["index_pool"], c["tables"],
                                                   c["seq_lens"], c["query_start_loc"], TOPK, INDEX_DIM ** -0.5)

        picked = indexer()

        def sparse_attention():
            return torch.ops.mla.sparse_mla_attention(c["q_latent"], c["q_pe"], c["latent_pool"], c["k_pe_pool"],
                                                      c["tables"], c["seq_lens"], c["query_start_loc"], picked, scale)

        def sparse_step():
            chosen = indexer()
            return torch.ops.mla.sparse_mla_attention(c["q_latent"], c["q_pe"], c["latent_pool"], c["k_pe_pool"],
                                                      c["tables"], c["seq_lens"], c["query_start_loc"], chosen, scale)

        with torch.no_grad():
            results = interleaved_medians({"dense": dense, "sparse_step": sparse_step, "indexer": indexer,
                                           "sparse_attention": sparse_attention}, rounds=rounds,
                                          min_run_time=min_run_time)
        moved = _bytes(batch, context, c["latent_pool"].element_size())
        ms = {name: r["median_s"] * 1e3 for name, r in results.items()}
        floor_ms = {name: b / bandwidth / 1e6 for name, b in moved.items()}
        floor_ms["sparse_step"] = floor_ms["indexer"] + floor_ms["sparse_attention"]
        rows.append({
            "context": context, "batch": batch,
            **{f"{name}_ms": value for name, value in ms.items()},
            "dense_over_sparse": median_ratio(results, "dense", "sparse_step"),
            **{f"{name}_memory_floor_fraction": floor_ms[name] / ms[name] for name in ms},
        })
    first = rows[0]
    for row in rows:
        # how the sparse step grows with the context (ideal: flat past the top-k, plus the indexer's scan)
        row["sparse_step_over_first_context"] = row["sparse_step_ms"] / first["sparse_step_ms"]
    return rows


def prefill_rows(lengths=(8192,), *, dtype=torch.bfloat16, seed: int = 0, heads: int = HEADS) -> list[dict]:
    """One request's prefill of `length` tokens: the indexer over its causal context and sparse attention,
    one timed call each (a prefill at these lengths runs for seconds: a single call is the measurement)."""
    scale = (128 + ROPE) ** -0.5
    rows = []
    for length in lengths:
        g = torch.Generator().manual_seed(seed)
        c = _layer(1, length, dtype, g, heads=heads)
        q_index = (torch.randn(length, INDEX_HEADS, INDEX_DIM, generator=g)).to(dtype)
        weights = torch.randn(length, INDEX_HEADS, generator=g) * INDEX_HEADS ** -0.5
        q_latent = torch.randn(length, heads, LATENT, generator=g).to(dtype)
        q_pe = torch.randn(length, heads, ROPE, generator=g).to(dtype)
        starts = torch.tensor([0, length], dtype=torch.int32)
        with torch.no_grad():
            start = time.perf_counter()
            picked = torch.ops.mla.lightning_indexer(q_index, weights, c["index_pool"], c["tables"], c["seq_lens"],
                                                     starts, TOPK, INDEX_DIM ** -0.5)
            indexed = time.perf_counter()
            torch.ops.mla.sparse_mla_attention(q_latent, q_pe, c["latent_pool"], c["k_pe_pool"], c["tables"],
                                               c["seq_lens"], starts, picked, scale)
            done = time.perf_counter()
        rows.append({"tokens": length, "heads": heads, "indexer_s": indexed - start,
                     "sparse_attention_s": done - indexed, "total_s": done - start})
    return rows
