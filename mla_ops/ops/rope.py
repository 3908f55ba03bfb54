"""`mla::rope`: rotary embedding of DeepSeek's interleaved pairs, in fp32 or rounded like the stock formula.

Rotation pairs are (x[2i], x[2i+1]):
    o0 = x0*c - x1*s,   o1 = x1*c + x0*s
`compute_dtype` says where that is rounded:

* `"float32"` (default): in fp32 (fp64 for fp64 inputs), rounded once to x's dtype at the end,
  as transformers' native DeepSeek-V2 `apply_rotary_emb` does it: one complex multiplication per
  pair (ATen rounds the products, then subtracts / adds them: exactly the formula above), so it is
  bit-identical to it in every dtype. The more accurate rotation in fp16 / bf16.
* `"activation"`: cos / sin cast to x's dtype, each product and the sum rounded to it, op for op as
  `x*cos + rotate_half(x)*sin` (the hub remote code's `apply_rotary_pos_emb`, transformers'
  rotate_half RoPE) and DeepSeek-V3's `apply_rotary_pos_emb_interleave` compute it in the model's
  dtype: bit-identical to those in bf16 / fp16 as well (and in fp32, where it is the float32 formula
  without the fused multiply-adds ATen's complex multiplication uses in rows of fewer than 8 pairs).

`layout="interleaved"` writes (o0, o1) back into the pair positions (`apply_rotary_emb`).
`layout="half"` writes the same values de-interleaved, out[i] = o0, out[i + D/2] = o1: the hub
remote code's `apply_rotary_pos_emb` (de-interleave, then x*cos + rotate_half(x)*sin),
DeepSeek-V3's `apply_rotary_pos_emb_interleave` and `torch_npu.npu_interleave_rope`.
`layout="neox"` rotates the pairs (x[i], x[i+D/2]) and writes them in place: `apply_rotary_pos_emb`
with `rotate_half` (MiniCPM3; DeepSeek-V3 with `rope_interleave=False`). Attention scores are
identical for either layout as long as q and k use the same one.
"""
from typing import Optional

import torch
from torch import Tensor

from .._checks import (
    check_float,
    check_layout,
    check_rope_compute_dtype,
    check_rope_tables,
    check_same_device,
    memo_by_signature,
)
from .._library import define_op
from .rms_norm import compute_dtype

OP = "rope"


# ------------------------------------------------------------------------------------------ check
@memo_by_signature
def check_rope_args(x: Tensor, cos: Tensor, sin: Tensor, *, layout: str = "interleaved",
                    compute_dtype: str = "float32") -> None:
    """x [..., S, D] float with D even; cos/sin [B, S, D/2] or [S, D/2]; layout interleaved|half|neox;
    compute_dtype float32|activation."""
    check_layout(OP, "layout", layout)
    check_rope_compute_dtype(OP, "compute_dtype", compute_dtype)
    check_float(OP, "x", x)
    torch._check(x.dim() >= 2, lambda: f"mla.{OP}: x must be [..., S, D], got shape {tuple(x.shape)}")
    batch = x.shape[0] if x.dim() >= 3 else None
    check_rope_tables(OP, "x", cos, sin, x.shape[-1], x.shape[-2], batch)
    check_same_device(OP, {"x": x, "cos": cos, "sin": sin})


def _rope_fake(x: Tensor, cos: Tensor, sin: Tensor, *, layout: str = "interleaved",
               compute_dtype: str = "float32") -> Tensor:
    check_rope_args(x, cos, sin, layout=layout, compute_dtype=compute_dtype)
    return x.new_empty(x.shape)


# -------------------------------------------------------------------------------------- reference
def broadcast_table(table: Tensor, x: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """cos/sin [B, S, D/2] or [S, D/2] -> broadcastable against x [..., S, D/2], in `dtype` (default:
    the fp32 compute dtype).

    A batched table lines up with x's first dim; any dims between batch and sequence (heads) get 1.
    """
    table = table.to(dtype or compute_dtype(x.dtype))
    if table.dim() == 3 and x.dim() > 3:
        table = table.view(table.shape[0], *([1] * (x.dim() - 3)), table.shape[1], table.shape[2])
    return table


def rope_math(x: Tensor, cos: Tensor, sin: Tensor, layout: str = "interleaved",
              rope_compute_dtype: str = "float32") -> Tensor:
    """x [..., S, D] -> rotated, same shape and dtype, contiguous.

    `rope_compute_dtype` (the op's compute_dtype): "float32" rotates in fp32 (fp64 for fp64) with one
    complex multiplication of the pairs (x[2i] + i x[2i+1]) by (cos + i sin): the op count matters at
    decode sizes (about half the time of the elementwise formulation for k_pe at S=1), and it is
    exactly transformers' apply_rotary_emb arithmetic. "activation" is `_rope_in_activation_dtype`.
    """
    if rope_compute_dtype == "activation":
        return _rope_in_activation_dtype(x, cos, sin, layout)
    cdt = compute_dtype(x.dtype)
    if layout == "neox":  # pairs (x[i], x[i+D/2]): gathered next to each other first
        xf = x.to(cdt).view(*x.shape[:-1], 2, x.shape[-1] // 2).transpose(-1, -2).contiguous()
    else:
        xf = x.to(cdt).contiguous()  # view_as_complex needs even strides and offset
    # explicit sizes: a -1 would be ambiguous for an empty x
    pairs = torch.view_as_complex(xf.view(*x.shape[:-1], x.shape[-1] // 2, 2))
    rotated = torch.view_as_real(pairs * torch.complex(broadcast_table(cos, x), broadcast_table(sin, x)))
    if layout == "interleaved":
        out = rotated.flatten(-2)
    else:  # half / neox: all first elements of the pairs, then all second elements
        out = rotated.transpose(-1, -2).reshape(x.shape)
    return out.to(x.dtype).contiguous()


def _rope_in_activation_dtype(x: Tensor, cos: Tensor, sin: Tensor, layout: str) -> Tensor:
    """The stock formula in x's dtype: cos/sin cast to it, o0 = x0*c - x1*s, o1 = x1*c + x0*s with
    every product and sum an ATen op of its own, so each is rounded to x's dtype exactly where
    `x*cos + rotate_half(x)*sin` (rotate_half's negation is exact) and
    `apply_rotary_pos_emb_interleave` round it. A product of two bf16 / fp16 values is exact in the
    fp32 ATen computes it in, so strided and contiguous operands round alike."""
    c, s = broadcast_table(cos, x, x.dtype), broadcast_table(sin, x, x.dtype)
    half = x.shape[-1] // 2
    x0, x1 = (x[..., :half], x[..., half:]) if layout == "neox" else (x[..., 0::2], x[..., 1::2])
    o0 = x0 * c - x1 * s
    o1 = x1 * c + x0 * s
    if layout == "interleaved":
        return torch.stack((o0, o1), dim=-1).flatten(-2)
    return torch.cat((o0, o1), dim=-1)  # half / neox: all first elements of the pairs, then all second ones


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor, *, layout: str = "interleaved",
                   compute_dtype: str = "float32") -> Tensor:
    return rope_math(x, cos, sin, layout, compute_dtype)


# --------------------------------------------------------------------------------------- backward
def rope_backward_math(grad: Tensor, x: Tensor, cos: Tensor, sin: Tensor, layout: str,
                       need_x: bool = True, need_tables: bool = True):
    """Gradients of `rope_math` w.r.t. x, cos and sin (None where not needed), for either rounding.

    The rotation is orthogonal, so dL/dx is the rotation by -theta of the output gradient, put
    back into the input's pair positions (adjacent for interleaved / half, halves for neox). Both
    compute dtypes round the same exact rotation, whose gradient this is; it is computed in fp32
    (fp64 for fp64, where both forwards are the same formula and gradcheck sees the exact math).
    """
    cdt = compute_dtype(x.dtype)
    g = grad.to(cdt)
    if layout == "interleaved":
        g0, g1 = g[..., 0::2], g[..., 1::2]
    else:
        half = g.shape[-1] // 2
        g0, g1 = g[..., :half], g[..., half:]
    c, s = broadcast_table(cos, x), broadcast_table(sin, x)
    grad_x = grad_cos = grad_sin = None
    if need_x:
        gx0 = g0 * c + g1 * s
        gx1 = g1 * c - g0 * s
        pairs_in_halves = layout == "neox"
        grad_x = (torch.cat((gx0, gx1), dim=-1) if pairs_in_halves
                  else torch.stack((gx0, gx1), dim=-1).flatten(-2)).to(x.dtype)
    if need_tables:
        xf = x.to(cdt)
        if layout == "neox":
            x0, x1 = xf[..., : xf.shape[-1] // 2], xf[..., xf.shape[-1] // 2:]
        else:
            x0, x1 = xf[..., 0::2], xf[..., 1::2]
        grad_cos = (g0 * x0 + g1 * x1).sum_to_size(c.shape).reshape(cos.shape).to(cos.dtype)
        grad_sin = (g1 * x0 - g0 * x1).sum_to_size(s.shape).reshape(sin.shape).to(sin.dtype)
    return grad_x, grad_cos, grad_sin


def _rope_setup_context(ctx, inputs, keyword_only_inputs, output):
    x, cos, sin = inputs
    ctx.save_for_backward(x, cos, sin)
    ctx.layout = keyword_only_inputs.get("layout", "interleaved")  # (compute_dtype: same gradient either way)


def _rope_backward(ctx, grad):
    x, cos, sin = ctx.saved_tensors
    need = ctx.needs_input_grad
    return rope_backward_math(grad, x, cos, sin, ctx.layout, need_x=need[0], need_tables=need[1] or need[2])


ROPE = define_op(
    'rope(Tensor x, Tensor cos, Tensor sin, *, str layout="interleaved", str compute_dtype="float32") -> Tensor',
    check=check_rope_args, fake=_rope_fake, reference=rope_reference,
    autograd=(_rope_backward, _rope_setup_context),
)


# ---------------------------------------------------------------------------------- public wrapper
def rope(x: Tensor, cos: Tensor, sin: Tensor, *, layout: str = "interleaved",
         compute_dtype: str = "float32") -> Tensor:
    """Rotary embedding of DeepSeek's interleaved pairs (x[2i], x[2i+1]).

    Args:
        x: `[..., S, D]` with D even, fp32 / fp16 / bf16 (e.g. q_pe `[B, N, S, 64]`).
        cos, sin: one value per rotation pair, `[B, S, D/2]` or `[S, D/2]` (broadcast over heads);
            for transformers' native model: `freqs_cis.real`, `freqs_cis.imag`.
        layout: `"interleaved"` writes rotated pairs in place (transformers' `apply_rotary_emb`);
            `"half"` writes them de-interleaved, first halves then second halves (the hub remote
            code's `apply_rotary_pos_emb`, `torch_npu.npu_interleave_rope`); `"neox"` rotates the
            pairs (x[i], x[i + D/2]) in place (rotate_half).
        compute_dtype: `"float32"` rotates in fp32 and rounds once (transformers' DeepSeek-V2);
            `"activation"` casts cos/sin to x's dtype and rounds each product and sum to it, as
            `x*cos + rotate_half(x)*sin` does in a bf16 / fp16 model (DeepSeek-V3 and its family,
            the hub remote code). In fp32 / fp64 both are that dtype's formula.
    Returns:
        Tensor of x's shape and dtype, contiguous.
    """
    return torch.ops.mla.rope.default(x, cos, sin, layout=layout, compute_dtype=compute_dtype)
