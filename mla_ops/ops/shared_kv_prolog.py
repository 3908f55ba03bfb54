"""`mla::shared_kv_q_prolog` and `mla::shared_kv_prolog`: the query and the shared K=V prologs of
DeepSeek-V4's attention (shared-KV multi-query attention: one K=V row per token, rope inside).

The q and kv paths of `DeepseekV4Attention.forward` in huggingface/transformers
`src/transformers/models/deepseek_v4/modeling_deepseek_v4.py`, op for op (the same torch ops in the
same order, `F.linear` as `nn.Linear` calls it), so both are bit-identical to the stock module given
the same weights and tables, in fp32 and in a bf16 model whose norm weights stay fp32:

    weighted_rms(x) = (w * (x32 * rsqrt(mean(x32^2) + eps))).to(x.dtype)      (DeepseekV4RMSNorm, x32 = x in fp32)
    q_residual = weighted_rms(hidden @ q_a_weight^T)                         [B, S, Q]   (q_a_proj, q_a_norm)
    q          = (q_residual @ q_b_weight^T).view(B, S, N, D)                             (q_b_proj)
    q          = q * rsqrt(mean(q32^2) + eps).to(q.dtype)                    per head    (DeepseekV4UnweightedRMSNorm:
                                                                                          the factor is rounded to q's
                                                                                          dtype, the multiply is in it)
    q[..., -R:] = rope(q[..., -R:])                                          [B, S, N, D]
    kv         = rope_trailing(weighted_rms(hidden @ kv_weight^T))           [B, S, D]    (kv_proj, kv_norm)

    rope(r) = (r32 * cos + rotate_half(r)32 * sin).to(r.dtype), pairs (r[2i], r[2i+1]) of the trailing R
              channels, cos / sin repeated per pair (`apply_rotary_pos_emb`: fp32 math, one rounding)

Shapes: hidden [B, S, Hd]; q_a_weight [Q, Hd]; q_norm_weight [Q]; q_b_weight [N*D, Q]; kv_weight
[D, Hd]; kv_norm_weight [D]; cos / sin [B, S, R/2] or [S, R/2] with R = 2 * cos.shape[-1] <= D (any
float dtype: stock passes them rounded to the model dtype). Weights in hidden's dtype, norm weights fp32
(as `_keep_in_fp32_modules_strict` keeps them) or hidden's dtype. Outputs in hidden's dtype, contiguous.
`q_residual` is also the input of the CSA indexer's query projection.

The attention output's inverse rope (`apply_rotary_pos_emb(out, cos, -sin)`) is `mla.rope` on the
trailing R channels with the negated sine: `compute_dtype="float32"` is bit-identical to it in bf16 /
fp16 (products of 8- or 11-bit mantissas are exact in fp32, so no fused multiply-add can change them),
`compute_dtype="activation"` in fp32 (the same formula in fp32, op for op).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import (
    check_float,
    check_rank,
    check_rope_tables,
    check_same_device,
    check_same_dtype,
    check_size,
    memo_by_signature,
)
from .._library import define_op
from .rms_norm import compute_dtype

Q_OP = "shared_kv_q_prolog"
KV_OP = "shared_kv_prolog"


# ----------------------------------------------------------------------------------------- checks
def check_norm_weight(op: str, name: str, weight: Tensor, size, size_name: str, activation: Tensor,
                      activation_name: str) -> None:
    """A DeepSeek-V4 RMSNorm weight: [size], float32 (as stock keeps it) or the activation's dtype."""
    check_rank(op, name, weight, 1, f"[{size_name}]")
    check_size(op, name, weight.shape[0], size, f"length must equal {size_name}")
    torch._check(
        weight.dtype in (torch.float32, activation.dtype),
        lambda: f"mla.{op}: {name} must be float32 (stock keeps the norm weights in fp32) or {activation_name}'s "
        f"dtype {activation.dtype}, got {weight.dtype}",
    )


def check_rope_width(op: str, name: str, cos: Tensor, head_dim, head_name: str) -> None:
    """The rotary width R = 2 * cos.shape[-1] (`name`: the cos table) is at least one pair and fits in the
    head (rope rotates its trailing R channels)."""
    torch._check(cos.shape[-1] >= 1,
                 lambda: f"mla.{op}: {name} has no rotation pair (last dim 0); pass the rope table, [..., R/2], R >= 2")
    torch._check(
        2 * cos.shape[-1] <= head_dim,
        lambda: f"mla.{op}: the rotary dim R = {2 * cos.shape[-1]} (twice the last dim of {name}) must not exceed "
        f"{head_name} ({head_dim}): rope rotates the trailing R channels of each row",
    )


def _check_hidden_and_projection(op: str, hidden_states: Tensor, name: str, weight: Tensor, layout: str) -> None:
    check_float(op, "hidden_states", hidden_states)
    check_rank(op, "hidden_states", hidden_states, 3, "[batch, seq, hidden]")
    check_rank(op, name, weight, 2, layout)
    check_same_dtype(op, name, weight, "hidden_states", hidden_states)
    check_size(op, name, weight.shape[1], hidden_states.shape[2],
               "in_features (dim 1) must equal the hidden size of hidden_states")


@memo_by_signature
def check_shared_kv_q_prolog_args(hidden_states, q_a_weight, q_norm_weight, q_b_weight, cos, sin, *,
                                  num_heads: int, eps: float = 1e-6) -> None:
    """hidden_states [B, S, Hd]; q_a_weight [Q, Hd]; q_norm_weight [Q]; q_b_weight [N*D, Q]; cos/sin
    [B, S, R/2] or [S, R/2] with 2 <= R <= D; num_heads N >= 1; eps >= 0."""
    op = Q_OP
    torch._check(num_heads > 0, lambda: f"mla.{op}: num_heads must be positive, got {num_heads}")
    torch._check(eps >= 0.0, lambda: f"mla.{op}: eps must be >= 0, got {eps}")
    _check_hidden_and_projection(op, hidden_states, "q_a_weight", q_a_weight, "[q_lora_rank, hidden] (q_a_proj.weight)")
    check_norm_weight(op, "q_norm_weight", q_norm_weight, q_a_weight.shape[0], "q_lora_rank (the rows of q_a_weight)",
                      hidden_states, "hidden_states")
    check_rank(op, "q_b_weight", q_b_weight, 2, "[num_heads * head_dim, q_lora_rank] (q_b_proj.weight)")
    check_same_dtype(op, "q_b_weight", q_b_weight, "hidden_states", hidden_states)
    check_size(op, "q_b_weight", q_b_weight.shape[1], q_a_weight.shape[0],
               "in_features (dim 1) must equal q_lora_rank (the rows of q_a_weight)")
    torch._check(
        q_b_weight.shape[0] % num_heads == 0,
        lambda: f"mla.{op}: q_b_weight has {q_b_weight.shape[0]} rows, which must be num_heads ({num_heads}) * "
        f"head_dim; pass the num_heads of the attention (config.num_attention_heads)",
    )
    torch._check(cos.dim() in (2, 3), lambda: f"mla.{op}: cos must be [B, S, R/2] or [S, R/2], got {tuple(cos.shape)}")
    check_rope_width(op, "cos", cos, q_b_weight.shape[0] // num_heads, "head_dim (q_b_weight rows / num_heads)")
    check_rope_tables(op, "q", cos, sin, 2 * cos.shape[-1], hidden_states.shape[1], hidden_states.shape[0])
    check_same_device(op, {"hidden_states": hidden_states, "q_a_weight": q_a_weight, "q_norm_weight": q_norm_weight,
                           "q_b_weight": q_b_weight, "cos": cos, "sin": sin})


@memo_by_signature
def check_shared_kv_prolog_args(hidden_states, kv_weight, kv_norm_weight, cos, sin, *, eps: float = 1e-6) -> None:
    """hidden_states [B, S, Hd]; kv_weight [D, Hd]; kv_norm_weight [D]; cos/sin [B, S, R/2] or [S, R/2]
    with 2 <= R <= D; eps >= 0."""
    op = KV_OP
    torch._check(eps >= 0.0, lambda: f"mla.{op}: eps must be >= 0, got {eps}")
    _check_hidden_and_projection(op, hidden_states, "kv_weight", kv_weight, "[head_dim, hidden] (kv_proj.weight)")
    check_norm_weight(op, "kv_norm_weight", kv_norm_weight, kv_weight.shape[0], "head_dim (the rows of kv_weight)",
                      hidden_states, "hidden_states")
    torch._check(cos.dim() in (2, 3), lambda: f"mla.{op}: cos must be [B, S, R/2] or [S, R/2], got {tuple(cos.shape)}")
    check_rope_width(op, "cos", cos, kv_weight.shape[0], "head_dim (the rows of kv_weight)")
    check_rope_tables(op, "kv", cos, sin, 2 * cos.shape[-1], hidden_states.shape[1], hidden_states.shape[0])
    check_same_device(op, {"hidden_states": hidden_states, "kv_weight": kv_weight, "kv_norm_weight": kv_norm_weight,
                           "cos": cos, "sin": sin})


# ------------------------------------------------------------------------------------------ fakes
def _shared_kv_q_prolog_fake(hidden_states, q_a_weight, q_norm_weight, q_b_weight, cos, sin, *, num_heads,
                             eps=1e-6):
    check_shared_kv_q_prolog_args(hidden_states, q_a_weight, q_norm_weight, q_b_weight, cos, sin,
                                  num_heads=num_heads, eps=eps)
    batch, seq, _ = hidden_states.shape
    return (hidden_states.new_empty((batch, seq, num_heads, q_b_weight.shape[0] // num_heads)),
            hidden_states.new_empty((batch, seq, q_a_weight.shape[0])))


def _shared_kv_prolog_fake(hidden_states, kv_weight, kv_norm_weight, cos, sin, *, eps=1e-6):
    check_shared_kv_prolog_args(hidden_states, kv_weight, kv_norm_weight, cos, sin, eps=eps)
    batch, seq, _ = hidden_states.shape
    return hidden_states.new_empty((batch, seq, kv_weight.shape[0]))


# -------------------------------------------------------------------------------------- reference
def weighted_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`DeepseekV4RMSNorm`: normalised in fp32 (fp64 for fp64), multiplied by the weight there, cast once."""
    input_dtype = x.dtype
    h = x.to(compute_dtype(input_dtype))
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return (weight * h).to(input_dtype)


def unweighted_rms_norm(x: Tensor, eps: float) -> Tensor:
    """`DeepseekV4UnweightedRMSNorm`: the rsqrt factor in fp32, rounded to x's dtype, the multiply in it."""
    return x * torch.rsqrt(x.to(compute_dtype(x.dtype)).square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rotate_half_pairs(x: Tensor) -> Tensor:
    """(x[2i], x[2i+1]) -> (-x[2i+1], x[2i]): V4's `rotate_half` of interleaved pairs."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rope_trailing(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """V4's `apply_rotary_pos_emb`: rotate the trailing R = 2 * cos.shape[-1] channels of x [..., D] by the
    interleaved pairs, in fp32 (fp64 for fp64) with one rounding; cos / sin [..., R/2] broadcastable
    against x[..., :R/2]. Returns a new contiguous tensor, x's dtype."""
    cdt = compute_dtype(x.dtype)
    cos = cos.repeat_interleave(2, dim=-1).to(cdt)
    sin = sin.repeat_interleave(2, dim=-1).to(cdt)
    rope_dim = cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    rotated = ((rope.to(cdt) * cos) + (rotate_half_pairs(rope).to(cdt) * sin)).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def _per_token_table(table: Tensor) -> Tensor:
    """[B, S, R/2] or [S, R/2] -> broadcastable against [B, S, N, R/2] (one value per token, all heads)."""
    return table.unsqueeze(-2)


def shared_kv_q_prolog_reference(hidden_states: Tensor, q_a_weight: Tensor, q_norm_weight: Tensor,
                                 q_b_weight: Tensor, cos: Tensor, sin: Tensor, *, num_heads: int,
                                 eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """-> (q [B, S, N, D], q_residual [B, S, Q]), contiguous, hidden's dtype."""
    batch, seq, _ = hidden_states.shape
    q_residual = weighted_rms_norm(F.linear(hidden_states, q_a_weight), q_norm_weight, eps)
    q = F.linear(q_residual, q_b_weight).view(batch, seq, num_heads, q_b_weight.shape[0] // num_heads)
    q = unweighted_rms_norm(q, eps)
    return rope_trailing(q, _per_token_table(cos), _per_token_table(sin)), q_residual.contiguous()


def shared_kv_prolog_reference(hidden_states: Tensor, kv_weight: Tensor, kv_norm_weight: Tensor, cos: Tensor,
                               sin: Tensor, *, eps: float = 1e-6) -> Tensor:
    """-> kv [B, S, D], contiguous, hidden's dtype: the K = V row of every token, rope inside."""
    return rope_trailing(weighted_rms_norm(F.linear(hidden_states, kv_weight), kv_norm_weight, eps), cos, sin)


SHARED_KV_Q_PROLOG = define_op(
    "shared_kv_q_prolog(Tensor hidden_states, Tensor q_a_weight, Tensor q_norm_weight, Tensor q_b_weight, "
    "Tensor cos, Tensor sin, *, int num_heads, float eps=1e-06) -> (Tensor q, Tensor q_residual)",
    check=check_shared_kv_q_prolog_args, fake=_shared_kv_q_prolog_fake, reference=shared_kv_q_prolog_reference,
)
SHARED_KV_PROLOG = define_op(
    "shared_kv_prolog(Tensor hidden_states, Tensor kv_weight, Tensor kv_norm_weight, Tensor cos, Tensor sin, *, "
    "float eps=1e-06) -> Tensor",
    check=check_shared_kv_prolog_args, fake=_shared_kv_prolog_fake, reference=shared_kv_prolog_reference,
)


# -------------------------------------------------------------------------------- public wrappers
def shared_kv_q_prolog(hidden_states: Tensor, q_a_weight: Tensor, q_norm_weight: Tensor, q_b_weight: Tensor,
                       cos: Tensor, sin: Tensor, *, num_heads: int, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """DeepSeek-V4's query prolog: q_a_proj -> RMSNorm -> q_b_proj -> per-head unweighted RMSNorm -> rope of
    the trailing R channels.

    Args:
        hidden_states: `[B, S, Hd]` attention input, fp32 / fp16 / bf16.
        q_a_weight: `[Q, Hd]` (`q_a_proj.weight`); q_norm_weight: `[Q]` (`q_a_norm.weight`, fp32 or
            hidden's dtype); q_b_weight: `[N * D, Q]` (`q_b_proj.weight`).
        cos, sin: `[B, S, R/2]` or `[S, R/2]`, one value per rotation pair (the layer's rope table at the
            tokens' positions; R <= D).
        num_heads: N. eps: the epsilon of both norms (`config.rms_norm_eps`).
    Returns:
        `(q [B, S, N, D], q_residual [B, S, Q])`, contiguous, hidden's dtype; q_residual feeds the indexer.
    """
    return torch.ops.mla.shared_kv_q_prolog.default(hidden_states, q_a_weight, q_norm_weight, q_b_weight, cos, sin,
                                                    num_heads=num_heads, eps=eps)


def shared_kv_prolog(hidden_states: Tensor, kv_weight: Tensor, kv_norm_weight: Tensor, cos: Tensor, sin: Tensor,
                     *, eps: float = 1e-6) -> Tensor:
    """DeepSeek-V4's K = V prolog: kv_proj -> RMSNorm -> rope of the trailing R channels.

    Args:
        hidden_states: `[B, S, Hd]` attention input, fp32 / fp16 / bf16.
        kv_weight: `[D, Hd]` (`kv_proj.weight`); kv_norm_weight: `[D]` (`kv_norm.weight`, fp32 or hidden's dtype).
        cos, sin: `[B, S, R/2]` or `[S, R/2]` (R <= D).
        eps: the norm epsilon (`config.rms_norm_eps`).
    Returns:
        `kv [B, S, D]`, contiguous, hidden's dtype: the one row per token that is both key and value.
    """
    return torch.ops.mla.shared_kv_prolog.default(hidden_states, kv_weight, kv_norm_weight, cos, sin, eps=eps)
