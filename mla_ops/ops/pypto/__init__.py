"""PyPTO kernels of mla_ops (pypto==0.2.0) and their CPU simulation harness.

Importing this package does not import pypto (nor torch_npu); only ``importlib.util.find_spec``
and the installed distribution's metadata are consulted by :func:`is_available`. The public
functions are resolved lazily from their modules on first access:

* ``kv_prolog_stage2`` / ``kv_prolog_stage2_not_supported_reasons``  (kv_prolog_stage2.py)
* ``gather_pa_kv_cache`` / ``select_gather_tile_config`` / ``GatherTileConfig``  (gather_pa_kv_cache.py)
* ``scatter_pa_kv_cache``  (scatter_pa_kv_cache.py)
* ``sim``: the simulation harness (``SimResult``, ``last_result()``, ``ensure_supported()``)
"""

import importlib
from typing import List

_LAZY = {
    "SUPPORTED_PYPTO_VERSION": "sim",
    "kv_prolog_stage2": "kv_prolog_stage2",
    "kv_prolog_stage2_not_supported_reasons": "kv_prolog_stage2",
    "Stage2Config": "kv_prolog_stage2",
    "gather_pa_kv_cache": "gather_pa_kv_cache",
    "gather_pa_kv_cache_not_supported_reasons": "gather_pa_kv_cache",
    "select_gather_tile_config": "gather_pa_kv_cache",
    "GatherTileConfig": "gather_pa_kv_cache",
    "scatter_pa_kv_cache": "scatter_pa_kv_cache",
    "scatter_pa_kv_cache_not_supported_reasons": "scatter_pa_kv_cache",
    "SimResult": "sim",
    "SimVerificationError": "sim",
    "last_result": "sim",
    "ensure_supported": "sim",
}

__all__ = ["is_available", "unavailable_reasons", "sim", *_LAZY]


def unavailable_reasons() -> List[str]:
    """Why the PyPTO kernels cannot run here (empty list = they can); does not import pypto."""
    from . import sim
    return sim.unsupported_reasons()


def is_available() -> bool:
    """True when pypto is importable and its version is exactly 0.2.0 (does not import pypto)."""
    return not unavailable_reasons()


def __getattr__(name):
    if name == "sim":
        return importlib.import_module(f"{__name__}.sim")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__():
    return sorted(set(globals()) | set(__all__))
