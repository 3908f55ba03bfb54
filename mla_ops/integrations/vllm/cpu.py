"""vLLM's CPU MLA backend with its cache write, decode and prefill on `torch.ops.mla`.

Subclasses `vllm/v1/attention/backends/mla/cpu_mla.py` (`CPUMLABackend`, `CPUMLAImpl`) and changes three
methods: the cache write, the decode (`forward_mqa`) and the prefill (`forward_mha`, :mod:`.prefill`: each
request absorbed over the paged cache or expanded through kv_b_proj, with its cached context, so chunked
prefill and prefix caching run). Everything else (metadata builder, weight absorption and the decode / prefill
split in `vllm/model_executor/layers/attention/mla_attention.py` `MLAAttention.forward_impl`) is vLLM's.

vLLM's MLA cache is one tensor `[num_blocks, block_size, L + R]` (latent ‖ rotated k_pe; 512 + 64 for
DeepSeek-V2/V3). Its two column views `cache[..., :L].unsqueeze(2)` and `cache[..., L:].unsqueeze(2)`
(`[num_blocks, block_size, 1, L]` / `[..., 1, R]`) are exactly the `key_cache` / `value_cache` pair of the
mla ops, which read and write strided caches in place: the pool is never copied.

Not routed: the KV prolog (kv_a_proj -> kv_a_layernorm -> rotary), which vLLM runs before the backend in
`vllm/model_executor/layers/mla.py` `MultiHeadLatentAttentionWrapper.forward`. The only hook there is
replacing the whole wrapper (`PluggableLayer.register_oot`), and `mla.latent_kv_prolog` needs kv_a's
weight in `nn.Linear` layout, which vLLM's CPU linear layers no longer have after loading
(`vllm/model_executor/layers/linear.py` -> `dispatch_cpu_unquantized_gemm(layer, remove_weight=True)` in
`vllm/model_executor/layers/utils.py` repacks it for oneDNN / sgl-kernel and leaves an empty tensor);
with q_lora_rank set (DeepSeek-V2/V3) kv_a is also fused with q_a into one GEMM (`fused_qkv_a_proj`).
"""
from __future__ import annotations

import logging
import weakref
from collections import Counter

import torch
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

import mla_ops  # noqa: F401  (registers torch.ops.mla; a no-op when already imported)

from . import prefill
from .routes import serving_decode_backend

logger = logging.getLogger("vllm.mla_ops")  # vLLM's handlers print its logger tree

# (op, layer) -> calls in this process, layer = the attention module's prefix ("model.layers.3.self_attn").
# The dense prefill adds what it served per layer and step: `prefill_tokens` (query tokens), `prefill_tokens_absorbed`
# / `prefill_tokens_expanded` (by form), `prefill_context_tokens` (cached tokens attended besides the step's own)
# and `prefill_steps_with_decodes` (steps whose batch also decoded). Observability for tests and benchmarks: a
# few dict updates per layer call, negligible next to the ops.
CALLS: Counter = Counter()


def layer_label(impl) -> str:
    """The attention module prefix of an impl, from its kv_b_proj's prefix (vLLM linear layers keep it)."""
    prefix = getattr(getattr(impl, "kv_b_proj", None), "prefix", "") or "?"
    return prefix.removesuffix(".kv_b_proj")


def split_mla_cache(kv_cache: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's `[num_blocks, block_size, L + R]` MLA cache -> (key_cache `[NB, bs, 1, L]`,
    value_cache `[NB, bs, 1, R]`), views of the same storage."""
    if kv_cache.dim() != 3:
        raise ValueError(f"mla-ops vLLM backend: expected the MLA cache as [num_blocks, block_size, "
                         f"kv_lora_rank + rope_dim], got shape {tuple(kv_cache.shape)}")
    return kv_cache[..., :kv_lora_rank].unsqueeze(2), kv_cache[..., kv_lora_rank:].unsqueeze(2)


def mla_decode(impl, q, kv_cache: torch.Tensor, attn_metadata, layer) -> torch.Tensor:
    """Absorbed decode through `torch.ops.mla.mla_decode_attention`.

    q: `(ql_nope [B, N, L], q_pe [B, N, R])` or their concatenation `[B, N, L + R]` (what
    `MLAAttention.forward_impl` hands `forward_mqa`); kv_cache `[NB, bs, L + R]`. Block table
    `[B, max_blocks]` and seq_lens `[B]` (tokens including the current one) are vLLM's decode metadata,
    passed as they are (int32). Returns o_latent `[B, N, L]` in q's dtype.
    """
    if isinstance(q, tuple):
        q_latent, q_pe = q
    else:
        q_latent, q_pe = q.split([impl.kv_lora_rank, q.shape[-1] - impl.kv_lora_rank], dim=-1)
    key_cache, value_cache = split_mla_cache(kv_cache, impl.kv_lora_rank)
    decode = attn_metadata.decode
    out = torch.ops.mla.mla_decode_attention(q_latent, q_pe, key_cache, value_cache, decode.block_table,
                                             decode.seq_lens, impl.scale)
    CALLS["mla_decode_attention", layer_label(impl)] += 1
    return out


def mla_cache_update(kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, kv_cache_dtype: str) -> bool:
    """Write the new tokens' latent `[T, L]` and rotated k_pe `[T, 1, R]` into vLLM's cache through
    `torch.ops.mla.scatter_pa_kv_cache`; slot_mapping `[T]` (negative = padding, skipped by the op).
    Returns False when there was no cache to write (vLLM's profile run binds empty caches)."""
    if kv_cache.numel() == 0:
        return False
    if kv_cache_dtype != "auto":
        raise NotImplementedError(f"mla-ops vLLM backend: kv_cache_dtype={kv_cache_dtype!r} is not supported "
                                  "(the cache must hold the model dtype: kv_cache_dtype='auto')")
    slots = slot_mapping.flatten()
    tokens = slots.shape[0]
    latent = kv_c_normed[:tokens].unsqueeze(1)  # [T, 1, L]
    rope = k_pe[:tokens].reshape(tokens, 1, -1)  # [T, 1, R]
    if latent.dtype != kv_cache.dtype:  # vLLM's own backends cast the same way
        latent, rope = latent.to(kv_cache.dtype), rope.to(kv_cache.dtype)
    key_cache, value_cache = split_mla_cache(kv_cache, latent.shape[-1])
    torch.ops.mla.scatter_pa_kv_cache(latent, rope, key_cache, value_cache, slots)
    return True


def record_prefill(impl, ran: Counter, attn_metadata) -> None:
    """Add what a prefill served (:func:`.prefill.forward_mha`'s counts) to CALLS under the impl's layer."""
    label = layer_label(impl)
    for name, n in ran.items():
        CALLS[name, label] += n
    if attn_metadata.num_decodes:
        CALLS["prefill_steps_with_decodes", label] += 1


def _plugin_state() -> str:
    from . import _state

    return _state or "backend loaded without register()"


class MlaOpsMethods:
    """The two methods the plugin replaces in vLLM's CPU MLA impls (CPU_MLA and AMX_MLA share them; each
    impl has its own prefill: :class:`MlaOpsCPUMLAImpl`'s, :class:`.amx.MlaOpsAMXMLAImpl`'s).

    The first impl built in a process logs the route (one line per process and backend, not per layer)."""

    _announced: set = set()
    prefill_route = "prefill stays vLLM's"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        backend = self.backend_name
        if backend not in MlaOpsMethods._announced:
            MlaOpsMethods._announced.add(backend)
            logger.info("mla-ops vLLM plugin: %s; %s decode -> torch.ops.mla.mla_decode_attention (served by "
                        "%s), cache write -> torch.ops.mla.scatter_pa_kv_cache, %s", _plugin_state(), backend,
                        serving_decode_backend("cpu"), self.prefill_route)

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        assert attn_metadata.decode is not None
        return mla_decode(self, q, kv_c_and_k_pe_cache, attn_metadata, layer), None

    # vLLM 0.33 passes extra keyword arguments (skip_scale); accepted and unused (no quantized cache).
    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale,
                           **kwargs):
        if mla_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype):
            CALLS["scatter_pa_kv_cache", layer_label(self)] += 1


class MlaOpsCPUMLAImpl(MlaOpsMethods, CPUMLAImpl):
    """`CPUMLAImpl` whose decode is `mla.mla_decode_attention`, cache write `mla.scatter_pa_kv_cache` and
    prefill `mla.mla_prefill_attention` / `mla.mha_prefill_attention` (:mod:`.prefill`)."""

    backend_name = "CPU_MLA"
    prefill_route = ("prefill -> torch.ops.mla.mla_prefill_attention (absorbed) / torch.ops.mla.mha_prefill_attention "
                     "(expanded) by cost")
    # the MLAAttention layer that owns this impl (its W_UK_T / W_UV and _v_up_proj), found on first use
    _attention_layer = None

    def bind_layer(self, layer) -> None:
        """Use `layer` (an `MLAAttention` whose `impl` is this impl) for the absorbed form's projections."""
        self._attention_layer = weakref.ref(layer)

    def attention_layer(self):
        """The `MLAAttention` that owns this impl: vLLM hands `forward_mha` no layer, so it is looked up once in
        the forward context's layers (vLLM's `static_forward_context`)."""
        layer = self._attention_layer() if self._attention_layer is not None else None
        if layer is None:
            from vllm.forward_context import get_forward_context

            layers = get_forward_context().no_compile_layers.values()
            layer = next((m for m in layers if getattr(m, "impl", None) is self), None)
            if layer is None:
                raise RuntimeError(f"mla-ops vLLM backend: no attention layer of the forward context owns the "
                                   f"impl of {layer_label(self)}")
            self.bind_layer(layer)
        return layer

    def forward_mha(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output,
                    output_scale=None, **kwargs):
        # kv_c_normed / k_pe are this step's latents, already in the cache (vLLM writes it before attention):
        # both forms read them from there
        if output_scale is not None:
            raise NotImplementedError("mla-ops vLLM backend: the prefill has no fused output quantization "
                                      "(output_scale)")
        key_cache, value_cache = split_mla_cache(kv_c_and_k_pe_cache, self.kv_lora_rank)
        ran = prefill.forward_mha(self, self.attention_layer(), q, key_cache, value_cache, attn_metadata.prefill,
                                  output)
        record_prefill(self, ran, attn_metadata)

    def up_project_latents(self, latent: torch.Tensor) -> torch.Tensor:
        """kv_b_proj of latents `[S, L]` -> `[S, N * (P + V)]` (the expanded form's keys and values)."""
        return self.kv_b_proj(latent)[0]


class MlaOpsCPUMLABackend(CPUMLABackend):
    """`CPUMLABackend` with :class:`MlaOpsCPUMLAImpl`; `get_name()` stays "CPU_MLA"."""

    @staticmethod
    def get_impl_cls() -> type[MlaOpsCPUMLAImpl]:
        return MlaOpsCPUMLAImpl
