"""The ``npu`` backend (Ascend, PrivateUse1): torch_npu stage-1 ops + PyPTO kernels.

Nothing here imports torch_npu or pypto at import time; the kernels import them when called (an NPU
tensor exists only once torch_npu is imported). The kernels are bound to PrivateUse1 whether or not
torch_npu was imported before mla_ops.

Policy (plain functions, testable on any machine):
* kv_prolog: B*S tokens <= `MLA_OPS_NPU_FUSED_MAX_TOKENS` (default 16) and the PyPTO stage-2 kernel
  able to take the call (its own reasons: pypto 0.2.0 importable, fp16/bf16, dims, devices, fp32
  rotation — rope_compute_dtype="float32"; memoised per call signature) -> stage 1 with torch_npu
  (matmul, split, npu_rms_norm) + the PyPTO stage-2 kernel; otherwise the torch_npu baseline composite
  (the same stage 1, stage 2 as framework ops, which also round RoPE in the activation dtype).
  Token counts and the reasons depend on shapes and dtypes only, so the choice needs no host
  synchronisation and is frozen into a captured aclgraph.
* gather_pa_kv_cache: the PyPTO kernel, with the large-token tile when heads*dim > 4096.

Both ops fall back, never raise, when their PyPTO kernel cannot take a call (any pypto other than
0.2.0, pypto missing, an unsupported dtype or shape): kv_prolog to this backend's own torch_npu
baseline (inside the kernel: the baseline is NPU code, so the npu backend still serves the call, also
under MLA_OPS_BACKEND=npu), gather to the reference kernel (through the backend layer, via
`reasons=`: the npu backend has no other gather, so an explicit MLA_OPS_BACKEND=npu demand for a
gather it cannot serve is refused with the reasons, as for every backend). `explain()` names the path
either way (`fused_kv_prolog_reasons` for kv_prolog).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from .._checks import memo_by_signature
from .._optional import has_module
from ..kernels.pypto.gather_pa_kv_cache import gather_pa_kv_cache as pypto_gather
from ..kernels.pypto.gather_pa_kv_cache import gather_pa_kv_cache_not_supported_reasons
from ..kernels.pypto.kv_prolog_stage2 import kv_prolog_stage2
from ..ops.gather_pa_kv_cache import functional_gather
from ..ops.kv_prolog import expand_latent
from ..ops.rope import rope_math
from ..settings import settings
from . import Backend
from .staged_kv_prolog import stage2_not_supported_reasons, staged_kv_prolog


def _unavailable() -> Optional[str]:
    return None if has_module("torch_npu") else "torch_npu is not installed"


NPU = Backend("npu", "Ascend NPU: torch_npu stage-1 ops + PyPTO kernels, fused for short token counts", ("npu",),
              _unavailable, auto_priority=0)  # the automatic choice on NPU tensors


def use_fused_kv_prolog(num_tokens: int, max_fused_tokens: int) -> bool:
    """Short token counts (decode, short prefill) -> the PyPTO stage-2 kernel; long ones -> the
    torch_npu baseline, as the original sample measured ("<= 20 tokens: PyPTO +5.9%, > 20:
    baseline +10.6%"); the default threshold is 16 (MLA_OPS_NPU_FUSED_MAX_TOKENS). No tokens: the
    baseline, which handles empty inputs without launching a kernel."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return 0 < num_tokens <= max_fused_tokens


def _npu_stage1(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, eps):
    """kv_a matmul, split and RMSNorm with torch_npu's native ops: (latent [B,S,L], k_pe view [B,S,R])."""
    import torch_npu

    lora = kv_norm_weight.shape[0]
    compressed = F.linear(hidden_states, kv_a_weight, kv_a_bias)
    ckv, k_pe = torch.split(compressed, [lora, compressed.shape[-1] - lora], dim=-1)
    # ckv is a strided view (row stride L+R). npu_rms_norm takes it as is: torch_npu routes it to
    # aclnnRmsNorm, and the aclnn (opapi) path of Ascend/op-plugin hands view strides to the
    # operator, which makes any copy it needs itself; its documentation
    # (op-plugin docs, torch_npu.npu_rms_norm: "self: Tensor, 1-8 dims") states no contiguity
    # requirement. A `.contiguous()` here would be a second, avoidable [T, L] copy per layer.
    latent = torch_npu.npu_rms_norm(ckv, kv_norm_weight, epsilon=eps)[0]
    return latent, k_pe


def baseline_stage2(latent, k_pe, kv_b_weight, cos, sin, *, num_heads, qk_nope_head_dim, v_head_dim, rope_layout,
                    rope_compute_dtype="float32"):
    """Stage 2 as framework ops on token-major inputs (the torch_npu baseline composite)."""
    tokens = latent.shape[0]
    k_nope, value = expand_latent(latent.view(1, tokens, -1), kv_b_weight, num_heads, qk_nope_head_dim, v_head_dim)
    k_pe_rot = rope_math(k_pe, cos, sin, rope_layout, rope_compute_dtype)
    return k_nope[0].transpose(0, 1).contiguous(), value[0].transpose(0, 1).contiguous(), k_pe_rot


@memo_by_signature
def _stage2_reasons(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin, *, num_heads,
                    qk_nope_head_dim, v_head_dim, eps=1e-6, rope_layout="interleaved", rope_compute_dtype="float32"):
    # Memoised per call signature: decode asks the same question every step and layer, and the
    # stage-2 reasons cost tens of microseconds. (pypto's version is cached separately, in
    # pypto_runtime.compat, so not even a first call per signature reads package metadata again.)
    return stage2_not_supported_reasons(hidden_states, kv_a_weight, kv_norm_weight, kv_b_weight,
                                        num_heads=num_heads, qk_nope_head_dim=qk_nope_head_dim,
                                        v_head_dim=v_head_dim, rope_layout=rope_layout,
                                        rope_compute_dtype=rope_compute_dtype, mode="npu")


def fused_kv_prolog_reasons(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin, *,
                            num_heads, qk_nope_head_dim, v_head_dim, eps=1e-6, rope_layout="interleaved",
                            rope_compute_dtype="float32") -> list[str]:
    """Why this kv_prolog call takes the torch_npu baseline instead of the fused PyPTO stage 2
    (empty: fused). Shapes, dtypes and devices only: no host synchronisation."""
    tokens = hidden_states.shape[0] * hidden_states.shape[1]
    if not use_fused_kv_prolog(tokens, settings.npu_fused_max_tokens):
        return [f"{tokens} tokens (the fused stage 2 serves 1..{settings.npu_fused_max_tokens}, "
                f"MLA_OPS_NPU_FUSED_MAX_TOKENS)"]
    return _stage2_reasons(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin,
                           num_heads=num_heads, qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim, eps=eps,
                           rope_layout=rope_layout, rope_compute_dtype=rope_compute_dtype)


fused_kv_prolog_reasons.cache_clear = _stage2_reasons.cache_clear  # after a change of what they depend on


def _kv_prolog_path(*args, **kwargs) -> str:
    reasons = fused_kv_prolog_reasons(*args, **kwargs)
    if not reasons:
        return "fused: torch_npu stage 1 + PyPTO stage 2"
    return "torch_npu baseline (not the fused PyPTO stage 2: " + "; ".join(reasons) + ")"


@NPU.kernel("kv_prolog", path=_kv_prolog_path)
def kv_prolog(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos, sin, *, num_heads,
              qk_nope_head_dim, v_head_dim, eps=1e-6, rope_layout="interleaved", rope_compute_dtype="float32"):
    fused = not fused_kv_prolog_reasons(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight, cos,
                                        sin, num_heads=num_heads, qk_nope_head_dim=qk_nope_head_dim,
                                        v_head_dim=v_head_dim, eps=eps, rope_layout=rope_layout,
                                        rope_compute_dtype=rope_compute_dtype)
    if fused:  # (the fused kernel rotates in fp32: its reasons refuse rope_compute_dtype="activation")
        # looked up at call time (not bound at import) so that a test can stand in for the launch
        stage2 = functools.partial(kv_prolog_stage2, mode="npu")
    else:
        stage2 = functools.partial(baseline_stage2, rope_compute_dtype=rope_compute_dtype)
    return staged_kv_prolog(_npu_stage1, stage2, hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, kv_b_weight,
                            cos, sin, num_heads=num_heads, qk_nope_head_dim=qk_nope_head_dim,
                            v_head_dim=v_head_dim, eps=eps, rope_layout=rope_layout)


_gather_reasons = functools.partial(gather_pa_kv_cache_not_supported_reasons, mode="npu")


@NPU.kernel("gather_pa_kv_cache", reasons=_gather_reasons)
def gather_pa_kv_cache(key_cache, value_cache, block_tables, seq_lens, key, value, *, seq_offset=None,
                       is_seq_lens_cumsum=False):
    """The PyPTO gather (no host sync: values are validated only through the Python helpers'
    validate=True; the kernel clamps out-of-range ids instead of reading out of bounds)."""
    pypto_gather(key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset=seq_offset,
                 is_seq_lens_cumsum=is_seq_lens_cumsum, mode="npu")


NPU.kernel("gather_pa_kv_cache_functional", reasons=_gather_reasons)(functional_gather(gather_pa_kv_cache))


def warmup_token_counts() -> tuple[int, ...]:
    return settings.npu_warmup_tokens


def warmup(model, *, rope_layout: str = "interleaved", rope_compute_dtype: str = "float32") -> None:
    """Compile the fused kv_prolog kernels for the token counts decode uses (1 and 2 by default),
    with the first attention layer's weights, before generation starts (as the original script).

    `rope_layout` and `rope_compute_dtype` must be the ones the patched attention calls kv_prolog
    with ("half" for the hub remote code): kernels are compiled per layout, and a call rotating in the
    activation dtype takes the baseline, which has nothing to compile."""
    attn = next(m for m in model.modules() if hasattr(m, "kv_a_proj_with_mqa"))
    kv_a, norm, kv_b = attn.kv_a_proj_with_mqa, attn.kv_a_layernorm, attn.kv_b_proj
    device, dtype = kv_a.weight.device, kv_a.weight.dtype
    rope_half = attn.qk_rope_head_dim // 2
    with torch.no_grad():
        for tokens in warmup_token_counts():
            hidden = torch.randn(1, tokens, kv_a.weight.shape[1], device=device, dtype=dtype)
            cos = torch.ones(1, tokens, rope_half, device=device)
            sin = torch.zeros(1, tokens, rope_half, device=device)
            torch.ops.mla.kv_prolog(hidden, kv_a.weight, kv_a.bias, norm.weight, kv_b.weight, cos, sin,
                                    num_heads=attn.num_heads, qk_nope_head_dim=attn.qk_nope_head_dim,
                                    v_head_dim=attn.v_head_dim, eps=norm.variance_epsilon, rope_layout=rope_layout,
                                    rope_compute_dtype=rope_compute_dtype)
