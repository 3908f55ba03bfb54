"""Backends: which kernel serves each `mla::` op on each device, and why not the others.

A backend is a set of kernels for some device types. It declares each kernel where it defines it,
with the `@backend.kernel(op)` decorator, optionally with a function that says, in words, why the
kernel cannot serve a particular call (`reasons=`: only what that backend cares about — a dtype
subset, tile limits, a missing package; shapes and ranks are the op's own check, which runs first
whatever the backend, so a bad call gets the same message everywhere).

Backends (modules of this package):
* ``reference`` — the torch kernels of `mla_ops.ops`; any device; the ground truth.
* ``cpu_native`` — C++ kernels for the CPU (`mla_ops/csrc/cpu`), built with the package; the
  automatic choice on CPU where a build imports.
* ``pypto_sim`` — the PyPTO kernels run on CPU by pypto's simulator (opt-in: tests, kernel work).
* ``npu`` — Ascend NPU: torch_npu ops + PyPTO kernels, on PrivateUse1.

Choosing (`MLA_OPS_BACKEND` / `mla_ops.settings.set_backend`):
* ``auto``: per device type, the first backend of `auto_priority(device_type)` (the backends that
  declare an `auto_priority`, then the reference) that serves the call; a backend that cannot serve a
  call is skipped and `explain(op, *args)` says why.
* an explicit backend: a demand for the ops it declares — a call it cannot serve fails with its
  reasons instead of falling back; ops it has no kernel for keep the automatic choice.

The choice is made once per (op, device type, setting), not per call: `bind()` attaches, for each
op and dispatch key, either the chosen kernel itself or — when the first candidate has reasons that
depend on the inputs — a small chooser walking the candidates. It runs at import and again whenever
the setting changes. The reference kernels sit on CompositeExplicitAutograd (see `mla_ops._library`)
and serve every device nothing else is bound for.

A backend with C++ kernels can register them on the dispatcher itself (`Backend(cpu_registrar=...)`,
the ``cpu_native`` backend): when it is the first choice for an op on CPU and only the reference
kernel comes after it, `bind()` hands it the op, and `torch.ops.mla.<op>` on CPU tensors then runs no
Python at all — the C++ kernel checks the arguments (the same messages as the Python checks), asks
its own reasons, and hands a call it cannot serve to the reference kernel (automatic choice) or
refuses it with the message below (a demand).
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
from .._library import NAMESPACE, OPS, checked_kernel
from ..settings import settings

# Device types the backend layer binds kernels for, and their dispatch keys.
DISPATCH_KEYS = {"cpu": "CPU", "npu": "PrivateUse1"}


@dataclasses.dataclass(frozen=True)
class Kernel:
    fn: Callable
    reasons: Optional[Callable] = None  # (*args, **kwargs) -> list[str]; memoised per call signature
    path: Optional[Callable] = None     # (*args, **kwargs) -> str: which of the kernel's own paths runs
    checks_arguments: bool = False      # fn runs the op's metadata check itself (in C++): not again before it


class CpuRegistrar(Protocol):
    """What a backend with C++ kernels offers `bind()` (the native extension module is one):

    * ``dispatcher_ops() -> list[str]``: the ops it can serve from the dispatcher;
    * ``bind(requests)``: register, for each ``OpRequest(op, demand, refusal_head, refusal_tail)``, a
      CPU kernel (checks, reasons, kernel; a call it cannot serve goes to the reference kernel, or with
      ``demand`` raises NotImplementedError(refusal_head + "; ".join(reasons) + refusal_tail)) and an
      AutogradCPU kernel (no input needs a gradient: straight to it; else the op's own Autograd
      kernel). Replaces its earlier binding;
    * ``unbind()``; ``registration_file() -> str`` (what the dispatcher records as their source);
    * ``OpRequest``: the request type.
    """

    OpRequest: type

    def dispatcher_ops(self) -> list[str]: ...

    def bind(self, requests: list) -> None: ...

    def unbind(self) -> None: ...

    def registration_file(self) -> str: ...


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
        cpu_registrar: () -> a `CpuRegistrar` (or None when unavailable): C++ kernels the backend
            registers on the dispatcher itself for the ops it is the CPU choice of.
    """

    def __init__(self, name: str, description: str, device_types: tuple[str, ...],
                 unavailable: Callable[[], Optional[str]] = lambda: None, *, auto_priority: Optional[int] = None,
                 cpu_registrar: Optional[Callable[[], Optional[CpuRegistrar]]] = None):
        if name in BACKENDS:
            raise RuntimeError(f"backend {name!r} is defined twice")
        self.name = name
        self.description = description
        self.device_types = device_types
        self.auto_priority = auto_priority
        self.cpu_registrar = cpu_registrar
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


# ---------------------------------------------------------------------------------------- binding
_bound_lib: Optional[torch.library.Library] = None
_bound: dict[tuple[str, str], str] = {}  # (op, device type) -> what serves it, for reports
_registered: dict[tuple[str, str], str] = {}  # (op, dispatch key) -> the file that registered bind()'s kernel
_bound_registrars: list = []  # the CpuRegistrars holding registrations made by the last bind()


def _chooser(op: str, options: tuple[Backend, ...], demand: bool) -> Callable:
    """A kernel that picks the first of `options` (fixed at bind time) that can serve each call."""
    def choose_and_run(*args, **kwargs):
        backend, _ = _pick(op, options, demand, args, kwargs)
        return backend.kernels[op].fn(*args, **kwargs)

    choose_and_run.__name__ = f"mla_{op}_choose_{'_or_'.join(b.name for b in options)}"
    return choose_and_run


def _cpu_registrar(op: str, device_type: str, options: tuple[Backend, ...]):
    """The registrar of the first candidate when it can serve `op` from the dispatcher: C++ kernels on
    the CPU key, with nothing but the reference kernel (its fallback) after it."""
    first = options[0]
    if DISPATCH_KEYS[device_type] != "CPU" or first.cpu_registrar is None or options[1:] not in ((), (REFERENCE,)):
        return None
    registrar = first.cpu_registrar()
    return registrar if registrar is not None and op in registrar.dispatcher_ops() else None


def bind() -> None:
    """(Re)attach the chosen kernels for every op and device type under the current setting."""
    global _bound_lib
    _sync_reference_kernels()
    if _bound_lib is not None:
        _bound_lib._destroy()
    for registrar in _bound_registrars:
        registrar.unbind()
    _bound_registrars.clear()
    _bound_lib = torch.library.Library(NAMESPACE, "IMPL")
    _bound.clear()
    _registered.clear()
    requests: dict[Any, list] = {}
    for name, op in OPS.items():
        for device_type, key in DISPATCH_KEYS.items():
            options = candidates(name, device_type)
            if not options or options == (REFERENCE,):
                _bound[(name, device_type)] = "reference"
                continue  # CompositeExplicitAutograd serves it
            first = options[0]
            demand = _is_demand(name, settings.backend)
            registrar = _cpu_registrar(name, device_type, options)
            if registrar is not None:
                head, tail = refusal(name, first.name, "\0").split("\0")
                requests.setdefault(registrar, []).append(registrar.OpRequest(name, demand, head, tail))
                falls_back = first.kernels[name].reasons is not None  # call-dependent reasons: the reference
                _bound[(name, device_type)] = " or ".join(b.name for b in options) if falls_back else first.name
                continue
            # the first candidate takes every call it can be asked (no call-dependent reasons): bind it
            direct = (first.kernels[name].reasons is None and first.serves_device(device_type)
                      and not first.unavailable_reason())
            if direct:
                kernel, label, checked = first.kernels[name].fn, first.name, first.kernels[name].checks_arguments
            else:
                kernel = _chooser(name, options, demand)
                label, checked = " or ".join(b.name for b in options), False
            _bound_lib.impl(name, kernel if checked else checked_kernel(op, kernel, f"mla_{name}_{device_type}"), key)
            _bound[(name, device_type)] = label
            _registered[(name, key)] = __file__
    for registrar, ops in requests.items():
        registrar.bind(ops)
        _bound_registrars.append(registrar)
        for request in ops:
            for key in ("CPU", "AutogradCPU"):
                _registered[(request.op, key)] = registrar.registration_file()


def bound_registrations(op: str) -> dict[str, str]:
    """dispatch key -> the file that registered the kernel `bind()` attached for `op` there (the
    backend layer's Python Library, or a backend's C++ registration), for the binding tests."""
    return {key: source for (name, key), source in _registered.items() if name == op}


def bound_report() -> list[tuple[str, str, str]]:
    """(op, device type, what serves it) under the current setting, for `mla-ops info`."""
    return [(op, device_type, label) for (op, device_type), label in sorted(_bound.items())]


def availability_report() -> list[tuple[str, str, str]]:
    """(backend, ops, 'available' | 'unavailable: reason') for `mla-ops info`."""
    _sync_reference_kernels()
    rows = []
    for backend in BACKENDS.values():
        reason = backend.unavailable_reason()
        rows.append((backend.name, ", ".join(sorted(backend.kernels)),
                     "available" if not reason else f"unavailable: {reason}"))
    return rows


_settings_module.on_backend_change(bind)

__all__ = ["Backend", "Kernel", "CpuRegistrar", "BACKENDS", "REFERENCE", "auto_priority", "candidates", "choose",
           "explain", "refusal", "bind", "bound_report", "bound_registrations", "availability_report"]
