"""The forwards the patch installs on transformers' native modules: MLA attention and RMSNorm.

The native forward serves both cache modes: a paged latent cache (`MLAPagedCache`, whoever made it)
goes to `paged_attention`, anything else (no cache, or a transformers cache) takes the dense path.
"""
from __future__ import annotations

import torch

from . import paged_attention
from .attention_parts import attend_and_project, dense_key, kv_prolog_call, patch_options, split_query
from .modeling import native_module
from .paged_cache import MLAPagedCache


def native_attention_forward(self, hidden_states, attention_mask=None, cache=None, position_embeddings=None,
                             **kwargs):
    """Drop-in for transformers' native `DeepseekV2Attention.forward` (5.24 signature)."""
    if cache is None:
        cache = kwargs.pop("past_key_values", None)  # the pre-5.24 keyword, still accepted upstream
    if isinstance(cache, MLAPagedCache):  # whoever made it (this patch, or a class-level one)
        return paged_attention.paged_attention_forward(self, hidden_states, attention_mask, cache,
                                                       position_embeddings, **kwargs)
    # no cache, or a cache of another kind: the dense path serves it
    opts = patch_options(self)
    hf = native_module()
    batch, seq = hidden_states.shape[:-1]
    q_nope, q_pe = split_query(self, hidden_states)
    freqs_cis = position_embeddings.to(hidden_states.device)  # complex64 [B, S, R/2]
    cos, sin = freqs_cis.real, freqs_cis.imag
    if opts.kv_prolog:
        k_nope, value_states, k_pe = kv_prolog_call(self, hidden_states, cos, sin, "interleaved")
        if opts.rope:
            q_pe = torch.ops.mla.rope(q_pe, cos, sin)
        else:
            q_pe, _ = hf.apply_rotary_emb(q_pe, q_pe[:, :1], freqs_cis)  # stock rotation of q only
        key_states = dense_key(k_nope, k_pe)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
    else:
        # Stock KV path (latent cache + expand_kv), with only the RoPE routed through mla.rope.
        compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
        kv_nope, k_pe = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_nope = self.kv_a_layernorm(kv_nope).view(batch, 1, seq, self.kv_lora_rank)
        k_pe = k_pe.view(batch, 1, seq, self.qk_rope_head_dim)
        q_pe, k_pe = torch.ops.mla.rope(q_pe, cos, sin), torch.ops.mla.rope(k_pe, cos, sin)
        if cache is not None:
            k_nope, k_pe = cache.update(k_nope, k_pe, self.layer_idx, kwargs=kwargs)
        key_states, value_states = self.expand_kv(k_nope, k_pe)
    query_states = torch.cat((q_nope, q_pe), dim=-1)
    return attend_and_project(self, query_states, key_states, value_states, attention_mask, **kwargs)


def rms_norm_forward(self, hidden_states):
    """Drop-in for `DeepseekV2RMSNorm.forward` (native and remote code compute the same thing)."""
    return torch.ops.mla.rms_norm(hidden_states, self.weight, self.variance_epsilon)
