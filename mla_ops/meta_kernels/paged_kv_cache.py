"""Fake kernels and shared argument checks for the paged KV-cache ops (ARCHITECTURE §3.5):
`mla::scatter_pa_kv_cache`, `mla::gather_pa_kv_cache`, `mla::gather_pa_kv_cache_functional`.

Only metadata is checked here. The checks that need index values (block ids in range, cumsum
monotone, offsets divisible by block_size, output large enough) live in `mla_ops.ops.value_checks`:
they run eagerly on CPU and behind an explicit `validate=True` elsewhere, never in a captured graph.
"""
from typing import Optional

import torch

from ._checks import check_index, check_rank, check_same_device, check_same_dtype, check_size, eager_memo

CACHE_LAYOUT = "[num_blocks, block_size, heads, dim]"


def check_cache_pair(op: str, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    check_rank(op, "key_cache", key_cache, 4, CACHE_LAYOUT)
    check_rank(op, "value_cache", value_cache, 4, CACHE_LAYOUT)
    check_size(op, "value_cache", value_cache.shape[0], key_cache.shape[0],
               "num_blocks (dim 0) must equal key_cache's")
    check_size(op, "value_cache", value_cache.shape[1], key_cache.shape[1],
               "block_size (dim 1) must equal key_cache's")
    # an empty pool has no slot to clamp ids into: the sync-free paths could not stay in bounds
    torch._check(key_cache.shape[0] >= 1, lambda: f"mla.{op}: key_cache needs at least one block (dim 0), got 0")
    torch._check(key_cache.shape[1] >= 1, lambda: f"mla.{op}: block_size (key_cache dim 1) must be >= 1, got 0")


def check_token_tensor(op: str, name: str, t: torch.Tensor, cache_name: str, cache: torch.Tensor) -> None:
    """t [T, heads, dim] must match the cache's per-token [heads, dim] and dtype."""
    check_rank(op, name, t, 3, "[tokens, heads, dim]")
    check_size(op, name, t.shape[1], cache.shape[2], f"heads (dim 1) must equal {cache_name}.shape[2]")
    check_size(op, name, t.shape[2], cache.shape[3], f"head dim (dim 2) must equal {cache_name}.shape[3]")
    check_same_dtype(op, name, t, cache_name, cache)


@eager_memo
def check_scatter_args(key, value, key_cache, value_cache, slot_mapping) -> None:
    """key [T, Hk, Dk], value [T, Hv, Dv], caches [NB, bs, H*, D*], slot_mapping [T] int32/int64."""
    op = "scatter_pa_kv_cache"
    check_cache_pair(op, key_cache, value_cache)
    check_token_tensor(op, "key", key, "key_cache", key_cache)
    check_token_tensor(op, "value", value, "value_cache", value_cache)
    check_size(op, "value", value.shape[0], key.shape[0], "token count (dim 0) must equal key's")
    check_index(op, "slot_mapping", slot_mapping)
    check_rank(op, "slot_mapping", slot_mapping, 1, "[tokens]")
    check_size(op, "slot_mapping", slot_mapping.shape[0], key.shape[0],
               "length must equal the token count of key (use a negative slot for padding tokens)")
    check_same_device(op, {"key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache,
                           "slot_mapping": slot_mapping})


@eager_memo
def check_gather_args(op: str, key_cache, value_cache, block_tables, seq_lens, key, value,
                      seq_offset: Optional[torch.Tensor], is_seq_lens_cumsum: bool) -> None:
    """Caches [NB, bs, H*, D*]; block_tables [Q, max_blocks]; seq_lens [Q+1] (cumsum) or [Q];
    seq_offset [Q] or None; key [T, Hk, Dk], value [T, Hv, Dv] outputs."""
    check_cache_pair(op, key_cache, value_cache)
    check_token_tensor(op, "key", key, "key_cache", key_cache)
    check_token_tensor(op, "value", value, "value_cache", value_cache)
    check_size(op, "value", value.shape[0], key.shape[0], "row count (dim 0) must equal key's")
    check_index(op, "block_tables", block_tables)
    check_rank(op, "block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    check_index(op, "seq_lens", seq_lens)
    check_rank(op, "seq_lens", seq_lens, 1,
               "[num_seqs + 1] (cumulative, is_seq_lens_cumsum=True) or [num_seqs] (lengths)")
    num_seqs = block_tables.shape[0]
    if is_seq_lens_cumsum:
        check_size(op, "seq_lens", seq_lens.shape[0], num_seqs + 1,
                   "must have num_seqs + 1 entries (a cumulative sum starting at 0) when "
                   "is_seq_lens_cumsum=True; pass per-sequence lengths with is_seq_lens_cumsum=False")
    else:
        check_size(op, "seq_lens", seq_lens.shape[0], num_seqs,
                   "must have one length per sequence (block_tables rows) when is_seq_lens_cumsum=False; "
                   "pass a cumulative [num_seqs + 1] tensor with is_seq_lens_cumsum=True")
    if seq_offset is not None:
        check_index(op, "seq_offset", seq_offset)
        check_rank(op, "seq_offset", seq_offset, 1, "[num_seqs]")
        check_size(op, "seq_offset", seq_offset.shape[0], num_seqs, "needs one offset per sequence")
    check_same_device(op, {"key_cache": key_cache, "value_cache": value_cache, "block_tables": block_tables,
                           "seq_lens": seq_lens, "key": key, "value": value, "seq_offset": seq_offset})


def _scatter_pa_kv_cache_fake(key, value, key_cache, value_cache, slot_mapping) -> None:
    check_scatter_args(key, value, key_cache, value_cache, slot_mapping)


def _gather_pa_kv_cache_fake(key_cache, value_cache, block_tables, seq_lens, key, value, *,
                             seq_offset=None, is_seq_lens_cumsum=False) -> None:
    check_gather_args("gather_pa_kv_cache", key_cache, value_cache, block_tables, seq_lens, key, value,
                      seq_offset, is_seq_lens_cumsum)


def _gather_pa_kv_cache_functional_fake(key_cache, value_cache, block_tables, seq_lens, key, value, *,
                                        seq_offset=None, is_seq_lens_cumsum=False):
    check_gather_args("gather_pa_kv_cache_functional", key_cache, value_cache, block_tables, seq_lens,
                      key, value, seq_offset, is_seq_lens_cumsum)
    # The real kernel starts from key.clone() / value.clone(), which keeps their strides.
    return torch.empty_like(key), torch.empty_like(value)
