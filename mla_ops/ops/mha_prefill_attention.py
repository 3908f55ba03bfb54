"""`mla::mha_prefill_attention`: causal prefill attention over per-head keys and values (MLA's expanded form).

For a long prompt, MLA's prefill runs faster expanded: kv_b_proj turns the new tokens' latents into
per-head keys [N, P + R] (k_nope with the shared k_pe appended) and values [N, V], and each (query, key)
pair then costs N·(Dqk + Dv) multiply-adds instead of the absorbed form's N·(2L + R)
(`mla.mla_prefill_attention`); vLLM's MLA backends prefill this way. DeepSeek-V2/V3: Dqk = 192,
Dv = 128 (Dv may differ from Dqk).

Layout: B requests of a mixed batch, packed along the token dim. Request b's queries are rows
`query_start_loc[b]:query_start_loc[b+1]` of q, its keys and values rows
`key_start_loc[b]:key_start_loc[b+1]` of k and v (its cached context first, then its q_b new tokens);
q_b <= k_b. Query token i sees the keys 0 .. k_b - q_b + i of its request (causal, aligned
bottom-right). Per head n:

    o[t, n] = softmax_j(softmax_scale * q[t, n] . k[j, n]) . v[j, n]     over those keys j

Kernels. On CPU the reference is ATen's memory-bounded flash attention,
`aten::_scaled_dot_product_flash_attention_for_cpu`, which returns the output and its log-sum-exp and takes
one head size: per request, the context keys [0, k_b - q_b) run non-causal and the new keys causal (a square,
so top-left and bottom-right alignment agree), and the two outputs are merged by their log-sum-exps in fp32
(fp64 for fp64); the value head is zero-padded to Dqk (or q and k to Dv, the larger; zero dims change no dot
product) and the output sliced back. No [N, q_b, k_b] tensor is made: the flash kernel tiles the keys and
skips the key blocks after a causal query block, where SDPA with an explicit mask materialises every score.
The flash kernel accumulates in fp32 and rounds its output to the activation dtype, so the merged output of a
request with context holds two roundings of the parts' outputs and one of the merge.

The native backend (`cpu_native`, csrc/cpu/kernels/mha_prefill_attention.cpp) runs the same online softmax
in one walk over each request's keys, context and new tokens together, with P . V at Dv: at DeepSeek-V2's
dims (Dqk 192, Dv 128) the reference's padding costs a fifth more multiply-adds. Its GEMMs are fp32
`at::native::cpublas::brgemm` calls (oneDNN's brgemm kernel where oneDNN has one for the CPU, BLAS
otherwise), bf16 and fp16 operands widened as they are packed; where oneDNN runs bf16 / fp16 on AMX tiles,
ATen's flash kernel does too, and the reference serves those dtypes.

A key a token does not see has no effect on its output, whatever its value; a NaN or +inf score makes
the output NaN and a -inf score weighs 0, as the softmax of the formula does. The fused kernels give
neither for non-finite inputs (they multiply the zero weights of a tile's masked keys by their values
too, and 0 x inf is NaN; ATen's CPU flash kernel gives a row whose only score is NaN zeros), so a
request whose queries, keys or values hold a non-finite number (one isfinite pass over them) takes the
masked softmax in fp32 instead, in chunks of query tokens, each non-finite value row added only to the
tokens that see it.

On other devices the reference reads the two cumulative counts on the host (one sync: the per-request
loop needs them, and the value checks run on them too) and calls torch's
`scaled_dot_product_attention` per request with a boolean bottom-right causal mask `[q_b, k_b]` built on
the device (a tensor subclass such as `causal_lower_right` does not pass every device's dispatch), which
SDPA serves with its fused kernels where the device has them.

Value checks (every call, ValueError before anything is computed): query_start_loc runs from 0 to T
and key_start_loc from 0 to S without decreasing, and q_b <= k_b. A request with no query token
(q_b = 0) produces nothing; its keys are not read.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
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
from .sparse_attention import _CHUNK_ELEMENTS, check_starts

OP = "mha_prefill_attention"


# ----------------------------------------------------------------------------------------- checks
@memo_by_signature
def check_mha_prefill_attention_args(q, k, v, query_start_loc, key_start_loc, softmax_scale: float) -> None:
    """q [T, N, Dqk] (floating), k [S, N, Dqk] and v [S, N, Dv] in q's dtype (Dqk, Dv >= 1);
    query_start_loc [B+1] and key_start_loc [B+1] int32/int64; softmax_scale a positive normal float32
    number (`check_softmax_scale`)."""
    op = OP
    check_softmax_scale(op, softmax_scale, " (e.g. qk_head_dim ** -0.5)")
    check_float(op, "q", q)
    check_rank(op, "q", q, 3, "[tokens, heads, qk_head_dim]")
    torch._check(q.shape[2] >= 1, lambda: f"mla.{op}: q head dim (dim 2) must be >= 1, got 0")
    check_rank(op, "k", k, 3, "[keys, heads, qk_head_dim]")
    check_same_dtype(op, "k", k, "q", q)
    check_size(op, "k", k.shape[1], q.shape[1], "heads (dim 1) must equal q's")
    check_size(op, "k", k.shape[2], q.shape[2], "head dim (dim 2) must equal q's qk_head_dim")
    check_rank(op, "v", v, 3, "[keys, heads, v_head_dim]")
    check_same_dtype(op, "v", v, "q", q)
    check_size(op, "v", v.shape[0], k.shape[0], "keys (dim 0) must equal k's")
    check_size(op, "v", v.shape[1], q.shape[1], "heads (dim 1) must equal q's")
    torch._check(v.shape[2] >= 1, lambda: f"mla.{op}: v head dim (dim 2) must be >= 1, got 0")
    check_index(op, "query_start_loc", query_start_loc)
    check_rank(op, "query_start_loc", query_start_loc, 1, "[batch + 1] (cumulative query tokens per request)")
    check_index(op, "key_start_loc", key_start_loc)
    check_rank(op, "key_start_loc", key_start_loc, 1, "[batch + 1] (cumulative keys per request)")
    check_size(op, "key_start_loc", key_start_loc.shape[0], query_start_loc.shape[0],
               "length must equal query_start_loc's (one entry per request plus one)")
    torch._check(query_start_loc.shape[0] >= 1,
                 lambda: f"mla.{op}: query_start_loc must have one entry per request plus one (cumulative counts "
                 f"starting at 0), got an empty tensor")
    check_same_device(op, {"q": q, "k": k, "v": v, "query_start_loc": query_start_loc,
                           "key_start_loc": key_start_loc})


def check_mha_prefill_values(num_tokens: int, num_keys: int, query_start_loc: Tensor,
                             key_start_loc: Tensor) -> list[tuple[int, int, int, int]]:
    """query_start_loc runs from 0 to T and key_start_loc from 0 to S without decreasing; q_b <= k_b.
    Returns (first query row, q_b, first key row, k_b) per request. Python integers: nothing wraps."""
    # read on the host (a device tensor is copied first: the one host synchronisation of the device path)
    query_starts, key_starts = query_start_loc.cpu().tolist(), key_start_loc.cpu().tolist()
    check_starts(OP, "query_start_loc", query_starts, num_tokens, "query tokens")
    check_starts(OP, "key_start_loc", key_starts, num_keys, "keys")
    requests = []
    for b in range(len(query_starts) - 1):
        q_len, k_len = query_starts[b + 1] - query_starts[b], key_starts[b + 1] - key_starts[b]
        if q_len > k_len:
            raise ValueError(f"mla.{OP}: request {b} has {q_len} query tokens (query_start_loc) but {k_len} keys "
                             f"(key_start_loc); its keys must include its query tokens (q_len <= k_len)")
        requests.append((query_starts[b], q_len, key_starts[b], k_len))
    return requests


def _mha_prefill_attention_fake(q, k, v, query_start_loc, key_start_loc, softmax_scale):
    check_mha_prefill_attention_args(q, k, v, query_start_loc, key_start_loc, softmax_scale)
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))


# -------------------------------------------------------------------------------------- reference
def _heads_first(t: Tensor, width: int) -> Tensor:
    """[tokens, N, D] -> [1, N, tokens, width], zero-padded on the last dim to `width`."""
    if t.shape[2] < width:
        t = F.pad(t, (0, width - t.shape[2]))
    return t.transpose(0, 1)[None]


def _flash(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float) -> tuple[Tensor, Tensor]:
    """ATen's CPU flash attention of [1, N, q, D] over [1, N, k, D] -> (out [1, N, q, D], lse [1, N, q])."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=softmax_scale)


def _finite(q: Tensor, k: Tensor, v: Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in (q, k, v))


def _request_exact(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float) -> Tensor:
    """One request whose keys or values hold a non-finite number: the masked softmax in fp32 (fp64 for fp64),
    for chunks of query tokens (scores [N, chunk, k_b] of at most `_CHUNK_ELEMENTS` values), with every
    non-finite value row added only to the tokens that see it -> [q_b, N, Dv]."""
    q_len, heads, k_len = q.shape[0], q.shape[1], k.shape[0]
    compute = torch.promote_types(q.dtype, torch.float32)
    keys = k.to(compute).transpose(0, 1)  # [N, k, Dqk]
    values = v.to(compute).transpose(0, 1)  # [N, k, Dv]
    finite = torch.isfinite(values).all(dim=2).all(dim=0)  # [k]: the key rows whose values are all finite
    clean = values.masked_fill(~finite[None, :, None], 0)
    bad = torch.nonzero(~finite)[:, 0].tolist()
    out = q.new_empty((q_len, heads, v.shape[2]), dtype=compute)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, heads * k_len))
    for i0 in range(0, q_len, chunk):
        i1 = min(q_len, i0 + chunk)
        scores = q[i0:i1].to(compute).transpose(0, 1) @ keys.transpose(1, 2) * softmax_scale  # [N, c, k]
        sees = torch.arange(k_len)[None, :] <= (k_len - q_len + torch.arange(i0, i1))[:, None]  # [c, k]
        probs = torch.softmax(scores.masked_fill(~sees[None], float("-inf")), dim=-1)
        o = probs @ clean  # [N, c, Dv]
        for j in bad:  # 0 x inf = NaN: a non-finite value row reaches only the tokens that see it
            takes = sees[:, j]
            o[:, takes] += probs[:, takes, j, None] * values[:, j, None, :]
        out[i0:i1] = o.transpose(0, 1)
    return out


def _request_flash(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float) -> Tensor:
    """One request on CPU: q [q_b, N, Dqk], k [k_b, N, Dqk], v [k_b, N, Dv] (q_b >= 1) -> [q_b, N, Dv]: the
    context keys non-causal and the new ones causal, merged by their log-sum-exps in fp32 (fp64 for fp64)."""
    if not _finite(q, k, v):
        return _request_exact(q, k, v, softmax_scale)
    q_len, k_len, dim_v = q.shape[0], k.shape[0], v.shape[2]
    width = max(q.shape[2], dim_v)
    query = _heads_first(q, width)
    context = k_len - q_len
    new_out, new_lse = _flash(query, _heads_first(k[context:], width), _heads_first(v[context:], width), True,
                              softmax_scale)
    if context == 0:
        return new_out[0, :, :, :dim_v].transpose(0, 1)
    old_out, old_lse = _flash(query, _heads_first(k[:context], width), _heads_first(v[:context], width), False,
                              softmax_scale)
    merge = torch.promote_types(q.dtype, torch.float32)
    lse = torch.logaddexp(old_lse, new_lse)
    out = (old_out[..., :dim_v].to(merge) * torch.exp(old_lse - lse)[..., None]
           + new_out[..., :dim_v].to(merge) * torch.exp(new_lse - lse)[..., None])
    return out[0].transpose(0, 1)


def _request_sdpa(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float) -> Tensor:
    """One request through torch SDPA with a bottom-right causal mask [q_b, k_b] (bool, built on the device:
    query i sees keys 0 .. k_b - q_b + i) -> [q_b, N, Dv]."""
    if not _finite(q, k, v):
        return _request_exact(q, k, v, softmax_scale)
    q_len, k_len = q.shape[0], k.shape[0]
    rows = torch.arange(q_len, device=q.device)[:, None] + (k_len - q_len)
    visible = rows >= torch.arange(k_len, device=q.device)[None, :]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=visible, scale=softmax_scale)
    return out[0].transpose(0, 1)


def _per_request(request_kernel, q: Tensor, k: Tensor, v: Tensor, query_start_loc: Tensor, key_start_loc: Tensor,
                 softmax_scale: float) -> Tensor:
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    for q_start, q_len, k_start, k_len in check_mha_prefill_values(q.shape[0], k.shape[0], query_start_loc,
                                                                   key_start_loc):
        if q_len == 0:
            continue
        keys = slice(k_start, k_start + k_len)
        out[q_start:q_start + q_len] = request_kernel(q[q_start:q_start + q_len], k[keys], v[keys], softmax_scale)
    return out


def mha_prefill_attention_sdpa(q: Tensor, k: Tensor, v: Tensor, query_start_loc: Tensor, key_start_loc: Tensor,
                               softmax_scale: float) -> Tensor:
    """The reference's path on non-CPU devices: per request, torch SDPA with `causal_lower_right`."""
    return _per_request(_request_sdpa, q, k, v, query_start_loc, key_start_loc, softmax_scale)


def mha_prefill_attention_reference(q: Tensor, k: Tensor, v: Tensor, query_start_loc: Tensor, key_start_loc: Tensor,
                                    softmax_scale: float) -> Tensor:
    """-> [T, N, Dv] in q's dtype. CPU: ATen's flash attention per request (context and new keys, merged);
    other devices: `mha_prefill_attention_sdpa`."""
    if q.device.type != "cpu":
        return mha_prefill_attention_sdpa(q, k, v, query_start_loc, key_start_loc, softmax_scale)
    return _per_request(_request_flash, q, k, v, query_start_loc, key_start_loc, softmax_scale)


MHA_PREFILL_ATTENTION = define_op(
    "mha_prefill_attention(Tensor q, Tensor k, Tensor v, Tensor query_start_loc, Tensor key_start_loc, "
    "float softmax_scale) -> Tensor",
    check=check_mha_prefill_attention_args, fake=_mha_prefill_attention_fake, reference=mha_prefill_attention_reference,
)


# ---------------------------------------------------------------------------------- public wrapper
def mha_prefill_attention(q: Tensor, k: Tensor, v: Tensor, query_start_loc: Tensor, key_start_loc: Tensor,
                          softmax_scale: float) -> Tensor:
    """Causal prefill attention of packed requests over per-head keys and values.

    Args:
        q: `[T, N, Dqk]` queries of the T query tokens (fp32 / bf16 / fp16; fp64 for checks).
        k: `[S, N, Dqk]` and v: `[S, N, Dv]` in q's dtype: each request's keys and values, its cached
            context first and its query tokens' own last (Dv may differ from Dqk).
        query_start_loc: `[B+1]` int32/int64 cumulative query tokens per request (0 .. T);
        key_start_loc: `[B+1]` cumulative keys per request (0 .. S); each request has at least as many
            keys as query tokens.
        softmax_scale: the attention scale, a positive normal float32 number.
    Returns:
        `[T, N, Dv]` in q's dtype: query token i of request b (q_b tokens, k_b keys) attends its keys
        0 .. k_b - q_b + i.
    """
    return torch.ops.mla.mha_prefill_attention.default(q, k, v, query_start_loc, key_start_loc, softmax_scale)
