"""The ``cpu_native`` backend: C++ kernels for the CPU, built with the package (`mla_ops/csrc/cpu`).

The kernels are compiled once per ISA into `mla_ops._C_avx512`, `mla_ops._C_avx2` and
`mla_ops._C_default` (setup.py, `torch.utils.cpp_extension`), written with ATen's portable vector
types (`at::vec::Vectorized`) and `at::parallel_for`, so the same sources build for AVX2, AVX-512
and NEON. `load()` imports the best build the CPU supports, decided by
`torch.backends.cpu.get_cpu_capability()` (which honours ``ATEN_CPU_CAPABILITY``), or the one named
by ``MLA_OPS_NATIVE_ISA`` (``avx512`` | ``avx2`` | ``default``), e.g. to run the AVX2 build on an
AVX-512 machine. The build is imported when the backends are bound (at ``import mla_ops``: whether it
imports decides the CPU binding); it is our own extension and pulls in no optional package. A
machine where no build imports keeps the reference kernels, and `mla-ops info` says why.

The op's metadata check runs before these kernels (the backend layer binds them behind it). The C++
kernels validate index values themselves and report a bad value without writing anything; the
reference value checks then run only to raise the usual ValueError. What the kernels do not serve
(float64, gradcheck's dtype; decode caches whose last dim is not unit-stride; a prolog rotating k_pe
with rope_compute_dtype="activation" in fp16 / bf16) goes to the reference kernels, with the reason in
`mla_ops.explain(...)`.

C++ entry points (pybind11, `bindings.cpp`; the GIL is released during every call):
``decode_attention(..., validate) -> Tensor | None``, ``kv_prolog(...)``, ``latent_kv_prolog(...)``,
``gather_pa_kv_cache(...) -> int`` and ``scatter_pa_kv_cache(...) -> int`` (0 done, 1 bad value,
nothing written), ``isa()``.
"""
from __future__ import annotations

import importlib
import os
import threading
from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

from .._checks import INTERLEAVED_INPUT_LAYOUTS
from ..ops.decode_attention import check_decode_values
from ..ops.gather_pa_kv_cache import check_gather_values, functional_gather
from ..ops.scatter_pa_kv_cache import check_scatter_values
from . import Backend

NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

ISAS = ("avx512", "avx2", "default")
ENV_ISA = "MLA_OPS_NATIVE_ISA"

_lock = threading.Lock()
_modules: dict[str, Optional[ModuleType]] = {}
_reasons: dict[str, str] = {}


def cpu_supports(isa: str) -> bool:
    """Whether this CPU can run the `isa` build (hardware, whatever ATEN_CPU_CAPABILITY says)."""
    if isa == "default":
        return True
    if isa == "avx512":
        return bool(torch.cpu._is_avx512_supported())
    if isa == "avx2":
        return bool(torch.cpu._is_avx2_supported())
    return False


def _preferred_isa() -> str:
    """The build matching ATen's own kernel level (so ATEN_CPU_CAPABILITY=avx2 picks the AVX2 build)."""
    capability = torch.backends.cpu.get_cpu_capability().upper()
    if capability.startswith("AVX512"):
        return "avx512"
    if capability == "AVX2":
        return "avx2"
    return "default"


def requested_isa() -> str:
    """The build `load()` uses: ``MLA_OPS_NATIVE_ISA`` when set, else the CPU's best."""
    value = os.environ.get(ENV_ISA, "").strip().lower()
    return value or _preferred_isa()


def _import(isa: str) -> Optional[ModuleType]:
    with _lock:
        if isa in _modules:
            return _modules[isa]
        module = None
        if isa not in ISAS:
            _reasons[isa] = f"{ENV_ISA}={isa!r} is not one of {ISAS}"
        elif not cpu_supports(isa):
            _reasons[isa] = f"this CPU does not support {isa} (torch.cpu reports no {isa})"
        else:
            try:
                module = importlib.import_module(f"mla_ops._C_{isa}")
            except ImportError as exc:
                _reasons[isa] = (
                    f"mla_ops._C_{isa} is not built or cannot be imported ({exc}); reinstall with "
                    f"`pip install --no-build-isolation -e .` on a machine with a C++ compiler"
                )
        _modules[isa] = module
        return module


_default: tuple = (None, None)  # (MLA_OPS_NATIVE_ISA value it was resolved for, module)


def load(isa: Optional[str] = None) -> Optional[ModuleType]:
    """The extension module for `isa` (default: `requested_isa()`), or None (see `unavailable_reason`)."""
    global _default
    if isa is not None:
        return _import(isa)
    env = os.environ.get(ENV_ISA)
    if _default[0] != env or _default[1] is None:  # the per-call fast path is one dict lookup
        _default = (env, _import(requested_isa()))
    return _default[1]


def unavailable_reason(isa: Optional[str] = None) -> Optional[str]:
    """Why `load(isa)` returns None, or None when the native kernels are usable."""
    isa = isa or requested_isa()
    return None if _import(isa) is not None else _reasons.get(isa, "unknown")


def isa() -> Optional[str]:
    """The ISA of the loaded build ("avx512", "avx2", "default"), or None when unavailable."""
    chosen = requested_isa()
    return chosen if load(chosen) is not None else None


def available_isas() -> list[str]:
    """Every build that is installed and runs on this CPU (the tests and the benchmark loop over them)."""
    return [name for name in ISAS if _import(name) is not None]


def _module(ext: Optional[ModuleType]) -> ModuleType:
    ext = ext or load()
    if ext is None:
        raise RuntimeError(f"mla-ops native CPU kernels unavailable: {unavailable_reason()}")
    return ext




def _unavailable() -> Optional[str]:
    return unavailable_reason()


CPU_NATIVE = Backend("cpu_native", "C++ kernels (ATen vectorized, at::parallel_for) built with the package",
                     ("cpu",), _unavailable, auto_priority=0)  # the automatic choice on CPU where a build imports


def _dtype_reasons(activation: Tensor) -> list[str]:
    if activation.dtype in NATIVE_DTYPES:
        return []
    return [f"{activation.dtype} is not served by the native kernels (float32, bfloat16, float16); "
            f"the reference kernel serves it"]


def _prolog_reasons(hidden_states, *args, rope_layout: str = "interleaved", rope_compute_dtype: str = "float32",
                    **kwargs) -> list[str]:
    """(kv_prolog and latent_kv_prolog: cos and sin are the last two positional arguments.)"""
    reasons = _dtype_reasons(hidden_states)
    if rope_compute_dtype == "activation" and hidden_states.dtype != torch.float32:
        # In fp32 the kernel's separately rounded fp32 products and sums (-ffp-contract=off) are the
        # "activation" formula itself; in fp16 / bf16 that formula rounds every step to the half type.
        reasons.append(f"rope_compute_dtype 'activation' with {hidden_states.dtype}: the native prolog kernels "
                       f"rotate k_pe in fp32 and round once; the reference kernel rounds each product and sum to "
                       f"{hidden_states.dtype} as the stock x*cos + rotate_half(x)*sin does")
    cos, sin = args[-2], args[-1]
    if not (_position_major(cos) and _position_major(sin)):
        # transformers 4.54 - 5.1x build DeepSeek-V2's rotary tables transposed; ATen's complex
        # multiply over such a layout (the stock model's RoPE, and the reference kernel's) takes a
        # loop whose rounding the vectorised native formula does not reproduce
        reasons.append("cos/sin are laid out pair-major (the rotary tables of a transposed freqs tensor); the "
                       "reference kernel reproduces transformers' rounding for them")
    if rope_layout not in INTERLEAVED_INPUT_LAYOUTS:
        reasons.append(f"rope_layout {rope_layout!r}: the native prolog kernels rotate adjacent pairs "
                       f"({' or '.join(INTERLEAVED_INPUT_LAYOUTS)}); the reference kernel serves it")
    return reasons


def _position_major(table: Tensor) -> bool:
    """Whether a [.., S, R/2] table steps through pairs no slower than through positions."""
    return table.dim() < 2 or table.shape[-1] <= 1 or table.shape[-2] <= 1 or table.stride(-1) <= table.stride(-2)


def _decode_reasons(q_latent, q_pe, key_cache, value_cache, *args, **kwargs) -> list[str]:
    reasons = _dtype_reasons(q_latent)
    if key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        reasons.append("the caches' last dim must be unit-stride for the native decode kernel")
    return reasons


def _bad_values(op: str) -> RuntimeError:
    return RuntimeError(f"mla.{op}: the native kernel rejected the index values but the reference checks "
                        f"accept them (please report this with the inputs)")


# ------------------------------------------------------------------------------------------ kernels
# `_ext` (keyword-only, not part of the op schemas) selects a build explicitly: tests and benchmark.

@CPU_NATIVE.kernel("mla_decode_attention", reasons=_decode_reasons, memoize=False)
def mla_decode_attention(q_latent: Tensor, q_pe: Tensor, key_cache: Tensor, value_cache: Tensor,
                         block_tables: Tensor, seq_lens: Tensor, softmax_scale: float, *,
                         _ext: Optional[ModuleType] = None) -> Tensor:
    """q_latent [B, N, L], q_pe [B, N, R], key_cache [NB, bs, 1, L], value_cache [NB, bs, 1, R],
    block_tables [B, max_blocks], seq_lens [B] (int32/int64) -> o_latent [B, N, L] in q's dtype.

    fp32 scores and probabilities with an online softmax, split over batch x heads x context chunks
    (one sequence uses every core); positions past a row's length are never read."""
    out = _module(_ext).decode_attention(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens,
                                         float(softmax_scale), True)
    if out is None:  # a bad index value: the reference check formats the error
        check_decode_values(block_tables, seq_lens, key_cache.shape[0], key_cache.shape[1])
        raise _bad_values("mla_decode_attention")
    return out


@CPU_NATIVE.kernel("kv_prolog", reasons=_prolog_reasons, memoize=False)
def kv_prolog(hidden_states: Tensor, kv_a_weight: Tensor, kv_a_bias: Optional[Tensor], kv_norm_weight: Tensor,
              kv_b_weight: Tensor, cos: Tensor, sin: Tensor, *, num_heads: int, qk_nope_head_dim: int,
              v_head_dim: int, eps: float = 1e-6, rope_layout: str = "interleaved",
              rope_compute_dtype: str = "float32", _ext: Optional[ModuleType] = None):
    """The two GEMMs through ATen (the reference's own calls), then split + RMSNorm + RoPE + output
    layout in one vectorised pass; bit-identical to the reference kernel."""
    return _module(_ext).kv_prolog(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin,
                                   num_heads, qk_nope_head_dim, v_head_dim, float(eps), rope_layout == "interleaved")


@CPU_NATIVE.kernel("latent_kv_prolog", reasons=_prolog_reasons, memoize=False)
def latent_kv_prolog(hidden_states: Tensor, kv_a_weight: Tensor, kv_a_bias: Optional[Tensor],
                     kv_norm_weight: Tensor, cos: Tensor, sin: Tensor, *, eps: float = 1e-6,
                     rope_layout: str = "interleaved", rope_compute_dtype: str = "float32",
                     _ext: Optional[ModuleType] = None):
    """hidden_states [B, S, H] -> latent [B, S, L] (normed), k_pe [B, S, R] (rotated); bit-identical."""
    return _module(_ext).latent_kv_prolog(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin,
                                          float(eps), rope_layout == "interleaved")


@CPU_NATIVE.kernel("gather_pa_kv_cache")
def gather_pa_kv_cache(key_cache: Tensor, value_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, key: Tensor,
                       value: Tensor, *, seq_offset: Optional[Tensor] = None, is_seq_lens_cumsum: bool = False,
                       _ext: Optional[ModuleType] = None) -> None:
    """Block-run copies of every sequence's tokens into key [T, Hk, Dk] / value [T, Hv, Dv] (any cache
    strides); validated first, nothing written on a bad value."""
    status = _module(_ext).gather_pa_kv_cache(key_cache, value_cache, block_tables, seq_lens, key, value,
                                              seq_offset, bool(is_seq_lens_cumsum))
    if status != 0:
        check_gather_values("gather_pa_kv_cache", key_cache, block_tables, seq_lens, key.shape[0], seq_offset,
                            is_seq_lens_cumsum)
        raise _bad_values("gather_pa_kv_cache")


CPU_NATIVE.kernel("gather_pa_kv_cache_functional")(functional_gather(gather_pa_kv_cache))
gather_pa_kv_cache_functional = CPU_NATIVE.kernels["gather_pa_kv_cache_functional"].fn


@CPU_NATIVE.kernel("scatter_pa_kv_cache")
def scatter_pa_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
                        *, _ext: Optional[ModuleType] = None) -> None:
    """key_cache[slot // bs, slot % bs] = key[t] (same for value) for every token t with slot >= 0."""
    status = _module(_ext).scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    if status != 0:
        check_scatter_values(slot_mapping, key_cache.shape[0] * key_cache.shape[1])
        raise _bad_values("scatter_pa_kv_cache")
