"""Ascend NPU backend (PrivateUse1): torch_npu stage-1 ops + PyPTO kernels (ARCHITECTURE §4).

Nothing here imports torch_npu at module level; `register(lib)` does, and is only called when
torch_npu is already imported (`import mla_ops` after `import torch_npu`) or on request
(`mla_ops.registration.register_npu()`).

Policy (plain functions in `policy`, unit-tested on any machine):
* kv_prolog: B*S tokens <= `MLA_OPS_NPU_FUSED_MAX_TOKENS` (default 16) -> stage 1 with torch_npu
  (matmul, split, npu_rms_norm) + the PyPTO stage-2 kernel; more tokens -> the torch_npu baseline
  composite (the same stage 1, stage 2 as framework ops). Token counts are shapes, so the choice
  needs no host synchronisation and is frozen into a captured aclgraph.
* gather_pa_kv_cache: the PyPTO kernel, with the large-token tile when heads*dim > 4096.
"""
from __future__ import annotations

from ...config import settings
from . import policy

__all__ = ["register", "warmup", "warmup_token_counts", "policy"]


def register(lib) -> bool:
    """Attach the PrivateUse1 kernels to the mla library; False if torch_npu is unusable here."""
    from ..._optional import torch_npu_usable
    from ...backends import NPU, make_dispatcher

    usable, _ = torch_npu_usable()
    if not usable:
        return False
    for op in NPU.ops:
        lib.impl(op, make_dispatcher(op), "PrivateUse1")
    return True


def warmup_token_counts() -> tuple[int, ...]:
    return settings.npu_warmup_tokens


def warmup(model, *, rope_layout: str = "interleaved") -> None:
    """Compile the fused kv_prolog kernels for the token counts decode uses (1 and 2 by default),
    with the first attention layer's weights, before generation starts (as the original script).

    `rope_layout` must be the one the patched attention calls kv_prolog with ("half" for the hub
    remote code): kernels are compiled per layout."""
    import torch

    attn = next(m for m in model.modules() if hasattr(m, "kv_a_proj_with_mqa"))
    kv_a, norm, kv_b = attn.kv_a_proj_with_mqa, attn.kv_a_layernorm, attn.kv_b_proj
    device, dtype = kv_a.weight.device, kv_a.weight.dtype
    rope_half = attn.qk_rope_head_dim // 2
    with torch.no_grad():
        for tokens in warmup_token_counts():
            hidden = torch.randn(1, tokens, kv_a.weight.shape[1], device=device, dtype=dtype)
            cos = torch.ones(1, tokens, rope_half, device=device)
            sin = torch.zeros(1, tokens, rope_half, device=device)
            torch.ops.mla.kv_prolog(hidden, kv_a.weight, kv_a.bias, norm.weight, kv_b.weight, cos, sin,
                                    num_heads=attn.num_heads, qk_nope_head_dim=attn.qk_nope_head_dim,
                                    v_head_dim=attn.v_head_dim, eps=norm.variance_epsilon, rope_layout=rope_layout)
