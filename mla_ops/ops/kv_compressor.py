"""`mla::kv_compressor`: DeepSeek-V4's KV compressor over a paged entry pool. Every m = `compress_ratio`
tokens of a request are pooled into one entry, written into `entry_cache`; the raw projections of a
request's latest tokens are carried between calls in `state`, so prefill, chunked prefill and decode
write the same entries.

The compressors of huggingface/transformers `src/transformers/models/deepseek_v4/modeling_deepseek_v4.py`
(`DeepseekV4HCACompressor`, `DeepseekV4CSACompressor` and the indexer's own compressor in
`DeepseekV4Indexer`), op for op: the same `[n, slots, D]` tensors go through the same torch ops, so the
entries are bit-identical to the ones the stock modules keep in their cache (`compressed_kv`), in fp32
and in a bf16 model whose position_bias and norm weights stay fp32. Entry w of a request, from the raw
projections `kv`, `gate` (`kv_proj(x)`, `gate_proj(x)`) of its tokens:

    without overlap (HCA, C = D):  slots = tokens [w*m, (w+1)*m)
        kv_s = kv[slots], g = gate[slots] + position_bias                          [m, D]
    with overlap (CSA, C = 2D):    2m slots: the first D channels (Ca) of tokens [(w-1)*m, w*m) with
        position_bias[:, :D], then channels D..2D (Cb) of tokens [w*m, (w+1)*m) with position_bias[:, D:];
        for w = 0 the Ca slots hold kv 0 and gate -inf (weight 0)                  [2m, D]
    pooled = (kv_s * softmax(g, over the slots, in fp32).to(kv.dtype)).sum(over the slots)   per channel
    entry  = rope_trailing(weighted_rms(pooled), cos_cache[w*m], sin_cache[w*m])

(g is fp32 when position_bias is: type promotion; weighted_rms and rope_trailing as in
`mla.shared_kv_prolog`: fp32 math, one rounding; the entry is rotated at the position of its own
window's first token.)

Requests as in `mla.sparse_mla_attention` (`mla_ops/ops/sparse_attention.py`): `query_start_loc [B+1]`,
`seq_lens [B]` tokens of request b including this call's q_b new ones, whose rows in kv / gate are
`query_start_loc[b]:query_start_loc[b+1]` at positions n0 .. seq_lens[b] - 1 (n0 = seq_lens[b] - q_b).
The call writes exactly the entries of the windows it closes, n0 // m <= w < seq_lens[b] // m, entry w at
`entry_cache[block_tables[b, w // bs], w % bs, 0]`.

`state [B, L, 2, C]` (kv's dtype; L = 2m with overlap, m without) holds the raw kv (index 0) and the raw
gate (index 1, before position_bias) of request b's token at position p in row p % L: the call reads the
rows of the earlier tokens its windows need (positions from (n0 // m - 1) * m with overlap, n0 // m * m
without, up to n0 - 1) and writes the rows of its last min(q_b, L) tokens. A request starts with any
state (its first windows read nothing before position 0). Everything read is read before anything is
written.

Memory per layer: the entry pool holds D * 2 / m bytes per token in bf16 (CSA at DeepSeek-V4-Flash dims,
D = 512, m = 4: 256 bytes; its indexer's Di = 128: 64 bytes; HCA, m = 128: 8 bytes); the state
L * 2 * C * 2 bytes per request (32 KiB for CSA, 256 KiB for HCA at those dims).

The reference kernel has one path with one semantics: on CPU the values are checked first (a clear
ValueError naming the argument, nothing written): query_start_loc from 0 to T without decreasing,
q_b <= seq_lens[b], the entries written within the block table, their block ids in the pool, and every
rotation position written (w * m) within the tables. Other devices check nothing (no host sync) and
never read or write out of bounds whatever the values: an entry that is not a slot of the pool, or
whose position is past the tables, is not written.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._checks import (
    check_float,
    check_rank,
    check_same_device,
    check_same_dtype,
    check_size,
    check_writable_layout,
    memo_by_signature,
)
from .._library import define_op
from ._paged import validates_on_host
from .shared_kv_prolog import check_norm_weight, check_rope_width, rope_trailing, weighted_rms_norm
from .sparse_attention import (
    _CHUNK_ELEMENTS,
    _check_requests,
    _slots,
    check_compress_ratio,
    check_query_starts,
    token_positions,
)

OP = "kv_compressor"


def state_rows(compress_ratio: int, overlap: bool) -> int:
    """L: the rows of `state` per request (the tokens a call may need from before it)."""
    return 2 * compress_ratio if overlap else compress_ratio


# ----------------------------------------------------------------------------------------- checks
@memo_by_signature
def check_kv_compressor_args(kv, gate, position_bias, norm_weight, cos_cache, sin_cache, state, entry_cache,
                             block_tables, seq_lens, query_start_loc, *, compress_ratio: int, overlap: bool,
                             eps: float = 1e-6) -> None:
    """kv, gate [T, C] (C = 2D with overlap, D without); position_bias [m, C] (fp32 or kv's dtype);
    norm_weight [D] (fp32 or kv's dtype); cos_cache / sin_cache [P >= 1, R/2] with 2 <= R <= D;
    state [B, L, 2, C] in kv's dtype; entry_cache [NB >= 1, bs >= 1, 1, D] in kv's dtype; the request
    tensors of `mla.sparse_mla_attention`; compress_ratio m >= 1; eps >= 0."""
    op = OP
    check_compress_ratio(op, compress_ratio)
    torch._check(eps >= 0.0, lambda: f"mla.{op}: eps must be >= 0, got {eps}")
    check_rank(op, "norm_weight", norm_weight, 1, "[head_dim] (kv_norm.weight of the compressor)")
    head_dim = norm_weight.shape[0]
    channels = 2 * head_dim if overlap else head_dim
    series = ("2 * head_dim with overlap=True (CSA: two series, Ca and Cb)" if overlap
              else "head_dim with overlap=False (HCA)")
    check_float(op, "kv", kv)
    check_rank(op, "kv", kv, 2, "[tokens, channels] (kv_proj output of the new tokens)")
    check_size(op, "kv", kv.shape[1], channels, f"channels (dim 1) must be {series}; head_dim is the length of "
               f"norm_weight")
    check_rank(op, "gate", gate, 2, "[tokens, channels] (gate_proj output of the new tokens)")
    check_size(op, "gate", gate.shape[0], kv.shape[0], "tokens (dim 0) must equal kv's")
    check_size(op, "gate", gate.shape[1], kv.shape[1], "channels (dim 1) must equal kv's")
    check_same_dtype(op, "gate", gate, "kv", kv)
    check_norm_weight(op, "norm_weight", norm_weight, head_dim, "head_dim", kv, "kv")
    check_rank(op, "position_bias", position_bias, 2, "[compress_ratio, channels]")
    check_size(op, "position_bias", position_bias.shape[0], compress_ratio,
               "rows (dim 0) must equal compress_ratio (one bias row per slot of a window)")
    check_size(op, "position_bias", position_bias.shape[1], channels, "channels (dim 1) must equal kv's")
    torch._check(position_bias.dtype in (torch.float32, kv.dtype),
                 lambda: f"mla.{op}: position_bias must be float32 (stock keeps it in fp32) or kv's dtype "
                 f"{kv.dtype}, got {position_bias.dtype}")
    for name, table in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        check_float(op, name, table)
        check_rank(op, name, table, 2, "[positions, rope_dim / 2] (the rope table by position)")
    torch._check(cos_cache.shape == sin_cache.shape, lambda: f"mla.{op}: cos_cache and sin_cache must have the same "
                 f"shape, got {tuple(cos_cache.shape)} and {tuple(sin_cache.shape)}")
    torch._check(cos_cache.shape[0] >= 1, lambda: f"mla.{op}: cos_cache has no position (dim 0 is 0); pass the rope "
                 f"table of every position an entry is rotated at (w * compress_ratio)")
    check_rope_width(op, "cos_cache", cos_cache, head_dim, "head_dim (the length of norm_weight)")
    _check_requests(op, block_tables, seq_lens, query_start_loc)
    rows = state_rows(compress_ratio, overlap)
    check_rank(op, "state", state, 4, "[batch, rows, 2, channels] (raw kv and gate of each request's latest tokens)")
    check_size(op, "state", state.shape[0], block_tables.shape[0],
               "batch (dim 0) must equal the number of block-table rows (one per request)")
    check_size(op, "state", state.shape[1], rows, f"rows (dim 1) must be {'2 * ' if overlap else ''}compress_ratio "
               f"with overlap={overlap}")
    check_size(op, "state", state.shape[2], 2, "dim 2 must be 2 (index 0: raw kv, index 1: raw gate)")
    check_size(op, "state", state.shape[3], channels, "channels (dim 3) must equal kv's")
    check_same_dtype(op, "state", state, "kv", kv)
    check_writable_layout(op, "state", state)
    check_rank(op, "entry_cache", entry_cache, 4, "[num_blocks, block_size, 1, head_dim] (the compressed entries)")
    check_size(op, "entry_cache", entry_cache.shape[2], 1, "heads (dim 2) must be 1: one entry row per window")
    check_size(op, "entry_cache", entry_cache.shape[3], head_dim, "dim (dim 3) must equal head_dim (the length of "
               "norm_weight)")
    torch._check(entry_cache.shape[0] >= 1, lambda: f"mla.{op}: entry_cache needs at least one block (dim 0), got 0")
    torch._check(entry_cache.shape[1] >= 1,
                 lambda: f"mla.{op}: block_size (entry_cache dim 1) must be >= 1, got 0")
    check_same_dtype(op, "entry_cache", entry_cache, "kv", kv)
    check_writable_layout(op, "entry_cache", entry_cache)
    check_same_device(op, {"kv": kv, "gate": gate, "position_bias": position_bias, "norm_weight": norm_weight,
                           "cos_cache": cos_cache, "sin_cache": sin_cache, "state": state, "entry_cache": entry_cache,
                           "block_tables": block_tables, "seq_lens": seq_lens, "query_start_loc": query_start_loc})


def check_compressor_values(num_tokens: int, block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                            compress_ratio: int, num_positions: int, num_blocks: int,
                            block_size: int) -> list[tuple[int, int, int]]:
    """The CPU value checks (a host sync). Returns (request, first entry, end entry) of every request
    that closes windows: it writes the entries first <= w < end.

    Python integers throughout: no sum or product of int64 values can wrap around."""
    op, m = OP, compress_ratio
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    check_query_starts(op, starts, num_tokens)
    width = block_tables.shape[1]
    written = []  # (request, first entry, end entry)
    for b, n in enumerate(lens):
        q_len = starts[b + 1] - starts[b]
        if n < q_len:
            raise ValueError(f"mla.{op}: seq_lens[{b}] = {n} is less than the request's {q_len} new tokens; "
                             f"seq_lens counts the request's tokens including the new ones")
        first, end = (n - q_len) // m, n // m
        if end <= first:
            continue
        if end > width * block_size:
            raise ValueError(f"mla.{op}: seq_lens[{b}] = {n} closes entry {end - 1} (entries are seq_lens // "
                             f"compress_ratio {m}), beyond the block table's capacity ({width} blocks x "
                             f"{block_size} entries)")
        if (end - 1) * m >= num_positions:
            raise ValueError(f"mla.{op}: entry {end - 1} of request {b} is rotated at position {(end - 1) * m}, but "
                             f"cos_cache / sin_cache hold positions 0..{num_positions - 1}; pass tables of at least "
                             f"{(end - 1) * m + 1} positions")
        written.append((b, first, end))
    if written:
        tables = block_tables.cpu().long()
        for b, first, end in written:
            columns = tables[b, first // block_size: (end - 1) // block_size + 1]
            bad = (columns < 0) | (columns >= num_blocks)
            if bool(bad.any()):
                j = first // block_size + int(torch.nonzero(bad)[0, 0])
                raise ValueError(f"mla.{op}: block_tables[{b}, {j}] = {int(tables[b, j])} holds entries this call "
                                 f"writes (request {b}) but is not a block id in [0, {num_blocks})")
    return written


def _kv_compressor_fake(kv, gate, position_bias, norm_weight, cos_cache, sin_cache, state, entry_cache, block_tables,
                        seq_lens, query_start_loc, *, compress_ratio, overlap, eps=1e-6) -> None:
    check_kv_compressor_args(kv, gate, position_bias, norm_weight, cos_cache, sin_cache, state, entry_cache,
                             block_tables, seq_lens, query_start_loc, compress_ratio=compress_ratio, overlap=overlap,
                             eps=eps)


# -------------------------------------------------------------------------------------- reference
def _put_rows(dest: Tensor, index: tuple[Tensor, ...], rows: Tensor, kept: Tensor) -> None:
    """dest[index[0][i], index[1][i], ...] = rows[i] for the kept i, without a host sync.

    The other rows are redirected to the first kept row's place with that row's own data, so the
    duplicate writes are identical; with no kept row at all, dest's first element row is rewritten
    with its own contents. Nothing is written out of bounds as long as the kept indices are in range."""
    count = rows.shape[0]
    if count == 0:
        return
    any_kept = kept.any()
    first_kept = torch.argmax(kept.to(torch.int8))
    pick = torch.where(kept, torch.arange(count, device=rows.device), first_kept)
    place = tuple(torch.where(any_kept, i[pick], 0) for i in index)
    dest.index_put_(place, torch.where(any_kept, rows[pick], dest[(0,) * len(index)].unsqueeze(0)))


def _gather_tokens(new_rows: Tensor, carried: Tensor, request: Tensor, positions: Tensor, first_position: Tensor,
                   starts: Tensor) -> Tensor:
    """Rows [K, S, c] of the tokens at `positions` [K, S] of requests `request` [K]: this call's row
    (new_rows [T, c]) from the request's first new position on, else the state's row p % L
    (carried [B, L, c]). Indices are clamped: nothing is read out of bounds whatever the values."""
    first = first_position[request][:, None]
    is_new = positions >= first
    row = (starts[request][:, None] + positions - first).clamp(0, new_rows.shape[0] - 1)
    earlier = carried[request[:, None], torch.remainder(positions, carried.shape[1])]
    return torch.where(is_new[..., None], new_rows[row], earlier)


def _pooled_entries(kv, gate, position_bias, norm_weight, cos_cache, sin_cache, state, request, window, first_position,
                    starts, compress_ratio: int, overlap: bool, eps: float) -> Tensor:
    """The entries [K, D] of windows `window` [K] of requests `request` [K] (stock's op sequence)."""
    m, head_dim = compress_ratio, norm_weight.shape[0]
    slot = torch.arange(m, device=kv.device)
    own = window[:, None] * m + slot  # [K, m]: the window's tokens

    def gather(rows, carried, positions):
        return _gather_tokens(rows, carried, request, positions, first_position, starts)

    if overlap:
        # Cb of the window's own tokens in slots m..2m-1; Ca of the previous window's in slots 0..m-1
        cb_kv = gather(kv[:, head_dim:], state[:, :, 0, head_dim:], own)
        cb_gate = gather(gate[:, head_dim:], state[:, :, 1, head_dim:], own) + position_bias[:, head_dim:]
        previous = own - m
        ca_kv = gather(kv[:, :head_dim], state[:, :, 0, :head_dim], previous)
        ca_gate = gather(gate[:, :head_dim], state[:, :, 1, :head_dim], previous) + position_bias[:, :head_dim]
        has_previous = (window >= 1)[:, None, None]
        pool_kv = kv.new_zeros((window.shape[0], 2 * m, head_dim))
        pool_gate = cb_gate.new_full((window.shape[0], 2 * m, head_dim), float("-inf"))
        pool_kv[:, m:] = cb_kv
        pool_gate[:, m:] = cb_gate
        pool_kv[:, :m] = torch.where(has_previous, ca_kv, 0)  # the first window: kv 0, gate -inf (weight 0)
        pool_gate[:, :m] = torch.where(has_previous, ca_gate, float("-inf"))
    else:
        pool_kv = gather(kv, state[:, :, 0], own)
        pool_gate = gather(gate, state[:, :, 1], own) + position_bias
    pooled = (pool_kv * pool_gate.softmax(dim=1, dtype=torch.float32).to(pool_kv.dtype)).sum(dim=1)
    normed = weighted_rms_norm(pooled, norm_weight, eps)
    at = (window * m).clamp(0, cos_cache.shape[0] - 1)
    return rope_trailing(normed, cos_cache[at], sin_cache[at])


def _request_layout(seq_lens: Tensor, query_start_loc: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(first token row [B], tokens [B], first new position n0 [B]) of every request, int64."""
    starts = query_start_loc.long()
    seq = seq_lens.long()
    return starts[:-1], seq, seq - (starts[1:] - starts[:-1])


def _state_update(kv: Tensor, gate: Tensor, state: Tensor, seq_lens: Tensor, query_start_loc: Tensor):
    """(index, rows [T, 2, C], kept [T]) of the state writes: every new token's (request, p % L), its
    raw kv and gate, and whether it is one of its request's last L tokens (rows written once each)."""
    rows = state.shape[1]
    token_request, token_position = token_positions(seq_lens, query_start_loc, kv.shape[0])
    kept = (token_position >= seq_lens.long()[token_request] - rows) & (token_position >= 0)
    return (token_request, torch.remainder(token_position, rows)), torch.stack((kv, gate), dim=1), kept


def kv_compressor_sync_free(kv: Tensor, gate: Tensor, position_bias: Tensor, norm_weight: Tensor, cos_cache: Tensor,
                            sin_cache: Tensor, state: Tensor, entry_cache: Tensor, block_tables: Tensor,
                            seq_lens: Tensor, query_start_loc: Tensor, compress_ratio: int, overlap: bool,
                            eps: float = 1e-6) -> None:
    """The compressor without a host sync (the reference on other devices): entries for a static bound
    of T // m + B candidate windows (request b closes at most ceil(q_b / m) of them), the k-th closed
    window of the batch in candidate k, the others masked; every index clamped or masked, so nothing is
    read or written out of bounds whatever the values. Everything is read before anything is written.

    The candidates of all requests share one tensor (chunked), so ATen's multi-threaded CPU softmax may
    split them differently from stock's one-request tensors: the same entries up to rounding."""
    m = compress_ratio
    num_tokens, batch = kv.shape[0], state.shape[0]
    if num_tokens == 0 or batch == 0:
        return
    starts, seq, first_position = _request_layout(seq_lens, query_start_loc)
    first_window = torch.div(first_position, m, rounding_mode="floor")
    closed = (torch.div(seq, m, rounding_mode="floor") - first_window).clamp(min=0)
    ends = torch.cumsum(closed, 0)
    num_entries = num_tokens // m + batch
    candidate = torch.arange(num_entries, device=kv.device)
    request = torch.searchsorted(ends, candidate, right=True).clamp(max=batch - 1)
    window = first_window[request] + candidate - (ends[request] - closed[request])
    is_entry = (candidate < ends[-1]) & (window >= 0) & (window * m < cos_cache.shape[0])
    block, offset, in_pool = _slots(block_tables, request, window, entry_cache.shape[0], entry_cache.shape[1])
    is_entry &= in_pool
    state_index, token_rows, state_kept = _state_update(kv, gate, state, seq_lens, query_start_loc)
    chunk = max(1, _CHUNK_ELEMENTS // ((2 * m if overlap else m) * kv.shape[1]))
    entries = torch.cat([_pooled_entries(kv, gate, position_bias, norm_weight, cos_cache, sin_cache, state,
                                         request[first:first + chunk], window[first:first + chunk], first_position,
                                         starts, m, overlap, eps)
                         for first in range(0, num_entries, chunk)])
    _put_rows(entry_cache, (block, offset), entries[:, None, :], is_entry)
    _put_rows(state, state_index, token_rows, state_kept)


def kv_compressor_reference(kv: Tensor, gate: Tensor, position_bias: Tensor, norm_weight: Tensor, cos_cache: Tensor,
                            sin_cache: Tensor, state: Tensor, entry_cache: Tensor, block_tables: Tensor,
                            seq_lens: Tensor, query_start_loc: Tensor, *, compress_ratio: int, overlap: bool,
                            eps: float = 1e-6) -> None:
    """CPU: the value checks, then the entries of one request at a time, all its windows of the call in
    one tensor: the shapes the stock compressor runs for one request, so even ATen's multi-threaded
    softmax splits the work as it does there. Other devices: `kv_compressor_sync_free`."""
    if entry_cache.device.type != "cpu":
        kv_compressor_sync_free(kv, gate, position_bias, norm_weight, cos_cache, sin_cache, state, entry_cache,
                                block_tables, seq_lens, query_start_loc, compress_ratio, overlap, eps)
        return
    closing = check_compressor_values(kv.shape[0], block_tables, seq_lens, query_start_loc, compress_ratio,
                                      cos_cache.shape[0], entry_cache.shape[0], entry_cache.shape[1])
    if kv.shape[0] == 0:
        return
    starts, _, first_position = _request_layout(seq_lens, query_start_loc)
    state_index, token_rows, state_kept = _state_update(kv, gate, state, seq_lens, query_start_loc)
    block_size = entry_cache.shape[1]
    writes = []
    for b, first, end in closing:  # every entry is computed (the state read) before anything is written
        window = torch.arange(first, end)
        entries = _pooled_entries(kv, gate, position_bias, norm_weight, cos_cache, sin_cache, state,
                                  torch.full_like(window, b), window, first_position, starts, compress_ratio,
                                  overlap, eps)
        blocks = block_tables[b].long()[torch.div(window, block_size, rounding_mode="floor")]
        writes.append((blocks, torch.remainder(window, block_size), entries))
    for blocks, offsets, entries in writes:
        entry_cache[blocks, offsets, 0] = entries
    _put_rows(state, state_index, token_rows, state_kept)


# A mutating op returns `()` (never the mutated inputs), as torch.compile's auto-functionalization expects.
KV_COMPRESSOR = define_op(
    "kv_compressor(Tensor kv, Tensor gate, Tensor position_bias, Tensor norm_weight, Tensor cos_cache, "
    "Tensor sin_cache, Tensor(a!) state, Tensor(b!) entry_cache, Tensor block_tables, Tensor seq_lens, "
    "Tensor query_start_loc, *, int compress_ratio, bool overlap, float eps=1e-06) -> ()",
    check=check_kv_compressor_args, fake=_kv_compressor_fake, reference=kv_compressor_reference,
)


# -------------------------------------------------------------------------------- public wrapper
def kv_compressor(kv: Tensor, gate: Tensor, position_bias: Tensor, norm_weight: Tensor, cos_cache: Tensor,
                  sin_cache: Tensor, state: Tensor, entry_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                  query_start_loc: Tensor, *, compress_ratio: int, overlap: bool, eps: float = 1e-6,
                  validate: bool = False) -> None:
    """Pool every `compress_ratio` tokens of each request into one entry of a paged pool, in place.

    Args:
        kv, gate: `[T, C]` raw `kv_proj` / `gate_proj` outputs of the T new tokens (fp32 / fp16 / bf16);
            C = 2 * D with overlap (CSA), D without (HCA).
        position_bias: `[m, C]` (`position_bias`, fp32 or kv's dtype); norm_weight: `[D]` (`kv_norm.weight`).
        cos_cache, sin_cache: `[P, R/2]` the rope table by position (entry w is rotated at position w * m).
        state: `[B, L, 2, C]` in kv's dtype (L = 2m with overlap, m without), written in place: raw kv and
            gate of each request's latest tokens, row p % L. A new request may start with any contents.
        entry_cache: `[num_blocks, block_size, 1, D]` in kv's dtype, written in place: entry w of request b
            at `block_tables[b, w // block_size]`, offset `w % block_size`.
        block_tables: `[B, max_blocks]`; seq_lens: `[B]` tokens of each request including the new ones;
            query_start_loc: `[B+1]` cumulative new tokens per request (the rows of kv / gate).
        compress_ratio: m, tokens per entry. overlap: CSA's overlapping windows (two series per token).
        eps: the norm epsilon (`config.rms_norm_eps`).
        validate: check the values on non-CPU devices (CPU always checks).
    Writes the entries of the windows this call closes (n0 // m <= w < seq_lens[b] // m, n0 = seq_lens[b] - q_b)
    and the state rows of each request's last min(q_b, L) new tokens.
    """
    if validates_on_host(validate, entry_cache):
        check_kv_compressor_args(kv, gate, position_bias, norm_weight, cos_cache, sin_cache, state, entry_cache,
                                 block_tables, seq_lens, query_start_loc, compress_ratio=compress_ratio,
                                 overlap=overlap, eps=eps)
        check_compressor_values(kv.shape[0], block_tables, seq_lens, query_start_loc, compress_ratio,
                                cos_cache.shape[0], entry_cache.shape[0], entry_cache.shape[1])
    torch.ops.mla.kv_compressor.default(kv, gate, position_bias, norm_weight, cos_cache, sin_cache, state, entry_cache,
                                        block_tables, seq_lens, query_start_loc, compress_ratio=compress_ratio,
                                        overlap=overlap, eps=eps)
