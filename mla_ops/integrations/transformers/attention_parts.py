"""Pieces of the MLA attention forward shared by the dense and paged modes and by every family.

Each patched attention module (or class) carries a `LayerPatch` (`_mla_ops_patch`): the options it
was patched with, its `MlaFamily` (how this family's forward differs) and the `Release` (what the
installed transformers calls things), all decided once at apply time.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .families import ROPE_FUNCTIONS, MlaFamily
from .releases import Release

PATCH_ATTRIBUTE = "_mla_ops_patch"
STOCK_ROPE_FUNCTION = {layout: name for name, layout in ROPE_FUNCTIONS.items()}
CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value")  # 5.24+, 4.56-5.23, 4.54-4.55


@dataclasses.dataclass(frozen=True)
class LayerPatch:
    """What one patched attention class or module needs (family and release are None for the hub code;
    `remote_rope_compute_dtype` is the hub code's stock rounding, found by running its RoPE at apply time)."""

    options: "object"  # PatchOptions (defined with patch())
    family: Optional[MlaFamily]
    release: Optional[Release]
    remote_rope_compute_dtype: str = "float32"

    def rope_compute_dtype(self, config) -> str:
        """The rope_compute_dtype the ops rotate this layer's q_pe / k_pe with: the patch option, or for
        "stock" the one reproducing the stock forward's rounding (per model: a family whose config picks
        the RoPE function may pick its rounding with it)."""
        chosen = self.options.rope_compute_dtype
        if chosen != "stock":
            return chosen
        return self.remote_rope_compute_dtype if self.family is None else self.family.stock_rope_compute_dtype(config)


def layer_patch(module) -> LayerPatch:
    """The LayerPatch the patch stored on this attention module (or on its class)."""
    return getattr(module, PATCH_ATTRIBUTE)


@dataclasses.dataclass(frozen=True)
class ForwardInputs:
    """One call's arguments, sorted: the stock forward's named parameters and the rest (`extra`,
    passed on to the attention function as the stock forward passes its **kwargs)."""

    attention_mask: Optional[torch.Tensor]
    position_embeddings: object  # complex freqs [B, S, R/2] (DeepSeek-V2), (cos, sin) [B, S, R], or None
    cache: object
    position_ids: Optional[torch.Tensor]
    cache_position: Optional[torch.Tensor]
    extra: dict
    prev_topk_indices: Optional[torch.Tensor] = None  # a "shared" sparse-attention layer's previous top-k


def sort_arguments(family: MlaFamily, args: tuple, kwargs: dict) -> ForwardInputs:
    """Map a call of the stock signature (positional or keyword; any of the cache keywords) onto
    ForwardInputs. Names the stock forward declares are not passed on (it does not pass them either)."""
    named = dict(zip(family.parameters[1:], args))
    extra = dict(kwargs)
    for name in family.parameters[1:]:
        if name in extra:
            named[name] = extra.pop(name)
    cache = None
    for keyword in CACHE_KEYWORDS:  # whichever keyword the caller used; none is passed on
        value = named.pop(keyword, extra.pop(keyword, None))
        cache = cache if value is None else value
    position_ids = named.get("position_ids", extra.get("position_ids"))
    cache_position = named.get("cache_position", extra.get("cache_position"))
    return ForwardInputs(named.get("attention_mask"), named.get("position_embeddings"), cache, position_ids,
                         cache_position, extra, named.get("prev_topk_indices"))


# --------------------------------------------------------------------------------------------- RoPE
@dataclasses.dataclass(frozen=True)
class Rotary:
    """One forward's RoPE for the ops: per-pair tables [B, S, R/2] (or [S, R/2]), the layout and the
    rope_compute_dtype (where the rotation rounds). `layout` None is NoPE: the tables are the identity
    rotation and `stock` is None."""

    cos: torch.Tensor
    sin: torch.Tensor
    layout: Optional[str]
    stock: object  # the position embeddings as the stock forward received them
    compute_dtype: str = "float32"

    @property
    def op_layout(self) -> str:
        """The layout the prolog ops get (any, for NoPE: the identity rotation moves nothing)."""
        return self.layout or "interleaved"


def rotary(attn, patch: LayerPatch, position_embeddings, hidden_states) -> Rotary:
    layout = patch.family.rope_layout(attn.config)
    if layout is None:  # NoPE: rotating by angle 0 leaves the values exactly as they are
        half = attn.qk_rope_head_dim // 2
        seq = hidden_states.shape[1]
        return Rotary(hidden_states.new_ones(seq, half, dtype=torch.float32),
                      hidden_states.new_zeros(seq, half, dtype=torch.float32), None, None)
    compute_dtype = patch.rope_compute_dtype(attn.config)
    if layout == "interleaved":  # DeepSeek-V2: complex64 freqs_cis [B, S, R/2]
        freqs = position_embeddings.to(hidden_states.device)
        return Rotary(freqs.real, freqs.imag, layout, freqs, compute_dtype)
    cos, sin = position_embeddings  # [B, S, R] = cat(per-pair, per-pair) for both layouts
    half = cos.shape[-1] // 2
    return Rotary(cos[..., :half], sin[..., :half], layout, (cos, sin), compute_dtype)


def query_residual(attn, hidden_states):
    """q_a_layernorm(q_a_proj(x)) [B, S, q_lora_rank]: the q-LoRA latent (a sparse-attention indexer's
    input too)."""
    return attn.q_a_layernorm(attn.q_a_proj(hidden_states))


def split_query(attn, hidden_states, q_resid=None):
    """q [B, S, N*(P+R)] -> (q_nope [B, N, S, P], q_pe [B, N, S, R]), as the stock forwards do
    (`q_resid`: the q-LoRA latent when the caller already has it)."""
    batch, seq = hidden_states.shape[:-1]
    if getattr(attn, "q_a_proj", None) is None:
        q = attn.q_proj(hidden_states)
    else:
        q = attn.q_b_proj(query_residual(attn, hidden_states) if q_resid is None else q_resid)
    q = q.view(batch, seq, -1, attn.qk_nope_head_dim + attn.qk_rope_head_dim).transpose(1, 2)
    return torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)


def query(attn, patch: LayerPatch, hidden_states, rot: Rotary, *, rope_op: bool = False, q_resid=None):
    """(q_nope [B, N, S, P], q_pe [B, N, S, R] rotated): through mla.q_prolog (q_prolog=True), or the
    stock projections with q_pe through mla.rope (rope=True, or `rope_op`) or the family's own RoPE
    function. `q_resid`: the q-LoRA latent, when the caller computed it (`query_residual`)."""
    opts, family = patch.options, patch.family
    if opts.q_prolog:
        lora = getattr(attn, "q_a_proj", None) is not None
        q_a, q_norm = (attn.q_a_proj, attn.q_a_layernorm) if lora else (None, None)
        q_b = attn.q_b_proj if lora else attn.q_proj
        return torch.ops.mla.q_prolog(
            hidden_states, q_a.weight if lora else None, q_a.bias if lora else None,
            q_norm.weight if lora else None, q_b.weight, rot.cos, rot.sin, num_heads=attn.num_heads,
            qk_nope_head_dim=attn.qk_nope_head_dim, eps=q_norm.variance_epsilon if lora else 1e-6,
            rope_layout=rot.op_layout, rope_compute_dtype=rot.compute_dtype)
    q_nope, q_pe = split_query(attn, hidden_states, q_resid)
    if family.lora_scales:  # LongCat scales both parts before the rotation
        q_nope, q_pe = q_nope * attn.mla_scale_q_lora, q_pe * attn.mla_scale_q_lora
    if rot.layout is None:
        return q_nope, q_pe
    if opts.rope or rope_op:
        return q_nope, torch.ops.mla.rope(q_pe, rot.cos, rot.sin, layout=rot.layout, compute_dtype=rot.compute_dtype)
    stock = getattr(family.modeling, STOCK_ROPE_FUNCTION[rot.layout])
    stock_args = (rot.stock,) if rot.layout == "interleaved" else rot.stock
    return q_nope, stock(q_pe, q_pe[:, :1], *stock_args)[0]  # the stock function rotates q (and a dummy k)


def scale_query(attn, patch: LayerPatch, query_states, position_ids):
    """Mistral-4's Llama-4 position-dependent query scale (identity for the other families)."""
    if not patch.family.query_position_scale:
        return query_states
    params = attn.config.rope_parameters
    scale = patch.family.modeling.get_llama_4_attn_scale(position_ids, params.get("llama_4_scaling_beta"),
                                                         params.get("original_max_position_embeddings"))
    return query_states * scale.to(query_states.dtype)


# ----------------------------------------------------------------------------------------- KV path
def kv_prolog_call(attn, hidden_states, rot: Rotary):
    """mla.kv_prolog with this layer's weights -> (k_nope [B,N,S,P], value [B,N,S,V], k_pe [B,1,S,R])."""
    kv_a, norm = attn.kv_a_proj_with_mqa, attn.kv_a_layernorm
    return torch.ops.mla.kv_prolog(
        hidden_states, kv_a.weight, kv_a.bias, norm.weight, attn.kv_b_proj.weight, rot.cos, rot.sin,
        num_heads=attn.num_heads, qk_nope_head_dim=attn.qk_nope_head_dim, v_head_dim=attn.v_head_dim,
        eps=norm.variance_epsilon, rope_layout=rot.op_layout, rope_compute_dtype=rot.compute_dtype)


def latent_prolog(attn, patch: LayerPatch, hidden_states, rot: Rotary):
    """mla.latent_kv_prolog -> (latent [B, S, L] normed (and LongCat-scaled), k_pe [B, S, R] rotated)."""
    kv_a, norm = attn.kv_a_proj_with_mqa, attn.kv_a_layernorm
    latent, k_pe = torch.ops.mla.latent_kv_prolog(hidden_states, kv_a.weight, kv_a.bias, norm.weight, rot.cos,
                                                  rot.sin, eps=norm.variance_epsilon, rope_layout=rot.op_layout,
                                                  rope_compute_dtype=rot.compute_dtype)
    if patch.family.lora_scales:
        latent = latent * attn.mla_scale_kv_lora
    return latent, k_pe


def dense_key(k_nope, k_pe):
    """[k_nope | k_pe broadcast over heads]: the full per-head key the dense cache stores."""
    return torch.cat((k_nope, k_pe.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)


def expand_latent(attn, latent):
    """latent [B, T, L] -> (k_nope [B, N, T, P], value [B, N, T, V]) through the layer's own kv_b_proj:
    the stock model's expansion of its latent cache (views of one projection)."""
    batch, tokens, _ = latent.shape
    kv = attn.kv_b_proj(latent).view(batch, tokens, attn.num_heads, attn.qk_nope_head_dim + attn.v_head_dim)
    return torch.split(kv.transpose(1, 2), [attn.qk_nope_head_dim, attn.v_head_dim], dim=-1)


# ---------------------------------------------------------------------------------------- attention
def sparse_query_residual(attn, patch: LayerPatch, hidden_states):
    """The q-LoRA latent a layer's own sparse-attention indexer reads (None: dense attention, or a
    "shared" layer reusing the previous layer's top-k)."""
    if not patch.family.sparse or getattr(attn, "indexer", None) is None:
        return None
    return query_residual(attn, hidden_states)


def sparse_result(patch: LayerPatch, output, weights, topk):
    """The forward's return: (output, weights), and the top-k third where the stock forward returns it."""
    return (output, weights, topk) if patch.family.shared_topk else (output, weights)


def attend(attn, patch: LayerPatch, query_states, key_states, value_states, attention_mask, extra: dict):
    """The model's attention implementation (eager / sdpa / ...) over [B, N, S, *] states
    -> ([B, S, N, V], attention weights or None)."""
    implementation = attn.config._attn_implementation
    interface = patch.release.attention_function(patch.family.modeling, implementation)
    pad = query_states.shape[-1] - value_states.shape[-1]
    pad = pad if patch.family.flash_value_padding and "flash" in (implementation or "") else 0
    if pad:  # as those stock forwards do: flash kernels want one head dim for K and V
        value_states = torch.nn.functional.pad(value_states, [0, pad])
    out, weights = interface(attn, query_states, key_states, value_states, attention_mask,
                             dropout=0.0 if not attn.training else attn.attention_dropout, scaling=attn.scaling,
                             **extra)
    return (out[..., : out.shape[-1] - pad] if pad else out), weights


def project_output(attn, patch: LayerPatch, attn_output, hidden_states):
    """[B, S, N, V] (or [B, S, N*V]) -> o_proj output [B, S, hidden]; Bailing's per-head sigmoid gate
    from the layer input first, as its stock forward does."""
    batch, seq = hidden_states.shape[:-1]
    if patch.family.output_gate:
        gate = torch.sigmoid(attn.g_proj(hidden_states).float()).to(hidden_states.dtype)
        attn_output = attn_output.reshape(batch, seq, attn.num_heads, -1) * gate.unsqueeze(-1)
    return attn.o_proj(attn_output.reshape(batch, seq, -1).contiguous())
