"""Registration: every `mla::` schema, and which kernel serves which dispatch key (ARCHITECTURE §4).

| dispatch key                | kernel                                                              |
|-----------------------------|---------------------------------------------------------------------|
| CompositeExplicitAutograd   | `mla_ops.ops.reference`: every device, CPU included, for every op    |
|                             | without a more specific kernel below                                 |
| CPU                         | the backend dispatcher, for the ops pypto_sim can serve only          |
|                             | (`CPU_DISPATCHED_OPS`; reference unless MLA_OPS_BACKEND=pypto_sim)    |
| Meta / fake                 | `mla_ops.meta_kernels`                                               |
| Autograd                    | backward formulas (4 ops); a clear refusal for the inference-only 4  |
| PrivateUse1 (Ascend NPU)    | the backend dispatcher for the ops the `npu` backend declares, once  |
|                             | torch_npu is imported (`register_npu()`)                             |

`register_all()` is idempotent; `import mla_ops` calls it once.
"""
from __future__ import annotations

import sys

import torch

from ..backends import PYPTO_SIM, make_dispatcher
from ..meta_kernels import FAKE_KERNELS
from ..ops.reference import REFERENCE_KERNELS
from ..ops.reference.kv_prolog import (
    kv_prolog_backward,
    kv_prolog_setup_context,
    latent_kv_prolog_backward,
    latent_kv_prolog_setup_context,
)
from ..ops.reference.rms_norm import rms_norm_autograd_backward, rms_norm_setup_context
from ..ops.reference.rope import rope_autograd_backward, rope_setup_context
from .library import NAMESPACE, lib
from .schemas import ALL_SCHEMAS

AUTOGRAD_FORMULAS = {
    "rms_norm": (rms_norm_autograd_backward, rms_norm_setup_context),
    "rope": (rope_autograd_backward, rope_setup_context),
    "kv_prolog": (kv_prolog_backward, kv_prolog_setup_context),
    "latent_kv_prolog": (latent_kv_prolog_backward, latent_kv_prolog_setup_context),
}
# §3.7: the ops with a backward; the others are inference-only and refuse gradients clearly.
DIFFERENTIABLE_OPS = tuple(AUTOGRAD_FORMULAS)
INFERENCE_ONLY_OPS = tuple(op for op in ALL_SCHEMAS if op not in DIFFERENTIABLE_OPS)
# Ops whose CPU calls go through the backend dispatcher (pypto_sim can serve them on CPU).
CPU_DISPATCHED_OPS = PYPTO_SIM.ops

_registered = False


def _flat_tensors(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value


def _inference_only_kernel(op_name: str):
    """Autograd-key kernel: refuse gradients with a clear message, else run below autograd.

    Also bumps the version counter of the arguments the op writes (what custom_op's
    ADInplaceOrView kernel does), so autograd notices a cache modified after being saved.
    """
    overload = getattr(getattr(torch.ops, NAMESPACE), op_name).default
    mutated = [i for i, a in enumerate(overload._schema.arguments) if a.alias_info and a.alias_info.is_write]

    def kernel(*args, **kwargs):
        if torch.is_grad_enabled() and any(t.requires_grad for t in _flat_tensors(args, kwargs)):
            raise RuntimeError(
                f"mla.{op_name} is inference-only and has no backward: call it under torch.no_grad() / "
                f"torch.inference_mode(), or .detach() its inputs. Differentiable mla ops: "
                f"{', '.join(DIFFERENTIABLE_OPS)}.")
        with torch._C._AutoDispatchBelowAutograd():
            result = overload(*args, **kwargs)
        for i in mutated:
            if i < len(args) and isinstance(args[i], torch.Tensor):
                torch.autograd.graph.increment_version(args[i])
        return result

    kernel.__name__ = f"mla_{op_name}_inference_only"
    return kernel


def register_all() -> None:
    """Define every schema and attach every kernel, fake and autograd formula (idempotent)."""
    global _registered
    if _registered:
        return
    for name, schema in ALL_SCHEMAS.items():
        lib.define(schema)
    for name, kernel in REFERENCE_KERNELS.items():
        lib.impl(name, kernel, "CompositeExplicitAutograd")
    for name in CPU_DISPATCHED_OPS:
        lib.impl(name, make_dispatcher(name), "CPU")
    for name, fake in FAKE_KERNELS.items():
        lib._register_fake(name, fake)
    for name, (backward, setup_context) in AUTOGRAD_FORMULAS.items():
        torch.library.register_autograd(f"{NAMESPACE}::{name}", backward, setup_context=setup_context, lib=lib)
    for name in INFERENCE_ONLY_OPS:
        lib.impl(name, _inference_only_kernel(name), "Autograd")
    _registered = True
    if "torch_npu" in sys.modules:  # already imported (e.g. by torch's device autoload): add NPU kernels
        register_npu()


def register_npu() -> bool:
    """Attach the Ascend (PrivateUse1) kernels. Imports torch_npu; call after `import torch_npu`.

    Returns False (and changes nothing) when torch_npu cannot be used on this machine.
    """
    from ..ops import npu

    return npu.register(lib)
