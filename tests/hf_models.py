"""Small transformers DeepSeek-V2 configs used across the tests (random weights, no download)."""
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM


def yarn_rope_parameters(original_max: int = 4096):
    """DeepSeek-V2-Lite's YaRN settings in transformers 5.x spelling."""
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": original_max}


def tiny_config(**overrides) -> DeepseekV2Config:
    """hidden 64, 2 layers (dense + MoE with 4 experts, top-2), 4 heads, L 32, R 16, P 32, V 32."""
    cfg = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
               v_head_dim=32, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
               n_shared_experts=1, moe_intermediate_size=32, max_position_embeddings=40 * 128,
               rope_parameters=yarn_rope_parameters(128), bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.update(overrides)
    return DeepseekV2Config(**cfg)


def lite_attn_config(**overrides) -> DeepseekV2Config:
    """DeepSeek-V2-Lite's exact attention dims (hidden 2048, 16 heads, L 512, R 64, P 128, V 128,
    YaRN) with 2 layers, a small MoE (8 experts, top-2) and vocab 1024."""
    cfg = dict(vocab_size=1024, hidden_size=2048, intermediate_size=1024, num_hidden_layers=2,
               num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
               qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=1,
               n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, moe_intermediate_size=256,
               max_position_embeddings=163840, rope_parameters=yarn_rope_parameters(), rms_norm_eps=1e-6,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.update(overrides)
    return DeepseekV2Config(**cfg)


def build_model(config: DeepseekV2Config, dtype=torch.float32, attn: str = "sdpa", seed: int = 0):
    torch.manual_seed(seed)
    config._attn_implementation = attn
    return DeepseekV2ForCausalLM(config).to(dtype).eval()
