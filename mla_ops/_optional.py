"""Probes for heavy optional packages, without importing them.

`import mla_ops` must work on a machine that has none of torch_npu, torchair, pypto or matplotlib,
and must not initialise any device. Everything here answers "could it be imported?" with
`importlib.util.find_spec` (no import), except `torch_npu_usable()`, which really imports torch_npu
and is only called on the NPU registration path.
"""
from __future__ import annotations

import functools
import importlib.util


@functools.lru_cache(maxsize=None)
def has_module(name: str) -> bool:
    """True when `name` is installed (found by the import system); nothing is imported."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that fails to import, or a bad name
        return False


@functools.lru_cache(maxsize=None)
def torch_npu_usable() -> tuple[bool, str]:
    """(usable, reason). Imports torch_npu: call only when NPU support is actually wanted.

    torch_npu without the CANN toolkit fails at import (``libhccl.so`` missing); that is reported
    as a reason, never raised, so a CPU machine with a stray torch_npu wheel still works.
    """
    if not has_module("torch_npu"):
        return False, "torch_npu is not installed"
    try:
        import torch_npu  # noqa: F401
    except Exception as exc:  # ImportError for missing CANN libraries, RuntimeError from init
        return False, f"torch_npu is installed but cannot be imported ({type(exc).__name__}: {exc})"
    import torch

    if not (hasattr(torch, "npu") and torch.npu.is_available()):
        return False, "torch_npu imported but no NPU device is available"
    return True, ""
