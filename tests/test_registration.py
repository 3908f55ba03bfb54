"""The registration layer itself: every schema once, a fake for every op, lean imports, backends."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import mla_ops
from mla_ops import backends
from mla_ops.registration import schemas
from utils import SMALL, prolog_inputs, prolog_kwargs


@pytest.mark.parametrize("name", list(schemas.ALL_SCHEMAS))
def test_every_op_is_registered_with_its_schema_and_a_fake(name):
    overload = getattr(torch.ops.mla, name).default
    assert str(overload._schema) == str(torch._C.parse_schema(f"mla::{schemas.ALL_SCHEMAS[name]}"))
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


# The schemas as ARCHITECTURE.md §3 writes them, restated here independently of registration/schemas.py.
CONTRACT_SCHEMAS = {
    "rms_norm": "mla::rms_norm(Tensor x, Tensor weight, float eps=1e-6) -> Tensor",
    "rope": 'mla::rope(Tensor x, Tensor cos, Tensor sin, *, str layout="interleaved") -> Tensor',
    "kv_prolog": "mla::kv_prolog(Tensor hidden_states, Tensor kv_a_weight, Tensor? kv_a_bias, Tensor kv_norm_weight, "
                 "Tensor kv_b_weight, Tensor cos, Tensor sin, *, int num_heads, int qk_nope_head_dim, "
                 'int v_head_dim, float eps=1e-6, str rope_layout="interleaved") '
                 "-> (Tensor k_nope, Tensor value, Tensor k_pe)",
    "latent_kv_prolog": "mla::latent_kv_prolog(Tensor hidden_states, Tensor kv_a_weight, Tensor? kv_a_bias, "
                        "Tensor kv_norm_weight, Tensor cos, Tensor sin, *, float eps=1e-6, "
                        'str rope_layout="interleaved") -> (Tensor latent, Tensor k_pe)',
    "scatter_pa_kv_cache": "mla::scatter_pa_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, "
                           "Tensor(b!) value_cache, Tensor slot_mapping) -> ()",
    "mla_decode_attention": "mla::mla_decode_attention(Tensor q_latent, Tensor q_pe, Tensor key_cache, "
                            "Tensor value_cache, Tensor block_tables, Tensor seq_lens, float softmax_scale) -> Tensor",
}


@pytest.mark.parametrize("name", list(CONTRACT_SCHEMAS))
def test_schemas_are_the_contracts(name):
    """Argument names, types, defaults, mutability and returns as §3 states them (return names are
    documentation in the contract; the registered ones may be unnamed)."""
    expected = torch._C.parse_schema(CONTRACT_SCHEMAS[name])
    ours = getattr(torch.ops.mla, name).default._schema

    def signature(schema):
        return ([(a.name, str(a.type), a.kwarg_only, a.default_value, a.is_write) for a in schema.arguments],
                [str(r.type) for r in schema.returns])

    assert signature(ours) == signature(expected)


def test_register_all_is_idempotent():
    """A second register_all() neither raises nor registers anything twice (torch.library would
    raise on a duplicate kernel), and every op keeps exactly its one schema."""
    from mla_ops.registration import register_all
    from mla_ops.registration.library import lib

    before = list(lib._op_impls)
    register_all()
    register_all()
    assert list(lib._op_impls) == before
    for name in schemas.ALL_SCHEMAS:
        assert getattr(torch.ops.mla, name).default._schema.name == f"mla::{name}"


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
    assert mla_ops.explain("kv_prolog", *args, **kwargs).startswith("mla.kv_prolog: reference")
    with mla_ops.use_backend("npu"):
        # an explicit backend that cannot serve the call fails loudly, with its reasons
        with pytest.raises(NotImplementedError, match=r"backend 'npu' was requested .* cannot serve"):
            torch.ops.mla.kv_prolog(*args, **kwargs)
        # ... but ops it does not claim still run on the reference kernels
        torch.ops.mla.rms_norm(args[0], torch.ones(SMALL.H), 1e-6)
        assert backends.last_choice("kv_prolog") is None or backends.last_choice("kv_prolog")[0] != "npu"


def test_config_rejects_unknown_backend_and_bad_env():
    with pytest.raises(ValueError, match="unknown mla_ops backend 'cuda'"):
        mla_ops.set_backend("cuda")
    env = dict(os.environ, MLA_OPS_NPU_FUSED_MAX_TOKENS="many", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    out = subprocess.run([sys.executable, "-c", "import mla_ops"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode != 0 and "MLA_OPS_NPU_FUSED_MAX_TOKENS='many' is not an integer" in out.stderr


def test_availability_report_lists_every_backend():
    rows = {name: status for name, _, status in backends.availability_report()}
    assert rows["reference"] == "available"
    assert rows["npu"].startswith("unavailable: torch_npu")
    assert set(rows) == {"reference", "pypto_sim", "npu"}
