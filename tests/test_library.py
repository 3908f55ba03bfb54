"""The op library itself: every op defined once from its OpDef, a fake for every op, lean imports,
backend binding."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import mla_ops
from mla_ops import backends
from mla_ops._library import OPS

from utils import SMALL, prolog_inputs, prolog_kwargs

ALL_OPS = ("rms_norm", "rope", "kv_prolog", "latent_kv_prolog", "q_prolog", "scatter_pa_kv_cache",
           "gather_pa_kv_cache", "gather_pa_kv_cache_functional", "mla_decode_attention", "scatter_pa_cache",
           "lightning_indexer", "sparse_mla_attention", "shared_kv_q_prolog", "shared_kv_prolog", "kv_compressor",
           "shared_kv_attention", "mla_prefill_attention", "mha_prefill_attention")


def test_the_op_table_is_derived_from_the_op_modules():
    assert set(OPS) == set(ALL_OPS)
    assert {name for name, op in OPS.items() if op.differentiable} == {"rms_norm", "rope", "kv_prolog",
                                                                       "latent_kv_prolog", "q_prolog"}
    assert set(backends.REFERENCE.kernels) == set(ALL_OPS)
    assert all(backends.REFERENCE.kernels[name].fn is OPS[name].reference for name in ALL_OPS)


@pytest.mark.parametrize("name", ALL_OPS)
def test_every_op_is_registered_with_its_schema_and_a_fake(name):
    overload = getattr(torch.ops.mla, name).default
    assert str(overload._schema) == str(torch._C.parse_schema(f"mla::{OPS[name].schema}"))
    assert OPS[name].fake.__name__ == f"_{name}_fake"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(), "Meta")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(), "CompositeExplicitAutograd")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(), "Autograd")


def test_gather_schema_matches_torch_npu():
    """Argument names, order and defaults of torch_npu.npu_gather_pa_kv_cache (op-plugin yaml)."""
    npu = torch._C.parse_schema(
        "npu::npu_gather_pa_kv_cache(Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor(a!) key, Tensor(b!) value, *, Tensor? seq_offset=None, bool is_seq_lens_cumsum=False) -> ()")
    ours = torch.ops.mla.gather_pa_kv_cache.default._schema
    assert [(a.name, str(a.type), a.kwarg_only, a.default_value) for a in ours.arguments] == \
        [(a.name, str(a.type), a.kwarg_only, a.default_value) for a in npu.arguments]


# The schemas as the design document (docs/design.md) writes them, restated independently of the op modules.
CONTRACT_SCHEMAS = {
    "rms_norm": "mla::rms_norm(Tensor x, Tensor weight, float eps=1e-6) -> Tensor",
    "rope": 'mla::rope(Tensor x, Tensor cos, Tensor sin, *, str layout="interleaved", str compute_dtype="float32") '
            "-> Tensor",
    "kv_prolog": "mla::kv_prolog(Tensor hidden_states, Tensor kv_a_weight, Tensor? kv_a_bias, Tensor kv_norm_weight, "
                 "Tensor kv_b_weight, Tensor cos, Tensor sin, *, int num_heads, int qk_nope_head_dim, "
                 'int v_head_dim, float eps=1e-6, str rope_layout="interleaved", str rope_compute_dtype="float32") '
                 "-> (Tensor k_nope, Tensor value, Tensor k_pe)",
    "q_prolog": "mla::q_prolog(Tensor hidden_states, Tensor? q_a_weight, Tensor? q_a_bias, Tensor? q_norm_weight, "
                "Tensor q_b_weight, Tensor cos, Tensor sin, *, int num_heads, int qk_nope_head_dim, float eps=1e-6, "
                'str rope_layout="interleaved", str rope_compute_dtype="float32") -> (Tensor q_nope, Tensor q_pe)',
    "latent_kv_prolog": "mla::latent_kv_prolog(Tensor hidden_states, Tensor kv_a_weight, Tensor? kv_a_bias, "
                        "Tensor kv_norm_weight, Tensor cos, Tensor sin, *, float eps=1e-6, "
                        'str rope_layout="interleaved", str rope_compute_dtype="float32") '
                        "-> (Tensor latent, Tensor k_pe)",
    "scatter_pa_kv_cache": "mla::scatter_pa_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, "
                           "Tensor(b!) value_cache, Tensor slot_mapping) -> ()",
    "mla_decode_attention": "mla::mla_decode_attention(Tensor q_latent, Tensor q_pe, Tensor key_cache, "
                            "Tensor value_cache, Tensor block_tables, Tensor seq_lens, float softmax_scale, "
                            "Tensor? sinks=None, int sliding_window=0, Tensor? q_scale=None) -> Tensor",
    "sparse_mla_attention": "mla::sparse_mla_attention(Tensor q_latent, Tensor q_pe, Tensor key_cache, "
                            "Tensor value_cache, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
                            "Tensor topk_indices, float softmax_scale, Tensor? sinks=None, "
                            "Tensor? q_scale=None) -> Tensor",
}


@pytest.mark.parametrize("name", list(CONTRACT_SCHEMAS))
def test_schemas_are_the_contracts(name):
    """Argument names, types, defaults, mutability and returns as the contract states them (return
    names are documentation in the contract; the registered ones may be unnamed)."""
    expected = torch._C.parse_schema(CONTRACT_SCHEMAS[name])
    ours = getattr(torch.ops.mla, name).default._schema

    def signature(schema):
        return ([(a.name, str(a.type), a.kwarg_only, a.default_value, a.is_write) for a in schema.arguments],
                [str(r.type) for r in schema.returns])

    assert signature(ours) == signature(expected)


def test_an_op_cannot_be_defined_twice():
    from mla_ops._library import define_op

    op = OPS["rms_norm"]
    with pytest.raises(RuntimeError, match="mla.rms_norm is defined twice"):
        define_op(op.schema, check=op.check, fake=op.fake, reference=op.reference)
    assert getattr(torch.ops.mla, "rms_norm").default._schema.name == "mla::rms_norm"


def test_import_touches_no_npu_cuda_or_heavy_optional_package():
    """`import mla_ops` must not import torch_npu, torchair, pypto, matplotlib or transformers, and
    must not initialise CUDA (torchao's test_lean_import idea)."""
    code = textwrap.dedent("""
        import sys, torch
        torch.cuda.current_device = lambda: (_ for _ in ()).throw(AssertionError("cuda initialised"))
        import mla_ops
        heavy = [m for m in ("torch_npu", "torchair", "pypto", "matplotlib", "transformers") if m in sys.modules]
        assert not heavy, heavy
        assert not torch.cuda.is_initialized()
        print("lean")
    """)
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and "lean" in out.stdout, out.stderr


def test_backend_selection_auto_and_explicit():
    args = prolog_inputs(SMALL, torch.float32)
    kwargs = prolog_kwargs(SMALL)
    native = backends.BACKENDS["cpu_native"]
    automatic = "reference" if native.unavailable_reason() else "cpu_native"
    assert mla_ops.explain("kv_prolog", *args, **kwargs).startswith(f"mla.kv_prolog: {automatic}")
    with mla_ops.use_backend("reference"):
        assert mla_ops.explain("kv_prolog", *args, **kwargs).startswith("mla.kv_prolog: reference")
    with mla_ops.use_backend("npu"):
        # an explicit backend that cannot serve the call fails loudly, with its reasons
        with pytest.raises(NotImplementedError, match=r"backend 'npu' was requested .* cannot serve"):
            torch.ops.mla.kv_prolog(*args, **kwargs)
        assert "backend 'npu' was requested" in mla_ops.explain("kv_prolog", *args, **kwargs)
        # ... but ops it does not claim keep the automatic choice
        out = torch.ops.mla.rms_norm(args[0], torch.ones(SMALL.H), 1e-6)
        assert torch.equal(out, OPS["rms_norm"].reference(args[0], torch.ones(SMALL.H), 1e-6))
        served = dict(((op, dev), who) for op, dev, who in backends.serving_report())
        automatic_rms_norm = "reference" if native.unavailable_reason() else "cpu_native or reference"
        assert served[("rms_norm", "cpu")] == automatic_rms_norm


def test_a_setting_change_registers_nothing_and_the_next_call_follows_it():
    """The dispatcher's registrations are made at import (the op definitions) and when the native extension
    loads, never by a change of setting: the setting is read by the calls. `reference` is served on CPU;
    the npu backend, requested by name, refuses a CPU call; back to `reference`, served again."""
    hidden, kv_a, _, norm_w, kv_b, cos, sin = prolog_inputs(SMALL, torch.bfloat16)
    args, kwargs = (hidden, kv_a, None, norm_w, kv_b, cos, sin), prolog_kwargs(SMALL)
    dump = torch._C._dispatch_dump("mla::kv_prolog")
    with mla_ops.use_backend("reference"):
        assert ("kv_prolog", "cpu", "reference") in backends.serving_report()
        expected = torch.ops.mla.kv_prolog(*args, **kwargs)
        with mla_ops.use_backend("npu"):
            assert ("kv_prolog", "cpu", "npu (refused: device cpu)") in backends.serving_report()
            with pytest.raises(NotImplementedError, match="backend 'npu' was requested"):
                torch.ops.mla.kv_prolog(*args, **kwargs)
            assert torch._C._dispatch_dump("mla::kv_prolog") == dump
        assert all(torch.equal(a, b) for a, b in zip(torch.ops.mla.kv_prolog(*args, **kwargs), expected))
    assert torch._C._dispatch_dump("mla::kv_prolog") == dump


def test_a_wrong_shape_gets_the_ops_own_message_whatever_the_backend():
    hidden, kv_a, _, norm_w, kv_b, cos, sin = prolog_inputs(SMALL, torch.bfloat16)
    bad = (hidden[0], kv_a, None, norm_w, kv_b, cos, sin)  # 2-D hidden_states
    for backend in ("auto", "reference", "cpu_native", "pypto_sim", "npu"):
        with mla_ops.use_backend(backend):
            with pytest.raises(RuntimeError, match=r"mla.kv_prolog: hidden_states must be 3-D"):
                torch.ops.mla.kv_prolog(*bad, **prolog_kwargs(SMALL))


def test_config_rejects_unknown_backend_and_bad_env():
    with pytest.raises(ValueError, match="unknown mla_ops backend 'cuda'"):
        mla_ops.set_backend("cuda")
    env = dict(os.environ, MLA_OPS_NPU_FUSED_MAX_TOKENS="many", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    out = subprocess.run([sys.executable, "-c", "import mla_ops"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode != 0 and "MLA_OPS_NPU_FUSED_MAX_TOKENS='many' is not an integer" in out.stderr


def test_availability_report_lists_every_backend_with_its_own_reason():
    rows = {name: status for name, _, status in backends.availability_report()}
    assert set(rows) == set(backends.BACKENDS) == {"reference", "cpu_native", "pypto_sim", "npu"}
    assert rows["reference"] == "available"
    for name, backend in backends.BACKENDS.items():
        reason = backend.unavailable_reason()
        assert rows[name] == ("available" if reason is None else f"unavailable: {reason}")
