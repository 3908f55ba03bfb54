"""`mla::kv_prolog` (the fused MLA KV prolog) and `mla::latent_kv_prolog` (its first stage).

The KV path of transformers' `DeepseekV2Attention.forward` + `expand_kv`, op for op, so the
outputs are bit-identical to the stock module given the same weights:

    compressed = hidden @ kv_a_weight^T (+ bias)          [B, S, L+R]
    ckv | k_pe = split(compressed, [L, R])
    latent     = rms_norm(ckv)                           [B, S, L]     <- latent_kv_prolog stops here
    kv         = latent @ kv_b_weight^T                  [B, S, N*(P+V)]
    k_nope | value = split(kv.view(B, S, N, P+V).transpose(1, 2), [P, V])
    k_pe       = rope(k_pe)                              [B, 1, S, R]  ([B, S, R] for latent_kv_prolog)

`rope_compute_dtype` is `mla::rope`'s compute_dtype: "float32" rotates in fp32 and rounds once
(transformers' DeepSeek-V2), "activation" rounds each product and sum to the activation dtype as
`x*cos + rotate_half(x)*sin` does in a bf16 / fp16 model (DeepSeek-V3's family, the hub remote code).

Shapes: B batch, S tokens, H hidden, N heads, L kv_lora_rank (the size of kv_norm_weight), R rope
dim, P qk_nope_head_dim, V v_head_dim. Weights are in nn.Linear layout ([out, in]), exactly as the
transformers modules hold them. The `[B*S, N, D] -> [B, N, S, D]` step is a view + transpose (heads
after batch, then tokens), not a reshape: a reshape is only right for S == 1.

`latent_kv_prolog` returns what an MLA latent cache stores per token: L + R values (576 in
DeepSeek-V2-Lite, 1152 bytes in bf16) instead of N*(P+R+V) for the expanded K/V.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import (
    check_float,
    check_layout,
    check_rank,
    check_rope_compute_dtype,
    check_rope_tables,
    check_same_device,
    check_same_dtype,
    check_size,
    memo_by_signature,
)
from .._library import define_op
from .rms_norm import rms_norm_backward_math, rms_norm_math
from .rope import rope_backward_math, rope_math


# ----------------------------------------------------------------------------------------- checks
def _check_stage1_args(op: str, hidden_states: Tensor, kv_a_weight: Tensor, kv_a_bias: Optional[Tensor],
                       kv_norm_weight: Tensor, cos: Tensor, sin: Tensor, eps: float, rope_layout: str,
                       rope_compute_dtype: str) -> None:
    """Stage-1 arguments, shared by both prologs.

    hidden_states [B, S, H]; kv_a_weight [L+R, H] (nn.Linear layout of kv_a_proj_with_mqa);
    kv_a_bias [L+R] or None; kv_norm_weight [L]; cos/sin [B, S, R/2] or [S, R/2]. All weights
    in hidden_states' dtype (they feed F.linear with it).
    """
    check_layout(op, "rope_layout", rope_layout)
    check_rope_compute_dtype(op, "rope_compute_dtype", rope_compute_dtype)
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
    # Rotary dims are even (rotation pairs): an odd remainder means kv_norm_weight (which defines
    # kv_lora_rank) has the wrong size, so name it rather than report an odd rotary dim.
    torch._check(
        rope_dim % 2 == 0 or cos.dim() not in (2, 3),
        lambda: f"mla.{op}: kv_norm_weight has {lora_rank} entries, but kv_a_weight's {kv_a_weight.shape[0]} "
        f"output rows minus the rotary dim {2 * cos.shape[-1]} (twice the last dim of cos) leave "
        f"kv_lora_rank = {kv_a_weight.shape[0] - 2 * cos.shape[-1]}; pass kv_a_layernorm.weight of that size",
    )
    if kv_a_bias is not None:
        check_rank(op, "kv_a_bias", kv_a_bias, 1, "[kv_lora_rank + rope_dim]")
        check_size(op, "kv_a_bias", kv_a_bias.shape[0], kv_a_weight.shape[0],
                   "length must equal kv_a_weight's output rows")
        check_same_dtype(op, "kv_a_bias", kv_a_bias, "hidden_states", hidden_states)
    check_rope_tables(op, "k_pe", cos, sin, rope_dim, hidden_states.shape[1], hidden_states.shape[0])
    torch._check(eps >= 0.0, lambda: f"mla.{op}: eps must be >= 0, got {eps}")
    check_same_device(op, {"hidden_states": hidden_states, "kv_a_weight": kv_a_weight,
                           "kv_a_bias": kv_a_bias, "kv_norm_weight": kv_norm_weight,
                           "cos": cos, "sin": sin})


@memo_by_signature
def check_latent_kv_prolog_args(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin, *,
                                eps: float = 1e-6, rope_layout: str = "interleaved",
                                rope_compute_dtype: str = "float32") -> None:
    _check_stage1_args("latent_kv_prolog", hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin, eps,
                       rope_layout, rope_compute_dtype)


@memo_by_signature
def check_kv_prolog_args(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin, *,
                         num_heads: int, qk_nope_head_dim: int, v_head_dim: int, eps: float = 1e-6,
                         rope_layout: str = "interleaved", rope_compute_dtype: str = "float32") -> None:
    """The stage-1 arguments plus kv_b_weight [N*(P+V), L] (nn.Linear layout) and the head dims."""
    op = "kv_prolog"
    _check_stage1_args(op, hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin, eps, rope_layout,
                       rope_compute_dtype)
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


# ------------------------------------------------------------------------------------------ fakes
def _kv_prolog_fake(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin, *,
                    num_heads, qk_nope_head_dim, v_head_dim, eps=1e-6, rope_layout="interleaved",
                    rope_compute_dtype="float32"):
    check_kv_prolog_args(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin,
                         num_heads=num_heads, qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim, eps=eps,
                         rope_layout=rope_layout, rope_compute_dtype=rope_compute_dtype)
    batch, seq, _ = hidden_states.shape
    rope_dim = kv_a_weight.shape[0] - kv_norm_weight.shape[0]
    return (
        hidden_states.new_empty((batch, num_heads, seq, qk_nope_head_dim)),
        hidden_states.new_empty((batch, num_heads, seq, v_head_dim)),
        hidden_states.new_empty((batch, 1, seq, rope_dim)),
    )


def _latent_kv_prolog_fake(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin, *,
                           eps=1e-6, rope_layout="interleaved", rope_compute_dtype="float32"):
    check_latent_kv_prolog_args(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin, eps=eps,
                                rope_layout=rope_layout, rope_compute_dtype=rope_compute_dtype)
    batch, seq, _ = hidden_states.shape
    lora_rank = kv_norm_weight.shape[0]
    return (
        hidden_states.new_empty((batch, seq, lora_rank)),
        hidden_states.new_empty((batch, seq, kv_a_weight.shape[0] - lora_rank)),
    )


# ------------------------------------------------------------------------------------- reference
def latent_stage(hidden_states: Tensor, kv_a_weight: Tensor, kv_a_bias: Optional[Tensor],
                 kv_norm_weight: Tensor, eps: float):
    """Stage 1: kv_a projection, split, RMSNorm. Returns (ckv, latent, k_pe) with ckv/k_pe views."""
    lora_rank = kv_norm_weight.shape[0]
    compressed = F.linear(hidden_states, kv_a_weight, kv_a_bias)
    ckv, k_pe = torch.split(compressed, [lora_rank, compressed.shape[-1] - lora_rank], dim=-1)
    return ckv, rms_norm_math(ckv, kv_norm_weight, eps), k_pe


def expand_latent(latent: Tensor, kv_b_weight: Tensor, num_heads: int, qk_nope_head_dim: int,
                  v_head_dim: int):
    """Stage 2 projection: latent [B, S, L] -> (k_nope [B, N, S, P], value [B, N, S, V]) as views."""
    batch, seq, _ = latent.shape
    kv = F.linear(latent, kv_b_weight).view(batch, seq, num_heads, qk_nope_head_dim + v_head_dim)
    k_nope, value = torch.split(kv.transpose(1, 2), [qk_nope_head_dim, v_head_dim], dim=-1)
    return k_nope, value


def kv_prolog_reference(hidden_states: Tensor, kv_a_weight: Tensor, kv_a_bias: Optional[Tensor],
                        kv_norm_weight: Tensor, kv_b_weight: Tensor, cos: Tensor, sin: Tensor, *, num_heads: int,
                        qk_nope_head_dim: int, v_head_dim: int, eps: float = 1e-6,
                        rope_layout: str = "interleaved", rope_compute_dtype: str = "float32"):
    """-> k_nope [B, N, S, P], value [B, N, S, V], k_pe [B, 1, S, R], contiguous, hidden's dtype."""
    batch, seq, _ = hidden_states.shape
    _, latent, k_pe = latent_stage(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, eps)
    k_nope, value = expand_latent(latent, kv_b_weight, num_heads, qk_nope_head_dim, v_head_dim)
    k_pe = rope_math(k_pe.view(batch, 1, seq, k_pe.shape[-1]), cos, sin, rope_layout, rope_compute_dtype)
    # clone, not .contiguous(): an empty view counts as contiguous and would be returned as is,
    # and the two are views of one buffer (custom-op outputs must not alias)
    return k_nope.clone(memory_format=torch.contiguous_format), value.clone(memory_format=torch.contiguous_format), k_pe


def latent_kv_prolog_reference(hidden_states: Tensor, kv_a_weight: Tensor, kv_a_bias: Optional[Tensor],
                               kv_norm_weight: Tensor, cos: Tensor, sin: Tensor, *, eps: float = 1e-6,
                               rope_layout: str = "interleaved", rope_compute_dtype: str = "float32"):
    """-> latent [B, S, L] (normed compressed kv), k_pe [B, S, R] (rotated): one latent cache entry."""
    _, latent, k_pe = latent_stage(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, eps)
    return latent, rope_math(k_pe, cos, sin, rope_layout, rope_compute_dtype)


# ----------------------------------------------------------------------------------------- backward
# torch.library.register_autograd wiring: one gradient per positional input, None where not needed.
# Stage 1 (kv_a projection + RMSNorm) is recomputed once per backward from the saved inputs instead
# of keeping its intermediates alive between forward and backward. rope_compute_dtype needs nothing
# here: both roundings are of one rotation, whose gradient `rope_backward_math` computes.

def output_specs(output):
    """(shape, dtype, device) of each output: what a backward needs to make zeros for unused ones."""
    return [(o.shape, o.dtype, o.device) for o in output]


def grad_or_zeros(grad: Optional[Tensor], spec) -> Tensor:
    shape, dtype, device = spec
    return torch.zeros(shape, dtype=dtype, device=device) if grad is None else grad


def _save_common(ctx, keyword_only_inputs, output) -> None:
    ctx.eps = keyword_only_inputs.get("eps", 1e-6)
    ctx.rope_layout = keyword_only_inputs.get("rope_layout", "interleaved")
    ctx.output_specs = output_specs(output)


def _prolog_tail_backward(ctx, stage, hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin,
                          grad_latent, grad_k_pe_rot, rope_view, need_tables: bool):
    """Shared by both prologs: RoPE and RMSNorm backward, then the kv_a projection backward.

    `stage` is latent_stage's (ckv, latent, k_pe) recomputed by the caller. Returns grads for
    (hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin).
    """
    need = ctx.needs_input_grad
    ckv, _, k_pe = stage
    grad_ckv, grad_norm_w = rms_norm_backward_math(grad_latent, ckv, kv_norm_weight, ctx.eps, need_weight=need[3])
    grad_k_pe_in, grad_cos, grad_sin = rope_backward_math(grad_k_pe_rot, rope_view(k_pe), cos, sin,
                                                          ctx.rope_layout, need_tables=need_tables)
    grad_compressed = torch.cat((grad_ckv, grad_k_pe_in.reshape(k_pe.shape)), dim=-1)  # [B, S, L+R]
    flat = grad_compressed.flatten(0, -2)  # [B*S, L+R] (flatten: no ambiguous -1 when empty)
    grad_hidden = grad_compressed @ kv_a_weight if need[0] else None
    grad_kv_a = flat.t() @ hidden_states.flatten(0, -2) if need[1] else None
    grad_bias = flat.sum(0) if (kv_a_bias is not None and need[2]) else None
    return grad_hidden, grad_kv_a, grad_bias, grad_norm_w, grad_cos, grad_sin


def _kv_prolog_setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(*inputs[:7])  # hidden, kv_a_w, kv_a_b (may be None), norm_w, kv_b_w, cos, sin
    _save_common(ctx, keyword_only_inputs, output)


def _kv_prolog_backward(ctx, grad_k_nope, grad_value, grad_k_pe):
    """Gradients for (hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin)."""
    hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin = ctx.saved_tensors
    grad_k_nope, grad_value, grad_k_pe = (
        grad_or_zeros(g, spec) for g, spec in zip((grad_k_nope, grad_value, grad_k_pe), ctx.output_specs))
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


def _latent_kv_prolog_setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(*inputs[:6])  # hidden, kv_a_w, kv_a_b (may be None), norm_w, cos, sin
    _save_common(ctx, keyword_only_inputs, output)


def _latent_kv_prolog_backward(ctx, grad_latent, grad_k_pe):
    """Gradients for (hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin)."""
    hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin = ctx.saved_tensors
    grad_latent, grad_k_pe = (grad_or_zeros(g, spec) for g, spec in zip((grad_latent, grad_k_pe),
                                                                          ctx.output_specs))
    need_tables = ctx.needs_input_grad[4] or ctx.needs_input_grad[5]
    stage = latent_stage(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, ctx.eps)
    return _prolog_tail_backward(ctx, stage, hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin,
                                 grad_latent, grad_k_pe, lambda k_pe: k_pe, need_tables)


KV_PROLOG = define_op(
    "kv_prolog(Tensor hidden_states, Tensor kv_a_weight, Tensor? kv_a_bias, Tensor kv_norm_weight, "
    "Tensor kv_b_weight, Tensor cos, Tensor sin, *, int num_heads, int qk_nope_head_dim, "
    'int v_head_dim, float eps=1e-06, str rope_layout="interleaved", str rope_compute_dtype="float32") '
    "-> (Tensor k_nope, Tensor value, Tensor k_pe)",
    check=check_kv_prolog_args, fake=_kv_prolog_fake, reference=kv_prolog_reference,
    autograd=(_kv_prolog_backward, _kv_prolog_setup_context),
)

LATENT_KV_PROLOG = define_op(
    "latent_kv_prolog(Tensor hidden_states, Tensor kv_a_weight, Tensor? kv_a_bias, "
    'Tensor kv_norm_weight, Tensor cos, Tensor sin, *, float eps=1e-06, str rope_layout="interleaved", '
    'str rope_compute_dtype="float32") -> (Tensor latent, Tensor k_pe)',
    check=check_latent_kv_prolog_args, fake=_latent_kv_prolog_fake, reference=latent_kv_prolog_reference,
    autograd=(_latent_kv_prolog_backward, _latent_kv_prolog_setup_context),
)


# -------------------------------------------------------------------------------- public wrappers
def kv_prolog(hidden_states: Tensor, kv_a_weight: Tensor, kv_a_bias: Optional[Tensor], kv_norm_weight: Tensor,
              kv_b_weight: Tensor, cos: Tensor, sin: Tensor, *, num_heads: int, qk_nope_head_dim: int,
              v_head_dim: int, eps: float = 1e-6, rope_layout: str = "interleaved",
              rope_compute_dtype: str = "float32"):
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
        rope_compute_dtype: `"float32"` or `"activation"`: `compute_dtype` of :func:`mla_ops.rope`.
    Returns:
        `(k_nope [B, N, S, P], value [B, N, S, V], k_pe [B, 1, S, R])`, contiguous, in
        hidden_states' dtype.
    """
    return torch.ops.mla.kv_prolog.default(
        hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin,
        num_heads=num_heads, qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim, eps=eps,
        rope_layout=rope_layout, rope_compute_dtype=rope_compute_dtype)


def latent_kv_prolog(hidden_states: Tensor, kv_a_weight: Tensor, kv_a_bias: Optional[Tensor],
                     kv_norm_weight: Tensor, cos: Tensor, sin: Tensor, *, eps: float = 1e-6,
                     rope_layout: str = "interleaved", rope_compute_dtype: str = "float32"):
    """Stage 1 of the prolog: what an MLA latent cache stores per token (L + R values).

    Arguments as :func:`kv_prolog` (without kv_b_weight and the head dims).
    Returns:
        `(latent [B, S, L], k_pe [B, S, R])`: the RMS-normed compressed kv and the rotated k_pe.
    """
    return torch.ops.mla.latent_kv_prolog.default(
        hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin, eps=eps, rope_layout=rope_layout,
        rope_compute_dtype=rope_compute_dtype)
