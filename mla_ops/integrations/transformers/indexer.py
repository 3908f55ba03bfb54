"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): each query's top-k keys, for the dense and the paged mode.

Dense mode selects as stock does, with the layer's own indexer forward (`dense_selection`: its
`torch.topk` choice among exactly equal scores has no rule that another kernel could reproduce), and
folds the top-k into the attention mask as the stock forward folds it (`restrict_mask`).

Paged mode: the indexer's own projections (wq_b, wk, k_norm, weights_proj) and its RoPE run as the
stock indexer computes them, with its modules and the RoPE function its forward names (DeepSeek-V3.2:
NeoX half-split, GLM-5: interleaved pairs; HY-V4 rotates the trailing dims and norms the key in fp32).
Scoring and selection, sum_h w_h * relu(scale * q_h.k) over the keys a query may see and the best
`index_topk` of them, are one `mla.lightning_indexer` call over the paged indexer-key pool; a prefill
folds the chosen keys into its mask, the decode hands them to `mla.sparse_mla_attention`. A pooled indexer
(GLM-5-Next's "KeyPool": keys pooled over blocks of tokens by a learned gate) selects with its own forward
in both modes; the paged mode hands it the cached rows as its stock cache would (`PooledIndexerRows`).

Requests. The op reads a request's keys through a block table and lets query i of a request with
q_len queries and seq_len keys see positions 0..seq_len-q_len+i (right-down causal), so each batch
row becomes two requests (`select_topk`): its padding queries, scored against anything and then
dropped (the stock mask hides every key from them, so their top-k changes nothing), and its real
queries, which see the row's real keys in order. The paged cache stores real tokens only.

Ties: where scores tie exactly across the k-th place, the op keeps the lower positions (its contract)
and stock's `torch.topk` keeps whichever its partial sort leaves in front, so paged mode can fold other
keys than stock there (with few indexer heads many scores are exactly 0 after the ReLU); dense mode
picks stock's.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn.functional as F

from .attention_parts import CACHE_KEYWORDS
from .families import forward_parameters

# The attention implementations the stock forward folds the top-k into the mask for; any other gets it
# as `indices=` (a sparse kernel such as flash-mla), as stock hands it.
MASKED_IMPLEMENTATIONS = ("eager", "sdpa")


def indexer_query_key(indexer, family, hidden_states, q_resid, position_embeddings, position_ids=None):
    """The stock indexer's inputs to its scores: (q [B, S, H, D] and k [B, S, D], both rotated, in the
    model's dtype; weights [B, S, H] fp32 with n_heads**-0.5 folded in). The key is normed in the norm's own
    dtype (HY-V4's LayerNorm is fp32) and the RoPE dims are the leading or trailing qk_rope_head_dim
    (`MlaFamily.indexer_rope_trailing`); a forward folding softmax_scale into the weights and scoring
    relu(q.k) (HY-V4) scores the same: relu(s x) = s relu(x) for s > 0, equal up to fp32 rounding.
    `indexer`: the layer's indexer module; `q_resid` [B, S, q_lora_rank]: q_a_layernorm(q_a_proj(x)), as the
    attention computed it, or None for an indexer taking its query from the layer input
    (`MlaFamily.indexer_input_query`: wq_b(q_input_norm(x)) scaled by its log-position scale at `position_ids`,
    rotated only where the indexer's `use_rope` says)."""
    batch, seq = hidden_states.shape[:-1]
    cos, sin = position_embeddings
    if family.indexer_input_query:
        q = indexer.wq_b(indexer.q_input_norm(hidden_states)).view(batch, seq, indexer.n_heads, indexer.head_dim)
        q = indexer.softmax_scaling(q, position_ids, head_dim_first=False)
    else:
        q = indexer.wq_b(q_resid).view(batch, seq, indexer.n_heads, indexer.head_dim)
    k = indexer.wk(hidden_states)
    norm_weight = getattr(indexer.k_norm, "weight", None)
    if isinstance(norm_weight, torch.Tensor):  # in the norm's own dtype (HY-V4's fp32 LayerNorm), then back
        k = k.to(norm_weight.dtype)
    k = indexer.k_norm(k).to(hidden_states.dtype).unsqueeze(2)  # [B, S, 1, D]
    if getattr(indexer, "use_rope", True):
        rotate = getattr(family.modeling, family.indexer)
        rope_dims, pass_dims = indexer.qk_rope_head_dim, indexer.head_dim - indexer.qk_rope_head_dim
        trailing = family.indexer_rope_trailing  # the rotated dims last (HY-V4), else first (DeepSeek-V3.2)
        split = [pass_dims, rope_dims] if trailing else [rope_dims, pass_dims]
        q_parts, k_parts = list(torch.split(q, split, dim=-1)), list(torch.split(k, split, dim=-1))
        rotated = 1 if trailing else 0
        q_parts[rotated], k_parts[rotated] = rotate(q_parts[rotated], k_parts[rotated], cos, sin, unsqueeze_dim=2)
        q, k = torch.cat(q_parts, dim=-1), torch.cat(k_parts, dim=-1)
    k = k.squeeze(2)
    weights_proj = indexer.weights_proj
    weights = weights_proj(hidden_states.to(weights_proj.weight.dtype)).float() * (indexer.n_heads ** -0.5)
    return q, k, weights


def select_topk(indexer, q, weights, k_cache, block_tables, seq_lens, real):
    """The `indexer` module's top-k of every real query of B rows -> int32 [B, S, index_topk]: row-local
    key positions, best first, -1 past what a query can see and everywhere for a padding query.

    q [B, S, H, D], weights [B, S, H] (`indexer_query_key`); k_cache [NB, bs, 1, D]; block_tables
    [B, W] and seq_lens [B]: row b's real keys, positions 0..seq_lens[b]-1, the last of them its real
    queries in order; real [B, S] bool: which queries are real."""
    batch, seq = real.shape
    n_real = real.sum(1)
    n_pad = seq - n_real
    rows = torch.arange(batch, device=real.device)[:, None]
    # each row's padding queries first, then its real ones in order (a stable sort of the flags)
    order = torch.argsort(real.to(torch.int8), dim=1, stable=True)
    flat = lambda x: x[rows, order].reshape(batch * seq, *x.shape[2:])  # noqa: E731
    block_size = k_cache.shape[1]
    width = max(block_tables.shape[1], -(-seq // block_size))
    # the padding request of a row: n_pad positions of block 0 repeated (any key: its result is dropped)
    tables = torch.stack((torch.zeros_like(block_tables[:, :1]).expand(-1, width),
                          F.pad(block_tables, (0, width - block_tables.shape[1]))), dim=1).reshape(2 * batch, width)
    lens = torch.stack((n_pad, seq_lens.to(n_pad.dtype)), dim=1).reshape(-1)
    starts = F.pad(torch.cumsum(torch.stack((n_pad, n_real), dim=1).reshape(-1), 0), (1, 0))
    local = torch.ops.mla.lightning_indexer(flat(q), flat(weights), k_cache, tables, lens, starts, indexer.index_topk,
                                            indexer.softmax_scale).view(batch, seq, -1)
    local = local[rows, torch.argsort(order, dim=1)]  # back to the tokens' order
    return torch.where(real[..., None], local, -1)


def restrict_mask(attention_mask, columns, real, dtype):
    """The stock fold of a top-k into the attention mask: a query's keys outside its top-k `columns`
    [B, S, K] (key columns, -1: none) are masked (`& ~` a bool mask, `finfo(dtype).min` in an additive
    one). With `real` [B, S] (bool), a padding query's row is left as it is (the mask already hides
    every key there); None folds every row, as stock does."""
    batch, seq = columns.shape[:2]
    keys = attention_mask.shape[-1]
    index = torch.where(columns < 0, keys, columns).long()  # -1 -> a spare column, cut off below
    dropped = columns.new_ones((batch, seq, keys + 1), dtype=torch.bool).scatter(-1, index, False)[..., :keys]
    if real is not None:
        dropped = dropped & real[..., None]
    dropped = dropped.unsqueeze(1)  # [B, 1, S, T]; True = masked
    if attention_mask.dtype == torch.bool:
        return attention_mask & ~dropped
    return attention_mask.masked_fill(dropped, torch.finfo(dtype).min)


def selects(attn, patch) -> bool:
    """Whether this layer attends to a top-k: it runs an indexer, or reuses the previous layer's top-k (a "shared"
    layer); a layer of a sparse family with neither attends densely (dots3_note's sliding-window layers)."""
    return patch.family.sparse and (getattr(attn, "indexer", None) is not None or patch.family.shared_topk)


def previous_topk(inputs):
    """A "shared" layer's top-k: the previous layer's, as the stock forward reuses it."""
    if inputs.prev_topk_indices is None:
        raise ValueError("Shared DSA layers require top-k indices from a previous full indexer layer.")
    return inputs.prev_topk_indices


def stock_indexer_call(indexer, hidden_states, q_resid, position_embeddings, mask, position_ids, cache):
    """The layer's own indexer forward -> its int32 top-k [B, S, K], each argument passed in the place its forward
    names it (the cache is `past_key_values` before transformers 5.24 and `cache` from 5.24; an indexer taking its
    query from the layer input takes no q_resid, GLM-5-Next's pooled indexer no RoPE tables and a 2-D mask).
    `mask`: the mask the stock attention hands its indexer ([B, S, T], or the model's [B, S] padding mask)."""
    values = {"hidden_states": hidden_states, "q_resid": q_resid, "position_embeddings": position_embeddings,
              "attention_mask": mask, "position_ids": position_ids, **dict.fromkeys(CACHE_KEYWORDS, cache)}
    return indexer(*(values[name] for name in forward_parameters(type(indexer))))


def dense_selection(attn, patch, hidden_states, q_lora, inputs, query_states, kv_length: int):
    """The dense mode's top-k, stock's exactly: (the attention mask with it folded in as stock folds it,
    or the mask unchanged and the top-k passed as `indices=` to other implementations; extra kwargs for
    the attention function; the int32 [B, S, min(index_topk, T)] top-k a "shared" next layer reuses).
    A family whose mask is the top-k alone (`MlaFamily.topk_mask`, GLM-5-Next: the model hands the layer its
    [B, S] padding mask, the indexer's top-k holds causality and padding) builds it with the layer's own
    `build_attention_mask_from_topk` from `query_states` [B, N, S, D] and the `kv_length` keys.

    The layer's own indexer forward scores and selects (it writes its key through the stock cache's
    `update_indexer`, scores [B, S, T] against the model's mask and keeps `torch.topk`'s choice). Which
    of several exactly equal scores `torch.topk` keeps has no rule (ATen's CPU kernel runs
    std::partial_sort / std::nth_element on the scores alone, its choice depending on the row's length
    and contents), and with few indexer heads many scores are exactly 0 after the ReLU: only the same
    computation on the same row picks the same keys, which dense mode promises. `mla.lightning_indexer`
    and its tie rule serve the paged mode."""
    mask, topk_mask = inputs.attention_mask, patch.family.topk_mask
    if not isinstance(mask, torch.Tensor) or mask.dim() != (2 if topk_mask else 4):
        raise ValueError(f"sparse attention needs the model's {'2-D padding' if topk_mask else '4-D attention'} "
                         f"mask (the indexer scores against it)")
    if attn.indexer is None:
        columns = previous_topk(inputs)
    else:
        # the stock call: the indexer scores against the 3-D [B, S, T] mask (the 2-D one where the top-k is the mask)
        columns = stock_indexer_call(attn.indexer, hidden_states, None if q_lora is None else q_lora[1],
                                     inputs.position_embeddings, mask if topk_mask else mask[:, 0],
                                     inputs.position_ids, inputs.cache)
    if topk_mask:
        return attn.build_attention_mask_from_topk(topk_indices=columns, query_states=query_states,
                                                   kv_length=kv_length), {}, columns
    if attn.config._attn_implementation in MASKED_IMPLEMENTATIONS:
        return restrict_mask(mask, columns, None, hidden_states.dtype), {}, columns
    return mask, {"indices": columns}, columns


def paged_selection(attn, patch, hidden_states, q_lora, inputs, layer, plan):
    """The paged mode's top-k: int32 [B, S, K] row-local positions of the paged cache (-1: none).
    The new tokens' indexer keys go into the layer's paged indexer pool (`mla.scatter_pa_cache`, the
    plan's slots: padding is never stored) and the op reads the pool through the row block tables."""
    if attn.indexer is None:
        return previous_topk(inputs)
    if patch.family.indexer_pooled:
        return pooled_selection(attn, hidden_states, None if q_lora is None else q_lora[1], layer, plan)
    with torch.no_grad():
        q, k, weights = indexer_query_key(attn.indexer, patch.family, hidden_states,
                                          None if q_lora is None else q_lora[1], inputs.position_embeddings,
                                          inputs.position_ids)
        pool = layer.indexer_pool_like(k)
        torch.ops.mla.scatter_pa_cache(k.reshape(-1, 1, k.shape[-1]), pool, plan.slot_mapping)
        return select_topk(attn.indexer, q, weights, pool, plan.block_tables, plan.seq_lens, plan.real)


class PooledIndexerRows:
    """The stock cache as a pooled indexer (GLM-5-Next's "KeyPool") reads it, over a paged layer: its forward
    hands `update_indexer` the new tokens' (key | gate score | valid) rows and gets back every cached row of each
    batch row, and reads the rows' width from `layers[i].keys` and `layers[i].get_seq_length()`.

    The new rows go into the layer's indexer pool (`mla.scatter_pa_cache`, the plan's slots: padding is never
    stored), and each batch row's cached rows come back right-aligned in `width` columns (the table's capacity,
    a static shape), the valid channel 0 before them: where a left-padded stock cache keeps them, so the
    forward pools, scores, selects and expands as its stock call does (left padding, as generate pads).
    `row_local` turns its columns back into the paged cache's row-local positions."""

    def __init__(self, layer, plan, layer_idx: int):
        self.pool, self.plan = layer.indexer_pool, plan
        self.block_size = self.pool.shape[1]
        self.width = plan.block_tables.shape[1] * self.block_size
        self.layers = {layer_idx: self}
        self.keys = self.pool.new_empty(0, self.width, 0)  # (what the stock forward reads the width off)

    def get_seq_length(self) -> int:
        return self.width

    def update_indexer(self, packed, layer_idx: int):
        """packed [B, S, 2D + 1] (key | gate score | valid) of the new tokens -> [B, width, 2D + 1] of every
        cached token, right-aligned."""
        plan = self.plan
        new = packed[..., :-1].to(self.pool.dtype)
        torch.ops.mla.scatter_pa_cache(new.reshape(-1, 1, new.shape[-1]), self.pool, plan.slot_mapping)
        position = torch.arange(self.width, device=packed.device)[None, :] - self.offsets()[:, None]  # [B, W]
        valid = position >= 0
        position = position.clamp(min=0)
        block = torch.gather(plan.block_tables.long(), 1, torch.div(position, self.block_size, rounding_mode="floor"))
        rows = self.pool[block.clamp(0, self.pool.shape[0] - 1), position % self.block_size, 0]  # [B, W, 2D]
        rows = rows.masked_fill(~valid[..., None], 0)
        return torch.cat([rows, valid[..., None].to(rows.dtype)], dim=-1).to(packed.dtype)

    def offsets(self):
        """[B] the column of each row's first cached token."""
        return self.width - self.plan.seq_lens.long()

    def row_local(self, columns):
        """[B, S, K] columns of the right-aligned rows (-1 none) -> the paged cache's row-local positions."""
        local = columns.long() - self.offsets()[:, None, None]
        return torch.where((columns >= 0) & (local >= 0), local, -1).to(torch.int32)


def pooled_selection(attn, hidden_states, q_resid, layer, plan):
    """A pooled indexer's top-k in the paged mode: its own forward over the cached (key | gate score) rows
    (`PooledIndexerRows`) -> int32 [B, S, K] row-local positions (-1 none; -1 everywhere for a padding query)."""
    rows = PooledIndexerRows(layer, plan, attn.layer_idx)
    with torch.no_grad():
        columns = stock_indexer_call(attn.indexer, hidden_states, q_resid, None, plan.real, None, rows)
    return rows.row_local(columns)


def paged_columns(local, plan, prefix_width: int):
    """Row-local positions [B, S, K] of the paged cache -> key columns of a prefill's
    [prefix padded to prefix_width | new tokens] (-1 kept): position j < prefix_lens[b] is the
    prefix's column j, a later one the column of the (j - prefix_lens[b])-th real new token."""
    batch, seq = plan.real.shape
    prefix = plan.prefix_lens.view(batch, 1, 1)
    new_columns = torch.argsort((~plan.real).to(torch.int8), dim=1, stable=True)  # real new tokens first
    new = (local.long() - prefix).clamp(0, seq - 1).view(batch, -1)
    later = prefix_width + torch.gather(new_columns, 1, new).view(local.shape)
    columns = torch.where(local < prefix, local.long(), later)
    return torch.where(local < 0, -1, columns)


# The probe of `indexer_refusal`: tokens of one random row, the top-k it keeps (fewer than the tokens,
# so the choice shows).
PROBE_TOKENS, PROBE_TOPK = 24, 6


def indexer_refusal(attn, family) -> Optional[str]:
    """Run the layer's stock indexer and the patch's selection (`indexer_query_key` + the op) on one
    small random row, causal, and compare what they pick; None when they pick the same keys.

    Its forward's names cannot tell every variant apart (HY-V4's indexer rotates the last
    qk_rope_head_dim dims, not the first, with DeepSeek-V3.2's very names). The picks are compared by
    their scores under the patch's own q and k, so keys tied on score may differ; another rotation,
    split or scale picks keys of other scores. No-op without an indexer or on the meta device."""
    indexer = getattr(attn, "indexer", None)
    if indexer is None or indexer.wk.weight.is_meta:
        return None
    weight = indexer.wk.weight
    generator = torch.Generator().manual_seed(0)
    new = lambda *shape: torch.randn(*shape, generator=generator).to(weight)  # noqa: E731
    hidden = new(1, PROBE_TOKENS, indexer.hidden_size)
    q_resid = None if family.indexer_input_query else new(1, PROBE_TOKENS, indexer.q_lora_rank)
    positions = torch.arange(PROBE_TOKENS, device=weight.device)[None]
    angles = torch.randn(1, PROBE_TOKENS, indexer.qk_rope_head_dim // 2, generator=generator)
    cos, sin = (torch.cat((f(angles), f(angles)), dim=-1).to(weight) for f in (torch.cos, torch.sin))
    causal = torch.ones(PROBE_TOKENS, PROBE_TOKENS, dtype=torch.bool, device=weight.device).tril()[None]
    probe = copy.copy(indexer)  # the same modules, a smaller top-k
    probe.index_topk = PROBE_TOPK
    with torch.no_grad():
        try:
            stock = stock_indexer_call(probe, hidden, q_resid, (cos, sin), causal, positions, None).long()
        except Exception as exc:  # another signature: not DeepSeek-V3.2's indexer
            return f"sparse attention: its indexer ({type(indexer).__name__}) does not run as DeepSeek-V3.2's " \
                   f"({type(exc).__name__}: {exc})"
        q, k, weights = indexer_query_key(probe, family, hidden, q_resid, (cos, sin), positions)
        rows = torch.arange(PROBE_TOKENS, device=weight.device)
        ours = select_topk(probe, q, weights, k.reshape(PROBE_TOKENS, 1, 1, -1), rows[None], rows[-1:] + 1,
                           torch.ones(1, PROBE_TOKENS, dtype=torch.bool, device=weight.device)).long()
        dots = torch.einsum("bshd,btd->bsht", q.float(), k.float())
        scores = (weights[..., None] * torch.relu(dots * indexer.softmax_scale)).sum(2)  # [1, S, T]

        def picked(indices):  # the scores of the picks a query can see, best first
            seen = (indices >= 0) & (indices <= rows[None, :, None])
            values = torch.gather(scores, 2, indices.clamp(min=0))
            return torch.sort(torch.where(seen, values, float("-inf")), dim=-1, descending=True).values

    if torch.allclose(picked(stock), picked(ours), rtol=1e-4, atol=1e-6):
        return None
    return (f"sparse attention: on a random input its indexer ({type(indexer).__name__}) picks other keys than "
            f"DeepSeek-V3.2's indexer, which the patch reproduces (it rotates, splits or scales q / k otherwise)")
