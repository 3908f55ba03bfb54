"""The forwards the patch installs: DeepSeek-V2 attention (native and hub remote code) and RMSNorm.

The native forward serves both cache modes: a paged latent cache (`MLAPagedCache`, whoever made it)
goes to `paged_attention`, anything else (no cache, or a transformers cache) takes the dense path.
"""
from __future__ import annotations

import sys

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


def _remote_rope_pairs(attn, hidden_states, position_ids, kv_seq_len):
    """cos/sin per rotation pair [B, S, R/2] from the remote code's own rotary embedding.

    Its tables are cat(freqs, freqs) over the full rope dim, indexed by position; the first half
    is one value per pair. They come in the activation dtype (the remote code casts them)."""
    cos, sin = attn.rotary_emb(hidden_states, seq_len=kv_seq_len)
    half = attn.qk_rope_head_dim // 2
    return cos[position_ids][..., :half], sin[position_ids][..., :half]


def _past_length(past_key_value, layer_idx, new_tokens) -> int:
    if past_key_value is None:
        return 0
    if hasattr(past_key_value, "get_usable_length"):  # transformers 4.x Cache API the remote code uses
        return past_key_value.get_usable_length(new_tokens, layer_idx)
    return past_key_value.get_seq_length(layer_idx)


def remote_attention_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                             output_attentions=False, use_cache=False, **kwargs):
    """Drop-in for the hub remote code's `DeepseekV2Attention.forward` (eager attention).

    KV path through `mla.kv_prolog(rope_layout="half")`: its k_pe is de-interleaved exactly like the
    remote code's `apply_rotary_pos_emb` leaves it, so the cached keys are the ones it would cache."""
    opts = patch_options(self)  # kv_prolog=True and cache="dense": apply() refuses the rest for remote code
    batch, seq, _ = hidden_states.shape
    q_nope, q_pe = split_query(self, hidden_states)
    kv_seq_len = seq + _past_length(past_key_value, self.layer_idx, seq)
    if position_ids is None:
        position_ids = torch.arange(kv_seq_len - seq, kv_seq_len, device=hidden_states.device)[None].expand(batch, -1)
    cos, sin = _remote_rope_pairs(self, hidden_states, position_ids, kv_seq_len)
    k_nope, value_states, k_pe = kv_prolog_call(self, hidden_states, cos, sin, "half")
    if opts.rope:
        q_pe = torch.ops.mla.rope(q_pe, cos, sin, layout="half")
    else:
        full_cos, full_sin = self.rotary_emb(hidden_states, seq_len=kv_seq_len)
        q_pe, _ = sys.modules[type(self).__module__].apply_rotary_pos_emb(
            q_pe, q_pe[:, :1], full_cos, full_sin, position_ids)
    query_states = torch.cat((q_nope, q_pe), dim=-1)
    key_states = dense_key(k_nope, k_pe)
    if past_key_value is not None:
        key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx,
                                                         {"sin": sin, "cos": cos})
    attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.softmax_scale
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = torch.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
    attn_weights = torch.nn.functional.dropout(attn_weights, p=self.attention_dropout, training=self.training)
    attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).reshape(batch, seq, -1)
    attn_output = self.o_proj(attn_output)
    return attn_output, (attn_weights if output_attentions else None), past_key_value


def rms_norm_forward(self, hidden_states):
    """Drop-in for `DeepseekV2RMSNorm.forward` (native and remote code compute the same thing)."""
    return torch.ops.mla.rms_norm(hidden_states, self.weight, self.variance_epsilon)
