"""Backends: what each one serves, why it cannot serve an input, and the one place that chooses.

Each backend declares the ops, devices and dtypes it supports and explains in words why it cannot
serve a call (`not_supported_reasons`, after xformers' fmha dispatch). `choose()` walks a priority
list: with ``MLA_OPS_BACKEND=auto`` it takes the first backend with no reasons and records why it
skipped the others (``explain()`` / ``last_choice()``); with an explicit backend it either serves or
raises ``NotImplementedError`` listing the reasons — a demand is never silently downgraded.
A backend serves only the ops it declares: an explicit ``pypto_sim`` still runs ``rms_norm`` with
the reference kernel, because pypto_sim has no rms_norm kernel to offer.

Backends:
* ``reference`` — torch ops, any device, every op (`mla_ops.ops.reference`).
* ``pypto_sim`` — the PyPTO kernels on CPU through pypto's simulator with pass verification
  (`mla_ops.ops.pypto`): kv_prolog (stage 2 in PyPTO) and the paged-cache ops. fp16/bf16 only.
* ``npu`` — Ascend: torch_npu stage-1 ops + PyPTO kernels (`mla_ops.ops.npu`), NPU tensors only.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Optional

import torch

from . import _optional
from .config import settings


@dataclasses.dataclass(frozen=True)
class Backend:
    """A set of kernels. `kernels_module` is imported only when one of its kernels is needed."""

    name: str
    description: str
    devices: tuple[str, ...]  # device types ("cpu", "npu"); "*" = any
    ops: tuple[str, ...]
    kernels_module: str  # module exposing KERNELS: dict[op, callable] (and optional REASONS)
    availability: Callable[[], Optional[str]] = lambda: None  # -> reason it is unavailable, or None

    def unavailable_reason(self) -> Optional[str]:
        return self.availability()

    def kernels(self) -> dict[str, Callable]:
        return importlib.import_module(self.kernels_module).KERNELS

    def not_supported_reasons(self, op: str, args: tuple, kwargs: dict) -> list[str]:
        """Readable reasons this backend cannot run `op` on these inputs (empty: it can)."""
        if op not in self.ops:
            return [f"{self.name} has no {op} kernel"]
        reason = self.unavailable_reason()
        if reason:
            return [reason]
        device = _device_of(args)
        if "*" not in self.devices and device is not None and device.type not in self.devices:
            return [f"device={device.type} (supported: {', '.join(self.devices)})"]
        checker = getattr(importlib.import_module(self.kernels_module), "REASONS", {}).get(op)
        return list(checker(*args, **kwargs)) if checker else []


def _device_of(args: tuple) -> Optional[torch.device]:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return None


def _pypto_unavailable() -> Optional[str]:
    from .ops import pypto_sim

    return pypto_sim.unavailable_reason()


def _npu_unavailable() -> Optional[str]:
    usable, reason = _optional.torch_npu_usable()
    if not usable:
        return reason
    if not _optional.has_module("pypto"):
        return "pypto is not installed (the NPU kv_prolog stage 2 and gather are PyPTO kernels)"
    return None


REFERENCE = Backend(
    name="reference",
    description="torch ops; any device; the ground truth",
    devices=("*",),
    ops=("rms_norm", "rope", "kv_prolog", "latent_kv_prolog", "scatter_pa_kv_cache", "gather_pa_kv_cache",
         "gather_pa_kv_cache_functional", "mla_decode_attention"),
    kernels_module="mla_ops.ops.reference",
)
PYPTO_SIM = Backend(
    name="pypto_sim",
    description="PyPTO kernels run on CPU by pypto 0.2.0's simulator with pass verification (~1 s/call)",
    devices=("cpu",),
    ops=("kv_prolog", "gather_pa_kv_cache", "gather_pa_kv_cache_functional", "scatter_pa_kv_cache"),
    kernels_module="mla_ops.ops.pypto_sim",
    availability=_pypto_unavailable,
)
NPU = Backend(
    name="npu",
    description="Ascend NPU: torch_npu stage-1 ops + PyPTO kernels, fused for short token counts",
    devices=("npu",),
    ops=("kv_prolog", "gather_pa_kv_cache", "gather_pa_kv_cache_functional"),
    kernels_module="mla_ops.ops.npu.kernels",
    availability=_npu_unavailable,
)
BACKENDS: dict[str, Backend] = {b.name: b for b in (REFERENCE, PYPTO_SIM, NPU)}

# Automatic choice per device type: first backend without reasons wins.
_AUTO_PRIORITY: dict[str, tuple[Backend, ...]] = {"npu": (NPU, REFERENCE)}
_DEFAULT_PRIORITY: tuple[Backend, ...] = (REFERENCE,)

_last_choice: dict[str, tuple[str, list[tuple[str, list[str]]]]] = {}


def choose(op: str, args: tuple, kwargs: dict) -> tuple[Backend, list[tuple[str, list[str]]]]:
    """-> (backend, [(skipped backend, reasons), ...]) for this call under the current settings."""
    requested = settings.backend
    if requested == "auto":
        device = _device_of(args)
        candidates = _AUTO_PRIORITY.get(device.type if device is not None else "", _DEFAULT_PRIORITY)
    else:
        candidates = (BACKENDS[requested],)
    skipped: list[tuple[str, list[str]]] = []
    for backend in candidates:
        if requested != "auto" and op not in backend.ops:
            return REFERENCE, [(backend.name, [f"{backend.name} has no {op} kernel; the reference serves it"])]
        reasons = backend.not_supported_reasons(op, args, kwargs)
        if not reasons:
            return backend, skipped
        if requested != "auto":
            raise NotImplementedError(
                f"mla.{op}: backend {backend.name!r} was requested (MLA_OPS_BACKEND / mla_ops.config) but "
                f"cannot serve this call: {'; '.join(reasons)}. Use MLA_OPS_BACKEND=auto to fall back.")
        skipped.append((backend.name, reasons))
    return REFERENCE, skipped


def make_dispatcher(op: str) -> Callable:
    """The kernel registered for a device key: picks a backend per call, runs its kernel."""
    reference = REFERENCE.kernels()[op]

    def dispatch(*args: Any, **kwargs: Any):
        if settings.backend in ("auto", "reference") and _device_of(args).type == "cpu":
            return reference(*args, **kwargs)  # hot path: nothing else serves CPU automatically
        backend, skipped = choose(op, args, kwargs)
        _last_choice[op] = (backend.name, skipped)
        return backend.kernels()[op](*args, **kwargs)

    dispatch.__name__ = f"mla_{op}_dispatch"
    return dispatch


def last_choice(op: str) -> Optional[tuple[str, list[tuple[str, list[str]]]]]:
    """(backend, skipped-with-reasons) of the last non-trivial dispatch of `op`, or None."""
    return _last_choice.get(op)


def explain(op: str, *args: Any, **kwargs: Any) -> str:
    """Which backend would run `torch.ops.mla.<op>(*args, **kwargs)` now, and why not the others."""
    try:
        backend, skipped = choose(op, args, kwargs)
    except NotImplementedError as exc:
        return str(exc)
    lines = [f"mla.{op}: {backend.name} ({backend.description})"]
    lines += [f"  not {name}: {'; '.join(reasons)}" for name, reasons in skipped]
    return "\n".join(lines)


def availability_report() -> list[tuple[str, str, str]]:
    """(backend, ops, 'available' | 'unavailable: reason') for `mla-ops info`."""
    rows = []
    for backend in BACKENDS.values():
        reason = backend.unavailable_reason()
        rows.append((backend.name, ", ".join(backend.ops), "available" if not reason else f"unavailable: {reason}"))
    return rows
