"""Reference `mla::rms_norm` (ARCHITECTURE §3.1): the CPU kernel and the ground truth.

Bit-identical to transformers' `DeepseekV2RMSNorm.forward`: the same ops in the same order
(upcast, mean of squares, rsqrt, multiply, downcast, multiply by the weight).
"""
import torch
from torch import Tensor

from ...meta_kernels.rms_norm import check_rms_norm_args


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms and rotations run in fp32 (fp64 stays fp64, so gradcheck sees fp64 math)."""
    return torch.promote_types(dtype, torch.float32)


def rms_norm_unchecked(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The formula, without argument checks (callers that already validated use this)."""
    input_dtype = x.dtype
    h = x.to(compute_dtype(input_dtype))
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """x [..., H], weight [H] -> [..., H] in promote_types(weight, x), contiguous."""
    check_rms_norm_args(x, weight, eps)
    return rms_norm_unchecked(x, weight, eps).contiguous()


def rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, eps: float,
                      need_x: bool = True, need_weight: bool = True):
    """Gradients of `rms_norm_unchecked` w.r.t. x and weight (either may be skipped: None).

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


def rms_norm_setup_context(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def rms_norm_autograd_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_x, grad_w = rms_norm_backward(grad, x, weight, ctx.eps, need_x=need_x, need_weight=need_w)
    return grad_x, grad_w, None
