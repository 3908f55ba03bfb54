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
    from ..backends import cpu_native

    if cpu_native.unavailable_reason() is None:
        print(f"{'native CPU kernels':<26}{cpu_native.isa()} build (this CPU runs: "
              f"{', '.join(cpu_native.available_isas())}; {cpu_native.ENV_ISA} picks one)")
    print("\nbackends")
    for name, ops, status in backends.availability_report():
        print(f"  {name:<12}{status}")
        print(f"  {'':<12}ops: {ops}")
    print("\nwho serves each op (device type: backend)")
    rows: dict[str, list[str]] = {}
    for op, device_type, label in backends.serving_report():
        rows.setdefault(op, []).append(f"{device_type}: {label}")
    for op, cells in rows.items():
        print(f"  {op:<32}{'   '.join(cells)}")
    _print_mla_families()


def _print_mla_families() -> None:
    """The MLA model families the installed transformers provides, and whether the patch serves them."""
    from .._optional import has_module

    if not has_module("transformers"):
        return
    from ..integrations.transformers import families, shared_kv

    print("\ntransformers MLA families (mla_ops.patch(model) patches the supported ones)")
    for model_type in families.installed_mla_model_types() + shared_kv.installed_shared_kv_model_types():
        try:
            described = families.families_of(model_type)
        except Exception as exc:  # a modeling module that does not import here (a missing optional package)
            print(f"  {model_type:<18}not importable here ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})")
            continue
        for family in described:
            status = "supported" if family.refused is None else f"refused: {family.refused}"
            if family.model_type != model_type:  # built from another family's classes
                status += f" (the {family.model_type} attention)"
            layout = family.rope if family.rope != "config" else "config.rope_interleave"
            print(f"  {model_type:<18}{family.attention.__name__:<30}rope {layout:<24}{status}")
