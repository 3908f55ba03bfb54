"""`mla-ops bench vllm` end to end at a tiny size: both engines, on the backend vLLM picks on this CPU,
and the kernel-alone comparison against every vLLM decode kernel this CPU runs. `mla-ops bench
vllm-prefill --quick` end to end (every part and side, the JSON, the rendered tables) and its memory
estimates."""
import importlib.util
import json
import pathlib
import sys

import torch
from harness import AMX

from mla_ops.bench import vllm as bench_vllm
from mla_ops.bench import vllm_prefill


def test_bench_vllm_times_the_route_on_the_backend_vllm_picks():
    rows = bench_vllm.measure(contexts=(64,), batch_sizes=(1,), decode_tokens=4, num_layers=1)
    assert [(r["backend"], r["attention_backend"]) for r in rows] == [
        ("mla-ops", "AMX_MLA" if AMX else "CPU_MLA"), ("vllm", "AMX_MLA" if AMX else "CPU_MLA")]
    assert all(r["attn_call_ms"] > 0 and r["decode_tok_s"] > 0 for r in rows)
    # the thread count the engine's attention calls ran with (vLLM's CPU worker binds one per CPU it is given)
    assert all(r["attn_threads"] >= 1 for r in rows)
    assert rows[0]["attn_vs_vllm"] > 0
    assert "attn ms" in bench_vllm.format_rows(rows)


def test_bench_vllm_sparse_family_times_the_sparse_backend_against_dense_mla_on_both_routes():
    # a 64-token context over a top-16 selection: the sparse side attends to a quarter of what dense MLA does
    rows = bench_vllm.measure(family="deepseek_v32", contexts=(64,), batch_sizes=(2,), decode_tokens=4,
                              num_layers=1, index_topk=16)
    dense = "AMX_MLA" if AMX else "CPU_MLA"
    assert [(r["backend"], r["attention_backend"], r["route"]) for r in rows] == [
        ("mla-ops", "CPU_MLA_SPARSE", "mla-ops"), ("mla-ops dense", dense, "mla-ops"), ("vllm dense", dense, "vllm")]
    sparse = rows[0]
    # the step's attention is the indexer's call and the sparse attention's, both timed inside the engine
    assert 0 < sparse["indexer_call_ms"] < sparse["attn_call_ms"]
    assert all("indexer_call_ms" not in r for r in rows[1:])
    assert sparse["tok_s_vs_dense"] > 0 and sparse["tok_s_vs_vllm"] > 0 and "tok_s_vs_vllm" not in rows[2]
    table = bench_vllm.format_rows(rows)
    assert "tok/s vs dense" in table and "CPU_MLA_SPARSE" in table


def test_bench_vllm_kernel_rows_cover_every_host_kernel_of_this_cpu():
    rows = bench_vllm.measure_ops(contexts=(256,), batch_sizes=(1, 2), reps=2, num_blocks=64)
    assert {r["host"] for r in rows} == ({"CPU_MLA", "AMX_MLA"} if AMX else {"CPU_MLA"})
    assert len(rows) == 2 * (2 if AMX else 1)
    assert all(r["mla_ms"] > 0 and r["vllm_ms"] > 0 and r["threads"] == torch.get_num_threads() for r in rows)


def test_host_kernels_compute_the_same_attention():
    # the callables the benchmarks time are the kernels vLLM runs, on the same pool: same result (bf16)
    import mla_ops  # noqa: F401

    gen = torch.Generator().manual_seed(0)
    for block_size in (16, 32):
        pool = torch.randn(40, block_size, 576, generator=gen).bfloat16()
        tables = torch.randperm(40, generator=gen)[:20].view(2, 10).int()
        lens = torch.tensor([5, 10 * block_size - 3], dtype=torch.int32)
        q = torch.randn(2, 16, 576, generator=gen).bfloat16()
        ours = torch.ops.mla.mla_decode_attention(q[..., :512], q[..., 512:], pool[..., :512].unsqueeze(2),
                                                  pool[..., 512:].unsqueeze(2), tables, lens, 0.1)
        kernels = bench_vllm.host_decode_kernels(q, pool, tables, lens, 0.1)
        assert set(kernels) == ({"CPU_MLA"} if block_size == 16 else ({"AMX_MLA"} if AMX else set()))
        for name, fn in kernels.items():
            torch.testing.assert_close(fn().float(), ours.float(), atol=2e-2, rtol=2e-2, msg=name)


# --- mla-ops bench vllm-prefill ----------------------------------------------------------------------------------
V2_LITE = {"heads": 16, "hidden": 2048, "qk_nope_head_dim": 128, "v_head_dim": 128, "intermediate": 512}


def _render_docs():
    path = pathlib.Path(__file__).resolve().parents[2] / "tools" / "render_docs.py"
    spec = importlib.util.spec_from_file_location("render_docs", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_prefill_memory_estimates_leave_out_what_materializes_the_scores():
    gib = 2**30
    # stock CPU_MLA (fp32 selects it on every CPU): fp32 scores and probabilities [16, S, S] at 16k, 32 GiB
    assert vllm_prefill.prefill_peak_bytes("vllm", 16384, "float32", V2_LITE) > 32 * gib
    # the plugin side on vLLM's own prefill is held to the same estimate; on the mla ops, chunked, to a step's
    # activations
    assert (vllm_prefill.prefill_peak_bytes("plugin", 16384, "float32", V2_LITE)
            == vllm_prefill.prefill_peak_bytes("vllm", 16384, "float32", V2_LITE))
    assert vllm_prefill.prefill_peak_bytes("plugin", 32768, "float32", V2_LITE, prefill_route="mla-ops",
                                           step_tokens=2048) < gib / 2
    # transformers' eager scores [16, S, S]: bf16 scores twice and their fp32 softmax
    assert vllm_prefill.transformers_prefill_peak_bytes(16384, 16, "bfloat16") > 32 * gib
    assert vllm_prefill.transformers_prefill_peak_bytes(4096, 16, "bfloat16") < 3 * gib
    reason = vllm_prefill._fit_reason(34 * gib, "a prefill", 16 * gib)
    assert "~34.0 GiB" in reason and "16.0 GiB usable" in reason
    assert vllm_prefill._fit_reason(gib, "a prefill", 16 * gib) is None


def test_bench_vllm_prefill_quick_runs_every_part_on_every_side(tmp_path):
    from mla_ops.cli import main

    out = tmp_path / "vllm_prefill.json"
    threads = torch.get_num_threads()
    try:
        assert main(["bench", "vllm-prefill", "--quick", "--dtypes", "bfloat16", "--threads", "1",
                     "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)  # --threads sets this process's count
    data = json.loads(out.read_text())
    meta = data["meta"]
    assert meta["command"].startswith("mla-ops bench vllm-prefill --quick --dtypes bfloat16")
    assert meta["threads"] == data["threads"] == 1 and meta["cpu_flags"] and meta["commit"] and meta["vllm"]
    settings = vllm_prefill.PRESETS["quick"]
    assert data["model"]["num_layers"] == settings.num_layers and data["dtypes"] == ["bfloat16"]

    # parts prefill and long: every (part, side, context) ran or is listed with its reason
    expected = {("prefill", side, c) for side in ("plugin", "vllm", "transformers") for c in settings.contexts}
    expected.add(("long", "plugin", settings.long_context))
    ran = {(r["part"], r["side"], r["context"]) for r in data["rows"]}
    left_out = {(s["part"], s["side"], s["context"]) for s in data["skipped"]}
    assert ran | left_out == expected and not ran & left_out
    assert all("GiB usable" in s["reason"] for s in data["skipped"])
    for r in data["rows"]:
        assert r["ttft_s"] > 0 and r["prefill_tok_s"] > 0 and r["peak_rss_bytes"] >= r["rss_before_bytes"] > 0
        assert 0 <= r["first_token"] < data["model"]["vocab_size"]
    routes = {(r["side"], r["prefill_route"]) for r in data["rows"]}
    assert all(route == {"plugin": route, "vllm": "vllm", "transformers": "transformers eager"}[side]
               for side, route in routes)
    # the route a plugin row names is what its engine's probe ran: an mla prefill op or none
    for engine in data["engines"]:
        assert engine["prefill_route"] == ("mla-ops" if engine["probe_prefill_ops"] else "vllm")
        assert engine["peak_rss_bytes"] > 0 and engine["startup_s"] > 0
    assert {e["side"] for e in data["engines"]} == {"plugin", "vllm"}

    # part turns: the second prompt's prefix comes from the cache where the engine keeps one
    assert [t["side"] for t in data["turns"]] == ["plugin", "vllm"]
    for t in data["turns"]:
        assert t["first_s"] > 0 and t["second_s"] > 0 and t["first_cached_tokens"] == 0
        assert t["second_cached_tokens"] == (settings.turn_context if t["prefix_caching"] else 0)

    # part serve: both servers, every turn, time to first token and decode rate per session
    assert sorted((s["side"], s["turn"]) for s in data["serve"]) == [
        (side, turn) for side in ("plugin", "vllm") for turn in range(1, settings.session_turns + 1)]
    assert len(data["serve_sessions"]) == 2 * settings.sessions * settings.session_turns
    for s in data["serve_sessions"]:
        assert s["ttft_s"] > 0 and s["decode_tok_s"] > 0
        assert s["prompt_tokens"] == settings.session_start + (s["turn"] - 1) * (
            settings.answer_tokens + settings.session_new_tokens)
    plugin_server = next(s for s in data["servers"] if s["side"] == "plugin")
    assert any("mla-ops vLLM plugin" in line for line in plugin_server["log"])

    report = vllm_prefill.format_report({**data, "environment": meta})
    assert "time to first token" in report and "second turn" in report and "vllm serve" in report
    render_docs = _render_docs()
    for build in (render_docs.vllm_prefill, render_docs.vllm_prefill_turns, render_docs.vllm_prefill_serve):
        header, rows = build(data)
        assert rows and all(len(row) == len(header) for row in rows), build.__name__
