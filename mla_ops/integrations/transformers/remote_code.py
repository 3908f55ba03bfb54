"""The hub remote code's DeepSeek-V2 attention (`modeling_deepseek.py`, loaded with
`trust_remote_code=True`): how it is recognised and the forward the patch installs on it.

The remote code runs on transformers 4.x (it calls `Cache.get_usable_length`, gone since 4.54, and
imports `transformers.modeling_attn_mask_utils`, gone in 5.x; tested on 4.45); nothing here imports
transformers, so this works whichever transformers the remote code runs on.
"""
from __future__ import annotations

import functools
import sys

import torch

from .attention_parts import Rotary, dense_key, kv_prolog_call, layer_patch, split_query
from .families import matching_rope_compute_dtype

REMOTE_FLASH_ATTENTION = "DeepseekV2FlashAttention2"  # the hub code's FA2 variant: other mask convention


def is_remote_attention(module: torch.nn.Module) -> bool:
    """The hub remote-code attention (modeling_deepseek.py): class `DeepseekV2Attention` defined in a
    module that is not transformers' own, with the remote code's per-layer `rotary_emb` and
    `softmax_scale` attributes."""
    return (type(module).__name__ == "DeepseekV2Attention"
            and not type(module).__module__.startswith("transformers.models.")
            and hasattr(module, "kv_a_proj_with_mqa") and hasattr(module, "rotary_emb")
            and hasattr(module, "softmax_scale"))


def _remote_rope_pairs(attn, hidden_states, position_ids, kv_seq_len):
    """cos/sin per rotation pair [B, S, R/2] from the remote code's own rotary embedding.

    Its tables are cat(freqs, freqs) over the full rope dim, indexed by position; the first half
    is one value per pair. They come in the activation dtype (the remote code casts them)."""
    cos, sin = attn.rotary_emb(hidden_states, seq_len=kv_seq_len)
    half = attn.qk_rope_head_dim // 2
    return cos[position_ids][..., :half], sin[position_ids][..., :half]


@functools.lru_cache(maxsize=None)
def _stock_rounding(modeling) -> str:
    apply_rotary_pos_emb = getattr(modeling, "apply_rotary_pos_emb", None)
    if apply_rotary_pos_emb is None:  # a variant of the code without the published function: the fp32 rotation
        return "float32"

    def rotate(x, cos, sin):  # per-pair tables [B, S, R/2] -> the code's [T, R] tables + position_ids
        batch, seq = cos.shape[:2]
        positions = torch.arange(batch * seq).view(batch, seq)
        full = [torch.cat((t, t), -1).reshape(batch * seq, -1) for t in (cos, sin)]
        return apply_rotary_pos_emb(x, x[:, :1], *full, positions)[0]

    return matching_rope_compute_dtype(rotate, "half") or "float32"


def stock_rope_compute_dtype(attn) -> str:
    """The rope_compute_dtype reproducing the hub code's `apply_rotary_pos_emb` (found by running it on a
    small random bf16 and fp16 input, once per modeling module): "activation" for the published code,
    which rotates in the model's dtype with cos/sin tables cast to it. "float32" when neither matches."""
    return _stock_rounding(sys.modules[type(attn).__module__])


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
    remote code's `apply_rotary_pos_emb` leaves it, so the cached keys are the ones it would cache, and
    rotated with the rounding the patch chose (by default the remote code's own: in the model's dtype)."""
    patch = layer_patch(self)
    opts = patch.options  # kv_prolog=True and cache="dense": patch() refuses the rest for remote code
    batch, seq, _ = hidden_states.shape
    q_nope, q_pe, _ = split_query(self, hidden_states)
    kv_seq_len = seq + _past_length(past_key_value, self.layer_idx, seq)
    if position_ids is None:
        position_ids = torch.arange(kv_seq_len - seq, kv_seq_len, device=hidden_states.device)[None].expand(batch, -1)
    cos, sin = _remote_rope_pairs(self, hidden_states, position_ids, kv_seq_len)
    rot = Rotary(cos, sin, "half", None, patch.rope_compute_dtype(self.config))
    k_nope, value_states, k_pe = kv_prolog_call(self, hidden_states, rot)
    if opts.rope:
        q_pe = torch.ops.mla.rope(q_pe, cos, sin, layout="half", compute_dtype=rot.compute_dtype)
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
