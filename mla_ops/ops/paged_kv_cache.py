"""Public wrappers for the paged KV-cache ops (ARCHITECTURE §3.5)."""
from typing import Optional

import torch
from torch import Tensor

from ..meta_kernels.paged_kv_cache import check_gather_args, check_scatter_args
from .value_checks import check_gather_values, check_scatter_values, validates_on_host


def scatter_pa_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                        slot_mapping: Tensor, *, validate: bool = False) -> None:
    """Write token rows into paged caches in place: `cache[slot // bs, slot % bs] = row`.

    Args:
        key: `[T, Hk, Dk]`, value: `[T, Hv, Dv]` (for MLA: the latent `[T, 1, L]` and k_pe `[T, 1, R]`).
        key_cache: `[num_blocks, block_size, Hk, Dk]`, value_cache: `[num_blocks, block_size, Hv, Dv]`.
        slot_mapping: `[T]` int32/int64, `slot = block * block_size + offset`; negative = padding, skipped.
        validate: check slot values before writing. CPU calls always validate; on other devices the
            default (False) skips the host sync, and out-of-range slots are then skipped silently.
    """
    if validates_on_host(validate, key_cache):
        check_scatter_args(key, value, key_cache, value_cache, slot_mapping)  # shapes first: values index by them
        check_scatter_values("scatter_pa_kv_cache", slot_mapping, key_cache.shape[0] * key_cache.shape[1])
    torch.ops.mla.scatter_pa_kv_cache.default(key, value, key_cache, value_cache, slot_mapping)


def gather_pa_kv_cache_into(key_cache: Tensor, value_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                            key: Tensor, value: Tensor, *, seq_offset: Optional[Tensor] = None,
                            is_seq_lens_cumsum: bool = False, validate: bool = False) -> None:
    """`torch.ops.mla.gather_pa_kv_cache` (torch_npu's argument names and defaults), plus `validate`.

    For each sequence q and token t < seq_len(q):
    `key[output_base(q) + t] = key_cache[block_tables[q, seq_offset[q] // bs + t // bs], t % bs]`
    (the same for value); rows no sequence covers are left untouched. `validate`: check the index
    values on non-CPU devices too (a host sync; CPU calls always check).
    """
    if validates_on_host(validate, key_cache):
        check_gather_args("gather_pa_kv_cache", key_cache, value_cache, block_tables, seq_lens, key, value,
                          seq_offset, is_seq_lens_cumsum)
        check_gather_values("gather_pa_kv_cache", key_cache, block_tables, seq_lens, key.shape[0], seq_offset,
                            is_seq_lens_cumsum)
    torch.ops.mla.gather_pa_kv_cache.default(key_cache, value_cache, block_tables, seq_lens, key, value,
                                             seq_offset=seq_offset, is_seq_lens_cumsum=is_seq_lens_cumsum)


def gather_pa_kv_cache(key_cache: Tensor, value_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, *,
                       seq_offset: Optional[Tensor] = None, cumsum: bool = True,
                       total_tokens: Optional[int] = None, validate: bool = False):
    """Gather every sequence's tokens from the paged caches into new contiguous tensors.

    The output size depends on the values of `seq_lens`, so it is decided here on the host (never
    inside a graph): pass `total_tokens` when you know it to avoid reading `seq_lens` back.

    Args:
        key_cache: `[num_blocks, block_size, Hk, Dk]`, value_cache: `[num_blocks, block_size, Hv, Dv]`.
        block_tables: `[Q, max_blocks]` int32/int64, logical -> physical block per sequence.
        seq_lens: `[Q + 1]` cumulative from 0 (`cumsum=True`, the default) or `[Q]` lengths.
        seq_offset: `[Q]` token offset of each sequence's first gathered token (a multiple of
            block_size; selects the starting block-table column), or None.
        total_tokens: rows to allocate; default `seq_lens[-1]` (cumsum) or `seq_lens.sum()`.
        validate: see :func:`gather_pa_kv_cache_into`.
    Returns:
        `(key [total_tokens, Hk, Dk], value [total_tokens, Hv, Dv])`.
    """
    if total_tokens is None:
        total_tokens = int(seq_lens[-1]) if cumsum else int(seq_lens.sum())
    if total_tokens < 0:
        raise ValueError(f"mla.gather_pa_kv_cache: total_tokens must be >= 0, got {total_tokens}")
    key = key_cache.new_empty((total_tokens, *key_cache.shape[2:]))
    value = value_cache.new_empty((total_tokens, *value_cache.shape[2:]))
    gather_pa_kv_cache_into(key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset=seq_offset,
                            is_seq_lens_cumsum=cumsum, validate=validate)
    return key, value
