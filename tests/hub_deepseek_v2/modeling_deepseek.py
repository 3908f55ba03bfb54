"""DeepSeek-V2 as the hub remote code (`modeling_deepseek.py`, loaded with trust_remote_code=True) runs
it, written for the tests from the published file's structure and formulas against the transformers 4.x
API that file uses (4.45): `transformers.modeling_attn_mask_utils._prepare_4d_causal_attention_mask`,
`is_torch_fx_available`, `DynamicCache.from_legacy_cache`, `Cache.get_usable_length`, `seen_tokens`,
`get_max_length`, a 3-tuple attention return. It imports nothing from transformers' own deepseek_v2.

What the patch depends on is kept exactly:
* the attention's module names (`q_proj` or `q_a_proj`/`q_a_layernorm`/`q_b_proj`, `kv_a_proj_with_mqa`,
  `kv_a_layernorm`, `kv_b_proj`, `o_proj`), its per-layer `rotary_emb` and `softmax_scale`;
* forward(hidden_states, attention_mask, position_ids, past_key_value, output_attentions, use_cache)
  -> (attn_output, attn_weights, past_key_value);
* kv_b_proj(kv_a_layernorm(compressed_kv)) before RoPE and before the cache, which holds the full
  K [B, N, T, P+R] and V [B, N, T, V];
* RoPE from cos/sin caches of cat(freqs, freqs) (YaRN), rebuilt in the activation dtype for
  seq_len = past + new tokens, indexed by position_ids; q_pe / k_pe de-interleaved
  (view(b, h, s, d/2, 2).transpose(4, 3)) before x*cos + rotate_half(x)*sin;
* eager attention: softmax(q k^T * softmax_scale + mask) in fp32, then o_proj.
The MoE router is a plain top-k softmax gate (no expert offloading, no auxiliary loss at inference).
"""
import math
from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import CrossEntropyLoss
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_attn_mask_utils import _prepare_4d_causal_attention_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.pytorch_utils import ALL_LAYERNORM_LAYERS
from transformers.utils import logging
from transformers.utils.import_utils import is_torch_fx_available

from .configuration_deepseek import DeepseekV2Config

# The published file wraps the mask function so that torch.fx tracing keeps it as one leaf call.
if is_torch_fx_available():
    _prepare_4d_causal_attention_mask = torch.fx.wrap(_prepare_4d_causal_attention_mask)

logger = logging.get_logger(__name__)


class DeepseekV2RMSNorm(nn.Module):
    """x [..., D] -> weight * x / sqrt(mean(x^2) + eps), normalised in fp32, back in x's dtype."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


ALL_LAYERNORM_LAYERS.append(DeepseekV2RMSNorm)


class DeepseekV2RotaryEmbedding(nn.Module):
    """Plain RoPE: cos/sin caches [seq_len, dim] = cat(freqs, freqs) over positions 0..seq_len-1."""

    def __init__(self, dim, max_position_embeddings=2048, base=10000, device=None):
        super().__init__()
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2).float().to(device) / self.dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._set_cos_sin_cache(seq_len=max_position_embeddings, device=self.inv_freq.device,
                                dtype=torch.get_default_dtype())
        # As in the published file: the first forward rebuilds the caches in the activation dtype, for
        # exactly the positions it needs (and every longer call rebuilds them again).
        self.max_seq_len_cached = None

    def _set_cos_sin_cache(self, seq_len, device, dtype):
        self.max_seq_len_cached = seq_len
        t = torch.arange(seq_len, device=device, dtype=self.inv_freq.dtype)
        freqs = torch.outer(t, self.inv_freq.to(t.device))
        emb = torch.cat((freqs, freqs), dim=-1)  # the "half" layout: pair i at columns i and i + dim/2
        self.register_buffer("cos_cached", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin_cached", emb.sin().to(dtype), persistent=False)

    def forward(self, x, seq_len=None):
        """x: any tensor in the activation dtype and device -> (cos, sin), each [seq_len, dim]."""
        if self.max_seq_len_cached is None or seq_len > self.max_seq_len_cached:
            self._set_cos_sin_cache(seq_len=seq_len, device=x.device, dtype=x.dtype)
        return self.cos_cached[:seq_len].to(dtype=x.dtype), self.sin_cached[:seq_len].to(dtype=x.dtype)


def yarn_find_correction_dim(num_rotations, dim, base=10000, max_position_embeddings=2048):
    """The rotary dimension whose wavelength completes `num_rotations` turns over the original context."""
    return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_find_correction_range(low_rot, high_rot, dim, base=10000, max_position_embeddings=2048):
    """[low, high] dimension bounds of YaRN's interpolation ramp, clamped to the rotary dims."""
    low = math.floor(yarn_find_correction_dim(low_rot, dim, base, max_position_embeddings))
    high = math.ceil(yarn_find_correction_dim(high_rot, dim, base, max_position_embeddings))
    return max(low, 0), min(high, dim - 1)


def yarn_get_mscale(scale=1, mscale=1):
    """YaRN's attention temperature factor for a context extended `scale` times."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_linear_ramp_mask(low, high, dim):
    """[dim] ramp: 0 below `low`, 1 above `high`, linear between."""
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    return torch.clamp((torch.arange(dim, dtype=torch.float32) - low) / (high - low), 0, 1)


class DeepseekV2YarnRotaryEmbedding(DeepseekV2RotaryEmbedding):
    """YaRN RoPE: inverse frequencies blended between interpolated (/factor) and original along the
    correction ramp; cos/sin scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""

    def __init__(self, dim, max_position_embeddings=2048, base=10000, device=None, scaling_factor=1.0,
                 original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1, mscale_all_dim=0):
        self.scaling_factor = scaling_factor
        self.original_max_position_embeddings = original_max_position_embeddings
        self.beta_fast = beta_fast
        self.beta_slow = beta_slow
        self.mscale = mscale
        self.mscale_all_dim = mscale_all_dim
        super().__init__(dim, max_position_embeddings, base, device)

    def _set_cos_sin_cache(self, seq_len, device, dtype):
        self.max_seq_len_cached = seq_len
        dim = self.dim
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
        freq_extra = 1.0 / (self.base ** exponents)
        freq_inter = 1.0 / (self.scaling_factor * self.base ** exponents)
        low, high = yarn_find_correction_range(self.beta_fast, self.beta_slow, dim, self.base,
                                               self.original_max_position_embeddings)
        extrapolate = 1.0 - yarn_linear_ramp_mask(low, high, dim // 2).to(device=device, dtype=torch.float32)
        inv_freq = freq_inter * (1 - extrapolate) + freq_extra * extrapolate
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
        scale = float(yarn_get_mscale(self.scaling_factor, self.mscale)
                      / yarn_get_mscale(self.scaling_factor, self.mscale_all_dim))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", (emb.cos() * scale).to(dtype), persistent=False)
        self.register_buffer("sin_cached", (emb.sin() * scale).to(dtype), persistent=False)


def rotate_half(x):
    """[..., d] -> cat(-x[d/2:], x[:d/2]): the partner of each "half"-layout pair, sign applied."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim=1):
    """q [B, N, S, R], k [B, 1, S, R] in the checkpoint's interleaved pair order; cos/sin [T, R].

    Each is first de-interleaved ((x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...)) so that the
    "half"-layout tables apply; the rotated q / k stay de-interleaved (that is what gets cached)."""
    cos = cos[position_ids].unsqueeze(unsqueeze_dim)
    sin = sin[position_ids].unsqueeze(unsqueeze_dim)
    b, h, s, d = q.shape
    q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    b, h, s, d = k.shape
    k = k.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class DeepseekV2MLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x)), [..., H] -> [..., H]."""

    def __init__(self, config, hidden_size=None, intermediate_size=None):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size if hidden_size is None else hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MoEGate(nn.Module):
    """Softmax router: hidden [B, S, H] -> (expert ids [B*S, k], weights [B*S, k] fp32, aux loss None)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.top_k = config.num_experts_per_tok
        self.n_routed_experts = config.n_routed_experts
        self.routed_scaling_factor = config.routed_scaling_factor
        self.scoring_func = config.scoring_func
        self.topk_method = config.topk_method
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty((self.n_routed_experts, config.hidden_size)))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, hidden_states):
        h = hidden_states.shape[-1]
        logits = F.linear(hidden_states.reshape(-1, h).float(), self.weight.float())
        if self.scoring_func != "softmax" or self.topk_method != "greedy":
            raise NotImplementedError(f"router {self.scoring_func}/{self.topk_method}: only softmax/greedy here")
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        topk_weight, topk_idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        if self.top_k > 1 and self.norm_topk_prob:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            topk_weight = topk_weight * self.routed_scaling_factor
        return topk_idx, topk_weight, None


class DeepseekV2MoE(nn.Module):
    """Routed experts (top-k of n_routed_experts) plus always-on shared experts, [B, S, H] -> [B, S, H]."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_experts_per_tok = config.num_experts_per_tok
        self.experts = nn.ModuleList([DeepseekV2MLP(config, intermediate_size=config.moe_intermediate_size)
                                      for _ in range(config.n_routed_experts)])
        self.gate = MoEGate(config)
        if config.n_shared_experts is not None:
            self.shared_experts = DeepseekV2MLP(
                config, intermediate_size=config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, hidden_states):
        identity, shape = hidden_states, hidden_states.shape
        topk_idx, topk_weight, _ = self.gate(hidden_states)
        y = self.moe_infer(hidden_states.reshape(-1, shape[-1]), topk_idx, topk_weight).view(*shape)
        if self.config.n_shared_experts is not None:
            y = y + self.shared_experts(identity)
        return y

    @torch.no_grad()
    def moe_infer(self, x, topk_idx, topk_weight):
        """x [T, H]; each token's expert outputs weighted (in fp32, like the router) and summed."""
        out = torch.zeros(x.shape, dtype=topk_weight.dtype, device=x.device)
        for e, expert in enumerate(self.experts):
            token, slot = (topk_idx == e).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, expert(x[token]).to(out.dtype) * topk_weight[token, slot, None])
        return out.to(x.dtype)


class DeepseekV2Attention(nn.Module):
    """Multi-head latent attention, eager. Shapes: B batch, S new tokens, T cached + new tokens, N heads,
    P nope / R rope / V value head dims, L kv_lora_rank."""

    def __init__(self, config: DeepseekV2Config, layer_idx: Optional[int] = None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.attention_dropout = config.attention_dropout
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.max_position_embeddings = config.max_position_embeddings
        self.rope_theta = config.rope_theta
        self.q_lora_rank = config.q_lora_rank
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.v_head_dim = config.v_head_dim
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.q_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.is_causal = True

        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.q_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(self.hidden_size, config.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = DeepseekV2RMSNorm(config.q_lora_rank)
            self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(self.hidden_size, config.kv_lora_rank + config.qk_rope_head_dim,
                                            bias=config.attention_bias)
        self.kv_a_layernorm = DeepseekV2RMSNorm(config.kv_lora_rank)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, self.hidden_size, bias=config.attention_bias)
        self._init_rope()

        self.softmax_scale = self.q_head_dim ** (-0.5)
        if self.config.rope_scaling is not None:
            mscale_all_dim = self.config.rope_scaling.get("mscale_all_dim", 0)
            if mscale_all_dim:  # YaRN's temperature, applied to both q and k: squared on the logits
                mscale = yarn_get_mscale(self.config.rope_scaling["factor"], mscale_all_dim)
                self.softmax_scale = self.softmax_scale * mscale * mscale

    def _init_rope(self):
        scaling = self.config.rope_scaling
        if scaling is None:
            self.rotary_emb = DeepseekV2RotaryEmbedding(self.qk_rope_head_dim,
                                                        max_position_embeddings=self.max_position_embeddings,
                                                        base=self.rope_theta)
        elif scaling["type"] == "yarn":
            keys = ("original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
            self.rotary_emb = DeepseekV2YarnRotaryEmbedding(
                self.qk_rope_head_dim, max_position_embeddings=self.max_position_embeddings,
                scaling_factor=scaling["factor"], base=self.rope_theta, **{k: scaling[k] for k in keys if k in scaling})
        else:
            raise ValueError(f"Unknown RoPE scaling type {scaling['type']}")

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_value: Optional[Cache] = None,
                output_attentions: bool = False, use_cache: bool = False, **kwargs
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[Cache]]:
        """hidden_states [B, S, H], attention_mask [B, 1, S, T] additive, position_ids [B, S]
        -> (attn_output [B, S, H], attn_weights [B, N, S, T] or None, past_key_value)."""
        bsz, q_len, _ = hidden_states.size()
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(bsz, q_len, self.num_heads, self.q_head_dim).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

        compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
        compressed_kv, k_pe = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = k_pe.view(bsz, q_len, 1, self.qk_rope_head_dim).transpose(1, 2)
        kv = (self.kv_b_proj(self.kv_a_layernorm(compressed_kv))
              .view(bsz, q_len, self.num_heads, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2))
        k_nope, value_states = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)

        kv_seq_len = value_states.shape[-2]
        if past_key_value is not None:
            if self.layer_idx is None:
                raise ValueError(f"{type(self).__name__} needs a layer_idx to use a cache")
            kv_seq_len += past_key_value.get_usable_length(kv_seq_len, self.layer_idx)
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        q_pe, k_pe = apply_rotary_pos_emb(q_pe, k_pe, cos, sin, position_ids)

        query_states = k_pe.new_empty(bsz, self.num_heads, q_len, self.q_head_dim)
        query_states[:, :, :, : self.qk_nope_head_dim] = q_nope
        query_states[:, :, :, self.qk_nope_head_dim:] = q_pe
        key_states = k_pe.new_empty(bsz, self.num_heads, q_len, self.q_head_dim)
        key_states[:, :, :, : self.qk_nope_head_dim] = k_nope
        key_states[:, :, :, self.qk_nope_head_dim:] = k_pe  # one rope key, broadcast over the heads
        if past_key_value is not None:
            cache_kwargs = {"sin": sin, "cos": cos}
            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx, cache_kwargs)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.softmax_scale
        if attn_weights.size() != (bsz, self.num_heads, q_len, kv_seq_len):
            raise ValueError(f"attention weights are {tuple(attn_weights.size())}, expected "
                             f"{(bsz, self.num_heads, q_len, kv_seq_len)}")
        if attention_mask is not None:
            if attention_mask.size() != (bsz, 1, q_len, kv_seq_len):
                raise ValueError(f"attention mask is {tuple(attention_mask.size())}, expected "
                                 f"{(bsz, 1, q_len, kv_seq_len)}")
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_weights = nn.functional.dropout(attn_weights, p=self.attention_dropout, training=self.training)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.num_heads * self.v_head_dim)
        attn_output = self.o_proj(attn_output)
        if not output_attentions:
            attn_weights = None
        return attn_output, attn_weights, past_key_value


class DeepseekV2FlashAttention2(DeepseekV2Attention):
    """The published FlashAttention-2 variant: same weights, but its attention_mask is the 2-D padding
    mask [B, T] (or None), not the additive 4-D one, and it needs the flash_attn package (CUDA)."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, **kwargs):
        raise NotImplementedError("this test model's FlashAttention-2 path needs flash_attn (CUDA); use eager")


ATTENTION_CLASSES = {"eager": DeepseekV2Attention, "flash_attention_2": DeepseekV2FlashAttention2}


class DeepseekV2DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)); MoE MLP from first_k_dense_replace on."""

    def __init__(self, config: DeepseekV2Config, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = ATTENTION_CLASSES[config._attn_implementation](config=config, layer_idx=layer_idx)
        moe = (config.n_routed_experts is not None and layer_idx >= config.first_k_dense_replace
               and layer_idx % config.moe_layer_freq == 0)
        self.mlp = DeepseekV2MoE(config) if moe else DeepseekV2MLP(config)
        self.input_layernorm = DeepseekV2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DeepseekV2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_value: Optional[Cache] = None,
                output_attentions: Optional[bool] = False, use_cache: Optional[bool] = False, **kwargs):
        """hidden_states [B, S, H] -> (hidden_states, [attn_weights,] [present_key_value])."""
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, self_attn_weights, present_key_value = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask, position_ids=position_ids,
            past_key_value=past_key_value, output_attentions=output_attentions, use_cache=use_cache, **kwargs)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = residual + self.mlp(self.post_attention_layernorm(hidden_states))
        outputs = (hidden_states,)
        if output_attentions:
            outputs += (self_attn_weights,)
        if use_cache:
            outputs += (present_key_value,)
        return outputs


class DeepseekV2PreTrainedModel(PreTrainedModel):
    config_class = DeepseekV2Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DeepseekV2DecoderLayer"]
    _skip_keys_device_placement = "past_key_values"
    _supports_flash_attn_2 = True
    _supports_cache_class = True  # generate() hands the model a DynamicCache (4.x)

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()


class DeepseekV2Model(DeepseekV2PreTrainedModel):
    """Embedding, config.num_hidden_layers decoder layers, final RMSNorm: input_ids [B, S] -> [B, S, H]."""

    def __init__(self, config: DeepseekV2Config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([DeepseekV2DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self._use_flash_attention_2 = config._attn_implementation == "flash_attention_2"
        self.norm = DeepseekV2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids: torch.LongTensor = None, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None,
                past_key_values: Optional[Union[Cache, List[torch.FloatTensor]]] = None,
                inputs_embeds: Optional[torch.FloatTensor] = None, use_cache: Optional[bool] = None,
                output_attentions: Optional[bool] = None, output_hidden_states: Optional[bool] = None,
                return_dict: Optional[bool] = None) -> Union[Tuple, BaseModelOutputWithPast]:
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        output_hidden_states = (output_hidden_states if output_hidden_states is not None
                                else self.config.output_hidden_states)
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        return_dict = return_dict if return_dict is not None else self.config.use_return_dict
        if input_ids is not None and inputs_embeds is not None:
            raise ValueError("You cannot specify both input_ids and inputs_embeds at the same time")
        if input_ids is not None:
            batch_size, seq_length = input_ids.shape[:2]
        elif inputs_embeds is not None:
            batch_size, seq_length = inputs_embeds.shape[:2]
        else:
            raise ValueError("You have to specify either input_ids or inputs_embeds")
        if self.gradient_checkpointing and self.training and use_cache:
            use_cache = False

        past_key_values_length = 0
        use_legacy_cache = False
        if use_cache:
            # tuples of (K, V) per layer, or None, become a DynamicCache; returned in the form they came
            use_legacy_cache = not isinstance(past_key_values, Cache)
            if use_legacy_cache:
                past_key_values = DynamicCache.from_legacy_cache(past_key_values)
            past_key_values_length = past_key_values.get_usable_length(seq_length)

        if position_ids is None:
            device = input_ids.device if input_ids is not None else inputs_embeds.device
            position_ids = torch.arange(past_key_values_length, seq_length + past_key_values_length,
                                        dtype=torch.long, device=device).unsqueeze(0)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if self._use_flash_attention_2:
            attention_mask = attention_mask if (attention_mask is not None and 0 in attention_mask) else None
        else:  # additive [B, 1, S, past + S] mask: causal, plus the padding of a 2-D attention_mask
            attention_mask = _prepare_4d_causal_attention_mask(attention_mask, (batch_size, seq_length),
                                                               inputs_embeds, past_key_values_length)

        hidden_states = inputs_embeds
        all_hidden_states = () if output_hidden_states else None
        all_self_attns = () if output_attentions else None
        next_decoder_cache = None
        for decoder_layer in self.layers:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            layer_outputs = decoder_layer(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                          past_key_value=past_key_values, output_attentions=output_attentions,
                                          use_cache=use_cache)
            hidden_states = layer_outputs[0]
            if use_cache:
                next_decoder_cache = layer_outputs[2 if output_attentions else 1]
            if output_attentions:
                all_self_attns += (layer_outputs[1],)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)

        next_cache = None
        if use_cache:
            next_cache = next_decoder_cache.to_legacy_cache() if use_legacy_cache else next_decoder_cache
        if not return_dict:
            return tuple(v for v in (hidden_states, next_cache, all_hidden_states, all_self_attns) if v is not None)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=next_cache,
                                       hidden_states=all_hidden_states, attentions=all_self_attns)


class DeepseekV2ForCausalLM(DeepseekV2PreTrainedModel, GenerationMixin):
    """DeepseekV2Model and an untied lm_head: input_ids [B, S] -> logits [B, S, vocab] in fp32."""

    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config):
        super().__init__(config)
        self.model = DeepseekV2Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def set_decoder(self, decoder):
        self.model = decoder

    def get_decoder(self):
        return self.model

    def forward(self, input_ids: torch.LongTensor = None, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None,
                past_key_values: Optional[Union[Cache, List[torch.FloatTensor]]] = None,
                inputs_embeds: Optional[torch.FloatTensor] = None, labels: Optional[torch.LongTensor] = None,
                use_cache: Optional[bool] = None, output_attentions: Optional[bool] = None,
                output_hidden_states: Optional[bool] = None, return_dict: Optional[bool] = None
                ) -> Union[Tuple, CausalLMOutputWithPast]:
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        output_hidden_states = (output_hidden_states if output_hidden_states is not None
                                else self.config.output_hidden_states)
        return_dict = return_dict if return_dict is not None else self.config.use_return_dict
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                             return_dict=return_dict)
        logits = self.lm_head(outputs[0]).float()
        loss = None
        if labels is not None:  # token n predicts token n + 1
            shift_logits = logits[..., :-1, :].contiguous().view(-1, self.config.vocab_size)
            shift_labels = labels[..., 1:].contiguous().view(-1).to(shift_logits.device)
            loss = CrossEntropyLoss()(shift_logits, shift_labels)
        if not return_dict:
            output = (logits,) + outputs[1:]
            return (loss,) + output if loss is not None else output
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, inputs_embeds=None,
                                      **kwargs):
        """generate()'s per-step inputs: only the tokens the cache has not seen, positions from the mask."""
        if past_key_values is not None:
            if isinstance(past_key_values, Cache):
                cache_length = past_key_values.get_seq_length()
                past_length = past_key_values.seen_tokens
                max_cache_length = past_key_values.get_max_length()
            else:
                cache_length = past_length = past_key_values[0][0].shape[2]
                max_cache_length = None
            # Keep only the unprocessed tokens: past the mask's extra length (inputs_embeds given to the
            # first step), or past what the cache holds; otherwise input_ids holds only new tokens already.
            if attention_mask is not None and attention_mask.shape[1] > input_ids.shape[1]:
                input_ids = input_ids[:, -(attention_mask.shape[1] - past_length):]
            elif past_length < input_ids.shape[1]:
                input_ids = input_ids[:, past_length:]
            # a bounded cache about to overflow sees only the last max_cache_length mask columns
            if (max_cache_length is not None and attention_mask is not None
                    and cache_length + input_ids.shape[1] > max_cache_length):
                attention_mask = attention_mask[:, -max_cache_length:]

        position_ids = kwargs.get("position_ids", None)
        if attention_mask is not None and position_ids is None:
            # left padding: positions count the real tokens only
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            if past_key_values:
                position_ids = position_ids[:, -input_ids.shape[1]:]

        if inputs_embeds is not None and past_key_values is None:
            model_inputs = {"inputs_embeds": inputs_embeds}
        else:
            model_inputs = {"input_ids": input_ids}
        model_inputs.update({"position_ids": position_ids, "past_key_values": past_key_values,
                             "use_cache": kwargs.get("use_cache"), "attention_mask": attention_mask})
        return model_inputs

    @staticmethod
    def _reorder_cache(past_key_values, beam_idx):
        return tuple(tuple(state.index_select(0, beam_idx.to(state.device)) for state in layer)
                     for layer in past_key_values)
