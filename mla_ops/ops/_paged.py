"""Pieces shared by the paged KV-cache ops (scatter, gather, decode attention).

Caches are `[num_blocks, block_size, heads, dim]` (the ND layout of torch_npu's paged-attention
ops); for MLA, `key_cache` holds the latent (`heads=1, dim=L`) and `value_cache` holds the rotated
k_pe (`heads=1, dim=R`). A token's slot is `block * block_size + offset`.

Two kinds of validation:
* metadata checks (`check_cache_pair`, `check_token_tensor`, `check_latent_query_and_caches`):
  sync-free, shared by fakes and eager kernels;
* value checks (block ids in range, lengths, offsets): they read index tensors back to the host, so
  they are a host sync. CPU kernels run them on every call (the data is already on the host);
  other devices run them only when asked (`validate=True` in the Python helpers); none of them ever
  runs inside a captured graph. Each raises ValueError naming the argument, the offending entry and
  the fix, before anything is written.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._checks import check_float, check_rank, check_same_dtype, check_size

CACHE_LAYOUT = "[num_blocks, block_size, heads, dim]"


# ------------------------------------------------------------------------------- metadata checks
def check_cache_pair(op: str, key_cache: Tensor, value_cache: Tensor) -> None:
    check_rank(op, "key_cache", key_cache, 4, CACHE_LAYOUT)
    check_rank(op, "value_cache", value_cache, 4, CACHE_LAYOUT)
    check_size(op, "value_cache", value_cache.shape[0], key_cache.shape[0],
               "num_blocks (dim 0) must equal key_cache's")
    check_size(op, "value_cache", value_cache.shape[1], key_cache.shape[1],
               "block_size (dim 1) must equal key_cache's")
    # an empty pool has no slot to clamp ids into: the sync-free paths could not stay in bounds
    torch._check(key_cache.shape[0] >= 1, lambda: f"mla.{op}: key_cache needs at least one block (dim 0), got 0")
    torch._check(key_cache.shape[1] >= 1, lambda: f"mla.{op}: block_size (key_cache dim 1) must be >= 1, got 0")


def check_sinks(op: str, sinks, q: Tensor, q_name: str = "q") -> None:
    """sinks [heads] (fp32 or q's dtype), one sink logit per head of `q` [rows, heads, dim], or None."""
    if sinks is None:
        return
    check_float(op, "sinks", sinks)
    check_rank(op, "sinks", sinks, 1, "[heads] (one sink logit per head)")
    check_size(op, "sinks", sinks.shape[0], q.shape[1], f"length must equal the heads of {q_name} (dim 1)")
    torch._check(sinks.dtype in (torch.float32, q.dtype),
                 lambda: f"mla.{op}: sinks must be float32 or {q_name}'s dtype {q.dtype}, got {sinks.dtype}")


def check_q_scale(op: str, q_scale, q: Tensor, q_name: str = "q_latent") -> None:
    """q_scale [rows, heads] (fp32 or q's dtype), one query scale per row and head of `q` [rows, heads, dim], or
    None."""
    if q_scale is None:
        return
    check_float(op, "q_scale", q_scale)
    check_rank(op, "q_scale", q_scale, 2, "[rows, heads] (one query scale per row and head)")
    check_size(op, "q_scale", q_scale.shape[0], q.shape[0], f"rows (dim 0) must equal {q_name}'s")
    check_size(op, "q_scale", q_scale.shape[1], q.shape[1], f"heads (dim 1) must equal {q_name}'s")
    torch._check(q_scale.dtype in (torch.float32, q.dtype),
                 lambda: f"mla.{op}: q_scale must be float32 or {q_name}'s dtype {q.dtype}, got {q_scale.dtype}")


def row_scales(softmax_scale: float, q_scale, dtype: torch.dtype):
    """The scale each row's and head's scores are multiplied by: softmax_scale, or the product softmax_scale *
    q_scale [rows, heads] in `dtype` (fp32 / fp64: the scalar rounded to it first, as the kernels form it) as
    [rows, heads, 1]."""
    if q_scale is None:
        return softmax_scale
    return (q_scale.to(dtype) * softmax_scale)[:, :, None]


def softmax_with_sinks(scores: Tensor, sinks) -> Tensor:
    """softmax over the last dim of `scores` [rows, heads, width] (fp32 / fp64) with one more logit per head,
    `sinks` [heads] (None: a plain softmax), in the denominator only: with M = max(max_j s_j, sink),
    p_j = exp(s_j - M) / (sum_i exp(s_i - M) + exp(sink - M)). A row of only -inf scores gets zeros with a
    finite sink (NaN without one: the callers zero such rows)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    column = sinks.to(scores.dtype)[None, :, None].expand(scores.shape[0], -1, 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]


def check_token_tensor(op: str, name: str, t: Tensor, cache_name: str, cache: Tensor) -> None:
    """t [T, heads, dim] must match the cache's per-token [heads, dim] and dtype."""
    check_rank(op, name, t, 3, "[tokens, heads, dim]")
    check_size(op, name, t.shape[1], cache.shape[2], f"heads (dim 1) must equal {cache_name}.shape[2]")
    check_size(op, name, t.shape[2], cache.shape[3], f"head dim (dim 2) must equal {cache_name}.shape[3]")
    check_same_dtype(op, name, t, cache_name, cache)


def check_latent_query_and_caches(op: str, rows: str, q_latent: Tensor, q_pe: Tensor, key_cache: Tensor,
                                  value_cache: Tensor) -> None:
    """The absorbed MLA query and the cache pair it attends over: q_latent [rows, N, L] (floating),
    q_pe [rows, N, R]; key_cache [NB, bs, 1, L] (latent), value_cache [NB, bs, 1, R] (k_pe); all in
    q_latent's dtype. `rows` names dim 0 of the queries in the messages ("tokens", "batch")."""
    check_float(op, "q_latent", q_latent)
    check_rank(op, "q_latent", q_latent, 3, f"[{rows}, heads, kv_lora_rank] (q_nope absorbed with W_UK)")
    check_rank(op, "q_pe", q_pe, 3, f"[{rows}, heads, rope_dim] (rotated)")
    check_same_dtype(op, "q_pe", q_pe, "q_latent", q_latent)
    check_size(op, "q_pe", q_pe.shape[0], q_latent.shape[0], f"{rows} (dim 0) must equal q_latent's")
    check_size(op, "q_pe", q_pe.shape[1], q_latent.shape[1], "heads (dim 1) must equal q_latent's")
    check_cache_pair(op, key_cache, value_cache)
    check_size(op, "key_cache", key_cache.shape[2], 1, "heads (dim 2) must be 1: MLA caches one shared latent")
    check_size(op, "value_cache", value_cache.shape[2], 1, "heads (dim 2) must be 1: MLA caches one shared k_pe")
    check_size(op, "key_cache", key_cache.shape[3], q_latent.shape[2],
               "dim (dim 3) must equal kv_lora_rank, the last dim of q_latent")
    check_size(op, "value_cache", value_cache.shape[3], q_pe.shape[2],
               "dim (dim 3) must equal rope_dim, the last dim of q_pe")
    check_same_dtype(op, "key_cache", key_cache, "q_latent", q_latent)
    check_same_dtype(op, "value_cache", value_cache, "q_latent", q_latent)


# ---------------------------------------------------------------------------------- value checks
def validates_on_host(validate: bool, cache: Tensor) -> bool:
    """Whether a Python helper runs the value checks itself: asked to (`validate=True`) on a
    non-CPU device. CPU kernels always run them."""
    return bool(validate) and cache.device.type != "cpu"


def first_bad(mask: Tensor) -> int:
    """Index of the first True entry of a 1-D mask."""
    return int(torch.nonzero(mask)[0, 0])


def check_used_block_ids(op: str, block_tables: Tensor, used: list[int], num_blocks: int,
                         first: Optional[list[int]] = None, name: str = "block_tables") -> None:
    """Every block id row b reads (its columns first[b] <= j < used[b]; from 0 without `first`) lies in
    [0, num_blocks); `name` names the table in the message.

    Runs on every CPU call: when every row reads the same columns from 0 one min/max over that window
    decides; the offending entry is located only once something is wrong."""
    if not used or max(used) == 0:
        return
    window = block_tables[:, :max(used)]
    if min(used) == max(used) and not any(first or ()):
        lowest, highest = (int(v) for v in torch.aminmax(window))
        if lowest >= 0 and highest < num_blocks:
            return
    tables = window.cpu().long()
    column = torch.arange(tables.shape[1])[None, :]
    read = column < torch.tensor(used)[:, None]
    if first is not None:
        read &= column >= torch.tensor(first, dtype=torch.int64)[:, None]
    bad = read & ((tables < 0) | (tables >= num_blocks))
    if bool(bad.any()):
        b, j = (int(v) for v in torch.nonzero(bad)[0])
        raise ValueError(f"mla.{op}: {name}[{b}, {j}] = {int(tables[b, j])} is used by sequence {b} "
                         f"but is not a block id in [0, {num_blocks})")


# ----------------------------------------------------------------------------------- aliasing
def _storage_bytes(t: Tensor) -> tuple[int, int]:
    """[first, last + 1) bytes of `t`'s elements within its storage (strides are never negative)."""
    first = t.storage_offset()
    last = first + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return first * t.element_size(), (last + 1) * t.element_size()


def overlaps_memory(a: Tensor, b: Tensor) -> bool:
    """Whether `a` and `b` live in one storage with intersecting byte ranges from their first to their
    last element: at::get_overlap_status's full and partial overlap for dense tensors; for strided
    views the ranges decide, so interleaved columns of one pool count as overlapping. Metadata only."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage()._cdata != b.untyped_storage()._cdata:
        return False
    (a_first, a_end), (b_first, b_end) = _storage_bytes(a), _storage_bytes(b)
    return a_first < b_end and b_first < a_end


def read_before_writing(rows: Tensor, *caches: Tensor) -> Tensor:
    """`rows`, or a copy of them when they are a view of memory one of `caches` covers: the scatter ops
    read every input row as it is before the call, whichever rows are written first (the contract of
    every backend; the native kernels copy in the same case)."""
    return rows.clone() if any(overlaps_memory(rows, cache) for cache in caches) else rows


# ---------------------------------------------------------------------------- addressing helpers
_WIDE_DTYPES = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8)


def wide_rows(*tensors_and_rows: tuple[Tensor, int]) -> list[Tensor]:
    """Contiguous tensors holding rows of one layout, each viewed as [rows, row] of one common
    element type: the widest that divides the row and every tensor's byte offset (so a source and
    a destination always agree; index kernels need equal dtypes).

    ATen's index kernels cost per element, so fewer, wider elements reach copy_ speed (measured:
    bf16 index_put_ 0.54x of copy_, complex128 rows 0.9x)."""
    first, first_rows = tensors_and_rows[0]
    row_bytes = first.numel() // max(first_rows, 1) * first.element_size()
    for wide in _WIDE_DTYPES:
        size = wide.itemsize
        if row_bytes % size == 0 and all(t.storage_offset() * t.element_size() % size == 0
                                         for t, _ in tensors_and_rows):
            break
    return [t.view(rows, -1).view(wide) for t, rows in tensors_and_rows]


def slot_index(cache: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
    """Slots -> (block, offset) index pair: advanced indexing with it reads or writes the caller's
    cache in place whatever its strides (split views such as cache[..., :L] of a wider pool, or
    pools whose blocks are not evenly spaced) without copying the pool."""
    block_size = cache.shape[1]
    return torch.div(slots, block_size, rounding_mode="floor"), torch.remainder(slots, block_size)
