"""Autograd: gradcheck in fp64 for the four differentiable ops; a clear error
for the inference-only ones."""
import pytest
import torch
from torch.autograd import gradcheck

import mla_ops

from utils import SMALL, paged_case, prolog_inputs, prolog_kwargs


def _f64(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


def test_rms_norm_gradcheck():
    assert gradcheck(lambda x, w: mla_ops.rms_norm(x, w, 1e-6), (_f64(2, 3, 12), _f64(12)))


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("table_shape", [(2, 3, 4), (1, 3, 4), (3, 4)], ids=["BSR", "1SR", "SR"])
def test_rope_gradcheck(layout, table_shape):
    cos, sin = _f64(*table_shape), _f64(*table_shape)
    assert gradcheck(lambda x, c, s: mla_ops.rope(x, c, s, layout=layout), (_f64(2, 5, 3, 8), cos, sin))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("bias", [False, True])
def test_kv_prolog_gradcheck(layout, bias):
    # cos/sin too: their gradients are part of the registered backward
    args = tuple(a.detach().requires_grad_() if a is not None else None
                 for a in prolog_inputs(SMALL, torch.float64, bias=bias))
    fn = lambda *a: mla_ops.kv_prolog(*a, **prolog_kwargs(SMALL, rope_layout=layout))  # noqa: E731
    assert gradcheck(fn, args)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_latent_kv_prolog_gradcheck(layout):
    hidden, kv_a, _, norm_w, _, cos, sin = prolog_inputs(SMALL, torch.float64)
    args = tuple(a.detach().requires_grad_() for a in (hidden, kv_a, norm_w, cos, sin))
    fn = lambda h, a, n, c, s: mla_ops.latent_kv_prolog(h, a, None, n, c, s, rope_layout=layout)  # noqa: E731
    assert gradcheck(fn, args)


def test_kv_prolog_backward_with_unused_outputs():
    """Only value used in the loss: the registered backward (whose other output grads are missing
    or zeros) gives what torch's own autograd gives through the same forward written in torch ops."""
    from mla_ops.ops.kv_prolog import expand_latent, latent_stage

    inputs = prolog_inputs(SMALL, torch.float64)
    args = [a.detach().requires_grad_() if a is not None else None for a in inputs]
    _, value, _ = mla_ops.kv_prolog(*args, **prolog_kwargs(SMALL))
    (value * torch.linspace(-1, 1, value.numel(), dtype=value.dtype).view(value.shape)).sum().backward()
    plain = [a.detach().requires_grad_() if a is not None else None for a in inputs]
    hidden, kv_a, kv_a_bias, norm_w, kv_b = plain[:5]
    _, latent, _ = latent_stage(hidden, kv_a, kv_a_bias, norm_w, 1e-6)
    _, expected_value = expand_latent(latent, kv_b, SMALL.N, SMALL.P, SMALL.V)
    (expected_value * torch.linspace(-1, 1, value.numel(), dtype=value.dtype).view(value.shape)).sum().backward()
    for name, got, want in zip(("hidden", "kv_a", "kv_norm", "kv_b"), (args[0], args[1], args[3], args[4]),
                               (hidden, kv_a, norm_w, kv_b)):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12, msg=name)


def _inference_only_calls():
    kc, vc, tables, cumsum, _ = paged_case(4, 4, [3, 2], key_shape=(1, 8), value_shape=(1, 4), dtype=torch.float32)
    key = torch.randn(5, 1, 8, requires_grad=True)
    value = torch.randn(5, 1, 4)
    return {
        "scatter_pa_kv_cache": lambda: torch.ops.mla.scatter_pa_kv_cache(key, value, kc, vc, torch.arange(5)),
        "gather_pa_kv_cache": lambda: torch.ops.mla.gather_pa_kv_cache(
            kc.requires_grad_(), vc, tables, cumsum, key.detach().clone(), value.clone(), is_seq_lens_cumsum=True),
        "gather_pa_kv_cache_functional": lambda: torch.ops.mla.gather_pa_kv_cache_functional(
            kc, vc, tables, cumsum, key, value, is_seq_lens_cumsum=True),
        "mla_decode_attention": lambda: torch.ops.mla.mla_decode_attention(
            torch.randn(2, 2, 8, requires_grad=True), torch.randn(2, 2, 4), kc.detach(), vc, tables,
            torch.tensor([3, 2]), 0.5),
    }


@pytest.mark.parametrize("op", list(_inference_only_calls()))
def test_inference_only_ops_refuse_gradients_clearly(op):
    with pytest.raises(RuntimeError, match=rf"mla\.{op} is inference-only.*torch\.no_grad"):
        _inference_only_calls()[op]()
    with torch.no_grad():
        _inference_only_calls()[op]()  # the same call runs without grad


def test_mutating_op_bumps_version_counter():
    kc, vc, *_ = paged_case(4, 4, [3], key_shape=(1, 8), value_shape=(1, 4), dtype=torch.float32)
    before = kc._version
    torch.ops.mla.scatter_pa_kv_cache(torch.randn(2, 1, 8), torch.randn(2, 1, 4), kc, vc, torch.tensor([0, 5]))
    assert kc._version > before
