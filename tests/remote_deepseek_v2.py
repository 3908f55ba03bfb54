"""A test-local stand-in for the hub remote code's attention (DeepSeek-V2-Lite-Chat's
`modeling_deepseek.py`, used with trust_remote_code on transformers 4.x), written from its published
structure and formulas — not copied — so the remote-code patch can be tested on transformers 5.

What matters, per the published file:
* module names `q_proj` (q_lora_rank None), `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`,
  `o_proj`, a per-layer `rotary_emb` (YaRN) and `softmax_scale`;
* forward(hidden_states, attention_mask, position_ids, past_key_value, output_attentions, use_cache)
  -> (attn_output, attn_weights, past_key_value);
* KV: kv_b_proj(kv_a_layernorm(compressed_kv)) before RoPE and before the cache; the cache holds
  the full K [B,N,T,P+R] and V [B,N,T,V];
* RoPE: cos/sin tables = cat(freqs, freqs) over the rope dim for every position up to seq_len,
  cast to the activation dtype, indexed by position_ids; q and k are de-interleaved
  (view(b,h,s,d/2,2).transpose(4,3)) and then rotated with x*cos + rotate_half(x)*sin;
* eager attention: softmax(q k^T * softmax_scale + mask, fp32) v, then o_proj.
The class is named DeepseekV2Attention like the original, so the patch recognises it by instance.
"""
import torch
from torch import nn
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as native


class DeepseekV2RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class DeepseekV2YarnRotaryEmbedding(nn.Module):
    """cos/sin caches of cat(freqs, freqs) per position; inv_freq and mscale as YaRN defines them
    (taken from the native rotary embedding, which computes the identical YaRN inv_freq)."""

    def __init__(self, config, max_position_embeddings=512):
        super().__init__()
        ref = native.DeepseekV2RotaryEmbedding(config)
        t = torch.arange(max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, ref.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos() * ref.attention_scaling, persistent=False)
        self.register_buffer("sin_cached", emb.sin() * ref.attention_scaling, persistent=False)

    def forward(self, x, seq_len):
        return self.cos_cached[:seq_len].to(dtype=x.dtype), self.sin_cached[:seq_len].to(dtype=x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim=1):
    cos = cos[position_ids].unsqueeze(unsqueeze_dim)
    sin = sin[position_ids].unsqueeze(unsqueeze_dim)

    def deinterleave(x):
        b, h, s, d = x.shape
        return x.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)

    q, k = deinterleave(q), deinterleave(k)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class LegacyDynamicCache:
    """The transformers 4.x cache API the remote code calls: update(k, v, layer_idx, cache_kwargs)
    and get_usable_length(new_seq_length, layer_idx)."""

    def __init__(self):
        self.key_cache, self.value_cache = [], []

    def get_usable_length(self, new_seq_length, layer_idx=0):
        return self.key_cache[layer_idx].shape[-2] if layer_idx < len(self.key_cache) else 0

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        if layer_idx < len(self.key_cache):
            self.key_cache[layer_idx] = torch.cat((self.key_cache[layer_idx], key_states), dim=-2)
            self.value_cache[layer_idx] = torch.cat((self.value_cache[layer_idx], value_states), dim=-2)
        else:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


class DeepseekV2Attention(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.attention_dropout = config.attention_dropout
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.qk_rope_head_dim, self.qk_nope_head_dim = config.qk_rope_head_dim, config.qk_nope_head_dim
        self.kv_lora_rank, self.v_head_dim = config.kv_lora_rank, config.v_head_dim
        self.q_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim,
                                            bias=config.attention_bias)
        self.kv_a_layernorm = DeepseekV2RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, config.hidden_size, bias=config.attention_bias)
        self.rotary_emb = DeepseekV2YarnRotaryEmbedding(config)
        self.softmax_scale = native.yarn_apply_mscale(config.rope_parameters, self.q_head_dim ** -0.5)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, **kwargs):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.q_head_dim).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
        compressed_kv, k_pe = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = k_pe.view(bsz, q_len, 1, self.qk_rope_head_dim).transpose(1, 2)
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed_kv))
        kv = kv.view(bsz, q_len, self.num_heads, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)
        k_nope, value_states = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        kv_seq_len = value_states.shape[-2]
        if past_key_value is not None:
            kv_seq_len += past_key_value.get_usable_length(kv_seq_len, self.layer_idx)
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        q_pe, k_pe = apply_rotary_pos_emb(q_pe, k_pe, cos, sin, position_ids)
        query_states = k_pe.new_empty(bsz, self.num_heads, q_len, self.q_head_dim)
        query_states[:, :, :, : self.qk_nope_head_dim] = q_nope
        query_states[:, :, :, self.qk_nope_head_dim:] = q_pe
        key_states = k_pe.new_empty(bsz, self.num_heads, q_len, self.q_head_dim)
        key_states[:, :, :, : self.qk_nope_head_dim] = k_nope
        key_states[:, :, :, self.qk_nope_head_dim:] = k_pe
        if past_key_value is not None:
            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx,
                                                             {"sin": sin, "cos": cos})
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.softmax_scale
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
        attn_output = self.o_proj(attn_output.reshape(bsz, q_len, self.num_heads * self.v_head_dim))
        return attn_output, (attn_weights if output_attentions else None), past_key_value


class RemoteCodeLayerStack(nn.Module):
    """Attention layers in a container, as a loaded remote-code model holds them."""

    def __init__(self, config, layers=2):
        super().__init__()
        self.layers = nn.ModuleList([DeepseekV2Attention(config, i) for i in range(layers)])
        self.norm = DeepseekV2RMSNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask, position_ids, cache=None):
        for layer in self.layers:
            out, _, cache = layer(hidden_states, attention_mask, position_ids, cache)
            hidden_states = self.norm(hidden_states + out)
        return hidden_states


def causal_mask(q_len, kv_len, dtype):
    """The remote code's 4-D additive mask [1, 1, q_len, kv_len]."""
    past = kv_len - q_len
    allowed = torch.arange(kv_len)[None, :] <= (torch.arange(q_len)[:, None] + past)
    return torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)[None, None]
