"""`mla::mla_prefill_attention`: absorbed MQA prefill over the paged latent cache, causal.

The request layout of a mixed prefill / decode batch, as `mla.sparse_mla_attention` takes it
(`mla_ops/ops/sparse_attention.py`): B requests, `query_start_loc [B+1]` cumulative query tokens
(request b's are rows `query_start_loc[b]:query_start_loc[b+1]`), `seq_lens [B]` cached tokens of each
request *including* its q_b new ones (written to the cache first), one block-table row per request.
Query token i of request b sits at position `p = seq_lens[b] - q_b + i` and attends the cached
positions 0..p (causal, aligned bottom-right: torch_npu's `sparse_mode=3`). Per head n, over those
positions j (latent[j] and k_pe[j] read from the cache pair as for `mla.mla_decode_attention`):

    scores[t, n, j] = scale * (q_latent[t, n] . latent[j] + q_pe[t, n] . k_pe[j])
    o_latent[t, n]  = softmax_j(scores[t, n, :p+1]) . latent[:p+1]

It is `mla.mla_decode_attention` for q_b = 1, and `mla.sparse_mla_attention` with every token listing
the positions 0..p. Every head reads the same L + R values per cached position and the context needs
no expansion through kv_b_proj, which suits short chunks over long contexts and batches mixing decode
and prefill tokens; a long prompt costs less in the expanded form (`mla.mha_prefill_attention`:
N·(Dqk + Dv) instead of N·(2L + R) multiply-adds per (query, key) pair).

Precision, as the decode and sparse ops: scores and the softmax in fp32 (fp64 for fp64), the
probabilities rounded once to the activation dtype before P·latent, the output rounded once.

Memory: the reference runs an online softmax over tiles of cached positions for chunks of query
tokens (fp32 running maximum, sum and accumulator per token and head), so it never holds
[heads, query tokens, context] scores: a chunk's scores are at most `_CHUNK_ELEMENTS` values. On CPU
it reads each request's lengths on the host (the value checks run there anyway) and multiplies the
chunk's tokens and heads against each tile of the request's cached rows; positions after a token
are masked, and a non-finite cached row a token does not attend has no effect on it (0 x inf is
NaN in a GEMM, so such rows are added separately to the tokens that attend them). On other devices
the sync-free path reads nothing on the host: it walks the whole block-table width per token,
gathering each token's own rows (unattended ones zeroed), so a position whose block id is outside
the pool, or one past the request's length, contributes nothing; a token with nothing to attend
(values the CPU checks refuse) gets zeros.

The value checks of every CPU call (ValueError, before anything is computed) are those of the sparse
ops (`check_request_values`): query_start_loc from 0 to T without decreasing, q_b <= seq_lens[b],
seq_lens[b] within the block table's capacity, every block id used in range.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._checks import check_same_device, check_softmax_scale, memo_by_signature
from .._library import define_op
from ._paged import check_latent_query_and_caches, validates_on_host
from .sparse_attention import _CHUNK_ELEMENTS, _check_requests, _slots, check_request_values, token_positions

OP = "mla_prefill_attention"

# Cached positions per tile of the online softmax.
_TILE = 512


# ----------------------------------------------------------------------------------------- checks
@memo_by_signature
def check_mla_prefill_attention_args(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                     softmax_scale: float) -> None:
    """q_latent [T, N, L], q_pe [T, N, R]; key_cache [NB, bs, 1, L] (latent), value_cache [NB, bs, 1, R]
    (k_pe), in q_latent's dtype; block_tables [B, max_blocks], seq_lens [B], query_start_loc [B+1]
    (int32/int64); softmax_scale a positive normal float32 number (`check_softmax_scale`)."""
    check_softmax_scale(OP, softmax_scale, " (e.g. qk_head_dim ** -0.5)")
    check_latent_query_and_caches(OP, "tokens", q_latent, q_pe, key_cache, value_cache)
    _check_requests(OP, block_tables, seq_lens, query_start_loc)
    check_same_device(OP, {"q_latent": q_latent, "q_pe": q_pe, "key_cache": key_cache, "value_cache": value_cache,
                           "block_tables": block_tables, "seq_lens": seq_lens, "query_start_loc": query_start_loc})


def _mla_prefill_attention_fake(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                softmax_scale):
    check_mla_prefill_attention_args(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                     softmax_scale)
    return q_latent.new_empty(q_latent.shape)


# -------------------------------------------------------------------------------------- reference
class _OnlineSoftmax:
    """Running maximum m, sum l and accumulator acc of rows of scores seen tile by tile (fp32, or fp64):
    after every tile, acc / l is the softmax-weighted sum of the rows' values so far."""

    def __init__(self, rows: tuple, dim: int, like: Tensor, compute: torch.dtype):
        self.m = like.new_full(rows, float("-inf"), dtype=compute)
        self.l = like.new_zeros(rows, dtype=compute)
        self.acc = like.new_zeros((*rows, dim), dtype=compute)

    def probabilities(self, scores: Tensor) -> Tensor:
        """exp(scores - running max) for a new tile [*rows, K] (masked scores are -inf), updating m, l and
        rescaling acc; a row that has seen only -inf keeps a zero sum. NaN / +inf scores make the row NaN."""
        m_new = torch.maximum(self.m, scores.amax(dim=-1))
        shift = torch.where(m_new == float("-inf"), 0.0, m_new)
        alpha = torch.exp(self.m - shift)
        probs = torch.exp(scores - shift[..., None])
        self.l = self.l * alpha + probs.sum(dim=-1)
        self.acc *= alpha[..., None]
        self.m = m_new
        return probs

    def result(self) -> Tensor:
        """acc / l; zeros for a row that attended nothing (l == 0)."""
        return torch.where(self.l[..., None] == 0, 0.0, self.acc / self.l[..., None])


def _request_prefill(q_latent: Tensor, q_pe: Tensor, key_cache: Tensor, value_cache: Tensor, table_row: Tensor,
                     seq_len: int, softmax_scale: float) -> Tensor:
    """One request on CPU: q_latent [q, N, L], q_pe [q, N, R] at positions seq_len - q .. seq_len - 1
    -> o_latent [q, N, L] in the compute dtype."""
    q_len, heads, lora = q_latent.shape
    compute = torch.promote_types(q_latent.dtype, torch.float32)
    block_size = key_cache.shape[1]
    first = seq_len - q_len  # the position of the request's first query token
    out = q_latent.new_empty(q_latent.shape, dtype=compute)
    chunk = max(1, _CHUNK_ELEMENTS // (heads * _TILE))
    for i0 in range(0, q_len, chunk):
        i1 = min(q_len, i0 + chunk)
        rows = (i1 - i0) * heads
        # the exact products of the activation-dtype values with fp32 sums, as the sparse reference
        query_latent = q_latent[i0:i1].reshape(rows, lora).to(compute)
        query_pe = q_pe[i0:i1].reshape(rows, -1).to(compute)
        state = _OnlineSoftmax((rows,), lora, q_latent, compute)
        seen = first + i1  # the chunk's last token attends positions 0 .. first + i1 - 1
        for k0 in range(0, seen, _TILE):
            positions = torch.arange(k0, min(seen, k0 + _TILE))
            blocks = table_row[torch.div(positions, block_size, rounding_mode="floor")]
            offsets = torch.remainder(positions, block_size)
            latent = key_cache[blocks, offsets, 0].to(compute)  # [K, L]
            k_pe = value_cache[blocks, offsets, 0].to(compute)  # [K, R]
            scores = query_latent @ latent.t()
            scores += query_pe @ k_pe.t()
            scores *= softmax_scale
            # a tile holding positions after some token of the chunk is masked for that token
            attended = None
            if int(positions[-1]) > first + i0:
                token_positions_ = torch.arange(first + i0, first + i1)
                attended = (positions[None, :] <= token_positions_[:, None]).repeat_interleave(heads, dim=0)
                scores.masked_fill_(~attended, float("-inf"))
            probs = state.probabilities(scores)
            # P rounded once to the activation dtype, as the decode kernels do before P @ latent
            probs = probs.to(q_latent.dtype).to(compute)
            finite = torch.isfinite(latent).all(dim=-1)
            if attended is None or bool(finite.all()):
                state.acc += probs @ latent
                continue
            # 0 x inf = NaN: a non-finite row reaches only the tokens that attend it
            state.acc += probs @ latent.masked_fill(~finite[:, None], 0)
            for j in torch.nonzero(~finite)[:, 0].tolist():
                takes = attended[:, j]
                state.acc[takes] += probs[takes, j, None] * latent[j]
        out[i0:i1] = state.result().view(i1 - i0, heads, lora)
    return out


def mla_prefill_attention_reference(q_latent: Tensor, q_pe: Tensor, key_cache: Tensor, value_cache: Tensor,
                                    block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                                    softmax_scale: float) -> Tensor:
    """-> o_latent [T, N, L] in q_latent's dtype. CPU: the value checks, then each request's tiles; other
    devices: `mla_prefill_attention_sync_free`."""
    if key_cache.device.type != "cpu":
        return mla_prefill_attention_sync_free(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens,
                                               query_start_loc, softmax_scale)
    requests = check_request_values(OP, q_latent.shape[0], block_tables, seq_lens, query_start_loc,
                                    key_cache.shape[0], key_cache.shape[1])
    out = q_latent.new_empty(q_latent.shape)
    tables = block_tables.long()
    for b, (start, q_len, seq_len) in enumerate(requests):
        if q_len == 0:
            continue
        rows = slice(start, start + q_len)
        out[rows] = _request_prefill(q_latent[rows], q_pe[rows], key_cache, value_cache, tables[b], seq_len,
                                     softmax_scale).to(out.dtype)
    return out


def mla_prefill_attention_sync_free(q_latent: Tensor, q_pe: Tensor, key_cache: Tensor, value_cache: Tensor,
                                    block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                                    softmax_scale: float) -> Tensor:
    """The device path: no host sync and no value check. Each token gathers its own rows over the whole
    block-table width, tile by tile (a static shape); a position after the token, at or past its
    request's length, or with a block id outside the pool is not attended (its gathered row zeroed), so
    nothing is read out of bounds whatever the values; a token left with nothing attended gets zeros."""
    num_tokens, heads, lora = q_latent.shape
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    out = q_latent.new_zeros(q_latent.shape)
    width = block_tables.shape[1] * block_size
    if num_tokens == 0 or width == 0:
        return out
    compute = torch.promote_types(q_latent.dtype, torch.float32)
    request, position = token_positions(seq_lens, query_start_loc, num_tokens)
    # positions 0..p of the request's cached ones: fewer than p + 1 when seq_lens is too small
    limit = torch.minimum(position + 1, seq_lens.long()[request])
    tile = min(width, _TILE)
    chunk = max(1, _CHUNK_ELEMENTS // (tile * (lora + value_cache.shape[3] + heads)))
    for t0 in range(0, num_tokens, chunk):
        rows = slice(t0, min(num_tokens, t0 + chunk))
        req = request[rows]
        query_latent, query_pe = q_latent[rows].to(compute), q_pe[rows].to(compute)
        state = _OnlineSoftmax(tuple(query_latent.shape[:2]), lora, q_latent, compute)
        for k0 in range(0, width, tile):
            columns = torch.arange(k0, min(width, k0 + tile), device=q_latent.device)
            block, offset, valid = _slots(block_tables, req[:, None], columns[None, :], num_blocks, block_size)
            valid &= columns[None, :] < limit[rows][:, None]
            latent = key_cache[block, offset, 0].to(compute)  # [t, K, L]
            k_pe = value_cache[block, offset, 0].to(compute)  # [t, K, R]
            latent.masked_fill_(~valid[:, :, None], 0)  # 0 x NaN would leak an unattended row
            scores = torch.bmm(query_latent, latent.transpose(1, 2))  # [t, N, K]
            scores += torch.bmm(query_pe, k_pe.transpose(1, 2))
            scores *= softmax_scale
            scores.masked_fill_(~valid[:, None, :], float("-inf"))
            probs = state.probabilities(scores).to(q_latent.dtype).to(compute)
            state.acc += torch.bmm(probs, latent)
        out[rows] = state.result().to(out.dtype)
    return out


MLA_PREFILL_ATTENTION = define_op(
    "mla_prefill_attention(Tensor q_latent, Tensor q_pe, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
    "Tensor seq_lens, Tensor query_start_loc, float softmax_scale) -> Tensor",
    check=check_mla_prefill_attention_args, fake=_mla_prefill_attention_fake,
    reference=mla_prefill_attention_reference,
)


# ---------------------------------------------------------------------------------- public wrapper
def mla_prefill_attention(q_latent: Tensor, q_pe: Tensor, key_cache: Tensor, value_cache: Tensor,
                          block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor, softmax_scale: float, *,
                          validate: bool = False) -> Tensor:
    """Absorbed MQA prefill over the paged latent cache: each query token attends its request's cached
    positions up to its own (causal, aligned bottom-right).

    Args:
        q_latent: `[T, N, L]` q_nope multiplied by W_UK; q_pe: `[T, N, R]` rotated.
        key_cache / value_cache: the MLA cache pair `[num_blocks, block_size, 1, L]` (latent) and
            `[num_blocks, block_size, 1, R]` (rotated k_pe), as for `mla.mla_decode_attention` (strided
            column views of one `[num_blocks, block_size, 1, L + R]` pool included).
        block_tables: `[B, max_blocks]` int32/int64; seq_lens: `[B]` cached tokens per request including
            its query tokens (written first); query_start_loc: `[B+1]` cumulative query tokens.
        softmax_scale: the attention scale, a positive normal float32 number.
        validate: check the index values on non-CPU devices (CPU always checks).
    Returns:
        `o_latent [T, N, L]` in q_latent's dtype: token i of request b (q_b tokens) attends positions
        0 .. seq_lens[b] - q_b + i; to be multiplied by W_UV.
    """
    if validates_on_host(validate, key_cache):
        check_mla_prefill_attention_args(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens,
                                         query_start_loc, softmax_scale)
        check_request_values(OP, q_latent.shape[0], block_tables, seq_lens, query_start_loc, key_cache.shape[0],
                             key_cache.shape[1])
    return torch.ops.mla.mla_prefill_attention.default(q_latent, q_pe, key_cache, value_cache, block_tables,
                                                       seq_lens, query_start_loc, softmax_scale)
