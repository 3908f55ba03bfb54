"""Sparse MLA (DeepSeek Sparse Attention): `mla::lightning_indexer` picks the top-k cached positions
each query token attends to, `mla::sparse_mla_attention` attends to exactly those.

Requests are laid out as vLLM lays out a mixed prefill/decode batch: B requests, `query_start_loc
[B+1]` cumulative query-token counts (the T query tokens of all requests, request b's are rows
`query_start_loc[b]:query_start_loc[b+1]`), `seq_lens [B]` cached tokens of each request *including*
its new query tokens (already written to the caches), and `block_tables [B, max_blocks]`. Query
token i of the q_b new tokens of request b sits at position `p = seq_lens[b] - q_b + i` and may see
the cached positions 0..p (torch_npu's `sparse_mode=3`, "right-down causal"): one convention for
prefill (q_b = seq_lens[b]), chunked prefill and decode (q_b = 1).

Indices are request-local positions plus a block table, torch_npu's convention
(`npu_sparse_flash_attention`); `to_global_slots` converts them to the global cache slots
(`block * block_size + offset`) FlashMLA and vLLM's sparse backends take.

    indexer score[t, j] = sum_h weights[t, h] * relu(softmax_scale * q[t, h] . k[j])       (fp32)
    sparse out[t, n]     = softmax_{j in idx[t]}(scale * (q_latent[t, n] . latent[j] + q_pe[t, n] . k_pe[j]))
                           . latent[idx[t]]

With `sinks [N]` the softmax of the attention has one more logit per head in its denominator, and with
`q_scale [T, N]` each token's head scores with softmax_scale * q_scale[t, n], as `mla.mla_decode_attention`
takes them (HY-V4's sparse layers: DeepSeek Sparse Attention with sinks; Mistral-Large-4's: a per-head
log-position query scale).

What the indexer keeps of the DeepSeek-V3.2 reference pipeline (`inference/model.py` of
deepseek-ai/DeepSeek-V3.2-Exp): the scores themselves. Its Hadamard rotation of q and k is
orthogonal (dot products are unchanged) and its fp8 quantisation of both is a storage format; like
transformers' `deepseek_v32` indexer the op scores the activation-dtype keys in fp32, so it selects
what transformers selects, except among exactly equal scores straddling the k-th place (below).

Ties: the top-k are the positions of the k highest scores in descending score order, and equal
scores keep ascending position order (a stable sort) on the reference, its sync-free path and the
native CPU kernels; torch_npu's `npu_lightning_indexer` documents the top-k set only, so among equal
scores at the k-th place its choice and order are its own (`backends/npu.py`). NaN
scores (from inf/NaN inputs) sort above every number, as torch.sort orders them. transformers' indexer
picks with `torch.topk`, which keeps whichever tied positions its partial sort leaves in front (no
documented rule), so the two can keep other positions where equal scores straddle the k-th place.

`softmax_scale` must be a positive normal float32 number (`check_softmax_scale`): the kernels scale
in float32.
"""
from __future__ import annotations

import operator
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
from ._paged import (
    check_latent_query_and_caches,
    check_q_scale,
    check_sinks,
    check_used_block_ids,
    row_scales,
    softmax_with_sinks,
    validates_on_host,
)

INDEXER = "lightning_indexer"
SPARSE = "sparse_mla_attention"

# Elements of one chunk of the reference kernels' score / gathered-row tensors: the references run
# prefill over long contexts chunk by chunk rather than materialising [T, heads, context].
_CHUNK_ELEMENTS = 1 << 24


# ----------------------------------------------------------------------------------------- checks
def _check_requests(op: str, block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor) -> None:
    """block_tables [B, max_blocks], seq_lens [B], query_start_loc [B+1], all int32/int64."""
    check_index(op, "block_tables", block_tables)
    check_rank(op, "block_tables", block_tables, 2, "[batch, max_blocks_per_seq]")
    check_index(op, "seq_lens", seq_lens)
    check_rank(op, "seq_lens", seq_lens, 1, "[batch]")
    check_size(op, "seq_lens", seq_lens.shape[0], block_tables.shape[0],
               "length must equal the number of block-table rows (one per request)")
    check_index(op, "query_start_loc", query_start_loc)
    check_rank(op, "query_start_loc", query_start_loc, 1, "[batch + 1] (cumulative query tokens per request)")
    check_size(op, "query_start_loc", query_start_loc.shape[0], block_tables.shape[0] + 1,
               "must have one entry per request plus one (cumulative counts starting at 0)")


def check_compress_ratio(op: str, compress_ratio: int) -> None:
    """compress_ratio: tokens per cached entry, >= 1 (1: one entry per token)."""
    torch._check(compress_ratio >= 1, lambda: f"mla.{op}: compress_ratio must be >= 1 (tokens pooled into one cached "
                 f"entry; 1 when the cache holds one entry per token), got {compress_ratio}")


@memo_by_signature
def check_lightning_indexer_args(q, weights, k_cache, block_tables, seq_lens, query_start_loc, topk: int,
                                 softmax_scale: float, compress_ratio: int = 1) -> None:
    """q [T, H, D]; weights [T, H] (fp32 or q's dtype); k_cache [NB, bs, 1, D] in q's dtype;
    the request tensors of `_check_requests`; topk >= 1; softmax_scale a positive normal float32
    number (`check_softmax_scale`); compress_ratio >= 1."""
    op = INDEXER
    check_softmax_scale(op, softmax_scale)
    check_compress_ratio(op, compress_ratio)
    torch._check(topk >= 1, lambda: f"mla.{op}: topk must be >= 1 (the number of positions kept per query "
                 f"token), got {topk}")
    check_float(op, "q", q)
    check_rank(op, "q", q, 3, "[tokens, index_heads, index_head_dim] (rotated indexer queries)")
    check_float(op, "weights", weights)
    check_rank(op, "weights", weights, 2, "[tokens, index_heads]")
    torch._check(weights.dtype in (torch.float32, q.dtype),
                 lambda: f"mla.{op}: weights must be float32 or q's dtype {q.dtype}, got {weights.dtype}")
    check_size(op, "weights", weights.shape[0], q.shape[0], "tokens (dim 0) must equal q's")
    check_size(op, "weights", weights.shape[1], q.shape[1], "heads (dim 1) must equal q's index heads")
    check_rank(op, "k_cache", k_cache, 4, "[num_blocks, block_size, 1, index_head_dim]")
    check_size(op, "k_cache", k_cache.shape[2], 1, "heads (dim 2) must be 1: the indexer caches one key per token")
    check_size(op, "k_cache", k_cache.shape[3], q.shape[2], "dim (dim 3) must equal index_head_dim, q's last dim")
    torch._check(k_cache.shape[0] >= 1, lambda: f"mla.{op}: k_cache needs at least one block (dim 0), got 0")
    torch._check(k_cache.shape[1] >= 1, lambda: f"mla.{op}: block_size (k_cache dim 1) must be >= 1, got 0")
    check_same_dtype(op, "k_cache", k_cache, "q", q)
    _check_requests(op, block_tables, seq_lens, query_start_loc)
    check_same_device(op, {"q": q, "weights": weights, "k_cache": k_cache, "block_tables": block_tables,
                           "seq_lens": seq_lens, "query_start_loc": query_start_loc})


@memo_by_signature
def check_sparse_mla_attention_args(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                    topk_indices, softmax_scale: float, sinks=None, q_scale=None) -> None:
    """q_latent [T, N, L], q_pe [T, N, R]; key_cache [NB, bs, 1, L] (latent), value_cache [NB, bs, 1, R]
    (k_pe); the request tensors; topk_indices [T, K] int32/int64; softmax_scale as for the indexer;
    sinks [N] and q_scale [T, N] (fp32 or q_latent's dtype) or None."""
    op = SPARSE
    check_softmax_scale(op, softmax_scale)
    check_latent_query_and_caches(op, "tokens", q_latent, q_pe, key_cache, value_cache)
    _check_requests(op, block_tables, seq_lens, query_start_loc)
    check_index(op, "topk_indices", topk_indices)
    check_rank(op, "topk_indices", topk_indices, 2, "[tokens, topk] (request-local positions, -1 = none)")
    check_size(op, "topk_indices", topk_indices.shape[0], q_latent.shape[0], "tokens (dim 0) must equal q_latent's")
    check_sinks(op, sinks, q_latent, "q_latent")
    check_q_scale(op, q_scale, q_latent)
    check_same_device(op, {"q_latent": q_latent, "q_pe": q_pe, "key_cache": key_cache, "value_cache": value_cache,
                           "block_tables": block_tables, "seq_lens": seq_lens, "query_start_loc": query_start_loc,
                           "topk_indices": topk_indices, "sinks": sinks, "q_scale": q_scale})


def check_starts(op: str, name: str, starts: list[int], total: int, counted: str) -> None:
    """A cumulative count `name` (as a list) runs from 0 to `total` (the number of `counted`) without
    decreasing."""
    if starts[0] != 0:
        raise ValueError(f"mla.{op}: {name} must start at 0, got {name}[0] = {starts[0]}")
    for b in range(len(starts) - 1):
        if starts[b + 1] < starts[b]:
            raise ValueError(f"mla.{op}: {name} must never decrease, but {name}[{b + 1}] = "
                             f"{starts[b + 1]} < {name}[{b}] = {starts[b]}")
    if starts[-1] != total:
        raise ValueError(f"mla.{op}: {name}[-1] = {starts[-1]} must equal the number of {counted} ({total})")


def check_query_starts(op: str, starts: list[int], num_tokens: int) -> None:
    """query_start_loc (as a list) runs from 0 to `num_tokens` without decreasing."""
    check_starts(op, "query_start_loc", starts, num_tokens, "query tokens")


def check_request_values(op: str, num_tokens: int, block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                         num_blocks: int, block_size: int, compress_ratio: int = 1) -> list[tuple[int, int, int]]:
    """query_start_loc runs from 0 to T without decreasing; 0 <= q_b <= seq_lens[b]; the request's
    cached entries (seq_lens[b] // compress_ratio: one per token for 1) fit the block table, and
    every block id holding one is in range. Returns (first token row, q_b, seq_len) per request.

    Python integers throughout: no sum or product of int64 values can wrap around."""
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    check_query_starts(op, starts, num_tokens)
    capacity = block_tables.shape[1] * block_size
    requests = []
    for b, n in enumerate(lens):
        q_len = starts[b + 1] - starts[b]
        if n < q_len:
            raise ValueError(f"mla.{op}: seq_lens[{b}] = {n} is less than the request's {q_len} query tokens; "
                             f"seq_lens counts the cached tokens including the new ones (write them first)")
        if n // compress_ratio > capacity:
            held = "tokens" if compress_ratio == 1 else f"entries (seq_lens // compress_ratio {compress_ratio})"
            raise ValueError(f"mla.{op}: seq_lens[{b}] = {n} needs {n // compress_ratio} cached {held}, more than "
                             f"the block table's capacity ({block_tables.shape[1]} blocks x {block_size})")
        requests.append((starts[b], q_len, n))
    check_used_block_ids(op, block_tables, [-(-(n // compress_ratio) // block_size) for n in lens], num_blocks)
    return requests


def check_index_values(topk_indices: Tensor, requests: list[tuple[int, int, int]]) -> None:
    """Every index of request b's tokens is -1 (none) or a position in [0, seq_lens[b])."""
    if topk_indices.numel() == 0:
        return
    limit = torch.zeros(topk_indices.shape[0], dtype=torch.int64)
    for start, q_len, n in requests:
        limit[start:start + q_len] = n
    indices = topk_indices.long()
    bad = (indices < -1) | (indices >= limit[:, None])
    if bool(bad.any()):
        t, k = (int(v) for v in torch.nonzero(bad)[0])
        b = next(b for b, (start, q_len, _) in enumerate(requests) if start <= t < start + q_len)
        raise ValueError(f"mla.{SPARSE}: topk_indices[{t}, {k}] = {int(indices[t, k])} is not a position of "
                         f"request {b} (its {requests[b][2]} cached tokens) nor -1 (none)")


# ------------------------------------------------------------------------------------------ fakes
def _lightning_indexer_fake(q, weights, k_cache, block_tables, seq_lens, query_start_loc, topk, softmax_scale,
                            compress_ratio=1):
    check_lightning_indexer_args(q, weights, k_cache, block_tables, seq_lens, query_start_loc, topk, softmax_scale,
                                 compress_ratio)
    return q.new_empty((q.shape[0], topk), dtype=torch.int32)


def _sparse_mla_attention_fake(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                               topk_indices, softmax_scale, sinks=None, q_scale=None):
    check_sparse_mla_attention_args(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                    topk_indices, softmax_scale, sinks, q_scale)
    return q_latent.new_empty(q_latent.shape)


# ------------------------------------------------------------------------------------- references
def token_requests(query_start_loc: Tensor, num_tokens: int) -> Tensor:
    """The request [T] (int64) of every query token, without a host sync (a static output size)."""
    starts = query_start_loc.long()
    return torch.repeat_interleave(torch.arange(starts.shape[0] - 1, device=starts.device), starts[1:] - starts[:-1],
                                   output_size=num_tokens)


def token_positions(seq_lens: Tensor, query_start_loc: Tensor, num_tokens: int) -> tuple[Tensor, Tensor]:
    """(request [T], position [T]) of every query token, int64, without a host sync: token i of
    request b's q_b tokens sits at seq_lens[b] - q_b + i."""
    starts = query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    request = token_requests(query_start_loc, num_tokens)
    row = torch.arange(num_tokens, device=starts.device)
    position = seq_lens.long()[request] - q_lens[request] + (row - starts[request])
    return request, position


def _slots(block_tables: Tensor, request: Tensor, positions: Tensor, num_blocks: int, block_size: int):
    """(block [..], offset [..], valid [..]) of request-local `positions` of rows `request` (broadcast).

    Positions outside the table or with a block id outside the pool are invalid and addressed at block
    0 (clamped), so nothing is read out of bounds whatever the values; a table without columns has no
    valid position (it is read through one column of -1 instead)."""
    width = block_tables.shape[1]
    if width == 0:
        block_tables = block_tables.new_full((block_tables.shape[0], 1), -1)
    columns = torch.div(positions, block_size, rounding_mode="floor")
    in_table = (positions >= 0) & (columns < width)
    ids = block_tables.long()[request, columns.clamp(0, block_tables.shape[1] - 1)]
    valid = in_table & (ids >= 0) & (ids < num_blocks)
    return torch.where(valid, ids, 0), torch.where(valid, torch.remainder(positions, block_size), 0), valid


def lightning_indexer_reference(q: Tensor, weights: Tensor, k_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                                query_start_loc: Tensor, topk: int, softmax_scale: float,
                                compress_ratio: int = 1) -> Tensor:
    """-> int32 [T, topk]. The CPU value checks, then `lightning_indexer_sync_free`."""
    if k_cache.device.type == "cpu":
        check_request_values(INDEXER, q.shape[0], block_tables, seq_lens, query_start_loc, k_cache.shape[0],
                             k_cache.shape[1], compress_ratio)
    return lightning_indexer_sync_free(q, weights, k_cache, block_tables, seq_lens, query_start_loc, topk,
                                       softmax_scale, compress_ratio)


def lightning_indexer_sync_free(q: Tensor, weights: Tensor, k_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                                query_start_loc: Tensor, topk: int, softmax_scale: float,
                                compress_ratio: int = 1) -> Tensor:
    """The reference indexer's device path, no host sync and no value check: every token scores the
    whole block-table width (a static shape), entries it may not see or outside the table and pool
    are masked (never read out of bounds, whatever the values), query tokens in chunks."""
    num_tokens, num_blocks, block_size = q.shape[0], k_cache.shape[0], k_cache.shape[1]
    out = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=q.device)
    width = block_tables.shape[1] * block_size
    if num_tokens == 0 or width == 0:
        return out
    compute = torch.promote_types(q.dtype, torch.float32)
    request, position = token_positions(seq_lens, query_start_loc, num_tokens)
    columns = torch.arange(width, device=q.device)
    chunk = max(1, _CHUNK_ELEMENTS // (q.shape[1] * width))
    for first in range(0, num_tokens, chunk):
        rows = slice(first, min(first + chunk, num_tokens))
        req = request[rows]
        block, offset, valid = _slots(block_tables, req[:, None], columns[None, :], num_blocks, block_size)
        keys = k_cache[block, offset, 0].to(compute)  # [t, W, D]
        scores = torch.relu(torch.bmm(q[rows].to(compute), keys.transpose(1, 2)) * softmax_scale)  # [t, H, W]
        index_scores = torch.bmm(weights[rows].to(compute)[:, None, :], scores)[:, 0]  # [t, W]
        # V4's rule for pooled entries (entry w covers tokens up to (w+1)m - 1); w <= p for m = 1
        visible = torch.div(position[rows] + 1, compress_ratio, rounding_mode="floor")
        seen = valid & (columns[None, :] < visible[:, None])
        index_scores.masked_fill_(~seen, float("-inf"))
        # stable: equal scores keep ascending positions, so unseen positions (-inf, after p) never
        # precede a seen one; what is picked is re-checked against `seen` for -1
        order = torch.sort(index_scores, dim=-1, descending=True, stable=True).indices[:, :topk]
        picked = torch.gather(seen, 1, order)
        out[rows, : order.shape[1]] = torch.where(picked, order, -1).to(torch.int32)
    return out


def sparse_mla_attention_reference(q_latent: Tensor, q_pe: Tensor, key_cache: Tensor, value_cache: Tensor,
                                   block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                                   topk_indices: Tensor, softmax_scale: float,
                                   sinks: Optional[Tensor] = None, q_scale: Optional[Tensor] = None) -> Tensor:
    """-> o_latent [T, N, L] in q_latent's dtype. The CPU value checks, then `sparse_mla_attention_sync_free`."""
    if key_cache.device.type == "cpu":
        requests = check_request_values(SPARSE, q_latent.shape[0], block_tables, seq_lens, query_start_loc,
                                        key_cache.shape[0], key_cache.shape[1])
        check_index_values(topk_indices, requests)
    return sparse_mla_attention_sync_free(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens,
                                          query_start_loc, topk_indices, softmax_scale, sinks, q_scale)


def sparse_mla_attention_sync_free(q_latent: Tensor, q_pe: Tensor, key_cache: Tensor, value_cache: Tensor,
                                   block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                                   topk_indices: Tensor, softmax_scale: float,
                                   sinks: Optional[Tensor] = None, q_scale: Optional[Tensor] = None) -> Tensor:
    """The reference sparse attention's device path, no host sync and no value check: an index that is
    not a cached position of its request (or whose block id is outside the pool, or a table without
    columns) attends to nothing, like -1; nothing is read out of bounds whatever the values."""
    num_tokens, num_blocks, block_size = q_latent.shape[0], key_cache.shape[0], key_cache.shape[1]
    out = q_latent.new_zeros(q_latent.shape)
    width = topk_indices.shape[1]
    if num_tokens == 0 or width == 0:
        return out
    score_dtype = torch.promote_types(q_latent.dtype, torch.float32)
    request = token_requests(query_start_loc, num_tokens)
    chunk = max(1, _CHUNK_ELEMENTS // (width * (key_cache.shape[3] + value_cache.shape[3])))
    for first in range(0, num_tokens, chunk):
        rows = slice(first, min(first + chunk, num_tokens))
        req, indices = request[rows], topk_indices[rows].long()
        block, offset, valid = _slots(block_tables, req[:, None], indices, num_blocks, block_size)
        valid &= indices < seq_lens.long()[req][:, None]
        # The gathered rows are copied anyway: copied into fp32 (or fp64), the GEMMs are the exact
        # products of the activation-dtype values with fp32 sums, as a bf16 GEMM with fp32 accumulation
        # computes them, and run at fp32 speed on every CPU (ATen's bf16 GEMM is ~15x slower than fp32
        # on CPUs without AVX512-BF16: 292 ms vs 19 ms for P [128, 2048] @ latent [2048, 512]).
        latent = key_cache[block, offset, 0].to(score_dtype)  # [t, K, L]
        k_pe = value_cache[block, offset, 0].to(score_dtype)  # [t, K, R]
        # 0 * NaN would leak whatever an unattended slot holds into probs @ latent
        latent.masked_fill_(~valid[:, :, None], 0)
        scores = torch.bmm(q_latent[rows].to(score_dtype), latent.transpose(1, 2))  # [t, N, K]
        scores += torch.bmm(q_pe[rows].to(score_dtype), k_pe.transpose(1, 2))
        scores *= row_scales(softmax_scale, None if q_scale is None else q_scale[rows], score_dtype)
        scores.masked_fill_(~valid[:, None, :], float("-inf"))
        probs = softmax_with_sinks(scores, sinks)
        probs.masked_fill_(~valid.any(dim=1)[:, None, None], 0.0)  # nothing listed: zeros, not NaN
        # P rounded once to the activation dtype, as the decode kernels do before P @ latent
        probs = probs.to(q_latent.dtype).to(score_dtype)
        out[rows] = torch.bmm(probs, latent).to(out.dtype)
    return out


LIGHTNING_INDEXER = define_op(
    "lightning_indexer(Tensor q, Tensor weights, Tensor k_cache, Tensor block_tables, Tensor seq_lens, "
    "Tensor query_start_loc, int topk, float softmax_scale, int compress_ratio=1) -> Tensor",
    check=check_lightning_indexer_args, fake=_lightning_indexer_fake, reference=lightning_indexer_reference,
)
SPARSE_MLA_ATTENTION = define_op(
    "sparse_mla_attention(Tensor q_latent, Tensor q_pe, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
    "Tensor seq_lens, Tensor query_start_loc, Tensor topk_indices, float softmax_scale, Tensor? sinks=None, "
    "Tensor? q_scale=None) -> Tensor",
    check=check_sparse_mla_attention_args, fake=_sparse_mla_attention_fake, reference=sparse_mla_attention_reference,
)


# -------------------------------------------------------------------------------- public wrappers
def lightning_indexer(q: Tensor, weights: Tensor, k_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                      query_start_loc: Tensor, topk: int, softmax_scale: float, compress_ratio: int = 1, *,
                      validate: bool = False) -> Tensor:
    """The DeepSeek Sparse Attention indexer over a paged indexer-key cache (one key per token, or
    per `compress_ratio` tokens: DeepSeek-V4's compressed indexer keys).

    Args:
        q: `[T, H, D]` rotated indexer queries of the T query tokens (fp32 / bf16 / fp16).
        weights: `[T, H]` per-head weights (fp32 or q's dtype), scale factors such as `H**-0.5` folded in.
        k_cache: `[num_blocks, block_size, 1, D]` indexer keys (written with `mla.scatter_pa_cache`).
        block_tables: `[B, max_blocks]`; seq_lens: `[B]` cached tokens per request including its
            query tokens; query_start_loc: `[B+1]` cumulative query tokens per request.
        topk: positions kept per query token; softmax_scale: the scale inside the ReLU (`D**-0.5`), a
            positive normal float32 number.
        compress_ratio: tokens per cached key (1: one key per token). With m > 1 the cache holds the
            entries of a compressor (`mla.kv_compressor`): request b has `seq_lens[b] // m` of them, and a
            token at position p sees the entries w < (p + 1) // m, those whose tokens are all at or
            before p (DeepSeek-V4's compressed sparse attention).
        validate: check the index values on non-CPU devices (CPU always checks).
    Returns:
        int32 `[T, topk]`: request-local positions (entry indices for m > 1), best first (equal scores:
        lower position first on the reference and native CPU kernels; `torch.topk` has no such rule), -1
        past the entries a token can see.
    """
    if validates_on_host(validate, k_cache):
        check_lightning_indexer_args(q, weights, k_cache, block_tables, seq_lens, query_start_loc, topk,
                                     softmax_scale, compress_ratio)
        check_request_values(INDEXER, q.shape[0], block_tables, seq_lens, query_start_loc, k_cache.shape[0],
                             k_cache.shape[1], compress_ratio)
    return torch.ops.mla.lightning_indexer.default(q, weights, k_cache, block_tables, seq_lens, query_start_loc,
                                                   topk, softmax_scale, compress_ratio)


def sparse_mla_attention(q_latent: Tensor, q_pe: Tensor, key_cache: Tensor, value_cache: Tensor,
                         block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor, topk_indices: Tensor,
                         softmax_scale: float, sinks: Optional[Tensor] = None, q_scale: Optional[Tensor] = None, *,
                         validate: bool = False) -> Tensor:
    """Absorbed MQA attention of each query token over its own list of cached positions.

    Args:
        q_latent: `[T, N, L]` q_nope multiplied by W_UK; q_pe: `[T, N, R]` rotated.
        key_cache / value_cache: the MLA cache pair `[num_blocks, block_size, 1, L]` (latent) and
            `[num_blocks, block_size, 1, R]` (rotated k_pe), as for `mla.mla_decode_attention`.
        block_tables, seq_lens, query_start_loc: the request layout (see `lightning_indexer`).
        topk_indices: `[T, K]` int32/int64 request-local positions (`lightning_indexer`'s output), -1 = none;
            a position listed twice is attended twice.
        softmax_scale: the attention scale, a positive normal float32 number.
        sinks: `[N]` per-head sink logits (fp32 or q_latent's dtype) in the softmax denominator, or None.
        q_scale: `[T, N]` a factor on softmax_scale per token and head (fp32 or q_latent's dtype), or None.
        validate: check the index values on non-CPU devices (CPU always checks).
    Returns:
        `o_latent [T, N, L]` (zeros for a token with no position listed), to be multiplied by W_UV.
    """
    if validates_on_host(validate, key_cache):
        check_sparse_mla_attention_args(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens,
                                        query_start_loc, topk_indices, softmax_scale, sinks, q_scale)
        requests = check_request_values(SPARSE, q_latent.shape[0], block_tables, seq_lens, query_start_loc,
                                        key_cache.shape[0], key_cache.shape[1])
        check_index_values(topk_indices.cpu(), requests)
    return torch.ops.mla.sparse_mla_attention.default(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens,
                                                      query_start_loc, topk_indices, softmax_scale, sinks, q_scale)


TO_GLOBAL_SLOTS = "to_global_slots"
INT32_MAX = 2**31 - 1


def _check_global_slot_args(topk_indices: Tensor, block_tables: Tensor, query_start_loc: Tensor,
                            block_size: int) -> None:
    """topk_indices [T, K], block_tables [B, max_blocks], query_start_loc [B+1], all int32/int64, one
    device; block_size a positive int. Metadata only (sync-free)."""
    op = TO_GLOBAL_SLOTS
    torch._check(isinstance(block_size, int) and not isinstance(block_size, bool) and block_size >= 1,
                 lambda: f"mla.{op}: block_size must be a positive int (tokens per cache block), got {block_size!r}")
    check_index(op, "topk_indices", topk_indices)
    check_rank(op, "topk_indices", topk_indices, 2, "[tokens, topk] (request-local positions, -1 = none)")
    check_index(op, "block_tables", block_tables)
    check_rank(op, "block_tables", block_tables, 2, "[batch, max_blocks_per_seq]")
    check_index(op, "query_start_loc", query_start_loc)
    check_rank(op, "query_start_loc", query_start_loc, 1, "[batch + 1] (cumulative query tokens per request)")
    check_size(op, "query_start_loc", query_start_loc.shape[0], block_tables.shape[0] + 1,
               "must have one entry per request plus one (cumulative counts starting at 0)")
    check_same_device(op, {"topk_indices": topk_indices, "block_tables": block_tables,
                           "query_start_loc": query_start_loc})


def to_global_slots(topk_indices: Tensor, block_tables: Tensor, query_start_loc: Tensor, block_size: int, *,
                    validate: bool = False) -> Tensor:
    """Request-local positions -> global cache slots `block_tables[b, i // bs] * bs + i % bs`: the index
    convention of FlashMLA's sparse decode and vLLM's sparse MLA backends
    (`triton_convert_req_index_to_global_index` in vllm/v1/attention/backends/mla/sparse_utils.py).

    Args:
        topk_indices: `[T, K]` int32/int64 request-local positions (`lightning_indexer`'s output).
        block_tables: `[B, max_blocks]` int32/int64; query_start_loc: `[B+1]` int32/int64 cumulative
            query tokens per request (its last entry must be T).
        block_size: tokens per cache block, >= 1.
        validate: on non-CPU devices, run the value checks CPU calls always run (a host sync):
            query_start_loc from 0 to T without decreasing, no slot past int32.
    Returns:
        int32 `[T, K]`: the slot of each entry, -1 for an entry that addresses no cached token (a
        negative position, one past its request's table, or a block id < 0).
    Raises:
        RuntimeError naming the argument for a wrong dtype, rank, length or block_size; ValueError
        naming the entry for a slot above 2**31 - 1, which int32 cannot hold, or
        for query_start_loc values (CPU, or validate=True).
        On other devices without validate such an entry is -1, never a wrapped-around slot.
    No host sync on non-CPU devices unless validate=True."""
    if not isinstance(block_size, (int, bool)):
        try:  # a numpy or one-element integer tensor: the Python int it stands for
            block_size = operator.index(block_size)
        except TypeError:
            pass  # refused below, with the argument named
    _check_global_slot_args(topk_indices, block_tables, query_start_loc, block_size)
    host = topk_indices.device.type == "cpu" or validate
    if host:
        check_query_starts(TO_GLOBAL_SLOTS, query_start_loc.tolist(), topk_indices.shape[0])
    request = token_requests(query_start_loc, topk_indices.shape[0])
    indices = topk_indices.long()
    # every block id >= 0 is a block: the pool size is unknown here
    block, offset, valid = _slots(block_tables, request[:, None], indices, torch.iinfo(torch.int64).max, block_size)
    # compared before multiplying: block * block_size could wrap around even in int64
    fits = block <= torch.div(INT32_MAX - offset, block_size, rounding_mode="floor")
    slots = torch.where(fits, block, 0) * block_size + offset
    if host:
        bad = valid & ~fits
        if bool(bad.any()):
            t, k = (int(v) for v in torch.nonzero(bad)[0])
            slot = int(block[t, k]) * block_size + int(offset[t, k])  # a Python int: no wrap-around
            raise ValueError(f"mla.{TO_GLOBAL_SLOTS}: topk_indices[{t}, {k}] = {int(indices[t, k])} addresses slot "
                             f"{slot} (block id {int(block[t, k])} x block_size {block_size} + offset "
                             f"{int(offset[t, k])}), which int32 cannot hold (at most {INT32_MAX}); use block ids "
                             f"below {INT32_MAX // block_size + 1}")
    return torch.where(valid & fits, slots, -1).to(torch.int32)
