"""Baseline vs fused, end to end: the original benchmark_bs_comparison.py, in one process.

The original launched the inference script twice per configuration (baseline aclgraph vs PyPTO
aclgraph) and compared the tokens/s it printed. Here both variants share one loaded model: the
fused variant is the same model with the mla patch applied (instance level) for its runs and
reverted after, runs alternate (baseline, fused, fused, baseline, ...) after warm-up, and each
configuration reports the median of its repeats. Classification as the original: speedup within
5% of 1 is "~Same", above "Fused faster", below "Baseline faster".
"""
from __future__ import annotations

import statistics
import time
from typing import Optional

import torch

from ..integrations.transformers import apply
from .timing import synchronize

PROMPT_LENGTHS = (32, 512, 2048)
OUTPUT_LENGTHS = (10, 20, 50, 100)
SAME_BAND = 0.05


def classify(speedup: float) -> str:
    if abs(speedup - 1.0) <= SAME_BAND:
        return "~Same"
    return "Fused faster" if speedup > 1.0 else "Baseline faster"


def synthetic_prompt(tokenizer, length: int, seed: int, device) -> torch.Tensor:
    """`length` random ordinary (non-special) token ids: the prompt length is exact."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    g = torch.Generator().manual_seed(seed)
    vocab = len(tokenizer)
    ids = torch.randint(0, vocab, (length * 2 + 8,), generator=g)
    ids = ids[[i not in special for i in ids.tolist()]][:length]
    return ids[None].to(device)


def measure(model, tokenizer, *, prompt_lengths=PROMPT_LENGTHS, output_lengths=OUTPUT_LENGTHS, repeats: int = 3,
            warmup: int = 1, fused: Optional[dict] = None, generate_kwargs: Optional[dict] = None,
            progress=print) -> list[dict]:
    """Rows per (prompt length, output length): baseline and fused medians, speedup, verdict."""
    fused = fused or {"kv_prolog": True}
    device = next(model.parameters()).device
    rows = []
    extra = dict(generate_kwargs or {})

    def run(ids, new_tokens, patched: bool) -> float:
        handle = apply(model, **fused) if patched else None
        try:
            with torch.no_grad():
                start = time.perf_counter()
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, **extra)
                synchronize(device)
                return time.perf_counter() - start
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
            for r in range(repeats):
                order = (False, True) if r % 2 == 0 else (True, False)
                for patched in order:
                    times[patched].append(run(ids, o_len, patched))
            base, fuse = statistics.median(times[False]), statistics.median(times[True])
            speedup = base / fuse
            rows.append({
                "prompt_tokens": p_len, "output_tokens": o_len,
                "baseline_s": base, "fused_s": fuse,
                "baseline_tokens_per_s": o_len / base, "fused_tokens_per_s": o_len / fuse,
                "speedup": speedup, "verdict": classify(speedup),
                "baseline_runs_s": times[False], "fused_runs_s": times[True],
            })
    return rows


def plot(rows: list[dict], path: str, title: str) -> Optional[str]:
    """tokens/s against output length, one panel per prompt length. Returns None when matplotlib is
    missing (it is an optional extra: pip install 'mla-ops[plot]')."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    prompts = sorted({r["prompt_tokens"] for r in rows})
    fig, axes = plt.subplots(1, len(prompts), figsize=(4.5 * len(prompts), 3.8), squeeze=False)
    for ax, p_len in zip(axes[0], prompts):
        sel = [r for r in rows if r["prompt_tokens"] == p_len]
        x = [r["output_tokens"] for r in sel]
        ax.plot(x, [r["baseline_tokens_per_s"] for r in sel], "o-", label="baseline")
        ax.plot(x, [r["fused_tokens_per_s"] for r in sel], "s-", label="fused")
        ax.set_title(f"prompt {p_len} tokens")
        ax.set_xlabel("output tokens")
        ax.set_ylabel("tokens / s")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
