"""The `mla-ops` command line (also `python -m mla_ops`).

    mla-ops ask [--prompt TEXT] [--model-path DIR] [--use_kv_fusion] [--use_acl_graph] ...
    mla-ops bench e2e|ops|decode|npu-sim [--quick] [--json FILE]
    mla-ops info
    mla-ops selftest [--device DEV] [--pypto-sim]
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .runtime import CliError

EPILOG = """examples:
  mla-ops ask                                   # built-in model (docs/builtin-model.md), stock transformers
  mla-ops ask --use_kv_fusion --prompt "Hi"     # KV prolog through torch.ops.mla.kv_prolog
  mla-ops ask --use_kv_fusion --cache paged     # paged latent cache + absorbed decode
  MODEL_PATH=/models/DeepSeek-V2-Lite-Chat mla-ops ask --device 0 --use_kv_fusion --use_acl_graph
  mla-ops bench e2e --quick                     # baseline vs fused table (+ JSON, PNG with matplotlib)
  mla-ops selftest --device 0                   # verify the backends on this machine (paste it in bug reports)
"""


def build_parser() -> argparse.ArgumentParser:
    from . import ask, bench, selftest

    parser = argparse.ArgumentParser(
        prog="mla-ops", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Multi-head latent attention (MLA) kernels as torch.ops.mla: inference and benchmarks.")
    sub = parser.add_subparsers(dest="command", metavar="{ask,bench,info,selftest}")
    sub.required = True
    ask_parser = sub.add_parser("ask", help="answer a prompt with a DeepSeek-V2 model (the original inference "
                                            "script), reporting load/tokenize/generation time, tokens/s, memory",
                                description=ask.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ask.add_arguments(ask_parser)

    bench.add_parser(sub)

    sub.add_parser("info", help="versions, and which backend can serve which op on this machine")
    selftest.add_arguments(sub.add_parser("selftest", help="verify the installed backends on this device: a PASS/FAIL/"
                                                           "SKIP table, non-zero exit status on any FAIL",
                                          description=selftest.__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter))
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "ask":
            from . import ask

            ask.run(args)
        elif args.command == "bench":
            from . import bench

            bench.run(args)
        elif args.command == "info":
            from . import info

            info.run(args)
        elif args.command == "selftest":
            from . import selftest

            return selftest.run(args)
    except CliError as exc:
        print(f"mla-ops: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mla-ops: interrupted", file=sys.stderr)
        return 130
    return 0
