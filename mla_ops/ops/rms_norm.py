"""Public wrapper for `torch.ops.mla.rms_norm` (ARCHITECTURE §3.1)."""
import torch
from torch import Tensor


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
