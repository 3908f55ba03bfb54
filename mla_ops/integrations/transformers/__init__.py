"""transformers integration: route DeepSeek-V2's multi-head latent attention through `torch.ops.mla`.

    from mla_ops.integrations import transformers as mla_transformers
    handle = mla_transformers.apply(model)                 # this model's attention layers only
    handle = mla_transformers.apply(model, cache="paged")  # + paged latent cache, absorbed decode
    handle.revert()                                        # the stock forwards again

Modules: `deepseek_v2` (apply: what is patched, options), `forwards` (the installed forwards),
`attention_parts` (pieces both cache modes share), `paged_cache` (MLAPagedCache),
`paged_attention` (the paged forward, absorbed decode), `generation` (model-level cache hooks),
`patching` (reversible, scoped attribute patches), `modeling` (finding transformers' classes).
"""
from .deepseek_v2 import CACHE_MODES, PatchOptions, apply
from .forwards import native_attention_forward, rms_norm_forward
from .modeling import (
    ALLOW_UNTESTED_ENV,
    SUPPORTED_TRANSFORMERS,
    check_transformers_version,
    is_native_attention,
)
from .paged_cache import MLAPagedCache, cache_bytes_per_token_per_layer
from .patching import PatchHandle, active_patches, revert
from .remote_code import is_remote_attention, remote_attention_forward

__all__ = ["apply", "revert", "active_patches", "PatchHandle", "PatchOptions", "MLAPagedCache", "CACHE_MODES",
           "SUPPORTED_TRANSFORMERS", "ALLOW_UNTESTED_ENV", "check_transformers_version", "is_native_attention",
           "is_remote_attention", "native_attention_forward", "remote_attention_forward", "rms_norm_forward",
           "cache_bytes_per_token_per_layer"]
