"""Every multi-head latent attention family of the installed transformers, patched or refused.

Each family is built from a tiny random config (tests/mla_families.py) and compared with the stock
model: prefill logits bit-identical in fp32, greedy tokens equal (dense, and paged where the model
is MLA in every layer), `torch.compile(fullgraph=True)` with the ops as graph nodes, revert back to
stock. Families the patch must refuse (sparse-attention indexers) are refused with the reason.
"""
import json
import subprocess
import sys

import pytest
import torch

from mla_ops.integrations import transformers as patch
from mla_ops.integrations.transformers import families

import mla_families

pytestmark = pytest.mark.slow

INSTALLED = families.installed_mla_model_types()
# What the patch must conclude from each family's structure (it reads the classes, not this table).
SPARSE = {"axk2", "deepseek_v32", "dots3_note", "glm5_next", "glm_moe_dsa", "hy_v4", "hy_v4_vl", "mistral_large4"}
SUPPORTED = [f for f in INSTALLED if f not in SPARSE]
HYBRID = {"bailing_hybrid", "kimi_linear"}  # linear-attention layers beside the MLA ones: no paged cache
EXPECTED_ROPE = {"deepseek_v2": "interleaved", "deepseek_v3": "half", "axk1": "half", "glm4_moe_lite": "half",
                 "youtu": "half", "mistral4": "half", "bailing_hybrid": "half", "longcat_flash": "half",
                 "minicpm3": "neox", "kimi_linear": None}
PROMPT_LEN, NEW_TOKENS = 12, 6


def _model(family, attn="sdpa", seed=0, **overrides):
    config_path, model_path, kwargs = mla_families.FAMILIES[family]
    kwargs = {**kwargs, **overrides}
    torch.manual_seed(seed)
    config = mla_families.load(config_path)(**kwargs)
    config._attn_implementation = attn
    model = mla_families.load(model_path)(config).to(torch.float32).eval()
    with torch.no_grad():  # non-trivial norm weights, so a skipped or misplaced norm shows
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
    return model


def _prompt(batch=2, seed=1):
    return torch.randint(3, mla_families.VOCAB, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                          min_new_tokens=NEW_TOKENS, pad_token_id=0)


def _forwards(model):
    """The function each module's forward runs (an instance patch shows here, not on the class)."""
    return {name: getattr(m.forward, "__func__", m.forward) for name, m in model.named_modules()}


def test_every_installed_mla_family_has_a_tiny_config():
    missing = sorted(set(INSTALLED) - set(mla_families.FAMILIES))
    assert not missing, f"add tiny configs to tests/mla_families.py for {missing}"
    assert "deepseek_v2" in INSTALLED and "deepseek_v3" in INSTALLED


@pytest.mark.parametrize("family", INSTALLED)
def test_family_is_recognised_by_structure(family):
    described = families.families_of(family)
    assert described, f"{family}: no MLA attention class recognised"
    for fam in described:
        if family in SPARSE:
            assert fam.refused and "sparse attention" in fam.refused, (fam.name, fam.refused)
        else:
            assert fam.refused is None, (fam.name, fam.refused)


def test_a_rope_function_is_checked_by_what_it_computes_not_its_name():
    """HY-V4-VL names its RoPE `apply_rotary_pos_emb` like the rotate_half families, but rotates
    interleaved pairs in place: running it tells them apart (MiniCPM3's is the neox rotation)."""
    import importlib

    if "hy_v4_vl" not in INSTALLED:
        pytest.skip("this transformers has no hy_v4_vl")
    other = importlib.import_module("transformers.models.hy_v4_vl.modeling_hy_v4_vl")
    neox = importlib.import_module("transformers.models.minicpm3.modeling_minicpm3")
    assert "does not compute the neox rotation" in families.rope_function_refusal(other, ["apply_rotary_pos_emb"])
    assert families.rope_function_refusal(neox, ["apply_rotary_pos_emb"]) is None


@pytest.mark.parametrize("family", sorted(SPARSE & set(INSTALLED)))
def test_sparse_attention_families_are_refused_with_the_reason(family):
    model = _model(family, attn="eager")
    with pytest.raises(NotImplementedError, match="sparse attention: an indexer picks the top-k keys"):
        patch.apply(model)
    assert not patch.active_patches()
    assert all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("options", [dict(rope=True, rms_norm=True), dict(q_prolog=True),
                                     dict(kv_prolog=False, rope=True)], ids=["kv_prolog+rope+rms_norm", "q_prolog",
                                                                             "rope-only"])
@pytest.mark.parametrize("family", SUPPORTED)
def test_prefill_logits_bit_identical_fp32(family, options):
    model = _model(family)
    if options.get("q_prolog") and family == "longcat_flash":
        with pytest.raises(ValueError, match="scales q between q_b_proj and RoPE"):
            patch.apply(model, **options)
        return
    ids = _prompt()
    with torch.no_grad():
        expected = model(ids).logits
        with patch.apply(model, **options) as handle:
            got = model(ids).logits
            assert handle.patched_modules >= 1
    assert torch.equal(got, expected)
    described = families.describe(type(next(m for m in model.modules() if families.is_mla_attention(m))))
    assert described.rope_layout(model.config) == EXPECTED_ROPE[family]


@pytest.mark.parametrize("cache", ["dense", "paged"])
@pytest.mark.parametrize("family", SUPPORTED)
def test_greedy_tokens_equal_to_stock(family, cache):
    model = _model(family)
    ids = _prompt()
    if cache == "paged" and family in HYBRID:
        with pytest.raises(NotImplementedError, match="mixes MLA layers with layers of another kind"):
            patch.apply(model, cache="paged")
        return
    with torch.no_grad():
        expected = _greedy(model, ids)
        with patch.apply(model, cache=cache, rope=True):
            got = _greedy(model, ids)
    assert torch.equal(got, expected)


# The stock model itself does not trace whole with fullgraph=True (LongCat-Flash: its MoE loops over
# the experts a data-dependent mask hits): there the patched attention layer is compiled on its own.
ATTENTION_ONLY_COMPILE = {"longcat_flash"}


def _attention_call(model, ids):
    """(first MLA attention module, the keyword arguments the model called it with, cache-free)."""
    attn = next(m for m in model.modules() if families.is_mla_attention(m))
    seen = {}

    def record(module, args, kwargs):
        seen.setdefault("kwargs", kwargs)

    hook = attn.register_forward_pre_hook(record, with_kwargs=True)
    try:
        model(ids, use_cache=False)
    finally:
        hook.remove()
    return attn, seen["kwargs"]


@pytest.mark.parametrize("family", SUPPORTED)
def test_compile_fullgraph_keeps_the_ops_as_nodes(family):
    """The patched forward traces with no graph break (fullgraph=True raises on one); the graph
    calls the prolog op, and the compiled output equals the eager one."""
    model = _model(family)
    ids = _prompt(batch=1)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad(), patch.apply(model, rope=True):
        torch._dynamo.reset()
        if family in ATTENTION_ONLY_COMPILE:
            attn, kwargs = _attention_call(model, ids)
            eager = attn(**kwargs)[0]
            got = torch.compile(attn, backend=capture, fullgraph=True)(**kwargs)[0]
        else:
            eager = model(ids, use_cache=False).logits
            got = torch.compile(model, backend=capture, fullgraph=True)(ids, use_cache=False).logits
    assert len(graphs) == 1
    targets = {str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"}
    assert any("mla.kv_prolog" in t or "mla.latent_kv_prolog" in t for t in targets), sorted(targets)[:20]
    assert torch.equal(got, eager)


@pytest.mark.parametrize("family", SUPPORTED)
def test_revert_restores_the_stock_model(family):
    model = _model(family)
    ids = _prompt()
    stock_forwards = _forwards(model)
    with torch.no_grad():
        expected = model(ids).logits
        handle = patch.apply(model, rope=True, rms_norm=True, cache="dense" if family in HYBRID else "paged")
        assert _forwards(model) != stock_forwards
        model(ids)
        handle.revert()
        got = model(ids).logits
    assert all(not any(k.startswith("_mla_ops") or k == "forward" for k in m.__dict__) for m in model.modules())
    assert _forwards(model) == stock_forwards
    assert torch.equal(got, expected)


def test_deepseek_v3_without_rope_interleave_uses_the_neox_layout():
    model = _model("deepseek_v3", rope_interleave=False)
    ids = _prompt()
    with torch.no_grad():
        expected = model(ids).logits
        expected_tokens = _greedy(model, ids)
        with patch.apply(model, rope=True, q_prolog=True):
            got = model(ids).logits
            got_tokens = _greedy(model, ids)
    assert torch.equal(got, expected) and torch.equal(got_tokens, expected_tokens)


def test_class_level_patch_of_a_family():
    cls = families.families_of("deepseek_v3")[0].attention
    stock = cls.forward
    with patch.apply(family="deepseek_v3", rms_norm=True):
        assert cls.forward is patch.mla_attention_forward
        model = _model("deepseek_v3")
        ids = _prompt()
        with torch.no_grad():
            got = model(ids).logits
    assert cls.forward is stock
    with torch.no_grad():
        assert torch.equal(got, model(ids).logits)
    with pytest.raises(ValueError, match="family='llama': that model has no multi-head latent attention"):
        patch.apply(family="llama")
    with pytest.raises(ValueError, match="no model_type 'nonesuch'"):
        patch.apply(family="nonesuch")
    with pytest.raises(NotImplementedError, match="sparse attention"):
        patch.apply(family="deepseek_v32")


@pytest.mark.parametrize("family", ["deepseek_v3", "minicpm3"])
def test_ask_runs_a_saved_checkpoint_of_the_family(family, tmp_path):
    """`mla-ops ask --model-path` loads a saved family checkpoint offline and answers through the ops,
    with the same tokens as the stock model generates."""
    from mla_ops.cli.loading import builtin_tokenizer

    tokenizer = builtin_tokenizer()
    model = _model(family, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                   bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "mla_ops", "ask", "--model-path", str(tmp_path), "--prompt", "hi",
                           "--output_length", "4", "--min-output-length", "4", "--use_kv_fusion", "--dtype", "fp32",
                           "--report-file", str(report)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert json.loads(report.read_text())["answer"] == tokenizer.decode(expected[0, ids.shape[1]:],
                                                                        skip_special_tokens=True)
