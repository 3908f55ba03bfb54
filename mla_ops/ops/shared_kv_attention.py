"""`mla::shared_kv_attention`: DeepSeek-V4's attention core over one shared K = V row per token.

DeepSeek-V4 caches one row per token (`kv`, head_dim D with the rotary dims inside: the trailing R
channels) that is both the key and the value of every head, and attends to two sets of rows:

* the sliding window: a token at position p sees the window rows of positions
  max(0, p - W + 1) .. p (W = `sliding_window` >= 1, itself included), read from the paged
  `kv_cache`;
* optionally, the entries of a compressor (`mla.kv_compressor`: one entry per `compress_ratio` = m
  tokens, in `compressed_cache`): request b holds seq_lens[b] // m of them, and entry w is visible to
  the token at position p iff w < (p + 1) // m (all m of its tokens are at or before p). Without
  `topk_indices` the token attends to every visible entry (heavily compressed attention, HCA); with
  `topk_indices [T, K]` to the entries listed on its row (compressed sparse attention, CSA: the
  output of `mla.lightning_indexer` with the same compress_ratio; -1 = none; an entry listed twice
  is attended twice).

Per token t and head h, over those rows k_j (window positions ascending, then the compressed
entries ascending or in listed order), in fp32 (fp64 for fp64 inputs):

    l_j = softmax_scale * (q[t, h] . k_j)
    M   = max(max_j l_j, sinks[h])
    p_j = exp(l_j - M) / (sum_i exp(l_i - M) + exp(sinks[h] - M))      (without sinks: softmax_j(l))
    out[t, h] = sum_j p_j k_j                                             (rounded once to q's dtype)

The sink is a per-head logit that enters the denominator and contributes no value (a sink of -inf
is no sink); a token with no row to attend to (only on the unchecked device path) gets zeros.
This is `eager_attention_forward` of DeepSeek-V4 in `huggingface/transformers`
(src/transformers/models/deepseek_v4/modeling_deepseek_v4.py): keys = values = the window rows
concatenated with the compressed entries, the window mask `kv_idx > q_idx - W`, the compressed
block bias (HCA: `w >= (position + 1) // m` masked; CSA: only the indexer's picks), and the sinks
concatenated as one more softmax column and dropped; and it is the `attn_sink` of
`deepseek-ai/FlashMLA` (tests/ref.py: the sink adds exp(sink - max) to the denominator only). The
output still carries the rotation of the trailing R dims of the values: the caller applies the
inverse rotation (`mla.rope` with -sin) before the output projection, as the model does. Stock
transformers computes the logits in the model dtype and rounds the probabilities to it before P.V;
this op keeps both in fp32 and rounds the output once.

Layout: the requests of a mixed prefill / decode batch as in `mla.sparse_mla_attention`
(`mla_ops/ops/sparse_attention.py`): `query_start_loc [B+1]`, `seq_lens [B]` tokens of request b
including its q_b new ones (already written), query token i at position seq_lens[b] - q_b + i;
window row j of request b at `kv_cache[block_tables[b, j // bs], j % bs, 0]`, compressed entry w at
`compressed_cache[compressed_block_tables[b, w // bsc], w % bsc, 0]`.

Blocks used: of the window pool, only the blocks holding positions from the earliest window start
of a request's query tokens, max(0, seq_lens[b] - q_b - W + 1), to seq_lens[b] - 1: block-table
columns wholly before that are never looked up and may hold anything (-1 for blocks freed once they
left every window); of the compressed pool, the blocks of the entries attended. The CPU value checks
(before anything is computed) check exactly those: query_start_loc from 0 to T without decreasing,
q_b <= seq_lens[b], seq_lens[b] within the window table's capacity and seq_lens[b] // m within the
compressed table's, every block id used in range, every listed index -1 or visible to its token.
The device path checks nothing (no host sync) and reads nothing out of bounds whatever the values:
a row whose block id is outside the pool, or a listed entry the token may not see, is not attended.
The reference gathers, per query token, the min(W, window capacity) positions up to its own and the
listed entries (or the compressed table's capacity of entries), masking what it may not attend, in
chunks of query tokens: a long prefill never holds [T, H, context] logits at once.

Memory per token and layer in bf16 at DeepSeek-V4-Flash dims (D = 512, W = 128): the window pool
holds D * 2 = 1024 bytes per token of which only the last W tokens of a request are read; a
compressed pool D * 2 / m (256 bytes at m = 4, 8 at m = 128).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._checks import (
    check_float,
    check_index,
    check_rank,
    check_same_device,
    check_same_dtype,
    check_size,
    check_softmax_scale,
    memo_by_signature,
)
from .._library import define_op
from ._paged import check_sinks, check_used_block_ids, softmax_with_sinks, validates_on_host
from .sparse_attention import (
    _CHUNK_ELEMENTS,
    _check_requests,
    _slots,
    check_compress_ratio,
    check_query_starts,
    token_positions,
)

OP = "shared_kv_attention"


# ----------------------------------------------------------------------------------------- checks
def _check_pool(op: str, name: str, pool: Tensor, q: Tensor, rows: str) -> None:
    """pool [num_blocks >= 1, block_size >= 1, 1, D] in q's dtype."""
    check_rank(op, name, pool, 4, f"[num_blocks, block_size, 1, head_dim] ({rows})")
    check_size(op, name, pool.shape[2], 1, "heads (dim 2) must be 1: one row per entry, shared by every head as "
               "key and value")
    check_size(op, name, pool.shape[3], q.shape[2], "dim (dim 3) must equal head_dim, q's last dim")
    torch._check(pool.shape[0] >= 1, lambda: f"mla.{op}: {name} needs at least one block (dim 0), got 0")
    torch._check(pool.shape[1] >= 1, lambda: f"mla.{op}: block_size ({name} dim 1) must be >= 1, got 0")
    check_same_dtype(op, name, pool, "q", q)


@memo_by_signature
def check_shared_kv_attention_args(q, kv_cache, block_tables, seq_lens, query_start_loc, sinks, softmax_scale: float,
                                   sliding_window: int, compressed_cache=None, compressed_block_tables=None,
                                   compress_ratio: int = 1, topk_indices=None) -> None:
    """q [T, H, D] (floating); kv_cache [NB, bs, 1, D] in q's dtype; the request tensors of
    `mla.sparse_mla_attention`; sinks [H] (fp32 or q's dtype) or None; softmax_scale a positive normal
    float32 number; sliding_window >= 1; compressed_cache [NBc, bsc, 1, D] in q's dtype with
    compressed_block_tables [B, max_entry_blocks] (both or neither); compress_ratio >= 1;
    topk_indices [T, K] int32/int64, only with compressed_cache."""
    op = OP
    check_softmax_scale(op, softmax_scale, " (e.g. head_dim ** -0.5)")
    torch._check(sliding_window >= 1, lambda: f"mla.{op}: sliding_window must be >= 1 (the window rows a token "
                 f"sees, itself included), got {sliding_window}")
    check_compress_ratio(op, compress_ratio)
    check_float(op, "q", q)
    check_rank(op, "q", q, 3, "[tokens, heads, head_dim] (normed, rotated queries)")
    _check_pool(op, "kv_cache", kv_cache, q, "the window rows, one per token")
    _check_requests(op, block_tables, seq_lens, query_start_loc)
    check_sinks(op, sinks, q)
    if compressed_cache is None:
        torch._check(compressed_block_tables is None,
                     lambda: f"mla.{op}: compressed_block_tables was given without compressed_cache; pass both "
                     f"(the compressor's entry pool and its block tables) or neither")
        torch._check(topk_indices is None,
                     lambda: f"mla.{op}: topk_indices lists compressed entries, but compressed_cache is None; pass "
                     f"compressed_cache and compressed_block_tables with it")
    else:
        torch._check(compressed_block_tables is not None,
                     lambda: f"mla.{op}: compressed_cache was given without compressed_block_tables; pass its "
                     f"block tables [batch, max_entry_blocks]")
        _check_pool(op, "compressed_cache", compressed_cache, q, "the compressor's entries, one per compress_ratio "
                    "tokens")
        check_index(op, "compressed_block_tables", compressed_block_tables)
        check_rank(op, "compressed_block_tables", compressed_block_tables, 2, "[batch, max_entry_blocks]")
        check_size(op, "compressed_block_tables", compressed_block_tables.shape[0], block_tables.shape[0],
                   "rows must equal block_tables' (one per request)")
        if topk_indices is not None:
            check_index(op, "topk_indices", topk_indices)
            check_rank(op, "topk_indices", topk_indices, 2, "[tokens, topk] (request-local compressed entry "
                       "indices, -1 = none)")
            check_size(op, "topk_indices", topk_indices.shape[0], q.shape[0], "tokens (dim 0) must equal q's")
    check_same_device(op, {"q": q, "kv_cache": kv_cache, "block_tables": block_tables, "seq_lens": seq_lens,
                           "query_start_loc": query_start_loc, "sinks": sinks, "compressed_cache": compressed_cache,
                           "compressed_block_tables": compressed_block_tables, "topk_indices": topk_indices})


def _check_read_block_ids(name: str, tables: Tensor, columns: list[tuple[int, int]], num_blocks: int) -> None:
    """Every block id row b reads (its columns columns[b][0] <= j < columns[b][1]) lies in [0, num_blocks)."""
    check_used_block_ids(OP, tables, [last for _, last in columns], num_blocks, first=[f for f, _ in columns],
                         name=name)


def check_shared_kv_values(num_tokens: int, kv_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                           query_start_loc: Tensor, sliding_window: int, compressed_cache: Optional[Tensor] = None,
                           compressed_block_tables: Optional[Tensor] = None, compress_ratio: int = 1,
                           topk_indices: Optional[Tensor] = None) -> list[tuple[int, int, int]]:
    """The value checks of every CPU call, in this order: query_start_loc runs from 0 to T without
    decreasing; per request q_b <= seq_lens[b], seq_lens[b] within the window table's capacity and
    seq_lens[b] // m within the compressed table's; the window block ids read are in range; every
    listed index is -1 or an entry its token sees; the compressed block ids read are in range.
    Returns (first token row, q_b, seq_len) per request. Python integers for all length arithmetic:
    nothing can wrap around."""
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    check_query_starts(OP, starts, num_tokens)
    block_size = kv_cache.shape[1]
    capacity = block_tables.shape[1] * block_size
    compressed = compressed_cache is not None
    requests = []
    for b, n in enumerate(lens):
        q_len = starts[b + 1] - starts[b]
        if n < q_len:
            raise ValueError(f"mla.{OP}: seq_lens[{b}] = {n} is less than the request's {q_len} query tokens; "
                             f"seq_lens counts the cached tokens including the new ones (write them first)")
        if n > capacity:
            raise ValueError(f"mla.{OP}: seq_lens[{b}] = {n} needs {n} cached tokens, more than the block table's "
                             f"capacity ({block_tables.shape[1]} blocks x {block_size})")
        if compressed:
            entry_capacity = compressed_block_tables.shape[1] * compressed_cache.shape[1]
            if n // compress_ratio > entry_capacity:
                raise ValueError(f"mla.{OP}: seq_lens[{b}] = {n} needs {n // compress_ratio} compressed entries "
                                 f"(seq_lens // compress_ratio {compress_ratio}), more than compressed_block_tables' "
                                 f"capacity ({compressed_block_tables.shape[1]} blocks x {compressed_cache.shape[1]})")
        requests.append((starts[b], q_len, n))
    # the window rows read: from the first query token's window start to the last token
    _check_read_block_ids("block_tables", block_tables,
                          [(max(0, n - q_len - sliding_window + 1) // block_size, -(-n // block_size)) if q_len
                           else (0, 0) for _, q_len, n in requests], kv_cache.shape[0])
    if not compressed:
        return requests
    entry_block = compressed_cache.shape[1]
    if topk_indices is None:  # every entry visible to the request's last token: w < seq_lens // m
        _check_read_block_ids("compressed_block_tables", compressed_block_tables,
                              [(0, -(-(n // compress_ratio) // entry_block)) if q_len else (0, 0)
                               for _, q_len, n in requests], compressed_cache.shape[0])
        return requests
    _check_listed_entries(topk_indices, requests, compress_ratio, compressed_block_tables, compressed_cache.shape[0],
                          entry_block)
    return requests


def _check_listed_entries(topk_indices: Tensor, requests: list[tuple[int, int, int]], compress_ratio: int,
                          compressed_block_tables: Tensor, num_blocks: int, entry_block: int) -> None:
    """Every listed index is -1 or an entry w < (p + 1) // m of its token at position p, and every
    block holding a listed entry is in range."""
    if topk_indices.numel() == 0:
        return
    tokens = topk_indices.shape[0]
    request = torch.zeros(tokens, dtype=torch.int64)
    visible = torch.zeros(tokens, dtype=torch.int64)
    for b, (start, q_len, n) in enumerate(requests):
        request[start:start + q_len] = b
        # positions n - q_len .. n - 1 (all below the checked capacity: no wrap-around)
        visible[start:start + q_len] = torch.div(torch.arange(n - q_len + 1, n + 1), compress_ratio,
                                                 rounding_mode="floor")
    indices = topk_indices.cpu().long()
    bad = (indices < -1) | (indices >= visible[:, None])
    if bool(bad.any()):
        t, k = (int(v) for v in torch.nonzero(bad)[0])
        b = int(request[t])
        start, q_len, n = requests[b]
        raise ValueError(f"mla.{OP}: topk_indices[{t}, {k}] = {int(indices[t, k])} is neither -1 (none) nor a "
                         f"compressed entry token {t} sees (request {b}, position {n - q_len + t - start}: the "
                         f"entries w < (position + 1) // compress_ratio = {int(visible[t])})")
    listed = indices >= 0
    if not bool(listed.any()):
        return
    tables = compressed_block_tables.cpu().long()
    rows, ks = torch.nonzero(listed, as_tuple=True)
    columns = torch.div(indices[rows, ks], entry_block, rounding_mode="floor")
    ids = tables[request[rows], columns]
    wrong = (ids < 0) | (ids >= num_blocks)
    if bool(wrong.any()):
        i = int(torch.nonzero(wrong)[0, 0])
        b, j = int(request[rows[i]]), int(columns[i])
        raise ValueError(f"mla.{OP}: compressed_block_tables[{b}, {j}] = {int(ids[i])} is used by sequence {b} "
                         f"(topk_indices[{int(rows[i])}, {int(ks[i])}] = {int(indices[rows[i], ks[i]])}) but is not "
                         f"a block id in [0, {num_blocks})")


# ------------------------------------------------------------------------------------------ fake
def _shared_kv_attention_fake(q, kv_cache, block_tables, seq_lens, query_start_loc, sinks, softmax_scale,
                              sliding_window, compressed_cache=None, compressed_block_tables=None, compress_ratio=1,
                              topk_indices=None):
    check_shared_kv_attention_args(q, kv_cache, block_tables, seq_lens, query_start_loc, sinks, softmax_scale,
                                   sliding_window, compressed_cache, compressed_block_tables, compress_ratio,
                                   topk_indices)
    return q.new_empty(q.shape)


# ------------------------------------------------------------------------------------- reference
def shared_kv_attention_sync_free(q: Tensor, kv_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                                  query_start_loc: Tensor, sinks: Optional[Tensor], softmax_scale: float,
                                  sliding_window: int, compressed_cache: Optional[Tensor] = None,
                                  compressed_block_tables: Optional[Tensor] = None, compress_ratio: int = 1,
                                  topk_indices: Optional[Tensor] = None) -> Tensor:
    """The reference's device path, no host sync and no value check. Every token gathers
    min(W, window table capacity) window rows (positions p - width + 1 .. p) and the listed entries,
    or without topk_indices the compressed table's whole capacity of entries (static shapes); a row
    before position 0, outside its table or pool, or an entry the token may not see, is not attended,
    and nothing is read out of bounds whatever the values. Query tokens in chunks: a long prefill never
    materialises more than a chunk of gathered rows and logits."""
    num_tokens, heads, dim = q.shape
    out = q.new_zeros(q.shape)
    # at most W rows, so every row gathered is in the window; more than capacity could not be addressed
    window_width = min(sliding_window, block_tables.shape[1] * kv_cache.shape[1])
    if compressed_cache is None:
        entry_width = 0
    elif topk_indices is None:
        entry_width = compressed_block_tables.shape[1] * compressed_cache.shape[1]
    else:
        entry_width = topk_indices.shape[1]
    width = window_width + entry_width
    if num_tokens == 0 or width == 0:
        return out
    compute = torch.promote_types(q.dtype, torch.float32)
    request, position = token_positions(seq_lens, query_start_loc, num_tokens)
    window_offsets = torch.arange(1 - window_width, 1, device=q.device)  # ascending, ending at p
    entries = torch.arange(entry_width, device=q.device)
    chunk = max(1, _CHUNK_ELEMENTS // (width * max(dim, heads)))
    for first in range(0, num_tokens, chunk):
        rows = slice(first, min(first + chunk, num_tokens))
        req, pos = request[rows], position[rows]
        # the window: positions p - window_width + 1 .. p, the negative ones invalid in _slots
        window = pos[:, None] + window_offsets[None, :]
        block, offset, valid = _slots(block_tables, req[:, None], window, kv_cache.shape[0], kv_cache.shape[1])
        keys = kv_cache[block, offset, 0]  # [t, window_width, D]
        if entry_width:
            index = entries[None, :].expand(window.shape[0], -1) if topk_indices is None else topk_indices[rows].long()
            entry_block, entry_offset, entry_valid = _slots(compressed_block_tables, req[:, None], index,
                                                            compressed_cache.shape[0], compressed_cache.shape[1])
            # entry w pools tokens wm .. (w+1)m - 1: visible once all of them are at or before p
            entry_valid &= index < torch.div(pos + 1, compress_ratio, rounding_mode="floor")[:, None]
            keys = torch.cat([keys, compressed_cache[entry_block, entry_offset, 0]], dim=1)
            valid = torch.cat([valid, entry_valid], dim=1)
        # copied into fp32 (fp64): the GEMMs are the exact products of the activation-dtype values
        # with fp32 sums; 0 * NaN would leak whatever an unattended slot holds into probs @ keys
        keys = keys.to(compute).masked_fill_(~valid[:, :, None], 0)
        logits = torch.bmm(q[rows].to(compute), keys.transpose(1, 2)) * softmax_scale  # [t, H, width]
        logits.masked_fill_(~valid[:, None, :], float("-inf"))
        probs = softmax_with_sinks(logits, sinks)  # one more column in the denominator, none in the output
        probs.masked_fill_(~valid.any(dim=1)[:, None, None], 0.0)  # nothing to attend to: zeros, not NaN
        out[rows] = torch.bmm(probs, keys).to(out.dtype)
    return out


def shared_kv_attention_reference(q: Tensor, kv_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                                  query_start_loc: Tensor, sinks: Optional[Tensor], softmax_scale: float,
                                  sliding_window: int, compressed_cache: Optional[Tensor] = None,
                                  compressed_block_tables: Optional[Tensor] = None, compress_ratio: int = 1,
                                  topk_indices: Optional[Tensor] = None) -> Tensor:
    """-> out [T, H, D] in q's dtype. The CPU value checks, then `shared_kv_attention_sync_free`: the
    same widths for every call over the same tables, so a token's answer is the same bits whichever
    chunk of a prefill (or decode step) it comes in."""
    if kv_cache.device.type == "cpu":
        check_shared_kv_values(q.shape[0], kv_cache, block_tables, seq_lens, query_start_loc, sliding_window,
                               compressed_cache, compressed_block_tables, compress_ratio, topk_indices)
    return shared_kv_attention_sync_free(q, kv_cache, block_tables, seq_lens, query_start_loc, sinks, softmax_scale,
                                         sliding_window, compressed_cache, compressed_block_tables, compress_ratio,
                                         topk_indices)


SHARED_KV_ATTENTION = define_op(
    "shared_kv_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
    "Tensor? sinks, float softmax_scale, int sliding_window, Tensor? compressed_cache=None, "
    "Tensor? compressed_block_tables=None, int compress_ratio=1, Tensor? topk_indices=None) -> Tensor",
    check=check_shared_kv_attention_args, fake=_shared_kv_attention_fake, reference=shared_kv_attention_reference,
)


# -------------------------------------------------------------------------------- public wrapper
def shared_kv_attention(q: Tensor, kv_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                        sinks: Optional[Tensor], softmax_scale: float, sliding_window: int,
                        compressed_cache: Optional[Tensor] = None, compressed_block_tables: Optional[Tensor] = None,
                        compress_ratio: int = 1, topk_indices: Optional[Tensor] = None, *,
                        validate: bool = False) -> Tensor:
    """DeepSeek-V4 attention of each query token over its sliding window of shared K = V rows and,
    optionally, the compressed entries it may see (all of them, or those listed in topk_indices).

    Args:
        q: `[T, H, D]` normed, rotated queries of the T query tokens (fp32 / bf16 / fp16).
        kv_cache: `[num_blocks, block_size, 1, D]` the window rows (rotated, in q's dtype), one per token.
        block_tables: `[B, max_blocks]`; seq_lens: `[B]` tokens per request including its query tokens
            (written first); query_start_loc: `[B+1]` cumulative query tokens per request. Columns
            wholly before the window of a request's first query token are never read (may be -1).
        sinks: `[H]` per-head sink logits (fp32 or q's dtype), or None.
        softmax_scale: the logit scale (`D**-0.5`), a positive normal float32 number.
        sliding_window: W >= 1: the token at position p sees the rows of positions p - W + 1 .. p.
        compressed_cache: `[num_entry_blocks, entry_block_size, 1, D]` the compressor's entries
            (`mla.kv_compressor`), with compressed_block_tables `[B, max_entry_blocks]`; or None.
        compress_ratio: m, tokens per compressed entry: request b holds seq_lens[b] // m entries, and
            the token at position p sees the entries w < (p + 1) // m.
        topk_indices: `[T, K]` int32/int64 request-local entry indices (`mla.lightning_indexer` with the
            same compress_ratio), -1 = none; None attends to every visible entry.
        validate: check the index values on non-CPU devices (CPU always checks).
    Returns:
        `[T, H, D]` in q's dtype, contiguous: the attention output, still rotated on its trailing rotary
        dims (apply the inverse rotation before the output projection).
    """
    if validates_on_host(validate, kv_cache):
        check_shared_kv_attention_args(q, kv_cache, block_tables, seq_lens, query_start_loc, sinks, softmax_scale,
                                       sliding_window, compressed_cache, compressed_block_tables, compress_ratio,
                                       topk_indices)
        check_shared_kv_values(q.shape[0], kv_cache, block_tables, seq_lens, query_start_loc, sliding_window,
                               compressed_cache, compressed_block_tables, compress_ratio, topk_indices)
    return torch.ops.mla.shared_kv_attention.default(q, kv_cache, block_tables, seq_lens, query_start_loc, sinks,
                                                     softmax_scale, sliding_window, compressed_cache,
                                                     compressed_block_tables, compress_ratio, topk_indices)
