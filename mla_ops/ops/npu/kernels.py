"""PrivateUse1 (Ascend NPU) kernels. Imported only through the backend registry, on an NPU machine."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ...config import settings
from ...meta_kernels._checks import HALF_DTYPES
from ...meta_kernels.kv_prolog import check_kv_prolog_args
from ...meta_kernels.paged_kv_cache import check_gather_args
from .. import hybrid
from ..reference.kv_prolog import expand_latent
from ..reference.paged_kv_cache import functional_gather
from ..reference.rope import rope_unchecked
from .policy import use_fused_kv_prolog



def _npu_stage1(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, eps):
    """kv_a matmul, split and RMSNorm with torch_npu's native ops: (latent [B,S,L], k_pe view [B,S,R])."""
    import torch_npu

    lora = kv_norm_weight.shape[0]
    compressed = F.linear(hidden_states, kv_a_weight, kv_a_bias)
    ckv, k_pe = torch.split(compressed, [lora, compressed.shape[-1] - lora], dim=-1)
    latent = torch_npu.npu_rms_norm(ckv.contiguous(), kv_norm_weight, epsilon=eps)[0]
    return latent, k_pe


def _baseline_stage2(latent, k_pe, kv_b_weight, cos, sin, *, num_heads, qk_nope_head_dim, v_head_dim, rope_layout):
    """Stage 2 as framework ops on token-major inputs (the torch_npu baseline composite)."""
    tokens = latent.shape[0]
    k_nope, value = expand_latent(latent.view(1, tokens, -1), kv_b_weight, num_heads, qk_nope_head_dim, v_head_dim)
    k_pe_rot = rope_unchecked(k_pe, cos, sin, rope_layout)
    return k_nope[0].transpose(0, 1).contiguous(), value[0].transpose(0, 1).contiguous(), k_pe_rot


def kv_prolog(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin, *, num_heads,
              qk_nope_head_dim, v_head_dim, eps=1e-6, rope_layout="interleaved"):
    check_kv_prolog_args(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin, num_heads,
                         qk_nope_head_dim, v_head_dim, eps, rope_layout)
    tokens = hidden_states.shape[0] * hidden_states.shape[1]
    fused = hidden_states.dtype in HALF_DTYPES and use_fused_kv_prolog(tokens, settings.npu_fused_max_tokens)
    if fused:
        from ..pypto.kv_prolog_stage2 import kv_prolog_stage2

        stage2 = functools.partial(kv_prolog_stage2, mode="npu")
    else:
        stage2 = _baseline_stage2
    return hybrid.kv_prolog(_npu_stage1, stage2, hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight,
                            cos, sin, num_heads=num_heads, qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim,
                            eps=eps, rope_layout=rope_layout)


def gather_pa_kv_cache(key_cache, value_cache, block_tables, seq_lens, key, value, *, seq_offset=None,
                       is_seq_lens_cumsum=False):
    """The PyPTO gather (no host sync: values are validated only through the Python helpers'
    validate=True; see mla_ops.ops.pypto.gather_pa_kv_cache for out-of-range ids)."""
    from ..pypto.gather_pa_kv_cache import gather_pa_kv_cache as pypto_gather

    check_gather_args("gather_pa_kv_cache", key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset,
                      is_seq_lens_cumsum)
    pypto_gather(key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset=seq_offset,
                 is_seq_lens_cumsum=is_seq_lens_cumsum, mode="npu")


gather_pa_kv_cache_functional = functional_gather(gather_pa_kv_cache)


def _gather_reasons(key_cache, value_cache, block_tables, seq_lens, key, value, *, seq_offset=None,
                    is_seq_lens_cumsum=False):
    from ..pypto.gather_pa_kv_cache import gather_pa_kv_cache_not_supported_reasons

    return gather_pa_kv_cache_not_supported_reasons(key_cache, value_cache, block_tables, seq_lens, key, value,
                                                    seq_offset=seq_offset, is_seq_lens_cumsum=is_seq_lens_cumsum,
                                                    mode="npu")


KERNELS = {
    "kv_prolog": kv_prolog,
    "gather_pa_kv_cache": gather_pa_kv_cache,
    "gather_pa_kv_cache_functional": gather_pa_kv_cache_functional,
}
REASONS = {"gather_pa_kv_cache": _gather_reasons, "gather_pa_kv_cache_functional": _gather_reasons}
