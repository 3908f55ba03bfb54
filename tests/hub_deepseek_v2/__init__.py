"""A hub-style DeepSeek-V2 model package for the tests: `configuration_deepseek.py` and
`modeling_deepseek.py`, written against the transformers 4.x API that DeepSeek-V2(-Lite)'s published
remote code uses, and `write_checkpoint`, which saves a small seeded model the way such a checkpoint
sits on disk (config.json with auto_map, the two .py files, model.safetensors, a tokenizer), to be
loaded with `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`.

Importing this package imports nothing from transformers: the modeling file only imports on 4.x
(it needs `transformers.modeling_attn_mask_utils`), and 5.x test runs import this package too.
"""
from __future__ import annotations

import importlib
import json
import pathlib
import shutil
from typing import Optional

DIRECTORY = pathlib.Path(__file__).resolve().parent
HUB_FILES = ("configuration_deepseek.py", "modeling_deepseek.py")
# What modeling_deepseek.py takes from transformers 4.x: (module, attribute). Later versions lack some of it:
# 4.54's per-layer caches dropped get_usable_length, 5.10 is_torch_fx_available, 5.24 the mask utilities.
HUB_API = (("transformers.modeling_attn_mask_utils", "_prepare_4d_causal_attention_mask"),
           ("transformers.utils.import_utils", "is_torch_fx_available"),
           ("transformers.cache_utils", "DynamicCache.from_legacy_cache"),
           ("transformers.cache_utils", "DynamicCache.get_usable_length"),
           ("transformers.cache_utils", "DynamicCache.get_max_length"),
           ("transformers.cache_utils", "DynamicCache.seen_tokens"))
BUILTIN_TOKENIZER = DIRECTORY.parents[1] / "mla_ops" / "assets" / "builtin_tokenizer"

# V2-Lite's YaRN as its config.json spells it (4.x "type" key)
LITE_ROPE_SCALING = {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096}

# hidden 64, 4 heads, L 32, R 16, P 32, V 32; 2 layers: dense, then MoE (4 experts, top-2, 1 shared)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
            first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            moe_intermediate_size=32, initializer_range=0.1,
            rope_scaling={**LITE_ROPE_SCALING, "original_max_position_embeddings": 128})
# V2-Lite's attention exactly (hidden 2048, 16 heads, L 512, R 64, P 128, V 128, its YaRN); 2 layers,
# 8 experts of 256 (top-2, 2 shared)
LITE_ATTN = dict(hidden_size=2048, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=16,
                 num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64,
                 qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=1, n_routed_experts=8,
                 num_experts_per_tok=2, n_shared_experts=2, moe_intermediate_size=256, initializer_range=0.02,
                 rope_scaling=LITE_ROPE_SCALING)


def missing_hub_api() -> Optional[str]:
    """The first piece of the transformers 4.x API the hub code uses that the installed transformers
    lacks ("module.attribute"), or None when the hub code can run."""
    for module_name, attribute in HUB_API:
        try:
            obj = importlib.import_module(module_name)
        except ImportError:
            return f"{module_name}.{attribute}"
        for part in attribute.split("."):
            if not hasattr(obj, part):
                return f"{module_name}.{attribute}"
            obj = getattr(obj, part)
    return None


def config_json(sizes: dict, *, vocab_size: int, token_ids: dict, dtype: str = "bfloat16",
                max_position_embeddings: int = 512) -> dict:
    """config.json as the hub checkpoint ships it: DeepSeek-V2-Lite's keys with these sizes, `auto_map`
    to the two remote-code files, `architectures` and `torch_dtype`. max_position_embeddings is kept
    small: every attention layer builds cos/sin caches that long when it is constructed."""
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV2Config",
                     "AutoModel": "modeling_deepseek.DeepseekV2Model",
                     "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM"},
        "model_type": "deepseek_v2", "torch_dtype": dtype, "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings, "attention_bias": False, "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001, "ep_size": 1, "hidden_act": "silu", "moe_layer_freq": 1, "n_group": 1,
        "norm_topk_prob": False, "pretraining_tp": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True, "tie_word_embeddings": False,
        "topk_group": 1, "topk_method": "greedy", "use_cache": True, **token_ids, **sizes,
    }


def save_tokenizer(directory: pathlib.Path):
    """The project's offline tokenizer (1024-token BPE, DeepSeek's special tokens, a chat template)
    saved as a plain PreTrainedTokenizerFast, which every transformers version loads."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(BUILTIN_TOKENIZER / "tokenizer.json"), bos_token="<｜begin▁of▁sentence｜>",
        eos_token="<｜end▁of▁sentence｜>", pad_token="<｜pad｜>",
        model_input_names=["input_ids", "attention_mask"])  # as DeepSeek's tokenizer: generate(**batch) takes it
    tokenizer.chat_template = (BUILTIN_TOKENIZER / "chat_template.jinja").read_text(encoding="utf-8")
    tokenizer.save_pretrained(directory)
    return tokenizer


def write_checkpoint(directory: pathlib.Path, sizes: dict = TINY, *, seed: int = 0, dtype: str = "bfloat16",
                     max_position_embeddings: int = 512) -> pathlib.Path:
    """Save a seeded random hub-style DeepSeek-V2 to `directory`; returns it.

    The model is built by transformers from the copied remote code (AutoModelForCausalLM.from_config,
    trust_remote_code), so the weights' names and shapes are the ones from_pretrained expects. The
    RMSNorm weights are set away from 1, so a norm whose weight is dropped changes the outputs."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name in HUB_FILES:
        shutil.copyfile(DIRECTORY / name, directory / name)
    tokenizer = save_tokenizer(directory)
    token_ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                 "pad_token_id": tokenizer.pad_token_id}
    config = config_json(sizes, vocab_size=len(tokenizer), token_ids=token_ids, dtype=dtype,
                         max_position_embeddings=max_position_embeddings)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    loaded = AutoConfig.from_pretrained(directory, trust_remote_code=True, local_files_only=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(loaded, trust_remote_code=True)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
    state = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory
