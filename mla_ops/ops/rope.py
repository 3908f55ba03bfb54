"""`mla::rope`: rotary embedding of DeepSeek's interleaved pairs, computed in fp32.

Rotation pairs are (x[2i], x[2i+1]), rotated in fp32:
    o0 = x0*c - x1*s,   o1 = x0*s + x1*c
computed as transformers' native `apply_rotary_emb` does, one complex multiplication per pair
(ATen rounds the products, then subtracts / adds them: exactly the formula above), so
`layout="interleaved"`, which writes (o0, o1) back into the pair positions, is bit-identical to it.
`layout="half"` writes the same values de-interleaved, out[i] = o0, out[i + D/2] = o1: the hub
remote code's `apply_rotary_pos_emb` (de-interleave, then x*cos + rotate_half(x)*sin) and
`torch_npu.npu_interleave_rope`; it is also bit-identical to DeepSeek-V3's
`apply_rotary_pos_emb_interleave` in fp32. `layout="neox"` rotates the pairs (x[i], x[i+D/2]) and writes
them in place: `apply_rotary_pos_emb` with `rotate_half` (MiniCPM3; DeepSeek-V3 with
`rope_interleave=False`). Attention scores are identical for either layout as long as q and k use the
same one.
"""
import torch
from torch import Tensor

from .._checks import check_float, check_layout, check_rope_tables, check_same_device, memo_by_signature
from .._library import define_op
from .rms_norm import compute_dtype

OP = "rope"


# ------------------------------------------------------------------------------------------ check
@memo_by_signature
def check_rope_args(x: Tensor, cos: Tensor, sin: Tensor, *, layout: str = "interleaved") -> None:
    """x [..., S, D] float with D even; cos/sin [B, S, D/2] or [S, D/2]; layout interleaved|half|neox."""
    check_layout(OP, "layout", layout)
    check_float(OP, "x", x)
    torch._check(x.dim() >= 2, lambda: f"mla.{OP}: x must be [..., S, D], got shape {tuple(x.shape)}")
    batch = x.shape[0] if x.dim() >= 3 else None
    check_rope_tables(OP, "x", cos, sin, x.shape[-1], x.shape[-2], batch)
    check_same_device(OP, {"x": x, "cos": cos, "sin": sin})


def _rope_fake(x: Tensor, cos: Tensor, sin: Tensor, *, layout: str = "interleaved") -> Tensor:
    check_rope_args(x, cos, sin, layout=layout)
    return x.new_empty(x.shape)


# -------------------------------------------------------------------------------------- reference
def broadcast_table(table: Tensor, x: Tensor) -> Tensor:
    """cos/sin [B, S, D/2] or [S, D/2] -> broadcastable against x [..., S, D/2], compute dtype.

    A batched table lines up with x's first dim; any dims between batch and sequence (heads) get 1.
    """
    table = table.to(compute_dtype(x.dtype))
    if table.dim() == 3 and x.dim() > 3:
        table = table.view(table.shape[0], *([1] * (x.dim() - 3)), table.shape[1], table.shape[2])
    return table


def rope_math(x: Tensor, cos: Tensor, sin: Tensor, layout: str = "interleaved") -> Tensor:
    """x [..., S, D] -> rotated, same shape and dtype, contiguous; math in fp32 (fp64 for fp64).

    One complex multiplication of the pairs (x[2i] + i x[2i+1]) by (cos + i sin): the op count
    matters at decode sizes (about half the time of the elementwise formulation for k_pe at S=1),
    and it is exactly transformers' apply_rotary_emb arithmetic.
    """
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


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor, *, layout: str = "interleaved") -> Tensor:
    return rope_math(x, cos, sin, layout)


# --------------------------------------------------------------------------------------- backward
def rope_backward_math(grad: Tensor, x: Tensor, cos: Tensor, sin: Tensor, layout: str,
                       need_x: bool = True, need_tables: bool = True):
    """Gradients of `rope_math` w.r.t. x, cos and sin (None where not needed).

    The rotation is orthogonal, so dL/dx is the rotation by -theta of the output gradient, put
    back into the input's pair positions (adjacent for interleaved / half, halves for neox).
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
    ctx.layout = keyword_only_inputs.get("layout", "interleaved")


def _rope_backward(ctx, grad):
    x, cos, sin = ctx.saved_tensors
    need = ctx.needs_input_grad
    return rope_backward_math(grad, x, cos, sin, ctx.layout, need_x=need[0], need_tables=need[1] or need[2])


ROPE = define_op(
    'rope(Tensor x, Tensor cos, Tensor sin, *, str layout="interleaved") -> Tensor',
    check=check_rope_args, fake=_rope_fake, reference=rope_reference,
    autograd=(_rope_backward, _rope_setup_context),
)


# ---------------------------------------------------------------------------------- public wrapper
def rope(x: Tensor, cos: Tensor, sin: Tensor, *, layout: str = "interleaved") -> Tensor:
    """Rotary embedding of DeepSeek's interleaved pairs (x[2i], x[2i+1]), computed in fp32.

    Args:
        x: `[..., S, D]` with D even, fp32 / fp16 / bf16 (e.g. q_pe `[B, N, S, 64]`).
        cos, sin: one value per rotation pair, `[B, S, D/2]` or `[S, D/2]` (broadcast over heads);
            for transformers' native model: `freqs_cis.real`, `freqs_cis.imag`.
        layout: `"interleaved"` writes rotated pairs in place (transformers' `apply_rotary_emb`);
            `"half"` writes them de-interleaved, first halves then second halves (the hub remote
            code's `apply_rotary_pos_emb`, `torch_npu.npu_interleave_rope`).
    Returns:
        Tensor of x's shape and dtype.
    """
    return torch.ops.mla.rope.default(x, cos, sin, layout=layout)
