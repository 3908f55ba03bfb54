"""NPU dispatch policy as plain functions (no torch_npu needed to call or test them)."""
from __future__ import annotations


def use_fused_kv_prolog(num_tokens: int, max_fused_tokens: int) -> bool:
    """Short token counts (decode, short prefill) -> the PyPTO stage-2 kernel; long ones -> the
    torch_npu baseline, as the original sample measured ("<= 20 tokens: PyPTO +5.9%, > 20:
    baseline +10.6%"); the default threshold is 16 (MLA_OPS_NPU_FUSED_MAX_TOKENS). No tokens: the
    baseline, which handles empty inputs without launching a kernel."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return 0 < num_tokens <= max_fused_tokens
