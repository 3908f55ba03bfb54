"""Runtime configuration: which backend serves the ops, and the NPU dispatch policy.

Settings are read once from the environment at import and can be changed at run time:

===============================  =========  ====================================================
environment variable             default    meaning
===============================  =========  ====================================================
``MLA_OPS_BACKEND``              ``auto``   ``auto`` or a backend's name: ``reference``, ``cpu_native``,
                                            ``pypto_sim``, ``npu`` (``mla_ops.backends.BACKENDS``)
``MLA_OPS_NPU_FUSED_MAX_TOKENS`` ``16``     NPU ``kv_prolog``: token counts (B*S) up to this use
                                            the fused PyPTO stage-2 kernel, larger ones the
                                            torch_npu baseline composite
``MLA_OPS_NPU_WARMUP_TOKENS``    ``1,2``    token counts compiled ahead by ``mla_ops.backends.npu.warmup``
===============================  =========  ====================================================

``auto`` picks the best available backend per device (the native C++ kernels for CPU tensors where the
extension imports, NPU kernels for NPU tensors, the torch reference kernels for everything else);
``mla_ops.explain(op, *args)`` says why it skipped the others. An explicit
backend is a demand for the ops it declares: a call it cannot serve fails with the reasons, it
does not fall back silently; ops it has no kernel for keep the automatic choice. ``pypto_sim`` runs
the PyPTO kernels through pypto's CPU simulator: about a second per call, meant for tests, kernel
work and ``mla-ops bench npu-sim``, never a default.

The backend is one setting of the whole process, read by every call (``mla_ops.backends.apply_setting``
makes a change take effect: it registers nothing, so a graph compiled earlier serves its later calls
under the setting of that moment). ``use_backend`` changes it for the duration of a block, for every
thread: it is meant for scripts and tests, not for serving two backends at once.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Callable, Iterator, Optional

# The names a backend setting may take: "auto" and every backend's name. The backend layer supplies
# them when it has defined its backends (`declare_backend_names`), so adding a backend module is all a
# new backend needs; the environment variable is validated then, at `import mla_ops`.
_backend_names: Callable[[], tuple[str, ...]] = lambda: ()  # noqa: E731


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; unset it or set e.g. {name}={default}") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r} must be >= 0")
    return value


def _env_int_tuple(name: str, default: tuple[int, ...]) -> tuple[int, ...]:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        values = tuple(int(part) for part in raw.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be a comma-separated list of integers, e.g. '1,2'") from None
    if any(v <= 0 for v in values):
        raise ValueError(f"{name}={raw!r}: token counts must be positive")
    return values


def backend_names() -> tuple[str, ...]:
    """"auto" and the name of every backend."""
    return ("auto",) + tuple(_backend_names())


def _check_backend(name: str, source: str = "set_backend") -> str:
    if name not in backend_names():
        raise ValueError(f"{source}: unknown mla_ops backend {name!r}; choose one of {', '.join(backend_names())}")
    return name


def declare_backend_names(names: Callable[[], tuple[str, ...]]) -> None:
    """Called by the backend layer once its backends exist: validates MLA_OPS_BACKEND against them."""
    global _backend_names
    _backend_names = names
    _check_backend(settings.backend, "MLA_OPS_BACKEND")


@dataclasses.dataclass
class Config:
    """The process-wide settings (one instance: ``mla_ops.settings.settings``)."""

    backend: str = "auto"  # change it with set_backend / use_backend
    npu_fused_max_tokens: int = 16
    npu_warmup_tokens: tuple[int, ...] = (1, 2)

    @classmethod
    def from_env(cls) -> "Config":
        return cls(
            backend=os.environ.get("MLA_OPS_BACKEND", "auto") or "auto",  # validated by declare_backend_names
            npu_fused_max_tokens=_env_int("MLA_OPS_NPU_FUSED_MAX_TOKENS", cls.npu_fused_max_tokens),
            npu_warmup_tokens=_env_int_tuple("MLA_OPS_NPU_WARMUP_TOKENS", cls.npu_warmup_tokens),
        )


settings = Config.from_env()
_backend_listeners: list[Callable[[], None]] = []


def on_backend_change(listener: Callable[[], None]) -> None:
    """Call `listener()` after every backend change (the backend layer applies it)."""
    _backend_listeners.append(listener)


def set_backend(name: str) -> None:
    """Select the backend for every later op call ("auto" or a backend's name, see `backend_names()`)."""
    settings.backend = _check_backend(name)
    for listener in _backend_listeners:
        listener()


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Context manager form of :func:`set_backend`; restores the previous backend on exit."""
    previous = settings.backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


@contextlib.contextmanager
def environment_variable(name: str, value: Optional[str]) -> Iterator[None]:
    """Set (or, with None, unset) the environment variable `name` inside the block; restored on exit."""
    previous = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous
