"""The `pypto_sim` backend: the PyPTO kernels run on CPU by pypto's simulator (ARCHITECTURE §4).

Stage 1 of kv_prolog (kv_a projection, split, RMSNorm) runs with the torch reference ops, as the
NPU path runs it with torch_npu's; stage 2 (kv_b projection, split, RoPE, assemble) and the paged
cache ops run as PyPTO kernels in SIM mode with pass verification, which computes their real
outputs on the CPU and reports the simulated AICore time (`mla_ops.ops.pypto.sim.last_result()`).
Arguments are validated exactly as on the reference path (same messages) before a kernel runs.
"""
from __future__ import annotations

import functools
from typing import Optional
from ..meta_kernels.kv_prolog import check_kv_prolog_args
from ..meta_kernels.paged_kv_cache import check_gather_args, check_scatter_args
from . import hybrid
from .reference.paged_kv_cache import functional_gather
from .value_checks import check_gather_values, check_scatter_values



def unavailable_reason() -> Optional[str]:
    """Why the simulator cannot run here (None when it can); does not import pypto."""
    from . import pypto

    return "; ".join(pypto.unavailable_reasons()) or None


def _kernels():
    """The host functions (imported from their modules: the package attributes of the same names
    become the submodules once those are imported)."""
    from .pypto.gather_pa_kv_cache import gather_pa_kv_cache, gather_pa_kv_cache_not_supported_reasons
    from .pypto.kv_prolog_stage2 import kv_prolog_stage2, kv_prolog_stage2_not_supported_reasons
    from .pypto.scatter_pa_kv_cache import scatter_pa_kv_cache, scatter_pa_kv_cache_not_supported_reasons

    return {f.__name__: f for f in (gather_pa_kv_cache, gather_pa_kv_cache_not_supported_reasons, kv_prolog_stage2,
                                    kv_prolog_stage2_not_supported_reasons, scatter_pa_kv_cache,
                                    scatter_pa_kv_cache_not_supported_reasons)}


def _reference_stage1(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, eps):
    from .reference.kv_prolog import latent_stage

    _, latent, k_pe = latent_stage(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, eps)
    return latent, k_pe


def kv_prolog(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin, *, num_heads,
              qk_nope_head_dim, v_head_dim, eps=1e-6, rope_layout="interleaved"):
    check_kv_prolog_args(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin, num_heads,
                         qk_nope_head_dim, v_head_dim, eps, rope_layout)
    stage2 = functools.partial(_kernels()["kv_prolog_stage2"], mode="sim")
    return hybrid.kv_prolog(_reference_stage1, stage2, hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight,
                            kv_b_weight, cos, sin, num_heads=num_heads, qk_nope_head_dim=qk_nope_head_dim,
                            v_head_dim=v_head_dim, eps=eps, rope_layout=rope_layout)


def gather_pa_kv_cache(key_cache, value_cache, block_tables, seq_lens, key, value, *, seq_offset=None,
                       is_seq_lens_cumsum=False):
    op = "gather_pa_kv_cache"
    check_gather_args(op, key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset,
                      is_seq_lens_cumsum)
    check_gather_values(op, key_cache, block_tables, seq_lens, key.shape[0], seq_offset, is_seq_lens_cumsum)
    _kernels()["gather_pa_kv_cache"](key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset=seq_offset,
                                is_seq_lens_cumsum=is_seq_lens_cumsum, mode="sim")


gather_pa_kv_cache_functional = functional_gather(gather_pa_kv_cache)


def scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping):
    check_scatter_args(key, value, key_cache, value_cache, slot_mapping)
    check_scatter_values("scatter_pa_kv_cache", slot_mapping, key_cache.shape[0] * key_cache.shape[1])
    _kernels()["scatter_pa_kv_cache"](key, value, key_cache, value_cache, slot_mapping, mode="sim")


# ------------------------------------------------------------------------- what the kernels support
def _kv_prolog_reasons(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin, *, num_heads,
                       qk_nope_head_dim, v_head_dim, eps=1e-6, rope_layout="interleaved"):
    """Reasons of the stage-2 kernel, judged on zero-memory stand-ins shaped like its inputs."""
    import torch

    tokens = hidden_states.shape[0] * hidden_states.shape[1]
    lora = kv_norm_weight.shape[0]
    rope_dim = kv_a_weight.shape[0] - lora

    def stand_in(cols, dtype):  # a broadcast scalar: the right shape, dtype and device, no storage
        return torch.empty((), dtype=dtype, device=hidden_states.device).expand(tokens, cols)

    table = stand_in(rope_dim // 2, torch.float32)
    return _kernels()["kv_prolog_stage2_not_supported_reasons"](
        stand_in(lora, hidden_states.dtype), stand_in(rope_dim, hidden_states.dtype), kv_b_weight, table, table,
        num_heads=num_heads, qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim, rope_layout=rope_layout,
        mode="sim")


def _gather_reasons(key_cache, value_cache, block_tables, seq_lens, key, value, *, seq_offset=None,
                    is_seq_lens_cumsum=False):
    return _kernels()["gather_pa_kv_cache_not_supported_reasons"](
        key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset=seq_offset,
        is_seq_lens_cumsum=is_seq_lens_cumsum, mode="sim")


def _scatter_reasons(key, value, key_cache, value_cache, slot_mapping):
    return _kernels()["scatter_pa_kv_cache_not_supported_reasons"](key, value, key_cache, value_cache, slot_mapping,
                                                              mode="sim")


KERNELS = {
    "kv_prolog": kv_prolog,
    "gather_pa_kv_cache": gather_pa_kv_cache,
    "gather_pa_kv_cache_functional": gather_pa_kv_cache_functional,
    "scatter_pa_kv_cache": scatter_pa_kv_cache,
}
REASONS = {
    "kv_prolog": _kv_prolog_reasons,
    "gather_pa_kv_cache": _gather_reasons,
    "gather_pa_kv_cache_functional": _gather_reasons,
    "scatter_pa_kv_cache": _scatter_reasons,
}
