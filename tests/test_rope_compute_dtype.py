"""Where mla.rope and the KV prologs round the rotation: `compute_dtype` / `rope_compute_dtype`.

"float32" (the default) rotates in fp32 and rounds once; "activation" casts cos/sin to the activation
dtype and rounds every product and sum to it, as x*cos + rotate_half(x)*sin does in a bf16 / fp16
model. Here: how the two roundings relate, and which backend serves a call; opcheck, compile, gradcheck,
the bad-value errors and the oracle comparison of the "activation" samples run from the case database
(tests/test_cases.py). Bit-identity with transformers' own RoPE functions is in
tests/test_goldens_transformers.py, q_prolog's in tests/test_q_prolog.py.
"""
import pytest
import torch

import mla_ops
from mla_ops.backends import cpu_native, npu, staged_kv_prolog
from mla_ops.ops.kv_prolog import kv_prolog_reference, latent_kv_prolog_reference

from utils import SMALL, prolog_inputs, prolog_kwargs, rope_tables

LAYOUTS = ("interleaved", "half", "neox")


def _rope_inputs(dtype, rope_dim=SMALL.R, seed=0):
    """x [B, N, S, R] and per-pair tables [B, S, R/2] (fp32; fp64 for fp64)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SMALL.B, SMALL.N, SMALL.S, rope_dim, generator=g).to(dtype)
    table_dtype = torch.promote_types(dtype, torch.float32)
    cos, sin = (t.to(table_dtype) for t in rope_tables(SMALL.B, SMALL.S, rope_dim, offset=5))
    return x, cos, sin


def _latent_args(args):
    hidden, kv_a, kv_a_b, norm_w, _, cos, sin = args
    return hidden, kv_a, kv_a_b, norm_w, cos, sin


@pytest.mark.parametrize("layout", LAYOUTS)
def test_both_roundings_agree_where_they_compute_in_one_dtype(layout):
    """fp64 and fp32 (rows of 32 pairs): both are that dtype's formula. bf16 / fp16: "activation" rounds
    every product and sum, so the results differ — by a few ulps of the output, nothing more."""
    for dtype, rope_dim in ((torch.float64, SMALL.R), (torch.float32, 64)):
        x, cos, sin = _rope_inputs(dtype, rope_dim)
        assert torch.equal(mla_ops.rope(x, cos, sin, layout=layout, compute_dtype="activation"),
                           mla_ops.rope(x, cos, sin, layout=layout))
    for dtype in (torch.bfloat16, torch.float16):
        x, cos, sin = _rope_inputs(dtype, 64)
        got = mla_ops.rope(x, cos, sin, layout=layout, compute_dtype="activation").float()
        fp32 = mla_ops.rope(x, cos, sin, layout=layout).float()
        ulp = torch.finfo(dtype).eps * fp32.abs().clamp(min=1)
        assert not torch.equal(got, fp32)
        # tables rounded (1/2 ulp each, times |x| <= 1 ulp of the products), two products, the sum: 4 ulps
        assert ((got - fp32).abs() <= 4 * ulp).all()


native = pytest.mark.skipif(cpu_native.unavailable_reason() is not None,
                            reason=f"native CPU kernels: {cpu_native.unavailable_reason()}")


@native
@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_native_prologs_serve_fp32_and_leave_half_types_to_the_reference(layout):
    """fp32: the native kernel's separately rounded fp32 products and sums are the "activation" formula,
    so it serves those calls, bit-identical. bf16: it rotates in fp32, so the automatic choice falls back
    to the reference kernel (explain() says why) and an explicit cpu_native demand is refused."""
    for dtype in (torch.float32, torch.bfloat16):
        args = prolog_inputs(SMALL, dtype)
        rounding = dict(rope_layout=layout, rope_compute_dtype="activation")
        kwargs = prolog_kwargs(SMALL, **rounding)
        text = mla_ops.explain("kv_prolog", *args, **kwargs)
        latent_text = mla_ops.explain("latent_kv_prolog", *_latent_args(args), **rounding)
        got = torch.ops.mla.kv_prolog(*args, **kwargs)
        latent = torch.ops.mla.latent_kv_prolog(*_latent_args(args), **rounding)
        assert all(torch.equal(a, b) for a, b in zip(got, kv_prolog_reference(*args, **kwargs)))
        assert all(torch.equal(a, b) for a, b in zip(latent, latent_kv_prolog_reference(*_latent_args(args),
                                                                                         **rounding)))
        if dtype == torch.float32:
            assert text.startswith("mla.kv_prolog: cpu_native") and latent_text.startswith(
                "mla.latent_kv_prolog: cpu_native"), (text, latent_text)
            continue
        assert text.startswith("mla.kv_prolog: reference"), text
        assert "not cpu_native: rope_compute_dtype 'activation' with torch.bfloat16" in text, text
        with mla_ops.use_backend("cpu_native"):
            with pytest.raises(NotImplementedError, match=r"backend 'cpu_native' was requested .* cannot serve this "
                                                          r"call: rope_compute_dtype 'activation'"):
                torch.ops.mla.kv_prolog(*args, **kwargs)
            torch.ops.mla.kv_prolog(*args, **prolog_kwargs(SMALL, rope_layout=layout))  # fp32 rotation: served


def test_the_pypto_stage2_declares_it_rotates_in_fp32():
    """The PyPTO stage-2 kernel (pypto_sim and the npu backend's fused path) rotates from fp32 tables and
    rounds once: an "activation" call is not its, and the reason says so (on any machine: the reasons
    read shapes and dtypes only)."""
    hidden, kv_a, _, norm_w, kv_b, cos, sin = prolog_inputs(SMALL, torch.bfloat16)
    dims = dict(num_heads=SMALL.N, qk_nope_head_dim=SMALL.P, v_head_dim=SMALL.V, rope_layout="half")
    reason = "rope_compute_dtype 'activation': the PyPTO stage-2 kernel rotates k_pe in fp32"
    for mode in ("sim", "npu"):
        assert any(reason in r for r in staged_kv_prolog.stage2_not_supported_reasons(
            hidden, kv_a, norm_w, kv_b, mode=mode, rope_compute_dtype="activation", **dims))
        assert not any("rope_compute_dtype" in r for r in staged_kv_prolog.stage2_not_supported_reasons(
            hidden, kv_a, norm_w, kv_b, mode=mode, **dims))
    fused = npu.fused_kv_prolog_reasons(hidden, kv_a, None, norm_w, kv_b, cos, sin, **dims,
                                        rope_compute_dtype="activation")
    assert any(reason in r for r in fused), fused


def test_the_npu_baseline_rounds_as_asked_on_the_standin():
    """On the torch_npu stand-in (a subprocess, see tests/test_npu_standin.py): a bf16 kv_prolog asking for
    "activation" takes the npu backend's baseline (no stage-2 launch), whose k_pe is the reference's bit
    for bit; the default fp32 rotation still takes the fused stage 2."""
    from test_npu_standin import run

    run("""
        import torch, mla_ops, torch_npu, run_with_standin as d
        from mla_ops.ops.kv_prolog import kv_prolog_reference
        from utils import SMALL, prolog_inputs, prolog_kwargs
        cpu = prolog_inputs(SMALL, torch.bfloat16)
        dev = [a.to("npu") if a is not None else None for a in cpu]
        kwargs = prolog_kwargs(SMALL, rope_layout="half", rope_compute_dtype="activation")
        out = torch.ops.mla.kv_prolog(*dev, **kwargs)
        assert d.STAGE2_CALLS == [], d.STAGE2_CALLS
        assert torch.equal(out[2].cpu(), kv_prolog_reference(*cpu, **kwargs)[2])
        text = mla_ops.explain("kv_prolog", *dev, **kwargs)
        assert "path: torch_npu baseline" in text and "rope_compute_dtype 'activation'" in text, text
        torch.ops.mla.kv_prolog(*dev, **prolog_kwargs(SMALL, rope_layout="half"))
        assert len(d.STAGE2_CALLS) == 1, d.STAGE2_CALLS
    """)
