"""Public wrapper for `torch.ops.mla.rope` (ARCHITECTURE §3.2)."""
import torch
from torch import Tensor


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
