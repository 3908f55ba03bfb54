"""The `pypto_sim` backend: the PyPTO kernels run on CPU by pypto's simulator (ARCHITECTURE §4).

Stage 1 of kv_prolog (kv_a projection, split, RMSNorm) runs with the torch reference ops, as the
NPU path runs it with torch_npu's; stage 2 (kv_b projection, split, RoPE, assemble) and the paged
cache ops run as PyPTO kernels in SIM mode with pass verification, which computes their real
outputs on the CPU and reports the simulated AICore time (`mla_ops.ops.pypto.sim.last_result()`).
"""
from __future__ import annotations

import importlib.metadata
from typing import Optional

from .._optional import has_module

SUPPORTED_PYPTO_VERSION = "0.2.0"


def unavailable_reason() -> Optional[str]:
    """Why the simulator cannot run here (None when it can); imports nothing heavy."""
    if not has_module("pypto"):
        return f"pypto is not installed (pip install pypto=={SUPPORTED_PYPTO_VERSION})"
    version = importlib.metadata.version("pypto")
    if version != SUPPORTED_PYPTO_VERSION:
        return (f"pypto {version} is installed; the CPU simulation fix is only valid for pypto "
                f"{SUPPORTED_PYPTO_VERSION}")
    return None
