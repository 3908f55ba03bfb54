"""`mla-ops selftest [--device DEV]`: verify every op on the device at hand, from the case database.

Prints one row per check and exits non-zero on any FAIL: the first thing to run on a new machine, and
what to paste into a bug report. Verdicts: PASS / FAIL / SKIP (with the reason), and INFO for a fact
or a measurement (versions, host time), which is reported, never judged.

Every op row runs one of the op's selftest samples (`mla_ops.testing.cases`, DeepSeek-V2-Lite's dims)
on the device through whichever backend serves it there — named in the row, with the kernel's own
path where it has one — and compares the result with the reference kernel run on the CPU (the same
inputs and dtype) and with the op's oracle (the contract in float64): the kernel must be within its
rounding bound of the oracle, and within the two kernels' bounds of the reference; ops that only move
data must be bit-exact. On an NPU it also checks that the npu backend serves every op it declares there, which
kv_prolog path (fused PyPTO or torch_npu baseline) each token count takes, the paged gather against
torch_npu's own npu_gather_pa_kv_cache, capture and replay in a device graph with new inputs (kv_prolog,
and on an NPU the decode attention, both cache scatters and both other prologs), and a short generate in
eager and graph mode (equal tokens). On CPU, `--pypto-sim` adds the
rows of the pypto_sim backend (the PyPTO kernels in pypto's simulator, about a second per call).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import torch

from .runtime import CliError, resolve_device

SELFTEST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOKEN_COUNTS = (1, 2, 16, 17)  # decode, speculative, the fused limit, the first baseline count
VERDICTS = ("PASS", "FAIL", "SKIP", "INFO")


@dataclasses.dataclass
class Row:
    check: str
    verdict: str  # one of VERDICTS
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
        counts = {v: sum(r.verdict == v for r in self.rows) for v in VERDICTS}
        lines.append(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped, "
                     f"{counts['INFO']} reported")
        return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu, an accelerator index (0, 1, ...), npu:N or cuda:N")
    parser.add_argument("--pypto-sim", action="store_true",
                        help="on CPU, also check the pypto_sim backend (the PyPTO kernels in pypto's simulator; "
                             "about a second per call)")
    parser.add_argument("--no-generate", action="store_true",
                        help="skip the eager/graph generate check on an accelerator")


# ------------------------------------------------------------------------------------------ op rows
def serving_backend(op: str, sample) -> str:
    """The backend (and its kernel's own path, where it has one) that serves this call now."""
    from .. import backends

    backend, _ = backends.choose(op, *sample.args, **sample.kwargs)
    kernel = backend.kernels.get(op)
    path = kernel.path(*sample.args, **sample.kwargs) if kernel is not None and kernel.path else ""
    return backend.name + (f" ({path})" if path else "")


def compare_with_reference(op: str, sample, dtype: torch.dtype, device: torch.device,
                           extra: Optional[Callable] = None) -> tuple[str, str]:
    """Run `sample` on `device`; judge it against the oracle and the reference kernel on the CPU.

    `extra(device_sample, outputs) -> (ok, words)`: a further comparison (torch_npu's own op)."""
    from ..testing import suites
    from ..testing.cases import CASES

    cases = CASES[op]
    dev_sample = sample.to(device)
    served = serving_backend(op, dev_sample)
    got = tuple(t.cpu() for t in suites.call(op, dev_sample))
    reference = suites.backend_variant("reference").run(op, sample)
    want = cases.oracle(*sample.args, **sample.kwargs)
    backend = served.split(" ", 1)[0]
    bound, ref_bound = cases.bound(backend, dtype), cases.bound("reference", dtype)
    got, reference, want = (cases.comparable(backend, outputs) for outputs in (got, reference, want))
    if bound == 0:
        ok = all(torch.equal(g, r) for g, r in zip(got, reference)) and \
            all(torch.equal(g, w.to(g.dtype)) for g, w in zip(got, want))
        detail = "bit-exact vs the reference kernel on cpu and the oracle" if ok else \
            "differs from the reference kernel on cpu / the oracle"
    else:
        vs_oracle = max((suites.normalised_error(g, w) for g, w in zip(got, want)), default=0.0)
        vs_reference = max((suites.normalised_error(g, r) for g, r in zip(got, reference)), default=0.0)
        ok = vs_oracle <= bound and vs_reference <= bound + ref_bound
        if backend == "reference" and device.type == "cpu":  # it is its own reference: the oracle judges it
            detail = f"vs oracle {vs_oracle:.1e} (bound {bound:.1e}); the reference kernel on cpu serves this call"
        else:
            detail = (f"vs reference kernel on cpu {vs_reference:.1e} (bound {bound + ref_bound:.1e}), "
                      f"vs oracle {vs_oracle:.1e} (bound {bound:.1e})")
    if extra is not None:
        same, words = extra(dev_sample, got)
        ok, detail = ok and same, f"{detail}; {words}"
    return ("PASS" if ok else "FAIL"), f"{served}; {detail}"


def _torch_npu_gather(dev_sample, got) -> tuple[bool, str]:
    """The same call through torch_npu.npu_gather_pa_kv_cache, bit for bit."""
    import torch_npu

    fresh = dev_sample.clone()
    torch_npu.npu_gather_pa_kv_cache(*fresh.args, **fresh.kwargs)
    same = torch.equal(fresh.args[4].cpu(), got[0]) and torch.equal(fresh.args[5].cpu(), got[1])
    return same, ("equal to torch_npu.npu_gather_pa_kv_cache" if same else
                  "differs from torch_npu.npu_gather_pa_kv_cache")


def check_ops(report: Report, device: torch.device, backend: Optional[str] = None) -> None:
    """One row per op x selftest sample x dtype; with `backend`, only its ops, requested explicitly
    (a call it cannot serve is a SKIP row with its reasons)."""
    from .. import backends
    from ..settings import use_backend
    from ..testing.cases import CASES

    for op, cases in CASES.items():
        if backend is not None and op not in backends.BACKENDS[backend].kernels:
            continue
        extra = _torch_npu_gather if device.type == "npu" and op == "gather_pa_kv_cache" else None
        for dtype_name, dtype in SELFTEST_DTYPES.items():
            for name in cases.selftest:
                sample = cases.sample(dtype, name)
                check = f"{op} {name} {dtype_name}" + (f" [{backend}]" if backend else "")
                if backend is None:
                    report.run(check, lambda op=op, sample=sample, dtype=dtype: compare_with_reference(
                        op, sample, dtype, device, extra))
                    continue
                reasons = backends.BACKENDS[backend].not_supported_reasons(op, *sample.args, **sample.kwargs)
                if reasons:
                    report.add(check, "SKIP", "; ".join(reasons))
                    continue
                with use_backend(backend):
                    report.run(check, lambda op=op, sample=sample, dtype=dtype: compare_with_reference(
                        op, sample, dtype, device))


def prolog_sample(tokens: int, dtype: torch.dtype, layout: str, seed: int = 0):
    """kv_prolog at DeepSeek-V2-Lite's dims with `tokens` tokens (one sequence)."""
    import dataclasses as dc

    from ..testing.cases import Sample
    from ..testing.inputs import LITE, prolog_inputs, prolog_kwargs

    dims = dc.replace(LITE, B=1, S=tokens)
    return Sample(f"T={tokens}", prolog_inputs(dims, dtype, generator=torch.Generator().manual_seed(seed)),
                  prolog_kwargs(dims, rope_layout=layout))


def check_kv_prolog_paths(report: Report, device: torch.device) -> None:
    """kv_prolog at each token count around the fused limit: which path serves it, and its accuracy."""
    for dtype_name in ("bf16", "fp16"):
        for layout in ("interleaved", "half"):
            for tokens in TOKEN_COUNTS:
                sample = prolog_sample(tokens, SELFTEST_DTYPES[dtype_name], layout)
                report.run(f"kv_prolog path T={tokens} {dtype_name} {layout}",
                           lambda sample=sample, dtype=SELFTEST_DTYPES[dtype_name]: compare_with_reference(
                               "kv_prolog", sample, dtype, device))


# ------------------------------------------------------------------------------------ device checks
# The npu kernels captured in a device graph and replayed with new inputs on an NPU, each with the case
# database sample it runs (kv_prolog has its own row, on every accelerator).
NPU_GRAPH_CASES = (("mla_decode_attention", "v2lite-block-128"), ("scatter_pa_kv_cache", "v2lite"),
                   ("scatter_pa_cache", "v2lite"), ("q_prolog", "v2-lora-decode"),
                   ("latent_kv_prolog", "v2lite-decode-half"))


def other_values(sample):
    """The same call with other values (every floating tensor rolled by one along its last dim; index
    tensors kept): what a replay must pick up from the captured buffers."""
    return sample.map(lambda t: t.roll(1, -1) if t.is_floating_point() else t)


def replay_with_new_inputs(op: str, static_cpu, fresh_cpu, device: torch.device, make_graph,
                           capture) -> tuple[str, str]:
    """Capture `op` on `static_cpu` (moved to `device`) in a device graph, copy `fresh_cpu` into the
    captured buffers, replay, and judge the outputs (returned, or written in place) against the
    oracle of `fresh_cpu`."""
    from ..testing import suites
    from ..testing.cases import CASES

    static = static_cpu.to(device)
    call = getattr(torch.ops.mla, op)
    served = serving_backend(op, static)
    call(*static.args, **static.kwargs)  # compile / warm up outside the capture
    graph = make_graph()
    with capture(graph):
        result = call(*static.args, **static.kwargs)
    for dst, src in zip(static.args, fresh_cpu.args):
        if isinstance(dst, torch.Tensor):
            dst.copy_(src.to(device))
    graph.replay()
    outputs = suites.outputs_of(result, static.args, suites.written_positions(op))
    want = CASES[op].oracle(*fresh_cpu.args, **fresh_cpu.kwargs)
    bound = CASES[op].bound(served.split(" ", 1)[0], torch.bfloat16)
    err = max(suites.normalised_error(o.cpu(), w) for o, w in zip(outputs, want))
    detail = f"{served}; new inputs after capture; vs oracle {err:.1e} (bound {bound:.1e})"
    return ("PASS" if err <= bound else "FAIL"), detail


def check_graph_replay(report: Report, device: torch.device) -> None:
    if device.type == "npu":
        make_graph, capture = torch.npu.NPUGraph, torch.npu.graph
    elif device.type == "cuda":
        make_graph, capture = torch.cuda.CUDAGraph, torch.cuda.graph
    else:
        report.add("kv_prolog graph capture + replay", "SKIP", f"no device graphs on {device.type}")
        return
    from ..testing.cases import CASES

    report.run("kv_prolog graph capture + replay", lambda: replay_with_new_inputs(
        "kv_prolog", prolog_sample(1, torch.bfloat16, "interleaved", seed=2),
        prolog_sample(1, torch.bfloat16, "interleaved", seed=3), device, make_graph, capture))
    if device.type != "npu":
        return
    for op, name in NPU_GRAPH_CASES:
        sample = CASES[op].sample(torch.bfloat16, name)
        report.run(f"{op} graph capture + replay", lambda op=op, sample=sample: replay_with_new_inputs(
            op, sample, other_values(sample), device, make_graph, capture))


def report_host_time(report: Report, device: torch.device) -> None:
    """A measurement, not a verdict: the host time of one kv_prolog call at one token."""
    def one():
        sample = prolog_sample(1, torch.bfloat16, "interleaved").to(device)
        torch.ops.mla.kv_prolog(*sample.args, **sample.kwargs)
        calls = 50
        start = time.perf_counter()
        for _ in range(calls):
            torch.ops.mla.kv_prolog(*sample.args, **sample.kwargs)
        host_us = (time.perf_counter() - start) / calls * 1e6
        what = "host time, launches are asynchronous" if device.type != "cpu" else "wall time on the CPU"
        return "INFO", f"{host_us:.0f} us per kv_prolog call at T=1 ({what}; {serving_backend('kv_prolog', sample)})"

    report.run("host time per kv_prolog call", one)


def check_generate(report: Report, device: torch.device) -> None:
    def one():
        from ..backends import npu
        from ..integrations.transformers.patch import patch
        from .graph import compile_settings
        from .loading import builtin_model

        model, tokenizer = builtin_model(torch.bfloat16, device)
        ids = tokenizer("Hello", return_tensors="pt").input_ids.to(device)
        new = 8
        with patch(model, kv_prolog=True, cache="dense"):
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

    report.add("versions", "INFO", ", ".join(f"{m} {package_version(m)}" for m in ("torch_npu", "torchair", "pypto",
                                                                              "transformers"))
               + f", torch {torch.__version__}")
    reasons = pypto_runtime.unavailable_reasons()
    report.add("pypto (fused kernels)", "INFO", f"pypto {pypto_runtime.installed_pypto_version()}" if not reasons
               else "; ".join(reasons))
    if device.type != "npu":
        return
    served = {op: label for op, device_type, label in backends.serving_report() if device_type == "npu"}
    for op in sorted(backends.BACKENDS["npu"].kernels):
        label = served.get(op, "nothing")
        report.add(f"served on npu: {op}", "PASS" if "npu" in label else "FAIL", label)


def run(args) -> int:
    device = resolve_device(args.device)
    if args.pypto_sim and device.type != "cpu":
        raise CliError("--pypto-sim runs the PyPTO kernels on CPU; use it with --device cpu")
    report = Report(lambda msg: print(msg, flush=True))
    print(f"mla-ops selftest on {device}")
    environment(report, device)
    check_ops(report, device)
    if device.type == "cpu":
        if args.pypto_sim:
            from .. import pypto_runtime

            reasons = pypto_runtime.unavailable_reasons()
            if reasons:
                report.add("pypto_sim backend", "SKIP", "; ".join(reasons))
            else:
                check_ops(report, device, backend="pypto_sim")
        else:
            report.add("pypto_sim backend", "SKIP", "not asked for (--pypto-sim; about a second per call)")
        report_host_time(report, device)
        report.add("graph capture, generate", "SKIP", "accelerator checks; this run is on CPU")
    else:
        check_kv_prolog_paths(report, device)
        check_graph_replay(report, device)
        report_host_time(report, device)
        if args.no_generate:
            report.add("generate eager vs graph (built-in model)", "SKIP", "--no-generate")
        else:
            check_generate(report, device)
    print()
    print(report.table())
    return 1 if report.failed else 0
