"""DeepSeek-V4 (transformers' `deepseek_v4`) under `mla_ops.patch`: recognised by structure; dense mode
bit-identical to stock in fp32 and bf16 with its prologs, compressors, indexer and inverse RoPE on the ops;
paged mode entirely on the ops (`SharedKvPagedCache`), greedy tokens equal to stock, compiled decode with no
graph break; every mla op call counted per layer and forward; revert; the command line.

The tiny models have every layer type (sliding, CSA, HCA), prompts longer than the sliding window, more
compressed entries than `index_topk`, 8 indexer heads, O(1) weights and random sinks, position biases and
norm weights (stock initialises them to 0 / 0 / 1, which hides a skipped or misplaced one), and the tests
check that no two indexer scores tie at the k-th place (where `torch.topk` and the op may legitimately keep
different entries).
"""
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mla_ops
from mla_ops._optional import has_module
from mla_ops.cli import main
from mla_ops.integrations.transformers import families
from mla_ops.integrations.transformers.attention_parts import PATCH_ATTRIBUTE
from mla_ops.integrations.transformers.shared_kv import (
    DENSE_STATE_ATTRIBUTE,
    describe_shared_kv,
    installed_shared_kv_model_types,
    is_shared_kv_attention,
)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not has_module("transformers.models.deepseek_v4"),
                                 reason="the installed transformers has no DeepSeek-V4 (transformers >= 5.24)")]

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA, CSA)
WINDOW, CSA_RATE, HCA_RATE, TOPK = 8, 4, 8, 4
PROMPT = 41  # > WINDOW; CSA: 10 entries > TOPK; HCA: 5 entries
NEW_TOKENS = 40  # crosses 10 more CSA windows, 5 more HCA windows and the sliding window several times
# mla op calls per attention forward, by layer type (the same for a prefill and a decode step)
DENSE_CALLS = {SLIDING: {"shared_kv_q_prolog": 1, "shared_kv_prolog": 1, "rope": 1},
               CSA: {"shared_kv_q_prolog": 1, "shared_kv_prolog": 1, "rope": 2, "kv_compressor": 2,
                     "lightning_indexer": 1},
               HCA: {"shared_kv_q_prolog": 1, "shared_kv_prolog": 1, "rope": 1, "kv_compressor": 1}}
PAGED_CALLS = {kind: {**calls, "scatter_pa_cache": 1, "shared_kv_attention": 1} for kind, calls in DENSE_CALLS.items()}


def v4_config(**overrides):
    from transformers import DeepseekV4Config

    config = dict(vocab_size=128, hidden_size=64, num_hidden_layers=len(LAYER_TYPES), layer_types=list(LAYER_TYPES),
                  mlp_layer_types=["hash_moe"] + ["moe"] * (len(LAYER_TYPES) - 1), num_attention_heads=4,
                  num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25, q_lora_rank=32, o_groups=2,
                  o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=TOPK, sliding_window=WINDOW,
                  compress_rates={CSA: CSA_RATE, HCA: HCA_RATE}, moe_intermediate_size=32, n_routed_experts=4,
                  num_experts_per_tok=2, n_shared_experts=1, hc_mult=4, max_position_embeddings=4096,
                  rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                                   "beta_fast": 32, "beta_slow": 1},
                  bos_token_id=0, eos_token_id=1, pad_token_id=2)
    config.update(overrides)
    return DeepseekV4Config(**config)


def v4_model(config=None, dtype=torch.float32, seed=0):
    """A tiny DeepSeek-V4 in `dtype` (bf16 as transformers loads it: fp32 sinks, norms and position biases)
    with O(1) weights and random sinks, position biases, norm weights and hash routes."""
    from transformers import DeepseekV4ForCausalLM

    config = config or v4_config()
    model = DeepseekV4ForCausalLM._from_config(config, dtype=dtype).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "position_bias")) or "norm.weight" in name:
                param.copy_(torch.randn(param.shape, generator=generator).to(param.dtype))
            elif param.dim() >= 2 and "hc" not in name:  # (the hyper-connections keep their own init)
                param.copy_((0.3 * torch.randn(param.shape, generator=generator)).to(param.dtype))
        for name, buffer in model.named_buffers():
            if name.endswith("tid2eid"):
                buffer.copy_(torch.randint(0, config.n_routed_experts, buffer.shape, generator=generator))
    return model


def prompt(batch=1, length=PROMPT, seed=1):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _greedy(new_tokens=NEW_TOKENS, **extra):
    return dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, output_logits=True,
                return_dict_in_generate=True, **extra)


class LayerCalls(TorchDispatchMode):
    """The mla op calls of every attention forward: `records` holds (layer_idx, {op: count}) in call order
    (a forward pre-hook on each attention module opens its record)."""

    def __init__(self, model):
        super().__init__()
        self.records = []
        self._model = model
        self._hooks = []

    def __enter__(self):
        for module in self._model.modules():
            if is_shared_kv_attention(module):
                self._hooks.append(module.register_forward_pre_hook(
                    lambda m, args: self.records.append((m.layer_idx, {}))))
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "mla":
            calls = self.records[-1][1]
            name = func.overloadpacket.__name__
            calls[name] = calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    def check(self, per_layer_type: dict, forwards: int) -> None:
        """Every forward ran every layer once, in order, each making exactly its layer type's calls."""
        expected = [(i, per_layer_type[kind]) for _ in range(forwards) for i, kind in enumerate(LAYER_TYPES)]
        assert self.records == expected


def assert_no_indexer_ties(model, ids, gap=1e-5):
    """No query of `ids` sees two indexer scores equal (within `gap`, relative) at the k-th place, in any
    CSA layer of the stock model: there the selection is decided by scores alone."""
    scores = []
    hooks = [m.register_forward_hook(lambda mod, args, out: scores.append(out)) for m in model.modules()
             if type(m).__name__ == "DeepseekV4IndexerScorer"]
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(scores) == LAYER_TYPES.count(CSA)
    for layer_scores in scores:  # [B, S, T] fp32
        for row in layer_scores:
            for position, values in enumerate(row):
                visible = (position + 1) // CSA_RATE
                if visible > TOPK:
                    ranked = values[:visible].sort(descending=True).values
                    assert ranked[TOPK - 1] - ranked[TOPK] > gap * max(1.0, float(ranked[TOPK - 1].abs()))


def _forwards(model):
    """The function each module's forward runs (an instance patch shows here, not on the class)."""
    return {name: getattr(m.forward, "__func__", m.forward) for name, m in model.named_modules()}


# ---------------------------------------------------------------------------------- recognition
def test_recognised_by_structure_and_listed():
    assert "deepseek_v4" in installed_shared_kv_model_types()
    (family,) = families.families_of("deepseek_v4")
    assert family.shared_kv and family.refused is None and family.rope == "interleaved"
    assert family.parameters == ("hidden_states", "position_embeddings", "position_ids", "attention_mask", "cache")
    model = v4_model()
    attention = [m for m in model.modules() if is_shared_kv_attention(m)]
    assert [m.layer_idx for m in attention] == list(range(len(LAYER_TYPES)))
    assert not any(families.is_mla_attention(m) for m in model.modules())

    class WithAnExtraStep(family.attention):  # a forward doing something the patch does not reproduce
        def forward(self, hidden_states, position_embeddings, position_ids, attention_mask, cache=None, **kwargs):
            return self.output_gate(hidden_states), None

    assert "output_gate" in describe_shared_kv(WithAnExtraStep).refused


# ------------------------------------------------------------------------------------------ dense
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dense_prefill_bit_identical_to_stock(dtype):
    model = v4_model(dtype=dtype)
    ids = prompt(batch=2)
    assert_no_indexer_ties(model, ids)
    with torch.no_grad():
        expected = model(ids, use_cache=True).logits
        expected_uncached = model(ids, use_cache=False).logits
        with mla_ops.patch(model, cache="dense"), LayerCalls(model) as calls:
            got = model(ids, use_cache=True)
            got_uncached = model(ids, use_cache=False).logits
    assert torch.equal(got.logits, expected) and torch.equal(got_uncached, expected_uncached)
    calls.check(DENSE_CALLS, forwards=2)
    # the stock cache holds what stock holds: the window and the entries (and the op state beside them)
    layer = got.cache.layers[1]
    assert layer.compressed_kv["compressor"].shape == (2, PROMPT // CSA_RATE, 32)
    assert layer.compressed_kv["indexer"].shape == (2, PROMPT // CSA_RATE, 16)
    assert layer.entry_count == {"compressor": PROMPT // CSA_RATE, "indexer": PROMPT // CSA_RATE}
    assert set(layer.__dict__[DENSE_STATE_ATTRIBUTE]) == {"compressor", "indexer"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dense_greedy_generation_equals_stock(dtype):
    model = v4_model(dtype=dtype)
    ids = prompt()
    with torch.no_grad():
        expected = model.generate(ids, **_greedy())
        with mla_ops.patch(model, cache="dense"), LayerCalls(model) as calls:
            got = model.generate(ids, **_greedy())
    assert_no_indexer_ties(model, got.sequences)
    assert torch.equal(got.sequences, expected.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, expected.logits))  # every step, bit for bit
    calls.check(DENSE_CALLS, forwards=NEW_TOKENS)


def test_dense_chunked_prefill_and_padded_batch_equal_stock():
    from transformers import DynamicCache

    model = v4_model()
    ids = prompt()
    chunks = (17, 1, 11, 12)  # windows closing inside, across and at the end of calls
    with torch.no_grad():
        for patched in (False, True):
            cache, logits, start = DynamicCache(config=model.config), [], 0
            with mla_ops.patch(model, cache="dense") if patched else torch.no_grad():
                for size in chunks:
                    logits.append(model(ids[:, start:start + size], cache=cache, use_cache=True).logits)
                    start += size
            if not patched:
                expected = logits
        assert all(torch.equal(a, b) for a, b in zip(logits, expected))
        # left padding: stock's compressors pool the padding too; the dense mode reproduces that exactly
        padded = torch.cat((torch.full((1, 5), 2), prompt(length=PROMPT - 5, seed=2)), dim=1)
        batch = torch.cat((ids, padded))
        mask = torch.ones_like(batch)
        mask[1, :5] = 0
        expected = model.generate(batch, attention_mask=mask, **_greedy(12))
        with mla_ops.patch(model, cache="dense"):
            got = model.generate(batch, attention_mask=mask, **_greedy(12))
    assert torch.equal(got.sequences, expected.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, expected.logits))


def test_dense_beam_search_equals_stock():
    """Beam search reorders the stock cache's rows; the op state on its layers follows them."""
    model = v4_model()
    ids = prompt()
    kwargs = dict(num_beams=3, do_sample=False, max_new_tokens=10, min_new_tokens=10)
    with torch.no_grad():
        expected = model.generate(ids, **kwargs)
        with mla_ops.patch(model, cache="dense"):
            got = model.generate(ids, **kwargs)
    assert torch.equal(got, expected)


# ------------------------------------------------------------------------------------------ paged
def test_paged_greedy_tokens_equal_stock_fp32():
    from mla_ops.integrations.transformers.shared_kv_cache import SharedKvPagedCache

    model = v4_model()
    ids = prompt(batch=2)
    with torch.no_grad():
        expected = model.generate(ids, **_greedy())
        with mla_ops.patch(model), LayerCalls(model) as calls:  # cache="paged" is the default
            got = model.generate(ids, **_greedy())
    assert_no_indexer_ties(model, got.sequences)
    assert isinstance(got.cache, SharedKvPagedCache)
    assert torch.equal(got.sequences, expected.sequences)
    calls.check(PAGED_CALLS, forwards=NEW_TOKENS)  # the prefill and every decode step on the ops
    for a, b in zip(got.logits, expected.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_paged_sampling_and_a_second_turn_equal_stock():
    """Sampling under one seed, then a second generate continuing the returned cache (a prefill on it)."""
    model = v4_model()
    ids, more = prompt(), prompt(length=7, seed=5)
    kwargs = dict(do_sample=True, top_k=20, max_new_tokens=10, min_new_tokens=10, return_dict_in_generate=True)
    turns = []
    with torch.no_grad():
        for patched in (False, True):
            with mla_ops.patch(model) if patched else torch.no_grad():
                torch.manual_seed(7)
                first = model.generate(ids, **kwargs)
                second = model.generate(torch.cat((first.sequences, more), 1), cache=first.cache, **kwargs)
            turns.append((first.sequences, second.sequences, type(second.cache).__name__))
    (stock_first, stock_second, stock_cache), (first, second, cache) = turns
    assert torch.equal(first, stock_first) and torch.equal(second, stock_second)
    assert (stock_cache, cache) == ("DynamicCache", "SharedKvPagedCache")


def test_paged_bf16_is_as_accurate_as_stock_bf16():
    """In bf16 the paged attention rounds once (fp32 inside) where stock rounds its bf16 matmuls, so
    greedy tokens may part where two logits are close: teacher-forced on stock's tokens, the paged
    model's logits are as close to the fp32 model's as stock's bf16 logits are."""
    from transformers import DynamicCache

    from mla_ops.integrations.transformers.shared_kv_cache import SharedKvPagedCache

    model = v4_model(dtype=torch.bfloat16)
    exact = v4_model()
    exact.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    ids = prompt()
    with torch.no_grad():
        sequence = model.generate(ids, do_sample=False, max_new_tokens=12, min_new_tokens=12)

    def teacher_forced(net, cache):
        logits = [net(sequence[:, :PROMPT], cache=cache, use_cache=True).logits[:, -1]]
        for i in range(PROMPT, sequence.shape[1]):
            logits.append(net(sequence[:, i:i + 1], cache=cache, use_cache=True).logits[:, -1])
        return torch.stack(logits).float()

    with torch.no_grad():
        reference = teacher_forced(exact, DynamicCache(config=exact.config))
        stock = teacher_forced(model, DynamicCache(config=model.config))
        with mla_ops.patch(model):
            paged = teacher_forced(model, SharedKvPagedCache(model.config))
    stock_error, paged_error = (stock - reference).abs().mean(), (paged - reference).abs().mean()
    assert paged_error <= 1.25 * stock_error, (paged_error, stock_error)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_paged_chunked_prefill_equals_one_shot(static):
    from mla_ops.integrations.transformers.shared_kv_cache import SharedKvPagedCache

    model = v4_model()
    ids = prompt(batch=2)

    def cache():
        return (SharedKvPagedCache(model.config, static=True, batch_size=2, max_cache_len=64, block_size=4) if static
                else SharedKvPagedCache(model.config, block_size=4))

    def greedy(chunks, steps=8):
        kv, start, logits = cache(), 0, None
        for size in chunks:
            logits = model(ids[:, start:start + size], cache=kv, use_cache=True).logits
            start += size
        tokens = []
        for _ in range(steps):
            tokens.append(logits[:, -1:].argmax(-1))
            logits = model(tokens[-1], cache=kv, use_cache=True).logits
        return torch.cat(tokens, 1), logits

    with torch.no_grad(), mla_ops.patch(model):
        whole, whole_logits = greedy((PROMPT,))
        chunked, chunked_logits = greedy((17, 1, 11, 12))
    assert torch.equal(chunked, whole)
    torch.testing.assert_close(chunked_logits, whole_logits, rtol=0, atol=1e-5)


def test_paged_static_decode_compiles_fullgraph_and_matches_eager():
    from mla_ops.integrations.transformers.shared_kv_cache import SharedKvPagedCache

    model = v4_model()
    ids = prompt()

    def greedy(forward, cache, steps=8):
        pos = torch.arange(PROMPT)
        logits = forward(ids, cache=cache, position_ids=pos[None], use_cache=True).logits
        out = []
        for _ in range(steps):
            out.append(logits[:, -1:].argmax(-1))
            pos = pos[-1:] + 1
            logits = forward(out[-1], cache=cache, position_ids=pos[None], use_cache=True).logits
        return torch.cat(out, 1)

    def static_cache():
        return SharedKvPagedCache(model.config, static=True, batch_size=1, max_cache_len=64, block_size=4)

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad(), mla_ops.patch(model):
        eager = greedy(model, static_cache())
        torch._dynamo.reset()
        compiled = greedy(torch.compile(model, backend=capture, fullgraph=True), static_cache())
        decode_cache = static_cache()
        model(ids, cache=decode_cache, position_ids=torch.arange(PROMPT)[None], use_cache=True)
        explanation = torch._dynamo.explain(model)(ids[:, :1], cache=decode_cache,
                                                   position_ids=torch.tensor([[PROMPT]]), use_cache=True)
        generated = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                   cache_implementation="static", return_dict_in_generate=True)
    assert torch.equal(compiled, eager)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    targets = {str(n.target) for g in graphs for n in g.graph.nodes if "mla" in str(n.target)}
    assert {f"mla.{op}" for op in PAGED_CALLS[CSA]} <= targets
    assert isinstance(generated.cache, SharedKvPagedCache) and generated.cache.static
    expected = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)  # stock, EOS held back
    assert torch.equal(generated.sequences, expected)


def test_paged_cache_frees_window_blocks_and_reports_its_memory():
    from mla_ops.integrations.transformers.shared_kv_cache import WINDOW as WINDOW_SPACE
    from mla_ops.integrations.transformers.shared_kv_cache import SharedKvPagedCache

    model = v4_model()
    block = 4
    cache = SharedKvPagedCache(model.config, block_size=block)
    with torch.no_grad(), mla_ops.patch(model):
        model.generate(prompt(), cache=cache, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    tokens = PROMPT + NEW_TOKENS - 1  # (the last token is generated, not fed)
    window_blocks = [b for b in cache._rows[WINDOW_SPACE][0] if b >= 0]
    assert len(window_blocks) <= -(-WINDOW // block) + 1  # only the blocks the last window reads
    report = cache.memory_report()
    assert report["tokens"] == tokens
    # payload per token, averaged over the layers: a window row in each, 1/m of an entry (and of an
    # indexer entry) in each compressed layer, fp32
    payload = (4 * 32 * 4 + 2 * (32 + 16) * 4 / CSA_RATE + 32 * 4 / HCA_RATE) / 4
    assert report["payload_bytes_per_token_per_layer"] == pytest.approx(payload)
    assert report["assigned_bytes"] < tokens * 4 * 32 * 4 * len(LAYER_TYPES)  # less than every window row kept


# ------------------------------------------------------------------------------- patch handling
def test_revert_restores_stock_exactly():
    from transformers import DynamicCache

    model = v4_model()
    ids = prompt()
    stock_forwards = _forwards(model)
    with torch.no_grad():
        expected = model(ids, use_cache=True).logits
        for cache in ("dense", "paged"):
            handle = mla_ops.patch(model, cache=cache)
            assert handle.patched_modules == len(LAYER_TYPES)
            assert _forwards(model) != stock_forwards
            handle.revert()
            assert _forwards(model) == stock_forwards
            assert not any(PATCH_ATTRIBUTE in m.__dict__ for m in model.modules())
            with LayerCalls(model) as calls:
                out = model(ids, use_cache=True)
            assert torch.equal(out.logits, expected) and isinstance(out.cache, DynamicCache)
            assert all(not counts for _, counts in calls.records)


def test_class_level_patch_serves_models_built_inside():
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    stock_attention, stock_model = hf.DeepseekV4Attention.forward, hf.DeepseekV4Model.forward
    model = v4_model()
    ids = prompt()
    with torch.no_grad():
        expected = model.generate(ids, **_greedy(10))
        with mla_ops.patch(family="deepseek_v4"), LayerCalls(model) as calls:
            got = model.generate(ids, **_greedy(10))
    assert torch.equal(got.sequences, expected.sequences)
    calls.check(PAGED_CALLS, forwards=10)
    assert hf.DeepseekV4Attention.forward is stock_attention and hf.DeepseekV4Model.forward is stock_model


@pytest.mark.parametrize("options, error, message", [
    (dict(rms_norm=True), ValueError, "rms_norm=True"),
    (dict(kv_prolog=False, rope=True, cache="dense"), ValueError, "kv_prolog=False"),
    (dict(rope_compute_dtype="float32"), ValueError, "rope_compute_dtype='float32'"),
])
def test_options_the_patch_cannot_apply_are_refused(options, error, message):
    model = v4_model()
    stock_forwards = _forwards(model)
    with pytest.raises(error, match=message):
        mla_ops.patch(model, **options)
    assert _forwards(model) == stock_forwards


def test_a_norm_rounding_otherwise_is_refused():
    """A V4 attention whose q_a_norm rounds before its weight multiply (DeepSeek-V2's RMSNorm) computes
    what the prolog op does not: refused at patch time, naming the module, nothing patched."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RMSNorm

    model = v4_model(dtype=torch.bfloat16)
    attention = next(m for m in model.modules() if is_shared_kv_attention(m))
    attention.q_a_norm = DeepseekV2RMSNorm(attention.q_a_norm.weight.shape[0]).float()
    stock_forwards = _forwards(model)
    with pytest.raises(NotImplementedError, match=r"q_a_norm \(DeepseekV2RMSNorm\) does not compute the weighted"):
        mla_ops.patch(model)
    assert _forwards(model) == stock_forwards


def test_paged_refuses_padding_and_beam_search_with_the_reason():
    model = v4_model()
    batch = prompt(batch=2)
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    with torch.no_grad(), mla_ops.patch(model):
        with pytest.raises(NotImplementedError, match="without padding.*cache='dense'"):
            model.generate(batch, attention_mask=mask, max_new_tokens=2, do_sample=False)
        with pytest.raises(NotImplementedError, match="beam search"):
            model.generate(batch[:1], num_beams=2, max_new_tokens=2, do_sample=False)


def test_training_is_refused_by_the_inference_only_ops():
    model = v4_model()
    with mla_ops.patch(model, cache="dense"), pytest.raises(RuntimeError, match="inference-only"):
        model(prompt(), labels=prompt()).loss.backward()


# ---------------------------------------------------------------------------------- command line
def test_info_lists_deepseek_v4_as_supported(capsys):
    assert main(["info"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "DeepseekV4Attention" in line)
    assert line.split()[0] == "deepseek_v4" and line.endswith("supported")


@pytest.fixture(scope="module")
def v4_checkpoint(tmp_path_factory):
    """A tiny DeepSeek-V4 saved as a user would have it (safetensors, fp32) with the built-in tokenizer."""
    from mla_ops.cli.loading import builtin_tokenizer

    tokenizer = builtin_tokenizer()
    config = v4_config(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = v4_model(config)
    directory = tmp_path_factory.mktemp("deepseek_v4")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory, model, tokenizer


@pytest.mark.parametrize("flags", [[], ["--use_kv_fusion"], ["--use_kv_fusion", "--cache", "paged"]],
                         ids=["stock", "dense", "paged"])
def test_ask_runs_a_saved_deepseek_v4_offline(v4_checkpoint, flags, tmp_path, capsys):
    directory, model, tokenizer = v4_checkpoint
    report_file = tmp_path / "report.json"
    assert main(["ask", "--model-path", str(directory), "--prompt", "hello", "--output_length", "8",
                 "--min-output-length", "8", "--no-stream", "--report-file", str(report_file), *flags]) == 0
    out = capsys.readouterr().out
    report = json.loads(report_file.read_text())
    assert report["dtype"] == "float32" and report["generated_tokens"] == 8
    assert any("no SDPA attention" in note for note in report["notes"])
    routed = "routed through torch.ops.mla: shared_kv_q_prolog, shared_kv_prolog, kv_compressor, lightning_indexer"
    assert (routed in out) == bool(flags)
    assert ("shared_kv_attention" in out) == ("paged" in flags)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                         tokenize=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert report["answer"] == tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True)
