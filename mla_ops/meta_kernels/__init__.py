"""Fake (meta) kernels: shape / dtype / stride inference plus sync-free validation for every
`mla::` op. One module per op family, named like its twin in `mla_ops/ops/`. The `check_*_args`
functions are shared with the eager kernels, so a bad call fails with the same message eagerly and
under torch.compile / export."""
from .decode_attention import _mla_decode_attention_fake
from .kv_prolog import _kv_prolog_fake, _latent_kv_prolog_fake
from .paged_kv_cache import (
    _gather_pa_kv_cache_fake,
    _gather_pa_kv_cache_functional_fake,
    _scatter_pa_kv_cache_fake,
)
from .rms_norm import _rms_norm_fake
from .rope import _rope_fake

FAKE_KERNELS = {
    "rms_norm": _rms_norm_fake,
    "rope": _rope_fake,
    "kv_prolog": _kv_prolog_fake,
    "latent_kv_prolog": _latent_kv_prolog_fake,
    "scatter_pa_kv_cache": _scatter_pa_kv_cache_fake,
    "gather_pa_kv_cache": _gather_pa_kv_cache_fake,
    "gather_pa_kv_cache_functional": _gather_pa_kv_cache_functional_fake,
    "mla_decode_attention": _mla_decode_attention_fake,
}
