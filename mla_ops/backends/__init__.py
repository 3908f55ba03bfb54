"""Backends: which kernel serves each `mla::` op on each device, and why not the others.

A backend is a set of kernels for some device types. It declares each kernel where it defines it,
with the `@backend.kernel(op)` decorator, optionally with a function that says, in words, why the
kernel cannot serve a particular call (`reasons=`: only what that backend cares about — a dtype
subset, tile limits, a missing package; shapes and ranks are the op's own check, which runs first
whatever the backend, so a bad call gets the same message everywhere).

Backends (modules of this package):
* ``reference`` — the torch kernels of `mla_ops.ops`; any device; the ground truth.
* ``cpu_native`` — C++ kernels for the CPU (`mla_ops/csrc/cpu`), built with the package; the
  automatic choice on CPU where the extension imports.
* ``pypto_sim`` — the PyPTO kernels run on CPU by pypto's simulator (opt-in: tests, kernel work).
* ``npu`` — Ascend NPU: torch_npu ops + PyPTO kernels, on PrivateUse1.

Choosing (`MLA_OPS_BACKEND` / `mla_ops.settings.set_backend`):
* ``auto``: per device type, the first backend of `auto_priority(device_type)` (the backends that
  declare an `auto_priority`, then the reference) that serves the call; a backend that cannot serve a
  call is skipped and `explain(op, *args)` says why.
* an explicit backend: a demand for the ops it declares — a call it cannot serve fails with its
  reasons instead of falling back; ops it has no kernel for keep the automatic choice.

The setting is one process-wide value, read when a call is made (a graph compiled under one setting
calls whatever the setting is when it runs); changing it registers nothing. Calls reach the backends
two ways:
* a backend with C++ kernels registers them statically on the dispatcher's CPU key (``cpu_native``,
  `Backend(static_cpu_kernels=...)`); for each of its ops the backend layer sets a *route* in the
  extension: ``native`` (it is the automatic CPU choice: it serves what it can and hands the rest to
  the reference kernel), ``demanded`` (requested by name: it refuses what it cannot serve) or
  ``elsewhere`` (another backend is the choice: every call goes on). `torch.ops.mla.<op>` on CPU
  tensors then runs no Python when the native kernel serves it;
* everything else reaches the op's CompositeExplicitAutograd kernel (`mla_ops._library`), where
  `serve` picks, per (op, device type, setting) and cached, the first candidate that can serve the
  call: directly when it has no call-dependent reasons, else through a small chooser.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
from typing import Any, Callable, Optional, Protocol

import torch

from .. import settings as _settings_module
from .._checks import memo_by_signature
from .._library import OPS, checked_kernel, route_composite_calls
from ..settings import settings


@dataclasses.dataclass(frozen=True)
class Kernel:
    fn: Callable
    reasons: Optional[Callable] = None  # (*args, **kwargs) -> list[str]; memoised per call signature
    path: Optional[Callable] = None     # (*args, **kwargs) -> str: which of the kernel's own paths runs
    checks_arguments: bool = False      # fn runs the op's metadata check itself (in C++): not again before it


class StaticCpuKernels(Protocol):
    """What a backend with statically registered C++ CPU kernels offers the backend layer (the loaded
    native extension is one):

    * ``ops() -> list[str]``: the ops it registered on the CPU (and AutogradCPU) key;
    * ``set_route(op, route, refusal)``: route ``"native"``, ``"demanded"`` or ``"elsewhere"`` (see the
      module docstring); `refusal` is the NotImplementedError text of a demand it cannot serve, with
      ``{reasons}`` standing for its reasons.
    """

    def ops(self) -> list[str]: ...

    def set_route(self, op: str, route: str, refusal: str) -> None: ...


class Backend:
    """A named set of kernels for some device types.

    Args:
        name: what `MLA_OPS_BACKEND` calls it.
        description: one line for `mla-ops info` and `explain()`.
        device_types: the device types it serves (`"*"`: any).
        unavailable: () -> reason it cannot run on this machine at all, or None. Must not import
            heavy packages (probe with find_spec); the answer is cached.
        auto_priority: its rank in the automatic choice on its device types (lower is tried first);
            None: it serves only when requested by name. The reference kernels always come last.
        static_cpu_kernels: () -> its `StaticCpuKernels` (None while unavailable): C++ kernels registered
            statically on the CPU key for its ops, routed by the backend layer. Such a backend is tried
            before any other on CPU (its `auto_priority` must rank first), since its kernels see every
            CPU call first.
    """

    def __init__(self, name: str, description: str, device_types: tuple[str, ...],
                 unavailable: Callable[[], Optional[str]] = lambda: None, *, auto_priority: Optional[int] = None,
                 static_cpu_kernels: Optional[Callable[[], Optional[StaticCpuKernels]]] = None):
        if name in BACKENDS:
            raise RuntimeError(f"backend {name!r} is defined twice")
        self.name = name
        self.description = description
        self.device_types = device_types
        self.auto_priority = auto_priority
        self.static_cpu_kernels = static_cpu_kernels
        self._unavailable = functools.lru_cache(maxsize=None)(unavailable)
        self.kernels: dict[str, Kernel] = {}
        BACKENDS[name] = self

    def kernel(self, op: str, *, reasons: Optional[Callable] = None, memoize: bool = True,
               path: Optional[Callable] = None, checks_arguments: bool = False):
        """Decorator: `fn` is this backend's kernel for `mla::<op>` (same signature as the op).

        `reasons(*args, **kwargs) -> list[str]`: why the kernel cannot serve a call (the backend layer
        then falls back to the next candidate); cached per call signature unless `memoize=False` (for
        reasons cheaper than building the key). `path`: for a kernel that chooses between paths of its
        own (the NPU kv_prolog: fused or baseline), a description of the one a call takes, for `explain()`.
        `checks_arguments`: `fn` runs the op's metadata check itself (a C++ kernel), so the backend layer
        does not run the Python one before it."""
        def register(fn: Callable) -> Callable:
            self.kernels[op] = Kernel(fn, memo_by_signature(reasons) if reasons and memoize else reasons, path,
                                      checks_arguments)
            return fn
        return register

    def unavailable_reason(self) -> Optional[str]:
        return self._unavailable()

    def serves_device(self, device_type: str) -> bool:
        return "*" in self.device_types or device_type in self.device_types

    def not_supported_reasons(self, op: str, *args: Any, **kwargs: Any) -> list[str]:
        """Readable reasons this backend cannot run `op` on these inputs (empty: it can)."""
        kernel = self.kernels.get(op)
        if kernel is None:
            return [f"{self.name} has no {op} kernel"]
        reason = self.unavailable_reason()
        if reason:
            return [reason]
        device = _device_of(args, kwargs)
        if device is not None and not self.serves_device(device.type):
            return [f"device={device.type} (supported: {', '.join(self.device_types)})"]
        return list(kernel.reasons(*args, **kwargs)) if kernel.reasons else []

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, ops={sorted(self.kernels)})"


BACKENDS: dict[str, Backend] = {}


def _device_of(args: tuple, kwargs: dict) -> Optional[torch.device]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return None


# ------------------------------------------------------------------------------------- backends
REFERENCE = Backend("reference", "torch ops; any device; the ground truth", ("*",))


def _import_backend_modules() -> None:
    """Every module of this package defines its backends (they register themselves in BACKENDS)."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_import_backend_modules()
_settings_module.declare_backend_names(lambda: tuple(BACKENDS))


def auto_priority(device_type: str) -> tuple[Backend, ...]:
    """The automatic choice on `device_type`, in order (the first backend that serves a call wins):
    the backends that declare an `auto_priority` for it, then the reference kernels."""
    ranked = sorted((b for b in BACKENDS.values() if b.auto_priority is not None and device_type in b.device_types),
                    key=lambda b: b.auto_priority)
    return (*ranked, REFERENCE)


def _sync_reference_kernels() -> None:
    """The reference backend's kernels are the ops' own reference kernels (derived, never listed)."""
    for name, op in OPS.items():
        if name not in REFERENCE.kernels:
            REFERENCE.kernels[name] = Kernel(op.reference)


def candidates(op: str, device_type: str, setting: Optional[str] = None) -> tuple[Backend, ...]:
    """The backends that may serve `op` on `device_type` under `setting`, in order of preference."""
    setting = setting or settings.backend
    if _is_demand(op, setting):
        return (BACKENDS[setting],)  # a demand: served by that backend or refused, never downgraded
    priority = auto_priority(device_type)
    return tuple(b for b in priority if op in b.kernels and b.serves_device(device_type)
                 and not b.unavailable_reason())


def _is_demand(op: str, setting: str) -> bool:
    return setting != "auto" and op in BACKENDS[setting].kernels


def refusal(op: str, backend: str, reasons: str) -> str:
    """The NotImplementedError text of a demanded backend that cannot serve a call (`reasons` joined)."""
    return (f"mla.{op}: backend {backend!r} was requested (MLA_OPS_BACKEND / mla_ops.settings) but "
            f"cannot serve this call: {reasons}. Use MLA_OPS_BACKEND=auto to fall back.")


def _pick(op: str, options: tuple[Backend, ...], demand: bool, args: tuple, kwargs: dict):
    """The first of `options` that serves this call -> (backend, [(skipped backend, reasons)])."""
    skipped: list[tuple[str, list[str]]] = []
    for backend in options:
        reasons = backend.not_supported_reasons(op, *args, **kwargs)
        if not reasons:
            return backend, skipped
        if demand:
            raise NotImplementedError(refusal(op, backend.name, "; ".join(reasons)))
        skipped.append((backend.name, reasons))
    return REFERENCE, skipped


def choose(op: str, *args: Any, **kwargs: Any) -> tuple[Backend, list[tuple[str, list[str]]]]:
    """-> (backend, [(skipped backend, reasons), ...]) for this call under the current setting.

    Raises NotImplementedError when an explicitly requested backend cannot serve the call."""
    device = _device_of(args, kwargs)
    options = candidates(op, device.type if device is not None else "cpu")
    return _pick(op, options, _is_demand(op, settings.backend), args, kwargs)


def explain(op: str, *args: Any, **kwargs: Any) -> str:
    """Which backend would run `torch.ops.mla.<op>(*args, **kwargs)` now, and why not the others.

    The op's own argument check runs first: a bad call is explained by its error message."""
    _sync_reference_kernels()
    OPS[op].check(*args, **kwargs)
    try:
        backend, skipped = choose(op, *args, **kwargs)
    except NotImplementedError as exc:
        return str(exc)
    lines = [f"mla.{op}: {backend.name} ({backend.description})"]
    kernel = backend.kernels.get(op)
    if kernel is not None and kernel.path is not None:
        lines.append(f"  path: {kernel.path(*args, **kwargs)}")
    lines += [f"  not {name}: {'; '.join(reasons)}" for name, reasons in skipped]
    device = _device_of(args, kwargs)
    if device is not None:
        for other in auto_priority(device.type):
            reason = other.unavailable_reason()
            if reason and op in other.kernels:
                lines.append(f"  not {other.name}: {reason}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- serving
DEVICE_TYPES = ("cpu", "npu")  # the device types `serving_report` describes

# (op, device type, setting) -> the kernel that serves such calls at the CompositeExplicitAutograd key
_plans: dict[tuple[str, str, str], Callable] = {}


def _chooser(op: str, options: tuple[Backend, ...], demand: bool) -> Callable:
    """A kernel that picks the first of `options` that can serve each call."""
    def choose_and_run(*args, **kwargs):
        backend, _ = _pick(op, options, demand, args, kwargs)
        return backend.kernels[op].fn(*args, **kwargs)

    choose_and_run.__name__ = f"mla_{op}_choose_{'_or_'.join(b.name for b in options)}"
    return choose_and_run


def _statically_served(backend: Backend, op: str, device_type: str) -> bool:
    """Whether `backend`'s C++ kernel for `op` sees calls on `device_type` before the composite kernel
    (so a call that gets there is one it declined or was routed past)."""
    if device_type != "cpu" or backend.static_cpu_kernels is None or backend.unavailable_reason():
        return False
    kernels = backend.static_cpu_kernels()
    return kernels is not None and op in kernels.ops()


def _plan(op: str, device_type: str) -> Callable:
    """The composite-key kernel for `op` on `device_type` under the current setting."""
    opdef = OPS[op]
    demand = _is_demand(op, settings.backend)
    options = tuple(b for b in candidates(op, device_type) if not _statically_served(b, op, device_type))
    if not options:
        options = (REFERENCE,)
    first = options[0]
    kernel = first.kernels[op]
    if kernel.reasons is None and first.serves_device(device_type) and not first.unavailable_reason():
        return kernel.fn if kernel.checks_arguments else checked_kernel(opdef, kernel.fn, f"mla_{op}_{first.name}")
    return checked_kernel(opdef, _chooser(op, options, demand), f"mla_{op}_{device_type}")


def serve(op: str, args: tuple, kwargs: dict) -> Any:
    """Serve a call that reached `mla::<op>`'s CompositeExplicitAutograd kernel."""
    device = _device_of(args, kwargs)
    key = (op, device.type if device is not None else "cpu", settings.backend)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _plan(op, key[1])
    return plan(*args, **kwargs)


def _route(backend: Backend, op: str) -> str:
    """The route of `backend`'s static CPU kernel for `op` under the current setting."""
    options = candidates(op, "cpu")
    if not options or options[0] is not backend or any(b is not REFERENCE for b in options[1:]):
        return "elsewhere"
    return "demanded" if _is_demand(op, settings.backend) else "native"


def apply_setting() -> None:
    """Make the backend setting take effect: set the static kernels' routes, forget the composite plans.
    Runs at import and after every change of the setting; registers nothing."""
    _sync_reference_kernels()
    _plans.clear()
    for backend in BACKENDS.values():
        kernels = backend.static_cpu_kernels() if backend.static_cpu_kernels is not None else None
        if kernels is None:
            continue
        for op in kernels.ops():
            kernels.set_route(op, _route(backend, op), refusal(op, backend.name, "{reasons}"))


def serving_report() -> list[tuple[str, str, str]]:
    """(op, device type, what serves it) under the current setting, for `mla-ops info`."""
    rows = []
    for op in sorted(OPS):
        for device_type in DEVICE_TYPES:
            options = candidates(op, device_type) or (REFERENCE,)
            first = options[0]
            kernel = first.kernels.get(op)
            falls_back = kernel is not None and kernel.reasons is not None and len(options) > 1
            label = " or ".join(b.name for b in options) if falls_back else first.name
            if _is_demand(op, settings.backend) and not first.serves_device(device_type):
                label = f"{first.name} (refused: device {device_type})"
            rows.append((op, device_type, label))
    return rows


def availability_report() -> list[tuple[str, str, str]]:
    """(backend, ops, 'available' | 'unavailable: reason') for `mla-ops info`."""
    _sync_reference_kernels()
    rows = []
    for backend in BACKENDS.values():
        reason = backend.unavailable_reason()
        rows.append((backend.name, ", ".join(sorted(backend.kernels)),
                     "available" if not reason else f"unavailable: {reason}"))
    return rows


route_composite_calls(serve)
_settings_module.on_backend_change(apply_setting)
apply_setting()

__all__ = ["Backend", "Kernel", "StaticCpuKernels", "BACKENDS", "REFERENCE", "auto_priority", "candidates", "choose",
           "explain", "refusal", "serve", "apply_setting", "serving_report", "availability_report"]
