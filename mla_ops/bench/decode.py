"""Decode latency with a long context: stock transformers vs cache="dense" vs cache="paged".

Model: lite-attn (DeepSeek-V2-Lite's attention dims, 2 layers, small MoE, vocab 1024), bf16, sdpa.
For each context length T the three variants hold a cache of T tokens (filled with random values in
each cache's own layout: timing does not depend on the values, and a real prefill of 8k tokens
through stock would take minutes) and decode one token; after every timed step the cache is cropped
back to T. Variants run interleaved in one process; ratios are medians of per-round ratios.

Also measured: the attention layer's decode step alone — from (q_nope, rotated q_pe, the layer's
cache) to the per-head output [B, N, V] — stock's `expand_kv` + sdpa against the absorbed
`q_nope @ W_UK` -> `mla.mla_decode_attention` -> `@ W_UV`; and the cache bytes per token and layer.
"""
from __future__ import annotations

import copy
import os

import torch

import mla_ops  # noqa: F401

from ..integrations.transformers.paged_attention import absorbed_decode_step
from ..integrations.transformers.paged_cache import MLAPagedCache, cache_bytes_per_token_per_layer
from ..integrations.transformers.patch import patch
from ..models import build_model, family_attn_config, lite_attn_config
from .timing import interleaved_medians, median_ratio

CONTEXTS = (512, 2048, 4096, 8192)


def _indexed_layers(config) -> list[bool]:
    """Which layers run their own sparse-attention indexer (and cache its keys): none without
    `index_topk`; with it every layer but the "shared" ones of `indexer_types` (GLM-5)."""
    if getattr(config, "index_topk", None) is None:
        return [False] * config.num_hidden_layers
    types = getattr(config, "indexer_types", None) or ()
    return [i >= len(types) or types[i] != "shared" for i in range(config.num_hidden_layers)]


def _filled_dynamic_cache(config, shapes, dtype, generator, tokens):
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for layer, indexed in enumerate(_indexed_layers(config)):
        k_shape, v_shape = shapes
        cache.update(torch.randn(*k_shape, generator=generator).to(dtype),
                     torch.randn(*v_shape, generator=generator).to(dtype), layer)
        if indexed:  # the indexer keys [B, T, index_head_dim] stock caches beside the layer's KV
            cache.update_indexer(torch.randn(1, tokens, config.index_head_dim, generator=generator).to(dtype), layer)
    return cache


def _filled_paged_cache(config, tokens, dtype, generator, block_size):
    cache = MLAPagedCache(config, block_size=block_size, batch_size=1, max_cache_len=tokens + block_size,
                          dtype=dtype)
    plan = cache.begin_forward(None, 1, tokens, dtype, torch.device("cpu"))
    for layer in cache.layers:
        latent = torch.randn(tokens, 1, config.kv_lora_rank, generator=generator).to(dtype)
        k_pe = torch.randn(tokens, 1, config.qk_rope_head_dim, generator=generator).to(dtype)
        torch.ops.mla.scatter_pa_kv_cache(latent, k_pe, layer.latent_pool, layer.k_pe_pool, plan.slot_mapping)
        if layer.indexer_keys is not None:
            keys = torch.randn(tokens, 1, config.index_head_dim, generator=generator).to(dtype)
            torch.ops.mla.scatter_pa_cache(keys, layer.indexer_pool, plan.slot_mapping)
    cache.end_forward()
    return cache


def measure_model_decode(contexts=CONTEXTS, *, dtype=torch.bfloat16, rounds=3, min_run_time=0.3,
                         block_size=64, seed=0, family: str = "deepseek_v2", heads: int = 16) -> list[dict]:
    """Whole-model decode step at each context: stock vs cache="dense" vs cache="paged", for a 2-layer
    model of `family` (a transformers MLA model_type) with DeepSeek-V2-Lite's attention dims and `heads`
    attention heads (16 as V2-Lite; DeepSeek-V3.2 has 128). For a sparse family (DeepSeek-V3.2, GLM-5)
    the caches hold the indexer keys too, stock masks its dense attention down to the indexer's top-k
    (its own index_topk, 2048 by default), and the paged mode runs the indexer and the sparse attention."""
    config = family_attn_config(family, num_attention_heads=heads, num_key_value_heads=heads)
    stock = build_model(config, dtype, "sdpa", seed=seed)
    dense, paged = copy.deepcopy(stock), copy.deepcopy(stock)
    handles = [patch(dense, cache="dense"), patch(paged, cache="paged")]
    g = torch.Generator().manual_seed(seed)
    heads = config.num_attention_heads
    rows = []
    try:
        for tokens in contexts:
            latent_shapes = ((1, 1, tokens, config.kv_lora_rank), (1, 1, tokens, config.qk_rope_head_dim))
            dense_shapes = ((1, heads, tokens, config.qk_nope_head_dim + config.qk_rope_head_dim),
                            (1, heads, tokens, config.v_head_dim))
            caches = {
                "stock": (stock, _filled_dynamic_cache(config, latent_shapes, dtype, g, tokens)),
                "dense": (dense, _filled_dynamic_cache(config, dense_shapes, dtype, g, tokens)),
                "paged": (paged, _filled_paged_cache(config, tokens, dtype, g, block_size)),
            }
            token = torch.tensor([[7]])
            position = torch.tensor([[tokens]])

            def step(model, cache):
                def run():
                    with torch.no_grad():
                        model(token, cache=cache, position_ids=position, use_cache=True)
                    cache.crop(-1)
                return run

            results = interleaved_medians({name: step(*mc) for name, mc in caches.items()}, rounds=rounds,
                                          min_run_time=min_run_time)
            for name, (_, cache) in caches.items():
                rows.append({
                    "context": tokens, "variant": name, "ms_per_token": results[name]["median_s"] * 1e3,
                    "stock_over_variant": median_ratio(results, "stock", name),
                    "cache_bytes_per_token_per_layer": cache_bytes_per_token_per_layer(cache, tokens),
                })
    finally:
        for h in handles:
            h.revert()
    return rows


def measure_attention_step(contexts=CONTEXTS, *, dtype=torch.bfloat16, rounds=5, min_run_time=0.2,
                           block_size=64, seed=0) -> list[dict]:
    """One attention layer's decode step, from (q_nope, rotated q_pe, cache) to [B, N, V]."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf

    config = lite_attn_config()
    torch.manual_seed(seed)
    config._attn_implementation = "sdpa"
    attn = hf.DeepseekV2Attention(config, layer_idx=0).to(dtype).eval()
    g = torch.Generator().manual_seed(seed)
    heads, nope, rope, lora = config.num_attention_heads, config.qk_nope_head_dim, config.qk_rope_head_dim, \
        config.kv_lora_rank
    q_nope = torch.randn(1, heads, 1, nope, generator=g).to(dtype)
    q_pe = torch.randn(1, heads, 1, rope, generator=g).to(dtype)
    query = torch.cat((q_nope, q_pe), dim=-1)
    rows = []
    for tokens in contexts:
        latent = torch.randn(1, 1, tokens, lora, generator=g).to(dtype)
        k_pe = torch.randn(1, 1, tokens, rope, generator=g).to(dtype)
        blocks = -(-tokens // block_size)
        latent_pool = torch.zeros(blocks, block_size, 1, lora, dtype=dtype)
        k_pe_pool = torch.zeros(blocks, block_size, 1, rope, dtype=dtype)
        latent_pool.view(-1, lora)[:tokens] = latent[0, 0]
        k_pe_pool.view(-1, rope)[:tokens] = k_pe[0, 0]
        layer = SimpleNamespace(latent_pool=latent_pool, k_pe_pool=k_pe_pool)
        plan = SimpleNamespace(block_tables=torch.arange(blocks, dtype=torch.int32)[None],
                               seq_lens=torch.tensor([tokens]))

        def stock():
            with torch.no_grad():
                key, value = attn.expand_kv(latent, k_pe)
                return sdpa_attention_forward(attn, query, key, value, None, scaling=attn.scaling)[0]

        def absorbed():
            with torch.no_grad():
                return absorbed_decode_step(attn, layer, plan, q_nope, q_pe)  # the paged mode's own decode step

        results = interleaved_medians({"stock": stock, "absorbed": absorbed}, rounds=rounds,
                                      min_run_time=min_run_time)
        rows.append({"context": tokens, "stock_ms": results["stock"]["median_s"] * 1e3,
                     "absorbed_ms": results["absorbed"]["median_s"] * 1e3,
                     "stock_over_absorbed": median_ratio(results, "stock", "absorbed")})
    return rows


def environment() -> dict:
    return {"threads": torch.get_num_threads(), "torch": torch.__version__,
            "MALLOC_MMAP_MAX_": os.environ.get("MALLOC_MMAP_MAX_"),
            "MALLOC_TRIM_THRESHOLD_": os.environ.get("MALLOC_TRIM_THRESHOLD_")}
