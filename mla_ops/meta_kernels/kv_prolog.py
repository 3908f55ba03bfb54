"""Fake kernels and shared argument checks for `mla::kv_prolog` and `mla::latent_kv_prolog`
(ARCHITECTURE §3.3, §3.4)."""
from typing import Optional

import torch

from ._checks import (
    eager_memo,
    check_float,
    check_layout,
    check_rank,
    check_rope_tables,
    check_same_device,
    check_same_dtype,
    check_size,
)


@eager_memo
def check_latent_prolog_args(op: str, hidden_states: torch.Tensor, kv_a_weight: torch.Tensor,
                             kv_a_bias: Optional[torch.Tensor], kv_norm_weight: torch.Tensor,
                             cos: torch.Tensor, sin: torch.Tensor, eps: float, rope_layout: str) -> None:
    """Stage-1 arguments, shared by both prologs.

    hidden_states [B, S, H]; kv_a_weight [L+R, H] (nn.Linear layout of kv_a_proj_with_mqa);
    kv_a_bias [L+R] or None; kv_norm_weight [L]; cos/sin [B, S, R/2] or [S, R/2]. All weights
    in hidden_states' dtype (they feed F.linear with it).
    """
    check_layout(op, "rope_layout", rope_layout)
    check_float(op, "hidden_states", hidden_states)
    check_rank(op, "hidden_states", hidden_states, 3, "[batch, seq, hidden]")
    check_rank(op, "kv_a_weight", kv_a_weight, 2, "[kv_lora_rank + rope_dim, hidden] (nn.Linear layout)")
    check_rank(op, "kv_norm_weight", kv_norm_weight, 1, "[kv_lora_rank]")
    check_same_dtype(op, "kv_a_weight", kv_a_weight, "hidden_states", hidden_states)
    check_same_dtype(op, "kv_norm_weight", kv_norm_weight, "hidden_states", hidden_states)
    check_size(op, "kv_a_weight", kv_a_weight.shape[1], hidden_states.shape[2],
               "in_features (dim 1) must equal the hidden size of hidden_states")
    lora_rank = kv_norm_weight.shape[0]
    rope_dim = kv_a_weight.shape[0] - lora_rank
    torch._check(
        rope_dim > 0,
        lambda: f"mla.{op}: kv_a_weight has {kv_a_weight.shape[0]} output rows, which must be "
        f"kv_lora_rank ({lora_rank}, the size of kv_norm_weight) + rope_dim (> 0)",
    )
    if kv_a_bias is not None:
        check_rank(op, "kv_a_bias", kv_a_bias, 1, "[kv_lora_rank + rope_dim]")
        check_size(op, "kv_a_bias", kv_a_bias.shape[0], kv_a_weight.shape[0],
                   "length must equal kv_a_weight's output rows")
        check_same_dtype(op, "kv_a_bias", kv_a_bias, "hidden_states", hidden_states)
    check_rope_tables(op, "k_pe", cos, sin, rope_dim, hidden_states.shape[1],
                      hidden_states.shape[0])
    torch._check(eps >= 0.0, lambda: f"mla.{op}: eps must be >= 0, got {eps}")
    check_same_device(op, {"hidden_states": hidden_states, "kv_a_weight": kv_a_weight,
                           "kv_a_bias": kv_a_bias, "kv_norm_weight": kv_norm_weight,
                           "cos": cos, "sin": sin})


@eager_memo
def check_kv_prolog_args(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin,
                         num_heads: int, qk_nope_head_dim: int, v_head_dim: int, eps: float,
                         rope_layout: str) -> None:
    """All of `check_latent_prolog_args` plus kv_b_weight [N*(P+V), L] (nn.Linear layout)."""
    op = "kv_prolog"
    check_latent_prolog_args(op, hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin, eps,
                             rope_layout)
    for name, value in (("num_heads", num_heads), ("qk_nope_head_dim", qk_nope_head_dim),
                        ("v_head_dim", v_head_dim)):
        torch._check(value > 0, lambda: f"mla.{op}: {name} must be positive, got {value}")
    check_rank(op, "kv_b_weight", kv_b_weight, 2, "[num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]")
    check_same_dtype(op, "kv_b_weight", kv_b_weight, "hidden_states", hidden_states)
    check_size(op, "kv_b_weight", kv_b_weight.shape[0], num_heads * (qk_nope_head_dim + v_head_dim),
               f"rows must be num_heads * (qk_nope_head_dim + v_head_dim) = "
               f"{num_heads} * ({qk_nope_head_dim} + {v_head_dim})")
    check_size(op, "kv_b_weight", kv_b_weight.shape[1], kv_norm_weight.shape[0],
               "in_features (dim 1) must equal kv_lora_rank (the size of kv_norm_weight)")
    check_same_device(op, {"hidden_states": hidden_states, "kv_b_weight": kv_b_weight})


def _kv_prolog_fake(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin, *,
                    num_heads, qk_nope_head_dim, v_head_dim, eps=1e-6, rope_layout="interleaved"):
    check_kv_prolog_args(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin,
                         num_heads, qk_nope_head_dim, v_head_dim, eps, rope_layout)
    batch, seq, _ = hidden_states.shape
    rope_dim = kv_a_weight.shape[0] - kv_norm_weight.shape[0]
    return (
        hidden_states.new_empty((batch, num_heads, seq, qk_nope_head_dim)),
        hidden_states.new_empty((batch, num_heads, seq, v_head_dim)),
        hidden_states.new_empty((batch, 1, seq, rope_dim)),
    )


def _latent_kv_prolog_fake(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin, *,
                           eps=1e-6, rope_layout="interleaved"):
    check_latent_prolog_args("latent_kv_prolog", hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight,
                             cos, sin, eps, rope_layout)
    batch, seq, _ = hidden_states.shape
    lora_rank = kv_norm_weight.shape[0]
    return (
        hidden_states.new_empty((batch, seq, lora_rank)),
        hidden_states.new_empty((batch, seq, kv_a_weight.shape[0] - lora_rank)),
    )
