"""Model-level hooks of the paged mode: the model builds an `MLAPagedCache` (a `SharedKvPagedCache` for
DeepSeek-V4) where it would build its own cache, and each forward's token slots are planned once, before
the layers run."""
from __future__ import annotations

import copy
import types
import weakref

import torch

from .attention_parts import PATCH_ATTRIBUTE
from .families import forward_names, is_mla_attention
from .paged_attention import drop_absorbed_weights, track_absorbed_owners
from .paged_cache import LatentLayout, MLAPagedCache, unsupported
from .patching import stock_attr
from .shared_kv import is_shared_kv_attention
from .shared_kv_cache import SharedKvPagedCache

PAGED_CACHES = (MLAPagedCache, SharedKvPagedCache)
# What a DeepSeek-V4 model forward gets as its attention mask under the paged cache: its forward takes the
# first mask of a dict as built, so it builds none (mla.shared_kv_attention applies the window itself).
NO_MASK = {"sliding_attention": None}


def decoder_stacks(model) -> list:
    """The decoder stacks in `model`: modules holding `embed_tokens` and a `layers` ModuleList (the model
    itself, its `model`, or a multimodal wrapper's language model)."""
    return [m for m in model.modules()
            if hasattr(m, "embed_tokens") and isinstance(getattr(m, "layers", None), torch.nn.ModuleList)]


def holds_shared_kv(decoder) -> bool:
    """Whether `decoder`'s layers attend with DeepSeek-V4's shared-KV attention (its paged cache is a
    SharedKvPagedCache)."""
    return any(is_shared_kv_attention(m) for m in decoder.modules())


def new_paged_cache(decoder, config, **kwargs):
    """The paged cache for `decoder`: a SharedKvPagedCache for DeepSeek-V4, else an MLAPagedCache holding
    its MLA layers (`kwargs`: the caches' common arguments)."""
    if holds_shared_kv(decoder):
        return SharedKvPagedCache(config, **kwargs)
    return MLAPagedCache(config, layouts=latent_layouts(decoder), **kwargs)


def latent_layouts(model) -> list:
    """One `LatentLayout` per MLA layer of `model` (a decoder, or a model holding one), by layer_idx: its latent
    and rotary dims, the layer whose latent KV it reads (Mistral-Large-4's `kv_source_layers`; itself
    elsewhere) and whether it runs an indexer of its own; None for a hybrid's linear-attention layer (its
    states go to transformers' `LinearAttentionLayer` inside the paged cache). Refuses a decoder with layers of
    any other kind, whose state MLAPagedCache cannot hold."""
    decoder = model if hasattr(model, "layers") else next(iter(decoder_stacks(model)))
    by_index = {}
    for layer in decoder.layers:
        mla = [m for m in layer.modules() if is_mla_attention(m)]
        if not mla:
            linear = [m for m in layer.modules() if LINEAR_ATTENTION_STATE_CALLS & forward_names(type(m))]
            if len(linear) == 1 and isinstance(getattr(linear[0], "layer_idx", None), int):
                by_index[linear[0].layer_idx] = None  # (its states: the cache's LinearAttentionLayer)
                continue
            raise NotImplementedError(
                f"cache='paged': {type(decoder).__name__} mixes MLA layers with layers of another kind ("
                f"{type(layer).__name__} has no MLA attention and no linear attention keeping its states through "
                f"the cache's update_conv_state / update_recurrent_state); MLAPagedCache holds MLA latents and "
                f"linear-attention states only. Use cache='dense'")
        for attn in mla:
            shared = getattr(attn, "is_kv_shared_layer", False)
            source = attn.config.kv_source_layers[attn.layer_idx] if shared else attn.layer_idx
            own_indexer = getattr(attn, "indexer", None)
            by_index[attn.layer_idx] = LatentLayout(attn.kv_lora_rank, attn.qk_rope_head_dim, source,
                                                    own_indexer is not None,
                                                    hasattr(own_indexer, "get_pooled_states"))
    if all(layout is None for layout in by_index.values()):
        raise NotImplementedError(f"cache='paged': {type(decoder).__name__} has no MLA layer to page")
    return [by_index[i] for i in range(max(by_index) + 1)]


# What a linear-attention module's forward calls on the cache to keep its states (KDA: Kimi-Linear, Bailing-hybrid).
LINEAR_ATTENTION_STATE_CALLS = frozenset({"update_conv_state", "update_recurrent_state"})



def _instance_wants_dense(decoder) -> bool:
    """Whether `decoder` (an MLA family's decoder model) carries an instance patch with a dense cache:
    its options win over a class-level paged patch, whichever was applied first."""
    layers = getattr(decoder, "layers", None)
    first = layers[0] if layers is not None and len(layers) else None
    for module in first.modules() if first is not None else ():
        patch = module.__dict__.get(PATCH_ATTRIBUTE)
        if patch is not None:
            return patch.options.cache != "paged"
    return False


def _model_forward_with_paged_cache(original_forward, keyword: str):
    """Wrap an MLA decoder model's forward: create an MLAPagedCache when the model would create a
    cache, and plan each forward's slots once before the layers run. `keyword`: the stock forward's
    cache keyword (`cache`, or `past_key_values` before transformers 5.24)."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, **kwargs):
        for name in ("past_key_values", "cache"):  # either keyword, whichever release the caller writes for
            passed = kwargs.pop(name, None)
            cache = passed if cache is None else cache
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if use_cache and cache is None and not torch.is_grad_enabled() and not _instance_wants_dense(self):
            # With gradients (training), the model's own cache and the dense path serve: the paged
            # cache's writes are inference-only ops.
            cache = new_paged_cache(self, self.config)
        if isinstance(cache, MLAPagedCache) and not cache.layouts_checked and not torch.compiler.is_compiling():
            cache.check_layouts(latent_layouts(self))
        if isinstance(cache, PAGED_CACHES):
            tokens = input_ids if input_ids is not None else inputs_embeds
            cache.begin_forward(attention_mask, tokens.shape[0], tokens.shape[1], self.embed_tokens.weight.dtype,
                                tokens.device)
            if isinstance(cache, SharedKvPagedCache):
                attention_mask = NO_MASK
        try:
            return original_forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                    position_ids=position_ids, inputs_embeds=inputs_embeds, use_cache=use_cache,
                                    **{keyword: cache}, **kwargs)
        finally:
            if isinstance(cache, PAGED_CACHES):
                cache.end_forward()

    forward.__name__ = "mla_ops_paged_model_forward"
    forward.__wrapped__ = original_forward
    return forward


def _prepare_cache_with_paged(original, keyword: str):
    """Wrap GenerationMixin._prepare_cache_for_generation: the cache generate makes becomes an
    MLAPagedCache, or a SharedKvPagedCache for DeepSeek-V4 (static when cache_implementation='static'); a
    user-passed cache is respected.
    `keyword`: generate's model_kwargs key for the cache (`cache`, `past_key_values` before 5.24)."""

    def prepare(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length):
        passed = model_kwargs.get(keyword)  # a cache the caller handed generate
        decoder = next(iter(decoder_stacks(self)), None)  # (a multimodal wrapper's: its language model)
        shared_kv = decoder is not None and holds_shared_kv(decoder)
        static = generation_config.cache_implementation == "static"
        stock_config = generation_config
        if shared_kv and static and passed is None and not _instance_wants_dense(decoder):
            # transformers' StaticCache has no DeepSeek-V4 layers: stock makes its dynamic cache, replaced below
            stock_config = copy.copy(generation_config)
            stock_config.cache_implementation = None
        result = original(self, stock_config, model_kwargs, generation_mode, batch_size, max_cache_length)
        made = model_kwargs.get(keyword)
        if (made is None or made is passed or getattr(made, "_is_user_defined", False)
                or isinstance(made, PAGED_CACHES)):
            return result
        if _instance_wants_dense(decoder):  # a class-level hook, a dense instance patch
            return result
        if generation_config.num_beams > 1:
            unsupported("beam search (num_beams > 1)")
        requested = getattr(generation_config, "max_cache_len", None)  # (a generation option from 5.13)
        if static and requested is not None:  # as transformers sizes StaticCache
            max_cache_length = max(max_cache_length, requested)
        config = self.config.get_text_config(decoder=True)
        # generate expands the batch by num_return_sequences before the first forward (as transformers
        # sizes its own caches)
        rows = batch_size * max(1, generation_config.num_return_sequences or 1)
        if shared_kv:  # (in the activations' dtype: DeepSeek-V4 keeps some weights in fp32)
            model_kwargs[keyword] = SharedKvPagedCache(config, batch_size=rows, max_cache_len=max_cache_length,
                                                       static=static, dtype=decoder.embed_tokens.weight.dtype,
                                                       device=self.device)
            return result
        # a compiled decode makes the absorbed copies inside the trace: register their owners here
        track_absorbed_owners(m for m in self.modules() if hasattr(m, "kv_b_proj"))
        layouts = latent_layouts(decoder) if decoder is not None else None
        model_kwargs[keyword] = MLAPagedCache(config, batch_size=rows, max_cache_len=max_cache_length,
                                              static=static, dtype=self.dtype, device=self.device, layouts=layouts)
        return result

    prepare.__name__ = "mla_ops_prepare_cache_for_generation"
    return prepare


def install_cache_factory(decoder, generators, handle, keyword: str) -> None:
    """Hook cache creation on a decoder and the models generating with it, instances (or classes, for a
    class-level patch): model(use_cache=True) and generate() then build MLAPagedCache; reverting the handle
    frees the absorbed W_UK / W_UV copies the decode path made. `generators`: the model instance holding the
    decoder, or the generating classes (GenerationMixin) of a class-level patch. `keyword`: the release's
    cache keyword (`Release.model_cache_keyword`)."""
    decoder_class = decoder if isinstance(decoder, type) else type(decoder)
    # Always wrap the stock functions, so applying twice never stacks two wrappers.
    stock_forward = stock_attr(decoder_class, "forward")
    if isinstance(decoder, type):  # class level
        handle.set(decoder, "forward", _model_forward_with_paged_cache(stock_forward, keyword))
        for generator in generators:
            stock_prepare = stock_attr(generator, "_prepare_cache_for_generation")
            handle.set(generator, "_prepare_cache_for_generation", _prepare_cache_with_paged(stock_prepare, keyword))
        handle.on_revert(drop_absorbed_weights)
        return
    target_ref = weakref.ref(generators)  # the callback must not keep the model alive
    handle.on_revert(lambda: drop_absorbed_weights(target_ref().modules() if target_ref() is not None else ()))
    bound = _model_forward_with_paged_cache(stock_forward, keyword)
    handle.set(decoder, "forward", types.MethodType(bound, decoder), in_dict=True)
    if hasattr(generators, "_prepare_cache_for_generation") and generators is not decoder:
        stock_prepare = stock_attr(type(generators), "_prepare_cache_for_generation")
        wrapped = _prepare_cache_with_paged(stock_prepare, keyword)
        handle.set(generators, "_prepare_cache_for_generation", types.MethodType(wrapped, generators), in_dict=True)
