"""Autograd beyond the case database's gradcheck / inference-only refusal for every sample
(tests/test_cases.py): the prolog's backward with unused outputs against torch's own autograd, and the
version counter of a cache written in place."""
import torch

import mla_ops

from utils import SMALL, paged_case, prolog_inputs, prolog_kwargs


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


def test_mutating_op_bumps_version_counter():
    kc, vc, *_ = paged_case(4, 4, [3], key_shape=(1, 8), value_shape=(1, 4), dtype=torch.float32)
    before = kc._version
    torch.ops.mla.scatter_pa_kv_cache(torch.randn(2, 1, 8), torch.randn(2, 1, 4), kc, vc, torch.tensor([0, 5]))
    assert kc._version > before
