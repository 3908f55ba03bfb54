"""The model patch on DeepSeek-V2's hub remote code (`modeling_deepseek.py`, trust_remote_code=True), through
whole checkpoints saved here the way the hub ships them (tests/hub_deepseek_v2: config.json with auto_map,
the .py files, model.safetensors, a tokenizer) and loaded from disk by transformers 4.x: from_pretrained,
generate with 4.x's DynamicCache, and `mla-ops ask --trust-remote-code`.

The hub code imports transformers 4.x API that 5.x removed, so on 5.x this module is skipped;
`make test-compat` runs it on transformers 4.45."""
import json
import os
import subprocess
import sys

import pytest
import torch

import hub_deepseek_v2 as hub

_MISSING = hub.missing_hub_api()
if _MISSING:
    import transformers

    pytest.skip(f"the hub remote code (modeling_deepseek.py) needs transformers 4.x: {_MISSING} is missing in "
                f"transformers {transformers.__version__}; `make test-compat` runs these tests on transformers 4.45",
                allow_module_level=True)

from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402
from transformers.modeling_attn_mask_utils import _prepare_4d_causal_attention_mask  # noqa: E402

import mla_ops  # noqa: E402
from mla_ops.cli import main  # noqa: E402
from mla_ops.integrations import transformers as patch  # noqa: E402

from utils import MlaCalls  # noqa: E402

# whole models, generate and subprocesses: `make test-fast` leaves these to `make test`
pytestmark = pytest.mark.slow

CHECKPOINTS = {"tiny": hub.TINY, "tiny-q-lora": {**hub.TINY, "q_lora_rank": 48}, "lite-attn": hub.LITE_ATTN}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ENV = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
ENV.pop("MODEL_PATH", None)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> the directory of that hub-style checkpoint (bf16 weights, as V2-Lite's), saved once."""
    saved = {}
    # transformers imports the copied code as transformers_modules.<directory name>, one shared folder for
    # every process: a name per xdist worker keeps two workers from rewriting the same module at once
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")

    def get(name):
        if name not in saved:
            saved[name] = hub.write_checkpoint(tmp_path_factory.mktemp(f"hub-{name}-{worker}-"), CHECKPOINTS[name],
                                               seed=list(CHECKPOINTS).index(name) + 1)
        return saved[name]

    return get


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("MODEL_PATH", raising=False)


def load(directory, dtype=torch.float32):
    """The checkpoint as a user loads it: its own code, from local files only (eager: the hub code's default)."""
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, local_files_only=True,
                                                 torch_dtype=dtype)
    return model.eval()


def attentions(model):
    return [layer.self_attn for layer in model.model.layers]


def prompt_batch(model, batch=2, length=13, seed=0, pad=4):
    """input_ids [batch, length] and a 2-D attention mask whose last row is left-padded by `pad` tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, :pad] = 0
    ids[-1, :pad] = model.config.pad_token_id
    return ids, mask


def assert_stock(model):
    """No patched forward or option is left on any module."""
    for module in model.modules():
        assert "forward" not in module.__dict__ and "_mla_ops_options" not in module.__dict__, type(module).__name__


def test_the_saved_checkpoint_loads_offline_through_its_own_code(checkpoint):
    directory = checkpoint("tiny")
    config = json.loads((directory / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_deepseek.DeepseekV2ForCausalLM"
    assert config["architectures"] == ["DeepseekV2ForCausalLM"] and config["torch_dtype"] == "bfloat16"
    assert {"modeling_deepseek.py", "configuration_deepseek.py", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in directory.iterdir()}
    model = load(directory)
    # transformers ran the copied files (its dynamic-module package), not a class of its own
    assert type(model).__module__.startswith("transformers_modules.") and type(model).__module__.endswith(
        ".modeling_deepseek")
    assert not any(m.startswith("transformers.models.deepseek_v2") for m in sys.modules)
    assert model.config._attn_implementation == "eager"
    for attn in attentions(model):
        assert patch.is_remote_attention(attn) and not patch.is_mla_attention(attn)
    with safe_open(str(directory / "model.safetensors"), framework="pt") as weights:
        saved = weights.get_tensor("model.layers.1.self_attn.kv_b_proj.weight")
    assert torch.equal(model.model.layers[1].self_attn.kv_b_proj.weight, saved.float())
    assert len(AutoTokenizer.from_pretrained(directory, local_files_only=True)) == model.config.vocab_size


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(CHECKPOINTS))
@pytest.mark.parametrize("rope", [False, True], ids=["stock-q-rope", "mla-rope"])
def test_prefill_logits_bit_identical(checkpoint, name, rope, dtype):
    """A left-padded batch through the whole model, in fp32, bf16 (the checkpoint's dtype) and fp16: the
    hub code rotates in the model's dtype from tables cast to it and runs kv_b on every new token, which
    is what mla.kv_prolog(rope_layout="half", rope_compute_dtype="activation") does (the patch reads that
    rounding off the code's apply_rotary_pos_emb), so every layer's hidden states and the logits are
    bit-identical; the ops really ran (counted)."""
    model = load(checkpoint(name), DTYPES[dtype])
    ids, mask = prompt_batch(model)
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, output_hidden_states=True)
        with mla_ops.patch(model, rope=rope, rms_norm=True, cache="dense") as handle, MlaCalls() as calls:
            got = model(ids, attention_mask=mask, output_hidden_states=True)
    norms = 3 * layers + 1 + (layers if model.config.q_lora_rank else 0)  # input, post-attn, kv_a (+ q_a), final
    assert handle.patched_modules == layers + norms
    assert calls.counts["kv_prolog"] == layers and calls.counts.get("rope", 0) == (layers if rope else 0)
    assert calls.counts["rms_norm"] == norms - layers  # kv_a_layernorm runs inside kv_prolog
    for a, b in zip(got.hidden_states, expected.hidden_states):
        assert torch.equal(a, b)
    assert torch.equal(got.logits, expected.logits)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["tiny", "lite-attn"])
def test_greedy_generate_matches_stock_with_the_4x_dynamic_cache(checkpoint, name, dtype):
    """generate() on a left-padded batch of chat prompts: the hub code's prepare_inputs_for_generation,
    4.x's DynamicCache, position_ids from the mask. Same tokens, same per-step scores, and the cache
    holds the same full K [B, N, T, P+R] (k_pe de-interleaved) and V [B, N, T, V] bit for bit — in bf16
    too (like the patch, the hub code runs kv_b on the new tokens only and caches the full K/V)."""
    directory = checkpoint(name)
    model = load(directory, DTYPES[dtype])
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                           tokenize=False) for c in ("hello", "What does the latent cache hold?")]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert (batch.attention_mask == 0).any()  # the short prompt is padded
    new = 8
    # return_legacy_cache=False: 4.45 hands back the DynamicCache it decoded with, not tuples made from it
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, return_dict_in_generate=True,
                  output_scores=True, return_legacy_cache=False)
    with torch.no_grad():
        stock = model.generate(**batch, **kwargs)
        with mla_ops.patch(model, rope=True, cache="dense"), MlaCalls() as calls:
            got = model.generate(**batch, **kwargs)
    layers, prompt = model.config.num_hidden_layers, batch.input_ids.shape[1]
    assert calls.counts["kv_prolog"] == layers * new  # the prefill and every decode step went through mla
    assert torch.equal(got.sequences, stock.sequences)
    for a, b in zip(got.scores, stock.scores):
        assert torch.equal(a, b)
    cache, stock_cache = got.past_key_values, stock.past_key_values
    assert type(cache) is DynamicCache and type(stock_cache) is DynamicCache
    attn = model.model.layers[0].self_attn
    assert cache.key_cache[0].shape == (2, attn.num_heads, prompt + new - 1, attn.q_head_dim)
    for a, b in zip(cache.key_cache + cache.value_cache, stock_cache.key_cache + stock_cache.value_cache):
        assert torch.equal(a, b)


def _teacher_forced(model, ids, prefill):
    """Logits [B, S, vocab] of a prefill of `prefill` tokens, then one cached decode step per remaining
    token, and the final cache. Called without a cache, the hub model returns the legacy per-layer
    (K, V) tuples, which each step turns back into a DynamicCache (from_legacy_cache); positions come
    from the cache's length (no position_ids are passed)."""
    out = model(ids[:, :prefill], use_cache=True)
    cache, logits = out.past_key_values, [out.logits]
    for t in range(prefill, ids.shape[1]):
        out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits)
    return torch.cat(logits, dim=1), cache


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_decode_through_the_legacy_tuple_cache_bit_identical(checkpoint, dtype):
    model = load(checkpoint("tiny-q-lora"), DTYPES[dtype])
    ids = torch.randint(3, model.config.vocab_size, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, expected_cache = _teacher_forced(model, ids, 9)
        with mla_ops.patch(model, rope=True, cache="dense"), MlaCalls() as calls:
            got, cache = _teacher_forced(model, ids, 9)
    assert calls.counts["kv_prolog"] == model.config.num_hidden_layers * 6
    assert isinstance(cache, tuple) and len(cache) == model.config.num_hidden_layers
    assert torch.equal(got, expected)
    for (k, v), (k_ref, v_ref) in zip(cache, expected_cache):
        assert k.shape[2] == 14 and torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_bf16_is_bit_identical_and_the_fp32_rotation_as_accurate_as_stock(checkpoint):
    """bf16 (V2-Lite's attention dims), a prefill then teacher-forced decode steps. By default the patch
    rotates as the hub code does (in bf16 from bf16 tables, each product and sum rounded): every logit
    bit-identical to stock's. With rope_compute_dtype="float32" it rotates in fp32 from the same tables,
    so each rotated value differs by up to an ulp and the MoE router can then pick another expert for a
    token near a tie (a single logit then moves by up to ~0.5, measured). What holds there: against the
    fp32 model with the same weights its bf16 logits are as accurate as stock bf16's (mean abs error
    ratio 0.74-1.14 over 20 seeds on two checkpoints: bound 1.3), and their median distance from stock is
    below one bf16 ulp of the logits (|x| in [2, 4): 2**-6; measured 0.004-0.008 over 4 checkpoints). A
    wrong rotation or cache entry moves the logits by their own size (~1), far outside both bounds."""
    directory = checkpoint("lite-attn")
    reference, model = load(directory, torch.float32), load(directory, torch.bfloat16)
    ids = torch.randint(3, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact, _ = _teacher_forced(reference, ids, 16)
        stock, _ = _teacher_forced(model, ids, 16)
        with mla_ops.patch(model, rope=True, rms_norm=True, cache="dense"):
            same, _ = _teacher_forced(model, ids, 16)
        with mla_ops.patch(model, rope=True, rms_norm=True, rope_compute_dtype="float32", cache="dense"), \
                MlaCalls() as calls:
            got, _ = _teacher_forced(model, ids, 16)
    assert torch.equal(same, stock)
    assert calls.counts["kv_prolog"] == calls.counts["rope"] == model.config.num_hidden_layers * 9
    assert not torch.equal(got, stock)  # the option reached the ops
    stock_error, got_error = (stock - exact).abs().mean(), (got - exact).abs().mean()
    assert got_error <= 1.3 * stock_error, (got_error, stock_error)
    assert (got - stock).abs().median() <= 2 ** -6


def test_the_patched_attention_returns_the_three_tuple_and_its_weights(checkpoint):
    model = load(checkpoint("tiny"))
    ids, mask = prompt_batch(model, length=7)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, output_attentions=True)
        with mla_ops.patch(model, cache="dense"):
            got = model(ids, attention_mask=mask, output_attentions=True)
    assert len(got.attentions) == model.config.num_hidden_layers
    for a, b in zip(got.attentions, expected.attentions):
        assert a.shape == (2, model.config.num_attention_heads, 7, 7) and torch.equal(a, b)

    # one layer on its own, with the 4.x cache object: (out, weights, the same cache), the cache filled
    attn = attentions(model)[0]
    hidden = torch.randn(1, 5, model.config.hidden_size)
    mask4 = _prepare_4d_causal_attention_mask(None, (1, 5), hidden, 0)
    positions = torch.arange(5)[None]
    with torch.no_grad():
        ref_out, ref_weights, _ = attn(hidden, mask4, positions, DynamicCache(), output_attentions=True)
        with mla_ops.patch(model, cache="dense"):
            cache = DynamicCache()
            result = attn(hidden, mask4, positions, cache, output_attentions=True, use_cache=True)
    assert isinstance(result, tuple) and len(result) == 3 and result[2] is cache
    assert cache.get_seq_length(0) == 5
    assert torch.equal(result[0], ref_out) and torch.equal(result[1], ref_weights)


def test_paged_mode_is_refused_clearly(checkpoint):
    model = load(checkpoint("tiny"))
    with pytest.raises(NotImplementedError, match="cache='paged' supports transformers' own MLA attention"):
        mla_ops.patch(model, cache="paged")
    assert_stock(model)
    assert not patch.active_patches()


def test_a_refused_reapply_keeps_the_previous_patch(checkpoint):
    """patch() checks everything before touching the model: a refused re-apply (paged on remote code)
    leaves the earlier dense patch in place, handle and all, and the model still runs through it."""
    model = load(checkpoint("tiny"))
    handle = mla_ops.patch(model, cache="dense")
    with pytest.raises(NotImplementedError, match="cache='paged' supports transformers' own MLA attention"):
        mla_ops.patch(model, cache="paged")
    assert handle.active and patch.active_patches() == [handle]
    assert all(a.forward.__func__ is patch.remote_attention_forward for a in attentions(model))
    ids, mask = prompt_batch(model)
    with torch.no_grad(), MlaCalls() as calls:
        model(ids, attention_mask=mask)
    assert calls.counts["kv_prolog"] == model.config.num_hidden_layers


def test_the_hub_flash_attention_class_is_refused_with_the_fix(checkpoint):
    """The hub code's DeepseekV2FlashAttention2 gets a 2-D padding mask (or None), which the eager
    patched forward would misread: refused, naming the way out. (FlashAttention-2 needs CUDA and
    flash_attn, so the loaded layers are switched to the checkpoint module's own FA2 class.)"""
    model = load(checkpoint("tiny"))
    flash = sys.modules[type(model).__module__].DeepseekV2FlashAttention2
    for attn in attentions(model):
        attn.__class__ = flash
    with pytest.raises(NotImplementedError, match="attn_implementation='eager'"):
        mla_ops.patch(model, cache="dense")
    assert_stock(model)
    assert not patch.active_patches()


def test_rope_without_kv_prolog_is_refused(checkpoint):
    model = load(checkpoint("tiny"))
    with pytest.raises(ValueError, match="use kv_prolog=True"):
        mla_ops.patch(model, kv_prolog=False, rope=True, cache="dense")
    assert_stock(model)


def test_revert_restores_the_stock_forwards(checkpoint):
    model = load(checkpoint("tiny-q-lora"))
    ids, mask = prompt_batch(model)
    classes = {type(m): type(m).forward for m in model.modules()}
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        handle = mla_ops.patch(model, rope=True, rms_norm=True, cache="dense")
        assert all(a.forward.__func__ is patch.remote_attention_forward for a in attentions(model))
        handle.revert()
        assert not handle.active and not patch.active_patches()
        assert_stock(model)
        assert {type(m): type(m).forward for m in model.modules()} == classes  # the classes were never touched
        with MlaCalls() as calls:
            got = model(ids, attention_mask=mask).logits
    assert calls.counts == {} and torch.equal(got, expected)


# --- mla-ops ask on the saved checkpoint --------------------------------------------------------------

def run_cli(*args):
    """`python -m mla_ops ...` in a fresh process, offline: exit code, stdout, stderr."""
    proc = subprocess.run([sys.executable, "-m", "mla_ops", *args], capture_output=True, text=True, env=ENV,
                          timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


def stock_answer(directory, dtype, prompt, tokens):
    """What the unpatched checkpoint answers to `prompt` (chat template, greedy), as ask decodes it."""
    model = load(directory, dtype)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("dtype,flags", [("bfloat16", []), ("float32", ["--dtype", "fp32", "--use_kv_fusion"])],
                         ids=["bf16-auto-baseline", "fp32-kv-fusion"])
def test_ask_runs_the_saved_checkpoint_with_its_remote_code(checkpoint, tmp_path, dtype, flags):
    """The CLI in a fresh process, offline: loads the checkpoint through its own code (its dtype by
    default), and answers what the stock model answers (fp32 for the fused run: bit-identical)."""
    directory = checkpoint("tiny")
    report_file = tmp_path / "report.json"
    code, out, err = run_cli("ask", "--model-path", str(directory), "--trust-remote-code", "--prompt", "hello",
                             "--output_length", "4", "--min-output-length", "4", "--no-stream",
                             "--report-file", str(report_file), *flags)
    assert code == 0, err
    report = json.loads(report_file.read_text())
    assert report["model"] == str(directory) and report["dtype"] == dtype and report["generated_tokens"] == 4
    assert report["options"]["use_kv_fusion"] == ("--use_kv_fusion" in flags)
    # the hub code has no SDPA attention: ask's default --attn sdpa runs its eager one, and says so
    assert any("no sdpa attention; running its eager attention" in note for note in report["notes"])
    assert "routed through torch.ops.mla: kv_prolog" in out if flags else "baseline" in out
    assert report["answer"] == stock_answer(directory, getattr(torch, dtype), "hello", 4)


ASK = ["ask", "--trust-remote-code", "--prompt", "hello", "--output_length", "5", "--min-output-length", "5",
       "--dtype", "fp32", "--no-stream", "--attn", "eager"]
FLAG_SETS = [[], ["--use_kv_fusion"], ["--use_kv_fusion", "--use_rope"], ["--use_kv_fusion", "--use_rope", "--use_pto"],
             ["--use_pto"]]


@pytest.fixture(scope="module")
def baseline_answer(checkpoint, tmp_path_factory):
    report_file = tmp_path_factory.mktemp("baseline") / "base.json"
    assert main([*ASK, "--model-path", str(checkpoint("tiny")), "--report-file", str(report_file)]) == 0
    return json.loads(report_file.read_text())["answer"]


@pytest.mark.parametrize("flags", FLAG_SETS, ids=lambda f: " ".join(f) or "baseline")
def test_ask_every_cpu_flag_on_the_remote_code(checkpoint, baseline_answer, flags, tmp_path, capsys):
    """In-process: each CPU flag set answers the baseline's tokens (fp32) and routes exactly the mla ops
    it names, per layer and forward (1 prefill + 4 decode steps)."""
    report_file = tmp_path / "r.json"
    with MlaCalls() as calls:
        assert main([*ASK, "--model-path", str(checkpoint("tiny")), "--report-file", str(report_file), *flags]) == 0
    layers, forwards = 2, 5
    expected = {}
    if "--use_kv_fusion" in flags:
        expected["kv_prolog"] = layers * forwards
    if "--use_rope" in flags:
        expected["rope"] = layers * forwards  # q_pe: the fused prolog rotates k_pe
    if "--use_pto" in flags:  # input + post-attention norms (+ kv_a unless fused), final norm
        expected["rms_norm"] = ((2 if "--use_kv_fusion" in flags else 3) * layers + 1) * forwards
    assert calls.counts == expected
    report = json.loads(report_file.read_text())
    assert report["generated_tokens"] == 5 and report["answer"] == baseline_answer


@pytest.mark.parametrize("flags,message", [
    (["--use_kv_fusion", "--cache", "paged"], "--cache paged: the checkpoint's remote code"),
    (["--use_rope"], "--use_rope on the checkpoint's remote code needs --use_kv_fusion"),
    (["--use_kv_fusion", "--use_acl_graph"], "--use_acl_graph: graph mode decodes with a static cache"),
], ids=["paged", "rope-alone", "graph"])
def test_ask_refuses_what_the_remote_code_cannot_take_before_loading(checkpoint, flags, message, capsys):
    assert main([*ASK, "--model-path", str(checkpoint("tiny")), *flags]) == 2
    out, err = capsys.readouterr()
    assert message in err and "loading weights" not in out


def test_ask_without_trust_remote_code_names_the_flag(checkpoint, capsys):
    """transformers 4.x has no DeepSeek-V2 of its own: the checkpoint runs only through its code."""
    args = [a for a in ASK if a != "--trust-remote-code"]
    assert main([*args, "--model-path", str(checkpoint("tiny"))]) == 2
    assert "pass --trust-remote-code" in capsys.readouterr().err


def test_ask_builtin_model_needs_native_deepseek_v2(capsys):
    assert main(["ask", "--output_length", "2"]) == 2
    assert "the built-in model (no --model-path / $MODEL_PATH) needs transformers' native DeepSeek-V2" in (
        capsys.readouterr().err)
