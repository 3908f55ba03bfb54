"""Route a transformers DeepSeek-V2 model's attention through `torch.ops.mla`, and back.

    from mla_ops.integrations.transformers import deepseek_v2
    handle = deepseek_v2.apply(model)            # this model's attention layers only
    ...                                          # same tokens, through mla.kv_prolog
    handle.revert()                              # the stock forwards again

    with deepseek_v2.apply(kv_prolog=True, rms_norm=True, rope=True):   # class level: models built
        model = DeepseekV2ForCausalLM(config)                           # inside use the ops

Targets:
* transformers' native `DeepseekV2Attention` (supported range `SUPPORTED_TRANSFORMERS`; the forward's
  cache keyword and cache layout changed across 5.x, so other versions are refused at apply time);
* the hub remote-code `DeepseekV2Attention` of `modeling_deepseek.py` (trust_remote_code), found on
  the model instance; patched with `rope_layout="half"`, its `(out, weights, past_key_value)` return
  and `position_ids` / `past_key_value` arguments kept.

Options (each routes one piece; the rest stays stock):
* `kv_prolog` — the KV path (kv_a -> split -> RMSNorm -> kv_b -> split -> RoPE) is one
  `mla.kv_prolog` call on the new tokens, and the full per-head K/V is cached ("dense" cache).
* `rope` — `q_pe` is rotated with `mla.rope` (and `k_pe` too when `kv_prolog=False`).
* `rms_norm` — every DeepseekV2RMSNorm goes through `mla.rms_norm`.
* `cache` — `"dense"` (above) or `"paged"`: the MLA latent cache (see `paged_cache` and `paged_attention`).

cos/sin always come from the model's own rotary embedding (YaRN scaling included), never recomputed.
Memory trade-off of the dense cache: per token and layer it holds N*(P+R) + N*V values (V2-Lite:
16*192 + 16*128 = 5120, 10240 B in bf16) against the latent cache's L+R = 576 (1152 B); the paged
mode keeps the latent.
"""
from __future__ import annotations

import dataclasses
import types
import weakref
from typing import Optional

import torch

from . import generation
from .forwards import native_attention_forward, rms_norm_forward
from .modeling import (
    check_transformers_version,
    has_native_deepseek_v2,
    is_native_attention,
    is_rms_norm,
    native_module,
)
from .paged_attention import ABSORBED_ATTRIBUTE
from .patching import PatchHandle, open_handle
from .remote_code import REMOTE_FLASH_ATTENTION, is_remote_attention, remote_attention_forward

CACHE_MODES = ("dense", "paged")


@dataclasses.dataclass(frozen=True)
class PatchOptions:
    kv_prolog: bool = True
    rms_norm: bool = False
    rope: bool = False
    cache: str = "dense"


def apply(model: Optional[torch.nn.Module] = None, *, kv_prolog: bool = True, rms_norm: bool = False,
          rope: bool = False, cache: str = "dense") -> PatchHandle:
    """Patch DeepSeek-V2 attention (and optionally RMSNorm / RoPE) onto `torch.ops.mla`.

    Args:
        model: a loaded model: patch this instance's modules only (native or hub remote code).
            None: patch transformers' native classes, so models built afterwards use the ops.
        kv_prolog: KV path through `mla.kv_prolog` (dense cache) — see the module docstring.
        rms_norm: every DeepseekV2RMSNorm through `mla.rms_norm`.
        rope: q_pe (and k_pe without kv_prolog) through `mla.rope`.
        cache: "dense" or "paged" (latent paged cache + absorbed decode; native attention only).
    Returns:
        A PatchHandle: `handle.revert()` (or leaving a `with` block) restores the stock forwards.
        Applying again to the same model (or to the classes) first reverts the previous patch there:
        the newest options win.
    """
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a loaded DeepSeek-V2 model), or None to patch the "
                        f"classes; got {type(model).__name__}")
    if not (kv_prolog or rope or rms_norm):
        raise ValueError("nothing to patch: kv_prolog, rope and rms_norm are all False; enable at least one")
    if cache not in CACHE_MODES:
        raise ValueError(f"cache must be one of {CACHE_MODES}, got {cache!r}")
    if cache == "paged" and not kv_prolog:
        raise ValueError("cache='paged' needs kv_prolog=True (the latent prolog feeds the paged cache)")
    options = PatchOptions(kv_prolog=kv_prolog, rms_norm=rms_norm, rope=rope, cache=cache)
    # Everything that can refuse this model is checked before the previous patch is touched.
    if model is None or not _only_remote_code(model):
        check_transformers_version()  # the native classes' forward and cache API are version-specific
    targets = None if model is None else _instance_targets(model, options)
    scope = "classes" if model is None else weakref.ref(model)
    handle = open_handle(options, scope, derived=(ABSORBED_ATTRIBUTE,))
    try:
        _patch(handle, model, targets, options)
    except BaseException:
        handle.revert()
        raise
    return handle


def _only_remote_code(model: torch.nn.Module) -> bool:
    """Whether `model` holds the hub remote code's attention and nothing from transformers' own
    DeepSeek-V2: then the patch needs nothing version-specific from the installed transformers."""
    modules = list(model.modules())
    return (any(is_remote_attention(m) for m in modules)
            and not any(type(m).__module__.startswith("transformers.models.deepseek_v2.") for m in modules))


def _instance_targets(model: torch.nn.Module, options: PatchOptions) -> list:
    """(module, forward) pairs to patch in `model`; raises, touching nothing, if it cannot be patched."""
    patch_attention = options.kv_prolog or options.rope
    targets, found_attention, decoder_found = [], False, False
    native_model_class = native_module().DeepseekV2Model if has_native_deepseek_v2() else ()
    for module in model.modules():
        decoder_found |= bool(native_model_class) and isinstance(module, native_model_class)
        if patch_attention and is_native_attention(module):
            targets.append((module, native_attention_forward))
            found_attention = True
        elif patch_attention and is_remote_attention(module):
            if options.cache == "paged":
                raise NotImplementedError("cache='paged' supports transformers' native DeepseekV2Attention only; "
                                          "this model uses the hub remote code")
            if not options.kv_prolog:
                raise ValueError("the hub remote-code attention is routed through mla.kv_prolog: use "
                                 "kv_prolog=True (rope=True and rms_norm=True can be added)")
            targets.append((module, remote_attention_forward))
            found_attention = True
        elif patch_attention and type(module).__name__ == REMOTE_FLASH_ATTENTION:
            raise NotImplementedError("the hub remote code's DeepseekV2FlashAttention2 takes flash-attention "
                                      "masks this patch does not build: load the model with "
                                      "attn_implementation='eager', or use transformers' native DeepSeek-V2")
        elif options.rms_norm and is_rms_norm(module):
            targets.append((module, rms_norm_forward))
    if patch_attention and not found_attention:
        raise ValueError(f"no DeepSeek-V2 attention module found in {type(model).__name__}: expected "
                         f"transformers' DeepseekV2Attention or the hub remote code's (modeling_deepseek.py)")
    if options.cache == "paged" and not decoder_found:
        raise ValueError(f"cache='paged' needs a transformers DeepseekV2Model inside {type(model).__name__}")
    if not targets:  # rms_norm alone on a model without DeepSeek-V2 norms: a patch that does nothing
        raise ValueError(f"model: no DeepSeek-V2 module to patch in {type(model).__name__} (rms_norm=True looks "
                         f"for DeepseekV2RMSNorm); pass a DeepSeek-V2 model")
    return targets


def _patch(handle: PatchHandle, model, targets, options: PatchOptions) -> None:
    hf = native_module()
    if model is None:
        if options.kv_prolog or options.rope:
            handle.set(hf.DeepseekV2Attention, "_mla_ops_options", options)
            handle.set(hf.DeepseekV2Attention, "forward", native_attention_forward)
            # copies of a class-patched model follow the class; only the derived copies stay behind
            handle.set(hf.DeepseekV2Attention, "__getstate__", _state_without_absorbed)
            handle.patched_modules += 1
        if options.rms_norm:
            handle.set(hf.DeepseekV2RMSNorm, "forward", rms_norm_forward)
            handle.patched_modules += 1
    else:
        for module, forward in targets:
            if forward is not rms_norm_forward:
                handle.set(module, "_mla_ops_options", options, in_dict=True)
            handle.set(module, "forward", types.MethodType(forward, module), in_dict=True)
            handle.patched_modules += 1
    if options.cache == "paged":
        generation.install_cache_factory(hf.DeepseekV2Model if model is None else model, handle)
    # (a dense instance patch needs no hook of its own: a class-level paged hook defers to its options)


def _state_without_absorbed(self) -> dict:
    """DeepseekV2Attention's pickling state without the absorbed weight copies the paged decode made."""
    state = torch.nn.Module.__getstate__(self)
    state.pop(ABSORBED_ATTRIBUTE, None)
    return state
