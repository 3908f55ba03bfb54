"""Gather / scatter throughput of the paged-cache ops against a plain `copy_` of the same bytes.

MLA latent cache layout: key = latent [num_blocks, block_size, 1, L], value = k_pe
[num_blocks, block_size, 1, R]; sequences' blocks are a random permutation of the pool.
"""
from __future__ import annotations

import torch

import mla_ops  # noqa: F401  (registers torch.ops.mla)

from .timing import interleaved_medians, median_ratio


def measure(tokens: int = 65536, block_size: int = 128, lora_rank: int = 512, rope_dim: int = 64,
            num_seqs: int = 4, dtype: torch.dtype = torch.bfloat16, tail: int = 0, rounds: int = 5,
            min_run_time: float = 0.2, seed: int = 0) -> list[dict]:
    """Rows {variant, ms, gb_s, ratio_to_copy}. `tail` tokens are removed from the last sequence so
    it ends inside a block (the partial-block path)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = tokens // block_size
    key_cache = torch.randn(num_blocks, block_size, 1, lora_rank, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, 1, rope_dim, generator=g).to(dtype)
    blocks_per_seq = num_blocks // num_seqs
    tables = torch.randperm(num_blocks, generator=g)[: blocks_per_seq * num_seqs].view(num_seqs, -1).int()
    lens = torch.full((num_seqs,), blocks_per_seq * block_size)
    lens[-1] -= tail
    total = int(lens.sum())
    cumsum = torch.zeros(num_seqs + 1, dtype=torch.int32)
    cumsum[1:] = torch.cumsum(lens, 0)
    key = torch.empty(total, 1, lora_rank, dtype=dtype)
    value = torch.empty(total, 1, rope_dim, dtype=dtype)
    # scatter writes the same tokens back to the slots they were gathered from
    slots = (tables.long()[:, :, None] * block_size + torch.arange(block_size)).view(-1)[:total]
    copy_dst_k, copy_dst_v = torch.empty_like(key), torch.empty_like(value)
    src_k, src_v = key_cache.view(-1, 1, lora_rank)[:total], value_cache.view(-1, 1, rope_dim)[:total]

    def copy():
        copy_dst_k.copy_(src_k)
        copy_dst_v.copy_(src_v)

    def gather():
        torch.ops.mla.gather_pa_kv_cache(key_cache, value_cache, tables, cumsum, key, value, is_seq_lens_cumsum=True)

    def scatter():
        torch.ops.mla.scatter_pa_kv_cache(key, value, key_cache, value_cache, slots)

    results = interleaved_medians({"copy_": copy, "gather_pa_kv_cache": gather, "scatter_pa_kv_cache": scatter},
                                  rounds=rounds, min_run_time=min_run_time)
    payload = total * (lora_rank + rope_dim) * key.element_size()
    rows = []
    for name, r in results.items():
        rows.append({
            "variant": name, "tokens": total, "block_size": block_size, "dtype": str(dtype).removeprefix("torch."),
            "ms": r["median_s"] * 1e3, "gb_s": payload / r["median_s"] / 1e9,
            # throughput ratio = copy time / variant time, median of per-round ratios
            "ratio_to_copy": 1.0 / median_ratio(results, name, "copy_"),
        })
    return rows
