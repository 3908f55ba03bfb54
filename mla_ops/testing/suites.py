"""Generic checks over the case database: each takes an op name and a `Sample` (or an `ErrorInput`)
and raises AssertionError with the details when the op breaks its contract.

They know nothing about any particular op: the test suite parametrizes them over `CASES`
(tests/test_cases.py) and `mla-ops selftest` runs `compare` on the device at hand.

* `call`: run an op (or one of its kernels) on a fresh copy of a sample; outputs + the tensors it writes.
* `compare`: a kernel variant against the oracle, within the op's bound for that backend and dtype.
* `run_opcheck`, `compiles_to_one_node`, `exports_to_one_node`, `gradcheck_or_refusal`: the PyTorch
  integration of the op (schema, fake, autograd registration, Dynamo, export).
* `raises_eagerly`, `raises_when_compiled`: bad inputs get the error naming the argument, before
  anything is written.
* `Variant`, `variants()`: every kernel that can serve an op here (reference, its other code paths,
  each native ISA build, the PyPTO simulator), each able to say why it cannot take a call.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from typing import Callable, ContextManager, Optional

import torch
from torch import Tensor

from .. import backends, settings
from .._library import OPS
from .cases import CASES, ErrorInput, Sample

OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


# -------------------------------------------------------------------------------------------- calls
def written_positions(op: str) -> list[int]:
    """Positions of the arguments `mla::<op>` writes in place (`Tensor(a!)` in its schema)."""
    return [i for i, a in enumerate(OPS[op].overload._schema.arguments) if a.alias_info and a.alias_info.is_write]


def outputs_of(result, args, written: list[int]) -> tuple[Tensor, ...]:
    """What a call produced: its returned tensors, then the arguments at `written` (schema order)."""
    outs = [] if result is None else list(result) if isinstance(result, (tuple, list)) else [result]
    return tuple(outs) + tuple(args[i] for i in written)


def call(op: str, sample: Sample, kernel: Optional[Callable] = None) -> tuple[Tensor, ...]:
    """Run `torch.ops.mla.<op>` (or `kernel`, with the op's calling convention, behind the op's own
    metadata check) on a fresh copy of `sample`."""
    fresh = sample.clone()
    if kernel is None:
        result = OPS[op].overload(*fresh.args, **fresh.kwargs)
    else:
        OPS[op].check(*fresh.args, **fresh.kwargs)
        result = kernel(*fresh.args, **fresh.kwargs)
    return outputs_of(result, fresh.args, written_positions(op))


def expected_metadata(op: str, sample: Sample) -> list[tuple[tuple, torch.dtype]]:
    """(shape, dtype) of each output, from the op's fake kernel on meta tensors."""
    return [(tuple(t.shape), t.dtype) for t in call(op, sample.to("meta"))]


def normalised_error(got: Tensor, want: Tensor) -> float:
    """max |got - want| / max |want| (0 for empty tensors; the absolute error when want is all zeros)."""
    if want.numel() == 0:
        return 0.0
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    diff = (got - want).abs().max().item()
    if math.isnan(diff):
        return math.inf
    scale = want.abs().max().item()
    return diff / scale if scale > 0 else diff


# ------------------------------------------------------------------------------------------ variants
@dataclasses.dataclass(frozen=True)
class Variant:
    """One kernel that can serve an op here.

    name: what reports show ("reference", "reference:sync-free", "cpu_native:avx2", "pypto_sim").
    backend: whose rounding bound applies (`OpCases.bound`).
    """

    name: str
    backend: str
    _reasons: Callable[[str, Sample], list[str]]
    _run: Callable[[str, Sample], tuple[Tensor, ...]]
    _has_kernel: Callable[[str], bool]
    # the context in which `torch.ops.mla.<op>` is served by this variant (None: it calls a kernel directly)
    serving: Optional[Callable[[], ContextManager]] = None

    def has_kernel(self, op: str) -> bool:
        """Whether the variant has code for `op` at all (what it can take is `not_supported_reasons`)."""
        return self._has_kernel(op)

    def not_supported_reasons(self, op: str, sample: Sample) -> list[str]:
        return self._reasons(op, sample)

    def run(self, op: str, sample: Sample) -> tuple[Tensor, ...]:
        return self._run(op, sample)


def backend_variant(name: str, *, label: Optional[str] = None, isa: Optional[str] = None) -> Variant:
    """`torch.ops.mla.<op>` with backend `name` requested explicitly (for the native kernels: their `isa` build)."""
    def reasons(op, sample):
        if isa is not None:
            from ..backends import cpu_native

            if isa not in cpu_native.available_isas():
                return [f"this CPU does not run the {isa} build of the native kernels"]
        return backends.BACKENDS[name].not_supported_reasons(op, *sample.args, **sample.kwargs)

    @contextlib.contextmanager
    def serving():
        from ..backends import cpu_native

        with cpu_native.use_isa(isa) if isa else contextlib.nullcontext(), settings.use_backend(name):
            yield

    def run(op, sample):
        with serving():
            return call(op, sample)

    return Variant(label or name, name, reasons, run, lambda op: op in backends.BACKENDS[name].kernels, serving)


def path_variant(path: str) -> Variant:
    """A reference-kernel code path other than CPU dispatch's (e.g. the sync-free device path), on CPU."""
    def reasons(op, sample):
        return [] if path in CASES[op].paths else [f"the {op} reference kernel has no {path} path"]

    def run(op, sample):
        return call(op, sample, CASES[op].paths[path])

    return Variant(f"reference:{path}", "reference", reasons, run, lambda op: path in CASES[op].paths)


def variants() -> list[Variant]:
    """Every kernel that can serve an op on this machine's CPU: each backend serving the CPU (derived
    from `BACKENDS`), the native one once per ISA build (`cpu_native.use_isa`), and the reference
    kernels' other code paths (`OpCases.paths`)."""
    from ..backends import cpu_native

    builds = {"cpu_native": cpu_native.ISAS}
    found = []
    for name, backend in backends.BACKENDS.items():
        if not backend.serves_device("cpu"):
            continue
        if name in builds:
            found += [backend_variant(name, label=f"{name}:{isa}", isa=isa) for isa in builds[name]]
        else:
            found.append(backend_variant(name))
        if backend is backends.REFERENCE:
            found += [path_variant(p) for p in sorted({p for c in CASES.values() for p in c.paths})]
    return found


def compare(variant: Variant, op: str, sample: Sample, dtype: torch.dtype) -> tuple[float, float]:
    """Run `variant` on `sample` and compare it with the oracle -> (normalised error, bound).

    Raises AssertionError on a wrong shape or dtype (against the op's fake kernel) or an error above
    the op's bound for the variant's backend."""
    got = variant.run(op, sample)
    cases = CASES[op]
    want = cases.oracle(*sample.args, **sample.kwargs)
    meta = expected_metadata(op, sample)
    assert len(got) == len(want) == len(meta), (len(got), len(want), len(meta))
    bound = cases.bound(variant.backend, dtype)
    got, want = cases.comparable(variant.backend, got), cases.comparable(variant.backend, want)
    worst = 0.0
    for i, (g, w, (shape, out_dtype)) in enumerate(zip(got, want, meta)):
        assert tuple(g.shape) == shape == tuple(w.shape), f"output {i}: shape {tuple(g.shape)}, expected {shape}"
        assert g.dtype == out_dtype, f"output {i}: dtype {g.dtype}, the fake kernel says {out_dtype}"
        if bound == 0:
            assert torch.equal(g.cpu(), w.to(g.dtype)), f"mla.{op} {sample.name} output {i}: not bit-exact"
        err = normalised_error(g, w)
        assert err <= bound, (f"mla.{op} {sample.name} via {variant.name} output {i}: normalised error {err:.3g} "
                              f"> bound {bound:.3g} ({dtype})")
        worst = max(worst, err)
    return worst, bound


# -------------------------------------------------------------------------------- PyTorch integration
def run_opcheck(op: str, sample: Sample) -> None:
    """torch.library.opcheck with its four utils (schema, autograd registration, fake tensor, AOT dispatch)."""
    result = torch.library.opcheck(OPS[op].overload, sample.args, dict(sample.kwargs), test_utils=OPCHECK_UTILS,
                                   raise_exception=True)
    assert all(v == "SUCCESS" for v in result.values()), result


def tensor_function(op: str, sample: Sample, clone_written: bool = True):
    """(fn(*tensors) calling the op on them with the sample's other arguments, the tensors): a
    function of tensors only, so Dynamo and export treat every tensor as an input. Tensors the op
    writes are cloned first (unless `clone_written` is False: an error input whose written tensor
    is itself the mistake), so the inputs stay untouched and the function is repeatable."""
    flat = list(sample.args) + list(sample.kwargs.values())
    where = [i for i, v in enumerate(flat) if isinstance(v, Tensor)]
    written = written_positions(op) if clone_written else []
    keys = list(sample.kwargs)
    overload = OPS[op].overload

    def fn(*tensors):
        values = list(flat)
        for i, t in zip(where, tensors):
            values[i] = t.clone() if i in written else t
        args, kwargs = values[: len(sample.args)], dict(zip(keys, values[len(sample.args):]))
        result = overload(*args, **kwargs)
        return outputs_of(result, args, written)

    return fn, [flat[i] for i in where]


class GraphCapture:
    """A torch.compile backend that records the FX graphs Dynamo hands over, then runs them."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def call_targets(self) -> set[str]:
        """The targets (as strings, e.g. "mla.kv_prolog") of every call_function node of the graphs."""
        return {str(node.target) for gm in self.graphs for node in gm.graph.nodes if node.op == "call_function"}

    def op_nodes(self, op: str) -> int:
        packet = getattr(torch.ops.mla, op)
        return sum(node.op == "call_function" and node.target in (packet, packet.default)
                   for gm in self.graphs for node in gm.graph.nodes)


def compiles_to_one_node(op: str, sample: Sample) -> None:
    """torch.compile(fullgraph=True): one graph, no break, the op as exactly one node; outputs equal eager."""
    fn, tensors = tensor_function(op, sample)
    torch._dynamo.reset()
    capture = GraphCapture()
    compiled = torch.compile(fn, backend=capture, fullgraph=True)
    got = compiled(*tensors)
    assert len(capture.graphs) == 1, f"{len(capture.graphs)} graphs"
    assert capture.op_nodes(op) == 1, [n.target for gm in capture.graphs for n in gm.graph.nodes]
    for g, w in zip(got, fn(*tensors)):
        assert torch.equal(g, w), f"mla.{op} {sample.name}: compiled output differs from eager"


def exports_to_one_node(op: str, sample: Sample) -> None:
    """torch.export: the op is one node of the exported graph (wrapped in auto_functionalized when it
    writes in place), and the exported program computes what eager does."""
    fn, tensors = tensor_function(op, sample)

    class Call(torch.nn.Module):
        def forward(self, *inputs):
            return fn(*inputs)

    exported = torch.export.export(Call(), tuple(tensors))
    overload = OPS[op].overload
    nodes = [n for n in exported.graph.nodes if n.op == "call_function"]
    direct = sum(n.target is overload for n in nodes)
    wrapped = sum(n.target is torch.ops.higher_order.auto_functionalized and n.args and n.args[0] is overload
                  for n in nodes)
    assert direct + wrapped == 1, [str(n.target) for n in nodes]
    for g, w in zip(exported.module()(*tensors), fn(*tensors)):
        assert torch.equal(g, w), f"mla.{op} {sample.name}: exported program differs from eager"


def gradcheck_or_refusal(op: str, sample: Sample) -> None:
    """Differentiable ops: torch.autograd.gradcheck in float64 over every floating-point input.
    Inference-only ops: a clear refusal naming torch.no_grad, and the same call runs without grad."""
    # fresh tensors with their own standard strides: gradcheck perturbs inputs element by element, and
    # an empty expanded table (stride 0) would count as overlapping
    fresh = sample.map(lambda t: t.detach().new_empty(t.shape).copy_(t))
    floats = [t for t in fresh.tensors() if t.is_floating_point()]
    if OPS[op].differentiable:
        for t in floats:
            t.requires_grad_(True)
        fn, tensors = tensor_function(op, fresh)
        assert torch.autograd.gradcheck(fn, tuple(tensors), fast_mode=True)
        return
    floats[0].requires_grad_(True)
    try:
        call(op, fresh)
    except RuntimeError as exc:
        assert re.search(rf"mla\.{op} is inference-only.*torch\.no_grad", str(exc)), str(exc)
    else:
        raise AssertionError(f"mla.{op} accepted an input that requires grad")
    with torch.no_grad():
        call(op, fresh)


# ------------------------------------------------------------------------------------------- errors
def _snapshot(sample: Sample) -> list[Optional[Tensor]]:
    return [t.clone() if t.device.type != "meta" else None for t in sample.tensors()]


def _assert_untouched(sample: Sample, snapshot) -> None:
    for i, (now, before) in enumerate(zip(sample.tensors(), snapshot)):
        assert before is None or torch.equal(now, before), f"tensor argument {i} was modified by a rejected call"


def _assert_names_argument(op: str, error: ErrorInput, message: str) -> None:
    assert re.search(error.match, message), f"message {message!r} does not match {error.match!r}"
    named = error.op_named or op
    assert f"mla.{named}" in message, f"the message does not name mla.{named}: {message!r}"
    assert error.argument in message, f"the message does not name {error.argument}: {message!r}"


def raises_eagerly(op: str, error: ErrorInput) -> None:
    """The eager call raises `error.error` naming the op and the argument, and writes nothing."""
    sample = error.sample
    snapshot = _snapshot(sample)
    try:
        OPS[op].overload(*sample.args, **sample.kwargs)
    except error.error as exc:
        _assert_names_argument(op, error, str(exc))
    else:
        raise AssertionError(f"mla.{op} accepted {error.name}")
    _assert_untouched(sample, snapshot)


def raises_when_compiled(op: str, error: ErrorInput) -> None:
    """Under torch.compile the fake kernel runs the same check at trace time: the same message, and
    no graph reaches the backend (the real kernel never ran)."""
    fn, tensors = tensor_function(op, error.sample, clone_written=False)
    snapshot = _snapshot(error.sample)
    torch._dynamo.reset()
    capture = GraphCapture()
    compiled = torch.compile(fn, backend=capture, fullgraph=True)
    try:
        compiled(*tensors)
    except Exception as exc:  # Dynamo wraps the check's RuntimeError in its own exception types
        _assert_names_argument(op, error, str(exc))
    else:
        raise AssertionError(f"mla.{op} compiled {error.name}")
    assert not capture.graphs, "the error came from running a compiled graph, not from the fake kernel"
    _assert_untouched(error.sample, snapshot)
