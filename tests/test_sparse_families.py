"""DeepSeek Sparse Attention (an indexer picks the top-k keys each query attends to) through the ops:
what is particular to the sparse families the patch serves (DeepSeek-V3.2, GLM-5 with its "shared"
indexer layers). tests/test_families.py runs them through every family test as well (unpadded
prefill bit-identical in fp32 / bf16 / fp16, greedy, compile, revert); here: padded batches, static
caches, the paged decode on mla.sparse_mla_attention compiled whole, a prompt continued in a second
forward, the top-k passed between layers, masks the indexer op cannot express, the cache pools.

The tiny configs keep top-8 of prompts of 12 (+ 6 generated) tokens, so the selection decides the
logits (`test_the_top_k_decides_the_logits`): a bit-identical logit means the same keys were picked.
"""
import pytest
import torch
from test_families import (
    NO_Q_PROLOG,
    NO_ROPE_ONLY,
    POOLED_INDEXER,
    SPARSE_SERVED,
    _model,
    _prompt,
    expected_calls,
    kv_path_op,
)

import mla_ops
from mla_ops.integrations import transformers as patch
from mla_ops.integrations.transformers import MLAPagedCache, families, generation, indexer, latent_layouts
from mla_ops.testing.suites import GraphCapture

import mla_families
from utils import MlaCalls

pytestmark = pytest.mark.slow

SERVED = sorted(SPARSE_SERVED & set(families.installed_mla_model_types()))
# GLM-5-Next's layers take the model's [B, S] padding mask: their attention mask is the indexer's top-k alone
FOUR_D_MASK = [f for f in SERVED if f != "glm5_next"]
# the RoPE layout of each indexer's own rotation (read off the function its forward calls)
INDEXER_ROPE = {"axk2": "neox", "deepseek_v32": "neox", "dots3_note": "half", "glm_moe_dsa": "half",
                "mistral_large4": "half", "hy_v4": "neox", "hy_v4_vl": "interleaved", "glm5_next": None}
NEW_TOKENS = 6


def _text_config(model):
    return model.config.get_text_config(decoder=True)


def _decoder(model):
    """The decoder stack (a multimodal wrapper's language model)."""
    return generation.decoder_stacks(model)[0]


def _padded_prompt():
    """Two rows of 12, the second left-padded by 3 (generate's padding side)."""
    ids = _prompt()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


def _generate(model, ids, mask, **extra):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True, **extra)


@pytest.mark.parametrize("family", SERVED)
def test_the_indexer_is_read_off_the_class(family):
    (described,) = families.families_of(family)
    assert described.refused is None and described.sparse
    assert described.indexer_layout() == INDEXER_ROPE[family]
    assert described.shared_topk == (family in ("glm_moe_dsa", "mistral_large4", "hy_v4", "hy_v4_vl", "glm5_next"))
    assert described.indexer_rope_trailing == (family in ("hy_v4", "hy_v4_vl"))
    assert described.attention_sinks == (family in ("hy_v4", "hy_v4_vl"))
    assert described.indexer_input_query == (family == "mistral_large4")
    assert described.indexer_pooled == described.topk_mask == (family == "glm5_next")


@pytest.mark.parametrize("family", SERVED)
def test_the_top_k_decides_the_logits(family):
    """The same weights keeping every key give other logits: the prompt is long enough for the choice."""
    ids = _prompt()
    with torch.no_grad():
        sparse = _model(family)(ids).logits
        dense = _model(family, index_topk=64)(ids).logits
    assert not torch.allclose(sparse, dense, atol=1e-3)


# (family, model seed, prompt seed) of a tiny model with 4 indexer heads keeping the top 4 of 24 tokens, its
# weights N(0, 1): many scores are exactly 0 after the ReLU and tie across the 4th place, so the tie rule
# decides the keys (the op's lowest-positions-first rule picks others: the paged prefill differs from stock)
FEW_INDEXER_HEADS = {"axk2": (0, 2), "deepseek_v32": (0, 1), "dots3_note": (0, 3), "glm_moe_dsa": (1, 3),
                     "mistral_large4": (0, 1), "hy_v4": (0, 1), "hy_v4_vl": (0, 2), "glm5_next": (0, 0)}


@pytest.mark.parametrize("family", SERVED)
def test_dense_prefill_bit_identical_where_scores_tie_across_the_kth_place(family):
    """Dense mode selects as stock does (its indexer forward and torch.topk), so its prefill logits are
    stock's bit for bit also where exactly equal scores straddle the k-th place; the paged prefill keeps
    the op's documented rule (equal scores: lower position first) and differs from stock on this prompt,
    which shows the ties decide (a pooled indexer, GLM-5-Next's, selects with its own forward in the paged
    mode too: there the paged prefill is stock's as well)."""
    model_seed, prompt_seed = FEW_INDEXER_HEADS[family]
    model = _model(family, seed=model_seed, index_n_heads=4, index_topk=4, initializer_range=1.0)
    ids = torch.randint(3, mla_families.VOCAB, (1, 24), generator=torch.Generator().manual_seed(prompt_seed))
    with torch.no_grad():
        expected = model(ids).logits
        with mla_ops.patch(model, rope=True, cache="dense"):
            dense = model(ids).logits
        assert torch.equal(dense, expected)
        with mla_ops.patch(model, rope=True, cache="paged"):
            paged = model(ids).logits
        # (a pooled indexer selects with its own forward in the paged mode too: stock's ties)
        assert torch.equal(paged, expected) == (family in POOLED_INDEXER)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("options", [dict(rope=True, rms_norm=True, cache="dense"), dict(q_prolog=True, cache="dense"),
                                     dict(kv_prolog=False, rope=True, cache="dense"), dict(rope=True, cache="paged")],
                         ids=["kv_prolog+rope+rms_norm", "q_prolog", "rope-only", "paged"])
@pytest.mark.parametrize("family", SERVED)
def test_padded_prefill_logits_bit_identical(family, options, attn):
    """fp32, a left-padded batch: the real tokens' logits bit-identical to stock (the padding rows'
    queries select nothing, as the stock mask lets them see nothing), the indexer op in each indexer layer."""
    model = _model(family, attn=attn)
    ids, mask = _padded_prompt()
    refusal = NO_Q_PROLOG.get(family) if options.get("q_prolog") else \
        NO_ROPE_ONLY.get(family) if options.get("kv_prolog") is False else None
    if refusal:
        with pytest.raises(ValueError, match=refusal):
            mla_ops.patch(model, **options)
        return
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        with mla_ops.patch(model, **options), MlaCalls() as calls:
            got = model(ids, attention_mask=mask).logits
    assert calls.counts == expected_calls(family, model, options)
    real = mask.bool()
    assert torch.equal(got[real], expected[real])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cache", ["dense", "paged"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("family", SERVED)
def test_padded_greedy_tokens_equal_to_stock(family, static, cache, dtype):
    """generate() on a left-padded batch, transformers' dynamic or static cache against the patch's dense
    mode on the same cache or the paged mode (MLAPagedCache, static with cache_implementation="static"):
    the same tokens, the prefill logits bit-identical (dense bf16: every step's, as in
    tests/test_families.py); the paged decode steps attend to the indexer's top-k over the paged
    latent cache with mla.sparse_mla_attention.

    Stock's static cache attends over its whole length in prefill, the slots past the prompt masked:
    a longer reduction, whose rounding differs from the dynamic cache's by an ulp on some CPUs (AVX-512
    GEMM blocking). The paged cache holds the prompt only, as the dynamic cache does, so its prefill
    logits are compared bit for bit with stock's dynamic-cache run, and within that ulp with the static
    one."""
    model = _model(family, dtype=dtype)
    ids, mask = _padded_prompt()
    extra = dict(cache_implementation="static") if static else {}
    options = dict(rope=True, cache=cache)
    with torch.no_grad():
        expected = _generate(model, ids, mask, **extra)
        same_prefill = _generate(model, ids, mask) if static and cache == "paged" else expected
        with mla_ops.patch(model, **options), MlaCalls() as calls:
            got = _generate(model, ids, mask, **extra)
    assert calls.counts == expected_calls(family, model, options, forwards=NEW_TOKENS,
                                          decode_steps=NEW_TOKENS - 1 if cache == "paged" else 0)
    assert torch.equal(got.sequences, expected.sequences)
    real = mask.bool()
    assert torch.equal(got.logits[0], same_prefill.logits[0])
    torch.testing.assert_close(got.logits[0], expected.logits[0], rtol=0, atol=4 * torch.finfo(dtype).eps)
    if cache == "paged":
        assert isinstance(got.past_key_values, MLAPagedCache) and got.past_key_values.static == static
    elif dtype == torch.bfloat16:
        for step, (a, b) in enumerate(zip(got.logits, expected.logits)):
            assert torch.equal(a, b), f"step {step}"
    assert real.all(-1).tolist() == [True, False]


@pytest.mark.parametrize("family", SERVED)
def test_prompt_continued_in_a_second_forward(family):
    """Paged, a prompt fed in two forwards (the second reads the prefix back with gather_pa_kv_cache and
    folds the indexer's choice among prefix + new keys into its own mask): the logits of the whole prompt
    in one stock forward, to rounding (the keys are concatenated in another order), and the same argmax."""
    model = _model(family)
    ids, mask = _padded_prompt()
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        with mla_ops.patch(model, rope=True, cache="paged"), MlaCalls() as calls:
            cache = MLAPagedCache(_text_config(model), block_size=4, layouts=latent_layouts(model))
            first = model(ids[:, :7], attention_mask=mask[:, :7], cache=cache, use_cache=True).logits
            second = model(ids[:, 7:], attention_mask=mask, cache=cache, use_cache=True).logits
    got = torch.cat((first, second), dim=1)
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=0, atol=1e-5)
    assert torch.equal(got[real].argmax(-1), expected[real].argmax(-1))
    assert calls.counts["gather_pa_kv_cache"] == mla_families.mla_layers(model.config)
    indexer_op = 0 if family in POOLED_INDEXER else 2 * mla_families.indexer_layers(model.config)
    assert calls.counts.get("lightning_indexer", 0) == indexer_op


def _decode_once(forward, ids, cache, position):
    return forward(ids, cache=cache, position_ids=torch.tensor([[position]]), use_cache=True).logits


@pytest.mark.parametrize("family", SERVED)
def test_compiled_paged_decode_has_no_graph_break(family):
    """A decode step on a static MLAPagedCache traces whole (fullgraph=True) with the indexer op, the
    indexer-key write and the sparse attention as graph nodes, and gives the eager step's logits."""
    model = _model(family)
    ids = _prompt(batch=1)
    config = _text_config(model)

    def prefilled():
        cache = MLAPagedCache(config, static=True, batch_size=1, max_cache_len=32, block_size=4,
                              layouts=latent_layouts(model))
        model(ids, cache=cache, position_ids=torch.arange(ids.shape[1])[None], use_cache=True)
        return cache

    capture = GraphCapture()
    nxt = ids[:, -1:]
    with torch.no_grad(), mla_ops.patch(model, rope=True, cache="paged"):
        eager = _decode_once(model, nxt, prefilled(), ids.shape[1])
        torch._dynamo.reset()
        compiled = _decode_once(torch.compile(model, backend=capture, fullgraph=True), nxt, prefilled(), ids.shape[1])
    assert len(capture.graphs) == 1
    targets = capture.call_targets()
    assert {"mla.scatter_pa_cache", "mla.sparse_mla_attention"} <= targets, sorted(targets)
    assert ("mla.lightning_indexer" in targets) == (family not in POOLED_INDEXER)
    # (a sliding-window layer, dots3_note's, decodes with mla_decode_attention's sliding_window)
    windowed = mla_families.sparse_layers(config) < mla_families.mla_layers(config)
    assert ("mla.mla_decode_attention" in targets) == windowed
    assert torch.equal(compiled, eager)


@pytest.mark.parametrize("family", SERVED)
def test_compiled_dense_prefill_selects_as_stock(family):
    """One graph: the prolog ops and the stock indexer's own top-k (dense mode selects as stock does)."""
    model = _model(family)
    ids = _prompt(batch=1)
    capture = GraphCapture()
    q_prolog = family not in NO_Q_PROLOG
    with torch.no_grad():
        stock = model(ids, use_cache=False).logits
        with mla_ops.patch(model, q_prolog=q_prolog, rope=not q_prolog, cache="dense"):
            torch._dynamo.reset()
            got = torch.compile(model, backend=capture, fullgraph=True)(ids, use_cache=False).logits
    assert len(capture.graphs) == 1
    targets = capture.call_targets()
    assert {"mla.q_prolog" if q_prolog else "mla.rope", kv_path_op(family)} <= targets
    assert "mla.lightning_indexer" not in targets
    assert any("topk" in target for target in targets), sorted(targets)
    assert torch.equal(got, stock)


def test_shared_layers_reuse_the_previous_layers_top_k():
    """GLM-5: layer 1 ("shared") runs no indexer and attends to exactly the keys layer 0 picked, handed
    on as the third value of layer 0's attention, in the dense and the paged mode."""
    model = _model("glm_moe_dsa")
    ids = _prompt()
    first, second = (layer.self_attn for layer in model.model.layers)
    assert second.indexer is None
    seen = {}
    hooks = [first.register_forward_hook(lambda m, a, out: seen.__setitem__("returned", out[2])),
             second.register_forward_pre_hook(lambda m, a, kw: seen.__setitem__("given", kw["prev_topk_indices"]),
                                              with_kwargs=True)]
    try:
        with torch.no_grad():
            for cache in ("dense", "paged"):
                seen.clear()
                with mla_ops.patch(model, rope=True, cache=cache), MlaCalls() as calls:
                    model(ids)
                assert seen["given"] is seen["returned"] and seen["given"].shape[:2] == ids.shape
                # dense mode selects with the stock indexer, the paged mode with the op
                assert calls.counts.get("lightning_indexer", 0) == (cache == "paged")
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("family", FOUR_D_MASK)
def test_dense_mode_serves_a_mask_of_packed_sequences_as_stock(family):
    """Two packed sequences in one row (a block-diagonal causal mask): dense mode's selection is the stock
    indexer's, which scores against any mask, so the attention output is stock's bit for bit."""
    model = _model(family)
    ids = _prompt(batch=1)
    attn = _decoder(model).layers[0].self_attn
    seen = {}

    def record(module, args, kwargs):
        seen.setdefault("kwargs", kwargs)

    hook = attn.register_forward_pre_hook(record, with_kwargs=True)
    with torch.no_grad():
        model(ids, use_cache=False)
    hook.remove()
    kwargs = dict(seen["kwargs"])
    seq = ids.shape[1]
    packed = torch.ones(seq, seq, dtype=torch.bool).tril()
    packed[6:, :6] = False
    kwargs["attention_mask"] = packed[None, None]
    with torch.no_grad():
        expected = attn(**kwargs)[0]
        with mla_ops.patch(model, rope=True, cache="dense"):
            got = attn(**kwargs)[0]
    assert torch.equal(got, expected)


@pytest.mark.parametrize("family", SERVED)
def test_paged_cache_keeps_indexer_keys_where_a_layer_has_an_indexer(family):
    model = _model(family)
    config = _text_config(model)
    layouts = latent_layouts(model)
    cache = MLAPagedCache(config, static=True, batch_size=1, max_cache_len=16, block_size=4, dtype=torch.float32,
                          layouts=layouts)
    # (a hybrid's linear-attention layers, GLM-5-Next's, hold states, not pools)
    paged = [(layer, attn) for layer, attn in zip(cache.layers, (d.self_attn for d in _decoder(model).layers))
             if layer in cache.paged_layers]
    indexed = [layer.indexer_keys is not None for layer, _ in paged]
    assert indexed == [attn.indexer is not None for _, attn in paged]
    assert sum(indexed) == mla_families.indexer_layers(config)
    # a pooled indexer's rows hold each token's key and gate score
    width = config.index_head_dim * (2 if family in POOLED_INDEXER else 1)
    for layer, _ in paged:
        if layer.indexer_keys is not None:
            assert layer.indexer_pool.shape == (4, 4, 1, width)
        else:
            with pytest.raises(RuntimeError, match="holds no indexer keys"):
                layer.indexer_pool
    # the latent pools of the layers owning theirs (a layer sharing an earlier layer's latent KV holds none)
    owned = [layout for i, layout in enumerate(layouts) if layout is not None and layout.source == i]
    latent_bytes = sum((layout.kv_lora_rank + layout.rope_dim) * 4 for layout in owned)
    report = cache.memory_report()
    assert report["payload_bytes_per_token_per_layer"] == (latent_bytes + width * 4 * sum(indexed)) / len(paged)


@pytest.mark.parametrize("family", SERVED)
def test_revert_and_class_level_patch(family):
    model = _model(family)
    ids, mask = _padded_prompt()
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        handle = mla_ops.patch(model, rope=True, cache="paged")
        model(ids, attention_mask=mask)
        handle.revert()
        assert all(not any(k.startswith("_mla_ops") or k == "forward" for k in m.__dict__) for m in model.modules())
        assert torch.equal(model(ids, attention_mask=mask).logits, expected)
        with mla_ops.patch(family=family, rope=True, cache="dense"), MlaCalls() as calls:
            got = model(ids, attention_mask=mask).logits
    assert calls.counts == expected_calls(family, model, dict(rope=True, cache="dense"))
    real = mask.bool()
    assert torch.equal(got[real], expected[real])


def test_an_indexer_computing_otherwise_is_told_apart_by_running_it():
    """HY-V4's indexer uses DeepSeek-V3.2's very names but rotates the last qk_rope_head_dim dims of each
    head, not the first: a DeepSeek-V3.2 model given HY-V4's indexers is refused at apply, by running the
    stock indexer and the patch's selection on a random input; its own indexers pass the same check."""
    from transformers.models.hy_v4.modeling_hy_v4 import HYV4Indexer

    (described,) = families.families_of("deepseek_v32")
    model = _model("deepseek_v32")
    assert indexer.indexer_refusal(model.model.layers[0].self_attn, described) is None
    for layer in model.model.layers:
        layer.self_attn.indexer = HYV4Indexer(model.config, layer.self_attn.layer_idx)
    with pytest.raises(NotImplementedError, match="picks other keys than DeepSeek-V3.2's indexer"):
        mla_ops.patch(model, cache="dense")
    assert not patch.active_patches()
    assert all("forward" not in m.__dict__ for m in model.modules())
