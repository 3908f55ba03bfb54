"""vLLM's CPU platform config, amended: a non-bf16 MLA model on a CPU with AMX tiles runs on CPU_MLA.

`vllm/platforms/cpu.py` `CpuPlatform.get_attn_backend_cls` picks AMX_MLA for every MLA model on a CPU with
AMX tiles unless `attention_backend="CPU_MLA"` was asked for, and `check_and_update_config` sizes the
cache for it (block 128). AMX_MLA takes bf16 only (`AMXMLABackend.supported_dtypes`;
`AMXMLAImpl.process_weights_after_loading` raises "expect weight to be bfloat16, ..." for fp32), so
stock vLLM cannot run an fp32 or fp16 MLA model on such a CPU at all. :func:`install` wraps
`check_and_update_config` to make, for those models only, the choice a user would make by hand
(`attention_backend="CPU_MLA"`), and logs it. A backend the user chose is never changed.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger("vllm.mla_ops")


def steer_off_amx(vllm_config) -> str | None:
    """Select CPU_MLA in `vllm_config` when AMX_MLA would be chosen for a model it cannot run.

    Returns the reason when it changed the config, else None."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    model_config = vllm_config.model_config
    attention_config = getattr(vllm_config, "attention_config", None)
    if model_config is None or attention_config is None or not getattr(model_config, "use_mla", False):
        return None
    if getattr(model_config.hf_config, "model_type", None) == "deepseek_v4":  # its own backends (see v4_route)
        return None
    if attention_config.backend is not None or not torch.cpu._is_amx_tile_supported():
        return None
    if model_config.dtype == torch.bfloat16:
        return None
    attention_config.backend = AttentionBackendEnum.CPU_MLA
    reason = (f"dtype {str(model_config.dtype).removeprefix('torch.')} on a CPU with AMX tiles: vLLM's AMX_MLA "
              "takes bfloat16 weights only, so the model runs on CPU_MLA (as attention_backend='CPU_MLA' "
              "selects); use dtype='bfloat16' for AMX_MLA")
    logger.warning("mla-ops vLLM plugin: %s", reason)
    return reason


def install(decisions: dict) -> None:
    """Wrap `CpuPlatform.check_and_update_config` with :func:`steer_off_amx` (idempotent). The wrapper also
    logs the plugin's route `decisions` ({backend: routes.Decision}) once per process: it runs after vLLM
    has set up its log handlers, which the plugin's registration precedes."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config
    if getattr(original, "_mla_ops_wrapped", False):
        return
    original_func = original.__func__
    logged = []

    def check_and_update_config(cls, vllm_config) -> None:
        if not logged:
            logged.append(True)
            for backend, decision in decisions.items():
                logger.info("mla-ops vLLM plugin: %s", decision.describe(backend))
        steer_off_amx(vllm_config)
        return original_func(cls, vllm_config)

    check_and_update_config._mla_ops_wrapped = True
    check_and_update_config.__wrapped__ = original_func
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
