"""The `mla-ops` command line (also `python -m mla_ops`).

    mla-ops ask [--prompt TEXT] [--model-path DIR] [--use_kv_fusion] [--use_acl_graph] ...
    mla-ops bench e2e|ops|decode|npu-sim [--quick] [--json FILE]
    mla-ops info
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Optional, Sequence

from .runtime import CliError

EPILOG = """examples:
  mla-ops ask                                   # built-in model (random weights), stock transformers
  mla-ops ask --use_kv_fusion --prompt "Hi"     # KV prolog through torch.ops.mla.kv_prolog
  mla-ops ask --use_kv_fusion --cache paged     # paged latent cache + absorbed decode
  MODEL_PATH=/models/DeepSeek-V2-Lite-Chat mla-ops ask --device 0 --use_kv_fusion --use_acl_graph
  mla-ops bench e2e --quick                     # baseline vs fused table (+ JSON, PNG with matplotlib)
"""


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # argparse names the type in its messages
    return parse


def build_parser() -> argparse.ArgumentParser:
    from . import ask

    parser = argparse.ArgumentParser(
        prog="mla-ops", description="DeepSeek-V2 MLA kernels as torch.ops.mla: inference and benchmarks.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="{ask,bench,info}")
    sub.required = True
    ask_parser = sub.add_parser("ask", help="answer a prompt with a DeepSeek-V2 model (the original inference "
                                            "script), reporting load/tokenize/generation time, tokens/s, memory",
                                description=ask.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ask.add_arguments(ask_parser)

    bench = sub.add_parser("bench", help="benchmarks: e2e baseline vs fused, per-op, long-context decode, "
                                         "simulated NPU kernel time")
    kinds = bench.add_subparsers(dest="kind", metavar="{e2e,ops,decode,npu-sim}")
    kinds.required = True

    e2e = kinds.add_parser("e2e", help="baseline vs fused generation across prompt and output lengths "
                                       "(the original benchmark_bs_comparison.py)")
    e2e.add_argument("--prompt-lengths", type=_int_list, default=[32, 512, 2048], help="default: 32,512,2048")
    e2e.add_argument("--output-lengths", type=_int_list, default=[10, 20, 50, 100], help="default: 10,20,50,100")
    e2e.add_argument("--repeats", type=_int_at_least(1), default=3, help="timed runs per variant and configuration (median)")
    e2e.add_argument("--warmup", type=_int_at_least(0), default=1, help="untimed runs per variant first (default: 1)")
    e2e.add_argument("--fused", default="kv_fusion",
                     help="what the fused variant routes through mla ops: a comma list of kv_fusion, rope, pto "
                          "(default: kv_fusion, the original comparison)")
    e2e.add_argument("--cache", default="dense", choices=["dense", "paged"], help="cache mode of the fused variant")
    e2e.add_argument("--quick", action="store_true",
                     help="prompt lengths 32,512, output lengths 10,20, 2 repeats (a minute on 2 cores)")
    for p in (e2e,):
        p.add_argument("--model-path", default=None, help="local checkpoint (default: the built-in model)")
        p.add_argument("--device", default="cpu")
        p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
        p.add_argument("--plot", default="bench_e2e.png", help="PNG plot path (needs matplotlib; skipped without)")

    ops = kinds.add_parser("ops", help="kv_prolog vs stock vs GEMM floor; gather/scatter GB/s vs copy_; "
                                       "decode attention vs materialised")
    ops.add_argument("--quick", action="store_true", help="fewer sizes and rounds")

    decode = kinds.add_parser("decode", help="per-token decode latency at long contexts: stock vs cache=dense vs "
                                             "cache=paged (lite-attn, bf16), plus the attention step alone")
    decode.add_argument("--contexts", type=_int_list, default=[512, 2048, 4096, 8192],
                        help="context lengths (default: 512,2048,4096,8192)")
    decode.add_argument("--quick", action="store_true", help="contexts 512,2048 and fewer rounds")

    sim = kinds.add_parser("npu-sim", help="simulated Ascend 910B2 AICore time of the PyPTO kernels "
                                           "(pypto's CPU simulator)")
    sim.add_argument("--quick", action="store_true", help="a subset of kernels and shapes")
    sim.add_argument("--record", action="store_true",
                     help="overwrite benchmarks/results/npu_sim.json with this run (the regression baseline)")
    for p in (e2e, ops, decode, sim):
        p.add_argument("--json", dest="json_path", default=None,
                       help=f"write results as JSON here (default: bench_{p.prog.split()[-1].replace('-', '_')}.json)")
        p.add_argument("--threads", type=_int_at_least(1), default=None, help="torch CPU threads (default: torch's choice)")

    sub.add_parser("info", help="versions, and which backend can serve which op on this machine")
    return parser


def _write_json(path: str, payload) -> None:
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"results written to {target}")


def _bench(args) -> None:
    import torch

    from ..bench.timing import format_table

    if args.threads:
        torch.set_num_threads(args.threads)
    json_path = args.json_path or f"bench_{args.kind.replace('-', '_')}.json"
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "command": " ".join(sys.argv)}
    if args.kind == "e2e":
        from ..bench import e2e
        from . import loading
        from .runtime import offline_environment, resolve_device

        offline_environment()
        if args.quick:
            args.prompt_lengths, args.output_lengths, args.repeats = [32, 512], [10, 20], 2
        flags = {f.strip() for f in args.fused.split(",") if f.strip()}
        unknown = flags - {"kv_fusion", "rope", "pto"}
        if unknown or not flags:
            raise CliError(f"--fused {args.fused!r}: choose from kv_fusion, rope, pto")
        if args.cache == "paged" and "kv_fusion" not in flags:
            raise CliError("--cache paged needs kv_fusion in --fused")
        device = resolve_device(args.device)
        loaded = loading.load(args.model_path, args.dtype, device, progress=print)
        for note in loaded.notes:
            print(f"NOTE: {note}")
        fused = {"kv_prolog": "kv_fusion" in flags, "rope": "rope" in flags, "rms_norm": "pto" in flags,
                 "cache": args.cache}
        rows = e2e.measure(loaded.model, loaded.tokenizer, prompt_lengths=args.prompt_lengths,
                           output_lengths=args.output_lengths, repeats=args.repeats, warmup=args.warmup, fused=fused)
        print(f"\nbaseline (stock transformers) vs fused ({', '.join(sorted(flags))}, cache={args.cache}); "
              f"{loaded.source} model, {loaded.dtype}, {device}, {torch.get_num_threads()} threads, "
              f"median of {args.repeats}")
        print(format_table(rows, [("prompt_tokens", "prompt"), ("output_tokens", "output"),
                                  ("baseline_tokens_per_s", "baseline tok/s"), ("fused_tokens_per_s", "fused tok/s"),
                                  ("speedup", "speedup"), ("verdict", "verdict")]))
        meta.update(model=loaded.source, dtype=str(loaded.dtype), device=str(device), fused=fused)
        _write_json(json_path, {"meta": meta, "rows": rows})
        title = (f"baseline vs fused ({', '.join(sorted(flags))}, cache={args.cache}): {loaded.source} model, "
                 f"{str(loaded.dtype).removeprefix('torch.')}, {device}")
        if e2e.plot(rows, args.plot, title):
            print(f"plot written to {args.plot}")
        else:
            print("plot skipped: matplotlib is not installed (pip install 'mla-ops[plot]')")
    elif args.kind == "ops":
        from ..bench import decode, ops, paged_kv_cache

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
        _write_json(json_path, {"meta": meta, "kv_prolog": kv, "paged_kv_cache": paged, "decode_attention": attention})
    elif args.kind == "decode":
        from ..bench import decode

        contexts = [512, 2048] if args.quick else args.contexts
        rounds = 2 if args.quick else 3
        model_rows = decode.measure_model_decode(contexts, rounds=rounds)
        print("\nwhole-model decode, ms per token (lite-attn, bf16): stock transformers vs cache=dense vs "
              "cache=paged")
        print(format_table(model_rows, [("context", "context"), ("variant", "variant"),
                                        ("ms_per_token", "ms/token"), ("stock_over_variant", "stock / this"),
                                        ("cache_bytes_per_token_per_layer", "cache B/token/layer")]))
        attention = decode.measure_attention_step(contexts, rounds=rounds + 2)
        print("\nattention decode step alone, one layer")
        print(format_table(attention, [("context", "context"), ("stock_ms", "stock ms"),
                                       ("absorbed_ms", "absorbed ms"), ("stock_over_absorbed", "stock / absorbed")]))
        meta.update(decode.environment())
        _write_json(json_path, {"meta": meta, "model_decode": model_rows, "attention_step": attention})
    elif args.kind == "npu-sim":
        from ..ops.pypto_sim import unavailable_reason

        reason = unavailable_reason()
        if reason:
            raise CliError(f"bench npu-sim needs pypto's simulator: {reason}")
        from ..ops.pypto import bench as sim_bench

        rows = sim_bench.measure(quick=args.quick)
        print(format_table(rows, [(k, k) for k in ("kernel", "config", "case", "tokens", "dtype", "aicore_us")]))
        record_path = sim_bench.default_record_path()
        regressions = sim_bench.compare_to_record(rows, sim_bench.load_record(record_path))
        for line in regressions:
            print(f"REGRESSION: {line}")
        if args.record:
            sim_bench.record(rows, record_path)
            print(f"recorded to {record_path}")
        _write_json(json_path, {"meta": meta, "rows": rows, "regressions": regressions})


def _info() -> None:
    import platform

    import torch

    from .. import backends
    from .._optional import has_module

    print(f"{'python':<24}{platform.python_version()}")
    print(f"{'torch':<24}{torch.__version__}")
    for module in ("transformers", "pypto", "torch_npu", "torchair", "matplotlib"):
        if has_module(module):
            from importlib.metadata import PackageNotFoundError, version

            try:
                text = version(module.replace("_", "-")) if module != "torch_npu" else version("torch_npu")
            except PackageNotFoundError:
                text = "installed"
        else:
            text = "not installed"
        print(f"{module:<24}{text}")
    print(f"{'backend (MLA_OPS_BACKEND)':<24}{backends.settings.backend}")
    print()
    for name, ops, status in backends.availability_report():
        print(f"{name:<12}{status}")
        print(f"{'':<12}ops: {ops}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "ask":
            from . import ask

            ask.run(args)
        elif args.command == "bench":
            _bench(args)
        elif args.command == "info":
            _info()
    except CliError as exc:
        print(f"mla-ops: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mla-ops: interrupted", file=sys.stderr)
        return 130
    return 0
