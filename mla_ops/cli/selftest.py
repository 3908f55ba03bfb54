"""`mla-ops selftest [--device DEV]`: verify the installed backends on the device at hand.

Prints one verdict per check (PASS / FAIL / SKIP, with the reason) and exits non-zero on any FAIL:
the first thing to run on a new machine, and what to paste into a bug report.

Every op check compares the op, run on the device through whichever backend serves it there, with
the reference kernel computed on the CPU in fp32 from the same inputs (or, for the paged gather,
with a plain loop over its contract and, on NPU, with torch_npu's own npu_gather_pa_kv_cache called
with identical arguments). On an NPU it also checks the binding of the kernels to PrivateUse1, which
kv_prolog path (fused PyPTO or torch_npu baseline) each token count takes, capture and replay of
kv_prolog in a device graph with new inputs, a short generate in eager and graph mode (equal tokens)
and the host time per call and per decode step. On CPU the op checks run for the CPU backends
(reference; pypto_sim with --pypto-sim, about a second per call).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from .runtime import CliError, resolve_device

TOKEN_COUNTS = (1, 2, 16, 17)          # decode, speculative, the fused limit, the first baseline count
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Normalised max error (max |got - expected| / max |expected|) allowed against the fp32 CPU reference:
# a few ulps of the output dtype over the kv_b GEMM's accumulation (K = 512).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
# DeepSeek-V2-Lite's attention dims (hidden, heads, kv_lora_rank, rope, nope, v)
H, N, L, R, P, V = 2048, 16, 512, 64, 128, 128


@dataclasses.dataclass
class Row:
    check: str
    verdict: str  # PASS | FAIL | SKIP
    detail: str = ""


class Report:
    def __init__(self, say: Callable[[str], None]):
        self.rows: list[Row] = []
        self.say = say

    def add(self, check: str, verdict: str, detail: str = "") -> None:
        self.rows.append(Row(check, verdict, detail))
        self.say(f"{verdict:<5} {check}" + (f"  ({detail})" if detail else ""))

    def run(self, check: str, fn: Callable[[], tuple[str, str]]) -> None:
        """fn() -> (verdict, detail); an exception is a FAIL with its message."""
        try:
            verdict, detail = fn()
        except Exception as exc:  # a check that crashes is a failed check, reported with its cause
            verdict, detail = "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        self.add(check, verdict, detail)

    @property
    def failed(self) -> bool:
        return any(r.verdict == "FAIL" for r in self.rows)

    def table(self) -> str:
        width = max(len(r.check) for r in self.rows)
        lines = [f"{'check':<{width}}  verdict  detail", "-" * (width + 40)]
        lines += [f"{r.check:<{width}}  {r.verdict:<7}  {r.detail}" for r in self.rows]
        counts = {v: sum(r.verdict == v for r in self.rows) for v in ("PASS", "FAIL", "SKIP")}
        lines.append(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
        return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu, an accelerator index (0, 1, ...), npu:N or cuda:N")
    parser.add_argument("--pypto-sim", action="store_true",
                        help="on CPU, also check the pypto_sim backend (the PyPTO kernels in pypto's simulator; "
                             "about a second per call)")
    parser.add_argument("--no-generate", action="store_true",
                        help="skip the eager/graph generate check on an accelerator")


# ------------------------------------------------------------------------------------------ inputs
def prolog_inputs(tokens: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    hidden = rand(1, tokens, H)
    kv_a = rand(L + R, H, scale=H ** -0.5)
    norm_w = (1 + 0.1 * torch.randn(L, generator=g)).to(dtype)
    kv_b = rand(N * (P + V), L, scale=L ** -0.5)
    angles = torch.arange(tokens, dtype=torch.float32)[:, None] * torch.rand(R // 2, generator=g)[None, :]
    return hidden, kv_a, None, norm_w, kv_b, angles.cos()[None], angles.sin()[None]


def prolog_kwargs(layout: str) -> dict:
    return dict(num_heads=N, qk_nope_head_dim=P, v_head_dim=V, eps=1e-6, rope_layout=layout)


def to(args, device):
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def expected_prolog(args, layout):
    """The reference kernel on the CPU in fp32 (the ground truth the device result is judged by)."""
    wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
    return torch.ops.mla.kv_prolog(*wide, **prolog_kwargs(layout))


def normalised_error(got, expected) -> float:
    return max(((g.cpu().float() - e).abs().max() / e.abs().max().clamp_min(1e-6)).item()
               for g, e in zip(got, expected))


def gather_cases():
    """(name, kwargs of gather_pa_kv_cache on CPU, output rows): tail blocks everywhere."""
    g = torch.Generator().manual_seed(1)
    nb, bs = 12, 16
    key_cache = torch.randn(nb, bs, 1, L, generator=g).bfloat16()
    value_cache = torch.randn(nb, bs, 1, R, generator=g).bfloat16()
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11], [10, 4, 6, 8]], dtype=torch.int32)
    lens = [5, 20, 35]                          # partial tail blocks: 5, 4, 3 rows
    plain = torch.tensor(lens, dtype=torch.int32)
    cumsum = torch.tensor([0, 5, 25, 60], dtype=torch.int32)
    offsets = torch.tensor([16, 0, 0], dtype=torch.int32)  # the first sequence starts in its 2nd block
    base = dict(key_cache=key_cache, value_cache=value_cache)
    return [
        ("plain seq_lens", dict(base, block_tables=tables, seq_lens=plain)),
        ("cumsum seq_lens", dict(base, block_tables=tables, seq_lens=cumsum, is_seq_lens_cumsum=True)),
        ("seq_offset", dict(base, block_tables=tables, seq_lens=plain, seq_offset=offsets)),
        ("int64 tables+lens", dict(base, block_tables=tables.long(), seq_lens=plain.long())),
    ], sum(lens)


def gather_oracle(key_cache, value_cache, block_tables, seq_lens, key, value, *, seq_offset=None,
                  is_seq_lens_cumsum=False):
    """The contract (docs/design.md, gather_pa_kv_cache) as a plain loop."""
    lens = seq_lens.tolist()
    bases, counts = (lens[:-1], [b - a for a, b in zip(lens[:-1], lens[1:])]) if is_seq_lens_cumsum else \
        ([sum(lens[:q]) for q in range(len(lens))], lens)
    bs = key_cache.shape[1]
    for q, (base, count) in enumerate(zip(bases, counts)):
        first = (int(seq_offset[q]) if seq_offset is not None else 0) // bs
        for t in range(count):
            block = int(block_tables[q, first + t // bs])
            key[base + t], value[base + t] = key_cache[block, t % bs], value_cache[block, t % bs]


# ------------------------------------------------------------------------------------------ checks
def check_kv_prolog(report: Report, device: torch.device, label: str) -> None:
    from .. import explain

    for dtype_name, dtype in DTYPES.items():
        for layout in ("interleaved", "half"):
            for tokens in TOKEN_COUNTS:
                def one(tokens=tokens, dtype=dtype, layout=layout):
                    args = prolog_inputs(tokens, dtype)
                    dev_args = to(args, device)
                    path = explain("kv_prolog", *dev_args, **prolog_kwargs(layout)).splitlines()
                    served = path[0].split(": ", 1)[1].split(" (")[0]
                    detail_path = next((line.strip()[6:] for line in path if line.strip().startswith("path:")), "")
                    got = torch.ops.mla.kv_prolog(*dev_args, **prolog_kwargs(layout))
                    err = normalised_error(got, expected_prolog(args, layout))
                    verdict = "PASS" if err <= TOLERANCE[dtype] else "FAIL"
                    return verdict, f"{served}{': ' + detail_path if detail_path else ''}; err {err:.1e}"
                report.run(f"kv_prolog {label} T={tokens} {dtype_name} {layout}", one)


def check_gather(report: Report, device: torch.device, label: str, against_torch_npu: bool) -> None:
    cases, rows = gather_cases()
    for name, kwargs in cases:
        def one(kwargs=kwargs):
            key = torch.zeros(rows, 1, L, dtype=torch.bfloat16)
            value = torch.zeros(rows, 1, R, dtype=torch.bfloat16)
            want_k, want_v = key.clone(), value.clone()
            gather_oracle(**kwargs, key=want_k, value=want_v)
            dev = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            got_k, got_v = key.to(device), value.to(device)
            torch.ops.mla.gather_pa_kv_cache(dev.pop("key_cache"), dev.pop("value_cache"), dev.pop("block_tables"),
                                             dev.pop("seq_lens"), got_k, got_v, **dev)
            ok = torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)
            detail = "bit-exact vs the contract" if ok else "differs from the contract"
            if against_torch_npu:
                import torch_npu

                dev = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
                npu_k, npu_v = key.to(device), value.to(device)
                torch_npu.npu_gather_pa_kv_cache(dev.pop("key_cache"), dev.pop("value_cache"), dev.pop("block_tables"),
                                                 dev.pop("seq_lens"), npu_k, npu_v, **dev)
                same = torch.equal(npu_k.cpu(), got_k.cpu()) and torch.equal(npu_v.cpu(), got_v.cpu())
                ok = ok and same
                detail += "; equal to torch_npu.npu_gather_pa_kv_cache" if same else \
                    "; differs from torch_npu.npu_gather_pa_kv_cache"
            return ("PASS" if ok else "FAIL"), detail
        report.run(f"gather_pa_kv_cache {label} {name}", one)


def check_graph_replay(report: Report, device: torch.device) -> None:
    if device.type == "npu":
        make_graph, capture = torch.npu.NPUGraph, torch.npu.graph
    elif device.type == "cuda":
        make_graph, capture = torch.cuda.CUDAGraph, torch.cuda.graph
    else:
        report.add("kv_prolog graph capture + replay", "SKIP", f"no device graphs on {device.type}")
        return

    def one():
        static = to(prolog_inputs(1, torch.bfloat16, seed=2), device)
        kwargs = prolog_kwargs("interleaved")
        torch.ops.mla.kv_prolog(*static, **kwargs)  # compile / warm up outside the capture
        graph = make_graph()
        with capture(graph):
            outputs = torch.ops.mla.kv_prolog(*static, **kwargs)
        fresh = prolog_inputs(1, torch.bfloat16, seed=3)
        for dst, src in zip(static, fresh):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src.to(device))
        graph.replay()
        err = normalised_error(outputs, expected_prolog(fresh, "interleaved"))
        return ("PASS" if err <= TOLERANCE[torch.bfloat16] else "FAIL"), f"new inputs after capture; err {err:.1e}"

    report.run("kv_prolog graph capture + replay", one)


def check_host_time(report: Report, device: torch.device) -> None:
    def one():
        args = to(prolog_inputs(1, torch.bfloat16), device)
        kwargs = prolog_kwargs("interleaved")
        torch.ops.mla.kv_prolog(*args, **kwargs)
        calls = 50
        start = time.perf_counter()
        for _ in range(calls):
            torch.ops.mla.kv_prolog(*args, **kwargs)
        host_us = (time.perf_counter() - start) / calls * 1e6  # launches are asynchronous: host cost
        return "PASS", f"{host_us:.0f} us per kv_prolog call at T=1 (host time, no synchronisation)"

    report.run("host time per kv_prolog call", one)


def check_generate(report: Report, device: torch.device) -> None:
    def one():
        from ..backends import npu
        from ..integrations.transformers import apply
        from .graph import compile_settings
        from .loading import builtin_model

        model, tokenizer = builtin_model(torch.bfloat16, device)
        ids = tokenizer("Hello", return_tensors="pt").input_ids.to(device)
        new = 8
        with apply(model, kv_prolog=True):
            if device.type == "npu":
                npu.warmup(model)
            with torch.no_grad():
                start = time.perf_counter()
                eager = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
                step_ms = (time.perf_counter() - start) / new * 1e3
                settings = compile_settings(device, say=lambda msg: None)
                graph = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                       max_cache_len=ids.shape[1] + new, **settings)
        same = torch.equal(eager.cpu(), graph.cpu())
        return ("PASS" if same else "FAIL"), (f"{new} tokens equal in eager and graph mode; eager {step_ms:.1f} ms "
                                              f"per decode step" if same else "graph mode generated other tokens")

    report.run("generate eager vs graph (built-in model)", one)


def environment(report: Report, device: torch.device) -> None:
    from .. import backends, pypto_runtime
    from .info import package_version

    report.add("versions", "PASS", ", ".join(f"{m} {package_version(m)}" for m in ("torch_npu", "torchair", "pypto",
                                                                              "transformers"))
               + f", torch {torch.__version__}")
    reasons = pypto_runtime.unavailable_reasons()
    report.add("pypto (fused kernels)", "PASS" if not reasons else "SKIP",
               f"pypto {pypto_runtime.installed_pypto_version()}" if not reasons else "; ".join(reasons))
    if device.type != "npu":
        return
    bound = {op: label for op, device_type, label in backends.bound_report() if device_type == "npu"}
    for op in ("kv_prolog", "gather_pa_kv_cache", "gather_pa_kv_cache_functional"):
        label = bound.get(op, "nothing")
        report.add(f"bound on PrivateUse1: {op}", "PASS" if "npu" in label else "FAIL", label)


def run(args) -> int:
    device = resolve_device(args.device)
    if args.pypto_sim and device.type != "cpu":
        raise CliError("--pypto-sim runs the PyPTO kernels on CPU; use it with --device cpu")
    report = Report(lambda msg: print(msg, flush=True))
    print(f"mla-ops selftest on {device}")
    environment(report, device)
    if device.type == "cpu":
        check_kv_prolog(report, device, "reference")
        check_gather(report, device, "reference", against_torch_npu=False)
        if args.pypto_sim:
            from .. import pypto_runtime
            from ..settings import use_backend

            reasons = pypto_runtime.unavailable_reasons()
            if reasons:
                report.add("pypto_sim backend", "SKIP", "; ".join(reasons))
            else:
                with use_backend("pypto_sim"):
                    check_kv_prolog(report, device, "pypto_sim")
                    check_gather(report, device, "pypto_sim", against_torch_npu=False)
        else:
            report.add("pypto_sim backend", "SKIP", "not asked for (--pypto-sim; about a second per call)")
        report.add("graph capture, generate, host time", "SKIP", "accelerator checks; this run is on CPU")
    else:
        label = "npu" if device.type == "npu" else device.type
        check_kv_prolog(report, device, label)
        check_gather(report, device, label, against_torch_npu=device.type == "npu")
        check_graph_replay(report, device)
        check_host_time(report, device)
        if args.no_generate:
            report.add("generate eager vs graph (built-in model)", "SKIP", "--no-generate")
        else:
            check_generate(report, device)
    print()
    print(report.table())
    return 1 if report.failed else 0
