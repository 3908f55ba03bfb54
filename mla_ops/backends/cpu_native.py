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

The ops this backend serves on CPU are registered on the dispatcher by the extension itself
(`bindings.cpp` / `registration.cpp`: CPU and AutogradCPU kernels, bound by `mla_ops.backends.bind`
for the build `load()` picks), so `torch.ops.mla.<op>` on CPU tensors runs no Python: the C++ kernel
runs the op's metadata check (the C++ twin of the Python one, same messages), this backend's reasons
(`*_reasons` below, in C++ too), the index-value checks (ValueError, nothing written) and the kernel.
What the kernels do not serve (float64, gradcheck's dtype; decode and sparse-attention caches whose
last dim is not unit-stride; a prolog rotating k_pe with rope_compute_dtype="activation" in fp16 / bf16;
pair-major rotary tables; the "neox" layout) goes to the reference kernels, with the reason in
`mla_ops.explain(...)`, or is refused when this backend was requested by name.

The Python kernels below call a build directly (the `_ext` keyword selects one: tests and
benchmarks compare builds side by side); they take the path only when the dispatcher binding does
not (another backend ranked between this one and the reference).
"""
from __future__ import annotations

import contextlib
import importlib
import os
import platform
import threading
import warnings
from types import ModuleType
from typing import Iterator, Optional

import torch

from ..settings import environment_variable
from . import Backend

ISAS = ("avx512", "avx2", "default")
ENV_ISA = "MLA_OPS_NATIVE_ISA"
# set (not "0"): setup.py builds no native kernels, and `import mla_ops` does not warn that they are missing
ENV_NO_NATIVE = "MLA_OPS_NO_NATIVE"
# "0" turns off the AMX tile engine of the decode / sparse attention kernels (read on every call):
# bf16 then runs on the AVX512-BF16 engine, e.g. to compare the two on one machine.
ENV_AMX = "MLA_OPS_NATIVE_AMX"

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
                    f"mla_ops._C_{isa} is not built or cannot be imported ({exc}); reinstall mla-ops in this "
                    f"environment with `pip install --no-build-isolation .` (`-e .` for a development install), "
                    f"with a C++ compiler"
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


def warn_if_unavailable() -> None:
    """Warn on x86-64 when no native build loads (`import mla_ops` calls this once), unless
    ``MLA_OPS_NO_NATIVE`` is set: the opt-out that setup.py honours too."""
    if platform.machine().lower() not in ("x86_64", "amd64") or os.environ.get(ENV_NO_NATIVE, "0") not in ("", "0"):
        return
    reason = unavailable_reason()
    if reason is not None:
        warnings.warn(f"mla-ops: the native CPU kernels are unavailable, so ops on CPU tensors run the reference "
                      f"kernels (slower): {reason}. Set {ENV_NO_NATIVE}=1 to run on the reference kernels without "
                      f"this warning.", RuntimeWarning, stacklevel=2)


def isa() -> Optional[str]:
    """The ISA of the loaded build ("avx512", "avx2", "default"), or None when unavailable."""
    chosen = requested_isa()
    return chosen if load(chosen) is not None else None


def available_isas() -> list[str]:
    """Every build that is installed and runs on this CPU (the tests and the benchmark loop over them)."""
    return [name for name in ISAS if _import(name) is not None]


def attention_engine(q_latent: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, *,
                     _ext: Optional[ModuleType] = None) -> str:
    """The tile engine the decode / sparse attention kernel of a build runs for these operands: "amx"
    (bf16 on AMX tiles, through oneDNN's brgemm ukernel, on CPUs where oneDNN runs AMX), "avx512_bf16"
    (bf16 dot products, vdpbf16ps) or "fp32" (fp32 FMA: every other dtype, layout or CPU)."""
    return _module(_ext).attention_engine(q_latent, key_cache, value_cache)


def _module(ext: Optional[ModuleType]) -> ModuleType:
    ext = ext or load()
    if ext is None:
        raise RuntimeError(f"mla-ops native CPU kernels unavailable: {unavailable_reason()}")
    return ext




def _unavailable() -> Optional[str]:
    return unavailable_reason()


@contextlib.contextmanager
def use_isa(isa: Optional[str]) -> Iterator[None]:
    """Serve the ops from the `isa` build (``MLA_OPS_NATIVE_ISA``) inside the block, re-binding the
    dispatcher on entry and exit (the binding is made for one build, not looked up per call)."""
    from . import bind

    try:
        with environment_variable(ENV_ISA, isa):
            bind()
            yield
    finally:
        bind()  # after the variable is restored


CPU_NATIVE = Backend("cpu_native", "C++ kernels (ATen vectorized, at::parallel_for) built with the package",
                     ("cpu",), _unavailable, auto_priority=0,  # the automatic choice on CPU where a build imports
                     cpu_registrar=lambda: load())


def _prolog_reasons(hidden_states, *args, rope_layout: str = "interleaved", rope_compute_dtype: str = "float32",
                    **kwargs) -> list[str]:
    """(kv_prolog and latent_kv_prolog: cos and sin are the last two positional arguments.)"""
    return _module(None).prolog_reasons(hidden_states, args[-2], args[-1], rope_layout, rope_compute_dtype)


def _decode_reasons(q_latent, q_pe, key_cache, value_cache, *args, **kwargs) -> list[str]:
    return _module(None).mla_decode_attention_reasons(q_latent, key_cache, value_cache)


def _sparse_attention_reasons(q_latent, q_pe, key_cache, value_cache, *args, **kwargs) -> list[str]:
    return _module(None).sparse_mla_attention_reasons(q_latent, key_cache, value_cache)


def _indexer_reasons(q, *args, **kwargs) -> list[str]:
    return _module(None).lightning_indexer_reasons(q)


# ------------------------------------------------------------------------------------------ kernels
# Each is the extension's direct entry point (the op's checks, reasons and kernel, in C++). `_ext`
# (keyword-only, not part of the op schemas) selects a build explicitly: tests and benchmark.
def _direct(op: str, doc: str, reasons=None):
    def kernel(*args, _ext: Optional[ModuleType] = None, **kwargs):
        return getattr(_module(_ext), op)(*args, **kwargs)

    kernel.__name__ = kernel.__qualname__ = op
    kernel.__doc__ = doc
    CPU_NATIVE.kernel(op, reasons=reasons, memoize=False, checks_arguments=True)(kernel)
    return kernel


mla_decode_attention = _direct(
    "mla_decode_attention",
    """q_latent [B, N, L], q_pe [B, N, R], key_cache [NB, bs, 1, L], value_cache [NB, bs, 1, R],
    block_tables [B, max_blocks], seq_lens [B] (int32/int64) -> o_latent [B, N, L] in q's dtype.

    fp32 scores and probabilities with an online softmax, split over batch x heads x context chunks
    (one sequence uses every core); positions past a row's length are never read.""",
    _decode_reasons)
kv_prolog = _direct(
    "kv_prolog",
    """The two GEMMs through ATen (the reference's own calls), then split + RMSNorm + RoPE + output
    layout in one vectorised pass; bit-identical to the reference kernel.""",
    _prolog_reasons)
latent_kv_prolog = _direct(
    "latent_kv_prolog",
    "hidden_states [B, S, H] -> latent [B, S, L] (normed), k_pe [B, S, R] (rotated); bit-identical.",
    _prolog_reasons)
gather_pa_kv_cache = _direct(
    "gather_pa_kv_cache",
    """Block-run copies of every sequence's tokens into key [T, Hk, Dk] / value [T, Hv, Dv] (any cache
    strides); validated first, nothing written on a bad value.""")
gather_pa_kv_cache_functional = _direct(
    "gather_pa_kv_cache_functional",
    "The out-of-place twin: gathers into clones of key and value (their strides kept) and returns them.")
scatter_pa_kv_cache = _direct(
    "scatter_pa_kv_cache",
    "key_cache[slot // bs, slot % bs] = key[t] (same for value) for every token t with slot >= 0.")
scatter_pa_cache = _direct(
    "scatter_pa_cache",
    "The one-pool twin (the sparse indexer's key cache): cache[slot // bs, slot % bs] = key[t]; the same C++ code.")
lightning_indexer = _direct(
    "lightning_indexer",
    """q [T, H, D], weights [T, H], k_cache [NB, bs, 1, D] -> int32 [T, topk]: fp32 scores of query tiles x
    context chunks (split over the cores, a key row read once per tile of a request's tokens), then an
    exact top-k per token (nth_element + sort on (score, position) keys: the reference's order, ties and
    NaN included).""",
    _indexer_reasons)
sparse_mla_attention = _direct(
    "sparse_mla_attention",
    """q_latent [T, N, L], q_pe [T, N, R], the latent / k_pe caches, topk_indices [T, K] -> o_latent [T, N, L]:
    the decode kernel over each token's listed positions (-1 skipped), all heads per gathered row, split
    over tokens and, for few tokens, over chunks of the list (merged like decode's split context).""",
    _sparse_attention_reasons)
