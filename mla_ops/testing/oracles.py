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


def mla_decode_attention_oracle(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, softmax_scale):
    """-> (o_latent [B, N, L],): per sequence, softmax(scale * (q_latent latent^T + q_pe k_pe^T)) latent
    over its first seq_lens[b] cached tokens, the latent and k_pe read token by token from the pool."""
    block_size = key_cache.shape[1]
    out = torch.zeros(q_latent.shape, dtype=torch.float64)
    for b in range(q_latent.shape[0]):
        slots = [(int(block_tables[b, t // block_size]), t % block_size) for t in range(int(seq_lens[b]))]
        latent = torch.stack([_f64(key_cache[i, o, 0]) for i, o in slots])
        k_pe = torch.stack([_f64(value_cache[i, o, 0]) for i, o in slots])
        scores = (_f64(q_latent[b]) @ latent.t() + _f64(q_pe[b]) @ k_pe.t()) * softmax_scale
        out[b] = torch.softmax(scores, dim=-1) @ latent
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


def lightning_indexer_oracle(q, weights, k_cache, block_tables, seq_lens, query_start_loc, topk, softmax_scale):
    """-> (int32 [T, topk],): per query token at position p, the positions 0..p sorted by descending
    score_j = sum_h w_h * relu(scale * q_h . k_j) (fp64), equal scores by ascending position; the first
    topk of them, -1 past the p + 1 there are (every entry -1 for p < 0)."""
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32)
    for t, (b, p, _) in enumerate(_request_tokens(seq_lens, query_start_loc)):
        if p < 0:  # values that leave the token no cached position (only the unchecked device paths take them)
            continue
        keys = torch.stack([_cached_row(k_cache, block_tables, b, j) for j in range(p + 1)])
        scores = torch.relu(softmax_scale * (_f64(q[t]) @ keys.t())).t() @ _f64(weights[t])  # [p + 1]
        ranked = sorted(range(p + 1), key=lambda j: (-float(scores[j]), j))[:topk]
        out[t, : len(ranked)] = torch.tensor(ranked, dtype=torch.int32)
    return (out,)


def sparse_mla_attention_oracle(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                topk_indices, softmax_scale):
    """-> (o_latent [T, N, L],): per query token, softmax(scale * (q_latent latent^T + q_pe k_pe^T)) latent
    over the positions it lists (a position listed twice counts twice; -1 skipped), zeros when it lists none.
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
        out[t] = torch.softmax(scores, dim=-1) @ latent
    return (out,)
