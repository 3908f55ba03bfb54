"""vllm-ascend adapter: decode attention of `AscendMLAImpl` through `torch.ops.mla.mla_decode_attention`.

NOT RUNNABLE HERE: vllm-ascend needs Ascend NPUs, CANN and torch_npu; this module is import-guarded and
has only been checked against vllm-ascend's source, not run.

Off by default: mla-ops' NPU kernel for `mla.mla_decode_attention` (the npu backend: torch_npu's
`npu_fused_infer_attention_score_v2` over the block table's whole width, seq_lens as a device-built mask)
has not been measured against vllm-ascend's own call on hardware, and never a downgrade is the rule
(`routes.decide("ASCEND_MLA")`); without that kernel the reference composite would serve the op, which
gathers the whole block-table width of every request per layer and step. `MLA_OPS_VLLM_ROUTE=mla-ops`
takes the route anyway, for trying it. Written against vllm-project/vllm-ascend
(snapshot of 2026-08-22, commit 182b75ea84ff13ece27b57391331ef8935410aea):

* `vllm_ascend/platform.py` `NPUPlatform.get_attn_backend_cls` returns hard-coded class paths, MLA:
  "vllm_ascend.attention.mla_v1.AscendMLABackend". :func:`register` wraps that classmethod to return
  :class:`MlaOpsAscendMLABackend` instead (nothing else changes).
* `vllm_ascend/attention/mla_v1.py` `AscendMLAImpl._forward_decode(q_nope, q_pe, k_nope, k_pe, block_size,
  attn_metadata, dequant_scale_q_nope)`: `q_nope` is q absorbed with W_UK `[B, N, L]`, `q_pe` rotated
  `[B, N, R]`, `k_nope` / `k_pe` are the layer's cache pair `kv_cache[0]` `[NB, 128, 1, 512]` and
  `kv_cache[1]` `[NB, 128, 1, 64]` (written by `npu_kv_rmsnorm_rope_cache` in `exec_kv_decode`) — exactly
  mla-ops' `key_cache` / `value_cache` — and `attn_metadata.decode` holds `block_table` `[B, max_blocks]`
  and `seq_lens` `[B]`. It returns `_v_up_proj(o)` with o head-major `[N, B, L]`.

Routed: plain decode only (one token per request, bf16/fp16 cache in the "PA" layout, no ACL graph
capture). Everything else — the FRACTAL_NZ cache (`enable_kv_nz`), fp8 attention layers, speculative
decoding, graph capture (whose parameter updater patches the fused kernel's arguments at replay),
decode context parallelism — stays on vllm-ascend's `npu_fused_infer_attention_score_v2`. The cache write
is not routed: vllm-ascend fuses it into the KV prolog (`npu_kv_rmsnorm_rope_cache`: RMSNorm + RoPE +
paged write in one kernel), which mla-ops' separate ops would only split up.
"""
from __future__ import annotations

import importlib.util

ASCEND_MLA = "vllm_ascend.attention.mla_v1.AscendMLABackend"
ADAPTER_BACKEND = "mla_ops.integrations.vllm.ascend.MlaOpsAscendMLABackend"


def register() -> str:
    """Wrap `NPUPlatform.get_attn_backend_cls` so MLA models get :class:`MlaOpsAscendMLABackend` — only
    where the route was measured worth taking (see :mod:`.routes`: not yet on Ascend), or when
    `MLA_OPS_VLLM_ROUTE=mla-ops` asks for the route anyway. Otherwise vllm-ascend is left as it is and the
    returned state says why."""
    if importlib.util.find_spec("vllm_ascend") is None or importlib.util.find_spec("torch_npu") is None:
        return "NPU platform without vllm_ascend / torch_npu importable; nothing routed"
    import torch_npu  # noqa: F401  (binds mla-ops' NPU kernels, so the decision sees them)

    from . import DECISIONS, routes

    DECISIONS["ASCEND_MLA"] = decision = routes.decide("ASCEND_MLA")
    if not decision.route:
        return f"not routed: {decision.describe('ASCEND_MLA')}"
    from vllm_ascend.platform import NPUPlatform

    original = NPUPlatform.get_attn_backend_cls
    if getattr(original, "_mla_ops_wrapped", False):
        return f"registered: {decision.describe('ASCEND_MLA')} (already wrapped)"
    original_func = original.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, *args, **kwargs):
        path = original_func(cls, selected_backend, attn_selector_config, *args, **kwargs)
        return ADAPTER_BACKEND if path == ASCEND_MLA else path

    get_attn_backend_cls._mla_ops_wrapped = True
    NPUPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    return f"registered: {decision.describe('ASCEND_MLA')}"


if importlib.util.find_spec("vllm_ascend") is not None:  # the classes exist only where vllm-ascend does
    import torch
    from vllm_ascend.attention.mla_v1 import AscendMLABackend, AscendMLAImpl

    import mla_ops  # noqa: F401  (registers torch.ops.mla, NPU kernels included where torch_npu is present)

    class MlaOpsAscendMLAImpl(AscendMLAImpl):
        """`AscendMLAImpl` whose plain decode attention is `torch.ops.mla.mla_decode_attention`."""

        def _routable(self, attn_metadata) -> bool:
            from vllm.config import CUDAGraphMode, get_current_vllm_config

            cfg = get_current_vllm_config()
            eager = cfg.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
            return (eager and not self.fa_quant_layer and not self.enable_kv_nz
                    and self.speculative_config is None and attn_metadata.decode is not None)

        def _forward_decode(self, q_nope, q_pe, k_nope, k_pe, block_size, attn_metadata,
                            dequant_scale_q_nope=None):
            if not self._routable(attn_metadata):
                return super()._forward_decode(q_nope, q_pe, k_nope, k_pe, block_size, attn_metadata,
                                               dequant_scale_q_nope)
            decode = attn_metadata.decode
            batch = q_nope.shape[0]
            q_latent = q_nope.reshape(batch, self.num_heads, self.kv_lora_rank)
            q_rope = q_pe.reshape(batch, self.num_heads, self.qk_rope_head_dim)
            key_cache = k_nope.view(-1, block_size, 1, self.kv_lora_rank)
            value_cache = k_pe.view(-1, block_size, 1, self.qk_rope_head_dim)
            out = torch.ops.mla.mla_decode_attention(q_latent, q_rope, key_cache, value_cache,  # -> [B, N, L]
                                                     decode.block_table, decode.seq_lens, self.scale)
            # vllm-ascend's _v_up_proj takes the head-major [N, B, L] of its fused kernel's output
            return self._v_up_proj(out.transpose(0, 1).contiguous())

    class MlaOpsAscendMLABackend(AscendMLABackend):
        """`AscendMLABackend` with :class:`MlaOpsAscendMLAImpl` (name stays "ASCEND_MLA"); decode context
        parallelism keeps vllm-ascend's own impl."""

        @staticmethod
        def get_impl_cls():
            impl = AscendMLABackend.get_impl_cls()
            return MlaOpsAscendMLAImpl if impl is AscendMLAImpl else impl
