"""Baseline vs fused, end to end: the original benchmark_bs_comparison.py, in one process.

The original launched the inference script twice per configuration (baseline aclgraph vs PyPTO
aclgraph) and compared the tokens/s it printed. Here both variants share one loaded model: the
fused variant is the same model with the mla patch applied (instance level) for its runs and
reverted after. After a warm-up, each configuration is timed in ABBA blocks (baseline, fused,
fused, baseline): a block's ratio sum(baseline) / sum(fused) cancels a machine that speeds up or
slows down steadily within the block, and the blocks' median ratio is the speedup. The verdict
(`timing.compare`) is "Fused faster" / "Baseline faster" only where the speedup is further from 1
than the noise: the side of the median's 90% confidence interval over the blocks that faces 1, and
never less than the spread between separate runs (5%, the original's "~Same" band); otherwise
"~Same (within noise ±x%)". So a verdict repeats from run to run (unlike one on the speedup alone, which follows the
noise), unless a configuration's true speedup sits right at that threshold.
On a machine other jobs share, `clock="cpu"` with one torch thread times each run by the CPU time
the process got, which the neighbours barely move (`timing.CLOCKS`).
"""
from __future__ import annotations

import gc
import statistics
from typing import Optional

import torch

from ..integrations.transformers.patch import patch
from .timing import CLOCKS, compare, format_table, median_interval, synchronize

PROMPT_LENGTHS = (32, 512, 2048)
OUTPUT_LENGTHS = (10, 20, 50, 100)


def verdict(block_ratios: list[float]) -> dict:
    """The speedup, its interval and the verdict of a configuration's ABBA block ratios."""
    return compare(block_ratios, faster="Fused faster", slower="Baseline faster")


def synthetic_prompt(tokenizer, length: int, seed: int, device) -> torch.Tensor:
    """`length` random ordinary (non-special) token ids: the prompt length is exact."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    g = torch.Generator().manual_seed(seed)
    vocab = len(tokenizer)
    ids = torch.randint(0, vocab, (length * 2 + 8,), generator=g)
    ids = ids[[i not in special for i in ids.tolist()]][:length]
    return ids[None].to(device)


def measure(model, tokenizer, *, prompt_lengths=PROMPT_LENGTHS, output_lengths=OUTPUT_LENGTHS, repeats: int = 8,
            warmup: int = 1, fused: Optional[dict] = None, generate_kwargs: Optional[dict] = None,
            clock: str = "wall", progress=print) -> list[dict]:
    """Rows per (prompt length, output length): `repeats` ABBA blocks (each variant timed twice per
    block), the variants' median times, the speedup with its interval, and the verdict. `clock` is a
    key of `timing.CLOCKS` ("cpu" for a machine other jobs share; with one torch thread)."""
    fused = fused or {"kv_prolog": True, "cache": "dense"}  # the original comparison
    timer = CLOCKS[clock]
    device = next(model.parameters()).device
    rows = []
    extra = dict(generate_kwargs or {})

    def run(ids, new_tokens, patched: bool) -> float:
        handle = patch(model, **fused) if patched else None
        try:
            with torch.no_grad():
                start = timer()
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, **extra)
                synchronize(device)
                return timer() - start
        finally:
            if handle is not None:
                handle.revert()

    for p_len in prompt_lengths:
        ids = synthetic_prompt(tokenizer, p_len, seed=p_len, device=device)
        for o_len in output_lengths:
            progress(f"prompt {p_len:>5} tokens, output {o_len:>4} tokens ...")
            for _ in range(warmup):
                run(ids, o_len, False)
                run(ids, o_len, True)
            times = {False: [], True: []}
            ratios = []
            for _ in range(repeats):
                gc.collect()  # a collection inside a timed run would land on one variant only
                block = [(patched, run(ids, o_len, patched)) for patched in (False, True, True, False)]
                for patched, seconds in block:
                    times[patched].append(seconds)
                ratios.append(sum(s for p, s in block if not p) / sum(s for p, s in block if p))
            base, fuse = statistics.median(times[False]), statistics.median(times[True])
            rows.append({
                "prompt_tokens": p_len, "output_tokens": o_len,
                "baseline_s": base, "fused_s": fuse,
                "baseline_tokens_per_s": o_len / base, "fused_tokens_per_s": o_len / fuse,
                **verdict(ratios),
                "baseline_spread_pct": _spread_pct(times[False]), "fused_spread_pct": _spread_pct(times[True]),
                "block_ratios": ratios, "baseline_runs_s": times[False], "fused_runs_s": times[True],
            })
    return rows


def _spread_pct(seconds: list[float]) -> Optional[float]:
    """A variant's run-to-run spread: the wider side of its median time's confidence interval, in %
    of the median (None with too few runs)."""
    interval = median_interval(seconds)
    if interval is None:
        return None
    median = statistics.median(seconds)
    return 100 * max(median - interval[0], interval[1] - median) / median


def format_rows(rows: list[dict], unit: str = "tok/s") -> str:
    """The table the command prints: tokens per second (of `unit`'s clock) of both variants, the
    speedup with its interval, the verdict."""
    shown = [{**r, "interval": "" if r["ci_low"] is None else f"{r['ci_low']:.2f}-{r['ci_high']:.2f}",
              "speedup_x": f"{r['speedup']:.2f}x", "baseline": f"{r['baseline_tokens_per_s']:.1f}",
              "fused": f"{r['fused_tokens_per_s']:.1f}"} for r in rows]
    return format_table(shown, [("prompt_tokens", "prompt"), ("output_tokens", "output"),
                                ("baseline", f"baseline {unit}"), ("fused", f"fused {unit}"),
                                ("speedup_x", "speedup"), ("interval", "90% interval"), ("verdict", "verdict")])


def plot(rows: list[dict], path: str, title: str, unit: str = "tokens / s") -> Optional[str]:
    """tokens/s against output length, one panel per prompt length, from 0 (a 2% gap looks like one),
    each point with its median's 90% interval and each output length labelled with the speedup and
    verdict. Returns None when matplotlib is missing (it is an optional extra: pip install 'mla-ops[plot]')."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None

    def tokens_per_s(r, variant):
        """The median rate and its interval as error bar lengths (below, above)."""
        rate = r["output_tokens"] / r[f"{variant}_s"]
        interval = median_interval(r[f"{variant}_runs_s"])
        if interval is None:
            return rate, (0.0, 0.0)
        return rate, (rate - r["output_tokens"] / interval[1], r["output_tokens"] / interval[0] - rate)

    prompts = sorted({r["prompt_tokens"] for r in rows})
    fig, axes = plt.subplots(1, len(prompts), figsize=(4.5 * len(prompts), 3.8), squeeze=False)
    for ax, p_len in zip(axes[0], prompts):
        sel = [r for r in rows if r["prompt_tokens"] == p_len]
        x = [r["output_tokens"] for r in sel]
        top = 0.0
        for variant, marker in (("baseline", "o-"), ("fused", "s-")):
            points = [tokens_per_s(r, variant) for r in sel]
            top = max(top, *(rate + bars[1] for rate, bars in points))
            ax.errorbar(x, [rate for rate, _ in points], yerr=list(zip(*(bars for _, bars in points))), fmt=marker,
                        capsize=3, label=variant)
        for r in sel:
            ax.annotate(f"{r['speedup']:.2f}x\n{r['verdict'].split(' (')[0]}", (r["output_tokens"], 0),
                        textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
        ax.set_ylim(0, 1.3 * top)  # room for the legend above the lines
        ax.margins(x=0.2)
        ax.set_xticks(x)
        ax.set_title(f"prompt {p_len} tokens")
        ax.set_xlabel("output tokens")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
