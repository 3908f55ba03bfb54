"""The forwards the patch installs on transformers' own modules: MLA attention (every supported
family, every supported release) and RMSNorm.

The attention forward serves both cache modes: a paged latent cache (`MLAPagedCache`, whoever made
it) goes to `paged_attention`, anything else (no cache, or a transformers cache) takes the dense path.
"""
from __future__ import annotations

import torch

from . import indexer, paged_attention
from .attention_parts import (
    attend,
    dense_key,
    expand_latent,
    kv_latent_scale,
    kv_prolog_call,
    latent_prolog,
    layer_patch,
    project_output,
    query,
    rotary,
    scale_query,
    shared_latent,
    shared_query_lora,
    sort_arguments,
    sparse_result,
)


def mla_attention_forward(self, hidden_states, *args, **kwargs):
    """Drop-in for a transformers MLA attention forward (any supported family and release): takes
    the stock signature (see `LayerPatch.family.parameters`), returns (attn_output, attn_weights)."""
    patch = layer_patch(self)
    inputs = sort_arguments(patch.family, args, kwargs)
    if getattr(inputs.cache, "holds_mla_latent_pages", False):  # an MLAPagedCache, whoever made it
        return paged_attention.paged_attention_forward(self, patch, hidden_states, inputs)
    opts = patch.options
    rot = rotary(self, patch, inputs.position_embeddings, hidden_states)
    q_lora = shared_query_lora(self, patch, hidden_states)
    q_nope, q_pe, gate = query(self, patch, hidden_states, rot, q_lora=q_lora)
    cache, release = inputs.cache, patch.release
    if patch.family.shared_latent_kv:  # the latent cache as stock keeps it: layers sharing it read it
        latent, k_pe = shared_latent(self, patch, hidden_states, rot, inputs)
        k_nope, value_states = expand_latent(self, latent[:, 0])
        key_states, cache = dense_key(k_nope, k_pe), None
    elif opts.kv_prolog and patch.family.fused_kv_prolog and self.qk_rope_head_dim > 0:
        k_nope, value_states, k_pe = kv_prolog_call(self, hidden_states, rot)
        key_states = dense_key(k_nope, k_pe)
    elif opts.kv_prolog:  # a latent step kv_prolog lacks (a scale, a norm on k_pe, no rotary dims): latent prolog, kv_b
        latent, k_pe = latent_prolog(self, patch, hidden_states, rot)
        k_nope, value_states = expand_latent(self, latent)
        key_states = dense_key(k_nope, k_pe[:, None])
    else:
        key_states, value_states = _stock_kv_with_mla_rope(self, patch, hidden_states, rot, inputs)
        cache = None  # (the stock KV path updated the cache itself)
    if cache is not None:  # the full per-head K/V: the "dense" cache
        key_states, value_states = release.update_cache(cache, key_states, value_states, self.layer_idx,
                                                        inputs.cache_position, inputs.extra)
    query_states = scale_query(self, patch, torch.cat((q_nope, q_pe), dim=-1), inputs.position_ids)
    attention_mask, extra, topk = inputs.attention_mask, inputs.extra, None
    if indexer.selects(self, patch):  # the indexer's top-k (the stock indexer's), folded into the mask
        attention_mask, indices, topk = indexer.dense_selection(self, patch, hidden_states, q_lora, inputs,
                                                                query_states, key_states.shape[2])
        extra = {**extra, **indices}
    attn_output, attn_weights = attend(self, patch, query_states, key_states, value_states, attention_mask, extra)
    # (GLM-5-Next hands its top-k on only where the next layer reuses it: its `next_skip_topk`)
    return sparse_result(patch, project_output(self, patch, attn_output, hidden_states, gate), attn_weights,
                         topk if getattr(self, "next_skip_topk", True) else None)


def _stock_kv_with_mla_rope(attn, patch, hidden_states, rot, inputs):
    """The stock KV path with only k_pe's RoPE through mla.rope (kv_prolog=False, rope=True): the
    latent cache + expand_kv where the stock forward has them (transformers >= 5.16), else kv_b
    before a full K/V cache. Returns (key [B, N, T, P+R], value [B, N, T, V])."""
    batch, seq = hidden_states.shape[:-1]
    compressed_kv = attn.kv_a_proj_with_mqa(hidden_states)
    kv_nope, k_pe = torch.split(compressed_kv, [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    latent = attn.kv_a_layernorm(kv_nope)
    scale = kv_latent_scale(attn, patch)
    latent = latent if scale is None else latent * scale
    k_pe = k_pe.view(batch, 1, seq, attn.qk_rope_head_dim)
    if patch.family.key_rope_norm:  # (the rope-only option: the norm stays stock's)
        k_pe = attn.k_rope_only_layernorm(k_pe)
    if rot.layout is not None:
        k_pe = torch.ops.mla.rope(k_pe, rot.cos, rot.sin, layout=rot.layout, compute_dtype=rot.compute_dtype)
    cache, release = inputs.cache, patch.release
    if patch.family.latent_stock_cache:
        latent = latent.view(batch, 1, seq, attn.kv_lora_rank)
        if cache is not None:
            latent, k_pe = release.update_cache(cache, latent, k_pe, attn.layer_idx, inputs.cache_position,
                                                inputs.extra)
        return attn.expand_kv(latent, k_pe)
    k_nope, value_states = expand_latent(attn, latent)
    key_states = dense_key(k_nope, k_pe)
    if cache is not None:
        key_states, value_states = release.update_cache(cache, key_states, value_states, attn.layer_idx,
                                                        inputs.cache_position, inputs.extra)
    return key_states, value_states


def rms_norm_forward(self, hidden_states):
    """Drop-in for an MLA family's RMSNorm forward (fp32 variance, weight * normed.to(dtype))."""
    return torch.ops.mla.rms_norm(hidden_states, self.weight, self.variance_epsilon)
