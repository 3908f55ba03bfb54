"""The KV prolog in two stages, as the original Ascend sample splits it (shared by the NPU and
pypto_sim backends).

Stage 1 (kv_a projection, split, RMSNorm) runs as framework ops; stage 2 (kv_b projection,
reshape/split into k_nope / value, RoPE on k_pe, assemble) is one PyPTO kernel over T = B*S tokens.
This module only moves tensors between the op's [B, S, ...] / [B, N, S, ...] layout and the
kernel's token-major [T, ...] layout — the [T, N, D] -> [B, N, S, D] step is a view + transpose
(the original sample's reshape was wrong for S > 1).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ..kernels.pypto.kv_prolog_stage2 import kv_prolog_stage2_not_supported_reasons


def stage2_inputs(latent: Tensor, k_pe: Tensor, cos: Tensor, sin: Tensor):
    """latent [B, S, L], k_pe [B, S, R] (a view is fine), cos/sin [B or 1, S, R/2] or [S, R/2]
    -> token-major (latent [T, L], k_pe [T, R], cos [T, R/2], sin [T, R/2]) with fp32 tables."""
    batch, seq, _ = latent.shape
    tokens = batch * seq

    def table(t: Tensor) -> Tensor:
        t = t.to(torch.float32)
        if t.dim() == 2:
            t = t.unsqueeze(0)
        return t.expand(batch, seq, t.shape[-1]).reshape(tokens, t.shape[-1])

    # explicit widths: reshape(tokens, -1) is ambiguous when there are no tokens
    return (latent.reshape(tokens, latent.shape[-1]), k_pe.reshape(tokens, k_pe.shape[-1]), table(cos),
            table(sin))


def stage2_outputs(k_nope: Tensor, value: Tensor, k_pe: Tensor, batch: int, seq: int):
    """(k_nope [T, N, P], value [T, N, V], k_pe [T, R]) -> the op's [B, N, S, P], [B, N, S, V], [B, 1, S, R]."""
    def heads_first(t: Tensor) -> Tensor:
        return t.view(batch, seq, t.shape[1], t.shape[2]).transpose(1, 2).contiguous()

    return heads_first(k_nope), heads_first(value), k_pe.view(batch, 1, seq, k_pe.shape[-1])


def staged_kv_prolog(stage1: Callable, stage2: Callable, hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight,
                     kv_b_weight, cos, sin, *, num_heads, qk_nope_head_dim, v_head_dim, eps, rope_layout):
    """stage1(hidden, kv_a_w, kv_a_b, norm_w, eps) -> (latent [B,S,L], k_pe [B,S,R]);
    stage2(latent_t, k_pe_t, kv_b_w, cos_t, sin_t, **dims) -> token-major outputs."""
    batch, seq, _ = hidden_states.shape
    latent, k_pe = stage1(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, eps)
    latent_t, k_pe_t, cos_t, sin_t = stage2_inputs(latent, k_pe, cos, sin)
    k_nope, value, k_pe_rot = stage2(latent_t, k_pe_t, kv_b_weight, cos_t, sin_t, num_heads=num_heads,
                                     qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim,
                                     rope_layout=rope_layout)
    return stage2_outputs(k_nope, value, k_pe_rot, batch, seq)


def stage2_not_supported_reasons(hidden_states, kv_a_weight, kv_norm_weight, kv_b_weight, *, num_heads,
                                 qk_nope_head_dim, v_head_dim, rope_layout, mode,
                                 rope_compute_dtype: str = "float32") -> list[str]:
    """The PyPTO stage-2 kernel's reasons for a kv_prolog call, judged on zero-memory stand-ins
    shaped like the stage-2 inputs (stage 1 has not run yet when the choice is made), plus the
    rounding it cannot reproduce: it rotates k_pe in fp32 from fp32 tables and rounds once, so a call
    asking to round like the stock formula in fp16 / bf16 (rope_compute_dtype="activation") is not its."""
    tokens = hidden_states.shape[0] * hidden_states.shape[1]
    lora = kv_norm_weight.shape[0]
    rope_dim = kv_a_weight.shape[0] - lora

    def stand_in(cols, dtype):  # a broadcast scalar: the right shape, dtype and device, no storage
        return torch.empty((), dtype=dtype, device=hidden_states.device).expand(tokens, cols)

    table = stand_in(rope_dim // 2, torch.float32)
    reasons = kv_prolog_stage2_not_supported_reasons(
        stand_in(lora, hidden_states.dtype), stand_in(rope_dim, hidden_states.dtype), kv_b_weight, table, table,
        num_heads=num_heads, qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim, rope_layout=rope_layout,
        mode=mode)
    if rope_compute_dtype != "float32":
        reasons.append(f"rope_compute_dtype {rope_compute_dtype!r}: the PyPTO stage-2 kernel rotates k_pe in fp32 "
                       f"and rounds once (rope_compute_dtype='float32')")
    return reasons
