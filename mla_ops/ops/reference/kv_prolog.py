"""Reference `mla::kv_prolog` and `mla::latent_kv_prolog` (ARCHITECTURE §3.3, §3.4).

The KV path of transformers' `DeepseekV2Attention.forward` + `expand_kv`, op for op, so the
outputs are bit-identical to the stock module given the same weights:

    compressed = hidden @ kv_a_weight^T (+ bias)          [B, S, L+R]
    ckv | k_pe = split(compressed, [L, R])
    latent     = rms_norm(ckv)                           [B, S, L]     <- latent_kv_prolog stops here
    kv         = latent @ kv_b_weight^T                  [B, S, N*(P+V)]
    k_nope | value = split(kv.view(B, S, N, P+V).transpose(1, 2), [P, V])
    k_pe       = rope(k_pe)                              [B, 1, S, R]

The `[B*S, N, D] -> [B, N, S, D]` step is a view + transpose (heads after batch, then tokens), not a
reshape: the original PyPTO sample's reshape was only right for S == 1.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ...meta_kernels.kv_prolog import check_kv_prolog_args, check_latent_prolog_args
from .rms_norm import rms_norm_backward, rms_norm_unchecked
from .rope import rope_backward, rope_unchecked


def latent_stage(hidden_states: Tensor, kv_a_weight: Tensor, kv_a_bias: Optional[Tensor],
                 kv_norm_weight: Tensor, eps: float):
    """Stage 1: kv_a projection, split, RMSNorm. Returns (ckv, latent, k_pe) with ckv/k_pe views."""
    lora_rank = kv_norm_weight.shape[0]
    compressed = F.linear(hidden_states, kv_a_weight, kv_a_bias)
    ckv, k_pe = torch.split(compressed, [lora_rank, compressed.shape[-1] - lora_rank], dim=-1)
    return ckv, rms_norm_unchecked(ckv, kv_norm_weight, eps), k_pe


def expand_latent(latent: Tensor, kv_b_weight: Tensor, num_heads: int, qk_nope_head_dim: int,
                  v_head_dim: int):
    """Stage 2 projection: latent [B, S, L] -> (k_nope [B, N, S, P], value [B, N, S, V]) as views."""
    batch, seq, _ = latent.shape
    kv = F.linear(latent, kv_b_weight).view(batch, seq, num_heads, qk_nope_head_dim + v_head_dim)
    k_nope, value = torch.split(kv.transpose(1, 2), [qk_nope_head_dim, v_head_dim], dim=-1)
    return k_nope, value


def kv_prolog(hidden_states: Tensor, kv_a_weight: Tensor, kv_a_bias: Optional[Tensor], kv_norm_weight: Tensor,
              kv_b_weight: Tensor, cos: Tensor, sin: Tensor, *, num_heads: int, qk_nope_head_dim: int,
              v_head_dim: int, eps: float = 1e-6, rope_layout: str = "interleaved"):
    """-> k_nope [B, N, S, P], value [B, N, S, V], k_pe [B, 1, S, R], contiguous, hidden's dtype."""
    check_kv_prolog_args(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin,
                         num_heads, qk_nope_head_dim, v_head_dim, eps, rope_layout)
    batch, seq, _ = hidden_states.shape
    _, latent, k_pe = latent_stage(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, eps)
    k_nope, value = expand_latent(latent, kv_b_weight, num_heads, qk_nope_head_dim, v_head_dim)
    k_pe = rope_unchecked(k_pe.view(batch, 1, seq, k_pe.shape[-1]), cos, sin, rope_layout)
    # clone, not .contiguous(): an empty view counts as contiguous and would be returned as is,
    # and the two are views of one buffer (custom-op outputs must not alias)
    return k_nope.clone(memory_format=torch.contiguous_format), value.clone(memory_format=torch.contiguous_format), k_pe


def latent_kv_prolog(hidden_states: Tensor, kv_a_weight: Tensor, kv_a_bias: Optional[Tensor],
                     kv_norm_weight: Tensor, cos: Tensor, sin: Tensor, *, eps: float = 1e-6,
                     rope_layout: str = "interleaved"):
    """-> latent [B, S, L] (normed compressed kv), k_pe [B, S, R] (rotated): one latent cache entry."""
    check_latent_prolog_args("latent_kv_prolog", hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight,
                             cos, sin, eps, rope_layout)
    _, latent, k_pe = latent_stage(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, eps)
    return latent, rope_unchecked(k_pe, cos, sin, rope_layout)


# ----------------------------------------------------------------------------------------- backward
# torch.library.register_autograd wiring: one gradient per positional input, None where not needed.
# Stage 1 (kv_a projection + RMSNorm) is recomputed once per backward from the saved inputs instead
# of keeping its intermediates alive between forward and backward.

def _output_specs(output):
    return [(o.shape, o.dtype, o.device) for o in output]


def _grad_or_zeros(grad: Optional[Tensor], spec) -> Tensor:
    shape, dtype, device = spec
    return torch.zeros(shape, dtype=dtype, device=device) if grad is None else grad


def _save_common(ctx, keyword_only_inputs, output) -> None:
    ctx.eps = keyword_only_inputs.get("eps", 1e-6)
    ctx.rope_layout = keyword_only_inputs.get("rope_layout", "interleaved")
    ctx.output_specs = _output_specs(output)


def _prolog_tail_backward(ctx, stage, hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin,
                          grad_latent, grad_k_pe_rot, rope_view, need_tables: bool):
    """Shared by both prologs: RoPE and RMSNorm backward, then the kv_a projection backward.

    `stage` is latent_stage's (ckv, latent, k_pe) recomputed by the caller. Returns grads for
    (hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin).
    """
    need = ctx.needs_input_grad
    ckv, _, k_pe = stage
    grad_ckv, grad_norm_w = rms_norm_backward(grad_latent, ckv, kv_norm_weight, ctx.eps, need_weight=need[3])
    grad_k_pe_in, grad_cos, grad_sin = rope_backward(grad_k_pe_rot, rope_view(k_pe), cos, sin, ctx.rope_layout,
                                                     need_tables=need_tables)
    grad_compressed = torch.cat((grad_ckv, grad_k_pe_in.reshape(k_pe.shape)), dim=-1)  # [B, S, L+R]
    flat = grad_compressed.flatten(0, -2)  # [B*S, L+R] (flatten: no ambiguous -1 when empty)
    grad_hidden = grad_compressed @ kv_a_weight if need[0] else None
    grad_kv_a = flat.t() @ hidden_states.flatten(0, -2) if need[1] else None
    grad_bias = flat.sum(0) if (kv_a_bias is not None and need[2]) else None
    return grad_hidden, grad_kv_a, grad_bias, grad_norm_w, grad_cos, grad_sin


def kv_prolog_setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(*inputs[:7])  # hidden, kv_a_w, kv_a_b (may be None), norm_w, kv_b_w, cos, sin
    _save_common(ctx, keyword_only_inputs, output)


def kv_prolog_backward(ctx, grad_k_nope, grad_value, grad_k_pe):
    """Gradients for (hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin)."""
    hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin = ctx.saved_tensors
    grad_k_nope, grad_value, grad_k_pe = (
        _grad_or_zeros(g, spec) for g, spec in zip((grad_k_nope, grad_value, grad_k_pe), ctx.output_specs))
    batch, _, seq, _ = grad_k_nope.shape
    # [B, N, S, P+V] -> [B, S, N*(P+V)]: the inverse of the forward's view + transpose.
    grad_kv = torch.cat((grad_k_nope, grad_value), dim=-1).transpose(1, 2).flatten(2)
    grad_latent = grad_kv @ kv_b_weight
    stage = latent_stage(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, ctx.eps)
    grad_kv_b = grad_kv.flatten(0, 1).t() @ stage[1].flatten(0, 1) if ctx.needs_input_grad[4] else None
    need_tables = ctx.needs_input_grad[5] or ctx.needs_input_grad[6]
    grad_hidden, grad_kv_a, grad_bias, grad_norm_w, grad_cos, grad_sin = _prolog_tail_backward(
        ctx, stage, hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin, grad_latent, grad_k_pe,
        lambda k_pe: k_pe.reshape(batch, 1, seq, k_pe.shape[-1]), need_tables)
    return grad_hidden, grad_kv_a, grad_bias, grad_norm_w, grad_kv_b, grad_cos, grad_sin


def latent_kv_prolog_setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(*inputs[:6])  # hidden, kv_a_w, kv_a_b (may be None), norm_w, cos, sin
    _save_common(ctx, keyword_only_inputs, output)


def latent_kv_prolog_backward(ctx, grad_latent, grad_k_pe):
    """Gradients for (hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin)."""
    hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin = ctx.saved_tensors
    grad_latent, grad_k_pe = (_grad_or_zeros(g, spec) for g, spec in zip((grad_latent, grad_k_pe),
                                                                          ctx.output_specs))
    need_tables = ctx.needs_input_grad[4] or ctx.needs_input_grad[5]
    stage = latent_stage(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, ctx.eps)
    return _prolog_tail_backward(ctx, stage, hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin,
                                 grad_latent, grad_k_pe, lambda k_pe: k_pe, need_tables)
