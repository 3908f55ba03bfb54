"""Paged KV-cache gather (`mla::gather_pa_kv_cache`, the GatherPaKvCache "Norm"/ND branch) as a PyPTO kernel.

For each sequence q and each token t < seq_len(q)::

    seq_len(q)      = seq_lens[q+1] - seq_lens[q]  (cumsum, [Q+1], starts at 0)  or  seq_lens[q]
    output_base(q)  = seq_lens[q]                  (cumsum)                       or  sum(seq_lens[:q])
    table_offset(q) = seq_offset[q] // block_size  (0 when seq_offset is None)
    physical        = block_tables[q, table_offset(q) + t // block_size]
    key[output_base(q) + t]   = key_cache[physical, t % block_size]
    value[output_base(q) + t] = value_cache[physical, t % block_size]

Rows of ``key``/``value`` not covered by any sequence keep their previous contents (written in
place; the SIM write-back preserves unwritten regions too).

Kernel: ``pypto.loop`` over sequences, an inner ``pypto.loop`` over the sequence's logical blocks;
the block id is read inside the kernel (``block_tables[q, j]``, a scalar read that pypto supports for
int32 tensors only -- the host converts int64 index tensors with ``.to(torch.int32)``, a device op,
no host sync; values must fit in int32, which the caller validates). Each block is one ``view`` of
the flattened cache (``[num_blocks*block_size, heads, dim]``, a free host view) with
``valid_shape=[rows]`` for the tail block, assembled into the output. Two vector tile
configurations, as in the original sample: K tile ``[16, Hk, Dk]`` / V tile ``[32, Hv, Dv]``, and
``[8, ...]`` for both when ``heads*dim > 4096`` for key or value (see
:func:`select_gather_tile_config`; halved for fp32 caches, so a tile keeps its bytes within the
192 KiB unified buffer). The original sample's ``ready_on_host_tensors`` runtime option is not set:
it declares the index tensors' device data ready on the host, which a caller passing device tensors
without a sync cannot promise (in SIM it changes nothing).

Non-cumsum ``seq_lens``: pypto 0.2.0 has no loop-carried scalar (a SymbolicScalar cannot be
accumulated across iterations; only loop indices advance), and its scalar reads (GetTensorData)
drive the AICPU control flow from kernel inputs -- reading a prefix sum the kernel computed itself
would need a device-side dependency that 0.2.0 does not document. So the running base
``sum(seq_lens[:q])`` is computed on the host side with device tensor ops (``cumsum`` into a
zero-prefixed int32 tensor): no host synchronisation on the NPU path, one small extra device op.

Out-of-range values: the kernel clamps instead of trusting the indices, so it never reads or writes
out of bounds whatever the values -- the block-table column to ``[0, C-1]``, the block id to
``[0, num_blocks-1]``, a sequence's start to ``>= 0`` and its rows to the output length, negative
lengths to 0. Clamped values produce wrong data, not an error: the kernel is **not** a line of
defence. Callers must validate block ids, offsets and lengths first (``mla_ops`` does so in eager
mode / with ``validate=True``).
"""

# No `from __future__ import annotations`: pypto.frontend.jit reads live pypto.Tensor annotations.
import dataclasses
import functools
from typing import List, Optional, Sequence, Tuple

import torch

from ... import pypto_runtime as runtime
from ...ops.gather_pa_kv_cache import check_gather_pa_kv_cache_args

__all__ = [
    "DEFAULT_GATHER_TILE",
    "GatherTileConfig",
    "LARGE_TOKEN_GATHER_TILE",
    "LARGE_TOKEN_THRESHOLD",
    "gather_pa_kv_cache",
    "gather_pa_kv_cache_not_supported_reasons",
    "select_gather_tile_config",
    "tile_fits_ub",
]

_CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclasses.dataclass(frozen=True)
class GatherTileConfig:
    """Vector tile of the gather kernel: token rows per key / value tile (heads and dim are whole)."""

    name: str
    key_tile_tokens: int
    value_tile_tokens: int


DEFAULT_GATHER_TILE = GatherTileConfig("default", key_tile_tokens=16, value_tile_tokens=32)
# [1, 64, 128] tiles would be many tiny tasks; [8, 64, 128] bf16 keeps one tile at 128 KiB of the
# 192 KiB unified buffer (a [16, 64, 128] bf16 tile, 256 KiB, does not compile: UB overflow).
LARGE_TOKEN_GATHER_TILE = GatherTileConfig("large_token", key_tile_tokens=8, value_tile_tokens=8)
LARGE_TOKEN_THRESHOLD = 4096   # heads*dim above which the large-token tile is used (key or value)
UB_BYTES = 192 * 1024          # Ascend 910B2 unified buffer: one vector tile must fit in it
TILE_ALIGN_BYTES = 32           # a tile's last dim is moved in 32-byte blocks (pypto's BLOCK_SIZE)


def select_gather_tile_config(key_heads: int, key_dim: int, value_heads: int, value_dim: int, *,
                              element_size: int = 2) -> GatherTileConfig:
    """"large_token" when ``heads*dim > 4096`` for the key or the value, else "default".

    The token rows above are for 16-bit caches (as in the original sample); ``element_size=4``
    (fp32) halves them so a tile keeps its size in bytes, and rows are reduced further if one tile
    would not fit the 192 KiB unified buffer. The choice is a performance specialisation only; every
    configuration gives identical results.
    """
    for name, v in (("key_heads", key_heads), ("key_dim", key_dim), ("value_heads", value_heads),
                    ("value_dim", value_dim), ("element_size", element_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    large = key_heads * key_dim > LARGE_TOKEN_THRESHOLD or value_heads * value_dim > LARGE_TOKEN_THRESHOLD
    base = LARGE_TOKEN_GATHER_TILE if large else DEFAULT_GATHER_TILE
    key_rows = _fit_rows(base.key_tile_tokens * 2 // element_size, key_heads * key_dim * element_size)
    value_rows = _fit_rows(base.value_tile_tokens * 2 // element_size, value_heads * value_dim * element_size)
    if (key_rows, value_rows) == (base.key_tile_tokens, base.value_tile_tokens):
        return base
    return GatherTileConfig(base.name, key_rows, value_rows)


def _fit_rows(rows: int, row_bytes: int) -> int:
    return max(1, min(rows, UB_BYTES // row_bytes))


def tile_fits_ub(tile: GatherTileConfig, key_hd: Tuple[int, int], value_hd: Tuple[int, int],
                 element_size: int) -> bool:
    """Whether both vector tiles of ``tile`` fit the unified buffer (else the kernel does not compile)."""
    return (tile.key_tile_tokens * key_hd[0] * key_hd[1] * element_size <= UB_BYTES
            and tile.value_tile_tokens * value_hd[0] * value_hd[1] * element_size <= UB_BYTES)


# ----------------------------------------------------------------------------------------------
# validation (no host sync)
# ----------------------------------------------------------------------------------------------
def cache_reasons(tensors, access: str) -> List[str]:
    """Shared by gather and scatter: a kernel dtype for both caches, and contiguous (the kernels
    address them through a flat [slots, heads, dim] view), rows that fit one vector tile."""
    reasons = []
    for name in ("key_cache", "value_cache"):
        t = tensors[name]
        if t.dtype not in _CACHE_DTYPES:
            reasons.append(f"{name} dtype must be bfloat16, float16 or float32, got {t.dtype}")
        if not t.is_contiguous():
            reasons.append(f"{name} must be contiguous (ND layout; it is {access} through a flat view)")
        dim_bytes = t.shape[3] * t.element_size()
        if dim_bytes % TILE_ALIGN_BYTES:
            # pypto 0.2.0 refuses such a tile at compile time ("lastDimBytes % BLOCK_SIZE == 0"), and a
            # failed compile leaves its recorder unusable for the rest of the process
            reasons.append(f"{name} last dim of {t.shape[3]} elements is {dim_bytes} bytes; PyPTO tiles need a "
                           f"multiple of {TILE_ALIGN_BYTES} bytes")
        row_bytes = t.shape[2] * t.shape[3] * t.element_size()
        if row_bytes > UB_BYTES:
            reasons.append(f"{name} rows of heads*dim = {t.shape[2] * t.shape[3]} elements "
                           f"({row_bytes} bytes) exceed the 192 KiB vector buffer of one tile")
    return reasons


def gather_pa_kv_cache_not_supported_reasons(key_cache, value_cache, block_tables, seq_lens, key, value, *,
                                             seq_offset=None, is_seq_lens_cumsum: bool = False,
                                             mode: str = "sim") -> List[str]:
    """Why this kernel cannot run arguments that passed the op's own check (`mla.gather_pa_kv_cache`:
    ranks, shapes, dtypes, devices): pypto's availability, the mode and device, the cache dtype
    subset and contiguity. Never reads values (block ids in range, monotone cumsum, offsets
    divisible by block_size are the caller's checks)."""
    reasons = list(runtime.unavailable_reasons())
    if mode not in runtime.MODES:
        return reasons + [f"mode must be one of {runtime.MODES}, got {mode!r}"]
    tensors = {"key_cache": key_cache, "value_cache": value_cache, "block_tables": block_tables,
               "seq_lens": seq_lens, "key": key, "value": value}
    if seq_offset is not None:
        tensors["seq_offset"] = seq_offset
    reasons += cache_reasons(tensors, "read")
    for name in ("key", "value"):
        if not tensors[name].is_contiguous():
            reasons.append(f"{name} must be contiguous (it is written in place)")
    reasons += runtime.device_reasons(tensors, mode, key)
    return reasons


# ----------------------------------------------------------------------------------------------
# the kernel
# ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _build_kernel(block_size: int, key_hd: Tuple[int, int], value_hd: Tuple[int, int], dtype: torch.dtype,
                  has_offset: bool, tile: GatherTileConfig, mode: str):
    """Build (once per process and variant). Arguments: key_cache [NB*BS, Hk, Dk],
    value_cache [NB*BS, Hv, Dv], block_tables [Q, C] i32, cu_seq_lens [Q+1] i32,
    (seq_offset [Q] i32,) key [T, Hk, Dk], value [T, Hv, Dv]."""
    runtime.ensure_supported()
    import pypto

    BS = block_size
    Hk, Dk = key_hd
    Hv, Dv = value_hd
    KT, VT = tile.key_tile_tokens, tile.value_tile_tokens
    dt = runtime.pypto_dtype(dtype)
    i32 = pypto.DT_INT32
    DYN = pypto.DYNAMIC
    jit = runtime.jit_kwargs(mode, error_tol=(0.0, 0.0))      # a copy: exact

    @pypto.frontend.function
    def _gather(key_cache, value_cache, block_tables, cu_seq_lens, seq_offset, key, value):
        num_seqs = block_tables.shape[0]
        cols = block_tables.shape[1]
        out_rows = key.shape[0]
        num_blocks = key_cache.shape[0] // BS
        for q in pypto.loop(num_seqs, name="LOOP_SEQ", idx_name="q"):
            # Clamped so that no value can make the kernel read or write out of bounds.
            start = pypto.max(cu_seq_lens[q], 0)
            n = pypto.max(pypto.min(cu_seq_lens[q + 1] - start, out_rows - start), 0)
            if has_offset:
                first_col = pypto.max(seq_offset[q], 0) // BS
            else:
                first_col = 0
            for j in pypto.loop((n + BS - 1) // BS, name="LOOP_BLOCK", idx_name="j"):
                col = pypto.min(first_col + j, cols - 1)
                phys = pypto.min(pypto.max(block_tables[q, col], 0), num_blocks - 1)
                rows = pypto.min(n - j * BS, BS)
                pypto.set_vec_tile_shapes(KT, Hk, Dk)
                kb = pypto.view(key_cache, [BS, Hk, Dk], [phys * BS, 0, 0], valid_shape=[rows, Hk, Dk])
                pypto.assemble(kb, [start + j * BS, 0, 0], key)
                pypto.set_vec_tile_shapes(VT, Hv, Dv)
                vb = pypto.view(value_cache, [BS, Hv, Dv], [phys * BS, 0, 0], valid_shape=[rows, Hv, Dv])
                pypto.assemble(vb, [start + j * BS, 0, 0], value)

    # pypto.frontend.jit compiles from the annotated signature: with and without seq_offset are two
    # decorated functions around the one body above.
    if has_offset:
        @pypto.frontend.jit(**jit)
        def gather_pa_kv_cache_kernel(
            key_cache: pypto.Tensor([DYN, Hk, Dk], dt),
            value_cache: pypto.Tensor([DYN, Hv, Dv], dt),
            block_tables: pypto.Tensor([DYN, DYN], i32),
            cu_seq_lens: pypto.Tensor([DYN], i32),
            seq_offset: pypto.Tensor([DYN], i32),
            key: pypto.Tensor([DYN, Hk, Dk], dt),
            value: pypto.Tensor([DYN, Hv, Dv], dt),
        ):
            _gather(key_cache, value_cache, block_tables, cu_seq_lens, seq_offset, key, value)
    else:
        @pypto.frontend.jit(**jit)
        def gather_pa_kv_cache_kernel(
            key_cache: pypto.Tensor([DYN, Hk, Dk], dt),
            value_cache: pypto.Tensor([DYN, Hv, Dv], dt),
            block_tables: pypto.Tensor([DYN, DYN], i32),
            cu_seq_lens: pypto.Tensor([DYN], i32),
            key: pypto.Tensor([DYN, Hk, Dk], dt),
            value: pypto.Tensor([DYN, Hv, Dv], dt),
        ):
            _gather(key_cache, value_cache, block_tables, cu_seq_lens, None, key, value)

    return gather_pa_kv_cache_kernel


def _as_int32(t: torch.Tensor) -> torch.Tensor:
    """int32, contiguous (device ops only; values are the caller's to keep in int32 range)."""
    return t.to(torch.int32).contiguous()


def _cumsum_with_zero(lengths: torch.Tensor) -> torch.Tensor:
    """[Q] lengths -> [Q+1] int32 cumsum starting at 0, on the lengths' device (no host sync)."""
    cu = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=lengths.device)
    torch.cumsum(lengths, 0, dtype=torch.int32, out=cu[1:])
    return cu


def run_with_result(key_cache, value_cache, block_tables, seq_lens, key, value, *, seq_offset=None,
                    is_seq_lens_cumsum: bool = False, mode: str = "sim", tile: Optional[GatherTileConfig] = None,
                    goldens: Optional[Sequence[torch.Tensor]] = None) -> Optional[runtime.SimResult]:
    """:func:`gather_pa_kv_cache` returning the SimResult (mode="sim"); ``tile`` overrides the
    automatic tile choice; ``goldens`` = optional (key, value) expected after the call."""
    check_gather_pa_kv_cache_args(key_cache, value_cache, block_tables, seq_lens, key, value,
                                  seq_offset=seq_offset, is_seq_lens_cumsum=is_seq_lens_cumsum)
    reasons = gather_pa_kv_cache_not_supported_reasons(
        key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset=seq_offset,
        is_seq_lens_cumsum=is_seq_lens_cumsum, mode=mode)
    if reasons:
        raise ValueError("gather_pa_kv_cache: " + "; ".join(reasons))
    nb, bs, hk, dk = key_cache.shape
    hv, dv = value_cache.shape[2:]
    if key.shape[0] == 0 or 0 in block_tables.shape or nb == 0:
        return None                     # nothing can (validly) be written; the kernel would index nothing
    tile = tile or select_gather_tile_config(hk, dk, hv, dv, element_size=key_cache.element_size())
    if not tile_fits_ub(tile, (hk, dk), (hv, dv), key_cache.element_size()):
        raise ValueError(f"gather_pa_kv_cache: tile {tile} does not fit the 192 KiB unified buffer for "
                         f"heads/dims {(hk, dk)} / {(hv, dv)} of {key_cache.dtype}")
    cu = _as_int32(seq_lens) if is_seq_lens_cumsum else _cumsum_with_zero(_as_int32(seq_lens))
    kernel = _build_kernel(bs, (hk, dk), (hv, dv), key_cache.dtype, seq_offset is not None, tile, mode)
    args = [key_cache.view(nb * bs, hk, dk), value_cache.view(nb * bs, hv, dv), _as_int32(block_tables), cu]
    if seq_offset is not None:
        args.append(_as_int32(seq_offset))
    args += [key, value]
    kernel_goldens = None
    if goldens is not None:
        kernel_goldens = [None] * (len(args) - 2) + list(goldens)
    return runtime.launch(f"gather_pa_kv_cache[{tile.name}]", kernel, args, mode=mode, goldens=kernel_goldens,
                          outputs={"key": key, "value": value})


def gather_pa_kv_cache(key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                       seq_offset: Optional[torch.Tensor] = None, is_seq_lens_cumsum: bool = False,
                       mode: str = "sim") -> None:
    """Gather paged cache blocks into contiguous ``key`` / ``value``, in place (``mla::gather_pa_kv_cache``).

    Args:
        key_cache:    [num_blocks, block_size, Hk, Dk] bf16/fp16/fp32, contiguous ND.
        value_cache:  [num_blocks, block_size, Hv, Dv] same dtype, same num_blocks/block_size.
        block_tables: [Q, C] int32/int64 physical block ids per sequence.
        seq_lens:     [Q+1] cumsum starting at 0 (``is_seq_lens_cumsum=True``) or [Q] lengths.
        key, value:   [T, Hk, Dk] / [T, Hv, Dv] outputs, contiguous, written in place.
        seq_offset:   optional [Q] token offsets, multiples of block_size (first table column =
                      seq_offset[q] // block_size).
        mode:         "sim" (CPU tensors through the PyPTO simulation) or "npu" (asynchronous).

    Values (block ids in range, monotone cumsum, offsets) are not checked here; see the module
    docstring for what the kernel does with bad values.

    Raises:
        ValueError: unsupported inputs (see :func:`gather_pa_kv_cache_not_supported_reasons`).
    """
    run_with_result(key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset=seq_offset,
                    is_seq_lens_cumsum=is_seq_lens_cumsum, mode=mode)
