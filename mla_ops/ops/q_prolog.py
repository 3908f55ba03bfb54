"""`mla::q_prolog`: the MLA query prolog (low-rank query, split, RoPE of the rope part).

The query path of transformers' DeepSeek-V2/V3 attention, op for op:

    q_lora_rank set (DeepSeek-V2, V3):  q = rms_norm(hidden @ q_a_weight^T (+ q_a_bias)) @ q_b_weight^T
    no q-LoRA (DeepSeek-V2-Lite):       q = hidden @ q_b_weight^T        (q_b_weight = q_proj.weight)
    q_nope | q_pe = split(q.view(B, S, N, P+R).transpose(1, 2), [P, R])
    q_pe = rope(q_pe)            (rope_compute_dtype: `mla::rope`'s compute_dtype)

Shapes: hidden [B, S, H]; q_a_weight [Q, H] (Q = q_lora_rank), q_norm_weight [Q], q_b_weight
[N*(P+R), Q or H]; cos/sin [B, S, R/2] or [S, R/2]. Returns q_nope [B, N, S, P] and q_pe
[B, N, S, R], contiguous, in hidden's dtype. R is twice the last dim of cos.

Relation to torch_npu's `npu_mla_prolog` (Ascend's fused MLA prolog, op-plugin): that one op
computes this query path *and* the latent KV path, absorbs W_UK into the query
(`q_nope @ W_UK` -> `[T, N, L]`) and writes the latent and rotated k_pe into the paged cache, with
optional quantisation. mla-ops keeps those as separate ops — `q_prolog`, `latent_kv_prolog`,
`scatter_pa_kv_cache`, and the absorption as a batched matmul in the caller — so each is usable on
its own (prefill needs the unabsorbed q_nope) and each has its own reference, fake and backward.
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
from .kv_prolog import grad_or_zeros, output_specs
from .rms_norm import rms_norm_backward_math, rms_norm_math
from .rope import rope_backward_math, rope_math

OP = "q_prolog"


# ------------------------------------------------------------------------------------------ check
@memo_by_signature
def check_q_prolog_args(hidden_states, q_a_weight, q_a_bias, q_norm_weight, q_b_weight, cos, sin, *,
                        num_heads: int, qk_nope_head_dim: int, eps: float = 1e-6,
                        rope_layout: str = "interleaved", rope_compute_dtype: str = "float32") -> None:
    """hidden_states [B, S, H]; q_a_weight [Q, H] + q_norm_weight [Q] (+ q_a_bias [Q]) or all None;
    q_b_weight [N*(P+R), Q or H]; cos/sin [B, S, R/2] or [S, R/2]."""
    check_layout(OP, "rope_layout", rope_layout)
    check_rope_compute_dtype(OP, "rope_compute_dtype", rope_compute_dtype)
    check_float(OP, "hidden_states", hidden_states)
    check_rank(OP, "hidden_states", hidden_states, 3, "[batch, seq, hidden]")
    for name, value in (("num_heads", num_heads), ("qk_nope_head_dim", qk_nope_head_dim)):
        torch._check(value > 0, lambda: f"mla.{OP}: {name} must be positive, got {value}")
    torch._check(eps >= 0.0, lambda: f"mla.{OP}: eps must be >= 0, got {eps}")
    torch._check(
        (q_a_weight is None) == (q_norm_weight is None),
        lambda: f"mla.{OP}: q_a_weight and q_norm_weight come together (the low-rank query: q_a_proj and "
        f"q_a_layernorm); pass both, or neither for a model without q-LoRA (q_b_weight = q_proj.weight)",
    )
    torch._check(q_a_weight is not None or q_a_bias is None,
                 lambda: f"mla.{OP}: q_a_bias was given without q_a_weight")
    in_features = hidden_states.shape[2]
    if q_a_weight is not None:
        check_rank(OP, "q_a_weight", q_a_weight, 2, "[q_lora_rank, hidden] (nn.Linear layout of q_a_proj)")
        check_rank(OP, "q_norm_weight", q_norm_weight, 1, "[q_lora_rank]")
        check_same_dtype(OP, "q_a_weight", q_a_weight, "hidden_states", hidden_states)
        check_same_dtype(OP, "q_norm_weight", q_norm_weight, "hidden_states", hidden_states)
        check_size(OP, "q_a_weight", q_a_weight.shape[1], hidden_states.shape[2],
                   "in_features (dim 1) must equal the hidden size of hidden_states")
        check_size(OP, "q_norm_weight", q_norm_weight.shape[0], q_a_weight.shape[0],
                   "length must equal q_lora_rank (the rows of q_a_weight)")
        if q_a_bias is not None:
            check_rank(OP, "q_a_bias", q_a_bias, 1, "[q_lora_rank]")
            check_size(OP, "q_a_bias", q_a_bias.shape[0], q_a_weight.shape[0], "length must equal q_a_weight's rows")
            check_same_dtype(OP, "q_a_bias", q_a_bias, "hidden_states", hidden_states)
        in_features = q_a_weight.shape[0]
    check_rank(OP, "q_b_weight", q_b_weight, 2, "[num_heads * (qk_nope_head_dim + rope_dim), in_features]")
    check_same_dtype(OP, "q_b_weight", q_b_weight, "hidden_states", hidden_states)
    check_size(OP, "q_b_weight", q_b_weight.shape[1], in_features,
               "in_features (dim 1) must equal q_lora_rank (with q_a_weight) or the hidden size (without)")
    torch._check(cos.dim() in (2, 3), lambda: f"mla.{OP}: cos must be [B, S, R/2] or [S, R/2], got {tuple(cos.shape)}")
    rope_dim = 2 * cos.shape[-1]
    check_size(OP, "q_b_weight", q_b_weight.shape[0], num_heads * (qk_nope_head_dim + rope_dim),
               f"rows must be num_heads * (qk_nope_head_dim + rope_dim) = {num_heads} * ({qk_nope_head_dim} + "
               f"{rope_dim}) (rope_dim is twice the last dim of cos)")
    check_rope_tables(OP, "q_pe", cos, sin, rope_dim, hidden_states.shape[1], hidden_states.shape[0])
    check_same_device(OP, {"hidden_states": hidden_states, "q_a_weight": q_a_weight, "q_a_bias": q_a_bias,
                           "q_norm_weight": q_norm_weight, "q_b_weight": q_b_weight, "cos": cos, "sin": sin})


def _q_prolog_fake(hidden_states, q_a_weight, q_a_bias, q_norm_weight, q_b_weight, cos, sin, *, num_heads,
                   qk_nope_head_dim, eps=1e-6, rope_layout="interleaved", rope_compute_dtype="float32"):
    check_q_prolog_args(hidden_states, q_a_weight, q_a_bias, q_norm_weight, q_b_weight, cos, sin,
                        num_heads=num_heads, qk_nope_head_dim=qk_nope_head_dim, eps=eps, rope_layout=rope_layout,
                        rope_compute_dtype=rope_compute_dtype)
    batch, seq, _ = hidden_states.shape
    rope_dim = 2 * cos.shape[-1]
    return (hidden_states.new_empty((batch, num_heads, seq, qk_nope_head_dim)),
            hidden_states.new_empty((batch, num_heads, seq, rope_dim)))


# -------------------------------------------------------------------------------------- reference
def _low_rank(hidden_states, q_a_weight, q_a_bias, q_norm_weight, eps):
    """The q-LoRA input of q_b: (q_a output before the norm or None, the normed input of q_b)."""
    if q_a_weight is None:
        return None, hidden_states
    q_a = F.linear(hidden_states, q_a_weight, q_a_bias)
    return q_a, rms_norm_math(q_a, q_norm_weight, eps)


def _split_heads(q: Tensor, num_heads: int, qk_nope_head_dim: int):
    batch, seq, _ = q.shape
    q = q.view(batch, seq, num_heads, q.shape[-1] // num_heads).transpose(1, 2)
    return torch.split(q, [qk_nope_head_dim, q.shape[-1] - qk_nope_head_dim], dim=-1)


def q_prolog_reference(hidden_states: Tensor, q_a_weight: Optional[Tensor], q_a_bias: Optional[Tensor],
                       q_norm_weight: Optional[Tensor], q_b_weight: Tensor, cos: Tensor, sin: Tensor, *,
                       num_heads: int, qk_nope_head_dim: int, eps: float = 1e-6, rope_layout: str = "interleaved",
                       rope_compute_dtype: str = "float32"):
    """-> q_nope [B, N, S, P], q_pe [B, N, S, R] (rotated), contiguous, hidden's dtype."""
    _, q_in = _low_rank(hidden_states, q_a_weight, q_a_bias, q_norm_weight, eps)
    q_nope, q_pe = _split_heads(F.linear(q_in, q_b_weight), num_heads, qk_nope_head_dim)
    return (q_nope.clone(memory_format=torch.contiguous_format),
            rope_math(q_pe, cos, sin, rope_layout, rope_compute_dtype))


# --------------------------------------------------------------------------------------- backward
def _q_prolog_setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(*inputs[:7])  # hidden, q_a_w, q_a_b, q_norm_w, q_b_w, cos, sin (None stays None)
    ctx.eps = keyword_only_inputs.get("eps", 1e-6)
    ctx.rope_layout = keyword_only_inputs.get("rope_layout", "interleaved")
    ctx.num_heads = keyword_only_inputs["num_heads"]
    ctx.qk_nope_head_dim = keyword_only_inputs["qk_nope_head_dim"]
    ctx.output_specs = output_specs(output)


def _q_prolog_backward(ctx, grad_q_nope, grad_q_pe):
    """Gradients for (hidden_states, q_a_weight, q_a_bias, q_norm_weight, q_b_weight, cos, sin).

    The q-LoRA stage is recomputed from the saved inputs rather than kept alive between the passes.
    Either rope_compute_dtype has the gradient of the one rotation both round (`rope_backward_math`)."""
    hidden, q_a_weight, q_a_bias, q_norm_weight, q_b_weight, cos, sin = ctx.saved_tensors
    need = ctx.needs_input_grad
    grad_q_nope, grad_q_pe = (grad_or_zeros(g, spec) for g, spec in zip((grad_q_nope, grad_q_pe), ctx.output_specs))
    q_a, q_in = _low_rank(hidden, q_a_weight, q_a_bias, q_norm_weight, ctx.eps)
    _, q_pe = _split_heads(F.linear(q_in, q_b_weight), ctx.num_heads, ctx.qk_nope_head_dim)
    grad_q_pe_in, grad_cos, grad_sin = rope_backward_math(grad_q_pe, q_pe, cos, sin, ctx.rope_layout,
                                                          need_tables=need[5] or need[6])
    grad_q = torch.cat((grad_q_nope, grad_q_pe_in), dim=-1).transpose(1, 2).flatten(2)  # [B, S, N*(P+R)]
    grad_q_b = grad_q.flatten(0, 1).t() @ q_in.flatten(0, 1) if need[4] else None
    grad_q_in = grad_q @ q_b_weight
    grad_q_a_w = grad_q_a_b = grad_norm_w = None
    if q_a_weight is None:
        grad_hidden = grad_q_in
    else:
        grad_q_a, grad_norm_w = rms_norm_backward_math(grad_q_in, q_a, q_norm_weight, ctx.eps, need_weight=need[3])
        grad_hidden = grad_q_a @ q_a_weight
        flat = grad_q_a.flatten(0, 1)
        grad_q_a_w = flat.t() @ hidden.flatten(0, 1) if need[1] else None
        grad_q_a_b = flat.sum(0) if (q_a_bias is not None and need[2]) else None
    return (grad_hidden if need[0] else None), grad_q_a_w, grad_q_a_b, grad_norm_w, grad_q_b, grad_cos, grad_sin


Q_PROLOG = define_op(
    "q_prolog(Tensor hidden_states, Tensor? q_a_weight, Tensor? q_a_bias, Tensor? q_norm_weight, "
    "Tensor q_b_weight, Tensor cos, Tensor sin, *, int num_heads, int qk_nope_head_dim, float eps=1e-06, "
    'str rope_layout="interleaved", str rope_compute_dtype="float32") -> (Tensor q_nope, Tensor q_pe)',
    check=check_q_prolog_args, fake=_q_prolog_fake, reference=q_prolog_reference,
    autograd=(_q_prolog_backward, _q_prolog_setup_context),
)


# ---------------------------------------------------------------------------------- public wrapper
def q_prolog(hidden_states: Tensor, q_a_weight: Optional[Tensor], q_a_bias: Optional[Tensor],
             q_norm_weight: Optional[Tensor], q_b_weight: Tensor, cos: Tensor, sin: Tensor, *, num_heads: int,
             qk_nope_head_dim: int, eps: float = 1e-6, rope_layout: str = "interleaved",
             rope_compute_dtype: str = "float32"):
    """The MLA query prolog: (q_a_proj -> RMSNorm ->) q_b_proj -> split -> RoPE of the rope part.

    Args:
        hidden_states: `[B, S, H]`, fp32 / fp16 / bf16.
        q_a_weight: `[Q, H]` (`q_a_proj.weight`), q_a_bias `[Q]` or None, q_norm_weight `[Q]`
            (`q_a_layernorm.weight`); all three None for a model without q-LoRA.
        q_b_weight: `[N * (P + R), Q]` (`q_b_proj.weight`), or `[N * (P + R), H]` (`q_proj.weight`).
        cos, sin: `[B, S, R/2]` or `[S, R/2]`, one value per rotation pair.
        num_heads, qk_nope_head_dim: N, P. eps: the q_a_layernorm epsilon.
        rope_layout: see :func:`mla_ops.rope`.
        rope_compute_dtype: `"float32"` or `"activation"`: `compute_dtype` of :func:`mla_ops.rope`.
    Returns:
        `(q_nope [B, N, S, P], q_pe [B, N, S, R])`, contiguous, in hidden_states' dtype.
    """
    return torch.ops.mla.q_prolog.default(hidden_states, q_a_weight, q_a_bias, q_norm_weight, q_b_weight, cos, sin,
                                          num_heads=num_heads, qk_nope_head_dim=qk_nope_head_dim, eps=eps,
                                          rope_layout=rope_layout, rope_compute_dtype=rope_compute_dtype)
