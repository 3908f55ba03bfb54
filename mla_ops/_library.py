"""The `mla` operator library: one `torch.library.Library` object and one `OpDef` per operator.

Each op module in `mla_ops/ops/` describes its operator once, with `define_op(...)`:

    RMS_NORM = define_op(
        "rms_norm(Tensor x, Tensor weight, float eps=1e-06) -> Tensor",
        check=check_rms_norm_args,        # metadata check (torch._check), shared by eager and fake
        fake=_rms_norm_fake,              # shapes/dtypes/strides of the outputs, for tracing
        reference=rms_norm_reference,     # torch ops, any device: the ground truth
        autograd=(backward, setup_context),
    )

and `define_op` makes every registration from that record: the schema, the fake kernel, the
reference kernel on `CompositeExplicitAutograd` (every device without a more specific kernel), and
either the backward formula or an `Autograd` kernel that refuses gradients for inference-only ops.
`OPS` (name -> OpDef) is filled as the op modules are imported; every other table (the reference
backend's kernels, the list of differentiable ops, `mla-ops info`) is derived from it.

Every eager kernel runs behind the op's own metadata check (`checked_kernel`), so a wrong shape gets
the same message whichever backend serves the call. The CompositeExplicitAutograd kernel hands each
call to the backend layer (`mla_ops.backends`, through `route_composite_calls`), which picks the
backend the setting chooses for the call's device — the reference kernel until it is installed;
native extensions register kernels for specific dispatch keys statically (the CPU key: see
`mla_ops.backends.cpu_native`). Nothing is registered after import, and nothing else defines an
`mla::` schema.

The Library must stay alive for the whole process: an op's registrations live as long as the
Library object that made them. Plain `Library` calls are used rather than the
`torch.library.custom_op` decorator, whose Python wrapper costs ~25 us per call (a tenth of a
decode-step kv_prolog on CPU).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

NAMESPACE = "mla"

lib = torch.library.Library(NAMESPACE, "DEF")


@dataclasses.dataclass(frozen=True)
class OpDef:
    """Everything that makes one `mla::` operator."""

    name: str
    schema: str
    check: Callable  # check(*args, **kwargs): raises a clear error for bad metadata; no host sync
    fake: Callable  # registered with torch.library.register_fake
    reference: Callable  # the torch kernel (unchecked math; `checked_kernel` adds the check)
    backward: Optional[Callable] = None  # torch.library.register_autograd formula, or None:
    setup_context: Optional[Callable] = None  # inference-only

    @property
    def differentiable(self) -> bool:
        return self.backward is not None

    @property
    def overload(self) -> torch._ops.OpOverload:
        return getattr(getattr(torch.ops, NAMESPACE), self.name).default

    @property
    def mutated_args(self) -> tuple[str, ...]:
        """Names of the arguments the op writes in place (`Tensor(a!)` in the schema)."""
        return tuple(a.name for a in self.overload._schema.arguments if a.alias_info and a.alias_info.is_write)


OPS: dict[str, OpDef] = {}


def checked_kernel(op: OpDef, kernel: Callable, name: str) -> Callable:
    """`kernel` behind the op's metadata check: what every eager registration of the op runs."""
    check = op.check

    def run(*args, **kwargs):
        check(*args, **kwargs)
        return kernel(*args, **kwargs)

    run.__name__ = run.__qualname__ = name
    run.__doc__ = kernel.__doc__
    run.__wrapped__ = kernel
    return run


def define_op(schema: str, *, check: Callable, fake: Callable, reference: Callable,
              autograd: Optional[tuple[Callable, Callable]] = None) -> OpDef:
    """Define `mla::<schema>` and register its fake, reference kernel and autograd behaviour."""
    name = schema.split("(", 1)[0].strip()
    if name in OPS:
        raise RuntimeError(f"mla.{name} is defined twice")
    backward, setup_context = autograd if autograd is not None else (None, None)
    op = OpDef(name, schema, check, fake, reference, backward, setup_context)
    lib.define(schema)
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=lib)
    lib.impl(name, _composite_kernel(op), "CompositeExplicitAutograd")
    if op.differentiable:
        torch.library.register_autograd(f"{NAMESPACE}::{name}", backward, setup_context=setup_context, lib=lib)
    else:
        lib.impl(name, _inference_only_kernel(op), "Autograd")
    OPS[name] = op
    return op


# (op name, args, kwargs) -> the result: the backend layer's choice among the backends (installed once,
# at import, by `route_composite_calls`); None: the reference kernel serves every call.
_composite_router: Optional[Callable] = None


def route_composite_calls(router: Callable) -> None:
    """Have `router(op_name, args, kwargs)` serve every call that reaches an op's CompositeExplicitAutograd
    kernel (every device without a more specific kernel, and the CPU kernels' hand-offs)."""
    global _composite_router
    _composite_router = router


def _composite_kernel(op: OpDef) -> Callable:
    reference = checked_kernel(op, op.reference, f"mla_{op.name}_reference")
    name = op.name

    def serve(*args, **kwargs):
        if _composite_router is None:
            return reference(*args, **kwargs)
        return _composite_router(name, args, kwargs)

    serve.__name__ = serve.__qualname__ = f"mla_{name}_composite"
    return serve


def differentiable_ops() -> tuple[str, ...]:
    return tuple(name for name, op in OPS.items() if op.differentiable)


def _flat_tensors(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value


def _inference_only_kernel(op: OpDef) -> Callable:
    """Autograd-key kernel: refuse gradients with a clear message, else run below autograd.

    Also bumps the version counter of the arguments the op writes (what custom_op's
    ADInplaceOrView kernel does), so autograd notices a cache modified after being saved.
    """
    overload = op.overload
    mutated = [i for i, a in enumerate(overload._schema.arguments) if a.alias_info and a.alias_info.is_write]

    def kernel(*args, **kwargs):
        if torch.is_grad_enabled() and any(t.requires_grad for t in _flat_tensors(args, kwargs)):
            raise RuntimeError(
                f"mla.{op.name} is inference-only and has no backward: call it under torch.no_grad() / "
                f"torch.inference_mode(), or .detach() its inputs. Differentiable mla ops: "
                f"{', '.join(differentiable_ops())}.")
        with torch._C._AutoDispatchBelowAutograd():
            result = overload(*args, **kwargs)
        for i in mutated:
            if i < len(args) and isinstance(args[i], torch.Tensor):
                torch.autograd.graph.increment_version(args[i])
        return result

    kernel.__name__ = f"mla_{op.name}_inference_only"
    return kernel
