"""Which of a host's MLA decode kernels the plugin replaces, and why: never a downgrade.

vLLM picks one MLA attention backend per platform and CPU (`vllm/platforms/cpu.py`
`CpuPlatform.get_attn_backend_cls`: AMX_MLA where the CPU has AMX tiles, CPU_MLA elsewhere; vllm-ascend
its ASCEND_MLA). The plugin puts `torch.ops.mla.mla_decode_attention` in place of a host's decode kernel
only where it was measured to be at least as fast as that kernel, and only when the mla-ops kernel that
would serve the call is the one that was measured (the C++ `cpu_native` kernel on CPU, an NPU kernel on
Ascend; never the reference composite). `HOST_KERNELS` holds those measurements, one row per host
backend; `decide()` applies them.

DeepSeek-V4 is decided by the same rule at model level (:mod:`mla_ops.integrations.vllm.v4_route`: vLLM's own
DeepSeek-V4 path is kept wherever it can run).

`MLA_OPS_VLLM_ROUTE` forces either choice (read in every process vLLM starts):
  auto      (default) the measured choice below, per host backend
  mla-ops   route every host backend the plugin knows, whatever was measured
  vllm      keep every host kernel (the plugin still registers, logs, and lets fp32 run on an AMX CPU)
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

ENV_ROUTE = "MLA_OPS_VLLM_ROUTE"
ROUTE_MODES = ("auto", "mla-ops", "vllm")
DECODE_OP = "mla_decode_attention"


@dataclasses.dataclass(frozen=True)
class HostKernel:
    """One host backend's decode kernel and what mla-ops measured against it.

    backend: vLLM's name for the attention backend ("CPU_MLA").
    kernel: the host's decode kernel, as the host calls it.
    device_type: where the mla op must run ("cpu" / "npu").
    mla_backend: the mla-ops backend whose decode kernel was measured against `kernel`; the route is
        only taken when this backend serves `mla.mla_decode_attention` on `device_type`.
    faster: whether to route once `mla_backend` serves the decode: that kernel was measured at least as
        fast as the host's in every measured case (ASCEND_MLA: not measured on hardware, so not routed
        by default).
    measured: the measurement, in words: ratios, shapes, CPU flags and the command that reproduces it.
    engine: the `cpu_native` tile engine of the bf16 decode that was measured (`cpu_native.attention_engine`),
        when the win depends on it: the route is only taken when that engine serves bf16 decode here.
    """

    backend: str
    kernel: str
    device_type: str
    mla_backend: str
    faster: bool
    measured: str
    engine: Optional[str] = None


# `measured` says where the comparison behind `faster` is recorded; the numbers themselves live in the
# result files that docs/performance.md renders (bf16 and fp32, V2-Lite attention dims: 16 heads,
# latent 512 + rope 64, the same cache memory, side by side in one run).
HOST_KERNELS: dict[str, HostKernel] = {row.backend: row for row in (
    HostKernel(
        "CPU_MLA", "torch.ops._C.mla_decode_kvcache (vllm csrc/cpu/mla_decode.cpp)", "cpu", "cpu_native", True,
        "cpu_native decode measured faster than vLLM's CPU_MLA kernel on AVX2-only and AVX-512 CPUs, and "
        "faster in the engine (docs/performance.md: `mla-ops bench ops --against vllm`, "
        "`mla-ops bench vllm --preset v2-lite-attention`)"),
    HostKernel(
        "AMX_MLA", "torch.ops._C.decode_attention_cpu (SGLang's AMX decode, vllm csrc/cpu/sgl-kernels)", "cpu",
        "cpu_native", True,
        "cpu_native decode on its AMX engine measured faster than vLLM's AMX_MLA kernel on an AMX CPU "
        "(docs/performance.md: `python -m mla_ops.bench.native`)",
        engine="amx"),
    HostKernel(
        "ASCEND_MLA", "torch_npu.npu_fused_infer_attention_score_v2 (vllm-ascend attention/mla_v1.py)", "npu",
        "npu", False,
        "not measured: mla-ops' NPU decode (torch_npu's same fused kernel, given the block table's whole width "
        "with seq_lens as a device-built mask, since torch_npu takes the lengths as a host list) has not run on "
        "Ascend hardware, so it is not known to be at least as fast as vllm-ascend's call with the host's "
        "lengths"),
)}


@dataclasses.dataclass(frozen=True)
class Decision:
    route: bool  # True: mla-ops' decode replaces the host's kernel
    reason: str  # why, in words, for the log and for `register()`'s state

    def describe(self, backend: str) -> str:
        verdict = "decode -> torch.ops.mla.mla_decode_attention" if self.route else "decode stays vLLM's"
        return f"{backend} {verdict} ({self.reason})"


def route_mode() -> str:
    """`MLA_OPS_VLLM_ROUTE`, validated: one of ROUTE_MODES (default "auto")."""
    mode = os.environ.get(ENV_ROUTE, "auto").strip().lower() or "auto"
    if mode not in ROUTE_MODES:
        raise ValueError(f"{ENV_ROUTE}={os.environ[ENV_ROUTE]!r} is not one of {', '.join(ROUTE_MODES)}; "
                         f"unset it for the measured choice")
    return mode


def serving_decode_backend(device_type: str) -> str:
    """The mla-ops backend that would serve `mla.mla_decode_attention` on `device_type` now (the first
    automatic candidate, or the one MLA_OPS_BACKEND demands): "cpu_native", "npu", "reference", ..."""
    from ...backends import candidates

    options = candidates(DECODE_OP, device_type)
    return options[0].name if options else "reference"


def bf16_decode_engine() -> str:
    """The `cpu_native` tile engine a bf16 decode at V2-Lite's attention dims runs on this machine now
    ("amx", "avx512_bf16", "fp32"), or "unavailable" without the native extension."""
    import torch

    from ...backends import cpu_native

    if cpu_native.load() is None:
        return "unavailable"
    q_latent = torch.empty(1, 16, 512, dtype=torch.bfloat16)
    key_cache = torch.empty(1, 64, 1, 512, dtype=torch.bfloat16)
    value_cache = torch.empty(1, 64, 1, 64, dtype=torch.bfloat16)
    return cpu_native.attention_engine(q_latent, key_cache, value_cache)


def decide(backend: str) -> Decision:
    """Whether the plugin replaces host backend `backend`'s decode kernel, and why."""
    host = HOST_KERNELS[backend]
    mode = route_mode()
    serving = serving_decode_backend(host.device_type)
    if mode == "vllm":
        return Decision(False, f"{ENV_ROUTE}=vllm keeps {host.kernel}")
    if mode == "mla-ops":
        return Decision(True, f"forced by {ENV_ROUTE}=mla-ops; served by mla-ops' {serving} kernel")
    if serving != host.mla_backend:
        return Decision(False, f"mla-ops' decode on {host.device_type} would run its {serving} kernel; the route "
                               f"needs its {host.mla_backend} kernel ({host.measured}); {ENV_ROUTE}=mla-ops "
                               "routes it anyway")
    if host.engine is not None and (engine := bf16_decode_engine()) != host.engine:
        return Decision(False, f"mla-ops' bf16 decode here runs its {engine} engine; the route needs its "
                               f"{host.engine} engine ({host.measured}); {ENV_ROUTE}=mla-ops routes it anyway")
    if not host.faster:
        return Decision(False, f"{host.kernel} is kept: {host.measured}; {ENV_ROUTE}=mla-ops routes "
                               "it anyway")
    return Decision(True, host.measured)
