"""Side-by-side timing on a shared, noisy machine.

Variants are timed in interleaved rounds (rotating order) with `torch.utils.benchmark`, and every
ratio is computed per round before taking the median, so drift of the machine between rounds
cancels out of the ratios. Absolute times are reported too, but the ratios are what to quote.
"""
from __future__ import annotations

import statistics
from typing import Callable

import torch
import torch.utils.benchmark as tbench


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so wall-clock timings include it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def interleaved_medians(variants: dict[str, Callable[[], object]], *, rounds: int = 5,
                        min_run_time: float = 0.2) -> dict[str, dict[str, float]]:
    """-> {name: {"median_s": ..., "times": [...]}}; each round times every variant once."""
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    # Timer runs single-threaded unless told otherwise; measure with the threads torch would use.
    threads = torch.get_num_threads()
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            timer = tbench.Timer(stmt="fn()", globals={"fn": variants[name]}, num_threads=threads)
            m = timer.blocked_autorange(min_run_time=min_run_time)
            times[name].append(m.median)
    return {n: {"median_s": statistics.median(ts), "times": ts} for n, ts in times.items()}


def median_ratio(results: dict[str, dict[str, float]], numerator: str, denominator: str) -> float:
    """Median over rounds of time(numerator) / time(denominator)."""
    pairs = zip(results[numerator]["times"], results[denominator]["times"])
    return statistics.median(a / b for a, b in pairs)


def format_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """Plain aligned text table; columns = [(key, header)], floats printed with 4 significant digits."""
    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    body = [[cell(r.get(k, "")) for k, _ in columns] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, (_, h) in enumerate(columns)]
    lines = ["  ".join(h.ljust(w) for (_, h), w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def cpu_flags() -> str:
    """The SIMD and matrix flags the kernels care about, as /proc/cpuinfo lists them (amx_bf16,
    amx_tile, avx2, avx512_bf16, avx512f)."""
    import re

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return "unknown"
    found = re.findall(r"\b(amx_bf16|amx_tile|avx512_bf16|avx512f|avx2)\b", text)
    return " ".join(sorted(set(found))) or "none"
