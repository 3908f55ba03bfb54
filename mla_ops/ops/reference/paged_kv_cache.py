"""Reference paged KV-cache ops (ARCHITECTURE §3.5): scatter into and gather from
`[num_blocks, block_size, heads, dim]` caches.

These are the CPU product, not only an oracle: no Python loop per token or block. Token rows are
moved with `index_select(out=)` / `index_put_` over the cache viewed as `[slots, row]`, where a row
is reinterpreted as the widest element type that divides it (16-byte complex128 for MLA's 1 KiB
latent rows): ATen's index kernels cost per element, so fewer, wider elements reach copy_ speed
(measured: bf16 index_put_ 0.54x of copy_, complex128 rows 0.9x).

Two code paths, one semantics:
* CPU tensors: the index values are on the host already, so they are validated (clear errors,
  nothing written on a bad call) and the exact set of rows is computed on the host.
* other devices (CUDA, ...): no host sync (CUDA-graph capturable). Every output row is computed;
  rows no sequence covers are rewritten with their own values, and ids that validation would have
  rejected are clamped so memory is never touched out of bounds (gather writes zeros for them,
  scatter skips them). Pass `validate=True` to the Python helpers to get the CPU errors instead.
"""
from typing import Optional

import torch
from torch import Tensor

from ...meta_kernels.paged_kv_cache import check_gather_args, check_scatter_args
from ..value_checks import check_gather_values, check_scatter_values, gather_sequence_layout

_WIDE_DTYPES = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8)


def _wide_rows(*tensors_and_rows: tuple[Tensor, int]) -> list[Tensor]:
    """Contiguous tensors holding rows of one layout, each viewed as [rows, row] of one common
    element type: the widest that divides the row and every tensor's byte offset (so a source and
    a destination always agree; index kernels need equal dtypes)."""
    first, first_rows = tensors_and_rows[0]
    row_bytes = first.numel() // max(first_rows, 1) * first.element_size()
    for wide in _WIDE_DTYPES:
        size = wide.itemsize
        if row_bytes % size == 0 and all(t.storage_offset() * t.element_size() % size == 0
                                         for t, _ in tensors_and_rows):
            break
    return [t.view(rows, -1).view(wide) for t, rows in tensors_and_rows]


def _slot_index(cache: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
    """Slots -> (block, offset) index pair: advanced indexing with it reads or writes the caller's
    cache in place whatever its strides (split views such as cache[..., :L] of a wider pool, or
    pools whose blocks are not evenly spaced) without copying the pool."""
    block_size = cache.shape[1]
    return torch.div(slots, block_size, rounding_mode="floor"), torch.remainder(slots, block_size)


def _gather_rows_into(dst: Tensor, cache: Tensor, src_slots: Tensor) -> None:
    """dst[i] = cache_slot[src_slots[i]] for all rows i of dst [n, H, D]."""
    n = dst.shape[0]
    if n == 0:
        return
    if cache.is_contiguous() and dst.is_contiguous():
        pool, out = _wide_rows((cache, cache.shape[0] * cache.shape[1]), (dst, n))
        torch.index_select(pool, 0, src_slots, out=out)
    else:  # strided cache or output: one element-typed gather, then one copy
        dst.copy_(cache[_slot_index(cache, src_slots)])


def _gather_plan_host(lens: Tensor, table_offset: Tensor, block_tables: Tensor, block_size: int, total: int):
    """Where every gathered token comes from (CPU, validated inputs), built block-wise.

    Output rows are the sequences back to back (cumsum starts at 0): token order is (sequence,
    block, offset) with each sequence's tail block trimmed. Returns (physical, aligned, slots):
    `physical` [nb] is the block of every used block in that order; its first `aligned` entries are
    whole blocks landing on block-aligned output rows (every sequence before the first one with a
    partial tail block, plus that sequence's full blocks), copied block-wise; `slots` are the source
    slots of the remaining tokens, output rows aligned*block_size .. total-1, copied token-wise.
    """
    blocks = torch.div(lens + block_size - 1, block_size, rounding_mode="floor")
    num_blocks_used = int(blocks.sum())
    seq_of_block = torch.repeat_interleave(torch.arange(lens.shape[0]), blocks, output_size=num_blocks_used)
    first_block = torch.cumsum(blocks, 0) - blocks
    block_in_seq = torch.arange(num_blocks_used) - first_block[seq_of_block]
    physical = block_tables[seq_of_block, table_offset[seq_of_block] + block_in_seq].long()
    tails = torch.remainder(lens, block_size)
    if num_blocks_used * block_size == total:  # no partial tail block anywhere: all block-wise
        return physical, num_blocks_used, physical.new_empty(0)
    first_tail = int(torch.nonzero(tails)[0, 0])
    aligned = int(torch.div(lens[: first_tail + 1], block_size, rounding_mode="floor").sum())
    rest = slice(aligned, None)
    rows_in_block = (lens[seq_of_block[rest]] - block_in_seq[rest] * block_size).clamp(max=block_size)
    keep = torch.arange(block_size)[None, :] < rows_in_block[:, None]
    slots = (physical[rest, None] * block_size + torch.arange(block_size))[keep]
    return physical, aligned, slots


def _gather_into(dst: Tensor, cache: Tensor, physical: Tensor, aligned: int, slots: Tensor) -> None:
    """dst[:total] <- the tokens: whole blocks block-wise (rows of block_size*H*D, measured ~1.2x
    faster than token rows), the rest token-wise (see _gather_plan_host)."""
    block_size = cache.shape[1]
    head = aligned * block_size
    if aligned and dst.is_contiguous() and cache.is_contiguous():
        pool, out = _wide_rows((cache, cache.shape[0]), (dst[:head], aligned))
        torch.index_select(pool, 0, physical[:aligned], out=out)
    elif aligned:  # strided output or cache: token-wise for the whole blocks too
        whole = (physical[:aligned, None] * block_size + torch.arange(block_size)).view(-1)
        _gather_rows_into(dst[:head], cache, whole)
    _gather_rows_into(dst[head:head + slots.shape[0]], cache, slots)


def _gather_sync_free(key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset,
                      is_seq_lens_cumsum) -> None:
    """Device path: token-granular over all output rows, no host sync, clamped indices."""
    num_seqs, columns = block_tables.shape
    if num_seqs == 0 or key.shape[0] == 0:
        return
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    starts, lens, table_offset = gather_sequence_layout(block_tables, seq_lens, seq_offset, is_seq_lens_cumsum,
                                                        block_size)
    rows = torch.arange(key.shape[0], device=key.device)
    seq = torch.searchsorted(starts + lens, rows, right=True).clamp_(max=num_seqs - 1)
    t = rows - starts[seq]
    covered = (t >= 0) & (t < lens[seq])
    col = table_offset[seq] + torch.div(t, block_size, rounding_mode="floor")
    col_ok = (col >= 0) & (col < columns)
    physical = block_tables[seq, col.clamp(0, columns - 1)].long()
    ok = covered & col_ok & (physical >= 0) & (physical < num_blocks)
    src = torch.where(ok, physical * block_size + torch.remainder(t, block_size), 0)
    for cache, out in ((key_cache, key), (value_cache, value)):
        gathered = cache[_slot_index(cache, src)]
        gathered = torch.where(ok[:, None, None], gathered, 0)
        out.copy_(torch.where(covered[:, None, None], gathered, out))


def gather_pa_kv_cache(key_cache: Tensor, value_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                       key: Tensor, value: Tensor, *, seq_offset: Optional[Tensor] = None,
                       is_seq_lens_cumsum: bool = False) -> None:
    """Write the tokens of every sequence from the paged caches into key [T, Hk, Dk] / value [T, Hv, Dv]."""
    op = "gather_pa_kv_cache"
    check_gather_args(op, key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset,
                      is_seq_lens_cumsum)
    if key_cache.device.type != "cpu":
        _gather_sync_free(key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset,
                          is_seq_lens_cumsum)
        return
    total = check_gather_values(op, key_cache, block_tables, seq_lens, key.shape[0], seq_offset,
                                is_seq_lens_cumsum)
    if total == 0:
        return
    block_size = key_cache.shape[1]
    _, lens, table_offset = gather_sequence_layout(block_tables, seq_lens, seq_offset, is_seq_lens_cumsum,
                                                   block_size)
    physical, aligned, slots = _gather_plan_host(lens, table_offset, block_tables, block_size, total)
    _gather_into(key, key_cache, physical, aligned, slots)
    _gather_into(value, value_cache, physical, aligned, slots)


def functional_gather(gather):
    """The out-of-place twin of an in-place gather kernel (every backend's `_functional` op): it
    writes into clones of key and value (keeping their strides) and returns them."""

    def gather_functional(key_cache, value_cache, block_tables, seq_lens, key, value, *, seq_offset=None,
                          is_seq_lens_cumsum=False):
        key_out, value_out = key.clone(), value.clone()
        gather(key_cache, value_cache, block_tables, seq_lens, key_out, value_out, seq_offset=seq_offset,
               is_seq_lens_cumsum=is_seq_lens_cumsum)
        return key_out, value_out

    gather_functional.__name__ = f"{gather.__name__}_functional"
    gather_functional.__doc__ = f"Out-of-place twin of {gather.__module__}.{gather.__name__}."
    return gather_functional


gather_pa_kv_cache_functional = functional_gather(gather_pa_kv_cache)


_MAX_RANGE_HOLES = 8


def _scatter_blocks(pool: Tensor, src: Tensor, blocks: Tensor) -> None:
    """pool[blocks[i]] = src[i] for whole-block rows.

    When the blocks cover one contiguous range of the pool (a prefill into freshly allocated blocks,
    in any order) except for a few holes (e.g. the block a sequence's tail only partly fills), each
    hole-free stretch of the range is written as a gather from src through the inverse permutation:
    index_select's row copies run at copy_ speed, index_put_'s do not (measured 1.2x vs 0.9x of
    copy_ on 75 MB). Anything else (duplicates, scattered blocks) goes through index_put_."""
    n = blocks.shape[0]
    lowest, highest = (int(v) for v in torch.aminmax(blocks))
    span = highest - lowest + 1
    if span - n <= _MAX_RANGE_HOLES:
        order = torch.full((span,), -1, dtype=torch.long)
        order[blocks - lowest] = torch.arange(n)
        present = order >= 0
        if int(present.sum()) == n:  # no block written twice
            bounds = [-1, *torch.nonzero(~present).flatten().tolist(), span]
            for hole, next_hole in zip(bounds[:-1], bounds[1:]):
                if next_hole - hole > 1:
                    start, stop = hole + 1, next_hole
                    torch.index_select(src, 0, order[start:stop], out=pool[lowest + start:lowest + stop])
            return
    pool.index_put_((blocks,), src)


def _scatter_rows(cache: Tensor, slots: Tensor, src: Tensor) -> None:
    """cache_slot[slots[i]] = src[i] for all rows of src [n, H, D].

    Leading runs of block_size tokens that fill one whole block in order (a prefill's usual slot
    mapping) are written block-wise, rows of block_size*H*D (measured 0.90x of copy_ against 0.81x
    token-wise); the rest token-wise."""
    n, block_size = src.shape[0], cache.shape[1]
    if n == 0:
        return
    if not cache.is_contiguous():  # writes must land in the caller's strided tensor
        cache.index_put_(_slot_index(cache, slots), src)
        return
    src = src.contiguous()
    whole = n // block_size
    aligned = 0
    if whole:
        runs = slots[: whole * block_size].view(whole, block_size)
        starts = runs[:, 0]
        in_order = (torch.remainder(starts, block_size) == 0) & (runs == starts[:, None] + torch.arange(block_size)).all(1)
        aligned = whole if bool(in_order.all()) else int(torch.argmin(in_order.to(torch.int8)))
    head = aligned * block_size
    if aligned:
        blocks = torch.div(starts[:aligned], block_size, rounding_mode="floor")
        _scatter_blocks(*_wide_rows((cache, cache.shape[0]), (src[:head], aligned)), blocks)
    if head < n:
        pool, rows = _wide_rows((cache, cache.shape[0] * block_size), (src[head:], n - head))
        pool.index_put_((slots[head:],), rows)


def _scatter_sync_free(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Device path, no host sync: padding (negative) and out-of-range slots write nothing.

    Skipped tokens are redirected to the slot of the first kept token with that token's own data,
    so the duplicate writes are identical; with no kept token at all, slot 0 is rewritten with its
    own contents. Either way no memory is touched out of bounds.
    """
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    slots = slot_mapping.long()
    kept = (slots >= 0) & (slots < num_slots)
    any_kept = kept.any()
    first_kept = torch.argmax(kept.to(torch.int8))
    token = torch.where(kept, torch.arange(num_tokens, device=key.device), first_kept)
    dst = torch.where(any_kept, slots[token], 0)
    for src, cache in ((key, key_cache), (value, value_cache)):
        rows = torch.where(any_kept, src[token], cache[0, 0].unsqueeze(0))
        cache.index_put_(_slot_index(cache, dst), rows)


def scatter_pa_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                        slot_mapping: Tensor) -> None:
    """key_cache[slot // bs, slot % bs] = key[t] (same for value) for every token t with slot >= 0."""
    check_scatter_args(key, value, key_cache, value_cache, slot_mapping)
    if key_cache.device.type != "cpu":
        _scatter_sync_free(key, value, key_cache, value_cache, slot_mapping)
        return
    kept = check_scatter_values("scatter_pa_kv_cache", slot_mapping, key_cache.shape[0] * key_cache.shape[1])
    slots = slot_mapping.long()
    if not bool(kept.all()):
        slots, key, value = slots[kept], key[kept], value[kept]
    _scatter_rows(key_cache, slots, key)
    _scatter_rows(value_cache, slots, value)
