"""Fake kernel and shared argument checks for `mla::rms_norm` (ARCHITECTURE §3.1)."""
import torch

from ._checks import check_float, check_rank, check_same_device, check_size, eager_memo

OP = "rms_norm"


@eager_memo
def check_rms_norm_args(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """x [..., H] float; weight [H] float on x's device; eps >= 0."""
    check_float(OP, "x", x)
    check_float(OP, "weight", weight)
    torch._check(x.dim() >= 1, lambda: f"mla.{OP}: x must have at least one dim [..., H], got a scalar")
    check_rank(OP, "weight", weight, 1, "[H]")
    check_size(OP, "weight", weight.shape[0], x.shape[-1], "length must equal the last dim of x")
    check_same_device(OP, {"x": x, "weight": weight})
    torch._check(eps >= 0.0, lambda: f"mla.{OP}: eps must be >= 0, got {eps}")


def rms_norm_out_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    # transformers' DeepseekV2RMSNorm returns `weight * normed.to(x.dtype)`: type promotion decides.
    return torch.promote_types(weight.dtype, x.dtype)


def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    check_rms_norm_args(x, weight, eps)
    return x.new_empty(x.shape, dtype=rms_norm_out_dtype(x, weight))
