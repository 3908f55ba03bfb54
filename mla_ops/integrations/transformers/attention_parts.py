"""Pieces of the MLA attention forward shared by the dense and paged modes and by every family.

Each patched attention module (or class) carries a `LayerPatch` (`_mla_ops_patch`): the options it
was patched with, its `MlaFamily` (how this family's forward differs) and the `Release` (what the
installed transformers calls things), all decided once at apply time.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .families import MlaFamily, OutputGate
from .releases import Release

PATCH_ATTRIBUTE = "_mla_ops_patch"
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
    shared_kv_states: object = None  # the latent KV layers hand on to the layers sharing it (Mistral-Large-4)


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
                         cache_position, extra, named.get("prev_topk_indices"), named.get("shared_kv_states"))


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


def uses_rope(attn, patch: LayerPatch) -> bool:
    """Whether this layer rotates (a family with RoPE in some layers only reads the layer's `use_rope`)."""
    return not patch.family.layer_rope or bool(attn.use_rope)


def rotary(attn, patch: LayerPatch, position_embeddings, hidden_states) -> Rotary:
    layout = patch.family.rope_layout(attn.config) if uses_rope(attn, patch) else None
    compute_dtype = patch.rope_compute_dtype(attn.config)
    tables = position_embeddings[0] if isinstance(position_embeddings, (tuple, list)) else None
    if compute_dtype == "activation" and patch.options.rope_compute_dtype == "stock" and tables is not None \
            and tables.dtype == torch.float32 and hidden_states.dtype != torch.float32:
        # fp32 tables beside half activations (dots3_note's indexed layers): the stock formula promotes to fp32
        # and the forward rounds the rotated values once
        compute_dtype = "float32"
    if layout is None:  # NoPE: rotating by angle 0 leaves the values exactly as they are (no values: no rotary dims)
        half = attn.qk_rope_head_dim // 2
        seq = hidden_states.shape[1]
        return Rotary(hidden_states.new_ones(seq, half, dtype=torch.float32),
                      hidden_states.new_zeros(seq, half, dtype=torch.float32), None, None, compute_dtype)
    if tables is None:  # DeepSeek-V2: complex64 freqs_cis [B, S, R/2]
        freqs = position_embeddings.to(hidden_states.device)
        return Rotary(freqs.real, freqs.imag, layout, freqs, compute_dtype)
    cos, sin = position_embeddings  # [B, S, R] = cat(per-pair, per-pair) for every layout
    half = cos.shape[-1] // 2
    return Rotary(cos[..., :half], sin[..., :half], layout, (cos, sin), compute_dtype)


def query_lora(attn, hidden_states, scaled: bool = False):
    """(q_a, q_resid) [B, S, q_lora_rank]: the q-LoRA latent q_a = q_a_proj(x) and q_resid = q_a_layernorm(q_a)
    (a sparse-attention indexer's input too); `scaled`: q_resid times the layer's q_lora_scale (dots3_note)."""
    q_a = attn.q_a_proj(hidden_states)
    q_resid = attn.q_a_layernorm(q_a)
    return q_a, q_resid * attn.q_lora_scale if scaled else q_resid


def split_query(attn, hidden_states, q_lora=None, gated: bool = False):
    """q [B, S, N*(P+R)] -> (q_nope [B, N, S, P], q_pe [B, N, S, R], gate), as the stock forwards do
    (`q_lora`: `query_lora`'s pair when the caller already has it). `gated`: the query projection is AXK2's
    `q_gate_proj` over cat(q_resid, q_a), whose heads hold P+R query and then V gate values: gate [B, S, N*V]
    (None otherwise)."""
    batch, seq = hidden_states.shape[:-1]
    qk_head_dim, gate = attn.qk_nope_head_dim + attn.qk_rope_head_dim, None
    if getattr(attn, "q_a_proj", None) is None:
        q = attn.q_proj(hidden_states)
    else:
        q_a, q_resid = query_lora(attn, hidden_states) if q_lora is None else q_lora
        if gated:
            q_and_gate = attn.q_gate_proj(torch.cat([q_resid, q_a], dim=-1))
            q, gate = torch.split(q_and_gate.view(batch, seq, -1, qk_head_dim + attn.v_head_dim),
                                  [qk_head_dim, attn.v_head_dim], dim=-1)
            gate = gate.reshape(batch, seq, -1)
        else:
            q = attn.q_b_proj(q_resid)
    q = q.view(batch, seq, -1, qk_head_dim).transpose(1, 2)
    q_nope, q_pe = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
    return q_nope, q_pe, gate


def query(attn, patch: LayerPatch, hidden_states, rot: Rotary, *, rope_op: bool = False, q_lora=None):
    """(q_nope [B, N, S, P], q_pe [B, N, S, R] rotated, the output gate the query projection gives or None):
    through mla.q_prolog (q_prolog=True), or the stock projections with q_pe through mla.rope (rope=True, or
    `rope_op`) or the family's own RoPE function. `q_lora`: `query_lora`'s pair, when the caller has it."""
    opts, family = patch.options, patch.family
    if opts.q_prolog:
        lora = getattr(attn, "q_a_proj", None) is not None
        q_a, q_norm = (attn.q_a_proj, attn.q_a_layernorm) if lora else (None, None)
        q_b = attn.q_b_proj if lora else attn.q_proj
        q_nope, q_pe = torch.ops.mla.q_prolog(
            hidden_states, q_a.weight if lora else None, q_a.bias if lora else None,
            q_norm.weight if lora else None, q_b.weight, rot.cos, rot.sin, num_heads=attn.num_heads,
            qk_nope_head_dim=attn.qk_nope_head_dim, eps=q_norm.variance_epsilon if lora else 1e-6,
            rope_layout=rot.op_layout, rope_compute_dtype=rot.compute_dtype)
        return q_nope, q_pe, None
    gated = family.output_gate is not None and family.output_gate.from_query
    if q_lora is None and family.latent_scales:
        q_lora = query_lora(attn, hidden_states, scaled=True)
    q_nope, q_pe, gate = split_query(attn, hidden_states, q_lora, gated)
    if family.lora_scales:  # LongCat scales both parts before the rotation
        q_nope, q_pe = q_nope * attn.mla_scale_q_lora, q_pe * attn.mla_scale_q_lora
    if rot.layout is None:
        return q_nope, q_pe, gate
    if opts.rope or rope_op:
        q_pe = torch.ops.mla.rope(q_pe, rot.cos, rot.sin, layout=rot.layout, compute_dtype=rot.compute_dtype)
        return q_nope, q_pe, gate
    stock = getattr(family.modeling, family.stock_rope_function(rot.layout))
    stock_args = tuple(rot.stock) if isinstance(rot.stock, (tuple, list)) else (rot.stock,)
    # the stock function rotates q (and a dummy k), in fp32 where the tables are (dots3_note's forward then casts back)
    return q_nope, stock(q_pe, q_pe[:, :1], *stock_args)[0].to(q_pe.dtype), gate


def scale_query(attn, patch: LayerPatch, query_states, position_ids):
    """The family's position-dependent query scale on [B, N, S, D] (identity for most families): Mistral-Large-4's
    per-head scale_h * log(pos + 1) + bias_h, its layer's own module as stock calls it after RoPE, or Mistral-4's
    Llama-4 scale. Elementwise per head and position, so q_nope and q_pe may be scaled apart."""
    if patch.family.query_log_position_scale:
        return attn.softmax_scaling(query_states, position_ids, head_dim_first=True)
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
    """mla.latent_kv_prolog -> (latent [B, S, L] normed (and scaled, `kv_latent_scale`), k_pe [B, S, R] rotated). A
    layer without rotary dims (R = 0, Mistral-Large-4's NoPE layers; the prolog op needs R > 0) or with a norm on
    k_pe (dots3_note): kv_a_proj_with_mqa, then the latent's RMSNorm through mla.rms_norm (and k_pe's norm and
    RoPE through mla.rms_norm and mla.rope)."""
    kv_a, norm = attn.kv_a_proj_with_mqa, attn.kv_a_layernorm
    if attn.qk_rope_head_dim == 0 or patch.family.key_rope_norm:
        latent, k_pe = torch.split(kv_a(hidden_states), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        latent = torch.ops.mla.rms_norm(latent.contiguous(), norm.weight, norm.variance_epsilon)
        if patch.family.key_rope_norm:  # dots3_note: an RMSNorm on k_pe, then its RoPE
            k_norm = attn.k_rope_only_layernorm
            k_pe = torch.ops.mla.rms_norm(k_pe.contiguous(), k_norm.weight, k_norm.variance_epsilon)
            if rot.layout is not None:
                k_pe = torch.ops.mla.rope(k_pe[:, None], rot.cos, rot.sin, layout=rot.layout,
                                          compute_dtype=rot.compute_dtype)[:, 0]
    else:
        latent, k_pe = torch.ops.mla.latent_kv_prolog(hidden_states, kv_a.weight, kv_a.bias, norm.weight, rot.cos,
                                                      rot.sin, eps=norm.variance_epsilon, rope_layout=rot.op_layout,
                                                      rope_compute_dtype=rot.compute_dtype)
    scale = kv_latent_scale(attn, patch)
    return (latent if scale is None else latent * scale), k_pe


def kv_latent_scale(attn, patch: LayerPatch):
    """The scale on the normed KV latent, where the family has one (LongCat-Flash's mla_scale_kv_lora, dots3_note's
    kv_lora_scale); None elsewhere."""
    if patch.family.lora_scales:
        return attn.mla_scale_kv_lora
    return attn.kv_lora_scale if patch.family.latent_scales else None


def shared_kv_key(attn) -> str:
    """The entry of `shared_kv_states` a layer's latent KV goes under: stock Mistral-Large-4 keeps one per kind of
    layer ("rope" / "nope"), which its `kv_source_layers` pair with their sources."""
    return "rope" if attn.use_rope else "nope"


def shared_latent(attn, patch: LayerPatch, hidden_states, rot: Rotary, inputs: ForwardInputs):
    """The dense mode's latent KV of a family whose layers share it (Mistral-Large-4), as stock caches it ->
    (latent [B, 1, T, L], k_pe [B, 1, T, R]) of every cached token. A layer that owns it computes the new tokens'
    with `latent_prolog` and updates the model's cache with them; a layer that shares an earlier layer's reads
    them from `shared_kv_states`, where a source layer leaves its own."""
    if attn.is_kv_shared_layer:
        return inputs.shared_kv_states[shared_kv_key(attn)]
    latent, k_pe = latent_prolog(attn, patch, hidden_states, rot)
    latent, k_pe = latent[:, None], k_pe[:, None]
    if inputs.cache is not None:
        latent, k_pe = patch.release.update_cache(inputs.cache, latent, k_pe, attn.layer_idx, inputs.cache_position,
                                                  inputs.extra)
    if attn.store_full_length_kv:
        inputs.shared_kv_states[shared_kv_key(attn)] = (latent, k_pe)
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
def shared_query_lora(attn, patch: LayerPatch, hidden_states):
    """`query_lora`'s pair where more than the query projection reads it: a layer's own sparse-attention
    indexer (q_resid; not one taking its query from the layer input) or AXK2's fused query-and-gate projection
    (both); None elsewhere (the query path computes it itself)."""
    gated = patch.family.output_gate is not None and patch.family.output_gate.from_query
    indexed = patch.family.sparse and getattr(attn, "indexer", None) is not None and \
        not patch.family.indexer_input_query
    needed = indexed or (gated and not patch.options.q_prolog)
    return query_lora(attn, hidden_states, scaled=patch.family.latent_scales) if needed else None


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
    if patch.family.sliding_window:  # as stock passes it (flash kernels window themselves; eager / sdpa: the mask)
        extra = {**extra, "sliding_window": attn.sliding_window}
    if patch.family.attention_sinks:  # as stock passes it (its eager function reads the module's own `sinks`)
        extra = {**extra, "s_aux": attn.sinks}
    out, weights = interface(attn, query_states, key_states, value_states, attention_mask,
                             dropout=0.0 if not attn.training else attn.attention_dropout, scaling=attn.scaling,
                             **extra)
    return (out[..., : out.shape[-1] - pad] if pad else out), weights


def gate_output(attn, gate: OutputGate, attn_output, hidden_states, gate_states=None):
    """The family's sigmoid output gate on attn_output [B, S, N, V] (or [B, S, N*V]) -> [B, S, N, V], rounded
    where its stock forward rounds (`OutputGate.rounding`). g: `gate_states` [B, S, N*V] from the query
    projection (`OutputGate.from_query`), else the gate projection of the layer input `hidden_states`; one gate
    per head ([B, S, N]) or per head and channel ([B, S, N*V]), as the projection gives it."""
    batch, seq = hidden_states.shape[:-1]
    g = gate_states if gate.from_query else getattr(attn, gate.module)(hidden_states)
    g = g.reshape(batch, seq, attn.num_heads, -1)
    attn_output = attn_output.reshape(batch, seq, attn.num_heads, -1)
    if gate.rounding == "gate_float32":
        return attn_output * torch.sigmoid(g.float()).to(attn_output.dtype)
    if gate.rounding == "product_float32":
        return (attn_output * torch.sigmoid(g.float())).to(attn_output.dtype)
    return attn_output * torch.sigmoid(g)


def project_output(attn, patch: LayerPatch, attn_output, hidden_states, gate_states=None):
    """[B, S, N, V] (or [B, S, N*V]) -> o_proj output [B, S, hidden]; the family's output gate first, as its
    stock forward does (`gate_states`: a gate the query projection gave)."""
    batch, seq = hidden_states.shape[:-1]
    if patch.family.output_gate is not None:
        attn_output = gate_output(attn, patch.family.output_gate, attn_output, hidden_states, gate_states)
    return attn.o_proj(attn_output.reshape(batch, seq, -1).contiguous())
