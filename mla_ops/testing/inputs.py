"""Input factories for the `mla::` ops: MLA dimension sets, rotary tables, prolog weights, paged caches.

Deterministic (seeded `torch.Generator`s), CPU tensors with realistic scales (weights scaled by
1/sqrt(fan_in), so activations stay O(1) in every dtype); callers move them to a device.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class Dims:
    """MLA dimensions: B batch, S tokens, H hidden, N heads, L kv_lora_rank, R rope, P nope, V v."""

    name: str
    B: int
    S: int
    H: int
    N: int
    L: int
    R: int
    P: int
    V: int


SMALL = Dims("small", B=2, S=3, H=32, N=4, L=16, R=8, P=8, V=12)
LITE = Dims("v2lite", B=1, S=2, H=2048, N=16, L=512, R=64, P=128, V=128)  # DeepSeek-V2-Lite's real dims
PREFILL = Dims("prefill", B=2, S=9, H=64, N=2, L=32, R=16, P=16, V=16)
DIM_SETS = (SMALL, LITE, PREFILL)


def rope_tables(batch: int, seq: int, rope_dim: int, *, offset: int = 0, batched: bool = True,
                dtype: torch.dtype = torch.float32):
    """cos/sin per rotation pair like DeepseekV2RotaryEmbedding: `[B, S, R/2]` (or `[S, R/2]`) in `dtype`."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    pos = torch.arange(offset, offset + seq, dtype=torch.float32)
    angles = pos[:, None] * inv_freq[None, :]  # fp32, as the rotary modules compute them
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    if batched:
        cos, sin = cos.expand(batch, -1, -1).contiguous(), sin.expand(batch, -1, -1).contiguous()
    return cos, sin


def prolog_inputs(d: Dims, dtype: torch.dtype, *, bias: bool = False, requires_grad: bool = False,
                  generator: Optional[torch.Generator] = None):
    """(hidden [B,S,H], kv_a_w [L+R,H], kv_a_b [L+R] | None, norm_w [L], kv_b_w [N*(P+V),L], cos, sin).

    Activations and weights in `dtype`; cos/sin `[B, S, R/2]` in fp32 (fp64 when `dtype` is fp64, so
    gradcheck sees fp64 math throughout)."""
    g = generator

    def rand(*shape, scale=1.0):
        t = (torch.randn(*shape, generator=g) * scale).to(dtype)
        return t.requires_grad_(requires_grad)

    hidden = rand(d.B, d.S, d.H)
    kv_a = rand(d.L + d.R, d.H, scale=d.H ** -0.5)
    kv_a_b = rand(d.L + d.R, scale=0.1) if bias else None
    norm_w = (1.0 + 0.1 * torch.randn(d.L, generator=g)).to(dtype).requires_grad_(requires_grad)
    kv_b = rand(d.N * (d.P + d.V), d.L, scale=d.L ** -0.5)
    table_dtype = torch.promote_types(dtype, torch.float32)
    cos, sin = (t.to(table_dtype) for t in rope_tables(d.B, d.S, d.R, offset=3))
    return hidden, kv_a, kv_a_b, norm_w, kv_b, cos, sin


def prolog_kwargs(d: Dims, **extra) -> dict:
    """The keyword arguments of `mla.kv_prolog` for dims `d`."""
    return dict(num_heads=d.N, qk_nope_head_dim=d.P, v_head_dim=d.V, **extra)


def paged_case(num_blocks: int, block_size: int, lens: list[int], *, key_shape=(1, 16), value_shape=(1, 8),
               dtype=torch.bfloat16, columns: Optional[int] = None, offsets: Optional[list[int]] = None,
               seed: int = 0):
    """A random paged cache pair and the tables addressing `lens` tokens per sequence.

    Returns `(key_cache [NB, bs, *key_shape], value_cache [NB, bs, *value_shape], block_tables
    [Q, columns] int32 (distinct physical blocks per sequence, -1 past each row's blocks), cumulative
    seq_lens [Q+1] int32, seq_offset [Q] int32)`; sequence q starts `offsets[q]` tokens into its row."""
    g = torch.Generator().manual_seed(seed)
    key_cache = torch.randn(num_blocks, block_size, *key_shape, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, *value_shape, generator=g).to(dtype)
    offsets = offsets or [0] * len(lens)
    need = [o // block_size + -(-n // block_size) for n, o in zip(lens, offsets)]
    columns = columns or max(need + [1])
    if sum(need) > num_blocks:
        raise ValueError(f"paged_case: the sequences need {sum(need)} blocks but the pool has {num_blocks}")
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(lens), columns), -1, dtype=torch.int32)
    used = 0
    for q, n_cols in enumerate(need):
        tables[q, :n_cols] = perm[used:used + n_cols].to(torch.int32)
        used += n_cols
    cumsum = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cumsum[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    return key_cache, value_cache, tables, cumsum, torch.tensor(offsets, dtype=torch.int32)


def split_pool(num_blocks: int, block_size: int, lora: int, rope: int, dtype: torch.dtype, seed: int = 0):
    """One `[NB, bs, 1, L+R]` pool and its two split views `pool[..., :L]` (latent) and `pool[..., L:]`
    (k_pe): how vLLM and the paged cache of the transformers patch hold the MLA cache pair."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(num_blocks, block_size, 1, lora + rope, generator=g).to(dtype)
    return pool, pool[..., :lora], pool[..., lora:]
