"""The contract of every `mla::` op as plain code: the one copy the tests, the selftest and the
benchmarks judge every kernel by.

Each oracle takes the op's own arguments and returns what the op must produce, as a tuple of
tensors: the op's outputs, or for an op that writes in place the tensors it writes (in schema
order). The math runs in float64 on the CPU, straight from the formulas in the op modules'
docstrings and docs/design.md (loops over sequences and tokens for the paged ops), sharing no code
with the kernels: a kernel is right when it is within its rounding bound of these
(`mla_ops.testing.cases`).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


def _f64(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.detach().cpu().double()


# ------------------------------------------------------------------------------------------ math
def rms_norm_oracle(x: Tensor, weight: Tensor, eps: float = 1e-6) -> tuple[Tensor]:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim."""
    x, weight = _f64(x), _f64(weight)
    return (weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps),)


def _tables_for(table: Tensor, x: Tensor) -> Tensor:
    """cos/sin `[B, S, R/2]` or `[S, R/2]` lined up with x `[B, ..., S, R/2]` (batch first, then tokens)."""
    table = _f64(table)
    if table.dim() == 3 and x.dim() > 3:
        table = table.view(table.shape[0], *([1] * (x.dim() - 3)), *table.shape[1:])
    return table


def rope_oracle(x: Tensor, cos: Tensor, sin: Tensor, *, layout: str = "interleaved",
                compute_dtype: str = "float32") -> tuple[Tensor]:
    """Rotate each pair (x0, x1) by its angle: (x0 c - x1 s, x0 s + x1 c).

    interleaved: pairs (x[2i], x[2i+1]) written back in place; half: the same pairs written as
    (out[i], out[i + D/2]); neox: pairs (x[i], x[i + D/2]) written in place. `compute_dtype` only says
    where a kernel rounds (once, or after every product and sum): the exact rotation is the same."""
    x = _f64(x)
    half = x.shape[-1] // 2
    if layout == "neox":
        x0, x1 = x[..., :half], x[..., half:]
    else:
        x0, x1 = x[..., 0::2], x[..., 1::2]
    c, s = _tables_for(cos, x), _tables_for(sin, x)
    o0, o1 = x0 * c - x1 * s, x0 * s + x1 * c
    if layout == "interleaved":
        out = torch.empty_like(x)
        out[..., 0::2], out[..., 1::2] = o0, o1
        return (out,)
    return (torch.cat((o0, o1), dim=-1),)


def _linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    out = x @ weight.t()
    return out if bias is None else out + bias


def _latent(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, eps):
    """-> (latent [B, S, L] normed, k_pe [B, S, R] not rotated)."""
    lora = kv_norm_weight.shape[0]
    compressed = _linear(_f64(hidden_states), _f64(kv_a_weight), _f64(kv_a_bias))
    (latent,) = rms_norm_oracle(compressed[..., :lora], kv_norm_weight, eps)
    return latent, compressed[..., lora:]


def _heads(t: Tensor, num_heads: int) -> Tensor:
    """[B, S, N*D] -> [B, N, S, D]: heads after batch, then tokens."""
    batch, seq, width = t.shape
    return t.reshape(batch, seq, num_heads, width // num_heads).permute(0, 2, 1, 3)


def latent_kv_prolog_oracle(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin, *, eps=1e-6,
                            rope_layout="interleaved", rope_compute_dtype="float32"):
    """-> (latent [B, S, L], k_pe [B, S, R] rotated)."""
    latent, k_pe = _latent(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, eps)
    return latent, rope_oracle(k_pe, cos, sin, layout=rope_layout)[0]


def kv_prolog_oracle(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin, *, num_heads,
                     qk_nope_head_dim, v_head_dim, eps=1e-6, rope_layout="interleaved", rope_compute_dtype="float32"):
    """-> (k_nope [B, N, S, P], value [B, N, S, V], k_pe [B, 1, S, R] rotated)."""
    latent, k_pe = _latent(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, eps)
    kv = _heads(_linear(latent, _f64(kv_b_weight)), num_heads)
    batch, seq, rope_dim = k_pe.shape
    (k_pe,) = rope_oracle(k_pe.reshape(batch, 1, seq, rope_dim), cos, sin, layout=rope_layout)
    return kv[..., :qk_nope_head_dim], kv[..., qk_nope_head_dim:], k_pe


def q_prolog_oracle(hidden_states, q_a_weight, q_a_bias, q_norm_weight, q_b_weight, cos, sin, *, num_heads,
                    qk_nope_head_dim, eps=1e-6, rope_layout="interleaved", rope_compute_dtype="float32"):
    """-> (q_nope [B, N, S, P], q_pe [B, N, S, R] rotated); without q-LoRA q_b_weight takes hidden directly."""
    q_in = _f64(hidden_states)
    if q_a_weight is not None:
        (q_in,) = rms_norm_oracle(_linear(q_in, _f64(q_a_weight), _f64(q_a_bias)), q_norm_weight, eps)
    q = _heads(_linear(q_in, _f64(q_b_weight)), num_heads)
    return q[..., :qk_nope_head_dim], rope_oracle(q[..., qk_nope_head_dim:], cos, sin, layout=rope_layout)[0]


# ------------------------------------------------------------------------------------- paged cache
def _sequences(block_tables, seq_lens, seq_offset, is_seq_lens_cumsum, block_size):
    """Per sequence q: (first output row, token count, first block-table column)."""
    lens = [int(v) for v in seq_lens]
    if is_seq_lens_cumsum:
        counts = [b - a for a, b in zip(lens[:-1], lens[1:])]
        bases = lens[:-1]
    else:
        counts = lens
        bases = [sum(lens[:q]) for q in range(len(lens))]
    columns = [0 if seq_offset is None else int(seq_offset[q]) // block_size for q in range(len(counts))]
    return list(zip(bases, counts, columns))


def gather_pa_kv_cache_oracle(key_cache, value_cache, block_tables, seq_lens, key, value, *, seq_offset=None,
                              is_seq_lens_cumsum=False):
    """-> (key, value) after the gather: for each sequence q and token t < its length,
    key[base(q) + t] = key_cache[block_tables[q, column(q) + t // bs], t % bs]; other rows untouched."""
    block_size = key_cache.shape[1]
    key, value = key.detach().cpu().clone(), value.detach().cpu().clone()
    key_cache, value_cache = key_cache.detach().cpu(), value_cache.detach().cpu()
    for q, (base, count, column) in enumerate(_sequences(block_tables, seq_lens, seq_offset, is_seq_lens_cumsum,
                                                         block_size)):
        for t in range(count):
            block = int(block_tables[q, column + t // block_size])
            key[base + t] = key_cache[block, t % block_size]
            value[base + t] = value_cache[block, t % block_size]
    return key, value


def scatter_pa_kv_cache_oracle(key, value, key_cache, value_cache, slot_mapping):
    """-> (key_cache, value_cache) after key_cache[s // bs, s % bs] = key[t] for every slot s >= 0."""
    block_size = key_cache.shape[1]
    key_cache, value_cache = key_cache.detach().cpu().clone(), value_cache.detach().cpu().clone()
    for t, slot in enumerate(int(s) for s in slot_mapping):
        if slot >= 0:
            key_cache[slot // block_size, slot % block_size] = key[t].detach().cpu()
            value_cache[slot // block_size, slot % block_size] = value[t].detach().cpu()
    return key_cache, value_cache


def _sink_softmax(scores: Tensor, sinks) -> Tensor:
    """Each head's softmax over scores [N, K] (fp64) with its sink logit sinks[n] (None: none) added to the
    denominator only: exp(s_k - M) / (sum_k exp(s_k - M) + exp(sink_n - M)), M = max(max_k s_k, sink_n)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = _f64(sinks)[:, None]
    top = torch.maximum(scores.max(dim=-1, keepdim=True).values, sink)
    weights = torch.exp(scores - top)
    return weights / (weights.sum(dim=-1, keepdim=True) + torch.exp(sink - top))


def mla_decode_attention_oracle(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, softmax_scale,
                                sinks=None, sliding_window=0, q_scale=None):
    """-> (o_latent [B, N, L],): per sequence, softmax(scale * (q_latent latent^T + q_pe k_pe^T)) latent
    over its first seq_lens[b] cached tokens (the last `sliding_window` of them when it is >= 1), the latent
    and k_pe read token by token from the pool; with `sinks` [N] each head's sink logit joins its
    denominator (`_sink_softmax`); with `q_scale` [B, N] head n's scores of row b are also multiplied by
    q_scale[b, n]."""
    block_size = key_cache.shape[1]
    out = torch.zeros(q_latent.shape, dtype=torch.float64)
    for b in range(q_latent.shape[0]):
        n = int(seq_lens[b])
        start = max(0, n - sliding_window) if sliding_window else 0
        slots = [(int(block_tables[b, t // block_size]), t % block_size) for t in range(start, n)]
        latent = torch.stack([_f64(key_cache[i, o, 0]) for i, o in slots])
        k_pe = torch.stack([_f64(value_cache[i, o, 0]) for i, o in slots])
        scores = (_f64(q_latent[b]) @ latent.t() + _f64(q_pe[b]) @ k_pe.t()) * softmax_scale
        if q_scale is not None:
            scores = scores * _f64(q_scale[b])[:, None]
        out[b] = _sink_softmax(scores, sinks) @ latent
    return (out,)



# ------------------------------------------------------------------------------------ sparse MLA
def _request_tokens(seq_lens, query_start_loc):
    """Per query token t: (request b, position p, seq_len n), from the host lists."""
    starts, lens = [int(v) for v in query_start_loc], [int(v) for v in seq_lens]
    tokens = []
    for b, n in enumerate(lens):
        q_len = starts[b + 1] - starts[b]
        tokens += [(b, n - q_len + i, n) for i in range(q_len)]
    return tokens


def _cached_row(cache, block_tables, b: int, j: int):
    block_size = cache.shape[1]
    return _f64(cache[int(block_tables[b, j // block_size]), j % block_size, 0])


def scatter_pa_cache_oracle(key, cache, slot_mapping):
    """-> (cache,) after cache[s // bs, s % bs] = key[t] for every slot s >= 0."""
    block_size = cache.shape[1]
    cache = cache.detach().cpu().clone()
    for t, slot in enumerate(int(s) for s in slot_mapping):
        if slot >= 0:
            cache[slot // block_size, slot % block_size] = key[t].detach().cpu()
    return (cache,)


def lightning_indexer_oracle(q, weights, k_cache, block_tables, seq_lens, query_start_loc, topk, softmax_scale,
                             compress_ratio=1):
    """-> (int32 [T, topk],): per query token at position p, the entries it sees, w < (p + 1) // m
    (the positions 0..p for m = 1), sorted by descending score_w = sum_h w_h * relu(scale * q_h . k_w)
    (fp64), equal scores by ascending index; the first topk of them, -1 past those there are (every
    entry -1 for p < 0)."""
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32)
    for t, (b, p, _) in enumerate(_request_tokens(seq_lens, query_start_loc)):
        visible = (p + 1) // compress_ratio
        if p < 0 or visible == 0:  # p < 0: values only the unchecked device paths take
            continue
        keys = torch.stack([_cached_row(k_cache, block_tables, b, j) for j in range(visible)])
        scores = torch.relu(softmax_scale * (_f64(q[t]) @ keys.t())).t() @ _f64(weights[t])  # [visible]
        ranked = sorted(range(visible), key=lambda j: (-float(scores[j]), j))[:topk]
        out[t, : len(ranked)] = torch.tensor(ranked, dtype=torch.int32)
    return (out,)


def sparse_mla_attention_oracle(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                topk_indices, softmax_scale, sinks=None, q_scale=None):
    """-> (o_latent [T, N, L],): per query token, softmax(scale * (q_latent latent^T + q_pe k_pe^T)) latent
    over the positions it lists (a position listed twice counts twice; -1 skipped), zeros when it lists none;
    with `sinks` [N] each head's sink logit joins its denominator (`_sink_softmax`), with `q_scale` [T, N] head n's
    scores of token t are also multiplied by q_scale[t, n].
    An entry that is no cached position of its request (values only the unchecked device paths take) is
    skipped like -1."""
    out = torch.zeros(q_latent.shape, dtype=torch.float64)
    for t, (b, _, n) in enumerate(_request_tokens(seq_lens, query_start_loc)):
        listed = [int(j) for j in topk_indices[t] if 0 <= int(j) < n]
        if not listed:
            continue
        latent = torch.stack([_cached_row(key_cache, block_tables, b, j) for j in listed])
        k_pe = torch.stack([_cached_row(value_cache, block_tables, b, j) for j in listed])
        scores = (_f64(q_latent[t]) @ latent.t() + _f64(q_pe[t]) @ k_pe.t()) * softmax_scale
        if q_scale is not None:
            scores = scores * _f64(q_scale[t])[:, None]
        out[t] = _sink_softmax(scores, sinks) @ latent
    return (out,)


# ------------------------------------------------------------------------------------ MLA prefill
def mla_prefill_attention_oracle(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                 softmax_scale):
    """-> (o_latent [T, N, L],): per query token at position p (seq_lens[b] - q_b + i), softmax(scale *
    (q_latent latent^T + q_pe k_pe^T)) latent over its request's cached positions 0..p, token by token (what a
    token does not attend never enters its sums). A position whose block id is not in the pool, or past the
    request's length (values only the unchecked device paths take), is skipped; a token left with no
    position gets zeros."""
    out = torch.zeros(q_latent.shape, dtype=torch.float64)
    starts = [int(v) for v in query_start_loc]
    for b, n in enumerate(int(v) for v in seq_lens):
        first, q_len = starts[b], starts[b + 1] - starts[b]
        if q_len == 0:
            continue
        rows = [(j, _pool_row(key_cache, block_tables, b, j)) for j in range(max(n, 0))]
        rows = [(j, row) for j, row in rows if row is not None]
        if not rows:
            continue
        positions = torch.tensor([j for j, _ in rows])
        latent = torch.stack([row for _, row in rows])  # [K, L]
        k_pe = torch.stack([_pool_row(value_cache, block_tables, b, j) for j, _ in rows])  # [K, R]
        for i in range(q_len):
            seen = positions <= n - q_len + i
            if not bool(seen.any()):
                continue
            t = first + i
            scores = (_f64(q_latent[t]) @ latent[seen].t() + _f64(q_pe[t]) @ k_pe[seen].t()) * softmax_scale
            out[t] = torch.softmax(scores, dim=-1) @ latent[seen]
    return (out,)


def mha_prefill_attention_oracle(q, k, v, query_start_loc, key_start_loc, softmax_scale):
    """-> (out [T, N, Dv],): per query token i of request b (q_b tokens, k_b keys) and head n,
    softmax(scale * q k^T) v over the request's keys 0 .. k_b - q_b + i, token by token."""
    out = torch.zeros((q.shape[0], q.shape[1], v.shape[2]), dtype=torch.float64)
    query_starts, key_starts = [int(x) for x in query_start_loc], [int(x) for x in key_start_loc]
    for b in range(len(query_starts) - 1):
        q0, q_len = query_starts[b], query_starts[b + 1] - query_starts[b]
        k0, k_len = key_starts[b], key_starts[b + 1] - key_starts[b]
        for i in range(q_len):
            keys = slice(k0, k0 + k_len - q_len + i + 1)
            scores = torch.einsum("nd,knd->nk", _f64(q[q0 + i]), _f64(k[keys])) * softmax_scale
            out[q0 + i] = torch.einsum("nk,knd->nd", torch.softmax(scores, dim=-1), _f64(v[keys]))
    return (out,)


# --------------------------------------------------------------------------------- DeepSeek-V4
def _pool_row(pool, tables, b: int, j: int):
    """Row j of request b in a paged pool, or None when its block id is no block of the pool (values
    only the unchecked device paths take)."""
    block_size = pool.shape[1]
    column = j // block_size
    if column >= tables.shape[1]:
        return None
    block = int(tables[b, column])
    if not 0 <= block < pool.shape[0]:
        return None
    return _f64(pool[block, j % block_size, 0])


def shared_kv_attention_oracle(q, kv_cache, block_tables, seq_lens, query_start_loc, sinks, softmax_scale,
                               sliding_window, compressed_cache=None, compressed_block_tables=None, compress_ratio=1,
                               topk_indices=None):
    """-> (out [T, H, D],): per query token at position p and head h, DeepSeek-V4's attention with a
    sink, one head at a time: the rows k_j are the window rows of positions max(0, p - W + 1) .. p,
    then the compressed entries w < (p + 1) // m (all of them, or those listed on the token's row,
    -1 skipped, a repeat counted again);
        l_j = scale * q[t, h] . k_j,  M = max(max_j l_j, sink_h),
        out[t, h] = sum_j exp(l_j - M) k_j / (sum_j exp(l_j - M) + exp(sink_h - M))
    (no sink term without sinks), zeros when there is no row. A row whose block id is not in its pool,
    or a listed entry the token may not see (values only the unchecked device paths take), is skipped."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t, (b, p, _) in enumerate(_request_tokens(seq_lens, query_start_loc)):
        rows = [_pool_row(kv_cache, block_tables, b, j) for j in range(max(0, p - sliding_window + 1), p + 1)]
        if compressed_cache is not None:
            visible = (p + 1) // compress_ratio
            listed = range(visible) if topk_indices is None else [int(w) for w in topk_indices[t]]
            rows += [_pool_row(compressed_cache, compressed_block_tables, b, w) for w in listed if 0 <= w < visible]
        rows = [r for r in rows if r is not None]
        if not rows:
            continue
        keys = torch.stack(rows)  # [rows, D]: keys and values
        for h in range(q.shape[1]):
            logits = softmax_scale * (keys @ _f64(q[t, h]))  # [rows]
            top = float(logits.max())
            sink = None if sinks is None else float(sinks[h])
            if sink is not None:
                top = max(top, sink)
            weights = torch.exp(logits - top)
            denominator = float(weights.sum()) + (0.0 if sink is None else math.exp(sink - top))
            out[t, h] = (weights @ keys) / denominator
    return (out,)


def _rotate_trailing(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [..., D] with its trailing R = 2 * cos.shape[-1] channels rotated pairwise, (x0, x1) at channels
    (D - R + 2i, D - R + 2i + 1) -> (x0 c_i - x1 s_i, x1 c_i + x0 s_i); cos / sin broadcast against x[..., :R/2]."""
    x = x.clone()
    half = cos.shape[-1]
    x0, x1 = x[..., -2 * half::2].clone(), x[..., -2 * half + 1::2].clone()
    x[..., -2 * half::2] = x0 * cos - x1 * sin
    x[..., -2 * half + 1::2] = x1 * cos + x0 * sin
    return x


def _v4_tables(table: Tensor, heads: bool) -> Tensor:
    """cos / sin [B, S, R/2] or [S, R/2] lined up with [B, S, (N,) R/2] (one value per token)."""
    table = _f64(table)
    return table[..., None, :] if heads else table


def shared_kv_q_prolog_oracle(hidden_states, q_a_weight, q_norm_weight, q_b_weight, cos, sin, *, num_heads, eps=1e-6):
    """-> (q [B, S, N, D], q_residual [B, S, Q]): DeepSeek-V4's query path, one token and head at a time:
    q_residual = w * c / sqrt(mean(c^2) + eps) with c = hidden @ q_a_weight^T; each head's row of
    q_residual @ q_b_weight^T divided by its own sqrt(mean(row^2) + eps) (no weight); its trailing R
    channels rotated in interleaved pairs by the token's angle."""
    hidden, q_a, q_b, weight = _f64(hidden_states), _f64(q_a_weight), _f64(q_b_weight), _f64(q_norm_weight)
    batch, seq, _ = hidden.shape
    head_dim = q_b.shape[0] // num_heads
    cos, sin = _f64(cos), _f64(sin)
    q = torch.zeros(batch, seq, num_heads, head_dim, dtype=torch.float64)
    q_residual = torch.zeros(batch, seq, q_a.shape[0], dtype=torch.float64)
    for b in range(batch):
        for s in range(seq):
            c = q_a @ hidden[b, s]
            q_residual[b, s] = weight * c / math.sqrt(float((c * c).mean()) + eps)
            c_s, s_s = (cos[s], sin[s]) if cos.dim() == 2 else (cos[min(b, cos.shape[0] - 1), s],
                                                                 sin[min(b, sin.shape[0] - 1), s])
            for h in range(num_heads):
                row = q_b[h * head_dim:(h + 1) * head_dim] @ q_residual[b, s]
                row = row / math.sqrt(float((row * row).mean()) + eps)
                q[b, s, h] = _rotate_trailing(row, c_s, s_s)
    return q, q_residual


def shared_kv_prolog_oracle(hidden_states, kv_weight, kv_norm_weight, cos, sin, *, eps=1e-6):
    """-> (kv [B, S, D],): per token, w * c / sqrt(mean(c^2) + eps) with c = hidden @ kv_weight^T, its
    trailing R channels rotated in interleaved pairs by the token's angle (DeepSeek-V4's K = V row)."""
    hidden, kv_w, weight = _f64(hidden_states), _f64(kv_weight), _f64(kv_norm_weight)
    batch, seq, _ = hidden.shape
    cos, sin = _f64(cos), _f64(sin)
    out = torch.zeros(batch, seq, kv_w.shape[0], dtype=torch.float64)
    for b in range(batch):
        for s in range(seq):
            c = kv_w @ hidden[b, s]
            c_s, s_s = (cos[s], sin[s]) if cos.dim() == 2 else (cos[min(b, cos.shape[0] - 1), s],
                                                                 sin[min(b, sin.shape[0] - 1), s])
            out[b, s] = _rotate_trailing(weight * c / math.sqrt(float((c * c).mean()) + eps), c_s, s_s)
    return (out,)


def kv_compressor_oracle(kv, gate, position_bias, norm_weight, cos_cache, sin_cache, state, entry_cache, block_tables,
                         seq_lens, query_start_loc, *, compress_ratio, overlap, eps=1e-6):
    """-> (state, entry_cache) after the call. Per request b with q_b new tokens at positions
    n0 .. seq_lens[b] - 1 (n0 = seq_lens[b] - q_b; a token before n0 read from state[b, p % L], L = 2m
    with overlap, m without), every entry w with n0 // m <= w < seq_lens[b] // m, one window at a time:
    its slots are the tokens [wm, (w+1)m) (without overlap, gate + position_bias) or, with overlap, the
    first D channels of tokens [(w-1)m, wm) (none for w = 0; bias[:, :D]) then the last D of tokens
    [wm, (w+1)m) (bias[:, D:]); per channel sum_s softmax_s(g)_s kv_s; times norm_weight / sqrt(mean(.^2)
    + eps); the trailing R channels rotated at position w * m; written at block_tables[b, w // bs],
    offset w % bs. Then state[b, p % L] = (kv, gate) of the request's last min(q_b, L) new tokens. An entry
    whose block id is not in the pool, or whose position is past the tables (values only the unchecked
    device paths take), is not written."""
    m, rows = compress_ratio, (2 * compress_ratio if overlap else compress_ratio)
    kv64, gate64, bias, weight = _f64(kv), _f64(gate), _f64(position_bias), _f64(norm_weight)
    cos_cache, sin_cache = _f64(cos_cache), _f64(sin_cache)
    state_before = _f64(state)
    state_after, entries = state_before.clone(), _f64(entry_cache).clone()
    dim = weight.shape[0]
    block_size = entry_cache.shape[1]
    starts, lens = [int(v) for v in query_start_loc], [int(v) for v in seq_lens]
    for b, n in enumerate(lens):
        start, q_len = starts[b], starts[b + 1] - starts[b]
        first = n - q_len

        def token(p, b=b, start=start, first=first):  # (raw kv, raw gate) of request b's token at position p
            if p >= first:
                return kv64[start + p - first], gate64[start + p - first]
            return state_before[b, p % rows, 0], state_before[b, p % rows, 1]

        for w in range(first // m, n // m):
            block = int(block_tables[b, w // block_size]) if w // block_size < block_tables.shape[1] else -1
            if not 0 <= block < entries.shape[0] or w * m >= cos_cache.shape[0]:
                continue
            slots = []  # (kv [D], gate + bias [D])
            if overlap:
                if w > 0:
                    slots += [(token(p)[0][:dim], token(p)[1][:dim] + bias[p - (w - 1) * m, :dim])
                              for p in range((w - 1) * m, w * m)]
                slots += [(token(p)[0][dim:], token(p)[1][dim:] + bias[p - w * m, dim:])
                          for p in range(w * m, (w + 1) * m)]
            else:
                slots += [(token(p)[0], token(p)[1] + bias[p - w * m]) for p in range(w * m, (w + 1) * m)]
            values = torch.stack([v for v, _ in slots])
            weights = torch.softmax(torch.stack([g for _, g in slots]), dim=0)  # over the slots, per channel
            pooled = (weights * values).sum(0)
            normed = weight * pooled / math.sqrt(float((pooled * pooled).mean()) + eps)
            entry = _rotate_trailing(normed, cos_cache[w * m], sin_cache[w * m])
            entries[block, w % block_size, 0] = entry
        for i in range(max(0, q_len - rows), q_len):
            p = first + i
            state_after[b, p % rows, 0] = kv64[start + i]
            state_after[b, p % rows, 1] = gate64[start + i]
    return state_after, entries
