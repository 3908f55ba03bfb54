"""Every op x every sample of the case database (`mla_ops.testing.cases`) through the generic suites:
opcheck, torch.compile as one node, torch.export, gradcheck (or the inference-only refusal), the error
inputs eagerly and compiled, and every kernel variant of this machine against the oracle.

Nothing here knows a particular op: adding an op or a backend adds its rows."""
import re

import pytest
import torch

from mla_ops import backends, settings
from mla_ops._library import NAMESPACE, OPS
from mla_ops.backends import cpu_native
from mla_ops.testing import suites
from mla_ops.testing.cases import ACTIVATION_DTYPES, ALL_DTYPES, CASES


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _samples(dtypes, ops=None):
    return [pytest.param(op, dtype, sample.name, id=f"{op}-{_dtype_id(dtype)}-{sample.name}")
            for op in (ops or CASES) for dtype in dtypes for sample in CASES[op].samples_in(dtype)]


def _errors(kind=None):
    return [pytest.param(op, i, id=f"{op}-{e.name}") for op in CASES for i, e in enumerate(CASES[op].errors())
            if kind is None or e.error is kind]


def test_the_database_covers_exactly_the_ops():
    assert set(CASES) == set(OPS)
    for op, cases in CASES.items():
        names = [s.name for dtype in ALL_DTYPES for s in cases.samples_in(dtype)]
        assert names, f"mla.{op} has no samples"
        for dtype in ALL_DTYPES:
            per_dtype = [s.name for s in cases.samples_in(dtype)]
            assert len(per_dtype) == len(set(per_dtype)), f"mla.{op}: duplicate sample names in {dtype}"
        assert cases.errors(), f"mla.{op} has no error inputs"
        assert set(cases.selftest) <= set(names), f"mla.{op}: selftest names a sample that does not exist"


# ------------------------------------------------------------------------------ PyTorch integration
@pytest.mark.parametrize("op,dtype,name", _samples(ACTIVATION_DTYPES))
def test_opcheck(op, dtype, name):
    sample = CASES[op].sample(dtype, name)
    if OPS[op].differentiable:  # the autograd-registration util needs inputs that require grad
        sample = sample.map(lambda t: t.detach().requires_grad_(t.is_floating_point()))
    suites.run_opcheck(op, sample)


@pytest.mark.parametrize("op,dtype,name", _samples((torch.float32,)))
def test_compiles_to_one_node(op, dtype, name):
    suites.compiles_to_one_node(op, CASES[op].sample(dtype, name))


@pytest.mark.parametrize("op", list(CASES))
def test_exports_to_one_node(op):
    suites.exports_to_one_node(op, CASES[op].samples_in(torch.float32)[0])


# gradcheck skips the samples named "v2lite" (V2-Lite's full attention dims: minutes of fp64 Jacobians for
# no coverage the small, prefill and q-LoRA samples do not give)
@pytest.mark.parametrize("op,dtype,name", [p for p in _samples((torch.float64,)) if "v2lite" not in p.values[2]])
def test_gradcheck_or_inference_only_refusal(op, dtype, name):
    suites.gradcheck_or_refusal(op, CASES[op].sample(dtype, name))


@pytest.mark.parametrize("op,index", _errors())
def test_error_input_eagerly(op, index):
    suites.raises_eagerly(op, CASES[op].errors()[index])


@pytest.mark.parametrize("variant", [v for v in suites.variants() if v.serving is not None], ids=lambda v: v.name)
@pytest.mark.parametrize("op,index", _errors())
def test_error_input_on_every_backend(variant, op, index):
    """Each backend serving the op on CPU (the native one per ISA build, with its checks in C++) raises the
    error the op's contract promises, naming the op and the argument, and writes nothing."""
    if not variant.has_kernel(op):
        pytest.skip(f"{variant.name} has no mla.{op} kernel")
    error = CASES[op].errors()[index]
    # metadata errors come from the check, before any backend's reasons; bad values pass the check, so
    # a backend that cannot take the call's shapes (its reasons) refuses it before looking at them
    asked = error.sample if error.error is ValueError else CASES[op].samples_in(torch.float32)[0]
    unavailable = variant.not_supported_reasons(op, asked)
    if unavailable:
        pytest.skip(f"{variant.name} cannot serve this mla.{op} call: {'; '.join(unavailable)}")
    with variant.serving():
        suites.raises_eagerly(op, error)


def _message(op: str, error, backend: str) -> str:
    with settings.use_backend(backend), pytest.raises(error.error) as raised:
        OPS[op].overload(*error.sample.args, **error.sample.kwargs)  # rejected: nothing is written
    return str(raised.value)


@pytest.mark.parametrize("op,index", [p for p in _errors() if p.values[0] in backends.BACKENDS["cpu_native"].kernels])
def test_native_error_messages_equal_the_reference(op, index):
    """The C++ checks of the native kernels are the Python checks' twins: word for word the same message."""
    if backends.BACKENDS["cpu_native"].unavailable_reason():
        pytest.skip(backends.BACKENDS["cpu_native"].unavailable_reason())
    error = CASES[op].errors()[index]
    if any(t.device.type != "cpu" for t in error.sample.tensors()):
        pytest.skip("a non-CPU tensor: the native kernel is not on this call's path")
    assert _message(op, error, "cpu_native") == _message(op, error, "reference")


@pytest.mark.parametrize("op,index", _errors(RuntimeError))
def test_error_input_when_compiled(op, index):
    error = CASES[op].errors()[index]
    if any(t.device.type == "meta" for t in error.sample.tensors()):
        pytest.skip("a meta tensor next to CPU tensors is refused by Dynamo before any op runs")
    suites.raises_when_compiled(op, error)


# ------------------------------------------------------------------------------- kernels vs oracle
VARIANTS = {v.name: v for v in suites.variants()}


def _kernel_cases():
    """(variant, op, dtype, sample) for every variant that has a kernel for the op; whether it can take
    a particular sample is asked at run time (the skip then gives the backend's own reasons)."""
    cases = []
    for variant in VARIANTS.values():
        marks = [pytest.mark.pypto] if variant.backend == "pypto_sim" else []
        for param in _samples(ALL_DTYPES):
            op = param.values[0]
            if variant.has_kernel(op):
                cases.append(pytest.param(variant.name, *param.values, marks=marks,
                                          id=f"{param.id}-{variant.name}"))
    return cases


@pytest.mark.parametrize("variant,op,dtype,name", _kernel_cases())
def test_kernel_matches_the_oracle(variant, op, dtype, name):
    chosen = VARIANTS[variant]
    sample = CASES[op].sample(dtype, name)
    reasons = chosen.not_supported_reasons(op, sample)
    if reasons:
        pytest.skip(f"{variant}: {'; '.join(reasons)}")
    with torch.no_grad():
        suites.compare(chosen, op, sample, dtype)


def _unchecked_cases():
    return [pytest.param(variant.name, op, dtype, sample.name,
                         id=f"{op}-{_dtype_id(dtype)}-{sample.name}-{variant.name}")
            for variant in VARIANTS.values() if variant.serving is None
            for op, cases in CASES.items() if variant.has_kernel(op)
            for dtype in ALL_DTYPES for sample in cases.unchecked_samples(dtype)]


@pytest.mark.parametrize("variant,op,dtype,name", _unchecked_cases())
def test_unchecked_path_answers_values_the_host_checks_refuse(variant, op, dtype, name):
    """The sync-free device paths validate nothing (no host sync): on values the CPU checks refuse they
    give the oracle's answer for entries that address nothing (none), reading nothing out of bounds."""
    sample = next(s for s in CASES[op].unchecked_samples(dtype) if s.name == name)
    with torch.no_grad():
        suites.compare(VARIANTS[variant], op, sample, dtype)


def test_the_reference_kernels_are_checked_whatever_the_native_build():
    """The reference variant serves every op and every sample on CPU, so `test_kernel_matches_the_oracle`
    proves the reference kernels in every run, native build or not."""
    reference = VARIANTS["reference"]
    for op, cases in CASES.items():
        for dtype in ALL_DTYPES:
            for sample in cases.samples_in(dtype):
                assert reference.not_supported_reasons(op, sample) == [], (op, sample.name)


# --------------------------------------------------------------------------------------- binding
_REGISTRATION = re.compile(r"^(\w+)(?:\[alias\])?: registered at (.+?):(\d+)")


def _registrations(op: str) -> dict[str, str]:
    """dispatch key -> the file that registered its kernel, from the dispatcher's own record."""
    found = {}
    for line in torch._C._dispatch_dump(f"{NAMESPACE}::{op}").splitlines():
        match = _REGISTRATION.match(line)
        if match and match.group(1) not in ("debug",):
            found[match.group(1)] = match.group(2)
    return found


# Where the native extension's static registrations say they come from (the path it was compiled at ends so).
NATIVE_REGISTRATION = "mla_ops/csrc/cpu/registration.cpp"


def _expected_registrations(op: str) -> dict[str, str]:
    """What the project itself registers for `op`: its definition's Meta (fake), CompositeExplicitAutograd
    (the backend layer's entry) and Autograd kernels, and — for the ops the cpu_native backend declares,
    when its extension is loaded — the extension's CPU and AutogradCPU kernels."""
    import mla_ops._library as library_module

    definition = library_module.__file__
    expected = {"Meta": definition, "CompositeExplicitAutograd": definition, "Autograd": definition}
    if cpu_native.load() is not None and op in cpu_native.NATIVE_OPS:
        expected.update(CPU=NATIVE_REGISTRATION, AutogradCPU=NATIVE_REGISTRATION)
    return expected


def _project_registrations(op: str) -> dict[str, str]:
    return {key: NATIVE_REGISTRATION if source.endswith(NATIVE_REGISTRATION) else source
            for key, source in _registrations(op).items()}


@pytest.mark.parametrize("op", list(OPS))
def test_every_kernel_is_registered_by_the_project(op):
    """Any registration other than the op's definition and the native extension's declared ones — a
    TORCH_LIBRARY_IMPL elsewhere, another Library, a key the extension should not touch — would serve
    calls behind the backend layer's back: it fails here, naming the key and the file."""
    assert _project_registrations(op) == _expected_registrations(op)


@pytest.mark.skipif(cpu_native.load() is None, reason="the native extension is not loaded: "
                    f"{cpu_native.unavailable_reason()}")
def test_the_extension_registers_exactly_the_ops_the_backend_declares():
    assert sorted(torch.ops.mla_native.ops()) == sorted(cpu_native.NATIVE_OPS)


def test_the_binding_check_sees_a_foreign_registration():
    """A kernel registered outside the binding shows up in the dispatcher's record (so the test above
    would fail for it), and disappears with its Library."""
    foreign = torch.library.Library(NAMESPACE, "IMPL")
    try:
        foreign.impl("rms_norm", lambda x, w, eps=1e-6: x, "PrivateUse1")
        assert _project_registrations("rms_norm") == {**_expected_registrations("rms_norm"), "PrivateUse1": __file__}
    finally:
        foreign._destroy()
    assert _project_registrations("rms_norm") == _expected_registrations("rms_norm")
