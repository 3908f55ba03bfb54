"""The paged decode step of every family with a paged mode compiles whole: on a static MLAPagedCache, one decode
step of the patched model traces with `torch.compile(fullgraph=True)` (no graph break), the decode attention
op a node of the graph, and gives the eager step's logits. The sparse families run the same check in
tests/test_sparse_families.py (with their indexer ops); the hybrids have no paged mode."""
import pytest
import torch
from test_families import ATTENTION_ONLY_COMPILE, SPARSE_SERVED, SUPPORTED, _model, _prompt

import mla_ops
from mla_ops.integrations.transformers import MLAPagedCache, latent_layouts
from mla_ops.testing.suites import GraphCapture

pytestmark = pytest.mark.slow

PAGED_DENSE_ATTENTION = [f for f in SUPPORTED if f not in SPARSE_SERVED]


@pytest.mark.parametrize("family", PAGED_DENSE_ATTENTION)
def test_compiled_paged_decode_has_no_graph_break(family):
    if family in ATTENTION_ONLY_COMPILE:
        pytest.skip(f"{family}'s stock MoE does not trace whole (tests/test_families.py compiles its attention)")
    model = _model(family)
    ids = _prompt(batch=1)
    config = model.config.get_text_config(decoder=True)
    layouts = latent_layouts(model)  # (a hybrid's linear-attention layers: None, their states in the cache too)

    def prefilled():
        cache = MLAPagedCache(config, static=True, batch_size=1, max_cache_len=32, block_size=4, layouts=layouts)
        model(ids, cache=cache, position_ids=torch.arange(ids.shape[1])[None], use_cache=True)
        return cache

    def decode(forward, cache):
        return forward(ids[:, -1:], cache=cache, position_ids=torch.tensor([[ids.shape[1]]]), use_cache=True).logits

    capture = GraphCapture()
    with torch.no_grad(), mla_ops.patch(model, rope=True, cache="paged"):
        eager = decode(model, prefilled())
        torch._dynamo.reset()
        compiled = decode(torch.compile(model, backend=capture, fullgraph=True), prefilled())
    assert len(capture.graphs) == 1
    targets = capture.call_targets()
    assert {"mla.latent_kv_prolog", "mla.scatter_pa_kv_cache", "mla.mla_decode_attention"} <= targets, sorted(targets)
    assert torch.equal(compiled, eager)


def test_layers_sharing_latent_kv_read_the_source_layers_pools():
    """Mistral-Large-4: a layer attending to an earlier layer's latent KV holds no latent pools of its own (the
    source's are read, through the layer's own kv_b), a NoPE layer's k_pe pool has no dims; a cache built without
    the model's layouts is refused by the model's forward with the fix, before anything is written."""
    from mla_ops.integrations.transformers import LatentLayout, latent_layouts

    model = _model("mistral_large4")
    config = model.config.get_text_config(decoder=True)
    layouts = latent_layouts(model)
    assert layouts == [LatentLayout(32, 16, 0, True), LatentLayout(32, 0, 1, True), LatentLayout(32, 16, 0, False),
                       LatentLayout(32, 0, 1, True)]
    cache = MLAPagedCache(config, static=True, batch_size=1, max_cache_len=16, block_size=4, dtype=torch.float32,
                          layouts=layouts)
    assert cache.layers[2].latent_pool is cache.layers[0].latent_pool and cache.layers[2].keys is None
    assert cache.layers[3].k_pe_pool is cache.layers[1].k_pe_pool and cache.layers[1].k_pe_pool.shape[-1] == 0
    ids = _prompt(batch=1)
    with torch.no_grad(), mla_ops.patch(model, cache="paged"):
        uniform = MLAPagedCache(config, block_size=4)
        with pytest.raises(ValueError, match=r"layouts=latent_layouts\(model\)"):
            model(ids, cache=uniform, use_cache=True)
        assert uniform.layers[0].keys is None  # (nothing allocated, nothing written)
    with pytest.raises(ValueError, match="an earlier layer that owns it"):
        MLAPagedCache(config, layouts=[LatentLayout(32, 16, 1), LatentLayout(32, 16, 1)])
