"""Test helpers: the shared opcheck wrapper, DeepSeek-V2 dimension sets and input factories."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch.library import opcheck as _opcheck
from torch.utils._python_dispatch import TorchDispatchMode

ALL_OPCHECK_TEST_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def opcheck(op, args, kwargs=None, *, test_utils=ALL_OPCHECK_TEST_UTILS, **extra):
    """`torch.library.opcheck` with all four default utils; fails the test on any non-SUCCESS."""
    result = _opcheck(op, args, kwargs, test_utils=test_utils, raise_exception=True, **extra)
    assert all(v == "SUCCESS" for v in result.values()), result
    return result


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


def rope_tables(batch: int, seq: int, rope_dim: int, *, offset: int = 0, batched: bool = True):
    """cos/sin per rotation pair like DeepseekV2RotaryEmbedding: fp32 [B, S, R/2] (or [S, R/2])."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    pos = torch.arange(offset, offset + seq, dtype=torch.float32)
    angles = pos[:, None] * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    if batched:
        cos, sin = cos.expand(batch, -1, -1).contiguous(), sin.expand(batch, -1, -1).contiguous()
    return cos, sin


def prolog_inputs(d: Dims, dtype: torch.dtype, *, bias: bool = False, requires_grad: bool = False,
                  generator: Optional[torch.Generator] = None):
    """(hidden, kv_a_w, kv_a_b, norm_w, kv_b_w, cos, sin) with realistic scales."""
    g = generator

    def rand(*shape, scale=1.0):
        t = (torch.randn(*shape, generator=g) * scale).to(dtype)
        return t.requires_grad_(requires_grad)

    hidden = rand(d.B, d.S, d.H)
    kv_a = rand(d.L + d.R, d.H, scale=d.H ** -0.5)
    kv_a_b = rand(d.L + d.R, scale=0.1) if bias else None
    norm_w = (1.0 + 0.1 * torch.randn(d.L, generator=g)).to(dtype).requires_grad_(requires_grad)
    kv_b = rand(d.N * (d.P + d.V), d.L, scale=d.L ** -0.5)
    table_dtype = torch.promote_types(dtype, torch.float32)  # fp32 tables; fp64 under gradcheck
    cos, sin = (t.to(table_dtype) for t in rope_tables(d.B, d.S, d.R, offset=3))
    return hidden, kv_a, kv_a_b, norm_w, kv_b, cos, sin


def prolog_kwargs(d: Dims, **extra):
    return dict(num_heads=d.N, qk_nope_head_dim=d.P, v_head_dim=d.V, **extra)


def paged_case(num_blocks: int, block_size: int, lens: list[int], *, key_shape=(1, 16), value_shape=(1, 8),
               dtype=torch.bfloat16, columns: Optional[int] = None, offsets: Optional[list[int]] = None,
               seed: int = 0):
    """A random paged cache pair, block tables with distinct physical blocks, cumsum seq_lens."""
    g = torch.Generator().manual_seed(seed)
    key_cache = torch.randn(num_blocks, block_size, *key_shape, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, *value_shape, generator=g).to(dtype)
    offsets = offsets or [0] * len(lens)
    need = [o // block_size + -(-n // block_size) for n, o in zip(lens, offsets)]
    columns = columns or max(need + [1])
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(lens), columns), -1, dtype=torch.int32)
    used = 0
    for q, n_cols in enumerate(need):
        tables[q, :n_cols] = perm[used:used + n_cols].to(torch.int32)
        used += n_cols
    cumsum = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cumsum[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    return key_cache, value_cache, tables, cumsum, torch.tensor(offsets, dtype=torch.int32)


def gather_loop_reference(key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset=None,
                          is_seq_lens_cumsum=False):
    """The gather semantics (docs/design.md) written as the plainest possible Python loop (the test oracle)."""
    block_size = key_cache.shape[1]
    key, value = key.clone(), value.clone()
    num_seqs = block_tables.shape[0]
    base = 0
    for q in range(num_seqs):
        if is_seq_lens_cumsum:
            seq_len, base = int(seq_lens[q + 1] - seq_lens[q]), int(seq_lens[q])
        else:
            seq_len = int(seq_lens[q])
        table_offset = 0 if seq_offset is None else int(seq_offset[q]) // block_size
        for t in range(seq_len):
            physical = int(block_tables[q, table_offset + t // block_size])
            key[base + t] = key_cache[physical, t % block_size]
            value[base + t] = value_cache[physical, t % block_size]
        if not is_seq_lens_cumsum:
            base += seq_len
    return key, value


def scatter_loop_reference(key, value, key_cache, value_cache, slot_mapping):
    block_size = key_cache.shape[1]
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    for t in range(key.shape[0]):
        slot = int(slot_mapping[t])
        if slot < 0:
            continue
        key_cache[slot // block_size, slot % block_size] = key[t]
        value_cache[slot // block_size, slot % block_size] = value[t]
    return key_cache, value_cache


def materialized_decode_reference(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, scale):
    """fp64 decode attention via the materialised latent per sequence (loop over the batch)."""
    block_size = key_cache.shape[1]
    out = []
    for b in range(q_latent.shape[0]):
        n = int(seq_lens[b])
        ids = [int(block_tables[b, t // block_size]) for t in range(n)]
        offs = [t % block_size for t in range(n)]
        latent = torch.stack([key_cache[i, o, 0] for i, o in zip(ids, offs)]).double()
        k_pe = torch.stack([value_cache[i, o, 0] for i, o in zip(ids, offs)]).double()
        scores = (q_latent[b].double() @ latent.T + q_pe[b].double() @ k_pe.T) * scale
        out.append(torch.softmax(scores, -1) @ latent)
    return torch.stack(out)


class MlaCalls(TorchDispatchMode):
    """Counts torch.ops.mla.* calls that reach the dispatcher."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "mla":
            name = func.overloadpacket.__name__
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def random_prompt(config, batch=1, length=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, config.vocab_size, (batch, length), generator=g)
