"""Side-by-side timing on a shared, noisy machine.

Variants are timed in interleaved rounds (rotating order) with `torch.utils.benchmark`, and every
ratio is computed per round before taking the median, so drift of the machine between rounds
cancels out of the ratios. Absolute times are reported too, but the ratios are what to quote.

`compare` turns per-round ratios into a verdict that repeats from run to run: the median ratio with
a distribution-free confidence interval, and "faster" only where the interval lies clear of 1 and
the difference is larger than a floor for the spread between separate runs (`RUN_TO_RUN_FLOOR`).
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Optional, Sequence

import torch
import torch.utils.benchmark as tbench

# How a run is timed. "wall": elapsed time. "cpu": the CPU time the process got; with one torch
# thread that is the time the work ran on a core, not the time it waited for one, so other jobs on
# the machine barely move it (with more threads it would add up every thread, spin-waits included).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


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


CONFIDENCE = 0.90
# Separate runs on one machine disagree by more than one run's interval says (the process's memory
# layout, frequency, other jobs): in six `bench e2e --quick --clock cpu --threads 1` runs on a shared
# 2-core machine the median ratio of a dense cell moved by up to 4.5%, while one run's interval was
# often within ±2%.
# Below this floor the verdict stays "~Same", as in the original benchmark's 5% band.
RUN_TO_RUN_FLOOR = 0.05


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Optional[tuple[float, float]]:
    """Distribution-free confidence interval of the median: the order statistics x_(k) and x_(n+1-k)
    for the largest k with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2. It assumes nothing about
    the shape of the noise (on a shared machine it is one-sided and heavy-tailed: preemption only
    ever adds time), and an outlier moves it by one rank at most. None when there are too few values
    for that confidence (fewer than 5 at 90%)."""
    xs = sorted(values)
    n = len(xs)
    tail, k = 0.0, 0
    while True:  # tail = P(X <= k) for X ~ Binomial(n, 1/2)
        tail += math.comb(n, k) / 2 ** n
        if tail > (1 - confidence) / 2 or k + 1 > n // 2:
            break
        k += 1
    if k == 0:
        return None
    return xs[k - 1], xs[n - k]


def compare(ratios: Sequence[float], *, faster: str, slower: str, floor: float = RUN_TO_RUN_FLOOR,
            confidence: float = CONFIDENCE) -> dict:
    """Verdict on per-round ratios time(baseline) / time(candidate) (> 1: the candidate is faster).

    -> {"speedup": median ratio, "ci_low", "ci_high", "noise_pct", "verdict"}. The noise is the side
    of the median's confidence interval that faces 1 (the one that could undo the difference: a run
    that went unusually well for the winner only widens the other side), in log space (so x2 and x0.5
    are the same distance), raised to `floor`. The verdict is `faster` / `slower` only where the
    median lies further from 1 than that noise, i.e. the whole interval is on one side of 1 (a test at
    10% two-sided) and the speedup exceeds the floor; otherwise "~Same (within noise ±x%)". Without
    enough rounds for an interval there is no verdict."""
    speedup = statistics.median(ratios)
    interval = median_interval(ratios, confidence)
    if interval is None:
        return {"speedup": speedup, "ci_low": None, "ci_high": None, "noise_pct": None,
                "verdict": f"no verdict (needs {min_rounds(confidence)}+ repeats)"}
    low, high = interval
    centre = math.log(speedup)
    towards_one = centre - math.log(low) if centre >= 0 else math.log(high) - centre
    noise = max(math.log(1 + floor), towards_one)
    if abs(centre) > noise:
        verdict = faster if centre > 0 else slower
    else:
        verdict = f"~Same (within noise ±{100 * math.expm1(noise):.0f}%)"
    return {"speedup": speedup, "ci_low": low, "ci_high": high, "noise_pct": 100 * math.expm1(noise),
            "verdict": verdict}


def min_rounds(confidence: float = CONFIDENCE) -> int:
    """The fewest values `median_interval` gives an interval for at `confidence`."""
    n = 1
    while median_interval(range(n), confidence) is None:
        n += 1
    return n


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


def source_commit() -> Optional[str]:
    """The git commit of the mla-ops checkout this package runs from (`git rev-parse HEAD`), with a
    "-dirty" suffix when tracked files differ from it; None when the package is not a git checkout's
    own `mla_ops/` (an installed wheel) or git is missing. A result file records it next to the
    command, so a number can be traced to the code that produced it."""
    import pathlib
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[2]

    def git(*args: str) -> Optional[str]:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    toplevel = git("rev-parse", "--show-toplevel")
    # a wheel installed into a virtualenv that lies inside some git checkout is not that checkout's code
    if toplevel is None or pathlib.Path(toplevel).resolve() != root:
        return None
    head = git("rev-parse", "HEAD")
    if head is None:
        return None
    changes = git("status", "--porcelain", "--untracked-files=no")
    return head + ("-dirty" if changes else "")
