"""`mla_ops.patch(model, cache="paged")`: the paged latent cache + absorbed decode against stock transformers."""
import pytest
import torch
from transformers import CompileConfig, DynamicCache
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf

import mla_ops
from mla_ops.integrations import transformers as patch
from mla_ops.integrations.transformers import MLAPagedCache

from models import build_model, lite_attn_config, tiny_config
from utils import MlaCalls, random_prompt

# whole models, generate and compile: `make test-fast` leaves these to `make test`

CONFIGS = {"tiny": tiny_config, "lite-attn": lite_attn_config}
# How a cache is handed to the model and to generate on the installed transformers (`cache` from 5.24)
CACHE = patch.releases.current_release().model_cache_keyword
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not patch.releases.current_release().paged,
                                reason=f"cache='paged' needs transformers >= {patch.releases.PAGED_SINCE} "
                                       f"(tests/test_model_patch.py checks it is refused before)")]
STOCK_MODEL_FORWARD = hf.DeepseekV2Model.forward


def _greedy(**extra):
    return dict(do_sample=False, output_logits=True, return_dict_in_generate=True, **extra)


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_tokens_identical_to_stock_fp32(config_name):
    config = CONFIGS[config_name]()
    model = build_model(config, torch.float32, "sdpa")
    ids = random_prompt(config, length=20)
    with torch.no_grad():
        expected = model.generate(ids, **_greedy(max_new_tokens=24, min_new_tokens=24))
        with mla_ops.patch(model, cache="paged"), MlaCalls() as calls:
            got = model.generate(ids, **_greedy(max_new_tokens=24, min_new_tokens=24))
    assert isinstance(got.past_key_values, MLAPagedCache)
    assert torch.equal(got.sequences, expected.sequences)
    layers = config.num_hidden_layers
    assert calls.counts["mla_decode_attention"] == 23 * layers  # every step after the prefill is absorbed
    assert calls.counts["latent_kv_prolog"] == calls.counts["scatter_pa_kv_cache"] == 24 * layers
    assert "kv_prolog" not in calls.counts
    # prefill: stock's own arithmetic (bit-identical); decode: absorbed, equal to fp32 rounding
    assert torch.equal(got.logits[0], expected.logits[0])
    for a, b in zip(got.logits[1:], expected.logits[1:]):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


def test_patch_defaults_to_the_paged_latent_cache():
    """`mla_ops.patch(model)` with no option: the latent KV prolog and the paged latent cache with the
    absorbed decode (PatchOptions' defaults), and stock's greedy tokens."""
    config = tiny_config()
    model = build_model(config, torch.float32, "sdpa")
    ids = random_prompt(config, length=12)
    with torch.no_grad():
        expected = model.generate(ids, **_greedy(max_new_tokens=8, min_new_tokens=8))
        with mla_ops.patch(model) as handle, MlaCalls() as calls:
            got = model.generate(ids, **_greedy(max_new_tokens=8, min_new_tokens=8))
    assert handle.options == patch.PatchOptions() and handle.options.cache == "paged"
    assert isinstance(got.past_key_values, MLAPagedCache)
    assert torch.equal(got.sequences, expected.sequences)
    assert calls.counts["mla_decode_attention"] == 7 * config.num_hidden_layers
    assert "kv_prolog" not in calls.counts


def _teacher_forced_logits(model, tokens, prompt_len):
    """Prefill tokens[:, :prompt_len], then feed the rest one by one; logits of every position."""
    out = model(tokens[:, :prompt_len], use_cache=True)
    cache, logits = out.past_key_values, [out.logits[:, -1]]
    for t in range(prompt_len, tokens.shape[1]):
        out = model(tokens[:, t:t + 1], **{CACHE: cache}, use_cache=True)
        logits.append(out.logits[:, -1])
    return logits


def test_bf16_logits_within_tolerance_of_stock():
    """bf16, V2-Lite attention dims, the same 16 tokens fed to both (teacher forcing).

    The absorbed decode rounds to bf16 at other places than stock's materialised path (q_nope @ W_UK,
    the attention scores and probabilities, o_latent, o_latent @ W_UV; see
    mla_ops/ops/decode_attention.py), each a relative 2^-9. The MLPs are dense here: with
    MoE, top-k routing is discontinuous and a 1-ulp change can switch an expert, which moves
    logits by ~0.3 for stock bf16 itself against fp32. Measured over 5 seeds: |paged - stock| <= 0.055
    on logits up to |3.9|, and paged is as far from the fp32 model as stock bf16 is (ratio <= 1.2)."""
    config = lite_attn_config(first_k_dense_replace=2)  # both layers dense MLPs, no MoE routing
    model = build_model(config, torch.bfloat16, "sdpa")
    reference = build_model(config, torch.float32, "sdpa")  # same seed: the fp32 weights bf16 rounds
    tokens = random_prompt(config, length=40)
    with torch.no_grad():
        fp32 = _teacher_forced_logits(reference, tokens, 24)
        expected = _teacher_forced_logits(model, tokens, 24)
        with mla_ops.patch(model, cache="paged"):
            got = _teacher_forced_logits(model, tokens, 24)
    assert torch.equal(got[0], expected[0]), "prefill is stock's arithmetic"

    def worst(a_list, b_list):
        return max((a.float() - b.float()).abs().max().item() for a, b in zip(a_list, b_list))

    assert 0 < worst(got, expected) <= 0.1
    assert worst(got, fp32) <= 1.5 * worst(expected, fp32)


def test_padded_batch_equals_one_at_a_time():
    config = lite_attn_config()
    model = build_model(config, torch.float32, "sdpa")
    prompts = [random_prompt(config, length=n, seed=s)[0] for s, n in enumerate((12, 5, 9))]
    batch = torch.full((3, 12), config.pad_token_id)
    mask = torch.zeros(3, 12, dtype=torch.long)
    for i, p in enumerate(prompts):
        batch[i, 12 - len(p):], mask[i, 12 - len(p):] = p, 1
    gen = dict(do_sample=False, pad_token_id=config.pad_token_id, max_new_tokens=10, min_new_tokens=10)
    with torch.no_grad(), mla_ops.patch(model, cache="paged"):
        singles = [model.generate(p[None], **gen)[0, len(p):] for p in prompts]
        out = model.generate(batch, attention_mask=mask, return_dict_in_generate=True, **gen)
    for i in range(3):
        assert torch.equal(out.sequences[i, 12:], singles[i]), f"row {i}"
    cache = out.past_key_values
    # padding is never stored: each row holds its real tokens (the last generated one is not fed back)
    assert cache.seq_lens.tolist() == [len(p) + 9 for p in prompts]


def test_prompt_continued_in_two_generate_calls():
    """Continuing with the returned cache equals one call; continuing with a new user turn (a prefill
    on top of a cached prefix: mla.gather_pa_kv_cache) equals stock on the whole text."""
    config = lite_attn_config()
    model = build_model(config, torch.float32, "sdpa")
    ids = random_prompt(config, length=10)
    turn = random_prompt(config, length=6, seed=5)
    with torch.no_grad():
        with mla_ops.patch(model, cache="paged"):
            one = model.generate(ids, do_sample=False, max_new_tokens=12, min_new_tokens=12)
            first = model.generate(ids, **_greedy(max_new_tokens=5, min_new_tokens=5))
            second = model.generate(first.sequences, **{CACHE: first.past_key_values}, do_sample=False,
                                    max_new_tokens=7, min_new_tokens=7)
            assert torch.equal(second, one)
            first = model.generate(ids, **_greedy(max_new_tokens=5, min_new_tokens=5))
            text = torch.cat((first.sequences, turn), dim=1)
            with MlaCalls() as calls:
                continued = model.generate(text, **{CACHE: first.past_key_values}, do_sample=False, max_new_tokens=6,
                                           min_new_tokens=6)
            assert calls.counts["gather_pa_kv_cache"] == config.num_hidden_layers  # one prefix prefill
        expected = model.generate(text, do_sample=False, max_new_tokens=6, min_new_tokens=6)
    assert torch.equal(continued, expected)


def test_cache_memory_is_the_latent():
    """bf16, V2-Lite dims: 576 values = 1152 B per token and layer, within one block of it."""
    config = lite_attn_config()
    model = build_model(config, torch.bfloat16, "sdpa")
    ids = random_prompt(config, length=150)
    with torch.no_grad(), mla_ops.patch(model, cache="paged"):
        out = model(ids, use_cache=True)
    report = out.past_key_values.memory_report()
    assert report["payload_bytes_per_token_per_layer"] == 1152
    block = report["block_size"]
    assert report["tokens"] == 150
    assert 1152 <= report["bytes_per_token_per_layer"] <= 1152 * (150 + block) / 150


def test_dynamic_pool_grows_block_by_block():
    config = tiny_config()
    model = build_model(config, torch.float32, "sdpa")
    ids = random_prompt(config, length=5)
    with torch.no_grad():
        expected = model.generate(ids, do_sample=False, max_new_tokens=20, min_new_tokens=20)
        with mla_ops.patch(model, cache="paged"):
            cache = MLAPagedCache(config, block_size=4)  # no size hint: one block per row to start with
            got = model.generate(ids, **{CACHE: cache}, do_sample=False, max_new_tokens=20, min_new_tokens=20)
    assert torch.equal(got, expected)
    assert cache.layers[0].latent_pool.shape[0] >= 6 and len(cache._blocks_host[0]) == 6  # 24 tokens / 4


def test_sampling_matches_stock_under_the_same_seed():
    config = tiny_config()
    model = build_model(config, torch.float32, "sdpa")
    ids = random_prompt(config, length=8)
    gen = dict(do_sample=True, top_k=20, temperature=0.9, max_new_tokens=16, min_new_tokens=16)
    with torch.no_grad():
        torch.manual_seed(7)
        expected = model.generate(ids, **gen)
        with mla_ops.patch(model, cache="paged"):
            torch.manual_seed(7)
            got = model.generate(ids, **gen)
    assert torch.equal(got, expected)


def test_beam_search_and_other_caches():
    config = tiny_config()
    model = build_model(config, torch.float32, "sdpa")
    ids = random_prompt(config, length=6)
    with torch.no_grad(), mla_ops.patch(model, cache="paged"):
        with pytest.raises(NotImplementedError, match="does not support beam search"):
            model.generate(ids, num_beams=2, max_new_tokens=3)
        # a cache passed in explicitly is respected (served by the dense path)
        dynamic = DynamicCache(config=config)
        out = model.generate(ids, **{CACHE: dynamic}, do_sample=False, max_new_tokens=4, return_dict_in_generate=True)
        assert out.past_key_values is dynamic
        assert dynamic.layers[0].keys.shape[-1] == config.qk_nope_head_dim + config.qk_rope_head_dim
    with torch.no_grad():
        assert torch.equal(out.sequences, model.generate(ids, do_sample=False, max_new_tokens=4))


def test_static_cache_decode_compiles_fullgraph_and_matches_eager():
    config = tiny_config()
    model = build_model(config, torch.float32, "sdpa")
    ids = random_prompt(config, length=8)

    def greedy(forward, cache, steps=6):
        pos = torch.arange(ids.shape[1])
        logits = forward(ids, **{CACHE: cache}, position_ids=pos[None], use_cache=True).logits
        out = []
        for _ in range(steps):
            nxt = logits[:, -1:].argmax(-1)
            out.append(nxt)
            pos = pos[-1:] + 1
            logits = forward(nxt, **{CACHE: cache}, position_ids=pos[None], use_cache=True).logits
        return torch.cat(out, 1)

    def static_cache():
        return MLAPagedCache(config, static=True, batch_size=1, max_cache_len=32, block_size=4)

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad(), mla_ops.patch(model, cache="paged"):
        eager = greedy(model, static_cache())
        torch._dynamo.reset()
        compiled = greedy(torch.compile(model, backend=capture, fullgraph=True), static_cache())
        decode_cache = static_cache()
        model(ids, **{CACHE: decode_cache}, position_ids=torch.arange(8)[None], use_cache=True)
        explanation = torch._dynamo.explain(model)(ids[:, :1], **{CACHE: decode_cache},
                                                   position_ids=torch.tensor([[8]]), use_cache=True)
        compile_config = CompileConfig(fullgraph=True, dynamic=False)
        compile_config._compile_all_devices = True
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        generated = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static",
                                   compile_config=compile_config, return_dict_in_generate=True)
    assert torch.equal(compiled, eager)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    targets = {str(n.target) for g in graphs for n in g.graph.nodes if "mla" in str(n.target)}
    assert {"mla.mla_decode_attention", "mla.scatter_pa_kv_cache", "mla.latent_kv_prolog"} <= targets
    assert isinstance(generated.past_key_values, MLAPagedCache) and generated.past_key_values.static
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert torch.equal(generated.sequences[:, 8:], eager)


def test_class_level_paged_patch():
    config = tiny_config()
    ids = random_prompt(config, length=6)
    with mla_ops.patch(cache="paged"):
        model = build_model(config)
        with torch.no_grad():
            out = model(ids, use_cache=True)
        assert isinstance(out.past_key_values, MLAPagedCache)
    stock = build_model(config)
    with torch.no_grad():
        assert isinstance(stock(ids, use_cache=True).past_key_values, DynamicCache)


def test_static_cache_overflow_is_a_clear_error():
    config = tiny_config()
    model = build_model(config)
    with torch.no_grad(), mla_ops.patch(model, cache="paged"):
        cache = MLAPagedCache(config, static=True, batch_size=1, max_cache_len=8, block_size=4)
        with pytest.raises(ValueError, match=r"holds 8 tokens per row \(max_cache_len=8\); this forward needs 10"):
            model(random_prompt(config, length=10), **{CACHE: cache}, use_cache=True)


def test_dynamic_cache_under_compile_is_a_clear_error():
    """The dynamic pool allocates blocks on the host: compiling it must fail naming the fix."""
    config = tiny_config()
    model = build_model(config, torch.float32, "sdpa")
    ids = random_prompt(config, length=6)
    torch._dynamo.reset()
    with torch.no_grad(), mla_ops.patch(model, cache="paged"):
        with pytest.raises(Exception, match=r"MLAPagedCache\(static=False\).*static=True"):
            torch.compile(model, backend="eager", fullgraph=True)(ids, cache=MLAPagedCache(config), use_cache=True)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_chunked_prefill_equals_stock_on_the_whole_text(static):
    """A prompt fed in three chunks (prefill, prefill on a cached prefix, prefill again) and then
    decoded: every logit equals stock's forward over the whole text, to fp32 rounding."""
    config = lite_attn_config()
    model = build_model(config, torch.float32, "sdpa")
    ids = random_prompt(config, length=23)
    chunks = [(0, 9), (9, 14), (14, 20), (20, 21), (21, 22), (22, 23)]  # three prefills, three decode steps
    with torch.no_grad():
        expected = model(ids).logits
        with mla_ops.patch(model, cache="paged"):
            cache = (MLAPagedCache(config, static=True, batch_size=1, max_cache_len=32, block_size=4) if static
                     else MLAPagedCache(config, block_size=4))
            got = [model(ids[:, a:b], **{CACHE: cache}, position_ids=torch.arange(a, b)[None], use_cache=True).logits
                   for a, b in chunks]
    assert int(cache.seq_lens[0]) == 23
    torch.testing.assert_close(torch.cat(got, 1), expected, rtol=0, atol=2e-5)


def test_weights_changed_after_decoding_are_picked_up():
    """The absorbed W_UK / W_UV copies follow kv_b_proj: modified in place, or the model cast (stale
    fp32 copies would fail the bf16 bmm outright)."""
    config = tiny_config()
    model = build_model(config, torch.float32, "sdpa")
    ids = random_prompt(config, length=8)
    gen = dict(do_sample=False, max_new_tokens=8, min_new_tokens=8, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad(), mla_ops.patch(model, cache="paged"):
        model.generate(ids, **gen)
        for layer in model.model.layers:
            layer.self_attn.kv_b_proj.weight.mul_(1.7)
        got_scaled = model.generate(ids, **gen)
        model.to(torch.bfloat16)
        got_bf16 = model.generate(ids, **gen)
    with torch.no_grad():
        expected_bf16 = model.generate(ids, **gen)
        model.to(torch.float32)
        expected_scaled = model.generate(ids, **gen)
    assert torch.equal(got_scaled.sequences, expected_scaled.sequences)
    # bf16: absorbed decode rounds in other places than stock (see test_bf16_logits_within_tolerance_of_stock)
    for got, expected in zip(got_bf16.logits, expected_bf16.logits):
        # |logits| <= 0.51 on this model: 0.02 is ~10 bf16 ulps there (measured 0.004; W_UK / W_UV left
        # stale after the in-place change measured 0.15)
        torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=0.02)
    assert torch.equal(got_bf16.sequences, expected_bf16.sequences)


def test_reapplying_with_other_options_replaces_the_patch():
    """patch() on an already patched model: the newest options win, and one revert restores stock."""
    config = tiny_config()
    model = build_model(config, torch.float32, "sdpa")
    ids = random_prompt(config, length=6)
    with torch.no_grad():
        mla_ops.patch(model, cache="paged")
        assert isinstance(model(ids, use_cache=True).past_key_values, MLAPagedCache)
        mla_ops.patch(model, cache="dense")
        with MlaCalls() as calls:
            out = model(ids, use_cache=True)
        assert isinstance(out.past_key_values, DynamicCache) and calls.counts == {"kv_prolog": 2}
        handle = mla_ops.patch(model, cache="paged")
        assert isinstance(model(ids, use_cache=True).past_key_values, MLAPagedCache)
        assert patch.active_patches() == [handle]
        handle.revert()
        with MlaCalls() as calls:
            out = model(ids, use_cache=True)
    assert isinstance(out.past_key_values, DynamicCache) and calls.counts == {}


def test_num_return_sequences_sampling_matches_stock():
    config = tiny_config()
    model = build_model(config, torch.float32, "sdpa")
    ids = random_prompt(config, length=7)
    gen = dict(do_sample=True, top_k=20, num_return_sequences=2, max_new_tokens=10, min_new_tokens=10,
               return_dict_in_generate=True)
    with torch.no_grad():
        torch.manual_seed(3)
        expected = model.generate(ids, **gen)
        with mla_ops.patch(model, cache="paged"):
            torch.manual_seed(3)
            got = model.generate(ids, **gen)
    assert isinstance(got.past_key_values, MLAPagedCache) and got.past_key_values.batch_size == 2
    assert torch.equal(got.sequences, expected.sequences)


def test_training_step_under_the_paged_patch_equals_stock():
    """With gradients on, no paged cache is made: the dense path serves, loss and grads as stock."""
    config = tiny_config()
    model = build_model(config, torch.float32, "sdpa")
    model.train()
    ids = random_prompt(config, batch=2, length=9)

    def loss_and_grads():
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    expected_loss, expected_grads = loss_and_grads()
    with mla_ops.patch(model, cache="paged"):
        loss, grads = loss_and_grads()
    assert torch.equal(loss, expected_loss)
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_four_dimensional_masks_mark_the_same_padding_as_two_dimensional_ones():
    config = tiny_config()
    cache = MLAPagedCache(config, block_size=4)
    mask_2d = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    allowed = torch.ones(5, 5, dtype=torch.bool).tril()[None, None] & mask_2d.bool()[:, None, None, :]
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    from_2d = cache._real_token_flags(mask_2d, 2, 5, torch.device("cpu"))
    assert torch.equal(cache._real_token_flags(allowed, 2, 5, torch.device("cpu")), from_2d)
    assert torch.equal(cache._real_token_flags(additive, 2, 5, torch.device("cpu")), from_2d)
    assert from_2d.tolist() == [[False, False, True, True, True], [True] * 5]


def test_crop_then_continue_equals_stock():
    """crop(-n) drops the last n cached tokens (freeing whole blocks); generating on from there is
    stock generation from the same text."""
    config = tiny_config()
    model = build_model(config, torch.float32, "sdpa")
    ids = random_prompt(config, length=6)
    gen = dict(do_sample=False, min_new_tokens=5, max_new_tokens=5)
    with torch.no_grad():
        with mla_ops.patch(model, cache="paged"):
            out = model.generate(ids, do_sample=False, max_new_tokens=10, min_new_tokens=10,
                                 return_dict_in_generate=True)
            cache = out.past_key_values
            assert cache.seq_lens.tolist() == [15]
            cache.crop(-7)  # 8 tokens left: exactly two blocks of 4
            assert cache.seq_lens.tolist() == [8] and len(cache._blocks_host[0]) == -(-8 // cache.block_size)
            text = out.sequences[:, :9]
            got = model.generate(text, **{CACHE: cache}, **gen)
        expected = model.generate(text, **gen)
    assert torch.equal(got, expected)


def test_class_level_paged_revert_frees_the_absorbed_weights():
    """The decode path's W_UK / W_UV copies (one kv_b_proj's worth per layer) go with the patch."""
    config = tiny_config()
    ids = random_prompt(config, length=6)
    with mla_ops.patch(cache="paged"):
        model = build_model(config)
        with torch.no_grad():
            model.generate(ids, do_sample=False, max_new_tokens=3, min_new_tokens=3)
        assert all("_mla_ops_absorbed" in layer.self_attn.__dict__ for layer in model.model.layers)
    assert not any("_mla_ops_absorbed" in layer.self_attn.__dict__ for layer in model.model.layers)
    with mla_ops.patch(model, cache="paged") as handle:
        with torch.no_grad():
            model.generate(ids, do_sample=False, max_new_tokens=3, min_new_tokens=3)
        assert all("_mla_ops_absorbed" in layer.self_attn.__dict__ for layer in model.model.layers)
        handle.revert()
    assert not any("_mla_ops_absorbed" in layer.self_attn.__dict__ for layer in model.model.layers)


def test_instance_dense_patch_under_a_class_level_paged_patch():
    """A model-level dense patch inside a class-level paged one: the instance's options win for that
    model (generate makes its stock cache, served by the dense path), with stock's tokens."""
    config = tiny_config()
    ids = random_prompt(config, length=6)
    gen = dict(do_sample=False, max_new_tokens=6, min_new_tokens=6)
    model = build_model(config)
    with torch.no_grad():
        expected = model.generate(ids, **gen)
        with mla_ops.patch(cache="paged"), mla_ops.patch(model, rope=True, cache="dense"):
            got = model.generate(ids, **gen, return_dict_in_generate=True)
    assert isinstance(got.past_key_values, DynamicCache)
    assert torch.equal(got.sequences, expected)


# ------------------------------------------------------------------ copies, saves, patch scopes
def _deepcopy(model):
    import copy

    return copy.deepcopy(model)


def _save_and_load(model):
    import io

    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


PATCH_ENTRIES = ("forward", "_mla_ops_patch", "_mla_ops_absorbed", "__getstate__", "_prepare_cache_for_generation")


def _assert_plain_stock(model, ids, expected):
    for module in model.modules():
        assert not set(PATCH_ENTRIES) & set(module.__dict__), f"{type(module).__name__} kept a patch entry"
    with torch.no_grad(), MlaCalls() as calls:
        out = model(ids, use_cache=True)
    assert not calls.counts and not isinstance(out.past_key_values, MLAPagedCache)
    assert torch.equal(out.logits, expected)


@pytest.mark.parametrize("copy_fn", [_deepcopy, _save_and_load], ids=["deepcopy", "torch.save"])
@pytest.mark.parametrize("cache", ["dense", "paged"])
def test_copies_and_saves_of_an_instance_patched_model_are_stock_and_patchable(cache, copy_fn):
    """A copy (deepcopy, or torch.save + torch.load) of an instance-patched model is a plain stock
    model: no patch entry, stock logits, no mla op; patch() patches it and revert() restores it; the
    original keeps its own patch."""
    config = tiny_config()
    model = build_model(config)
    ids = random_prompt(config, length=6)
    with torch.no_grad():
        expected = model(ids, use_cache=True).logits
    handle = mla_ops.patch(model, cache=cache)
    with torch.no_grad():  # a paged prefill and a decode step: the absorbed copies exist
        out = model(ids, use_cache=True)
        model(ids[:, -1:], **{CACHE: out.past_key_values}, use_cache=True)
    clone = copy_fn(model)
    _assert_plain_stock(clone, ids, expected)
    with mla_ops.patch(clone, cache=cache), torch.no_grad(), MlaCalls() as calls:
        out = clone(ids, use_cache=True)
    assert calls.counts and isinstance(out.past_key_values, MLAPagedCache) == (cache == "paged")
    _assert_plain_stock(clone, ids, expected)
    with torch.no_grad(), MlaCalls() as calls:
        model(ids, use_cache=True)
    assert calls.counts, "the original keeps its patch"
    handle.revert()
    _assert_plain_stock(model, ids, expected)


@pytest.mark.parametrize("copy_fn", [_deepcopy, _save_and_load], ids=["deepcopy", "torch.save"])
@pytest.mark.parametrize("cache", ["dense", "paged"])
def test_copies_of_a_class_patched_model_follow_the_class(cache, copy_fn):
    """Under a class-level patch a copy is a model of the patched class (it uses the ops, like any
    model of it) and is stock once the class patch is reverted; the absorbed copies are not copied."""
    config = tiny_config()
    stock = build_model(config)
    ids = random_prompt(config, length=6)
    with torch.no_grad():
        expected = stock(ids, use_cache=True).logits
    with mla_ops.patch(cache=cache):
        model = build_model(config)
        model.load_state_dict(stock.state_dict())
        with torch.no_grad():
            out = model(ids, use_cache=True)
            model(ids[:, -1:], **{CACHE: out.past_key_values}, use_cache=True)
        clone = copy_fn(model)
        assert not any("_mla_ops_absorbed" in m.__dict__ for m in clone.modules())
        with torch.no_grad(), MlaCalls() as calls:
            out = clone(ids, use_cache=True)
        assert calls.counts and isinstance(out.past_key_values, MLAPagedCache) == (cache == "paged")
    _assert_plain_stock(clone, ids, expected)


def test_an_instance_dense_patch_wins_over_a_class_paged_patch():
    config = tiny_config()
    ids = random_prompt(config, length=6)
    with mla_ops.patch(cache="paged"):
        model, other = build_model(config), build_model(config)
        with mla_ops.patch(model, cache="dense"), torch.no_grad(), MlaCalls() as calls:
            assert isinstance(model(ids, use_cache=True).past_key_values, DynamicCache)
            out = model.generate(ids, do_sample=False, max_new_tokens=3, return_dict_in_generate=True)
            assert not isinstance(out.past_key_values, MLAPagedCache)
            assert calls.counts["kv_prolog"] and "mla_decode_attention" not in calls.counts
        with torch.no_grad():  # the class patch still serves the other models
            out = other.generate(ids, do_sample=False, max_new_tokens=3, return_dict_in_generate=True)
        assert isinstance(out.past_key_values, MLAPagedCache)
        with torch.no_grad():  # and this one again once its own patch is gone
            assert isinstance(model(ids, use_cache=True).past_key_values, MLAPagedCache)
    # the other order: the class-level paged patch applied after the instance's dense one
    model = build_model(config)
    with mla_ops.patch(model, cache="dense"), mla_ops.patch(cache="paged"), torch.no_grad():
        assert isinstance(model(ids, use_cache=True).past_key_values, DynamicCache)
        out = model.generate(ids, do_sample=False, max_new_tokens=3, return_dict_in_generate=True)
        assert not isinstance(out.past_key_values, MLAPagedCache)


def test_dynamic_pool_reserves_what_is_generated_not_max_new_tokens():
    """generate() sizes the cache for prompt + max_new_tokens; a generation that stops after 5 tokens
    must hold about 5 tokens' worth of blocks, not 200000 (the static cache preallocates by design)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    from mla_ops.integrations.transformers.paged_cache import MAX_INITIAL_TOKENS_PER_ROW

    class AfterFive(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 6 + 5, dtype=torch.bool)

    config = tiny_config()
    model = build_model(config)
    ids = random_prompt(config, length=6)
    with torch.no_grad(), mla_ops.patch(model, cache="paged"):
        out = model.generate(ids, do_sample=False, max_new_tokens=200_000, return_dict_in_generate=True,
                             stopping_criteria=StoppingCriteriaList([AfterFive()]))
    assert out.sequences.shape[1] == 11
    cache = out.past_key_values
    assert isinstance(cache, MLAPagedCache) and not cache.static
    reserved_tokens = cache.layers[0].latent_pool.shape[0] * cache.block_size
    assert reserved_tokens <= MAX_INITIAL_TOKENS_PER_ROW + cache.block_size  # not 200006 tokens
    assert cache.memory_report()["pool_bytes"] <= 2 * (MAX_INITIAL_TOKENS_PER_ROW + cache.block_size) * (
        config.kv_lora_rank + config.qk_rope_head_dim) * 4 * config.num_hidden_layers
