"""The ``pypto_sim`` backend: the PyPTO kernels run on CPU through pypto's simulator (opt-in).

kv_prolog: stage 1 (kv_a projection, split, RMSNorm) with the reference ops, as the NPU path runs it
with torch_npu's; stage 2 (kv_b projection, split, RoPE, assemble) and the paged-cache ops run as
PyPTO kernels in SIM mode with pass verification, which computes their real outputs on the CPU and
reports the simulated AICore time (`mla_ops.pypto_runtime.last_result()`). About a second per call:
for tests, kernel development and `mla-ops bench npu-sim`, never chosen automatically.

The op's own argument check runs before any of these kernels (see `mla_ops.backends`); the reasons
below are only what the PyPTO kernels add: pypto 0.2.0 installed, fp16/bf16 for stage 2, contiguous
caches, tile limits, fp32 RoPE (rope_compute_dtype="float32": stage 2 rotates in fp32).
"""
from __future__ import annotations

import functools
from typing import Optional

from .. import pypto_runtime
from ..kernels.pypto.gather_pa_kv_cache import gather_pa_kv_cache as pypto_gather
from ..kernels.pypto.gather_pa_kv_cache import gather_pa_kv_cache_not_supported_reasons
from ..kernels.pypto.kv_prolog_stage2 import kv_prolog_stage2
from ..kernels.pypto.scatter_pa_kv_cache import scatter_pa_kv_cache as pypto_scatter
from ..kernels.pypto.scatter_pa_kv_cache import scatter_pa_kv_cache_not_supported_reasons
from ..ops.gather_pa_kv_cache import check_gather_values, functional_gather
from ..ops.kv_prolog import latent_stage
from ..ops.scatter_pa_kv_cache import check_scatter_values
from . import Backend
from .staged_kv_prolog import stage2_not_supported_reasons, staged_kv_prolog


def _unavailable() -> Optional[str]:
    return "; ".join(pypto_runtime.unavailable_reasons()) or None


PYPTO_SIM = Backend("pypto_sim", "PyPTO kernels run on CPU by pypto 0.2.0's simulator with pass verification "
                    "(~1 s/call)", ("cpu",), _unavailable)


def _reference_stage1(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, eps):
    _, latent, k_pe = latent_stage(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, eps)
    return latent, k_pe


def _kv_prolog_reasons(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin, *, num_heads,
                       qk_nope_head_dim, v_head_dim, eps=1e-6, rope_layout="interleaved", rope_compute_dtype="float32"):
    return stage2_not_supported_reasons(hidden_states, kv_a_weight, kv_norm_weight, kv_b_weight, num_heads=num_heads,
                                        qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim,
                                        rope_layout=rope_layout, rope_compute_dtype=rope_compute_dtype, mode="sim")


@PYPTO_SIM.kernel("kv_prolog", reasons=_kv_prolog_reasons)
def kv_prolog(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin, *, num_heads,
              qk_nope_head_dim, v_head_dim, eps=1e-6, rope_layout="interleaved", rope_compute_dtype="float32"):
    # (the reasons admit only rope_compute_dtype="float32": what the PyPTO stage 2 computes)
    return staged_kv_prolog(_reference_stage1, functools.partial(kv_prolog_stage2, mode="sim"), hidden_states,
                            kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin, num_heads=num_heads,
                            qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim, eps=eps,
                            rope_layout=rope_layout)


_gather_reasons = functools.partial(gather_pa_kv_cache_not_supported_reasons, mode="sim")


@PYPTO_SIM.kernel("gather_pa_kv_cache", reasons=_gather_reasons)
def gather_pa_kv_cache(key_cache, value_cache, block_tables, seq_lens, key, value, *, seq_offset=None,
                       is_seq_lens_cumsum=False):
    check_gather_values("gather_pa_kv_cache", key_cache, block_tables, seq_lens, key.shape[0], seq_offset,
                        is_seq_lens_cumsum)
    pypto_gather(key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset=seq_offset,
                 is_seq_lens_cumsum=is_seq_lens_cumsum, mode="sim")


PYPTO_SIM.kernel("gather_pa_kv_cache_functional", reasons=_gather_reasons)(functional_gather(gather_pa_kv_cache))


def _scatter_reasons(key, value, key_cache, value_cache, slot_mapping):
    return scatter_pa_kv_cache_not_supported_reasons(key, value, key_cache, value_cache, slot_mapping, mode="sim")


@PYPTO_SIM.kernel("scatter_pa_kv_cache", reasons=_scatter_reasons)
def scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping):
    check_scatter_values(slot_mapping, key_cache.shape[0] * key_cache.shape[1])
    pypto_scatter(key, value, key_cache, value_cache, slot_mapping, mode="sim")
