"""What the engine tests share: prompts, the plugin state the default route choice registers on this CPU,
and transformers' stock model as the reference (greedy tokens, teacher-forced logprobs)."""
from __future__ import annotations

import os

import torch

SPARSE_STATE = "sparse MLA -> mla-ops (CPU_MLA_SPARSE)"
# mla-ops' bf16 decode runs its AMX engine (measured faster than vLLM's AMX_MLA) on a CPU with AMX tiles unless
# oneDNN is capped below AMX or the engine is turned off; only then does the default route take AMX_MLA
AMX = bool(torch.cpu._is_amx_tile_supported())
AMX_ENGINE = AMX and "DNNL_MAX_CPU_ISA" not in os.environ and os.environ.get("MLA_OPS_NATIVE_AMX") != "0"
# the plugin's state in every process under the default (measured) route choice
AUTO_STATE = f"registered: CPU_MLA -> mla-ops, AMX_MLA -> {'mla-ops' if AMX_ENGINE else 'vllm'}, {SPARSE_STATE}"

# The DeepSeek-V3.2 test checkpoint (conftest.py `sparse_checkpoint`): 2 layers, 32 positions kept per query
# token (below the long prompts, above the short ones), positions up to 2048.
SPARSE_NUM_LAYERS = 2
INDEX_TOPK = 32


def random_prompts(lengths, seed: int) -> list[list[int]]:
    """Prompts of the given lengths, token ids 3..1023 (the built-in tokenizer's ids past BOS, EOS, PAD)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1024, (n,), generator=gen).tolist() for n in lengths]


def load_transformers_model(model_dir: str, architecture: str, dtype: torch.dtype = torch.float32,
                            index_topk: int | None = None):
    """transformers' stock model for `model_dir` (eager attention: the indexer's top-k folded into the
    attention mask), checked to be `architecture`. `index_topk` replaces every indexer's top-k size (a
    value above the context keeps every position: dense attention with the same weights). Loaded by its class,
    not through the auto classes: vLLM registers its own config classes with `AutoConfig` once it reads a config
    in this process (`vllm/transformers_utils/config.py`: deepseek_v32 -> DeepseekV3Config), after which
    `AutoModelForCausalLM` would build a DeepSeek-V3 from a DeepSeek-V3.2 checkpoint."""
    import transformers

    model_class = getattr(transformers, architecture)
    model = model_class.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    assert type(model.config) is model_class.config_class, type(model.config).__name__
    if index_topk is not None:
        for layer in model.model.layers:
            if layer.self_attn.indexer is not None:  # GLM-5 layers that reuse a top-k have none
                layer.self_attn.indexer.index_topk = index_topk
    return model.eval()


def transformers_greedy(model, prompts, max_tokens: int) -> list[list[int]]:
    """Greedy continuations of `prompts`, exactly `max_tokens` each, one prompt at a time, through the
    model's cache (indexer keys included). EOS is a token like any other, as in the engine with
    `ignore_eos` (`generate(min_new_tokens=...)` would mask it instead and pick the runner-up)."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            step = model(torch.tensor([prompt]), use_cache=True)
            tokens = [int(step.logits[0, -1].argmax())]
            while len(tokens) < max_tokens:
                step = model(torch.tensor([[tokens[-1]]]), past_key_values=step.past_key_values, use_cache=True)
                tokens.append(int(step.logits[0, -1].argmax()))
            out.append(tokens)
    return out


def transformers_logprobs(model, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """fp32 log-softmax `[len(continuation), vocab]` of the model's next-token distribution at each step of
    `continuation`, fed `prompt + continuation` (teacher-forced: the same prefixes the engine saw)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + continuation])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1)
