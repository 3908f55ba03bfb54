"""Route a transformers MLA model's attention through `torch.ops.mla`, and back: `patch` (which is
`mla_ops.patch`; its docstring documents every option).

    import mla_ops
    handle = mla_ops.patch(model)                     # this model's attention layers, latent paged cache
    ...                                               # same tokens, through the mla ops
    handle.revert()                                   # the stock forwards again

    with mla_ops.patch(family="deepseek_v3", rms_norm=True):   # class level: models built inside use
        model = DeepseekV3ForCausalLM(config)                  # the ops

Targets:
* transformers' own MLA attention classes (DeepSeek-V2, DeepSeek-V3 and the families built on its
  forward), recognised by structure (`families`) on transformers `SUPPORTED_TRANSFORMERS`, model types built
  from another family's classes included (`families.borrowed_model_types`); DeepSeek Sparse Attention with
  DeepSeek-V3.2's indexer (DeepSeek-V3.2, AXK2, dots3_note, Mistral-Large-4, GLM-5 and its "shared" indexer layers:
  the dense mode selects with the stock indexer itself, the paged mode through `mla.lightning_indexer`
  and decodes through `mla.sparse_mla_attention`, see `indexer`); other indexers and forwards doing
  something the patch does not reproduce are refused with the reason (an indexer is also run once on a
  random input at patch time, to check it picks what DeepSeek-V3.2's does);
* DeepSeek-V4's shared-KV attention (`shared_kv`), recognised by structure as well: kv_prolog=True routes
  it as a whole (prologs, compressors, indexer, inverse RoPE; with cache="paged" the attention and a
  `SharedKvPagedCache` too);
* the hub remote code's `DeepseekV2Attention` of `modeling_deepseek.py` (trust_remote_code), found on
  the model instance, on whatever transformers runs it (`remote_code`; dense cache only).

cos/sin always come from the model's own rotary embedding (YaRN scaling included), never recomputed.
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import types
import typing
import warnings
import weakref
from typing import Optional

import torch

from ..._checks import ROPE_COMPUTE_DTYPES
from . import families
from .attention_parts import PATCH_ATTRIBUTE, LayerPatch
from .families import MlaFamily, describe, families_of, is_mla_attention, is_rms_norm_class, norm_refusal
from .forwards import mla_attention_forward, rms_norm_forward
from .indexer import indexer_refusal
from .paged_attention import ABSORBED_ATTRIBUTE
from .patching import PatchHandle, open_handle
from .releases import check_paged_supported, check_transformers_version, current_release
from .remote_code import REMOTE_FLASH_ATTENTION, is_remote_attention, remote_attention_forward, stock_rope_compute_dtype
from .shared_kv import is_shared_kv_attention, layer_refusal, shared_kv_attention_forward

CACHE_MODES = ("dense", "paged")
# "stock": the rounding of the model's own forward; or one of the ops' rope_compute_dtype values
PATCH_ROPE_COMPUTE_DTYPES = ("stock", *ROPE_COMPUTE_DTYPES)
DEFAULT_FAMILY = "deepseek_v2"  # the class-level patch's family when none is named


@dataclasses.dataclass(frozen=True)
class PatchOptions:
    """The options of `patch` and their defaults (this class is their one home; `patch` documents them).
    Raises TypeError for a flag that is not a bool, and ValueError for a value or a combination `patch`
    cannot apply, each naming the option."""

    kv_prolog: bool = True
    rms_norm: bool = False
    rope: bool = False
    cache: str = "paged"
    q_prolog: bool = False
    rope_compute_dtype: str = "stock"

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if typing.get_type_hints(PatchOptions)[field.name] is bool and not isinstance(value, bool):
                raise TypeError(f"{field.name} must be True or False, got {value!r}")
        if not (self.kv_prolog or self.rope or self.rms_norm or self.q_prolog):
            raise ValueError("nothing to patch: kv_prolog, q_prolog, rope and rms_norm are all False; enable one")
        if self.cache not in CACHE_MODES:
            raise ValueError(f"cache must be one of {CACHE_MODES}, got {self.cache!r}")
        if self.cache == "paged" and not self.kv_prolog:
            raise ValueError("cache='paged' needs kv_prolog=True (the latent prolog feeds the paged cache); with "
                             "kv_prolog=False pass cache='dense' (the model's own cache)")
        if self.rope_compute_dtype not in PATCH_ROPE_COMPUTE_DTYPES:
            raise ValueError(f"rope_compute_dtype must be one of {PATCH_ROPE_COMPUTE_DTYPES} (\"stock\": round RoPE "
                             f"as the model's own forward does; \"float32\": rotate in fp32), got "
                             f"{self.rope_compute_dtype!r}")

    @classmethod
    def from_keywords(cls, options: dict) -> "PatchOptions":
        """The options given to `patch` by keyword; an unknown name is a TypeError that names it."""
        known = [field.name for field in dataclasses.fields(cls)]
        for name in options:
            if name not in known:
                close = difflib.get_close_matches(name, known + ["family"], n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise TypeError(f"patch() got an unknown option {name!r}{hint}; its options are model, family, "
                                f"{', '.join(known)}")
        return cls(**options)


def patch(model: Optional[torch.nn.Module] = None, *, family: Optional[str] = None, **options) -> PatchHandle:
    """Patch a model's MLA attention (and optionally its RMSNorms / RoPE) onto `torch.ops.mla`.

    Each option routes one piece through the ops; the rest stays stock. The defaults are `PatchOptions`'
    (the signature shows them).

    Args:
        model: a loaded model: patch this instance's modules only (any supported MLA family, or the
            hub remote code). None: patch the classes of `family`, so models built afterwards use the ops.
        family: class level only: the transformers model_type whose classes to patch (default
            "deepseek_v2"; `mla-ops info` lists the installed MLA families).
        kv_prolog: the KV path (kv_a -> split -> RMSNorm -> kv_b -> split -> RoPE) in one `mla.kv_prolog`
            call on the new tokens (`mla.latent_kv_prolog` with cache="paged").
        rms_norm: the family's RMSNorm modules through `mla.rms_norm`.
        rope: q_pe (and k_pe with kv_prolog=False) rotated with `mla.rope`.
        cache: "paged": the MLA latent cache, kv_lora_rank + rope dims per token and layer (V2-Lite:
            512 + 64 = 576 values, 1152 B in bf16), in blocks, decoded by the absorbed attention
            (`mla.mla_decode_attention`; `mla.sparse_mla_attention` under DeepSeek Sparse Attention); needs
            kv_prolog=True and transformers' own MLA classes on a release `releases` marks paged
            (`releases.PAGED_SINCE` on); no beam search. "dense": transformers' cache holds the full
            per-head K/V, N*(P+R) + N*V values per token and layer (V2-Lite: 16*192 + 16*128 = 5120,
            10240 B in bf16); every target, the hub remote code included; with kv_prolog=False, the
            model's own cache. DeepSeek-V4: "paged" is a `SharedKvPagedCache` (window rows, compressed
            entries and compressor states in block pools, attention by `mla.shared_kv_attention`;
            batches without padding), "dense" its own cache (`shared_kv`).
        q_prolog: the query path (q_a -> RMSNorm -> q_b, or q_proj -> split -> RoPE) in one `mla.q_prolog`
            call.
        rope_compute_dtype: where the ops round the RoPE they compute (k_pe in the prologs, q_pe with
            rope=True, q_prolog=True or cache="paged"; with rope=False the dense mode leaves q_pe to the
            stock function). "stock": as the model's own forward, read off its RoPE function
            (DeepSeek-V2: fp32 complex multiplication; DeepSeek-V3, its family and the hub remote code:
            in the model's dtype), so fp16 / bf16 models give stock's logits bit for bit. "float32":
            rotate in fp32 and round once (more accurate in fp16 / bf16, no longer bit-identical to a
            stock that rounds in its dtype; on the NPU the only rounding the fused PyPTO stage 2 computes).
            "activation": cast cos/sin to the model's dtype and round every product and sum to it.
            In an fp32 model all three rotate in fp32 ("float32" may differ from the elementwise stock
            formula by an ulp in rows of fewer than 8 rotation pairs, where ATen's complex multiply fuses).
    Returns:
        A PatchHandle: `handle.revert()` (or leaving a `with` block) restores the stock forwards.
        Patching the same model (or the classes) again first reverts the previous patch there: the
        newest options win.
    Raises:
        TypeError: an unknown option, a flag that is not a bool, or a model that is not a torch.nn.Module.
        ValueError / NotImplementedError: options or a model the patch cannot apply, with the reason;
            nothing is patched then.
    """
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a loaded MLA model), or None to patch the classes; "
                        f"got {type(model).__name__}")
    if model is not None and family is not None:
        raise ValueError("family= names the classes to patch when model is None; with a model, the patch finds "
                         "its families itself: drop family=")
    resolved = PatchOptions.from_keywords(options)
    # Everything that can refuse this model is checked before the previous patch is touched.
    if model is None:
        targets = _class_targets(family or DEFAULT_FAMILY, resolved)
    else:
        targets = _instance_targets(model, resolved)
    scope = "classes" if model is None else weakref.ref(model)
    handle = open_handle(resolved, scope, derived=(ABSORBED_ATTRIBUTE,))
    try:
        _patch(handle, model, targets)
    except BaseException:
        handle.revert()
        raise
    return handle


# The signature help() and editors show: the options with PatchOptions' defaults.
patch.__signature__ = inspect.Signature(
    [inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                       annotation=Optional[torch.nn.Module]),
     inspect.Parameter("family", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Optional[str])]
    + [inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default,
                         annotation=typing.get_type_hints(PatchOptions)[field.name])
       for field in dataclasses.fields(PatchOptions)],
    return_annotation=PatchHandle)


# The cache mode the former names of `patch` default to: they keep the behaviour their callers wrote for.
FORMER_DEFAULT_CACHE = "dense"


def deprecation_message(former_name: str) -> str:
    """What a former name of `patch` warns (DeprecationWarning)."""
    return (f"{former_name} is deprecated: use mla_ops.patch (the same options; it defaults to "
            f"cache={PatchOptions.cache!r}, where {former_name} keeps cache={FORMER_DEFAULT_CACHE!r})")


def patch_under_former_name(former_name: str, model: Optional[torch.nn.Module], options: dict) -> PatchHandle:
    """`patch` called through a deprecated name: warns, and keeps that name's default cache mode."""
    warnings.warn(deprecation_message(former_name), DeprecationWarning, stacklevel=3)
    return patch(model, **{"cache": FORMER_DEFAULT_CACHE, **options})


def apply(model: Optional[torch.nn.Module] = None, **options) -> PatchHandle:
    """Deprecated name of `patch` (`mla_ops.patch`): the same options; `cache` defaults to "dense"."""
    return patch_under_former_name("mla_ops.integrations.transformers.apply", model, options)


@dataclasses.dataclass
class _Targets:
    attention: list  # (module or class, LayerPatch; its family is None for the remote code)
    norms: list  # modules or classes
    decoders: list  # (decoder module, the model holding it), or (decoder class, its generating classes)


def _attention_patch(family: MlaFamily, options: PatchOptions, release) -> LayerPatch:
    if family.refused:
        raise NotImplementedError(f"{family.name} cannot be patched: {family.refused}")
    if family.shared_kv:
        return _shared_kv_patch(family, options, release)
    if options.q_prolog and family.lora_scales:
        raise ValueError(f"q_prolog=True: {family.name} scales q between q_b_proj and RoPE, which mla.q_prolog "
                         f"does not; use q_prolog=False (rope=True routes its RoPE)")
    if options.q_prolog and family.latent_scales:
        raise ValueError(f"q_prolog=True: {family.name} scales the normed q latent before q_b_proj (q_lora_scale), "
                         f"which mla.q_prolog does not; use q_prolog=False (rope=True routes its RoPE)")
    if not options.kv_prolog and family.shared_latent_kv:
        raise ValueError(f"kv_prolog=False: {family.name}'s layers share one latent KV cache, which the patch computes "
                         f"with mla.latent_kv_prolog; pass kv_prolog=True")
    if options.q_prolog and family.output_gate is not None and family.output_gate.from_query:
        raise ValueError(f"q_prolog=True: {family.name} projects its query and output gate together from "
                         f"cat(q_a_layernorm(q_a), q_a) ({family.output_gate.module}), which mla.q_prolog does not; "
                         f"use q_prolog=False (rope=True routes its RoPE)")
    return LayerPatch(options, family, release)


def _shared_kv_patch(family: MlaFamily, options: PatchOptions, release) -> LayerPatch:
    """DeepSeek-V4's attention is patched as a whole (both prologs with their RoPE, the compressors, the
    indexer, the inverse RoPE; paged: the attention too): kv_prolog=True routes it, q_prolog and rope are
    part of it; rms_norm and a rope_compute_dtype other than "stock" are refused."""
    if not options.kv_prolog:
        raise ValueError(f"kv_prolog=False: {family.name} is patched as a whole (its prologs with their RoPE, "
                         f"compressors, indexer and inverse RoPE on the ops); pass kv_prolog=True")
    if options.rms_norm:
        raise ValueError(f"rms_norm=True: {family.name}'s RMSNorm multiplies by its fp32 weight before rounding, "
                         f"which mla.rms_norm does not reproduce (its prolog ops compute the attention's norms); "
                         f"pass rms_norm=False")
    if options.rope_compute_dtype != "stock":
        raise ValueError(f"rope_compute_dtype={options.rope_compute_dtype!r}: {family.name}'s ops rotate as its "
                         f"stock forward does (fp32, rounded once); leave rope_compute_dtype='stock'")
    return LayerPatch(options, family, release)


def _class_targets(model_type: str, options: PatchOptions) -> _Targets:
    check_transformers_version()
    try:
        found = families_of(model_type)
    except ModuleNotFoundError:
        raise ValueError(f"family={model_type!r}: transformers has no model_type {model_type!r} (mla-ops info lists "
                         f"the installed MLA families)") from None
    if not found:
        raise ValueError(f"family={model_type!r}: that model has no multi-head latent attention")
    release = current_release()
    if options.cache == "paged":
        check_paged_supported(release)
    modeling = found[0].modeling
    attention = [(f.attention, _attention_patch(f, options, release)) for f in found] \
        if options.kv_prolog or options.rope or options.q_prolog else []
    norms = [cls for name, cls in vars(modeling).items()
             if options.rms_norm and isinstance(cls, type) and name.endswith("RMSNorm")
             and cls.__module__ == modeling.__name__ and "forward" in vars(cls) and is_rms_norm_class(cls)]
    decoders = []
    if options.cache == "paged":
        model_class, generators = found[0].model_classes()
        # a model type built from another family's classes (a multimodal wrapper) generates through its own
        generators += tuple(cls for cls in _own_generation_classes(model_type) if cls not in generators)
        decoders.append((model_class, generators))
    return _Targets(attention, norms, decoders)


def _own_generation_classes(model_type: str) -> list:
    """The generating classes (GenerationMixin) of `model_type`'s own modeling module, where it borrows its
    attention from another family's (`families.borrowed_model_types`); [] otherwise."""
    import importlib

    if families.modeling_model_type(model_type) == model_type:
        return []
    from transformers import GenerationMixin

    try:
        modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ModuleNotFoundError:  # a config-only model type: the family's own classes generate
        return []
    return [obj for obj in vars(modeling).values() if isinstance(obj, type) and obj.__module__ == modeling.__name__
            and issubclass(obj, GenerationMixin)]


def _instance_targets(model: torch.nn.Module, options: PatchOptions) -> _Targets:
    """What to patch in `model`; raises, touching nothing, if it cannot be patched."""
    patch_attention = options.kv_prolog or options.rope or options.q_prolog
    attention, found_attention, native, release, probed = [], False, False, None, set()
    for module in model.modules():
        if is_remote_attention(module):
            if options.cache == "paged":
                raise NotImplementedError("cache='paged' supports transformers' own MLA attention classes only; "
                                          "this model uses the hub remote code: pass cache='dense'")
            if patch_attention and (not options.kv_prolog or options.q_prolog):
                raise ValueError("the hub remote-code attention is routed through mla.kv_prolog: use "
                                 "kv_prolog=True and q_prolog=False (rope=True and rms_norm=True can be added)")
            found_attention = True
            if patch_attention:
                attention.append((module, LayerPatch(options, None, None, stock_rope_compute_dtype(module))))
        elif type(module).__name__ == REMOTE_FLASH_ATTENTION and patch_attention:
            raise NotImplementedError("the hub remote code's DeepseekV2FlashAttention2 takes flash-attention "
                                      "masks this patch does not build: load the model with "
                                      "attn_implementation='eager', or use transformers' native DeepSeek-V2")
        elif is_shared_kv_attention(module):
            if not native:
                check_transformers_version()
                native, release = True, current_release()
                if options.cache == "paged":
                    check_paged_supported(release)
            found_attention = True
            family = describe(type(module))
            layer = _attention_patch(family, options, release)  # (refuses what it cannot serve, before anything)
            refusal = layer_refusal(module)
            if refusal:
                raise NotImplementedError(f"{family.name} cannot be patched: {refusal}")
            attention.append((module, layer))
        elif is_mla_attention(module):
            if not native:
                check_transformers_version()  # the native forward and cache API are release-specific
                native, release = True, current_release()
                if options.cache == "paged":
                    check_paged_supported(release)
            found_attention = True
            if patch_attention:
                family = describe(type(module))
                layer = _attention_patch(family, options, release)
                # (a layer sharing an earlier layer's latent KV has no KV path of its own)
                shares_kv = family.shared_latent_kv and module.is_kv_shared_layer
                refusal = None if shares_kv else norm_refusal(module.kv_a_layernorm)
                if refusal is None and family.key_rope_norm:
                    refusal = norm_refusal(module.k_rope_only_layernorm, "k_rope_only_layernorm")
                if refusal and options.kv_prolog:
                    raise NotImplementedError(f"{family.name} cannot be patched: {refusal}")
                if family.sparse and not family.indexer_pooled and type(module) not in probed \
                        and getattr(module, "indexer", None) is not None:
                    probed.add(type(module))  # (one layer per class: the indexer code is the class's)
                    refusal = indexer_refusal(module, family)
                    if refusal:
                        raise NotImplementedError(f"{family.name} cannot be patched: {refusal}")
                attention.append((module, layer))
    if not found_attention:
        raise ValueError(f"no multi-head latent attention found in {type(model).__name__}: expected a transformers "
                         f"MLA model (DeepSeek-V2/V3/V4 and the families `mla-ops info` lists) or the hub remote "
                         f"code of DeepSeek-V2 (modeling_deepseek.py)")
    # RMSNorms of the modeling modules that define the model's MLA attention (the norms the ops compute)
    attention_modules = {type(m).__module__ for m in model.modules() if is_remote_attention(m) or is_mla_attention(m)}
    norms = [m for m in model.modules()
             if options.rms_norm and type(m).__name__.endswith("RMSNorm") and type(m).__module__ in attention_modules
             and norm_refusal(m) is None]
    decoders = []
    if options.cache == "paged":
        from . import generation

        decoders = [(decoder, model) for decoder in generation.decoder_stacks(model)]
        for decoder, _ in decoders:
            if not generation.holds_shared_kv(decoder):
                generation.latent_layouts(decoder)  # refuses layers it cannot page before anything is patched
        if not decoders:
            raise ValueError(f"cache='paged' needs the decoder (a module with embed_tokens and layers) inside "
                             f"{type(model).__name__}")
    if not attention and not norms:  # rms_norm alone on a model without RMSNorms the ops compute
        raise ValueError(f"model: no RMSNorm to patch in {type(model).__name__} (rms_norm=True looks for the MLA "
                         f"family's RMSNorm modules)")
    return _Targets(attention, norms, decoders)


def _patch(handle: PatchHandle, model, targets: _Targets) -> None:
    if model is None:
        for cls, layer in targets.attention:
            handle.set(cls, PATCH_ATTRIBUTE, layer)
            handle.set(cls, "forward", shared_kv_attention_forward if layer.family.shared_kv else mla_attention_forward)
            # copies of a class-patched model follow the class; only the derived copies stay behind
            handle.set(cls, "__getstate__", _state_without_absorbed)
            handle.patched_modules += 1
        for cls in targets.norms:
            handle.set(cls, "forward", rms_norm_forward)
            handle.patched_modules += 1
    else:
        for module, layer in targets.attention:
            forward = (remote_attention_forward if layer.family is None
                       else shared_kv_attention_forward if layer.family.shared_kv else mla_attention_forward)
            handle.set(module, PATCH_ATTRIBUTE, layer, in_dict=True)
            handle.set(module, "forward", types.MethodType(forward, module), in_dict=True)
            handle.patched_modules += 1
        for module in targets.norms:
            handle.set(module, "forward", types.MethodType(rms_norm_forward, module), in_dict=True)
            handle.patched_modules += 1
    if targets.decoders:
        from . import generation  # (the paged cache needs transformers' Cache API: imported when used)

        keyword = current_release().model_cache_keyword
        for decoder, generators in targets.decoders:
            generation.install_cache_factory(decoder, generators, handle, keyword)
    # (a dense instance patch needs no hook of its own: a class-level paged hook defers to its options)


def _state_without_absorbed(self) -> dict:
    """An attention module's pickling state without the absorbed weight copies the paged decode made."""
    state = torch.nn.Module.__getstate__(self)
    state.pop(ABSORBED_ATTRIBUTE, None)
    return state

