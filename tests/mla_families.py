"""Tiny random configs for every multi-head latent attention family in transformers 5.24 (fp32,
hidden 64, 2 attention layers, vocab 256), for the family tests.

FAMILIES: model_type -> (config class path, model class path, config kwargs).
Shared dims: 4 heads, q_lora_rank 32 (None where the family's checkpoints have no q-LoRA),
kv_lora_rank 32, qk_nope 16, qk_rope 16, v 16. MoE layers: 4 routed experts, top-2, 1 shared.
Sparse-attention (DSA) indexers keep top-8 (8 heads of 32). YaRN (DeepSeek-V2/V3/V3.2, Mistral-4, Mistral-Large-4)
and LongRoPE (MiniCPM3) where the real checkpoints use them.

qk_rope is 16, not smaller: DeepSeek-V2's stock RoPE multiplies complex numbers, and ATen's scalar
loop for rows shorter than a SIMD vector (R/2 < 8 complex values) contracts it into fused
multiply-adds, so the stock model's own result then depends on the memory layout of q (measured:
2.4e-7 between a strided and a contiguous q at R=8, 0 at R=16 and 64).
"""
from __future__ import annotations

import copy
import importlib

VOCAB = 256
TOKENS = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MLA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
           q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
           max_position_embeddings=128, intermediate_size=128)
MOE = dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32)
# index_head_dim above qk_rope 16, as in the real models (128 over 64): part of each indexer head is not rotated
DSA = dict(index_topk=8, index_head_dim=32, index_n_heads=8)


def yarn(mscale=1.0, mscale_all_dim=1.0, **extra):
    """DeepSeek-style YaRN scaled down: factor 4 over an original 32 positions (real: 40 over 4096)."""
    params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": mscale, "mscale_all_dim": mscale_all_dim}
    params.update(extra)
    return params


def _m(*dicts, **kw):
    out = {}
    for d in dicts:
        out.update(copy.deepcopy(d))
    out.update(kw)
    return out


P = "transformers.models"
FAMILIES = {
    # DeepSeek-V2-Lite layout (no q-LoRA: q_proj), group-free greedy routing, YaRN mscale 0.707
    "deepseek_v2": (f"{P}.deepseek_v2.DeepseekV2Config", f"{P}.deepseek_v2.DeepseekV2ForCausalLM",
                    _m(TOKENS, MLA, MOE, q_lora_rank=None, first_k_dense_replace=1, topk_method="greedy",
                       rope_parameters=yarn(0.707, 0.707))),
    "deepseek_v3": (f"{P}.deepseek_v3.DeepseekV3Config", f"{P}.deepseek_v3.DeepseekV3ForCausalLM",
                    _m(TOKENS, MLA, MOE, n_group=2, topk_group=1, first_k_dense_replace=1, rope_interleave=True,
                       num_mtp_layers=0, rope_parameters=yarn())),
    "deepseek_v32": (f"{P}.deepseek_v32.DeepseekV32Config", f"{P}.deepseek_v32.DeepseekV32ForCausalLM",
                     _m(TOKENS, MLA, MOE, DSA, n_group=2, topk_group=1, first_k_dense_replace=1,
                        rope_parameters=yarn())),
    "axk1": (f"{P}.axk1.AXK1Config", f"{P}.axk1.AXK1ForCausalLM",
             _m(TOKENS, MLA, MOE, n_group=2, topk_group=1, first_k_dense_replace=1, rope_interleave=True)),
    "axk2": (f"{P}.axk2.AXK2Config", f"{P}.axk2.AXK2ForCausalLM",
             _m(TOKENS, MLA, MOE, DSA, n_group=None, topk_group=None, first_k_dense_replace=1, gated_norm_rank=4)),
    # hybrid: layer 0 KDA linear attention, layer 1 MLA (layer_group_size 2); no q-LoRA like Ling
    "bailing_hybrid": (f"{P}.bailing_hybrid.BailingHybridConfig", f"{P}.bailing_hybrid.BailingHybridForCausalLM",
                       _m(TOKENS, MLA, q_lora_rank=None, n_shared_experts=1, moe_intermediate_size=32,
                          num_local_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                          first_k_dense_replace=1, layer_group_size=2, head_dim=16, rope_theta=6_000_000.0)),
    # text model only (Dots3NoteForCausalLM takes the text config); layer 0 DSA, layer 1 sliding-window MLA with
    # its own (per_layer_config) dims, rope theta per layer type
    "dots3_note": (f"{P}.dots3_note.Dots3NoteTextConfig", f"{P}.dots3_note.Dots3NoteForCausalLM",
                   _m(TOKENS, MLA, MOE, DSA, head_dim=24, n_group=1, topk_group=1, first_k_dense_replace=1,
                      shared_experts_intermediate_size=32, layer_types=["indexed_attention", "sliding_attention"],
                      sliding_window=4, swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=32,
                      swa_kv_lora_rank=32, swa_head_dim=24, swa_qk_nope_head_dim=16, swa_v_head_dim=16)),
    "glm4_moe_lite": (f"{P}.glm4_moe_lite.Glm4MoeLiteConfig", f"{P}.glm4_moe_lite.Glm4MoeLiteForCausalLM",
                      _m(TOKENS, MLA, MOE, n_group=1, topk_group=1, mlp_layer_types=["dense", "sparse"],
                         rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})),
    # multimodal wrapper (no text-only CausalLM): layer 0 KDA linear attention, layer 1 NoPE DSA MLA, hyper-connections
    "glm5_next": (f"{P}.glm5_next.Glm5NextConfig", f"{P}.glm5_next.Glm5NextForConditionalGeneration",
                  dict(text_config=_m(TOKENS, MLA, MOE, DSA, qk_rope_head_dim=0, qk_nope_head_dim=24,
                                      index_kpool=4, layer_types=["linear_attention", "indexed_attention"],
                                      mlp_layer_types=["dense", "sparse"], linear_head_dim=16, linear_num_heads=4,
                                      hc_mult=2, hc_sinkhorn_iters=3),
                       vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64,
                                          out_hidden_size=64, projection_intermediate_size=64, patch_size=14,
                                          image_size=28),
                       **TOKENS)),
    # GLM-5: DSA with cross-layer top-k sharing (layer 1 reuses layer 0's top-k)
    "glm_moe_dsa": (f"{P}.glm_moe_dsa.GlmMoeDsaConfig", f"{P}.glm_moe_dsa.GlmMoeDsaForCausalLM",
                    _m(TOKENS, MLA, MOE, DSA, n_group=1, topk_group=1, first_k_dense_replace=1,
                       indexer_types=["full", "shared"],
                       rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})),
    "hy_v4": (f"{P}.hy_v4.HYV4Config", f"{P}.hy_v4.HYV4ForCausalLM",
              _m(TOKENS, MLA, MOE, DSA, n_group=1, topk_group=1, indexer_types=["full", "shared"], hc_mult=2)),
    "hy_v4_vl": (f"{P}.hy_v4_vl.HYV4VLConfig", f"{P}.hy_v4_vl.HYV4VLForConditionalGeneration",
                 dict(text_config=_m(TOKENS, MLA, MOE, DSA, n_group=1, topk_group=1, indexer_types=["full", "shared"],
                                     hc_mult=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                 "mrope_section": [4, 2, 2]}),
                      vision_config=dict(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                         num_hidden_layers=1, out_hidden_size=64, patch_size=16),
                      **TOKENS)),
    # hybrid: layer 0 KDA linear attention, layer 1 MLA without RoPE (NoPE); no q-LoRA like Kimi-Linear-48B
    "kimi_linear": (f"{P}.kimi_linear.KimiLinearConfig", f"{P}.kimi_linear.KimiLinearForCausalLM",
                    _m(TOKENS, MLA, q_lora_rank=None, n_shared_experts=1, moe_intermediate_size=32,
                       num_local_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                       layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
                       linear_head_dim=16, linear_num_heads=4)),
    # one LongCat layer = 2 MLA sublayers (cache layers 0 and 1) + shortcut MoE with zero experts
    "longcat_flash": (f"{P}.longcat_flash.LongcatFlashConfig", f"{P}.longcat_flash.LongcatFlashForCausalLM",
                      _m(TOKENS, {k: v for k, v in MLA.items() if k not in ("num_hidden_layers", "intermediate_size")},
                         num_layers=1, head_dim=16, ffn_hidden_size=128, n_routed_experts=4, zero_expert_num=2,
                         moe_topk=2, expert_ffn_hidden_size=32,
                         rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0})),
    "minicpm3": (f"{P}.minicpm3.MiniCPM3Config", f"{P}.minicpm3.MiniCPM3ForCausalLM",
                 _m(TOKENS, MLA, dim_model_base=32, scale_emb=12, scale_depth=1.4,
                    rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                     "long_factor": [1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0],
                                     "original_max_position_embeddings": 32})),
    # Mistral Small 4: YaRN factor 128 over 8192 in the real config + llama-4 query scaling
    "mistral4": (f"{P}.mistral4.Mistral4Config", f"{P}.mistral4.Mistral4ForCausalLM",
                 _m(TOKENS, MLA, MOE, n_group=1, topk_group=1, first_k_dense_replace=1,
                    rope_parameters=yarn(llama_4_scaling_beta=0.1, max_position_embeddings=128))),
    # multimodal wrapper (Pixtral vision tower); layers 1 and 3 are NoPE (no_rope_layers), layers 2 and 3 attend to
    # the latent KV of layers 0 and 1 (kv_source_layers), layer 2 reuses layer 1's top-k while layer 3 runs its own
    # indexer; learned rope alpha, a per-head log-position query scale
    "mistral_large4": (f"{P}.mistral_large4.MistralLarge4Config",
                       f"{P}.mistral_large4.MistralLarge4ForConditionalGeneration",
                       dict(text_config=_m(TOKENS, MLA, MOE, DSA, q_lora_rank=None, n_group=1, topk_group=1,
                                           num_hidden_layers=4, kv_source_layers=[0, 1, 0, 1],
                                           indexer_types=["full", "full", "shared", "full"],
                                           first_k_dense_replace=1, no_rope_layers=[1, 0, 1, 0],
                                           rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                            "factor": 4.0, "original_max_position_embeddings": 32,
                                                            "beta_fast": 32.0, "beta_slow": 1.0,
                                                            "attention_factor": 1.0}),
                            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, head_dim=16, image_size=32, patch_size=16),
                            **TOKENS)),
    "youtu": (f"{P}.youtu.YoutuConfig", f"{P}.youtu.YoutuForCausalLM",
              _m(TOKENS, MLA, rope_interleave=True)),
    # Sarvam-105B: a config of its own, the DeepSeek-V3 model (transformers' auto mapping builds
    # DeepseekV3ForCausalLM for it); no q-LoRA, as its checkpoints
    "sarvam_mla": (f"{P}.sarvam_mla.SarvamMLAConfig", f"{P}.deepseek_v3.DeepseekV3ForCausalLM",
                   _m(TOKENS, MLA, MOE, q_lora_rank=None, first_k_dense_replace=1, rope_parameters=yarn())),
    # Kimi-K2.5: a vision tower and a DeepSeek-V3 language model (AutoModel of its text config)
    "kimi_k25": (f"{P}.kimi_k25.Kimi_K25Config", f"{P}.kimi_k25.Kimi_K25ForConditionalGeneration",
                 dict(text_config=_m(TOKENS, MLA, MOE, model_type="deepseek_v3", n_group=2, topk_group=1,
                                     first_k_dense_replace=1, rope_interleave=True, rope_parameters=yarn()),
                      vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, patch_size=14, pos_emb_height=4, pos_emb_width=4),
                      projection_hidden_size=32, image_token_id=VOCAB - 2, video_token_id=VOCAB - 1,
                      vision_start_token_id=VOCAB - 4, vision_end_token_id=VOCAB - 3, tie_word_embeddings=False,
                      **TOKENS)),
}


def mla_layers(config) -> int:
    """How many MLA attention layers a model of this config runs per forward, read off the config:
    the hybrids (Bailing-hybrid, Kimi-Linear) list their layer kinds in `layer_types`, of which the
    "full_attention" ones are MLA (the sparse-attention families call theirs "indexed_attention", dots3_note
    its windowed ones "sliding_attention");
    every other supported family is MLA in each of its `num_hidden_layers` (LongCat-Flash counts its
    two MLA sublayers per decoder layer there). A multimodal config is read through its text config."""
    config = config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return config.num_hidden_layers
    return sum(kind in ("full_attention", "indexed_attention", "sliding_attention") for kind in layer_types)


def indexer_layers(config) -> int:
    """How many layers run their own sparse-attention indexer (DeepSeek Sparse Attention), read off the
    config: every layer of a config with `index_topk`, less the "shared" ones of `indexer_types`
    (GLM-5, HY-V4: they reuse the previous layer's top-k) and the layers `layer_types` does not call
    "indexed_attention"; 0 for dense attention."""
    config = config.get_text_config(decoder=True)
    if not getattr(config, "index_topk", None):
        return 0
    indexer_types = getattr(config, "indexer_types", None)
    layer_types = getattr(config, "layer_types", None)  # (dots3_note: "sliding_attention" layers have none)
    if indexer_types:  # (GLM-5-Next: its linear-attention layers are listed too)
        return sum(kind == "full" and (not layer_types or layer_types[i] == "indexed_attention")
                   for i, kind in enumerate(indexer_types[:config.num_hidden_layers]))
    return layer_types.count("indexed_attention") if layer_types else config.num_hidden_layers


def sparse_layers(config) -> int:
    """How many MLA layers attend to a top-k (their own indexer's or the one a "shared" layer reuses): every layer
    of a config with `index_topk` but those `layer_types` does not call "indexed_attention" (dots3_note's
    sliding-window layers); 0 for dense attention."""
    config = config.get_text_config(decoder=True)
    if not getattr(config, "index_topk", None):
        return 0
    layer_types = getattr(config, "layer_types", None)
    return layer_types.count("indexed_attention") if layer_types else config.num_hidden_layers


def latent_kv_owners(config) -> int:
    """How many MLA layers compute and cache their own latent KV: all of them, but for the layers of
    `kv_source_layers` that attend to an earlier layer's (Mistral-Large-4)."""
    config = config.get_text_config(decoder=True)
    sources = getattr(config, "kv_source_layers", None)
    return mla_layers(config) if sources is None else sum(source == i for i, source in enumerate(sources))


def rope_layers(config) -> int:
    """How many MLA layers have rotary dims: all of them, but for the NoPE layers of `no_rope_layers`
    (Mistral-Large-4, 0 = no RoPE)."""
    config = config.get_text_config(decoder=True)
    flags = getattr(config, "no_rope_layers", None)
    return mla_layers(config) if flags is None else sum(flags[:config.num_hidden_layers])


def ropeless_kv_owners(config) -> int:
    """How many layers owning their latent KV have no rotary dims (their KV path is kv_a_proj + mla.rms_norm:
    the prolog ops need rotary dims): Mistral-Large-4's NoPE layers, every layer of a config without rotary dims
    (GLM-5-Next)."""
    config = config.get_text_config(decoder=True)
    if vars(config).get("qk_rope_head_dim") == 0:  # (read raw: dots3_note's is a per-layer attribute)
        return latent_kv_owners(config)
    flags, sources = getattr(config, "no_rope_layers", None), getattr(config, "kv_source_layers", None)
    if flags is None:
        return 0
    return sum(not flags[i] and (sources is None or sources[i] == i) for i in range(config.num_hidden_layers))


def load(path: str):
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)
