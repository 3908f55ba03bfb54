"""Public wrappers for `torch.ops.mla.kv_prolog` and `torch.ops.mla.latent_kv_prolog`
(ARCHITECTURE §3.3, §3.4)."""
from typing import Optional

import torch
from torch import Tensor


def kv_prolog(hidden_states: Tensor, kv_a_weight: Tensor, kv_a_bias: Optional[Tensor], kv_norm_weight: Tensor,
              kv_b_weight: Tensor, cos: Tensor, sin: Tensor, *, num_heads: int, qk_nope_head_dim: int,
              v_head_dim: int, eps: float = 1e-6, rope_layout: str = "interleaved"):
    """The fused MLA KV prolog: kv_a_proj -> split -> RMSNorm -> kv_b_proj -> split -> RoPE.

    Weights are in `nn.Linear` layout, exactly as the transformers modules hold them
    (`attn.kv_a_proj_with_mqa.weight`, `attn.kv_a_layernorm.weight`, `attn.kv_b_proj.weight`).

    Args:
        hidden_states: `[B, S, H]`, fp32 / fp16 / bf16.
        kv_a_weight: `[L + R, H]`; kv_a_bias: `[L + R]` or None.
        kv_norm_weight: `[L]` (its size defines L, kv_lora_rank).
        kv_b_weight: `[N * (P + V), L]`.
        cos, sin: `[B, S, R/2]` or `[S, R/2]`, one value per rotation pair.
        num_heads, qk_nope_head_dim, v_head_dim: N, P, V.
        eps: RMSNorm epsilon. rope_layout: see :func:`mla_ops.rope`.
    Returns:
        `(k_nope [B, N, S, P], value [B, N, S, V], k_pe [B, 1, S, R])`, contiguous, in
        hidden_states' dtype.
    """
    return torch.ops.mla.kv_prolog.default(
        hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin,
        num_heads=num_heads, qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim, eps=eps,
        rope_layout=rope_layout)


def latent_kv_prolog(hidden_states: Tensor, kv_a_weight: Tensor, kv_a_bias: Optional[Tensor],
                     kv_norm_weight: Tensor, cos: Tensor, sin: Tensor, *, eps: float = 1e-6,
                     rope_layout: str = "interleaved"):
    """Stage 1 of the prolog: what an MLA latent cache stores per token (L + R values).

    Returns:
        `(latent [B, S, L], k_pe [B, S, R])`: the RMS-normed compressed kv and the rotated k_pe.
    """
    return torch.ops.mla.latent_kv_prolog.default(
        hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin, eps=eps, rope_layout=rope_layout)
