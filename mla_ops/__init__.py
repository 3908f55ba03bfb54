"""mla-ops: multi-head latent attention (MLA) kernels as PyTorch operators, `torch.ops.mla.*`.

Importing this package defines every op (schema, fake, reference kernel, autograd: `mla_ops.ops`),
binds the backends' kernels (`mla_ops.backends`) and imports no NPU, CUDA or PyPTO package.

    import mla_ops, torch
    k_nope, value, k_pe = torch.ops.mla.kv_prolog(hidden, kv_a_w, None, norm_w, kv_b_w, cos, sin,
                                                  num_heads=16, qk_nope_head_dim=128, v_head_dim=128)
"""
from . import ops  # noqa: F401,I001  (defines the ops before the backends bind kernels to them)
from . import backends, settings
from .backends import explain
from .ops import (
    gather_pa_kv_cache,
    gather_pa_kv_cache_into,
    kv_prolog,
    latent_kv_prolog,
    lightning_indexer,
    mla_decode_attention,
    q_prolog,
    rms_norm,
    rope,
    scatter_pa_cache,
    scatter_pa_kv_cache,
    sparse_mla_attention,
    to_global_slots,
)
from .settings import set_backend, use_backend

backends.bind()

__version__ = "0.1.0"


def patch_deepseek_v2(model=None, **options):
    """Shortcut for `mla_ops.integrations.transformers.apply(model, **options)` (imports transformers)."""
    from .integrations import transformers

    return transformers.apply(model, **options)


__all__ = [
    "backends", "settings", "explain", "patch_deepseek_v2", "set_backend", "use_backend",
    "rms_norm", "rope", "kv_prolog", "latent_kv_prolog", "q_prolog",
    "scatter_pa_kv_cache", "gather_pa_kv_cache", "gather_pa_kv_cache_into", "mla_decode_attention",
    "scatter_pa_cache", "lightning_indexer", "sparse_mla_attention", "to_global_slots",
]
