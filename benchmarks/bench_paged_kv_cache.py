"""Gather / scatter of 64k tokens x 576 bf16 (MLA latent + k_pe) vs copy_ of the same bytes.

Run: .venv/bin/python benchmarks/bench_paged_kv_cache.py [--tokens 65536] [--tail 37]
Writes benchmarks/results/paged_kv_cache.json and prints a table. Ratios are medians of per-round
ratios from interleaved rounds in one process (see mla_ops/bench/timing.py).
"""
import argparse
import json
import pathlib
import platform

import torch

from mla_ops.bench.paged_kv_cache import measure
from mla_ops.bench.timing import format_table


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "paged_kv_cache.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for tail in (0, 37):
        for row in measure(tokens=args.tokens, block_size=args.block_size, tail=tail, rounds=args.rounds):
            rows.append({**row, "case": "block-aligned" if tail == 0 else f"last block partial (-{tail})"})
    print(format_table(rows, [("case", "case"), ("variant", "variant"), ("tokens", "tokens"), ("ms", "ms"),
                              ("gb_s", "GB/s"), ("ratio_to_copy", "x copy_ throughput")]))
    meta = {"torch": torch.__version__, "threads": args.threads, "machine": platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    pathlib.Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
