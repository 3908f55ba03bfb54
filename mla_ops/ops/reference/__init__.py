"""Torch reference kernels: the CPU kernels, the CompositeExplicitAutograd kernels for any other
device, and the ground truth for every other backend. One module per op family."""
from .decode_attention import mla_decode_attention
from .kv_prolog import kv_prolog, latent_kv_prolog
from .paged_kv_cache import gather_pa_kv_cache, gather_pa_kv_cache_functional, scatter_pa_kv_cache
from .rms_norm import rms_norm
from .rope import rope

REFERENCE_KERNELS = {
    "rms_norm": rms_norm,
    "rope": rope,
    "kv_prolog": kv_prolog,
    "latent_kv_prolog": latent_kv_prolog,
    "scatter_pa_kv_cache": scatter_pa_kv_cache,
    "gather_pa_kv_cache": gather_pa_kv_cache,
    "gather_pa_kv_cache_functional": gather_pa_kv_cache_functional,
    "mla_decode_attention": mla_decode_attention,
}

KERNELS = REFERENCE_KERNELS
