"""Checks that need the values of index tensors (ARCHITECTURE §2, §3.5).

They copy the (small) index tensors to the host, so they are a host sync: the CPU kernels run
them on every eager call (the data is already on the host), other devices run them only when asked
(`validate=True` in the Python helpers), and none of them ever runs inside a captured graph.
Each raises ValueError naming the argument, the offending entry and the fix, before anything is
written.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def gather_sequence_layout(block_tables: Tensor, seq_lens: Tensor, seq_offset: Optional[Tensor],
                           is_seq_lens_cumsum: bool, block_size: int):
    """Per sequence: (starts, lens, first table column) as int64 tensors on block_tables' device.

    starts[q] is the first output row of sequence q (`output_base` in §3.5), lens[q] its token
    count and table_offset[q] = seq_offset[q] // block_size. Sync-free.
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


def validates_on_host(validate: bool, cache: Tensor) -> bool:
    """Whether a Python helper runs the value checks itself: asked to (`validate=True`) on a
    non-CPU device. CPU kernels always run them."""
    return bool(validate) and cache.device.type != "cpu"


def _first_bad(mask: Tensor) -> int:
    return int(torch.nonzero(mask)[0, 0])


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
        steps = seq_lens[1:] - seq_lens[:-1]
        if bool((steps < 0).any()):
            i = _first_bad(steps < 0)
            raise ValueError(f"mla.{op}: cumulative seq_lens must never decrease, but seq_lens[{i + 1}] = "
                             f"{int(seq_lens[i + 1])} < seq_lens[{i}] = {int(seq_lens[i])}")
    elif bool((seq_lens < 0).any()):
        i = _first_bad(seq_lens < 0)
        raise ValueError(f"mla.{op}: seq_lens[{i}] = {int(seq_lens[i])} is negative; lengths must be >= 0")
    if offsets is not None:
        if bool((offsets < 0).any()):
            i = _first_bad(offsets < 0)
            raise ValueError(f"mla.{op}: seq_offset[{i}] = {int(offsets[i])} is negative; offsets must be >= 0")
        if bool((offsets % block_size != 0).any()):
            i = _first_bad(offsets % block_size != 0)
            raise ValueError(f"mla.{op}: seq_offset[{i}] = {int(offsets[i])} is not a multiple of block_size "
                             f"{block_size}; offsets select whole block-table columns")
    starts, lens, table_offset = gather_sequence_layout(block_tables, seq_lens, offsets, is_seq_lens_cumsum,
                                                        block_size)
    total = int(lens.sum())
    if total > out_rows:
        raise ValueError(f"mla.{op}: the sequences hold {total} tokens but key/value have only {out_rows} rows; "
                         f"allocate outputs of at least {total} rows (mla_ops.gather_pa_kv_cache does this)")
    blocks_needed = torch.div(lens + block_size - 1, block_size, rounding_mode="floor")
    last_col = table_offset + blocks_needed
    columns = block_tables.shape[1]
    if bool((last_col > columns).any()):
        q = _first_bad(last_col > columns)
        raise ValueError(f"mla.{op}: sequence {q} needs block-table columns {int(table_offset[q])}.."
                         f"{int(last_col[q]) - 1} ({int(lens[q])} tokens from seq_offset "
                         f"{0 if offsets is None else int(offsets[q])}) but block_tables has only {columns} "
                         f"columns")
    cols = torch.arange(columns)
    used = (cols >= table_offset[:, None]) & (cols < last_col[:, None])
    ids = block_tables.long()
    bad = used & ((ids < 0) | (ids >= num_blocks))
    if bool(bad.any()):
        q, j = (int(v) for v in torch.nonzero(bad)[0])
        raise ValueError(f"mla.{op}: block_tables[{q}, {j}] = {int(ids[q, j])} is used by sequence {q} but is "
                         f"not a block id in [0, {num_blocks})")
    return total


def check_scatter_values(op: str, slot_mapping: Tensor, num_slots: int) -> Tensor:
    """Slots must be < num_blocks * block_size (negative = padding). Returns the kept-token mask."""
    slots = slot_mapping.cpu()
    too_big = slots >= num_slots
    if bool(too_big.any()):
        i = _first_bad(too_big)
        raise ValueError(f"mla.{op}: slot_mapping[{i}] = {int(slots[i])} is outside the cache "
                         f"(num_blocks * block_size = {num_slots} slots); use a negative slot for padding")
    return slots >= 0


def check_decode_values(op: str, block_tables: Tensor, seq_lens: Tensor, num_blocks: int, block_size: int) -> int:
    """1 <= seq_lens <= table capacity, every used block id in range. Returns max(seq_lens).

    Runs on every CPU decode step, so it stays at a handful of small ops (lengths as a Python list,
    one min/max over the used window) and only locates the offending entry once something is wrong."""
    lens = seq_lens.tolist()
    if not lens:
        return 0
    capacity = block_tables.shape[1] * block_size
    for b, n in enumerate(lens):
        if n < 1:
            raise ValueError(f"mla.{op}: seq_lens[{b}] = {n}; each decoding sequence holds at least its current "
                             f"token (seq_lens >= 1)")
        if n > capacity:
            raise ValueError(f"mla.{op}: seq_lens[{b}] = {n} exceeds the block table's capacity "
                             f"({block_tables.shape[1]} blocks x {block_size} tokens)")
    used = [-(-n // block_size) for n in lens]
    window = block_tables[:, :max(used)]
    if min(used) == max(used):  # every row uses the whole window: one min/max decides
        lowest, highest = (int(v) for v in torch.aminmax(window))
        if lowest >= 0 and highest < num_blocks:
            return max(lens)
    tables = window.cpu().long()
    in_use = torch.arange(tables.shape[1])[None, :] < torch.tensor(used)[:, None]
    bad = in_use & ((tables < 0) | (tables >= num_blocks))
    if bool(bad.any()):
        b, j = (int(v) for v in torch.nonzero(bad)[0])
        raise ValueError(f"mla.{op}: block_tables[{b}, {j}] = {int(tables[b, j])} is used by sequence {b} "
                         f"but is not a block id in [0, {num_blocks})")
    return max(lens)
