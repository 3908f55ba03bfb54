"""mla-ops: DeepSeek-V2 multi-head latent attention (MLA) kernels as PyTorch operators.

Importing this package registers every `torch.ops.mla.*` op (schema, reference kernels, fake
kernels, autograd) and imports no NPU, CUDA or PyPTO package.

    import mla_ops, torch
    k_nope, value, k_pe = torch.ops.mla.kv_prolog(hidden, kv_a_w, None, norm_w, kv_b_w, cos, sin,
                                                  num_heads=16, qk_nope_head_dim=128, v_head_dim=128)
"""
from .registration import register_all

register_all()

from . import backends, config  # noqa: E402
from .backends import explain  # noqa: E402
from .config import set_backend, use_backend  # noqa: E402
from .ops.decode_attention import mla_decode_attention  # noqa: E402
from .ops.kv_prolog import kv_prolog, latent_kv_prolog  # noqa: E402
from .ops.paged_kv_cache import gather_pa_kv_cache, gather_pa_kv_cache_into, scatter_pa_kv_cache  # noqa: E402
from .ops.rms_norm import rms_norm  # noqa: E402
from .ops.rope import rope  # noqa: E402

__version__ = "0.1.0"


def patch_deepseek_v2(model=None, **options):
    """Shortcut for `mla_ops.model_patches.deepseek_v2.apply(model, **options)` (imports transformers)."""
    from .model_patches import deepseek_v2

    return deepseek_v2.apply(model, **options)


__all__ = [
    "backends", "config", "explain", "patch_deepseek_v2", "set_backend", "use_backend",
    "rms_norm", "rope", "kv_prolog", "latent_kv_prolog",
    "scatter_pa_kv_cache", "gather_pa_kv_cache", "gather_pa_kv_cache_into", "mla_decode_attention",
]
