"""Every multi-head latent attention family of the installed transformers, patched or refused.

Each family is built from a tiny random config (tests/mla_families.py) and compared with the stock
model: prefill logits bit-identical in fp32, bf16 and fp16 (dense and paged, the patch rounding RoPE
where the stock forward does), greedy tokens equal (dense, and paged where the model is MLA in every
layer), `torch.compile(fullgraph=True)` with the ops as graph nodes, revert back to stock. Every
comparison also counts the mla ops that ran against what the config says they must be (per MLA layer
and forward), so a path that silently fell back to stock code fails. Families the patch must refuse
(sparse-attention indexers beyond DeepSeek-V3.2's, forwards doing more) are refused with the reason.
The DeepSeek Sparse Attention families the patch serves run every test here too (their top-k through
mla.lightning_indexer in the paged mode, counted); tests/test_sparse_families.py has what is particular to them.
"""
import json
import subprocess
import sys

import pytest
import torch

import mla_ops
from mla_ops.integrations import transformers as patch
from mla_ops.integrations.transformers import families
from mla_ops.testing.suites import GraphCapture

import mla_families
from utils import MlaCalls

pytestmark = pytest.mark.slow

INSTALLED = families.installed_mla_model_types()
# What the patch must conclude from each family's structure (it reads the classes, not this table).
SPARSE = {"axk2", "deepseek_v32", "dots3_note", "glm5_next", "glm_moe_dsa", "hy_v4", "hy_v4_vl", "mistral_large4"}
# DeepSeek-V3.2's forward and indexer (GLM-5: + cross-layer top-k sharing, AXK2: + a gate from the query
# projection, HY-V4: + sinks, a gate, an indexer rotating its trailing dims, GLM-5-Next: a pooled indexer and a
# mask of the top-k alone): all served
SPARSE_SERVED = {"axk2", "deepseek_v32", "dots3_note", "glm5_next", "glm_moe_dsa", "hy_v4", "hy_v4_vl",
                 "mistral_large4"}
SUPPORTED = [f for f in INSTALLED if f not in SPARSE or f in SPARSE_SERVED]
# GLM-5-Next's indexer pools its keys over blocks of tokens ("KeyPool"): its own forward selects in both modes
POOLED_INDEXER = {"glm5_next"}
EXPECTED_ROPE = {"deepseek_v2": "interleaved", "deepseek_v3": "half", "axk1": "half", "glm4_moe_lite": "half",
                 "youtu": "half", "mistral4": "half", "bailing_hybrid": "half", "longcat_flash": "half",
                 "minicpm3": "neox", "kimi_linear": None, "deepseek_v32": "half", "glm_moe_dsa": "half",
                 "sarvam_mla": "half", "kimi_k25": "half", "axk2": "half", "mistral_large4": "half",
                 "dots3_note": "half", "hy_v4": "neox", "hy_v4_vl": "interleaved", "glm5_next": None}
# Where each stock forward rounds its RoPE: DeepSeek-V2 multiplies complex fp32, HY-V4-VL rotates in fp32; the
# families on DeepSeek-V3's forward rotate in the model's dtype; Kimi-Linear has none (NoPE: nothing to round).
EXPECTED_ROUNDING = {f: "activation" for f in EXPECTED_ROPE} | {"deepseek_v2": "float32", "kimi_linear": "float32",
                                                                "hy_v4_vl": "float32", "glm5_next": "float32"}
# The roundings the ops are asked for in a half-precision model with "stock": the family's, and fp32 in dots3_note's
# indexed layers, whose rotary tables its model makes in fp32 (the stock formula then promotes to fp32).
STOCK_ROUNDINGS = {f: {rounding} for f, rounding in EXPECTED_ROUNDING.items()}
STOCK_ROUNDINGS["dots3_note"] = {"activation", "float32"}
# LongCat-Flash scales the latent between kv_a_layernorm and kv_b_proj, Mistral-Large-4 caches the latent (its
# layers share it): the latent prolog, then kv_b.
LATENT_PROLOG = {"longcat_flash", "mistral_large4"}
# Mistral-Large-4's layers share one latent KV cache, which the patch computes with the prolog op only.
NO_ROPE_ONLY = {"mistral_large4": "share one latent KV cache"}
# What mla.q_prolog does not compute, refused with q_prolog=True: LongCat-Flash scales q between q_b_proj and
# RoPE; AXK2 projects its query and output gate together from cat(q_resid, q_a).
NO_Q_PROLOG = {"longcat_flash": "scales q between q_b_proj and RoPE", "axk2": "projects its query and output gate",
               "dots3_note": "scales the normed q latent"}
# dots3_note normalises k_pe before its RoPE: its KV path is kv_a_proj_with_mqa, mla.rms_norm on the latent and on
# k_pe, and mla.rope on k_pe (no prolog op).
KEY_ROPE_NORM = {"dots3_note"}
# GLM-5-Next's layers have no rotary dims (the prolog ops need some): kv_a_proj_with_mqa, mla.rms_norm, kv_b.
ROPELESS = {"glm5_next"}


def kv_path_op(family) -> str:
    """The op a graph of the family's dense-mode KV path holds (its prolog op, or mla.rms_norm without one)."""
    return "mla.rms_norm" if family in KEY_ROPE_NORM | ROPELESS else "mla.latent_kv_prolog" \
        if family in LATENT_PROLOG else "mla.kv_prolog"
PROMPT_LEN, NEW_TOKENS = 12, 6
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Prefill option sets (the paged cache is refused for the hybrids: see test_greedy_tokens_equal_to_stock).
PREFILL_OPTIONS = {"kv_prolog": dict(cache="dense"),  # q_pe through the family's own RoPE function
                   "kv_prolog+rope+rms_norm": dict(rope=True, rms_norm=True, cache="dense"),
                   "q_prolog": dict(q_prolog=True, cache="dense"),
                   "rope-only": dict(kv_prolog=False, rope=True, cache="dense"),
                   "paged": dict(rope=True, cache="paged")}


def _model(family, attn="sdpa", seed=0, dtype=torch.float32, **overrides):
    config_path, model_path, kwargs = mla_families.FAMILIES[family]
    if "text_config" in kwargs:  # a multimodal wrapper: the overrides are its language model's
        kwargs = {**kwargs, "text_config": {**kwargs["text_config"], **overrides}}
    else:
        kwargs = {**kwargs, **overrides}
    torch.manual_seed(seed)
    config = mla_families.load(config_path)(**kwargs)
    model_class = mla_families.load(model_path)
    if attn == "sdpa" and not model_class._supports_sdpa:  # (HY-V4, GLM-5-Next: their sparse attention is eager's)
        attn = "eager"
    config._attn_implementation = attn
    model = model_class(config).to(torch.float32).eval()
    with torch.no_grad():  # non-trivial norm weights and query scales, so a skipped or misplaced one shows
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif name.endswith("softmax_scaling.scale"):  # Mistral-Large-4's log-position query scales
                param.normal_(0.0, 0.3)
            elif name.endswith("softmax_scaling.bias"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif name.endswith("self_attn.sinks"):  # HY-V4's sink logits, O(1) against O(1) scores
                param.normal_(0.0, 1.5)
        if getattr(config.get_text_config(), "index_topk", None):
            # The pad token's embedding is zero (padding_idx), so a generated pad token's first indexer
            # query is zero and all its scores tie: which tied keys torch.topk keeps is unspecified.
            embedding = model.get_input_embeddings()
            embedding.weight[embedding.padding_idx].normal_()
    return model.to(dtype)


def _rms_norms(model) -> int:
    """The RMSNorm modules of the decoder (a multimodal wrapper's language model: its vision tower does not run
    on text) that mla.rms_norm computes (AXK2's gated RMSNorm around one is not one)."""
    from mla_ops.integrations.transformers.generation import decoder_stacks

    return sum(type(m).__name__.endswith("RMSNorm") and families.norm_refusal(m) is None
               for m in decoder_stacks(model)[0].modules())


def expected_calls(family, model, options, forwards=1, decode_steps=0):
    """The mla op calls a patched model must make: {op: count} for `forwards` forwards of which the last
    `decode_steps` are paged decode steps, from the config (MLA layers, RoPE or NoPE) and the options,
    never from a run. Per MLA layer and forward:

    * dense: kv_prolog (latent_kv_prolog + the layer's kv_b for LongCat-Flash and Mistral-Large-4), unless
      kv_prolog=False; a layer sharing an earlier layer's latent KV computes none, a layer owning one without
      rotary dims computes it with mla.rms_norm (Mistral-Large-4's NoPE layers);
      q_prolog with q_prolog=True, else mla.rope on q_pe with rope=True (and on k_pe without
      kv_prolog); NoPE rotates nothing;
    * paged: latent_kv_prolog (or mla.rms_norm, as above) and scatter_pa_kv_cache in every layer owning its
      latent KV every forward, q_pe through mla.rope in every layer with RoPE, and
      mla_decode_attention in every decode step (never a dense kv_prolog, never the stock cache);
    * rms_norm=True: every RMSNorm module of the model once, except kv_a_layernorm (inside the prolog);
    * sparse attention, paged mode: lightning_indexer in every layer with its own indexer (not the "shared"
      ones of config.indexer_types), which also writes its keys with scatter_pa_cache; the paged decode
      attends with sparse_mla_attention instead of mla_decode_attention. Dense mode selects with the
      stock indexer (no op call: its torch.topk choice among tied scores is stock's only that way), as the paged
      mode's pooled indexer (GLM-5-Next: its forward over the paged rows, their keys written by scatter_pa_cache); a
      sliding-window layer (dots3_note) decodes with mla_decode_attention's sliding_window.
    """
    config = model.config
    layers, owners = mla_families.mla_layers(config), mla_families.latent_kv_owners(config)
    ropeless_owners = mla_families.ropeless_kv_owners(config)  # (their latent through mla.rms_norm)
    rotating = mla_families.rope_layers(config) if EXPECTED_ROPE[family] is not None else 0
    indexed = mla_families.indexer_layers(config)
    # (a pooled indexer, GLM-5-Next's, selects with its own forward over the paged rows: no indexer op)
    sparse = {"lightning_indexer": indexed} if indexed and family not in POOLED_INDEXER else {}
    kv_norms = {"rms_norm": ropeless_owners} if ropeless_owners else {}
    prolog_layers = owners - ropeless_owners
    if family in KEY_ROPE_NORM:  # rms_norm on the latent and k_pe, rope on k_pe in place of the prolog op
        kv_norms, prolog_layers = {"rms_norm": 2 * owners}, 0
    k_rope = rotating if family in KEY_ROPE_NORM else 0
    per_forward = {}
    if options.get("cache") == "paged":
        scatter = {"scatter_pa_cache": indexed} if indexed else {}
        per_forward = {"latent_kv_prolog": prolog_layers, "scatter_pa_kv_cache": owners, "rope": rotating + k_rope,
                       **kv_norms, **sparse, **scatter}
        calls = {op: n * forwards for op, n in per_forward.items() if n}
        # the layers attending to a top-k decode with the sparse op, the others (sliding-window ones: the op's
        # sliding_window) with the decode op
        sparse_layers = mla_families.sparse_layers(config)
        decode = {"sparse_mla_attention": sparse_layers, "mla_decode_attention": layers - sparse_layers}
        return {**calls, **{op: n * decode_steps for op, n in decode.items() if n}} if decode_steps else calls
    kv_prolog = options.get("kv_prolog", True)
    if kv_prolog:
        per_forward["latent_kv_prolog" if family in LATENT_PROLOG else "kv_prolog"] = prolog_layers
        per_forward.update(kv_norms)
        per_forward["rope"] = k_rope
    if options.get("q_prolog"):
        per_forward["q_prolog"] = layers
    elif options.get("rope"):
        per_forward["rope"] = per_forward.get("rope", 0) + rotating * (1 if kv_prolog else 2)
    if options.get("rms_norm"):  # every RMSNorm module but the KV path's (computed there)
        kv_path_norms = owners * (2 if family in KEY_ROPE_NORM else 1)
        per_forward["rms_norm"] = per_forward.get("rms_norm", 0) + _rms_norms(model) - kv_path_norms
    return {op: n * forwards for op, n in per_forward.items() if n}


def _prompt(batch=2, seed=1):
    return torch.randint(3, mla_families.VOCAB, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids, **extra):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                          min_new_tokens=NEW_TOKENS, pad_token_id=0, **extra)


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
        if family in SPARSE and family not in SPARSE_SERVED:
            assert fam.refused and fam.refused.startswith("sparse attention: "), (fam.name, fam.refused)
        else:
            assert fam.refused is None, (fam.name, fam.refused)
        assert fam.sparse == (family in SPARSE_SERVED), fam.name


@pytest.mark.parametrize("family", SUPPORTED)
def test_the_rounding_of_each_familys_rope_is_read_off_its_function(family):
    """Which rope_compute_dtype reproduces the stock RoPE, found by running the family's RoPE function in
    bf16 and fp16; DeepSeek-V3 rounds the same for either of its two functions (the config's choice)."""
    config = _model(family).config.get_text_config(decoder=True)
    fam = families.families_of(family)[0]
    assert fam.stock_rope_compute_dtype(config) == EXPECTED_ROUNDING[family]
    if fam.rope == "config":
        config.rope_interleave = not config.rope_interleave
        assert fam.stock_rope_compute_dtype(config) == EXPECTED_ROUNDING[family]
    assert set(dict(fam.rope_rounding).values()) <= {EXPECTED_ROUNDING[family]}


def test_a_rope_function_no_rounding_reproduces_is_told_apart():
    """A rotation rounding elsewhere (here: step by step in the other half type, fp16 for bf16 inputs and
    bf16 for fp16 ones) matches neither compute dtype, so such a family keeps the fp32 rotation; the
    layouts' own stock functions do match."""
    from mla_ops.ops.rope import rope_math

    def other_half_type(x, cos, sin):
        other = torch.float16 if x.dtype == torch.bfloat16 else torch.bfloat16
        return rope_math(x.to(other), cos.to(other), sin.to(other), "half", "activation").to(x.dtype)

    assert families.matching_rope_compute_dtype(other_half_type, "half") is None
    v3 = families.families_of("deepseek_v3")[0].modeling
    assert families.stock_rope_rounding(v3, "apply_rotary_pos_emb_interleave") == "activation"
    assert families.stock_rope_rounding(families.families_of("deepseek_v2")[0].modeling,
                                        "apply_rotary_emb") == "float32"


def test_a_rope_function_is_read_by_what_it_computes_not_its_name():
    """HY-V4-VL names its RoPE `apply_rotary_pos_emb` like the rotate_half families, but rotates
    interleaved pairs in place: running it tells them apart (MiniCPM3's is the neox rotation); a function
    computing none of mla.rope's rotations reads as None, and its family is refused naming it."""
    import importlib
    import types

    if "hy_v4_vl" not in INSTALLED:
        pytest.skip("this transformers has no hy_v4_vl")
    interleaved = importlib.import_module("transformers.models.hy_v4_vl.modeling_hy_v4_vl")
    neox = importlib.import_module("transformers.models.minicpm3.modeling_minicpm3")
    assert families.rope_function_layout(interleaved, "apply_rotary_pos_emb") == "interleaved"
    assert families.rope_function_layout(neox, "apply_rotary_pos_emb") == "neox"
    doubled = types.ModuleType("doubled")  # a module whose "RoPE" scales instead of rotating
    doubled.apply_rotary_pos_emb = lambda q, k, cos, sin, unsqueeze_dim=1: (2 * q, 2 * k)
    assert families.rope_function_layout(doubled, "apply_rotary_pos_emb") is None


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("options", list(PREFILL_OPTIONS))
@pytest.mark.parametrize("family", SUPPORTED)
def test_prefill_logits_bit_identical(family, options, dtype):
    """One prefill forward, every dtype: the patch asks the ops to round RoPE where the stock forward does
    (EXPECTED_ROUNDING), and every other step is stock's own arithmetic, so the logits are bit-identical
    in bf16 and fp16 too — the paged prefill included (latent prolog, scatter, kv_b over the new tokens)."""
    model = _model(family, dtype=DTYPES[dtype])
    options = PREFILL_OPTIONS[options]
    if options.get("q_prolog") and family in NO_Q_PROLOG:
        with pytest.raises(ValueError, match=NO_Q_PROLOG[family]):
            mla_ops.patch(model, **options)
        return
    if options.get("kv_prolog") is False and family in NO_ROPE_ONLY:
        with pytest.raises(ValueError, match=NO_ROPE_ONLY[family]):
            mla_ops.patch(model, **options)
        return
    ids = _prompt()
    with torch.no_grad():
        expected = model(ids).logits
        with mla_ops.patch(model, **options) as handle, MlaCalls() as calls:
            got = model(ids).logits
            assert handle.patched_modules >= 1
    assert calls.counts == expected_calls(family, model, options)
    assert torch.equal(got, expected)
    described = families.describe(type(next(m for m in model.modules() if families.is_mla_attention(m))))
    assert described.rope_layout(model.config.get_text_config(decoder=True)) == EXPECTED_ROPE[family]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("cache", ["dense", "paged"])
@pytest.mark.parametrize("family", SUPPORTED)
def test_greedy_tokens_equal_to_stock(family, cache, dtype):
    """generate(): a prefill and NEW_TOKENS - 1 decode steps. Same tokens; the prefill's logits
    bit-identical. Dense bf16: every step's logits bit-identical as well (kv_b of the new token alone
    rounds like stock's kv_b over the whole latent cache while it holds <= 36 tokens: see
    tests/test_model_patch.py). The paged decode is absorbed (q_nope @ W_UK against the latent), which
    rounds elsewhere than stock: bf16 checks its prefill logits and first token only (its decode bounds
    are tests/test_paged_model.py's)."""
    model = _model(family, dtype=DTYPES[dtype])
    ids = _prompt()
    options = dict(cache=cache, rope=True)
    with torch.no_grad():
        expected = _greedy(model, ids, output_logits=True, return_dict_in_generate=True)
        with mla_ops.patch(model, **options), MlaCalls() as calls:
            got = _greedy(model, ids, output_logits=True, return_dict_in_generate=True)
    decode_steps = NEW_TOKENS - 1
    assert calls.counts == expected_calls(family, model, options, forwards=NEW_TOKENS,
                                          decode_steps=decode_steps if cache == "paged" else 0)
    assert torch.equal(got.logits[0], expected.logits[0])
    if cache == "paged" and dtype == "bf16":
        assert torch.equal(got.sequences[:, :PROMPT_LEN + 1], expected.sequences[:, :PROMPT_LEN + 1])
        return
    assert torch.equal(got.sequences, expected.sequences)
    if cache == "dense" and dtype == "bf16":
        for step, (a, b) in enumerate(zip(got.logits, expected.logits)):
            assert torch.equal(a, b), f"step {step}"


class MlaRoundings(MlaCalls):
    """MlaCalls that also records, per call, the RoPE rounding a rotating mla op was asked for."""

    def __init__(self):
        super().__init__()
        self.roundings = []  # (op, compute dtype) per call, the schema default where none was passed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "mla" and name in ("rope", "kv_prolog", "latent_kv_prolog", "q_prolog"):
            kwargs_ = kwargs or {}
            self.roundings.append((name, kwargs_.get("compute_dtype", kwargs_.get("rope_compute_dtype", "float32"))))
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.parametrize("family", SUPPORTED)
def test_the_fp32_rotation_is_an_option(family):
    """bf16: by default every rotating op rounds as the family's stock RoPE does; rope_compute_dtype="float32"
    reaches every one of them, and then the logits of the families that round in bf16 move off stock's
    (the fp32 rotation is the more accurate one, not the stock one)."""
    model = _model(family, dtype=torch.bfloat16)
    ids = _prompt()
    with torch.no_grad():
        expected = model(ids).logits
        for rounding in ("stock", "float32"):
            with mla_ops.patch(model, rope=True, q_prolog=family not in NO_Q_PROLOG,
                               rope_compute_dtype=rounding, cache="dense"), MlaRoundings() as calls:
                got = model(ids).logits
            wanted = STOCK_ROUNDINGS[family] if rounding == "stock" else {"float32"}
            assert calls.roundings and {d for _, d in calls.roundings} == wanted, calls.roundings
            if rounding == "float32" and model.config._attn_implementation == "eager":
                continue  # (eager rounds its bf16 scores, which can absorb the last bit of q_pe: HY-V4's)
            assert torch.equal(got, expected) == (rounding == "stock" or EXPECTED_ROUNDING[family] == "float32")


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
    capture = GraphCapture()
    with torch.no_grad(), mla_ops.patch(model, rope=True, cache="dense"):
        torch._dynamo.reset()
        if family in ATTENTION_ONLY_COMPILE:
            attn, kwargs = _attention_call(model, ids)
            eager = attn(**kwargs)[0]
            got = torch.compile(attn, backend=capture, fullgraph=True)(**kwargs)[0]
        else:
            eager = model(ids, use_cache=False).logits
            got = torch.compile(model, backend=capture, fullgraph=True)(ids, use_cache=False).logits
    assert len(capture.graphs) == 1
    targets = capture.call_targets()
    assert any(kv_path_op(family) in t for t in targets), sorted(targets)[:20]
    assert torch.equal(got, eager)


@pytest.mark.parametrize("family", SUPPORTED)
def test_revert_restores_the_stock_model(family):
    model = _model(family)
    ids = _prompt()
    stock_forwards = _forwards(model)
    with torch.no_grad():
        expected = model(ids).logits
        handle = mla_ops.patch(model, rope=True, rms_norm=True, cache="paged")
        assert _forwards(model) != stock_forwards
        model(ids)
        handle.revert()
        got = model(ids).logits
    assert all(not any(k.startswith("_mla_ops") or k == "forward" for k in m.__dict__) for m in model.modules())
    assert _forwards(model) == stock_forwards
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_deepseek_v3_without_rope_interleave_uses_the_neox_layout(dtype):
    model = _model("deepseek_v3", rope_interleave=False, dtype=DTYPES[dtype])
    ids = _prompt()
    with torch.no_grad():
        expected = model(ids).logits
        expected_tokens = _greedy(model, ids)
        with mla_ops.patch(model, rope=True, q_prolog=True, cache="dense"):
            got = model(ids).logits
            got_tokens = _greedy(model, ids)
    assert torch.equal(got, expected) and torch.equal(got_tokens, expected_tokens)


def test_class_level_patch_of_a_family():
    cls = families.families_of("deepseek_v3")[0].attention
    stock = cls.forward
    with mla_ops.patch(family="deepseek_v3", rms_norm=True, cache="dense"):
        assert cls.forward is patch.mla_attention_forward
        model = _model("deepseek_v3")
        ids = _prompt()
        with torch.no_grad():
            got = model(ids).logits
    assert cls.forward is stock
    with torch.no_grad():
        assert torch.equal(got, model(ids).logits)
    with pytest.raises(ValueError, match="family='llama': that model has no multi-head latent attention"):
        mla_ops.patch(family="llama", cache="dense")
    with pytest.raises(ValueError, match="no model_type 'nonesuch'"):
        mla_ops.patch(family="nonesuch", cache="dense")


@pytest.mark.parametrize("family", ["deepseek_v3", "minicpm3", "deepseek_v32", "glm_moe_dsa"])
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


# Each family's sigmoid output gate as its forward computes it: where g comes from and where it rounds.
OUTPUT_GATES = {"bailing_hybrid": ("g_proj", "gate_float32"), "axk2": ("q_gate_proj", "product_float32"),
                "hy_v4": ("gate_proj", "activation"), "dots3_note": ("g_proj", "activation")}


@pytest.mark.parametrize("family", sorted(OUTPUT_GATES))
def test_output_gates_are_read_off_the_forward(family):
    (described,) = families.families_of(family)
    assert (described.output_gate.module, described.output_gate.rounding) == OUTPUT_GATES[family]
    assert described.output_gate.from_query == (family == "axk2")


@pytest.mark.parametrize("family", ["axk2", "bailing_hybrid"])
def test_the_output_gates_rounding_decides_bf16_logits(family):
    """bf16: the gate rounded where the stock forward rounds gives stock's logits bit for bit; the same patch with
    the product rounded elsewhere does not (so the rounding read off the forward is the one that matters). A bf16
    sigmoid is the fp32 sigmoid rounded once, so "activation" and "gate_float32" differ only where the gate's
    input is wider than the model's dtype; the product's rounding is what tells them from "product_float32"."""
    import dataclasses

    model = _model(family, dtype=torch.bfloat16)
    ids = _prompt()
    with torch.no_grad():
        expected = model(ids).logits
        with mla_ops.patch(model, rope=True, cache="dense"):
            layers = [m for m in model.modules() if families.is_mla_attention(m)]
            stock_patch = layers[0]._mla_ops_patch
            assert torch.equal(model(ids).logits, expected)
            stock_rounding = stock_patch.family.output_gate.rounding
            others = {"activation", "gate_float32"} if stock_rounding == "product_float32" else {"product_float32"}
            for rounding in others:
                gate = dataclasses.replace(stock_patch.family.output_gate, rounding=rounding)
                other = dataclasses.replace(stock_patch, family=dataclasses.replace(stock_patch.family,
                                                                                    output_gate=gate))
                for layer in layers:
                    layer.__dict__["_mla_ops_patch"] = other
                assert not torch.equal(model(ids).logits, expected), rounding
            for layer in layers:
                layer.__dict__["_mla_ops_patch"] = stock_patch
