"""The ``npu`` backend (Ascend, PrivateUse1): torch_npu ops + PyPTO kernels.

Nothing here imports torch_npu or pypto at import time; the kernels import them when called (an NPU
tensor exists only once torch_npu is imported). The backend layer serves NPU tensors with them whether or
not torch_npu was imported before mla_ops.

Policy (plain functions, testable on any machine):
* kv_prolog: B*S tokens <= `MLA_OPS_NPU_FUSED_MAX_TOKENS` (default 16) and the PyPTO stage-2 kernel
  able to take the call (its own reasons: pypto 0.2.0 importable, fp16/bf16, dims, devices, fp32
  rotation — rope_compute_dtype="float32"; memoised per call signature) -> stage 1 with torch_npu
  (matmul, split, npu_rms_norm) + the PyPTO stage-2 kernel; otherwise the torch_npu baseline composite
  (the same stage 1, stage 2 as framework ops, which also round RoPE in the activation dtype).
  Token counts and the reasons depend on shapes and dtypes only, so the choice needs no host
  synchronisation and is frozen into a captured aclgraph.
* gather_pa_kv_cache: the PyPTO kernel, with the large-token tile when heads*dim > 4096.
* lightning_indexer / sparse_mla_attention: torch_npu's fused `npu_lightning_indexer` and
  `npu_sparse_flash_attention` (TND queries over PA_BSND caches), within their documented limits.
* shared_kv_attention (DeepSeek-V4): CANN's `sparse_flash_mla` (the cann_ops_transformer extension),
  within its Atlas A2/A3 limits; the other V4 ops (prologs, compressor, the indexer over compressed
  keys, which torch_npu's indexer cannot mask) run the reference kernels on the NPU.
* mla_decode_attention: torch_npu's `npu_fused_infer_attention_score_v2` in its MLA form (one query
  token, page attention), the lengths as a device-built mask over the whole block table.
* scatter_pa_kv_cache / scatter_pa_cache: torch_npu's `npu_scatter_nd_update_` with [block, offset]
  indices, padding slots redirected on the device.
* q_prolog / latent_kv_prolog: composites of torch_npu ops (npu_rms_norm for the norms); torch_npu's
  fused `npu_mla_prolog_v2/_v3` compute something else (see the prolog section).

The PyPTO ops fall back, never raise, when their PyPTO kernel cannot take a call (any pypto other than
0.2.0, pypto missing, an unsupported dtype or shape): kv_prolog to this backend's own torch_npu
baseline (inside the kernel: the baseline is NPU code, so the npu backend still serves the call, also
under MLA_OPS_BACKEND=npu), gather to the reference kernel (through the backend layer, via
`reasons=`: the npu backend has no other gather, so an explicit MLA_OPS_BACKEND=npu demand for a
gather it cannot serve is refused with the reasons, as for every backend). The torch_npu kernels
declare their documented limits the same way (`reasons=`). `explain()` names the path either way
(`fused_kv_prolog_reasons` for kv_prolog).
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
from ..ops.sparse_attention import token_positions, token_requests
from ..settings import settings
from . import Backend
from .staged_kv_prolog import stage2_not_supported_reasons, staged_kv_prolog


def _unavailable() -> Optional[str]:
    return None if has_module("torch_npu") else "torch_npu is not installed"


NPU = Backend("npu", "Ascend NPU: torch_npu ops (fused attention, cache scatter, prologs) + PyPTO kernels", ("npu",),
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


# ---------------------------------------------------------------------------------- sparse attention
# The limits below are those of the op-plugin documentation (Ascend/op-plugin,
# docs/zh/custom_APIs/torch_npu/torch_npu-npu_lightning_indexer.md and
# torch_npu-npu_sparse_flash_attention.md at master 517f2e7d0f20, 2026-08-21; schemas in
# op_plugin/config/op_plugin_functions.yaml, the same since the ops were added in 5c964309, 2025-11-21,
# and on the 7.3.0 / 26.0.0 / 26.1.0 branches), for Atlas A2/A3 where the chips differ. The calling
# convention is vllm-ascend's (vllm_ascend/device/device_op.py at 182b75ea84ff: TND query, PA_BSND
# caches, actual_seq_lengths_query = cumulative query counts without the leading 0,
# actual_seq_lengths_key/kv = per-request cached lengths).
_NPU_FLOATS = (torch.float16, torch.bfloat16)
_INDEXER_HEAD_DIM = 128
_INDEXER_MAX_HEADS = 64          # A2/A3 ("N1 <= 64"; the Ascend 950 takes only 8/16/24/32/64)
_SPARSE_COUNTS = "1..2048, 3072, 4096, 5120, 6144, 7168, 8192"
_SFA_LATENT, _SFA_ROPE = 512, 64
_SFA_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)  # A2/A3
_MAX_PA_BLOCK = 1024


def _sparse_count_supported(count: int) -> bool:
    return 1 <= count <= 2048 or count in (3072, 4096, 5120, 6144, 7168, 8192)


def _paged_block_reasons(name: str, cache) -> list[str]:
    """PA_BSND: block_size a multiple of 16, at most 1024; the cache contiguous (A2/A3 take no
    strided key; a `.contiguous()` here would copy the whole cache every call)."""
    reasons = []
    block_size = cache.shape[1]
    if block_size % 16 or block_size > _MAX_PA_BLOCK:
        reasons.append(f"{name} block_size {block_size} (torch_npu's paged layout takes multiples of 16 up to "
                       f"{_MAX_PA_BLOCK})")
    if not cache.is_contiguous():
        reasons.append(f"{name} is not contiguous (torch_npu on Atlas A2/A3 takes contiguous caches only)")
    return reasons


def lightning_indexer_reasons(q, weights, k_cache, block_tables, seq_lens, query_start_loc, topk,
                              softmax_scale, compress_ratio=1) -> list[str]:
    """Why torch_npu.npu_lightning_indexer cannot serve this call (shapes and dtypes only)."""
    reasons = []
    if compress_ratio != 1:
        reasons.append(f"compress_ratio {compress_ratio} (torch_npu's lightning indexer scores one key per token; "
                       f"its causal mask cannot express the compressed entries' visibility w < (p + 1) // m)")
    if q.dtype not in _NPU_FLOATS:
        reasons.append(f"dtype {q.dtype} (torch_npu's lightning indexer takes float16/bfloat16)")
    if q.shape[2] != _INDEXER_HEAD_DIM:
        reasons.append(f"index_head_dim {q.shape[2]} (torch_npu's lightning indexer takes {_INDEXER_HEAD_DIM})")
    if q.shape[1] > _INDEXER_MAX_HEADS:
        reasons.append(f"{q.shape[1]} index heads (torch_npu's lightning indexer takes at most "
                       f"{_INDEXER_MAX_HEADS})")
    if not _sparse_count_supported(topk):
        reasons.append(f"topk {topk} (torch_npu's sparse_count takes {_SPARSE_COUNTS})")
    return reasons + _paged_block_reasons("k_cache", k_cache)


def _lightning_indexer_path(*args, **kwargs) -> str:
    return ("torch_npu.npu_lightning_indexer (softmax_scale folded into the weights; order within the top-k "
            "not guaranteed by its documentation; among equal scores at the k-th place its choice is its own)")


@NPU.kernel("lightning_indexer", reasons=lightning_indexer_reasons, path=_lightning_indexer_path)
def lightning_indexer(q, weights, k_cache, block_tables, seq_lens, query_start_loc, topk, softmax_scale,
                      compress_ratio=1):
    """torch_npu.npu_lightning_indexer: q [T, H<=64, 128] fp16/bf16, weights [T, H], k_cache
    [NB, bs, 1, 128] -> int32 [T, topk] request-local positions, -1 past the p + 1 a token at position
    p can see.

    * Scale: torch_npu's indexer has no scale argument (score = sum_h w_h * relu(q_h . k)); the op's
      softmax_scale s > 0 is folded into the weights, since relu(s * x) = s * relu(x). The weights are
      scaled in fp32 and handed over in their own dtype (fp32 or q's): rounding fp32 weights to bf16
      would change which positions make the top-k. fp32 weights are documented for A2/A3 since the
      page's 2026-03 revisions (earlier ones, e.g. c2447e25, list bf16/fp16 only; the Ascend 950 takes
      no fp32 weights).
    * Order: the documentation promises the top-`sparse_count` set, not an order; its own test
      compares against a descending (unstable) torch.sort. So where no equal scores straddle the
      k-th place the positions are the op's, possibly in another order; where they do, which of the
      tied positions it keeps is its own, not the op's "lower position first".
    * Invalid entries: the documentation does not say what fills the slots past the visible count (its
      test writes masked positions there), so anything outside 0..p becomes -1 here.
    No host synchronisation: conversions are tensor ops of static shapes."""
    import torch_npu

    num_tokens = q.shape[0]
    if num_tokens == 0:  # torch_npu refuses empty queries; nothing to select
        return torch.full((0, topk), -1, dtype=torch.int32, device=q.device)
    scaled = (weights.float() * softmax_scale).to(weights.dtype).contiguous()
    indices = torch_npu.npu_lightning_indexer(
        q.contiguous(), k_cache, scaled,
        actual_seq_lengths_query=query_start_loc[1:].to(torch.int32),  # TND: cumulative, no leading 0
        actual_seq_lengths_key=seq_lens.to(torch.int32),               # PA_BSND: per request
        block_table=block_tables.to(torch.int32),
        layout_query="TND", layout_key="PA_BSND", sparse_count=topk, sparse_mode=3)[0]
    indices = indices.reshape(num_tokens, topk)  # [T, N2=1, sparse_count]
    _, position = token_positions(seq_lens, query_start_loc, num_tokens)
    visible = (indices >= 0) & (indices <= position[:, None])
    return torch.where(visible, indices, -1).to(torch.int32)


def sparse_mla_attention_reasons(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                 topk_indices, softmax_scale, sinks=None, q_scale=None) -> list[str]:
    """Why torch_npu.npu_sparse_flash_attention cannot serve this call (shapes and dtypes only)."""
    reasons = _sink_reasons("sparse flash attention (npu_sparse_flash_attention)", sinks, q_scale)
    if q_latent.dtype not in _NPU_FLOATS:
        reasons.append(f"dtype {q_latent.dtype} (torch_npu's sparse flash attention takes float16/bfloat16)")
    if q_latent.shape[2] != _SFA_LATENT or q_pe.shape[2] != _SFA_ROPE:
        reasons.append(f"kv_lora_rank {q_latent.shape[2]} / rope_dim {q_pe.shape[2]} (torch_npu's sparse flash "
                       f"attention takes {_SFA_LATENT} / {_SFA_ROPE})")
    if q_latent.shape[1] not in _SFA_HEADS:
        reasons.append(f"{q_latent.shape[1]} heads (torch_npu's sparse flash attention takes "
                       f"{'/'.join(map(str, _SFA_HEADS))} on Atlas A2/A3)")
    if topk_indices.shape[1] == 0:
        reasons.append("topk width 0 (torch_npu's sparse_indices must not be empty)")
    return reasons + _paged_block_reasons("key_cache", key_cache) + _paged_block_reasons("value_cache", value_cache)


@NPU.kernel("sparse_mla_attention", reasons=sparse_mla_attention_reasons,
            path=lambda *a, **k: "torch_npu.npu_sparse_flash_attention (MLA-absorb, sparse_mode=0)")
def sparse_mla_attention(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                         topk_indices, softmax_scale, sinks=None, q_scale=None):
    """torch_npu.npu_sparse_flash_attention in MLA-absorb mode (attention_mode=2): query = q_latent
    [T, N, 512], query_rope = q_pe [T, N, 64], key = value = key_cache [NB, bs, 1, 512] (the latent),
    key_rope = value_cache [NB, bs, 1, 64] (k_pe) -> o_latent [T, N, 512] in q's dtype.

    * Indices: [T, K] request-local positions -> sparse_indices [T, 1, K] int32. The documentation
      wants every row's valid entries first and -1s after (its reference stops at the first -1), the
      op takes any order: positions that are not a cached position of the token's request become -1
      and a stable sort moves the valid ones to the front, keeping their order.
    * sparse_mode=0 ("only the sparse selection, no extra causal mask"), not vllm-ascend's 3: the op
      attends to exactly the listed positions, also one after the token's own (which 3 would mask);
      for the indexer's output, which lists none, both agree.
    * A token with no valid position gets zeros (the op's contract; the documentation leaves it open).
    * Numerics: the kernel's (P rounding and accumulation order may differ from the reference's).
    No host synchronisation: conversions are tensor ops of static shapes."""
    import torch_npu

    num_tokens = q_latent.shape[0]
    if num_tokens == 0:  # torch_npu refuses empty queries
        return q_latent.new_zeros(q_latent.shape)
    request = token_requests(query_start_loc, num_tokens)
    indices = topk_indices.to(torch.int32)
    valid = (indices >= 0) & (indices < seq_lens.to(torch.int32)[request][:, None])
    front = torch.sort((~valid).to(torch.int32), dim=-1, stable=True).indices  # valid entries first
    sparse_indices = torch.gather(torch.where(valid, indices, -1), 1, front).unsqueeze(1).contiguous()
    out = torch_npu.npu_sparse_flash_attention(
        q_latent.contiguous(), key_cache, key_cache, sparse_indices, float(softmax_scale),
        block_table=block_tables.to(torch.int32),
        actual_seq_lengths_query=query_start_loc[1:].to(torch.int32),  # TND: cumulative, no leading 0
        actual_seq_lengths_kv=seq_lens.to(torch.int32),                # PA_BSND: per request
        query_rope=q_pe.contiguous(), key_rope=value_cache, sparse_block_size=1,
        layout_query="TND", layout_kv="PA_BSND", sparse_mode=0, attention_mode=2)[0]
    return torch.where(valid.any(dim=1)[:, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


# ------------------------------------------------------------------------------ shared-KV attention
# CANN's `sparse_flash_mla` (the cann_ops_transformer torch extension of hicann/ops-transformer), within
# the limits of attention/sparse_flash_mla/docs/torchapi_sparse_flash_mla.md (1a6406de): DeepSeek-V4's
# attention with K = V, a band over `ori_kv` and compressed entries in `cmp_kv` (all visible ones: HCA;
# those in `cmp_sparse_indices`: CSA), sinks in the softmax denominator. Where the products differ the
# Atlas A2/A3 limits are taken (the Ascend 950 takes more): a 128-token window, CSA ratio 4 and HCA 128,
# query heads a power of two, PA block sizes a multiple of 16 up to 1024, at most 8192 listed entries.
# vllm-ascend calls its own `_C_ascend.npu_sparse_attn_sharedkv` for V4 (vllm_ascend/attention/dsa_v1.py
# at 182b75ea); CANN's op is the public API with the same arguments.
_SFM_HEAD_DIM, _SFM_WINDOW, _SFM_CSA_RATIO, _SFM_HCA_RATIO, _SFM_MAX_TOPK = 512, 128, 4, 128, 8192


def shared_kv_attention_reasons(q, kv_cache, block_tables, seq_lens, query_start_loc, sinks, softmax_scale,
                                sliding_window, compressed_cache=None, compressed_block_tables=None,
                                compress_ratio=1, topk_indices=None) -> list[str]:
    """Why CANN's sparse_flash_mla cannot serve this call (shapes, dtypes and arguments only)."""
    reasons = [] if has_module("cann_ops_transformer") else [
        "cann_ops_transformer (CANN ops-transformer's torch extension, which has sparse_flash_mla) is not installed"]
    if q.dtype not in _NPU_FLOATS:
        reasons.append(f"dtype {q.dtype} (sparse_flash_mla takes float16/bfloat16)")
    if q.shape[2] != _SFM_HEAD_DIM:
        reasons.append(f"head_dim {q.shape[2]} (sparse_flash_mla takes {_SFM_HEAD_DIM})")
    heads = q.shape[1]
    if not (1 <= heads <= 128 and heads & (heads - 1) == 0):
        reasons.append(f"{heads} heads (sparse_flash_mla takes a power of two up to 128 on Atlas A3)")
    if sinks is None:
        reasons.append("no sinks (sparse_flash_mla requires them in its current version; whether a -inf sink "
                       "means none is not documented)")
    if sliding_window != _SFM_WINDOW:
        reasons.append(f"sliding_window {sliding_window} (sparse_flash_mla takes a {_SFM_WINDOW}-token window, "
                       f"ori_win_left=127, on Atlas A2/A3)")
    if compressed_cache is not None:
        expected = _SFM_CSA_RATIO if topk_indices is not None else _SFM_HCA_RATIO
        if compress_ratio != expected:
            kind = "CSA (listed entries)" if topk_indices is not None else "HCA (all visible entries)"
            reasons.append(f"compress_ratio {compress_ratio} for {kind} (sparse_flash_mla takes {expected} on "
                           f"Atlas A2/A3)")
        if topk_indices is not None and not 0 < topk_indices.shape[1] <= _SFM_MAX_TOPK:
            reasons.append(f"{topk_indices.shape[1]} listed entries per token (sparse_flash_mla takes 1.."
                           f"{_SFM_MAX_TOPK})")
        reasons += _paged_block_reasons("compressed_cache", compressed_cache)
    return reasons + _paged_block_reasons("kv_cache", kv_cache)


@NPU.kernel("shared_kv_attention", reasons=shared_kv_attention_reasons,
            path=lambda *a, **k: "cann_ops_transformer.sparse_flash_mla (TND queries, PA_BBND pools)")
def shared_kv_attention(q, kv_cache, block_tables, seq_lens, query_start_loc, sinks, softmax_scale, sliding_window,
                        compressed_cache=None, compressed_block_tables=None, compress_ratio=1, topk_indices=None):
    """CANN's sparse_flash_mla: q [T, H, 512] (TND), ori_kv = kv_cache and cmp_kv = compressed_cache
    (PA_BBND [NB, bs, 1, 512]) -> [T, H, 512] in q's dtype.

    * Window: ori_mask_mode=4 (band) with ori_win_left = sliding_window - 1 and ori_win_right = 0, over
      seqused_ori_kv = seq_lens tokens: the positions p - W + 1 .. p of the op.
    * Compressed entries: cmp_mask_mode=3 over the uncompressed length seqused_cmp_kv * m +
      cmp_residual_kv = seq_lens, i.e. entries w < (p + 1) // m, the op's rule; CSA passes topk_indices as
      cmp_sparse_indices [T, 1, K] int32 (logical entry indices, -1 = none, as the op's).
    * Block tables: the op lets columns before the window be -1 (freed); the documentation wants block
      ids >= 0, and the band never reads those columns, so -1 becomes block 0.
    * Host synchronisation: the metadata call needs max_seqlen_q, the longest request's query count, as a
      number: one read of query_start_loc (not capturable in a device graph).
    * Numerics: the kernel's (fp32 softmax per its documentation; accumulation order its own)."""
    import cann_ops_transformer

    num_tokens = q.shape[0]
    if num_tokens == 0:
        return q.new_zeros(q.shape)
    starts = query_start_loc.to(torch.int32)
    lens = seq_lens.to(torch.int32)
    compressed = compressed_cache is not None
    cmp_args, cmp_split = {}, {}
    if compressed:
        cmp_args = dict(cmp_kv=compressed_cache, cmp_block_table=compressed_block_tables.to(torch.int32).clamp_min(0),
                        seqused_cmp_kv=torch.div(lens, compress_ratio, rounding_mode="floor"),
                        cmp_residual_kv=torch.remainder(lens, compress_ratio))
        cmp_split = dict(seqused_cmp_kv=cmp_args["seqused_cmp_kv"], cmp_residual_kv=cmp_args["cmp_residual_kv"])
        if topk_indices is not None:
            cmp_args["cmp_sparse_indices"] = topk_indices.to(torch.int32).unsqueeze(1).contiguous()
    modes = dict(cmp_ratio=compress_ratio if compressed else 1, ori_mask_mode=4, cmp_mask_mode=3 if compressed else 0,
                 ori_win_left=sliding_window - 1, ori_win_right=0, layout_q="TND", layout_kv="PA_BBND")
    max_query = int((starts[1:] - starts[:-1]).max())
    metadata = cann_ops_transformer.sparse_flash_mla_metadata(
        q.shape[1], 1, q.shape[2], cu_seqlens_q=starts, seqused_ori_kv=lens, max_seqlen_q=max_query,
        cmp_topk=topk_indices.shape[1] if compressed and topk_indices is not None else 0,
        has_ori_kv=True, has_cmp_kv=compressed, **cmp_split, **modes)
    return cann_ops_transformer.sparse_flash_mla(
        q.contiguous(), ori_kv=kv_cache, ori_block_table=block_tables.to(torch.int32).clamp_min(0),
        cu_seqlens_q=starts, seqused_ori_kv=lens, sinks=sinks.float(), metadata=metadata,
        softmax_scale=float(softmax_scale), **cmp_args, **modes)[0]


# ------------------------------------------------------------------------------- paged decode attention
# torch_npu.npu_fused_infer_attention_score_v2 in its MLA form, within the limits of Ascend/op-plugin's
# docs/zh/custom_APIs/torch_npu/torch_npu-npu_fused_infer_attention_score_v2.md (master 517f2e7d0f20,
# 2026-08-21: "MLA场景约束" for query D = 512, "Q_S=1约束" for page attention) and the block_size limit of
# one query token in torch_npu-npu_fused_infer_attention_score.md (the same commit); schema in
# op_plugin/config/op_plugin_functions.yaml (named _v2 since 18792f97, 2025-07-29). vllm-ascend's plain
# decode calls it the same way (vllm_ascend/attention/mla_v1.py, AscendMLAImpl._forward_decode at
# 182b75ea84ff: q [B, N, 1, L] and q_pe [B, N, 1, R], key = value = the latent cache viewed
# [NB, 1, bs, L], key_rope the k_pe cache viewed [NB, 1, bs, R], one KV head, sparse_mode 0), except
# for two things: it passes the host's list of lengths (its metadata keeps seq_lens_list), and it takes
# the output head-major ("BNSD_NBSD") for its W_UV product, where the op returns [B, N, L] ("BNSD").
_FIA_LATENT, _FIA_ROPE = 512, 64
_FIA_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)  # query heads of the D = 512 MLA form
_FIA_MAX_BLOCK = 512     # one query token: block_size "非0值，最大512" (the MLA section alone allows 1024)
_FIA_MAX_KV = 262144     # one query token: KV_S <= 262144
_FIA_MAX_BATCH = 65536
_INT32_ELEMENTS = 2**31 - 1  # "key、value各自对应tensor的shape所有维度相乘不能超过int32的表示范围"


def _sink_reasons(kernel: str, sinks, q_scale) -> list[str]:
    """Per-head sinks and per-row query scales: the documented arguments of the torch_npu kernel bound here take
    neither (one softmax scale for the call)."""
    reasons = []
    if sinks is not None:
        reasons.append(f"sinks (torch_npu's {kernel} documents no per-head sink logit in its MLA form)")
    if q_scale is not None:
        reasons.append(f"q_scale (torch_npu's {kernel} takes one softmax scale per call)")
    return reasons


def mla_decode_attention_reasons(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens,
                                 softmax_scale, sinks=None, sliding_window=0, q_scale=None) -> list[str]:
    """Why torch_npu.npu_fused_infer_attention_score_v2 cannot serve this decode call (shapes and
    dtypes only)."""
    reasons = _sink_reasons("fused infer attention (npu_fused_infer_attention_score_v2)", sinks, q_scale)
    if sliding_window:
        reasons.append(f"sliding_window {sliding_window} (this binding masks each sequence by its length only)")
    batch, heads, lora = q_latent.shape
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    width = block_tables.shape[1]
    if q_latent.dtype not in _NPU_FLOATS:
        reasons.append(f"dtype {q_latent.dtype} (torch_npu's fused infer attention takes float16/bfloat16)")
    if lora != _FIA_LATENT or q_pe.shape[2] != _FIA_ROPE:
        reasons.append(f"kv_lora_rank {lora} / rope_dim {q_pe.shape[2]} (torch_npu's fused infer attention takes "
                       f"{_FIA_LATENT} / {_FIA_ROPE} in its MLA form)")
    if heads not in _FIA_HEADS:
        reasons.append(f"{heads} heads (torch_npu's fused infer attention takes {'/'.join(map(str, _FIA_HEADS))} "
                       f"in its MLA form)")
    if batch > _FIA_MAX_BATCH:
        reasons.append(f"batch {batch} (torch_npu's fused infer attention takes at most {_FIA_MAX_BATCH})")
    if block_size % 16 or block_size > _FIA_MAX_BLOCK:
        reasons.append(f"block_size {block_size} (torch_npu's page attention for one query token takes multiples "
                       f"of 16 up to {_FIA_MAX_BLOCK})")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not cache.is_contiguous():
            reasons.append(f"{name} is not contiguous (torch_npu's fused infer attention takes contiguous caches)")
        if cache.numel() > _INT32_ELEMENTS:
            reasons.append(f"{name} has {cache.numel()} elements (torch_npu's page attention counts them in int32)")
    if width * block_size > _FIA_MAX_KV:
        reasons.append(f"a block table of {width} x {block_size} positions (attended over its whole width, at most "
                       f"{_FIA_MAX_KV} for one query token)")
    if num_blocks < batch * width:
        reasons.append(f"num_blocks {num_blocks} < batch {batch} x block-table width {width} (torch_npu's page "
                       f"attention needs a block for each one its lengths address, and the lengths given are the "
                       f"table's capacity: seq_lens, on the device, would need a host read)")
    return reasons


@NPU.kernel("mla_decode_attention", reasons=mla_decode_attention_reasons,
            path=lambda *a, **k: "torch_npu.npu_fused_infer_attention_score_v2 (MLA form, BNSD, page attention "
                                 "over the whole block table, seq_lens as its mask)")
def mla_decode_attention(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, softmax_scale, sinks=None,
                         sliding_window=0, q_scale=None):
    """torch_npu.npu_fused_infer_attention_score_v2, MLA form: query = q_latent [B, N, 512] as
    [B, N, 1, 512] ("BNSD"), query_rope = q_pe [B, N, 64] as [B, N, 1, 64], key = value = key_cache
    [NB, bs, 1, 512] viewed [NB, 1, bs, 512] (the latent is both), key_rope = value_cache [NB, bs, 1, 64]
    viewed [NB, 1, bs, 64], one KV head, block_table int32 -> o_latent [B, N, 512] in q's dtype.

    * Lengths without a host read: torch_npu takes the lengths as a host list (SymInt[]), and seq_lens is
      a device tensor. Every row is given the table's capacity W*bs instead, and seq_lens becomes an
      atten_mask [B, 1, 1, W*bs] (nonzero = not attended, sparse_mode 0) built on the device. The price:
      the kernel works over the whole table width of every row, and the pool must hold B*W blocks (its
      documented lower bound for those lengths; a reason otherwise).
    * Block ids: the kernel reads every column, so ids are clamped into the pool; positions whose id is
      not a block of the pool are masked, as in the reference's device path. Positions past a row's
      length enter P . V with probability 0: they must hold finite values (mla-ops' paged caches are
      zero-initialised), since 0 * NaN is NaN and masked positions are not documented to be skipped.
    * A row with no attended position gives zeros (the op's contract; the documentation leaves that
      output open).
    * Numerics: the kernel's (inner_precise 0, the documented high-precision mode), not the reference's
      rounding of P to the activation dtype.
    No host synchronisation: the conversions are tensor ops of static shapes, the length list comes
    from shapes."""
    import torch_npu

    batch, heads, lora = q_latent.shape
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    width = block_tables.shape[1]
    if batch == 0 or width == 0:  # torch_npu's MLA form takes no empty tensors; nothing is attended
        return q_latent.new_zeros(q_latent.shape)
    capacity = width * block_size
    ids = block_tables.long()
    valid_ids = ((ids >= 0) & (ids < num_blocks)).repeat_interleave(block_size, dim=1)  # [B, W*bs]
    positions = torch.arange(capacity, device=q_latent.device)
    attended = (positions[None, :] < seq_lens.long()[:, None]) & valid_ids
    rope = q_pe.shape[2]
    latent = key_cache.view(num_blocks, 1, block_size, lora)  # [NB, KV_N, bs, D]: one tensor, key and value
    out = torch_npu.npu_fused_infer_attention_score_v2(
        q_latent.contiguous().view(batch, heads, 1, lora), latent, latent,
        query_rope=q_pe.contiguous().view(batch, heads, 1, rope),
        key_rope=value_cache.view(num_blocks, 1, block_size, rope),
        atten_mask=(~attended).view(batch, 1, 1, capacity), actual_seq_kvlen=[capacity] * batch,
        block_table=ids.clamp(0, num_blocks - 1).to(torch.int32), num_query_heads=heads, num_key_value_heads=1,
        softmax_scale=float(softmax_scale), input_layout="BNSD", sparse_mode=0, block_size=block_size)[0]
    out = out.view(batch, heads, lora)
    return torch.where(attended.any(dim=1)[:, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


# ---------------------------------------------------------------------------------------- cache writes
# torch_npu.npu_scatter_nd_update_ (Ascend/op-plugin 517f2e7d, docs/zh/custom_APIs/torch_npu/
# torch_npu-npu_scatter_nd_update_.md): input[indices[i]] = updates[i] in place, input of any strides,
# indices int32/int64 that must all be in range. vllm-ascend writes its sparse caches with it
# (vllm_ascend/attention/sfa_v1.py at 182b75ea). Not torch_npu.npu_scatter_pa_kv_cache: its
# documentation (torch_npu-npu_scatter_pa_kv_cache.md) takes contiguous inputs only, slots in
# [0, num_blocks * block_size) and no repeated slot, and describes its ND ('Norm') cache layout less
# precisely than the NZ one.
_SCATTER_ND_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.bool, torch.int64, torch.int8)


def _scatter_cache_reasons(name: str, cache) -> list[str]:
    if cache.dtype in _SCATTER_ND_DTYPES:
        return []
    return [f"{name} dtype {cache.dtype} (torch_npu's npu_scatter_nd_update_ takes float32/float16/bfloat16/bool/"
            f"int64/int8 on Atlas A2/A3)"]


def scatter_pa_kv_cache_reasons(key, value, key_cache, value_cache, slot_mapping) -> list[str]:
    """Why torch_npu.npu_scatter_nd_update_ cannot write this cache pair (dtypes only)."""
    return _scatter_cache_reasons("key_cache", key_cache) + _scatter_cache_reasons("value_cache", value_cache)


def scatter_pa_cache_reasons(key, cache, slot_mapping) -> list[str]:
    """Why torch_npu.npu_scatter_nd_update_ cannot write this pool (dtypes only)."""
    return _scatter_cache_reasons("cache", cache)


def scatter_rows_with_torch_npu(pairs, slot_mapping) -> None:
    """cache[slot // bs, slot % bs] = rows[t] for every token t whose slot lies in the pool, through
    torch_npu.npu_scatter_nd_update_ with [T, 2] (block, offset) indices. `pairs`: ((rows [T, H, D],
    cache [NB, bs, H, D]), ...), all addressed by one slot_mapping [T].

    The op skips padding (negative) and out-of-range slots; torch_npu takes no index out of range, and
    dropping those tokens would take a host read (a data-dependent count). So, as the reference's device
    path does, each of them is redirected to the first kept token's slot with that token's own row, or,
    with no token kept, to slot 0 with slot 0's own contents: every repeated index carries the same row,
    so any write order leaves the same cache (the documentation says nothing about repeated indices)."""
    import torch_npu

    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    num_blocks, block_size = pairs[0][1].shape[0], pairs[0][1].shape[1]
    slots = slot_mapping.long()
    kept = (slots >= 0) & (slots < num_blocks * block_size)
    any_kept = kept.any()
    first_kept = torch.argmax(kept.to(torch.float32))  # a kept token whenever there is one
    token = torch.where(kept, torch.arange(num_tokens, device=slots.device), first_kept)
    dst = torch.where(any_kept, slots[token], 0)
    indices = torch.stack((torch.div(dst, block_size, rounding_mode="floor"), torch.remainder(dst, block_size)), 1)
    # every pair's rows are gathered (copied) before any pool is written: rows may be views of a pool
    updates = [torch.where(any_kept, rows[token], cache[0, 0].unsqueeze(0)) for rows, cache in pairs]
    for (_, cache), rows in zip(pairs, updates):
        torch_npu.npu_scatter_nd_update_(cache, indices, rows)


def _scatter_path(*args, **kwargs) -> str:
    return "torch_npu.npu_scatter_nd_update_ ([block, offset] indices, padding slots redirected on the device)"


@NPU.kernel("scatter_pa_kv_cache", reasons=scatter_pa_kv_cache_reasons, path=_scatter_path)
def scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping):
    """key [T, Hk, Dk] -> key_cache [NB, bs, Hk, Dk], value [T, Hv, Dv] -> value_cache, in place, through
    torch_npu.npu_scatter_nd_update_; no host synchronisation (see `scatter_rows_with_torch_npu`)."""
    scatter_rows_with_torch_npu(((key, key_cache), (value, value_cache)), slot_mapping)


@NPU.kernel("scatter_pa_cache", reasons=scatter_pa_cache_reasons, path=_scatter_path)
def scatter_pa_cache(key, cache, slot_mapping):
    """key [T, H, D] -> cache [NB, bs, H, D] in place, through torch_npu.npu_scatter_nd_update_."""
    scatter_rows_with_torch_npu(((key, cache),), slot_mapping)


# ------------------------------------------------------------------------------------------- prologs
# torch_npu.npu_mla_prolog_v2 / _v3 (Ascend/op-plugin 517f2e7d, docs/zh/custom_APIs/torch_npu/
# torch_npu-npu_mla_prolog_v2.md, torch_npu-npu_mla_prolog_v3.md) cannot serve q_prolog or
# latent_kv_prolog:
# * their query output is q_nope absorbed with W_UK ([T, N, Hckv = 512]); q_prolog returns q_nope
#   itself [B, N, S, P] (prefill attends with it);
# * they run the query and the KV path in one call, with every weight required, and write the KV path
#   into caches (v2: paged, cache_index required; v3's "TND"/"BSND" cache modes into buffers):
#   latent_kv_prolog alone would run the whole query path for nothing;
# * their weights are transposed ([He, Hcq], [Hcq, N*(D+Dr)], [He, Hckv+Dr]) in FRACTAL_NZ, where the
#   ops take nn.Linear's [out, in] in ND: a transpose and format cast of every weight on every call;
# * no bias (q_a_bias / kv_a_bias), bfloat16 only when unquantised, fixed dims (v2: He 7168, Hcq 1536,
#   D 128, S <= 16; v3: He 1024..8192, Hcq 1536/2048, D 128/192; both N a power of 2 <= 128, Hckv 512,
#   Dr 64), one RoPE layout ("interleave-half" = rope_layout "half") with bfloat16 cos/sin [.., Dr]
#   where the ops take fp32 tables per rotation pair.
# So both prologs are composites of torch_npu ops: kv_prolog's stage 1 (F.linear, split, npu_rms_norm,
# one kernel for the norm) and RoPE as framework ops.
_RMS_NORM_FLOATS = (torch.float16, torch.bfloat16, torch.float32)  # npu_rms_norm's self dtypes, Atlas A2/A3
_NOT_MLA_PROLOG = ("not torch_npu.npu_mla_prolog_v3, which absorbs W_UK into q_nope, runs both paths into caches "
                   "and takes NZ weights of fixed dims")


def _rms_norm_reasons(hidden_states) -> list[str]:
    if hidden_states.dtype in _RMS_NORM_FLOATS:
        return []
    return [f"dtype {hidden_states.dtype} (torch_npu.npu_rms_norm takes float16/bfloat16/float32)"]


def latent_kv_prolog_reasons(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin, *, eps=1e-6,
                             rope_layout="interleaved", rope_compute_dtype="float32") -> list[str]:
    return _rms_norm_reasons(hidden_states)


@NPU.kernel("latent_kv_prolog", reasons=latent_kv_prolog_reasons,
            path=lambda *a, **k: "torch_npu composite: kv_prolog's stage 1 (F.linear, split, npu_rms_norm) and "
                                 "RoPE; " + _NOT_MLA_PROLOG)
def latent_kv_prolog(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin, *, eps=1e-6,
                     rope_layout="interleaved", rope_compute_dtype="float32"):
    """-> latent [B, S, L] (npu_rms_norm of the kv_a output's latent part), k_pe [B, S, R] (rotated):
    the latent the npu kv_prolog expands, so a cached latent and kv_prolog's agree bit for bit."""
    latent, k_pe = _npu_stage1(hidden_states, kv_a_weight, kv_a_bias, kv_norm_weight, eps)
    return latent, rope_math(k_pe, cos, sin, rope_layout, rope_compute_dtype)


def q_prolog_reasons(hidden_states, q_a_weight, q_a_bias, q_norm_weight, q_b_weight, cos, sin, *, num_heads,
                     qk_nope_head_dim, eps=1e-6, rope_layout="interleaved", rope_compute_dtype="float32") -> list[str]:
    return _rms_norm_reasons(hidden_states) if q_norm_weight is not None else []


def _q_prolog_path(hidden_states, q_a_weight, *args, **kwargs) -> str:
    steps = "F.linear, npu_rms_norm, F.linear, split and RoPE" if q_a_weight is not None else \
        "F.linear, split and RoPE (no q-LoRA)"
    return f"torch_npu composite: {steps}; {_NOT_MLA_PROLOG}"


@NPU.kernel("q_prolog", reasons=q_prolog_reasons, path=_q_prolog_path)
def q_prolog(hidden_states, q_a_weight, q_a_bias, q_norm_weight, q_b_weight, cos, sin, *, num_heads,
             qk_nope_head_dim, eps=1e-6, rope_layout="interleaved", rope_compute_dtype="float32"):
    """hidden [B, S, H] -> (q_a_proj -> npu_rms_norm ->) q_b_proj -> q_nope [B, N, S, P], q_pe [B, N, S, R]
    (rotated), contiguous, in hidden's dtype. Without q-LoRA (q_a_weight None) the framework ops alone."""
    import torch_npu

    q_in = hidden_states
    if q_a_weight is not None:
        q_in = torch_npu.npu_rms_norm(F.linear(hidden_states, q_a_weight, q_a_bias), q_norm_weight, epsilon=eps)[0]
    q = F.linear(q_in, q_b_weight)
    batch, seq, _ = q.shape
    q = q.view(batch, seq, num_heads, q.shape[-1] // num_heads).transpose(1, 2)  # explicit: seq may be 0
    q_nope, q_pe = torch.split(q, [qk_nope_head_dim, q.shape[-1] - qk_nope_head_dim], dim=-1)
    # clone, not .contiguous(): an empty view counts as contiguous, and op outputs must not alias
    return q_nope.clone(memory_format=torch.contiguous_format), rope_math(q_pe, cos, sin, rope_layout,
                                                                          rope_compute_dtype)


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
