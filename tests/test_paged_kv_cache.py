"""Paged KV-cache ops, bit-exact against a plain Python loop over their semantics.

Covers the ten sweep levels of the original GatherPaKvCache sample on the real network cache shapes,
the two hand-targeted shapes, both seq_lens modes, tail blocks, nonzero seq_offset, rows no sequence
covers, random tables (hypothesis), scatter -> gather round trips, and the device (sync-free) code path.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mla_ops
from mla_ops.ops.gather_pa_kv_cache import gather_sync_free
from mla_ops.ops.scatter_pa_kv_cache import scatter_sync_free
from mla_ops.testing.oracles import gather_pa_kv_cache_oracle, scatter_pa_kv_cache_oracle

from utils import paged_case

# The original sample's network sweep (cann/pypto-gym, GatherPaKvCache tests): Q=4 with these totals,
# and Q=3 with 44 tokens.
SWEEP_LEVELS = [(4, 6), (4, 27), (4, 31), (4, 35), (4, 39), (4, 43), (4, 47), (4, 51), (4, 55), (3, 44)]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern view, so random bit caches (NaN payloads included) compare exactly."""
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def random_bits_cache(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2 ** 15), 2 ** 15 - 1, shape, dtype=torch.int16, generator=g).view(dtype)


@pytest.fixture(scope="module")
def network_caches():
    """The original sample's network cache rows: key_cache [*,128,1,512], value_cache [*,128,1,64], bf16.

    640 blocks instead of the sample's 5513 (812 MB): the gather reads only the blocks the tables
    name, so the pool size changes nothing but memory (94 MB here)."""
    return random_bits_cache(640, 128, 1, 512, seed=1), random_bits_cache(640, 128, 1, 64, seed=2)


def split_tokens(total: int, parts: int, g: torch.Generator) -> list[int]:
    cuts = sorted(torch.randint(0, total + 1, (parts - 1,), generator=g).tolist())
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


def sweep_case(num_seqs, total, num_blocks, block_size=128, columns=8, seed=0):
    g = torch.Generator().manual_seed(seed + total)
    lens = split_tokens(total, num_seqs, g)
    offsets = [block_size * int(o) for o in torch.randint(0, 3, (num_seqs,), generator=g)]
    tables = torch.randint(0, num_blocks, (num_seqs, columns), generator=g, dtype=torch.int32)
    cumsum = torch.zeros(num_seqs + 1, dtype=torch.int32)
    cumsum[1:] = torch.cumsum(torch.tensor(lens), 0)
    return lens, tables, cumsum, torch.tensor(offsets, dtype=torch.int32)


@pytest.mark.parametrize("num_seqs,total", SWEEP_LEVELS, ids=[f"level{i}" for i in range(10)])
@pytest.mark.parametrize("cumsum_mode", [True, False], ids=["cumsum", "lengths"])
def test_gather_sample_sweep_levels(network_caches, num_seqs, total, cumsum_mode):
    key_cache, value_cache = network_caches
    lens, tables, cumsum, offsets = sweep_case(num_seqs, total, key_cache.shape[0])
    seq_lens = cumsum if cumsum_mode else torch.tensor(lens, dtype=torch.int32)
    key = random_bits_cache(total + 3, 1, 512, seed=3)  # 3 rows past the end: must stay untouched
    value = random_bits_cache(total + 3, 1, 64, seed=4)
    exp_key, exp_value = gather_pa_kv_cache_oracle(key_cache, value_cache, tables, seq_lens, key, value,
                                                   seq_offset=offsets, is_seq_lens_cumsum=cumsum_mode)
    torch.ops.mla.gather_pa_kv_cache(key_cache, value_cache, tables, seq_lens, key, value, seq_offset=offsets,
                                     is_seq_lens_cumsum=cumsum_mode)
    assert torch.equal(bits(key), bits(exp_key)) and torch.equal(bits(value), bits(exp_value))
    # the allocating helper and the functional twin agree
    k2, v2 = mla_ops.gather_pa_kv_cache(key_cache, value_cache, tables, cumsum, seq_offset=offsets,
                                    is_seq_lens_cumsum=True)
    assert torch.equal(bits(k2), bits(exp_key[:total])) and torch.equal(bits(v2), bits(exp_value[:total]))


@pytest.mark.parametrize("name,key_shape,value_shape", [
    ("heads1_k128_v64", (1, 128), (1, 64)),
    ("heads64_k128_v128", (64, 128), (64, 128)),
])
def test_gather_targeted_shapes(name, key_shape, value_shape):
    key_cache = random_bits_cache(64, 128, *key_shape, seed=5)
    value_cache = random_bits_cache(64, 128, *value_shape, seed=6)
    lens, tables, cumsum, offsets = sweep_case(2, 6, 64, seed=7)
    key = torch.zeros(6, *key_shape, dtype=torch.bfloat16)
    value = torch.zeros(6, *value_shape, dtype=torch.bfloat16)
    exp = gather_pa_kv_cache_oracle(key_cache, value_cache, tables, cumsum, key, value, seq_offset=offsets,
                                    is_seq_lens_cumsum=True)
    out = torch.ops.mla.gather_pa_kv_cache_functional(key_cache, value_cache, tables, cumsum, key, value,
                                                      seq_offset=offsets, is_seq_lens_cumsum=True)
    assert torch.equal(bits(out[0]), bits(exp[0])) and torch.equal(bits(out[1]), bits(exp[1]))
    assert not key.any() and not value.any(), "the functional twin must not write its inputs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gather_tail_blocks_offsets_and_uncovered_rows(dtype):
    key_cache, value_cache, tables, cumsum, offsets = paged_case(
        16, 4, [5, 0, 4, 9, 1], key_shape=(2, 3), value_shape=(1, 5), dtype=dtype, offsets=[4, 0, 8, 0, 12],
        columns=6)
    key, value = torch.full((25, 2, 3), 7.0, dtype=dtype), torch.full((25, 1, 5), 7.0, dtype=dtype)
    exp = gather_pa_kv_cache_oracle(key_cache, value_cache, tables, cumsum, key, value, seq_offset=offsets,
                                    is_seq_lens_cumsum=True)
    torch.ops.mla.gather_pa_kv_cache(key_cache, value_cache, tables, cumsum, key, value, seq_offset=offsets,
                                     is_seq_lens_cumsum=True)
    assert torch.equal(key, exp[0]) and torch.equal(value, exp[1])
    assert (key[19:] == 7).all(), "rows past the 19 gathered tokens must be untouched"


def test_gather_int64_indices_and_noncontiguous_output():
    key_cache, value_cache, tables, cumsum, _ = paged_case(8, 4, [3, 6], key_shape=(1, 8), value_shape=(1, 4),
                                                           dtype=torch.float32)
    key_big = torch.zeros(9, 1, 16)
    key = key_big[..., ::2]  # strided output
    value = torch.zeros(9, 1, 4)
    exp = gather_pa_kv_cache_oracle(key_cache, value_cache, tables, cumsum, key, value, seq_offset=None,
                                    is_seq_lens_cumsum=True)
    torch.ops.mla.gather_pa_kv_cache(key_cache, value_cache, tables.long(), cumsum.long(), key, value,
                                     is_seq_lens_cumsum=True)
    assert torch.equal(key, exp[0]) and torch.equal(value, exp[1])
    assert not key_big[..., 1::2].any()


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_gather_property_random_tables(data):
    """Random tables, offsets, both seq_lens modes, empty tables, poisoned unread slots; the CPU
    path and the sync-free path against the loop."""
    block_size = data.draw(st.sampled_from([1, 2, 4, 16]))
    num_blocks = data.draw(st.integers(1, 12))
    num_seqs = data.draw(st.integers(0, 5))
    columns = data.draw(st.integers(0, 4))  # 0: a [Q, 0] table, valid when every length is 0
    lens, offsets = [], []
    for _ in range(num_seqs):
        off_cols = data.draw(st.integers(0, max(columns - 1, 0)))
        max_len = (columns - off_cols) * block_size
        lens.append(data.draw(st.integers(0, max_len)))
        offsets.append(off_cols * block_size)
    tables = torch.tensor([[data.draw(st.integers(0, num_blocks - 1)) for _ in range(columns)]
                           for _ in range(num_seqs)], dtype=torch.int32).reshape(num_seqs, columns)
    cumsum_mode = data.draw(st.booleans())
    seq_lens = torch.tensor(([0] + list(torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0).tolist()))
                            if cumsum_mode else lens, dtype=torch.int64)
    extra = data.draw(st.integers(0, 3))
    total = sum(lens) + extra
    key_cache = torch.randn(num_blocks, block_size, 2, 3)
    value_cache = torch.randn(num_blocks, block_size, 1, 2)
    key, value = torch.randn(total, 2, 3), torch.randn(total, 1, 2)
    # without seq_offset every sequence starts at column 0, which always has room for its blocks
    offs = torch.tensor(offsets, dtype=torch.int32) if data.draw(st.booleans()) else None
    # slots no sequence reads hold NaN/inf (torch.empty garbage): they must reach no output row
    # (torch.equal fails on a NaN)
    read = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for q, n in enumerate(lens):
        first_col = 0 if offs is None else offsets[q] // block_size
        for t in range(n):
            read[int(tables[q, first_col + t // block_size]), t % block_size] = True
    poison = data.draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    key_cache[~read], value_cache[~read] = poison, poison
    exp = gather_pa_kv_cache_oracle(key_cache, value_cache, tables, seq_lens, key, value, seq_offset=offs,
                                    is_seq_lens_cumsum=cumsum_mode)
    out_key, out_value = key.clone(), value.clone()
    torch.ops.mla.gather_pa_kv_cache(key_cache, value_cache, tables, seq_lens, out_key, out_value,
                                     seq_offset=offs, is_seq_lens_cumsum=cumsum_mode)
    assert torch.equal(out_key, exp[0]) and torch.equal(out_value, exp[1])
    # the device (sync-free) path computes the same thing
    dev_key, dev_value = key.clone(), value.clone()
    gather_sync_free(key_cache, value_cache, tables, seq_lens, dev_key, dev_value, offs, cumsum_mode)
    assert torch.equal(dev_key, exp[0]) and torch.equal(dev_value, exp[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_against_loop_with_padding(dtype):
    key_cache = torch.randn(6, 4, 1, 8).to(dtype)
    value_cache = torch.randn(6, 4, 1, 2).to(dtype)
    slots = torch.tensor([5, -1, 0, 23, -7, 12], dtype=torch.int32)
    key, value = torch.randn(6, 1, 8).to(dtype), torch.randn(6, 1, 2).to(dtype)
    exp = scatter_pa_kv_cache_oracle(key, value, key_cache, value_cache, slots)
    dev = key_cache.clone(), value_cache.clone()
    torch.ops.mla.scatter_pa_kv_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, exp[0]) and torch.equal(value_cache, exp[1])
    scatter_sync_free(key, value, *dev, slots)
    assert torch.equal(dev[0], exp[0]) and torch.equal(dev[1], exp[1])


def testscatter_sync_free_all_padding_writes_nothing():
    key_cache, value_cache = torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 2)
    before = key_cache.clone(), value_cache.clone()
    scatter_sync_free(torch.randn(3, 1, 8), torch.randn(3, 1, 2), key_cache, value_cache,
                           torch.tensor([-1, -1, 99]))  # 99 is out of range: skipped, never written
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(0, 20), min_size=1, max_size=4), block_size=st.sampled_from([1, 4, 8]),
       seed=st.integers(0, 1000))
def test_scatter_then_gather_round_trip(lens, block_size, seed):
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks, generator=g)
    columns = max(blocks_per_seq + [1])
    tables = torch.full((len(lens), columns), -1, dtype=torch.int32)
    slots, used = [], 0
    for q, (n, nb) in enumerate(zip(lens, blocks_per_seq)):
        tables[q, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
        slots += [int(tables[q, t // block_size]) * block_size + t % block_size for t in range(n)]
    total = sum(lens)
    key, value = torch.randn(total, 1, 6, generator=g), torch.randn(total, 1, 3, generator=g)
    key_cache, value_cache = torch.zeros(num_blocks, block_size, 1, 6), torch.zeros(num_blocks, block_size, 1, 3)
    mla_ops.scatter_pa_kv_cache(key, value, key_cache, value_cache, torch.tensor(slots, dtype=torch.int64))
    seq_lens = torch.tensor([0] + torch.cumsum(torch.tensor(lens), 0).tolist(), dtype=torch.int32)
    out_key, out_value = mla_ops.gather_pa_kv_cache(key_cache, value_cache, tables, seq_lens, is_seq_lens_cumsum=True)
    assert torch.equal(out_key, key) and torch.equal(out_value, value)


@pytest.mark.parametrize("fn,argnames", [
    (gather_sync_free, "gather"),
    (scatter_sync_free, "scatter"),
])
def test_device_paths_are_sync_free(fn, argnames):
    """Trace the device code paths with fake tensors: any host sync (.item(), bool(), int() of a
    tensor, data-dependent shapes) would raise a data-dependent error here."""
    from torch.fx.experimental.proxy_tensor import make_fx

    key_cache, value_cache, tables, cumsum, offsets = paged_case(8, 4, [3, 6], key_shape=(1, 8),
                                                                 value_shape=(1, 4), dtype=torch.float32)
    key, value = torch.zeros(9, 1, 8), torch.zeros(9, 1, 4)
    if argnames == "gather":
        def run(kc, vc, bt, sl, k, v, so):
            fn(kc, vc, bt, sl, k, v, so, True)
            return k, v
        graph = make_fx(run, tracing_mode="fake")(key_cache, value_cache, tables, cumsum, key, value, offsets)
    else:
        def run(k, v, kc, vc, slots):
            fn(k, v, kc, vc, slots)
            return kc, vc
        graph = make_fx(run, tracing_mode="fake")(key, value, key_cache, value_cache, torch.tensor([1, -1, 5] * 3))
    code = str(graph.code)
    assert any(op in code for op in ("aten.index.Tensor", "aten.index_select", "aten.index_put")), code


@pytest.mark.parametrize("layout", ["range-permuted", "range-with-holes", "scattered-blocks", "partial-runs"])
def test_scatter_block_wise_paths_match_the_loop(layout):
    """Whole-block runs are written block-wise (a permutation of a block range through index_select,
    a range with a few holes stretch by stretch, other block sets through index_put_); whatever the
    path, the result is the plain loop's."""
    block_size, num_blocks = 4, 24
    g = torch.Generator().manual_seed(11)
    if layout == "range-permuted":
        blocks = (torch.randperm(8, generator=g) + 5).tolist()
    elif layout == "range-with-holes":
        blocks = [5, 9, 6, 12, 8, 11]  # range 5..12 without 7 and 10
    elif layout == "scattered-blocks":
        blocks = [20, 1, 13, 3]
    else:
        blocks = [2, 3, 7]
    slots = torch.tensor([b * block_size + t for b in blocks for t in range(block_size)])
    if layout == "partial-runs":
        slots = torch.cat((slots, torch.tensor([17 * block_size + 1, 40, -1, 41])))  # tail tokens, padding
    key, value = torch.randn(len(slots), 2, 3, generator=g), torch.randn(len(slots), 1, 5, generator=g)
    key_cache = torch.randn(num_blocks, block_size, 2, 3, generator=g)
    value_cache = torch.randn(num_blocks, block_size, 1, 5, generator=g)
    expected = scatter_pa_kv_cache_oracle(key, value, key_cache, value_cache, slots)
    torch.ops.mla.scatter_pa_kv_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected[0]) and torch.equal(value_cache, expected[1])


@pytest.mark.parametrize("contiguous_output", [True, False])
def test_gather_block_wise_path_with_aligned_sequences(contiguous_output):
    """Sequences whose lengths are whole blocks (then one with a tail) are copied block-wise."""
    key_cache, value_cache, tables, cumsum, offsets = paged_case(
        20, 4, [8, 4, 6, 3], key_shape=(2, 3), value_shape=(1, 5), dtype=torch.float32, offsets=[0, 4, 0, 8],
        columns=4)
    if contiguous_output:
        key, value = torch.full((23, 2, 3), 5.0), torch.full((23, 1, 5), 5.0)
    else:
        key, value = torch.full((23, 2, 6), 5.0)[..., ::2], torch.full((23, 1, 5), 5.0)
    expected = gather_pa_kv_cache_oracle(key_cache, value_cache, tables, cumsum, key, value, seq_offset=offsets,
                                         is_seq_lens_cumsum=True)
    torch.ops.mla.gather_pa_kv_cache(key_cache, value_cache, tables, cumsum, key, value, seq_offset=offsets,
                                     is_seq_lens_cumsum=True)
    assert torch.equal(key, expected[0]) and torch.equal(value, expected[1])


def _layout(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values in a tensor of the given memory layout (all views of a larger buffer)."""
    if layout == "contiguous":
        return tensor.clone()
    if layout == "misaligned":  # storage offset of one element: no wide reinterpretation divides it
        buf = torch.zeros(1 + tensor.numel(), dtype=tensor.dtype)
        out = buf[1:].view(tensor.shape)
    elif layout == "split-view":  # the first columns of a wider pool, like cache[..., :L]
        out = torch.zeros(*tensor.shape[:-1], tensor.shape[-1] + 3, dtype=tensor.dtype)[..., :tensor.shape[-1]]
    else:  # "uneven-blocks": every other block of a pool, with a gap per row too (no dims merge)
        wide = torch.zeros(tensor.shape[0] * 2, tensor.shape[1] * 2, *tensor.shape[2:], dtype=tensor.dtype)
        out = wide[::2, ::2]
    out.copy_(tensor)
    return out


LAYOUTS = ["contiguous", "misaligned", "split-view", "uneven-blocks"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("path", ["cpu", "sync-free"])
def test_gather_any_cache_and_output_layout(layout, path):
    """Results never depend on strides or storage offsets, on either path, and a strided cache is
    read in place (the pool is not modified)."""

    key_cache, value_cache, tables, cumsum, _ = paged_case(12, 4, [8, 5, 9], key_shape=(1, 6), value_shape=(1, 2))
    key, value = torch.zeros(22, 1, 6, dtype=torch.bfloat16), torch.zeros(22, 1, 2, dtype=torch.bfloat16)
    expected = gather_pa_kv_cache_oracle(key_cache, value_cache, tables, cumsum, key, value, is_seq_lens_cumsum=True)
    kc, vc, k, v = (_layout(t, layout) for t in (key_cache, value_cache, key, value))
    if path == "cpu":
        torch.ops.mla.gather_pa_kv_cache(kc, vc, tables, cumsum, k, v, is_seq_lens_cumsum=True)
    else:
        gather_sync_free(kc, vc, tables, cumsum, k, v, None, True)
    assert torch.equal(k, expected[0]) and torch.equal(v, expected[1])
    assert torch.equal(kc, key_cache) and torch.equal(vc, value_cache)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("path", ["cpu", "sync-free"])
def test_scatter_any_cache_and_source_layout(layout, path):
    """Writes land in the caller's tensors whatever their layout (a split view writes into its pool),
    with whole-block runs, a partial block and padding in one slot mapping."""

    g = torch.Generator().manual_seed(4)
    key_cache = torch.randn(10, 4, 1, 6, generator=g).to(torch.bfloat16)
    value_cache = torch.randn(10, 4, 1, 2, generator=g).to(torch.bfloat16)
    slots = torch.tensor([12, 13, 14, 15, 20, 21, 22, 23, -1, 33, 34, 2])
    key = torch.randn(12, 1, 6, generator=g).to(torch.bfloat16)
    value = torch.randn(12, 1, 2, generator=g).to(torch.bfloat16)
    expected = scatter_pa_kv_cache_oracle(key, value, key_cache, value_cache, slots)
    kc, vc, k, v = (_layout(t, layout) for t in (key_cache, value_cache, key, value))
    if path == "cpu":
        mla_ops.scatter_pa_kv_cache(k, v, kc, vc, slots)
    else:
        scatter_sync_free(k, v, kc, vc, slots)
    assert torch.equal(kc, expected[0]) and torch.equal(vc, expected[1])


@pytest.mark.parametrize("cumsum_mode", [False, True])
def test_gather_with_an_empty_block_table(cumsum_mode):
    """A [Q, 0] table with zero lengths is valid: nothing is written, on the CPU path and the sync-free
    path alike (which has no column to clamp ids into)."""
    key_cache, value_cache = torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 2)
    tables = torch.zeros(1, 0, dtype=torch.int32)
    seq_lens = torch.tensor([0, 0] if cumsum_mode else [0])
    key, value = torch.randn(3, 1, 8), torch.randn(3, 1, 2)
    for gather in (torch.ops.mla.gather_pa_kv_cache, gather_sync_free):
        out_key, out_value = key.clone(), value.clone()
        if gather is gather_sync_free:
            gather(key_cache, value_cache, tables, seq_lens, out_key, out_value, None, cumsum_mode)
        else:
            gather(key_cache, value_cache, tables, seq_lens, out_key, out_value, is_seq_lens_cumsum=cumsum_mode)
        assert torch.equal(out_key, key) and torch.equal(out_value, value)
