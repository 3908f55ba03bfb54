"""The ``cpu_native`` backend: C++ kernels for the CPU, built with the package (`mla_ops/csrc/cpu`).

One extension module, `mla_ops._C`, holds every kernel compiled for each ISA of the platform (x86-64:
``avx512``, ``avx2`` and ``default``; elsewhere ``default``, NEON on aarch64), written with ATen's
portable vector types (`at::vec::Vectorized`) and `at::parallel_for`. The kernels pick their ISA
build at the first call: the one matching ATen's own kernels (`torch.backends.cpu.get_cpu_capability()`,
which honours ``ATEN_CPU_CAPABILITY``), or the one ``MLA_OPS_NATIVE_ISA`` names (``avx512`` | ``avx2`` |
``default``; read at import), e.g. to run the AVX2 build on an AVX-512 machine. `use_isa` switches
builds inside a block (tests and benchmarks compare them side by side in one process).

Importing the extension registers its kernels on the dispatcher (static ``TORCH_LIBRARY_IMPL``,
`csrc/cpu/registration.cpp`): a CPU and an AutogradCPU kernel for each op of `NATIVE_OPS`, so
`torch.ops.mla.<op>` on CPU tensors runs no Python: the C++ kernel runs the op's metadata check (the
C++ twin of the Python one, same messages), this backend's reasons (in C++ too; `mla_ops.explain`
asks them through `torch.ops.mla_native.reasons`), the index-value checks (ValueError, nothing
written) and the kernel. What the kernels do not serve (float64, gradcheck's dtype; decode,
sparse, prefill and shared-KV attention caches whose last dim is not unit-stride; a prolog rotating k_pe with
rope_compute_dtype="activation" in fp16 / bf16; pair-major rotary tables; the "neox" layout; an
rms_norm of a non-contiguous x, or with a weight neither in x's dtype nor float32; an expanded prefill
(`mha_prefill_attention`) in bf16 / fp16 where oneDNN runs those on AMX tiles, as ATen's flash kernel then
does) goes to
the reference kernels, with the reason in `mla_ops.explain(...)`, or is refused when this backend was
requested by name. Which of the three the C++ kernel does is the op's *route*, which the backend layer
sets from the backend setting (`set_route`); nothing is registered or removed when the setting changes.

The extension is imported when `mla_ops` is (whether it imports decides the CPU route); it is our own
and pulls in no optional package. A machine where it does not import keeps the reference kernels, and
`mla-ops info` says why.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import platform
import threading
import warnings
from types import ModuleType
from typing import Any, Iterator, Optional

import torch

from .._library import OPS
from . import Backend

ISAS = ("avx512", "avx2", "default")
ENV_ISA = "MLA_OPS_NATIVE_ISA"
# set (not "0"): setup.py builds no native kernels, and `import mla_ops` does not warn that they are missing
ENV_NO_NATIVE = "MLA_OPS_NO_NATIVE"
# "0" turns off the AMX tile engine of the decode / sparse / shared-KV attention kernels (read on every call):
# bf16 then runs on the AVX512-BF16 engine, e.g. to compare the two on one machine; and the native expanded
# prefill (`mha_prefill_attention`) serves bf16 / fp16, which it otherwise leaves to ATen's AMX flash kernel.
ENV_AMX = "MLA_OPS_NATIVE_AMX"

# The ops the extension serves from the dispatcher: one `register_native_op` line each in
# csrc/cpu/registration.cpp (a test checks the two lists agree).
NATIVE_OPS = (
    "mla_decode_attention", "sparse_mla_attention", "mla_prefill_attention", "mha_prefill_attention",
    "lightning_indexer", "shared_kv_attention", "kv_prolog", "latent_kv_prolog", "shared_kv_q_prolog",
    "shared_kv_prolog", "kv_compressor", "rms_norm",
    "gather_pa_kv_cache", "gather_pa_kv_cache_functional", "scatter_pa_kv_cache", "scatter_pa_cache",
)

_lock = threading.Lock()
_loaded: Optional[tuple[Optional[ModuleType], Optional[str]]] = None  # (module, why not)


def requested_isa() -> Optional[str]:
    """The build ``MLA_OPS_NATIVE_ISA`` asks for, or None (the kernels choose from the CPU)."""
    return os.environ.get(ENV_ISA, "").strip().lower() or None


def _control() -> Any:
    return torch.ops.mla_native


def _import_extension() -> tuple[Optional[ModuleType], Optional[str]]:
    requested = requested_isa()
    if requested is not None and requested not in ISAS:
        return None, f"{ENV_ISA}={requested!r} is not one of {ISAS}"
    try:
        module = importlib.import_module("mla_ops._C")
    except ImportError as exc:
        return None, (f"mla_ops._C is not built or cannot be imported ({exc}); reinstall mla-ops in this "
                      f"environment with `pip install --no-build-isolation .` (`-e .` for a development install), "
                      f"with a C++ compiler")
    if requested is not None:
        runnable = list(_control().isas())
        if requested not in runnable:
            return None, (f"{ENV_ISA}={requested!r}: this CPU does not run the {requested} build of the native "
                          f"kernels (it runs {', '.join(runnable)})")
        _control().set_isa(requested)
    return module, None


def load() -> Optional[ModuleType]:
    """The extension module (imported once; its import registers the kernels), or None (see
    `unavailable_reason`)."""
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                _loaded = _import_extension()
    return _loaded[0]


def unavailable_reason() -> Optional[str]:
    """Why the native kernels cannot serve, or None when they can."""
    load()
    return _loaded[1]


def warn_if_unavailable() -> None:
    """Warn on x86-64 when the native kernels do not load (`import mla_ops` calls this once), unless
    ``MLA_OPS_NO_NATIVE`` is set: the opt-out that setup.py honours too."""
    if platform.machine().lower() not in ("x86_64", "amd64") or os.environ.get(ENV_NO_NATIVE, "0") not in ("", "0"):
        return
    reason = unavailable_reason()
    if reason is not None:
        warnings.warn(f"mla-ops: the native CPU kernels are unavailable, so ops on CPU tensors run the reference "
                      f"kernels (slower): {reason}. Set {ENV_NO_NATIVE}=1 to run on the reference kernels without "
                      f"this warning.", RuntimeWarning, stacklevel=2)


def isa() -> Optional[str]:
    """The ISA build serving calls ("avx512", "avx2", "default"), or None when unavailable."""
    return str(_control().isa()) if load() is not None else None


def available_isas() -> list[str]:
    """The builds this CPU runs (the tests and the benchmark loop over them), best first."""
    if load() is None:
        return []
    runnable = set(_control().isas())
    return [name for name in ISAS if name in runnable]


@contextlib.contextmanager
def use_isa(isa: str) -> Iterator[None]:
    """Serve the native kernels from the `isa` build inside the block (tests and benchmarks). A
    process setting, like the backend setting: calls from other threads see it too."""
    if load() is None:
        raise RuntimeError(f"mla-ops native CPU kernels unavailable: {unavailable_reason()}")
    previous = str(_control().isa())
    _control().set_isa(isa)
    try:
        yield
    finally:
        _control().set_isa(previous)


def attention_engine(q_latent: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> str:
    """The tile engine the decode / sparse attention kernel of the current build runs for these operands:
    "amx" (bf16 on AMX tiles, through oneDNN's brgemm ukernel, on CPUs where oneDNN runs AMX),
    "avx512_bf16" (bf16 dot products, vdpbf16ps) or "fp32" (fp32 FMA: every other dtype, layout or CPU)."""
    if load() is None:
        raise RuntimeError(f"mla-ops native CPU kernels unavailable: {unavailable_reason()}")
    return str(_control().attention_engine(q_latent, key_cache, value_cache))


def _schema_arguments(op: str, args: tuple, kwargs: dict) -> list:
    """Every argument of `mla::<op>`'s schema, in order, defaults filled in (for torch.ops.mla_native.reasons)."""
    values = []
    for i, argument in enumerate(OPS[op].overload._schema.arguments):
        if i < len(args):
            values.append(args[i])
        elif argument.name in kwargs:
            values.append(kwargs[argument.name])
        else:
            values.append(argument.default_value)
    return values


class _Extension:
    """What the backend layer asks of the loaded extension (a `StaticCpuKernels`)."""

    @staticmethod
    def ops() -> list[str]:
        return list(_control().ops())

    @staticmethod
    def set_route(op: str, route: str, refusal: str) -> None:
        _control().set_route(op, route, refusal)


def _static_cpu_kernels() -> Optional[_Extension]:
    return _Extension() if load() is not None else None


def _reasons_of(op: str):
    def reasons(*args, **kwargs) -> list[str]:
        return list(_control().reasons(op, _schema_arguments(op, args, kwargs)))

    reasons.__name__ = f"{op}_native_reasons"
    return reasons


CPU_NATIVE = Backend("cpu_native", "C++ kernels (ATen vectorized, at::parallel_for) built with the package",
                     ("cpu",), unavailable_reason, auto_priority=0,  # the automatic choice on CPU where it loads
                     static_cpu_kernels=_static_cpu_kernels)

def _not_registered(op: str):
    def reasons(*args, **kwargs) -> list[str]:
        return [f"the loaded extension ({load().__file__}) has no kernel for mla.{op}: it was built from other "
                f"sources; rebuild it (`pip install --no-build-isolation -e .`)"]

    return reasons


_REGISTERED = set(_control().ops()) if load() is not None else set(NATIVE_OPS)
_MAY_REFUSE = set(_control().ops_with_reasons()) if load() is not None else set(NATIVE_OPS)
for _op in NATIVE_OPS:
    # The kernel is the op itself: the extension serves it from the CPU key whenever this backend is the
    # CPU choice (the backend layer never calls it from Python: see `Backend.static_cpu_kernels`).
    _reasons = _reasons_of(_op) if _op in _MAY_REFUSE else None
    CPU_NATIVE.kernel(_op, reasons=_reasons if _op in _REGISTERED else _not_registered(_op), memoize=False,
                      checks_arguments=True)(OPS[_op].overload)
