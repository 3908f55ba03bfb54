"""Paged KV-cache scatter (``mla::scatter_pa_kv_cache``) as a PyPTO kernel.

For each token t with ``slot = slot_mapping[t] >= 0``::

    key_cache[slot // block_size, slot % block_size]   = key[t]
    value_cache[slot // block_size, slot % block_size] = value[t]

A negative slot is padding and is skipped; cache slots no token maps to keep their contents.

Kernel: ``pypto.loop`` over tokens; the slot is read inside the kernel (int32 scalar read -- the host
converts an int64 ``slot_mapping`` with ``.to(torch.int32)``, a device op, no host sync; values must
fit in int32) and the conditional write is a data-dependent ``if`` (``pypto.cond``) around a one-row
``view`` + ``assemble`` into the flattened cache ``[num_blocks*block_size, heads, dim]`` (a free host
view). Slots at or beyond ``num_blocks*block_size`` are skipped as well, so no value makes the kernel
write out of bounds; such a slot is a caller error that this kernel silently ignores -- validate
slots before calling (the kernel is not a line of defence).

Duplicate slots (two tokens mapping to one slot) are a caller error as in vLLM / torch_npu: the
result is one of the tokens (the pypto tensor-graph semantics apply them in token order, so the last
wins in the simulation; on the NPU the tasks may run in any order).
"""

# No `from __future__ import annotations`: pypto.frontend.jit reads live pypto.Tensor annotations.
import functools
from typing import List, Optional, Sequence, Tuple

import torch

from ... import pypto_runtime as runtime
from ...ops.scatter_pa_kv_cache import check_scatter_pa_kv_cache_args
from .gather_pa_kv_cache import cache_reasons

__all__ = ["scatter_pa_kv_cache", "scatter_pa_kv_cache_not_supported_reasons"]



def scatter_pa_kv_cache_not_supported_reasons(key, value, key_cache, value_cache, slot_mapping, *,
                                              mode: str = "sim") -> List[str]:
    """Why this kernel cannot run arguments that passed the op's own check
    (`mla.scatter_pa_kv_cache`): pypto's availability, the mode and device, the cache dtype subset
    and contiguity (slot values are the caller's to validate)."""
    reasons = list(runtime.unavailable_reasons())
    if mode not in runtime.MODES:
        return reasons + [f"mode must be one of {runtime.MODES}, got {mode!r}"]
    tensors = {"key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache,
               "slot_mapping": slot_mapping}
    reasons += cache_reasons(tensors, "written in place")
    reasons += runtime.device_reasons(tensors, mode, key)
    return reasons


@functools.lru_cache(maxsize=None)
def _build_kernel(key_hd: Tuple[int, int], value_hd: Tuple[int, int], dtype: torch.dtype, mode: str):
    """Arguments: key [T,Hk,Dk], value [T,Hv,Dv], slot_mapping [T] i32,
    key_cache [NB*BS,Hk,Dk], value_cache [NB*BS,Hv,Dv] (written in place)."""
    runtime.ensure_supported()
    import pypto

    Hk, Dk = key_hd
    Hv, Dv = value_hd
    dt = runtime.pypto_dtype(dtype)
    DYN = pypto.DYNAMIC
    jit = runtime.jit_kwargs(mode, error_tol=(0.0, 0.0))      # a copy: exact

    @pypto.frontend.jit(**jit)
    def scatter_pa_kv_cache_kernel(
        key: pypto.Tensor([DYN, Hk, Dk], dt),
        value: pypto.Tensor([DYN, Hv, Dv], dt),
        slot_mapping: pypto.Tensor([DYN], pypto.DT_INT32),
        key_cache: pypto.Tensor([DYN, Hk, Dk], dt),
        value_cache: pypto.Tensor([DYN, Hv, Dv], dt),
    ):
        num_slots = key_cache.shape[0]
        for t in pypto.loop(key.shape[0], name="LOOP_TOKEN", idx_name="t"):
            slot = slot_mapping[t]
            if slot >= 0:
                if slot < num_slots:
                    pypto.set_vec_tile_shapes(1, Hk, Dk)
                    pypto.assemble(pypto.view(key, [1, Hk, Dk], [t, 0, 0]), [slot, 0, 0], key_cache)
                    pypto.set_vec_tile_shapes(1, Hv, Dv)
                    pypto.assemble(pypto.view(value, [1, Hv, Dv], [t, 0, 0]), [slot, 0, 0], value_cache)

    return scatter_pa_kv_cache_kernel


def run_with_result(key, value, key_cache, value_cache, slot_mapping, *, mode: str = "sim",
                    goldens: Optional[Sequence[torch.Tensor]] = None) -> Optional[runtime.SimResult]:
    """:func:`scatter_pa_kv_cache` returning the SimResult (mode="sim"); ``goldens`` = optional
    (key_cache, value_cache) expected after the call."""
    check_scatter_pa_kv_cache_args(key, value, key_cache, value_cache, slot_mapping)
    reasons = scatter_pa_kv_cache_not_supported_reasons(key, value, key_cache, value_cache, slot_mapping,
                                                        mode=mode)
    if reasons:
        raise ValueError("scatter_pa_kv_cache: " + "; ".join(reasons))
    nb, bs, hk, dk = key_cache.shape
    hv, dv = value_cache.shape[2:]
    if key.shape[0] == 0 or nb * bs == 0:
        return None
    kernel = _build_kernel((hk, dk), (hv, dv), key_cache.dtype, mode)
    args = [key.contiguous(), value.contiguous(), slot_mapping.to(torch.int32).contiguous(),
            key_cache.view(nb * bs, hk, dk), value_cache.view(nb * bs, hv, dv)]
    kernel_goldens = None
    if goldens is not None:
        kernel_goldens = [None] * 3 + [g.reshape(nb * bs, *g.shape[2:]) for g in goldens]
    return runtime.launch("scatter_pa_kv_cache", kernel, args, mode=mode, goldens=kernel_goldens,
                          outputs={"key_cache": key_cache, "value_cache": value_cache})


def scatter_pa_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                        value_cache: torch.Tensor, slot_mapping: torch.Tensor, *, mode: str = "sim") -> None:
    """Write each token's key/value row into its cache slot, in place (the semantics of ``mla::scatter_pa_kv_cache``).

    Args:
        key, value:   [T, Hk, Dk] / [T, Hv, Dv], same dtype as the caches.
        key_cache:    [num_blocks, block_size, Hk, Dk] bf16/fp16/fp32, contiguous ND.
        value_cache:  [num_blocks, block_size, Hv, Dv], same num_blocks/block_size.
        slot_mapping: [T] int32/int64, ``block * block_size + offset``; negative = padding, skipped.
        mode:         "sim" (CPU tensors through the PyPTO simulation) or "npu" (asynchronous).

    Raises:
        ValueError: unsupported inputs (see :func:`scatter_pa_kv_cache_not_supported_reasons`).
    """
    run_with_result(key, value, key_cache, value_cache, slot_mapping, mode=mode)
