"""`mla::rms_norm`: RMSNorm, bit-identical to transformers' `DeepseekV2RMSNorm`.

    out = weight * (x_fp32 * rsqrt(mean(x_fp32^2, -1) + eps)).to(x.dtype)

The same ops in the same order as `DeepseekV2RMSNorm.forward` (upcast, mean of squares, rsqrt,
multiply, downcast, multiply by the weight); the result dtype follows type promotion of weight and
x, as in transformers.
"""
import torch
from torch import Tensor

from .._checks import check_float, check_rank, check_same_device, check_size, memo_by_signature
from .._library import define_op

OP = "rms_norm"


# ------------------------------------------------------------------------------------------ check
@memo_by_signature
def check_rms_norm_args(x: Tensor, weight: Tensor, eps: float = 1e-6) -> None:
    """x [..., H] float; weight [H] float on x's device; eps >= 0."""
    check_float(OP, "x", x)
    check_float(OP, "weight", weight)
    torch._check(x.dim() >= 1, lambda: f"mla.{OP}: x must have at least one dim [..., H], got a scalar")
    check_rank(OP, "weight", weight, 1, "[H]")
    check_size(OP, "weight", weight.shape[0], x.shape[-1], "length must equal the last dim of x")
    check_same_device(OP, {"x": x, "weight": weight})
    torch._check(eps >= 0.0, lambda: f"mla.{OP}: eps must be >= 0, got {eps}")


def rms_norm_out_dtype(x: Tensor, weight: Tensor) -> torch.dtype:
    # transformers' DeepseekV2RMSNorm returns `weight * normed.to(x.dtype)`: type promotion decides.
    return torch.promote_types(weight.dtype, x.dtype)


def _rms_norm_fake(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    check_rms_norm_args(x, weight, eps)
    return x.new_empty(x.shape, dtype=rms_norm_out_dtype(x, weight))


# -------------------------------------------------------------------------------------- reference
def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms and rotations run in fp32 (fp64 stays fp64, so gradcheck sees fp64 math)."""
    return torch.promote_types(dtype, torch.float32)


def rms_norm_math(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The formula on validated inputs (the prologs call it between their other steps)."""
    input_dtype = x.dtype
    h = x.to(compute_dtype(input_dtype))
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """x [..., H], weight [H] -> [..., H] in promote_types(weight, x), contiguous."""
    return rms_norm_math(x, weight, eps).contiguous()


# --------------------------------------------------------------------------------------- backward
def rms_norm_backward_math(grad: Tensor, x: Tensor, weight: Tensor, eps: float,
                           need_x: bool = True, need_weight: bool = True):
    """Gradients of `rms_norm_math` w.r.t. x and weight (either may be skipped: None).

    With n = x * r (compute dtype), r = rsqrt(mean(x^2) + eps), y = w * n.to(x.dtype):
    dL/dw = sum(g * n.to(x.dtype)), dL/dn = g * w, dL/dx = r * (dn - n * mean(dn * n)).
    """
    cdt = compute_dtype(x.dtype)
    h = x.to(cdt)
    r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    n = h * r
    grad_x = grad_w = None
    if need_weight:
        grad_w = (grad * n.to(x.dtype)).sum_to_size(weight.shape).to(weight.dtype)
    if need_x:
        gn = (grad * weight).to(cdt)
        grad_x = (r * (gn - n * (gn * n).mean(-1, keepdim=True))).to(x.dtype)
    return grad_x, grad_w


def _rms_norm_setup_context(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_norm_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_x, grad_w = rms_norm_backward_math(grad, x, weight, ctx.eps, need_x=need_x, need_weight=need_w)
    return grad_x, grad_w, None


RMS_NORM = define_op(
    "rms_norm(Tensor x, Tensor weight, float eps=1e-06) -> Tensor",
    check=check_rms_norm_args, fake=_rms_norm_fake, reference=rms_norm_reference,
    autograd=(_rms_norm_backward, _rms_norm_setup_context),
)


# ---------------------------------------------------------------------------------- public wrapper
def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """RMSNorm, bit-identical to transformers' `DeepseekV2RMSNorm`.

    Args:
        x: `[..., H]`, fp32 / fp16 / bf16. Normalised in fp32.
        weight: `[H]`.
        eps: added to the mean square before the rsqrt.
    Returns:
        `weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`, `[..., H]`, dtype
        `promote_types(weight.dtype, x.dtype)`.
    """
    return torch.ops.mla.rms_norm.default(x, weight, eps)
