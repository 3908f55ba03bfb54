"""What the patch needs from transformers that changed between releases, named by release.

transformers ships DeepSeek-V2 natively from 4.54.0. Across 4.54 -> 5.x the attention forward's
cache keyword (`past_key_value` -> `past_key_values` -> `cache`), the way a cache layer is told
where to write (`cache_kwargs` with `cache_position` -> the forward's kwargs) and the lookup of the
attention implementation (`ALL_ATTENTION_FUNCTIONS[name]` with an eager default ->
`ALL_ATTENTION_FUNCTIONS.get_interface(name, eager)`) changed. Everything else the patch touches is
read off the modules themselves (see `families`). One `Release` is chosen once, at apply time, and
travels with the patched layers.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

FIRST_NATIVE = "4.54.0"  # the first transformers with models/deepseek_v2
NEWEST_TESTED = "5.24.0"
SUPPORTED_TRANSFORMERS = (FIRST_NATIVE, "5.25.0")  # [min, max): the releases this patch is tested on
ALLOW_UNTESTED_ENV = "MLA_OPS_ALLOW_UNTESTED_TRANSFORMERS"


def _lookup_by_key(modeling, implementation: str) -> Callable:
    """4.54 - 5.x before get_interface: eager unless another implementation is registered by name."""
    if implementation == "eager":
        return modeling.eager_attention_forward
    return modeling.ALL_ATTENTION_FUNCTIONS[implementation]


def _lookup_get_interface(modeling, implementation: str) -> Callable:
    return modeling.ALL_ATTENTION_FUNCTIONS.get_interface(implementation, modeling.eager_attention_forward)


def _update_with_cache_position(cache, key, value, layer_idx: int, cache_position, extra: dict):
    """4.x: `update(key, value, layer_idx, cache_kwargs)`; static caches read `cache_position` there."""
    return cache.update(key, value, layer_idx, {"cache_position": cache_position})


def _update_with_kwargs(cache, key, value, layer_idx: int, cache_position, extra: dict):
    """5.x: `update(key, value, layer_idx, kwargs=...)` with the forward's own kwargs."""
    if cache_position is not None and "cache_position" not in extra:
        extra = {**extra, "cache_position": cache_position}
    return cache.update(key, value, layer_idx, kwargs=extra)


@dataclasses.dataclass(frozen=True)
class Release:
    """One range of transformers releases, as the patch sees it."""

    first: str  # the first release of the range
    attention_function: Callable  # (modeling module, implementation name) -> attention function
    update_cache: Callable  # (cache, key, value, layer_idx, cache_position, extra kwargs) -> (key, value)
    paged: bool  # MLAPagedCache works: the Cache API it implements (update(*args, **kwargs), 5.4+)
    model_cache_keyword: str  # the decoder model's cache keyword, and generate's model_kwargs key


# Newest first; a release belongs to the first entry it is not older than.
#  5.24: the forwards take `cache=` (was `past_key_values=`), and generate hands the model
#        `model_kwargs["cache"]`.
#  5.4:  Cache.update(key, value, layer_idx, *args, **kwargs) and get_mask_sizes(query_length): the
#        API MLAPagedCache implements; before, a `cache_kwargs` dict and a cache_position tensor.
#  5.1:  ALL_ATTENTION_FUNCTIONS.get_interface(name, default).
#  4.54: the first native DeepSeek-V2 (forward keyword `past_key_value`; `past_key_values` from 4.56).
RELEASES = (
    Release("5.24.0", _lookup_get_interface, _update_with_kwargs, paged=True, model_cache_keyword="cache"),
    Release("5.4.0", _lookup_get_interface, _update_with_kwargs, paged=True, model_cache_keyword="past_key_values"),
    Release("5.1.0", _lookup_get_interface, _update_with_cache_position, paged=False,
            model_cache_keyword="past_key_values"),
    Release(FIRST_NATIVE, _lookup_by_key, _update_with_cache_position, paged=False,
            model_cache_keyword="past_key_values"),
)
PAGED_SINCE = next(r.first for r in reversed(RELEASES) if r.paged)


def installed_version() -> str:
    import transformers

    return transformers.__version__


@functools.lru_cache(maxsize=None)
def release_for(version: str) -> Release:
    from packaging.version import Version

    for release in RELEASES:
        if Version(version) >= Version(release.first):
            return release
    return RELEASES[-1]


def check_transformers_version() -> str:
    """Raise a clear error unless the installed transformers is in SUPPORTED_TRANSFORMERS."""
    from packaging.version import Version

    version = installed_version()
    low, high = (Version(v) for v in SUPPORTED_TRANSFORMERS)
    if not (low <= Version(version) < high) and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise RuntimeError(
            f"mla_ops.integrations.transformers supports transformers >= {SUPPORTED_TRANSFORMERS[0]} (the first "
            f"with a native DeepSeek-V2), < {SUPPORTED_TRANSFORMERS[1]} (the newest tested: {NEWEST_TESTED}); found "
            f"{version}. Install a transformers in that range, or set {ALLOW_UNTESTED_ENV}=1 to try anyway. (The hub "
            f"remote code of DeepSeek-V2, trust_remote_code=True, is patched on any transformers that runs it.)")
    return version


def check_paged_supported(release: Release) -> None:
    if not release.paged:
        raise NotImplementedError(
            f"cache='paged' needs transformers >= {PAGED_SINCE} (the Cache API MLAPagedCache implements); "
            f"found {installed_version()}. Use cache='dense' (served on transformers >= {FIRST_NATIVE}), "
            f"or upgrade transformers")


def current_release() -> Release:
    """The Release of the installed transformers (after check_transformers_version)."""
    return release_for(installed_version())
