"""Per-op microbenchmarks on DeepSeek-V2-Lite dims (torch.utils.benchmark, interleaved rounds).

* kv_prolog at S = 1, 16, 512: `torch.ops.mla.kv_prolog` against the stock transformers modules run
  one after the other (kv_a_proj_with_mqa -> split -> kv_a_layernorm -> kv_b_proj -> view/transpose/
  split -> apply_rotary_emb), and against the two bare GEMMs alone (the floor any prolog pays).
* gather / scatter throughput against a plain copy_ of the same bytes (mla_ops.bench.paged_kv_cache).
* mla_decode_attention (absorbed) against materialised attention (mla_ops.bench.decode).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import mla_ops  # noqa: F401

from ..models import lite_attn_config
from .timing import interleaved_medians, median_ratio


def measure_kv_prolog(seq_lens=(1, 16, 512), *, dtype=torch.bfloat16, rounds=5, min_run_time=0.2,
                      seed=0) -> list[dict]:
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf

    config = lite_attn_config()
    torch.manual_seed(seed)
    attn = hf.DeepseekV2Attention(config, layer_idx=0).to(dtype).eval()
    rotary = hf.DeepseekV2RotaryEmbedding(config)
    kv_a, norm, kv_b = attn.kv_a_proj_with_mqa, attn.kv_a_layernorm, attn.kv_b_proj
    heads, nope, v, lora, rope = (config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim,
                                  config.kv_lora_rank, config.qk_rope_head_dim)
    rows = []
    for seq in seq_lens:
        hidden = torch.randn(1, seq, config.hidden_size).to(dtype)
        freqs_cis = rotary(hidden, torch.arange(seq)[None])
        cos, sin = freqs_cis.real, freqs_cis.imag
        latent_in = torch.randn(1, seq, lora).to(dtype)

        def fused():
            with torch.no_grad():
                return torch.ops.mla.kv_prolog(hidden, kv_a.weight, None, norm.weight, kv_b.weight, cos, sin,
                                               num_heads=heads, qk_nope_head_dim=nope, v_head_dim=v,
                                               eps=norm.variance_epsilon)

        def stock():
            with torch.no_grad():
                compressed = kv_a(hidden)
                kv_nope, k_pe = torch.split(compressed, [lora, rope], dim=-1)
                latent = norm(kv_nope).view(1, 1, seq, lora)
                k_pe = k_pe.view(1, 1, seq, rope)
                kv = kv_b(latent).view(1, seq, heads, nope + v).transpose(1, 2)
                k_nope, value = torch.split(kv, [nope, v], dim=-1)
                _, k_pe = hf.apply_rotary_emb(k_pe, k_pe, freqs_cis)
                return k_nope, value, k_pe

        def floor():
            with torch.no_grad():
                F.linear(hidden, kv_a.weight)
                return F.linear(latent_in, kv_b.weight)

        results = interleaved_medians({"mla.kv_prolog": fused, "stock": stock, "two GEMMs": floor}, rounds=rounds,
                                      min_run_time=min_run_time)
        rows.append({
            "S": seq, "mla_kv_prolog_us": results["mla.kv_prolog"]["median_s"] * 1e6,
            "stock_us": results["stock"]["median_s"] * 1e6, "gemm_floor_us": results["two GEMMs"]["median_s"] * 1e6,
            "fused_over_floor": median_ratio(results, "mla.kv_prolog", "two GEMMs"),
            "stock_over_floor": median_ratio(results, "stock", "two GEMMs"),
            "stock_over_fused": median_ratio(results, "stock", "mla.kv_prolog"),
        })
    return rows
