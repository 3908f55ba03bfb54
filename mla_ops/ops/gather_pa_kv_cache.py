"""`mla::gather_pa_kv_cache` and its functional twin: read every sequence's tokens out of paged
caches into contiguous `key [T, Hk, Dk]` / `value [T, Hv, Dv]`.

Argument names, order and defaults equal `torch_npu.npu_gather_pa_kv_cache(_functional)`, so code
moves between the two namespaces unchanged. For each sequence q and each token t < seq_len(q):

    seq_len(q)      = seq_lens[q+1] - seq_lens[q]   (is_seq_lens_cumsum: [Q+1], from 0)  or  seq_lens[q]
    output_base(q)  = seq_lens[q]                   (cumsum)                             or  sum(seq_lens[:q])
    table_offset(q) = seq_offset[q] // block_size   (0 when seq_offset is None)
    physical        = block_tables[q, table_offset(q) + t // block_size]
    key[output_base(q) + t]   = key_cache[physical, t % block_size]       (the same for value)

Rows of key/value no sequence covers are left untouched. The output size depends on the values of
seq_lens, so the allocating helper `mla_ops.gather_pa_kv_cache` decides it on the host (never inside
a graph) and calls the in-place op.

The reference kernel has two paths with one semantics. CPU tensors: the index values are validated
(clear errors, nothing written on a bad call) and the exact set of rows is planned on the host, whole
blocks copied block-wise. Other devices: no host sync (graph-capturable); every output row is
computed, rows no sequence covers are rewritten with their own values, and ids that validation would
reject are clamped so memory is never touched out of bounds (their rows get zeros).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._checks import (
    check_index,
    check_rank,
    check_same_device,
    check_size,
    check_writable_layout,
    memo_by_signature,
)
from .._library import define_op
from ._paged import check_cache_pair, check_token_tensor, first_bad, slot_index, validates_on_host, wide_rows


# ----------------------------------------------------------------------------------------- checks
def _check_gather_args(op: str, key_cache, value_cache, block_tables, seq_lens, key, value,
                       seq_offset: Optional[Tensor], is_seq_lens_cumsum: bool, writes_outputs: bool) -> None:
    """Caches [NB, bs, H*, D*]; block_tables [Q, max_blocks]; seq_lens [Q+1] (cumsum) or [Q];
    seq_offset [Q] or None; key [T, Hk, Dk], value [T, Hv, Dv] outputs (written in place unless
    functional, whose copies own their memory)."""
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
    if writes_outputs:  # both before anything is written: no half-done gather into key
        check_writable_layout(op, "key", key)
        check_writable_layout(op, "value", value)


@memo_by_signature
def check_gather_pa_kv_cache_args(key_cache, value_cache, block_tables, seq_lens, key, value, *,
                                  seq_offset=None, is_seq_lens_cumsum=False) -> None:
    _check_gather_args("gather_pa_kv_cache", key_cache, value_cache, block_tables, seq_lens, key, value,
                       seq_offset, is_seq_lens_cumsum, writes_outputs=True)


@memo_by_signature
def check_gather_pa_kv_cache_functional_args(key_cache, value_cache, block_tables, seq_lens, key, value, *,
                                             seq_offset=None, is_seq_lens_cumsum=False) -> None:
    _check_gather_args("gather_pa_kv_cache_functional", key_cache, value_cache, block_tables, seq_lens, key,
                       value, seq_offset, is_seq_lens_cumsum, writes_outputs=False)


def gather_sequence_layout(block_tables: Tensor, seq_lens: Tensor, seq_offset: Optional[Tensor],
                           is_seq_lens_cumsum: bool, block_size: int):
    """Per sequence: (starts, lens, first table column) as int64 tensors on block_tables' device.

    starts[q] is the first output row of sequence q (output_base), lens[q] its token count and
    table_offset[q] = seq_offset[q] // block_size. Sync-free.
    """
    seq_lens = seq_lens.long()
    if is_seq_lens_cumsum:
        starts, lens = seq_lens[:-1], seq_lens[1:] - seq_lens[:-1]
    else:
        lens = seq_lens
        starts = torch.cumsum(lens, 0) - lens
    if seq_offset is None:
        table_offset = torch.zeros_like(lens)
    else:
        table_offset = torch.div(seq_offset.long(), block_size, rounding_mode="floor")
    return starts, lens, table_offset


def check_gather_values(op: str, key_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, out_rows: int,
                        seq_offset: Optional[Tensor], is_seq_lens_cumsum: bool) -> int:
    """Validate the values of a gather call; returns the total token count (a host int)."""
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    block_tables, seq_lens = block_tables.cpu(), seq_lens.cpu().long()
    offsets = None if seq_offset is None else seq_offset.cpu().long()
    if is_seq_lens_cumsum:
        if seq_lens.numel() and int(seq_lens[0]) != 0:
            raise ValueError(f"mla.{op}: cumulative seq_lens must start at 0, got seq_lens[0] = {int(seq_lens[0])}; "
                             f"prepend a 0 or pass per-sequence lengths with is_seq_lens_cumsum=False")
        decreasing = seq_lens[1:] < seq_lens[:-1]  # compared, not subtracted: no int64 overflow
        if bool(decreasing.any()):
            i = first_bad(decreasing)
            raise ValueError(f"mla.{op}: cumulative seq_lens must never decrease, but seq_lens[{i + 1}] = "
                             f"{int(seq_lens[i + 1])} < seq_lens[{i}] = {int(seq_lens[i])}")
    elif bool((seq_lens < 0).any()):
        i = first_bad(seq_lens < 0)
        raise ValueError(f"mla.{op}: seq_lens[{i}] = {int(seq_lens[i])} is negative; lengths must be >= 0")
    if offsets is not None:
        if bool((offsets < 0).any()):
            i = first_bad(offsets < 0)
            raise ValueError(f"mla.{op}: seq_offset[{i}] = {int(offsets[i])} is negative; offsets must be >= 0")
        if bool((offsets % block_size != 0).any()):
            i = first_bad(offsets % block_size != 0)
            raise ValueError(f"mla.{op}: seq_offset[{i}] = {int(offsets[i])} is not a multiple of block_size "
                             f"{block_size}; offsets select whole block-table columns")
    starts, lens, table_offset = gather_sequence_layout(block_tables, seq_lens, offsets, is_seq_lens_cumsum,
                                                        block_size)
    columns = block_tables.shape[1]
    # Bounds before sums: an offset or length near 2**63 would overflow int64 in the arithmetic
    # below and slip past the range checks as a negative number.
    if bool((table_offset > columns).any()):
        q = first_bad(table_offset > columns)
        raise ValueError(f"mla.{op}: seq_offset[{q}] = {int(offsets[q])} starts at block-table column "
                         f"{int(table_offset[q])} but block_tables has only {columns} columns; offsets count tokens "
                         f"into a sequence's own table row (at most {columns} x block_size {block_size})")
    # ceil(len / block_size) without len + block_size - 1, and compared with the columns left rather than
    # multiplied out into tokens: neither can overflow int64
    blocks_needed = torch.div(lens, block_size, rounding_mode="floor") + (lens % block_size != 0).long()
    too_long = blocks_needed > columns - table_offset
    if bool(too_long.any()):
        q = first_bad(too_long)
        n, first = int(lens[q]), int(table_offset[q])  # Python ints: no overflow in the message
        raise ValueError(f"mla.{op}: sequence {q} needs block-table columns {first}.."
                         f"{first + -(-n // block_size) - 1} ({n} tokens from seq_offset "
                         f"{0 if offsets is None else int(offsets[q])}) but block_tables has only {columns} "
                         f"columns; seq_lens may hold at most {(columns - first) * block_size} tokens for it")
    total = sum(lens.tolist())  # Python ints: a sum over rows of an expanded table cannot wrap
    if total > out_rows:
        raise ValueError(f"mla.{op}: the sequences hold {total} tokens but key/value have only {out_rows} rows; "
                         f"allocate outputs of at least {total} rows (mla_ops.gather_pa_kv_cache does this)")
    last_col = table_offset + blocks_needed
    cols = torch.arange(columns)
    used = (cols >= table_offset[:, None]) & (cols < last_col[:, None])
    ids = block_tables.long()
    bad = used & ((ids < 0) | (ids >= num_blocks))
    if bool(bad.any()):
        q, j = (int(v) for v in torch.nonzero(bad)[0])
        raise ValueError(f"mla.{op}: block_tables[{q}, {j}] = {int(ids[q, j])} is used by sequence {q} but is "
                         f"not a block id in [0, {num_blocks})")
    return total



def _gather_pa_kv_cache_fake(key_cache, value_cache, block_tables, seq_lens, key, value, *,
                             seq_offset=None, is_seq_lens_cumsum=False) -> None:
    check_gather_pa_kv_cache_args(key_cache, value_cache, block_tables, seq_lens, key, value,
                                  seq_offset=seq_offset, is_seq_lens_cumsum=is_seq_lens_cumsum)


def _gather_pa_kv_cache_functional_fake(key_cache, value_cache, block_tables, seq_lens, key, value, *,
                                        seq_offset=None, is_seq_lens_cumsum=False):
    check_gather_pa_kv_cache_functional_args(key_cache, value_cache, block_tables, seq_lens, key, value,
                                             seq_offset=seq_offset, is_seq_lens_cumsum=is_seq_lens_cumsum)
    # The real kernel starts from key.clone() / value.clone(), which keeps their strides.
    return torch.empty_like(key), torch.empty_like(value)


# -------------------------------------------------------------------------------------- reference
def _gather_rows_into(dst: Tensor, cache: Tensor, src_slots: Tensor) -> None:
    """dst[i] = cache_slot[src_slots[i]] for all rows i of dst [n, H, D]."""
    n = dst.shape[0]
    if n == 0:
        return
    if cache.is_contiguous() and dst.is_contiguous():
        pool, out = wide_rows((cache, cache.shape[0] * cache.shape[1]), (dst, n))
        torch.index_select(pool, 0, src_slots, out=out)
    else:  # strided cache or output: one element-typed gather, then one copy
        dst.copy_(cache[slot_index(cache, src_slots)])


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
        pool, out = wide_rows((cache, cache.shape[0]), (dst[:head], aligned))
        torch.index_select(pool, 0, physical[:aligned], out=out)
    elif aligned:  # strided output or cache: token-wise for the whole blocks too
        whole = (physical[:aligned, None] * block_size + torch.arange(block_size)).view(-1)
        _gather_rows_into(dst[:head], cache, whole)
    _gather_rows_into(dst[head:head + slots.shape[0]], cache, slots)


def gather_sync_free(key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset,
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
    if columns:
        physical = block_tables[seq, col.clamp(0, columns - 1)].long()
    else:  # a [Q, 0] table (valid when every length is 0): no column to clamp into, no block to read
        physical = torch.full_like(col, -1)
    ok = covered & col_ok & (physical >= 0) & (physical < num_blocks)
    src = torch.where(ok, physical * block_size + torch.remainder(t, block_size), 0)
    for cache, out in ((key_cache, key), (value_cache, value)):
        gathered = cache[slot_index(cache, src)]
        gathered = torch.where(ok[:, None, None], gathered, 0)
        out.copy_(torch.where(covered[:, None, None], gathered, out))


def functional_gather(gather):
    """The out-of-place twin of an in-place gather kernel (every backend's `_functional` op): it
    writes into clones of key and value (keeping their strides) and returns them."""

    def gather_functional(key_cache, value_cache, block_tables, seq_lens, key, value, *, seq_offset=None,
                          is_seq_lens_cumsum=False, **extra):
        key_out, value_out = key.clone(), value.clone()
        gather(key_cache, value_cache, block_tables, seq_lens, key_out, value_out, seq_offset=seq_offset,
               is_seq_lens_cumsum=is_seq_lens_cumsum, **extra)
        return key_out, value_out

    gather_functional.__name__ = f"{gather.__name__}_functional"
    gather_functional.__doc__ = f"Out-of-place twin of {gather.__module__}.{gather.__name__}."
    return gather_functional




def gather_pa_kv_cache_reference(key_cache: Tensor, value_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                                 key: Tensor, value: Tensor, *, seq_offset: Optional[Tensor] = None,
                                 is_seq_lens_cumsum: bool = False) -> None:
    """Write the tokens of every sequence from the paged caches into key [T, Hk, Dk] / value [T, Hv, Dv]."""
    if key_cache.device.type != "cpu":
        gather_sync_free(key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset, is_seq_lens_cumsum)
        return
    total = check_gather_values("gather_pa_kv_cache", key_cache, block_tables, seq_lens, key.shape[0], seq_offset,
                                is_seq_lens_cumsum)
    if total == 0:
        return
    block_size = key_cache.shape[1]
    _, lens, table_offset = gather_sequence_layout(block_tables, seq_lens, seq_offset, is_seq_lens_cumsum,
                                                   block_size)
    physical, aligned, slots = _gather_plan_host(lens, table_offset, block_tables, block_size, total)
    _gather_into(key, key_cache, physical, aligned, slots)
    _gather_into(value, value_cache, physical, aligned, slots)


GATHER_PA_KV_CACHE = define_op(
    "gather_pa_kv_cache(Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
    "Tensor(a!) key, Tensor(b!) value, *, Tensor? seq_offset=None, bool is_seq_lens_cumsum=False) -> ()",
    check=check_gather_pa_kv_cache_args, fake=_gather_pa_kv_cache_fake, reference=gather_pa_kv_cache_reference,
)

# The functional twin (torch_npu's `_functional`): returns updated copies of key/value instead of
# writing them; what a graph compiler maps back onto the in-place op.
GATHER_PA_KV_CACHE_FUNCTIONAL = define_op(
    "gather_pa_kv_cache_functional(Tensor key_cache, Tensor value_cache, Tensor block_tables, "
    "Tensor seq_lens, Tensor key, Tensor value, *, Tensor? seq_offset=None, "
    "bool is_seq_lens_cumsum=False) -> (Tensor, Tensor)",
    check=check_gather_pa_kv_cache_functional_args, fake=_gather_pa_kv_cache_functional_fake,
    reference=functional_gather(gather_pa_kv_cache_reference),
)


# -------------------------------------------------------------------------------- public wrappers
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
        check_gather_pa_kv_cache_args(key_cache, value_cache, block_tables, seq_lens, key, value,
                                      seq_offset=seq_offset, is_seq_lens_cumsum=is_seq_lens_cumsum)
        check_gather_values("gather_pa_kv_cache", key_cache, block_tables, seq_lens, key.shape[0], seq_offset,
                            is_seq_lens_cumsum)
    torch.ops.mla.gather_pa_kv_cache.default(key_cache, value_cache, block_tables, seq_lens, key, value,
                                             seq_offset=seq_offset, is_seq_lens_cumsum=is_seq_lens_cumsum)


def _total_tokens(block_tables: Tensor, seq_lens: Tensor, is_seq_lens_cumsum: bool, block_size: int) -> int:
    """The output rows the helper allocates, read on the host, bounded before any allocation: an
    empty cumulative seq_lens or lengths summing past int64 would otherwise surface as an
    IndexError or a "negative dimension" from the allocator instead of naming seq_lens."""
    if seq_lens.dim() != 1 or block_tables.dim() != 2:  # the op's check names the wrong rank
        return int(seq_lens[-1]) if is_seq_lens_cumsum else int(seq_lens.sum())
    lens = seq_lens.tolist()  # Python ints: exact sums, no int64 wrap-around
    if is_seq_lens_cumsum and not lens:
        raise ValueError("mla.gather_pa_kv_cache: seq_lens is empty, but with is_seq_lens_cumsum=True it holds "
                         "num_seqs + 1 cumulative entries starting at 0 (pass [0] for no sequence)")
    total = lens[-1] if is_seq_lens_cumsum else sum(lens)
    capacity = block_tables.shape[0] * block_tables.shape[1] * block_size
    if total < 0 or total > capacity:
        raise ValueError(f"mla.gather_pa_kv_cache: seq_lens adds up to {total} tokens, but block_tables "
                         f"({block_tables.shape[0]} sequences x {block_tables.shape[1]} blocks of {block_size}) "
                         f"addresses at most {capacity}; each length must be between 0 and its table row's capacity")
    return total


def gather_pa_kv_cache(key_cache: Tensor, value_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, *,
                       seq_offset: Optional[Tensor] = None, is_seq_lens_cumsum: bool = False,
                       total_tokens: Optional[int] = None, validate: bool = False):
    """Gather every sequence's tokens from the paged caches into new contiguous tensors.

    The same arguments and defaults as the op (`is_seq_lens_cumsum=False`: `seq_lens` holds one
    length per sequence), minus the outputs, which are allocated here: their size depends on the
    values of `seq_lens`, so it is decided on the host (never inside a graph). Pass `total_tokens`
    when you know it to avoid reading `seq_lens` back.

    Args:
        key_cache: `[num_blocks, block_size, Hk, Dk]`, value_cache: `[num_blocks, block_size, Hv, Dv]`.
        block_tables: `[Q, max_blocks]` int32/int64, logical -> physical block per sequence.
        seq_lens: `[Q]` lengths, or `[Q + 1]` cumulative from 0 with `is_seq_lens_cumsum=True`.
        seq_offset: `[Q]` token offset of each sequence's first gathered token (a multiple of
            block_size; selects the starting block-table column), or None.
        total_tokens: rows to allocate; default `seq_lens.sum()` (or `seq_lens[-1]` when cumulative).
        validate: see :func:`gather_pa_kv_cache_into`.
    Returns:
        `(key [total_tokens, Hk, Dk], value [total_tokens, Hv, Dv])`.
    """
    if total_tokens is None:
        total_tokens = _total_tokens(block_tables, seq_lens, is_seq_lens_cumsum, key_cache.shape[1])
    if total_tokens < 0:
        raise ValueError(f"mla.gather_pa_kv_cache: total_tokens must be >= 0, got {total_tokens}")
    key = key_cache.new_empty((total_tokens, *key_cache.shape[2:]))
    value = value_cache.new_empty((total_tokens, *value_cache.shape[2:]))
    gather_pa_kv_cache_into(key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset=seq_offset,
                            is_seq_lens_cumsum=is_seq_lens_cumsum, validate=validate)
    return key, value
