"""NPU dispatch policy as plain functions (no torch_npu needed to call or test them)."""
from __future__ import annotations


def use_fused_kv_prolog(num_tokens: int, max_fused_tokens: int) -> bool:
    """Short token counts (decode, short prefill) -> the PyPTO stage-2 kernel; long ones -> the
    torch_npu baseline, as the original sample measured ("<= 20 tokens: PyPTO +5.9%, > 20:
    baseline +10.6%"); the default threshold is 16 (MLA_OPS_NPU_FUSED_MAX_TOKENS)."""
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    return num_tokens <= max_fused_tokens


def gather_tile_config(key_heads: int, key_dim: int, value_heads: int, value_dim: int):
    """The PyPTO gather kernel's tile configuration: "large_token" when heads*dim > 4096."""
    from ..pypto.gather_pa_kv_cache import select_gather_tile_config

    return select_gather_tile_config(key_heads, key_dim, value_heads, value_dim)
