"""`mla-ops bench vllm` end to end at a tiny size: both engines, on the backend vLLM picks on this CPU,
and the kernel-alone comparison against every vLLM decode kernel this CPU runs."""
import torch
from harness import AMX

from mla_ops.bench import vllm as bench_vllm


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
