"""`mla-ops info`: versions, the backends and which one serves each op on each device type."""
from __future__ import annotations

import platform


def package_version(module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    from .._optional import has_module

    if not has_module(module):
        return "not installed"
    try:
        return version(module.replace("_", "-")) if module != "torch_npu" else version("torch_npu")
    except PackageNotFoundError:
        return "installed"


def run(args=None) -> None:
    import torch

    from .. import backends
    from ..settings import settings

    print(f"{'python':<26}{platform.python_version()}")
    print(f"{'torch':<26}{torch.__version__}")
    for module in ("transformers", "pypto", "torch_npu", "torchair", "matplotlib"):
        print(f"{module:<26}{package_version(module)}")
    print(f"{'backend (MLA_OPS_BACKEND)':<26}{settings.backend}")
    print("\nbackends")
    for name, ops, status in backends.availability_report():
        print(f"  {name:<12}{status}")
        print(f"  {'':<12}ops: {ops}")
    print("\nwho serves each op (device type: backend)")
    rows: dict[str, list[str]] = {}
    for op, device_type, label in backends.bound_report():
        rows.setdefault(op, []).append(f"{device_type}: {label}")
    for op, cells in rows.items():
        print(f"  {op:<32}{'   '.join(cells)}")
