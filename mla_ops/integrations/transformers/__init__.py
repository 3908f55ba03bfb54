"""transformers integration: route multi-head latent attention (DeepSeek-V2/V3, the MLA families
built on them, and the sparse attention of DeepSeek-V3.2 and the families built on it) and DeepSeek-V4's
shared-KV attention through `torch.ops.mla`.

    import mla_ops
    handle = mla_ops.patch(model)                  # paged latent cache, absorbed decode
    handle = mla_ops.patch(model, cache="dense")   # full per-head K/V cache, as the original sample
    handle.revert()                                # the stock forwards again

`mla_ops.patch` is `patch.patch` (`apply` here is its deprecated name). Modules: `patch` (the `patch`
function: what is patched, options), `families` (recognising MLA attention classes by structure, and
how each family differs), `releases` (what changed between transformers
releases), `forwards` (the installed forwards), `attention_parts` (pieces every mode and family shares),
`paged_cache` (MLAPagedCache), `paged_attention` (the paged forward, absorbed decode), `indexer`
(DeepSeek Sparse Attention's top-k: the stock indexer's in dense mode, mla.lightning_indexer in paged),
`generation` (model-level cache hooks), `patching` (reversible, scoped attribute patches), `remote_code`
(the hub remote code of DeepSeek-V2), `shared_kv` (DeepSeek-V4: recognition and its forward in both modes)
and `shared_kv_cache` (SharedKvPagedCache, its paged cache).
"""
from . import releases  # noqa: F401 (public: what each transformers release supports)
from .families import MlaFamily, describe, families_of, installed_mla_model_types, is_mla_attention
from .forwards import mla_attention_forward, rms_norm_forward
from .patch import CACHE_MODES, PatchOptions, apply
from .patching import PatchHandle, active_patches, revert
from .releases import ALLOW_UNTESTED_ENV, SUPPORTED_TRANSFORMERS, check_transformers_version
from .remote_code import is_remote_attention, remote_attention_forward

__all__ = ["apply", "revert", "active_patches", "PatchHandle", "PatchOptions", "MLAPagedCache", "SharedKvPagedCache",
           "LatentLayout", "latent_layouts", "CACHE_MODES", "SUPPORTED_TRANSFORMERS", "ALLOW_UNTESTED_ENV",
           "check_transformers_version",
           "is_mla_attention", "is_remote_attention", "mla_attention_forward", "remote_attention_forward",
           "rms_norm_forward", "cache_bytes_per_token_per_layer", "MlaFamily", "describe", "families_of",
           "installed_mla_model_types"]


def __getattr__(name):
    # The paged cache subclasses transformers' Cache API of 4.56+; imported on first use, so the
    # package imports beside any transformers (the hub remote code runs on 4.45).
    if name in ("MLAPagedCache", "LatentLayout", "cache_bytes_per_token_per_layer"):
        from . import paged_cache

        return getattr(paged_cache, name)
    if name == "latent_layouts":
        from .generation import latent_layouts

        return latent_layouts
    if name == "SharedKvPagedCache":
        from .shared_kv_cache import SharedKvPagedCache

        return SharedKvPagedCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
