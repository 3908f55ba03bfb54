"""Fake kernel and shared argument checks for `mla::rope` (ARCHITECTURE §3.2)."""
import torch

from ._checks import check_float, check_layout, check_rope_tables, check_same_device, eager_memo

OP = "rope"


@eager_memo
def check_rope_args(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> None:
    """x [..., S, D] float with D even; cos/sin [B, S, D/2] or [S, D/2]; layout interleaved|half."""
    check_layout(OP, "layout", layout)
    check_float(OP, "x", x)
    torch._check(x.dim() >= 2, lambda: f"mla.{OP}: x must be [..., S, D], got shape {tuple(x.shape)}")
    batch = x.shape[0] if x.dim() >= 3 else None
    check_rope_tables(OP, "x", cos, sin, x.shape[-1], x.shape[-2], batch)
    check_same_device(OP, {"x": x, "cos": cos, "sin": sin})


def _rope_fake(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, layout: str = "interleaved"):
    check_rope_args(x, cos, sin, layout)
    return x.new_empty(x.shape)
