"""The paged-mode attention forward: latent prolog into the paged cache, absorbed decode.

* prefill: `mla.latent_kv_prolog` -> `mla.scatter_pa_kv_cache`; attention over the new tokens
  expanded with kv_b (exactly stock's arithmetic, so logits match stock bit for bit). When a row
  already has cached tokens (a prompt continued in a second call, chunked prefill), the prefix is
  read back with `mla.gather_pa_kv_cache` and expanded with it.
* decode (one token per row): the absorbed path of vLLM / FlashMLA — q_nope @ W_UK ->
  `mla.mla_decode_attention` over the paged latent cache -> @ W_UV -> o_proj. W_UK / W_UV are
  prepared once per layer from kv_b_proj.weight (contiguous copies); kv_b never runs over the cache.
* a layer sharing an earlier layer's latent KV (Mistral-Large-4) writes nothing: it reads the source layer's
  pools (`MLAPagedCache` aliases them) and, in a prefill, the new tokens' latent the source layer left in
  `shared_kv_states`, through its own kv_b (W_UK / W_UV in the decode).
* sparse attention (DeepSeek-V3.2, GLM-5): the indexer keys go into the layer's paged indexer pool
  (`mla.scatter_pa_cache`) and `mla.lightning_indexer` picks each query's top-k over it (`indexer`);
  a prefill folds them into its mask (stock's arithmetic again), a decode step attends to them alone
  with `mla.sparse_mla_attention` over the paged latent cache (absorbed, as above).
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from . import indexer
from .attention_parts import (
    attend,
    dense_key,
    expand_latent,
    latent_prolog,
    project_output,
    query,
    rotary,
    scale_query,
    shared_kv_key,
    shared_query_lora,
    sparse_result,
)

if TYPE_CHECKING:  # (the paged cache module needs transformers' Cache API: not imported here)
    from .paged_cache import ForwardPlan, MLAPagedLayer

# The attribute holding a layer's absorbed W_UK / W_UV copies: derived from kv_b_proj.weight, so
# never copied with the model (a copy remakes its own).
ABSORBED_ATTRIBUTE = "_mla_ops_absorbed"

# Attention modules holding absorbed W_UK / W_UV copies (registered eagerly), freed on revert.
_ABSORBED_OWNERS: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def track_absorbed_owners(modules) -> None:
    """Remember `modules` as owners of absorbed copies, so a revert frees what a compiled decode
    (which makes them inside the trace, where nothing can be registered) left on them."""
    _ABSORBED_OWNERS.update(modules)


def drop_absorbed_weights(modules=None) -> None:
    """Free the absorbed copies of `modules` (any iterable of modules), or of every owner."""
    for module in list(_ABSORBED_OWNERS if modules is None else modules):
        module.__dict__.pop(ABSORBED_ATTRIBUTE, None)
        _ABSORBED_OWNERS.discard(module)


def _absorbed_weights(attn):
    """(W_UK [N, P, L], W_UV^T [N, L, V]), contiguous, made once per layer from kv_b_proj.weight.

    Contiguous copies rather than views: ATen's CPU bf16 bmm copies a strided batch operand on every
    call (measured 8.5 ms for q_nope @ W_UK from the view vs 0.06 ms from the copy). They are remade
    when kv_b_proj.weight is replaced, modified in place, moved or cast (not checked inside a compiled
    graph, where weights are frozen)."""
    weight = attn.kv_b_proj.weight
    cached = attn.__dict__.get(ABSORBED_ATTRIBUTE)
    stale = cached is None or cached[0] is not weight
    if not stale and not torch.compiler.is_compiling():
        # in place (version), new storage (`.data = `, model.to(device) keeps the Parameter), new dtype
        stale = cached[1] != (weight._version, weight.data_ptr(), weight.dtype, weight.device)
    if stale:
        with torch.no_grad():
            per_head = weight.view(attn.num_heads, attn.qk_nope_head_dim + attn.v_head_dim, attn.kv_lora_rank)
            w_uk = per_head[:, : attn.qk_nope_head_dim].contiguous()
            w_uv_t = per_head[:, attn.qk_nope_head_dim:].transpose(1, 2).contiguous()
        cached = (weight, (weight._version, weight.data_ptr(), weight.dtype, weight.device), w_uk, w_uv_t)
        attn.__dict__[ABSORBED_ATTRIBUTE] = cached
        if not torch.compiler.is_compiling():  # (compiled generate: registered by the generate hook)
            _ABSORBED_OWNERS.add(attn)
    return cached[2], cached[3]


def absorbed_decode_step(attn, layer: "MLAPagedLayer", plan: "ForwardPlan", q_nope, q_pe, topk=None, window: int = 0,
                         q_scale=None):
    """One token per row: o = ((softmax(q_lat·latent + q_pe·k_pe, sinks) · latent) @ W_UV) -> [B, 1, N*V], over
    every cached token (mla.mla_decode_attention; its last `window` ones with a sliding window) or, sparse
    attention, over the row-local positions `topk` [B, 1, K] (mla.sparse_mla_attention; -1 = none). `q_scale`
    [B, N]: the query scale per row and head (the family's position-dependent one), the ops' own option."""
    w_uk, w_uv_t = _absorbed_weights(attn)
    batch = q_nope.shape[0]
    sinks = getattr(attn, "sinks", None)  # per-head sink logits [N] (HY-V4), in each softmax denominator
    q_latent = torch.bmm(q_nope[:, :, 0].transpose(0, 1), w_uk).transpose(0, 1)  # [B, N, L]
    if topk is None:
        o_latent = torch.ops.mla.mla_decode_attention(q_latent, q_pe[:, :, 0], layer.latent_pool, layer.k_pe_pool,
                                                      plan.block_tables, plan.seq_lens, attn.scaling, sinks, window,
                                                      q_scale)
    else:  # one query token per request
        starts = torch.arange(batch + 1, dtype=plan.seq_lens.dtype, device=q_latent.device)
        o_latent = torch.ops.mla.sparse_mla_attention(q_latent, q_pe[:, :, 0], layer.latent_pool, layer.k_pe_pool,
                                                      plan.block_tables, plan.seq_lens, starts, topk[:, 0],
                                                      attn.scaling, sinks, q_scale)
    out = torch.bmm(o_latent.transpose(0, 1), w_uv_t)  # [N, B, V]
    return out.transpose(0, 1).reshape(batch, 1, -1)


def _gather_prefix(layer: "MLAPagedLayer", plan: "ForwardPlan"):
    """Cached prefix of every row, padded: (latent [B, P, L], k_pe [B, P, R], valid [B, P])."""
    prefix = plan.prefix_lens
    lengths = prefix.tolist()
    longest, total = max(lengths), sum(lengths)
    cumsum = torch.zeros(len(lengths) + 1, dtype=torch.int64, device=prefix.device)
    cumsum[1:] = torch.cumsum(prefix, 0)
    latent, k_pe = layer.latent_pool, layer.k_pe_pool
    packed_latent = latent.new_empty(total, 1, latent.shape[-1])
    packed_k_pe = k_pe.new_empty(total, 1, k_pe.shape[-1])
    torch.ops.mla.gather_pa_kv_cache(latent, k_pe, plan.block_tables, cumsum, packed_latent, packed_k_pe,
                                     is_seq_lens_cumsum=True)
    pos = torch.arange(longest, device=prefix.device)
    valid = pos[None, :] < prefix[:, None]
    index = torch.where(valid, cumsum[:-1, None] + pos[None, :], 0)
    pad = lambda packed: torch.where(valid[..., None], packed[index.clamp(max=max(total - 1, 0)), 0], 0)  # noqa: E731
    return pad(packed_latent), pad(packed_k_pe), valid


def _prefill_with_prefix(attn, patch, layer, plan, query_states, latent, k_pe, topk=None, window=None):
    """New tokens attend to (gathered prefix + new tokens): materialised K/V via kv_b, own mask (narrowed
    to each real query's `topk` [B, S, K] row-local positions, sparse attention; to the last `window` tokens
    up to each query, a sliding-window layer). A family with attention sinks attends through its own attention
    function (which takes the module's sinks) with the mask made additive."""
    prefix_latent, prefix_k_pe, prefix_valid = _gather_prefix(layer, plan)
    keys_latent = torch.cat((prefix_latent, latent), dim=1)  # [B, P+S, L]
    k_nope, value_states = expand_latent(attn, keys_latent)
    k_pe_all = torch.cat((prefix_k_pe, k_pe), dim=1)[:, None]  # [B, 1, P+S, R]
    key_states = dense_key(k_nope, k_pe_all)
    seq = latent.shape[1]
    real = plan.real
    causal = torch.ones(seq, seq, dtype=torch.bool, device=real.device).tril()
    new_part = causal[None] & real[:, None, :] & real[:, :, None]  # real queries see earlier real tokens
    new_part |= torch.eye(seq, dtype=torch.bool, device=real.device)[None]  # padding queries see themselves
    prefix_part = prefix_valid[:, None, :] & real[:, :, None]
    mask = torch.cat((prefix_part, new_part), dim=-1)[:, None]  # [B, 1, S, P+S]
    if window is not None:  # row-local positions: the prefix's 0.., the real new tokens' after it
        query_pos = plan.prefix_lens[:, None] + torch.cumsum(real.long(), 1) - 1  # [B, S]
        prefix_pos = torch.arange(prefix_latent.shape[1], device=real.device).expand(real.shape[0], -1)
        key_pos = torch.cat((prefix_pos, query_pos), dim=1)  # [B, P+S]
        mask = mask & ((query_pos[:, :, None] - key_pos[:, None, :]) < window)[:, None]
    if topk is not None:
        columns = indexer.paged_columns(topk, plan, prefix_latent.shape[1])
        mask = indexer.restrict_mask(mask, columns, real, query_states.dtype)
    if patch.family.attention_sinks:
        additive = torch.zeros(mask.shape, dtype=query_states.dtype, device=mask.device)
        additive.masked_fill_(~mask, torch.finfo(query_states.dtype).min)
        out, _ = attend(attn, patch, query_states, key_states, value_states, additive, {})
        return out.reshape(latent.shape[0], seq, -1)
    out = F.scaled_dot_product_attention(query_states, key_states, value_states.contiguous(), attn_mask=mask,
                                         scale=attn.scaling)
    return out.transpose(1, 2).reshape(latent.shape[0], seq, -1)


def paged_attention_forward(attn, patch, hidden_states, inputs):
    """The paged-mode body of the patched MLA attention forward -> (attn_output [B, S, hidden], None)."""
    cache = inputs.cache
    plan = cache.plan
    if plan is None:
        raise RuntimeError("MLAPagedCache has no plan for this forward: the model-level hook did not run "
                           "(patch the model with mla_ops.patch(model), whose cache is 'paged')")
    batch, seq = hidden_states.shape[:-1]
    rot = rotary(attn, patch, inputs.position_embeddings, hidden_states)
    layer = cache.layers[attn.layer_idx]  # (a layer sharing an earlier layer's latent KV reads that layer's pools)
    shares_kv = patch.family.shared_latent_kv and attn.is_kv_shared_layer
    layout = layer.layout
    if (layout.kv_lora_rank, layout.rope_dim, layout.source != attn.layer_idx) != \
            (attn.kv_lora_rank, attn.qk_rope_head_dim, shares_kv):
        raise ValueError(f"MLAPagedCache layer {attn.layer_idx} holds {layout}, but the layer has kv_lora_rank "
                         f"{attn.kv_lora_rank}, rope dims {attn.qk_rope_head_dim} and "
                         f"{'shares' if shares_kv else 'owns'} its latent KV: build the cache with the model's "
                         f"layouts, MLAPagedCache(config, layouts=latent_layouts(model), ...)")
    if shares_kv:
        latent, k_pe = inputs.shared_kv_states[shared_kv_key(attn)]  # the new tokens', from the source layer
    else:
        latent, k_pe = latent_prolog(attn, patch, hidden_states, rot)
        torch.ops.mla.scatter_pa_kv_cache(latent.reshape(batch * seq, 1, -1), k_pe.reshape(batch * seq, 1, -1),
                                          layer.latent_pool, layer.k_pe_pool, plan.slot_mapping)
        if patch.family.shared_latent_kv and attn.store_full_length_kv:
            inputs.shared_kv_states[shared_kv_key(attn)] = (latent, k_pe)
    q_lora = shared_query_lora(attn, patch, hidden_states)
    # the paged path runs on the ops
    q_nope, q_pe, gate = query(attn, patch, hidden_states, rot, rope_op=True, q_lora=q_lora)
    q_scale = None
    if (patch.family.query_position_scale or patch.family.query_log_position_scale) and seq == 1:
        # the decode hands the factor per row and head to the op (its q_scale) instead of scaling q
        ones = q_nope.new_ones(batch, q_nope.shape[1], 1, 1)
        q_scale = scale_query(attn, patch, ones, inputs.position_ids)[:, :, 0, 0]
    elif patch.family.query_position_scale or patch.family.query_log_position_scale:
        q_nope = scale_query(attn, patch, q_nope, inputs.position_ids)
        q_pe = scale_query(attn, patch, q_pe, inputs.position_ids)
    topk = indexer.paged_selection(attn, patch, hidden_states, q_lora, inputs, layer, plan) \
        if indexer.selects(attn, patch) else None
    window = attn.sliding_window if patch.family.sliding_window else None
    if window is not None and topk is not None:
        raise NotImplementedError(f"{patch.family.name}: a layer with both a sliding window and an indexer")
    if seq == 1:
        attn_output = absorbed_decode_step(attn, layer, plan, q_nope, q_pe, topk, window or 0, q_scale)
        return sparse_result(patch, project_output(attn, patch, attn_output, hidden_states, gate), None, topk)
    query_states = torch.cat((q_nope, q_pe), dim=-1)
    if plan.has_prefix:
        attn_output = _prefill_with_prefix(attn, patch, layer, plan, query_states, latent, k_pe, topk, window)
        return sparse_result(patch, project_output(attn, patch, attn_output, hidden_states, gate), None, topk)
    # Fresh prefill: the new tokens are all there is (padding included, masked by transformers' own mask),
    # so this is stock's arithmetic and gives stock's logits.
    k_nope, value_states = expand_latent(attn, latent)
    key_states = dense_key(k_nope, k_pe[:, None])
    attention_mask = inputs.attention_mask
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-1] != seq:
        # transformers sized the mask for the whole cache (static: max_cache_len; after rows of only
        # padding: seen + S); the keys here are the new tokens, which are its last S (dynamic) or
        # first S (static, nothing seen yet) columns.
        attention_mask = attention_mask[..., :seq] if cache.static else attention_mask[..., -seq:]
    if topk is not None and patch.family.topk_mask:  # the top-k is the mask (GLM-5-Next), built as stock builds it
        attention_mask = attn.build_attention_mask_from_topk(topk_indices=indexer.paged_columns(topk, plan, 0),
                                                             query_states=query_states, kv_length=seq)
    elif topk is not None:  # as the stock forward folds its top-k (the new tokens are all the keys)
        attention_mask = indexer.restrict_mask(attention_mask, indexer.paged_columns(topk, plan, 0), plan.real,
                                               hidden_states.dtype)
    attn_output, attn_weights = attend(attn, patch, query_states, key_states, value_states, attention_mask,
                                       inputs.extra)
    return sparse_result(patch, project_output(attn, patch, attn_output, hidden_states, gate), attn_weights, topk)
