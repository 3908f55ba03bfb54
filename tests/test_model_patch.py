"""The DeepSeek-V2 model patch (dense mode) against the stock transformers model."""

import dataclasses
import importlib
import inspect

import pytest
import torch
import transformers
from transformers import CompileConfig, StaticCache
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf

import mla_ops
from mla_ops.integrations import transformers as patch

from models import build_model, lite_attn_config, tiny_config
from utils import MlaCalls, random_prompt

# whole models, generate and compile: `make test-fast` leaves these to `make test`
pytestmark = pytest.mark.slow

CONFIGS = {"tiny": tiny_config, "lite-attn": lite_attn_config}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MATRIX = [(c, d, a) for c in CONFIGS for d in DTYPES for a in ("eager", "sdpa")]
MATRIX_IDS = ["-".join(m) for m in MATRIX]
ORIGINAL_ATTENTION_FORWARD = hf.DeepseekV2Attention.forward
ORIGINAL_RMSNORM_FORWARD = hf.DeepseekV2RMSNorm.forward


@pytest.mark.parametrize("config_name,dtype_name,attn", MATRIX, ids=MATRIX_IDS)
def test_prefill_logits_bit_identical(config_name, dtype_name, attn):
    config = CONFIGS[config_name]()
    model = build_model(config, DTYPES[dtype_name], attn)
    ids = random_prompt(config, batch=2, length=19)
    with torch.no_grad():
        expected = model(ids).logits
        with mla_ops.patch(model, cache="dense"), MlaCalls() as calls:
            got = model(ids).logits
    assert calls.counts == {"kv_prolog": config.num_hidden_layers}
    assert torch.equal(got, expected)


@pytest.mark.parametrize("config_name,dtype_name,attn", MATRIX, ids=MATRIX_IDS)
def test_decode_logits_16_steps(config_name, dtype_name, attn):
    """bf16: bit-identical. fp32: within 1e-5 — the patch runs kv_b on each new token (a 1-row GEMM)
    while stock re-runs it over the whole latent cache (a T-row GEMM); fp32 GEMMs of different M
    block the reduction differently (last-bit differences, amplified to ~1e-6 in logits).
    In bf16 both GEMMs round the same fp32 sums to the same bf16 values while T <= 36 rows (oneDNN
    switches kernels at 37 rows on this build and then stock's *own* K for an old token changes by an
    ulp as the cache grows), so the prompt + 16 steps stays at 32 tokens."""
    config = CONFIGS[config_name]()
    model = build_model(config, DTYPES[dtype_name], attn)
    ids = random_prompt(config, length=16)
    kwargs = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        expected = model.generate(ids, **kwargs)
        with mla_ops.patch(model, cache="dense"):
            got = model.generate(ids, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for step, (a, b) in enumerate(zip(got.logits, expected.logits)):
        if dtype_name == "bf16":
            assert torch.equal(a, b), f"step {step}"
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=f"step {step}")


@pytest.mark.parametrize("config_name,dtype_name", [(c, d) for c in CONFIGS for d in DTYPES])
def test_greedy_generate_32_tokens_and_padded_batch(config_name, dtype_name):
    config = CONFIGS[config_name]()
    model = build_model(config, DTYPES[dtype_name], "sdpa")
    single = random_prompt(config, length=12)
    # three prompts of different lengths, left-padded like a tokenizer for generation would
    lengths = [12, 5, 9]
    batch = torch.full((3, 12), config.pad_token_id)
    mask = torch.zeros(3, 12, dtype=torch.long)
    for i, n in enumerate(lengths):
        batch[i, 12 - n:] = random_prompt(config, length=n, seed=i + 1)[0]
        mask[i, 12 - n:] = 1
    gen = dict(do_sample=False, pad_token_id=config.pad_token_id)
    with torch.no_grad():
        expected_single = model.generate(single, max_new_tokens=32, min_new_tokens=32, **gen)
        expected_batch = model.generate(batch, attention_mask=mask, max_new_tokens=12, **gen)
        with mla_ops.patch(model, cache="dense"):
            got_single = model.generate(single, max_new_tokens=32, min_new_tokens=32, **gen)
            got_batch = model.generate(batch, attention_mask=mask, max_new_tokens=12, **gen)
    assert got_single.shape[1] == 12 + 32
    assert torch.equal(got_single, expected_single)
    assert torch.equal(got_batch, expected_batch)


# transformers 4.x StaticCache layers are preallocated with config.head_dim; the dense patch caches the
# full key (qk_nope + qk_rope wide), which needs the lazily sized static layers of transformers 5.
STATIC_CACHE_TAKES_FULL_KEYS = pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5,
    reason="transformers 4.x StaticCache is preallocated with config.head_dim, narrower than the dense patch's "
           "full keys; transformers 5 sizes static layers from the first update")


def test_instance_scope_class_scope_and_revert():
    config = tiny_config()
    patched, other = build_model(config), build_model(config)
    ids = random_prompt(config)
    with torch.no_grad():
        expected = other(ids).logits
    handle = mla_ops.patch(patched, cache="dense")
    attn = patched.model.layers[0].self_attn
    assert attn.forward.__func__ is patch.mla_attention_forward
    assert other.model.layers[0].self_attn.forward.__func__ is ORIGINAL_ATTENTION_FORWARD, "other models untouched"
    assert hf.DeepseekV2Attention.forward is ORIGINAL_ATTENTION_FORWARD, "instance patch leaves the class alone"
    second = mla_ops.patch(patched, cache="dense")  # applying again replaces the first patch (newest options win)
    assert not handle.active and patch.active_patches() == [second]
    handle.revert()  # reverting a replaced handle is harmless
    assert attn.forward.__func__ is patch.mla_attention_forward
    second.revert()
    second.revert()  # and so is reverting twice
    patch.revert()
    assert "forward" not in attn.__dict__ and attn.forward.__func__ is ORIGINAL_ATTENTION_FORWARD
    with torch.no_grad():
        assert torch.equal(patched(ids).logits, expected)

    # class level: models built afterwards use the ops
    with mla_ops.patch(rms_norm=True, cache="dense") as class_handle:
        assert hf.DeepseekV2Attention.forward is patch.mla_attention_forward
        assert hf.DeepseekV2RMSNorm.forward is patch.rms_norm_forward
        fresh = build_model(config)
        with torch.no_grad(), MlaCalls() as calls:
            got = fresh(ids).logits
        assert calls.counts["kv_prolog"] == 2 and calls.counts["rms_norm"] == 2 * 2 + 1
        assert torch.equal(got, expected)
        assert class_handle.active
    assert hf.DeepseekV2Attention.forward is ORIGINAL_ATTENTION_FORWARD
    assert hf.DeepseekV2RMSNorm.forward is ORIGINAL_RMSNORM_FORWARD

    # a handle does not keep its model alive, and dies with it
    import gc
    import weakref

    doomed = build_model(config)
    mla_ops.patch(doomed, cache="paged" if patch.releases.current_release().paged else "dense")
    alive = weakref.ref(doomed)
    del doomed
    gc.collect()
    assert alive() is None and patch.active_patches() == []


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_rope_and_rms_norm_options_route_their_ops(dtype_name):
    config = lite_attn_config()
    model = build_model(config, DTYPES[dtype_name], "sdpa")
    ids = random_prompt(config, batch=2, length=7)
    with torch.no_grad():
        expected = model(ids).logits
        with mla_ops.patch(model, kv_prolog=False, rope=True, rms_norm=True, cache="dense"), MlaCalls() as calls:
            got_stock_kv = model(ids).logits
        with mla_ops.patch(model, kv_prolog=True, rope=True, rms_norm=True, cache="dense"), MlaCalls() as calls_all:
            got_all = model(ids).logits
    layers = config.num_hidden_layers
    # without kv_prolog: q_pe and k_pe rotations; every RMSNorm incl. kv_a_layernorm and the final norm
    assert calls.counts == {"rope": 2 * layers, "rms_norm": 3 * layers + 1}
    assert calls_all.counts == {"kv_prolog": layers, "rope": layers, "rms_norm": 2 * layers + 1}
    assert torch.equal(got_stock_kv, expected) and torch.equal(got_all, expected)


def test_fullgraph_compile_of_the_prefill_has_the_ops_as_nodes():
    """On every release (the static-cache decode compile below needs transformers 5): the patched
    forward traces with no graph break and calls the ops as single nodes; compiled == eager."""
    # dense MLPs only: transformers 4.x's DeepSeek-V2 MoE loops over a data-dependent expert count
    config = tiny_config()
    config.first_k_dense_replace = config.num_hidden_layers
    model = build_model(config, torch.float32, "sdpa")
    ids = random_prompt(model.config, length=9)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad(), mla_ops.patch(model, rope=True, rms_norm=True, cache="dense"):
        torch._dynamo.reset()
        eager = model(ids, use_cache=False).logits
        got = torch.compile(model, backend=capture, fullgraph=True)(ids, use_cache=False).logits
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert len(graphs) == 1
    for op in ("mla.kv_prolog", "mla.rope", "mla.rms_norm"):
        assert any(t.startswith(op) for t in targets), (op, sorted(set(targets)))
    assert torch.equal(got, eager)


@STATIC_CACHE_TAKES_FULL_KEYS
def test_static_cache_fullgraph_compile_has_kv_prolog_and_matches_stock():
    config = tiny_config()
    model = build_model(config, torch.float32, "sdpa")
    ids = random_prompt(config, length=8)

    def greedy(step_fn, cache, steps=6):
        tokens, out = ids, []
        pos = torch.arange(ids.shape[1])
        logits = step_fn(tokens, pos, cache)
        for _ in range(steps):
            nxt = logits[:, -1:].argmax(-1)
            out.append(nxt)
            pos = pos[-1:] + 1
            logits = step_fn(nxt, pos, cache)
        return torch.cat(out, 1)

    def step(m):
        return lambda tokens, pos, cache: m(tokens, cache=cache, position_ids=pos[None], use_cache=True).logits

    with torch.no_grad():
        expected = greedy(step(model), StaticCache(config=config, max_cache_len=32))
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        with mla_ops.patch(model, cache="dense"):
            torch._dynamo.reset()
            compiled = torch.compile(model, backend=capture, fullgraph=True)
            got = greedy(step(compiled), StaticCache(config=config, max_cache_len=32))
            decode_cache = StaticCache(config=config, max_cache_len=32)
            step(model)(ids, torch.arange(8), decode_cache)
            explanation = torch._dynamo.explain(model)(ids[:, :1], cache=decode_cache,
                                                       position_ids=torch.tensor([[8]]), use_cache=True)
    targets = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.mla.kv_prolog.default in targets or torch.ops.mla.kv_prolog in targets
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert torch.equal(got, expected)


@STATIC_CACHE_TAKES_FULL_KEYS
def test_generate_with_static_cache_and_compile_config():
    config = tiny_config()
    model = build_model(config, torch.float32, "sdpa")
    ids = random_prompt(config, length=8)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=6, do_sample=False)
        compile_config = CompileConfig(fullgraph=True, dynamic=False)
        compile_config._compile_all_devices = True  # transformers only auto-compiles on CPU when asked to
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        with mla_ops.patch(model, cache="dense"):
            got = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static",
                                 compile_config=compile_config)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "generate did not compile the decode step"
    assert torch.equal(got, expected)


def test_patched_model_still_trains():
    """Gradients of the attention weights match stock: same maths, but the registered backward
    formulas associate the sums differently from autograd through the stock ops, so fp32 agrees to
    rounding (rtol 1e-4 on grads of magnitude ~1e-2, atol 1e-6)."""
    config = tiny_config()
    stock, patched = build_model(config), build_model(config)
    stock.train()
    patched.train()
    ids = random_prompt(config, batch=2, length=10)
    stock(ids, labels=ids).loss.backward()
    with mla_ops.patch(patched, rms_norm=True, rope=True, cache="dense"):
        loss = patched(ids, labels=ids).loss
        loss.backward()
    names = ["q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    for layer_s, layer_p in zip(stock.model.layers, patched.model.layers):
        for name in names:
            g_s = getattr(layer_s.self_attn, name).weight.grad
            g_p = getattr(layer_p.self_attn, name).weight.grad
            torch.testing.assert_close(g_p, g_s, rtol=1e-4, atol=1e-6, msg=name)


def test_version_outside_supported_range_is_refused(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "4.53.0")
    monkeypatch.delenv(patch.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"supports transformers >= 4\.54\.0 .*, < 5\.25\.0 .* found 4\.53\.0"):
        mla_ops.patch(cache="dense")
    monkeypatch.setenv(patch.ALLOW_UNTESTED_ENV, "1")
    mla_ops.patch(cache="dense").revert()


def test_bad_arguments():
    with pytest.raises(ValueError, match="cache must be one of"):
        mla_ops.patch(cache="latent")
    with pytest.raises(ValueError, match="no multi-head latent attention found in Linear"):
        mla_ops.patch(torch.nn.Linear(2, 2), cache="dense")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module .* got str"):
        mla_ops.patch("model", cache="dense")
    with pytest.raises(ValueError, match="no multi-head latent attention found in Linear"):
        mla_ops.patch(torch.nn.Linear(2, 2), kv_prolog=False, rms_norm=True, cache="dense")
    with pytest.raises(ValueError, match="nothing to patch: kv_prolog, q_prolog, rope and rms_norm are all False"):
        mla_ops.patch(kv_prolog=False, cache="dense")
    with pytest.raises(ValueError, match=r"rope_compute_dtype must be one of \('stock', 'float32', 'activation'\) "
                                         r".* got 'bf16'"):
        mla_ops.patch(build_model(tiny_config()), rope_compute_dtype="bf16", cache="dense")
    assert not patch.active_patches()


@pytest.mark.parametrize("rounding", ["stock", "float32", "activation"])
def test_deepseek_v2_rotates_in_fp32_unless_told_otherwise(rounding):
    """transformers' DeepSeek-V2 multiplies complex fp32 (apply_rotary_emb): "stock" is the fp32
    rotation there, so bf16 logits are stock's for "stock" and "float32"; "activation" (rounding every
    step in bf16, as DeepSeek-V3 does) is then not DeepSeek-V2's arithmetic and moves them."""
    config = tiny_config()
    model = build_model(config, torch.bfloat16, "sdpa")
    ids = random_prompt(config, batch=2, length=19)
    with torch.no_grad():
        expected = model(ids).logits
        with mla_ops.patch(model, rope=True, rope_compute_dtype=rounding, cache="dense") as handle:
            got = model(ids).logits
    assert handle.options.rope_compute_dtype == rounding
    assert torch.equal(got, expected) == (rounding != "activation")


def test_patch_is_the_integrations_patch_and_states_each_option_once():
    """`mla_ops.patch` is the integration's one `patch`; its signature shows PatchOptions' fields and
    defaults, and its docstring documents each option once."""
    assert mla_ops.patch is importlib.import_module("mla_ops.integrations.transformers.patch").patch
    fields = dataclasses.fields(patch.PatchOptions)
    parameters = inspect.signature(mla_ops.patch).parameters
    assert list(parameters) == ["model", "family", *(f.name for f in fields)]
    assert all(parameters[f.name].default == f.default for f in fields)
    for name in parameters:
        assert mla_ops.patch.__doc__.count(f"\n        {name}: ") == 1, name


def test_unknown_option_is_refused_by_name():
    model = build_model(tiny_config())
    with pytest.raises(TypeError, match=r"patch\(\) got an unknown option 'cahce' \(did you mean 'cache'\?\); its "
                                        r"options are model, family, kv_prolog, .*rope_compute_dtype"):
        mla_ops.patch(model, cahce="dense")
    with pytest.raises(TypeError, match="rope must be True or False, got 'yes'"):
        mla_ops.patch(model, rope="yes")
    with pytest.raises(ValueError, match="cache='paged' needs kv_prolog=True .* pass cache='dense'"):
        mla_ops.patch(model, kv_prolog=False, rope=True)
    assert not patch.active_patches() and all("forward" not in m.__dict__ for m in model.modules())


def test_deprecated_names_warn_and_still_patch():
    """`mla_ops.patch_deepseek_v2` and `integrations.transformers.apply`: `mla_ops.patch` under its
    former names, with a DeprecationWarning that points at it, keeping their former default cache
    (dense) when none is given."""
    config = tiny_config()
    model = build_model(config)
    ids = random_prompt(config, batch=1, length=7)
    with torch.no_grad():
        expected = model(ids).logits
        for deprecated, name in ((mla_ops.patch_deepseek_v2, "mla_ops.patch_deepseek_v2"),
                                 (patch.apply, "mla_ops.integrations.transformers.apply")):
            with pytest.warns(DeprecationWarning, match=f"{name} is deprecated: use mla_ops.patch"):
                handle = deprecated(model)
            with handle, MlaCalls() as calls:
                got = model(ids).logits
            assert handle.options == patch.PatchOptions(cache="dense") and handle.patched_modules == 2
            assert calls.counts["kv_prolog"] == config.num_hidden_layers
            assert torch.equal(got, expected)
    assert not patch.active_patches()


@pytest.mark.skipif(patch.releases.current_release().paged, reason="this transformers serves cache='paged' "
                    "(tests/test_paged_model.py)")
def test_paged_mode_is_refused_where_the_cache_api_differs():
    """Before 5.4 Cache has another API (a `cache_kwargs` dict, masks sized from a cache_position
    tensor) than the one MLAPagedCache implements: refused, before anything changes."""
    model = build_model(tiny_config(), torch.float32, "sdpa")
    with pytest.raises(NotImplementedError, match=r"cache='paged' needs transformers >= 5\.4\.0 .* Use cache='dense'"):
        mla_ops.patch(model, cache="paged")
    assert not patch.active_patches() and all("forward" not in m.__dict__ for m in model.modules())
