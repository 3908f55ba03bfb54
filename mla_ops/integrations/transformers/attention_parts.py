"""Pieces of the DeepSeek-V2 attention forward shared by the dense and paged modes."""
from __future__ import annotations

from typing import Callable

import torch

from .modeling import native_module


def patch_options(module):
    """The PatchOptions the patch stored on this attention module (or on its class)."""
    return module._mla_ops_options


def split_query(attn, hidden_states):
    """q [B, S, N*(P+R)] -> (q_nope [B, N, S, P], q_pe [B, N, S, R]), as the stock forwards do."""
    batch, seq = hidden_states.shape[:-1]
    if attn.q_lora_rank is None:
        q = attn.q_proj(hidden_states)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden_states)))
    q = q.view(batch, seq, -1, attn.qk_nope_head_dim + attn.qk_rope_head_dim).transpose(1, 2)
    return torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)


def kv_prolog_call(attn, hidden_states, cos, sin, rope_layout):
    """mla.kv_prolog with this layer's weights -> (k_nope [B,N,S,P], value [B,N,S,V], k_pe [B,1,S,R])."""
    kv_a, norm = attn.kv_a_proj_with_mqa, attn.kv_a_layernorm
    return torch.ops.mla.kv_prolog(
        hidden_states, kv_a.weight, kv_a.bias, norm.weight, attn.kv_b_proj.weight, cos, sin,
        num_heads=attn.num_heads, qk_nope_head_dim=attn.qk_nope_head_dim, v_head_dim=attn.v_head_dim,
        eps=norm.variance_epsilon, rope_layout=rope_layout)


def dense_key(k_nope, k_pe):
    """[k_nope | k_pe broadcast over heads]: the full per-head key the dense cache stores."""
    return torch.cat((k_nope, k_pe.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)


def attend_and_project(attn, query_states, key_states, value_states, attention_mask, **kwargs):
    """The stock forward's tail: the model's attention implementation (eager / sdpa / ...) over
    [B, N, S, *] states, then o_proj -> ([B, S, hidden], attention weights or None)."""
    hf = native_module()
    batch, seq = query_states.shape[0], query_states.shape[2]
    attention_interface: Callable = hf.ALL_ATTENTION_FUNCTIONS.get_interface(
        attn.config._attn_implementation, hf.eager_attention_forward)
    attn_output, attn_weights = attention_interface(
        attn, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not attn.training else attn.attention_dropout, scaling=attn.scaling, **kwargs)
    return attn.o_proj(attn_output.reshape(batch, seq, -1).contiguous()), attn_weights


def expand_latent(attn, latent):
    """latent [B, T, L] -> (k_nope [B, N, T, P], value [B, N, T, V]) through the layer's own kv_b_proj:
    the stock model's expansion of its latent cache (views of one projection)."""
    batch, tokens, _ = latent.shape
    kv = attn.kv_b_proj(latent).view(batch, tokens, attn.num_heads, attn.qk_nope_head_dim + attn.v_head_dim)
    return torch.split(kv.transpose(1, 2), [attn.qk_nope_head_dim, attn.v_head_dim], dim=-1)
