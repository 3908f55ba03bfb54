"""DeepSeek-V2 model configurations used by the CLI, the benchmarks and the tests (random weights;
nothing is downloaded). transformers is imported on call, not at `import mla_ops`."""
from __future__ import annotations

# DeepSeek-V2-Lite(-Chat)'s config.json as published on the Hub (remote-code keys kept).
LITE_CONFIG_JSON = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "ep_size": 1,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
    "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
    "num_hidden_layers": 27, "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
}


def yarn_rope_parameters(original_max_position_embeddings: int = 4096) -> dict:
    """DeepSeek-V2-Lite's YaRN RoPE in transformers 5.x spelling."""
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 0.707, "mscale_all_dim": 0.707,
            "original_max_position_embeddings": original_max_position_embeddings}


def tiny_config(**overrides):
    """hidden 64, 2 layers (dense + MoE with 4 experts, top-2), 4 heads, L 32, R 16, P 32, V 32."""
    from transformers import DeepseekV2Config

    cfg = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
               v_head_dim=32, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
               n_shared_experts=1, moe_intermediate_size=32, max_position_embeddings=40 * 128,
               rope_parameters=yarn_rope_parameters(128), bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.update(overrides)
    return DeepseekV2Config(**cfg)


def lite_attn_config(**overrides):
    """DeepSeek-V2-Lite's exact attention (hidden 2048, 16 heads, L 512, R 64, P 128, V 128, YaRN)
    with 2 layers, a small MoE (8 experts of 256, top-2, 2 shared) and vocab 1024."""
    from transformers import DeepseekV2Config

    cfg = dict(vocab_size=1024, hidden_size=2048, intermediate_size=1024, num_hidden_layers=2,
               num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
               qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=1,
               n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, moe_intermediate_size=256,
               max_position_embeddings=163840, rope_parameters=yarn_rope_parameters(), rms_norm_eps=1e-6,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.update(overrides)
    return DeepseekV2Config(**cfg)


def family_attn_config(model_type: str = "deepseek_v2", **overrides):
    """DeepSeek-V2-Lite's attention dims (hidden 2048, 16 heads, L 512, R 64, P 128, V 128) on the config
    of another transformers MLA family (`model_type`), 2 layers with dense MLPs, vocab 1024, each
    family's own RoPE defaults (a sparse family's own indexer: DeepSeek-V3.2's 64 x 128, top-2048, and a
    query LoRA of rank 1536); `deepseek_v2` is `lite_attn_config()`."""
    if model_type == "deepseek_v2":
        return lite_attn_config(**overrides)
    from transformers import AutoConfig

    cfg = dict(vocab_size=1024, hidden_size=2048, intermediate_size=1024, num_hidden_layers=2,
               num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
               qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=2,
               max_position_embeddings=8192 + 64, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if getattr(AutoConfig.for_model(model_type), "index_topk", None) is not None:
        # a sparse-attention family: its indexer reads the query LoRA's output, so the query has one
        # (DeepSeek-V3.2's rank)
        cfg["q_lora_rank"] = 1536
    cfg.update(overrides)
    return AutoConfig.for_model(model_type, **cfg)


def build_model(config, dtype=None, attn: str = "sdpa", seed: int = 0):
    """A randomly initialised causal LM of `config`'s family (DeepSeek-V2 by default; seeded), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype or torch.float32).eval()
