"""`mla.mla_decode_attention` against materialised attention over the same paged cache."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mla_ops
from mla_ops.ops.decode_attention import decode_sync_free
from mla_ops.testing.oracles import mla_decode_attention_oracle

from utils import paged_case


def _case(dtype, lens, block_size=4, heads=4, lora=32, rope=8, seed=0):
    key_cache, value_cache, tables, cumsum, _ = paged_case(
        len(lens) * 8, block_size, lens, key_shape=(1, lora), value_shape=(1, rope), dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q_latent = torch.randn(len(lens), heads, lora, generator=g).to(dtype)
    q_pe = torch.randn(len(lens), heads, rope, generator=g).to(dtype)
    return q_latent, q_pe, key_cache, value_cache, tables, torch.tensor(lens)


@pytest.mark.parametrize("lens", [[1], [5, 1, 12], [16, 3]])
def test_matches_fp64_latent_attention(lens):
    args = _case(torch.float32, lens)
    out = mla_ops.mla_decode_attention(*args, softmax_scale=0.17)
    expected = mla_decode_attention_oracle(*args, 0.17)[0]
    # fp32 scores/softmax/sum over <= 16 tokens of unit-scale data: errors of a few fp32 ulps.
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_absorbed_equals_materialized_kv_b_attention(dtype, tol):
    """The stock (materialising) computation: expand the cached latent with kv_b into per-head
    k_nope/value, attend with q = [q_nope | q_pe] over K = [k_nope | k_pe], then o = p @ V.
    The absorbed path: q_latent = q_nope @ W_UK, o = (p @ latent) @ W_UV. Same maths,
    different association: fp32 agrees to rounding (scores of 64 terms, |o| ~ 0.1-1, rel ~1e-6);
    bf16 differs by the roundings of bf16 intermediates the two orders put in different places
    (a few bf16 ulps of |o| ~ 1, i.e. ~1e-2)."""
    heads, lora, rope, nope, v = 4, 32, 8, 16, 16
    lens = [9, 2]
    q_latent_unused, q_pe, key_cache, value_cache, tables, seq_lens = _case(dtype, lens, heads=heads, lora=lora,
                                                                              rope=rope)
    g = torch.Generator().manual_seed(3)
    kv_b = (torch.randn(heads * (nope + v), lora, generator=g) * lora ** -0.5).to(dtype)
    w = kv_b.view(heads, nope + v, lora)
    w_uk, w_uv = w[:, :nope], w[:, nope:]  # [N, P, L], [N, V, L]
    q_nope = torch.randn(len(lens), heads, nope, generator=g).to(dtype)
    scale = (nope + rope) ** -0.5
    q_latent = torch.einsum("bnp,npl->bnl", q_nope, w_uk)
    o_latent = mla_ops.mla_decode_attention(q_latent, q_pe, key_cache, value_cache, tables, seq_lens, scale)
    out = torch.einsum("bnl,nvl->bnv", o_latent, w_uv)
    for b, n in enumerate(lens):
        block_size = key_cache.shape[1]
        idx = [(int(tables[b, t // block_size]), t % block_size) for t in range(n)]
        latent = torch.stack([key_cache[i, o, 0] for i, o in idx])  # [T, L]
        k_pe = torch.stack([value_cache[i, o, 0] for i, o in idx])  # [T, R]
        kv = (latent @ kv_b.T).view(n, heads, nope + v).transpose(0, 1)  # kv_b_proj over the cache
        k = torch.cat((kv[..., :nope], k_pe.expand(heads, n, rope)), -1)
        q = torch.cat((q_nope[b], q_pe[b]), -1)[:, None]  # [N, 1, P+R]
        p = torch.softmax((q @ k.transpose(1, 2)).float() * scale, -1).to(dtype)
        expected = (p @ kv[..., nope:])[:, 0]
        torch.testing.assert_close(out[b].float(), expected.float(), rtol=tol, atol=tol)


def test_blocks_past_seq_len_are_ignored():
    """Cache content after seq_len (and padding ids in the table) must not leak into the result."""
    args = list(_case(torch.float32, [6, 2], block_size=4))
    assert args[4][1, 1] == -1  # sequence 1 (2 tokens) uses only its first block: the rest is padding
    out = mla_ops.mla_decode_attention(*args, softmax_scale=0.3)
    tables, key_cache = args[4].clone(), args[2].clone()
    spare = int(tables[0, 1])  # sequence 0 uses rows 0..1 of its second block
    key_cache[spare, 2:] = 1e4
    tables[1, 1] = spare  # a real block full of 1e4 where sequence 1's padding id was
    key_cache[int(tables[1, 0]), 2:] = 1e4  # and sequence 1's own block past its length
    args[2], args[4] = key_cache, tables
    assert torch.equal(mla_ops.mla_decode_attention(*args, softmax_scale=0.3), out)


@pytest.mark.parametrize("lens", [[13], [16], [16, 16], [16, 9]],
                         ids=["one-row", "one-full-row-unmasked", "two-full-rows", "ragged"])
def test_contiguous_blocks_read_without_a_gather_give_the_same_result(lens):
    """Blocks laid out back to back (what a fresh allocator hands one sequence) are read through a
    view of the pool instead of a gather copy; the result must not depend on which path ran."""
    block_size, heads, lora, rope = 4, 2, 8, 4
    blocks = [-(-n // block_size) for n in lens]
    width = max(blocks)
    g = torch.Generator().manual_seed(5)
    key_cache = torch.randn(len(lens) * width + 3, block_size, 1, lora, generator=g)
    value_cache = torch.randn(len(lens) * width + 3, block_size, 1, rope, generator=g)
    contiguous = torch.arange(len(lens) * width, dtype=torch.int32).view(len(lens), width)
    q_latent, q_pe = torch.randn(len(lens), heads, lora, generator=g), torch.randn(len(lens), heads, rope, generator=g)
    seq_lens = torch.tensor(lens)
    out = mla_ops.mla_decode_attention(q_latent, q_pe, key_cache, value_cache, contiguous, seq_lens, 0.4)
    # the same data reached through a shuffled table takes the gather path
    perm = torch.randperm(key_cache.shape[0], generator=g)
    inverse = torch.argsort(perm)
    shuffled = inverse[contiguous.long()].to(torch.int32)
    out_gather = mla_ops.mla_decode_attention(q_latent, q_pe, key_cache[perm], value_cache[perm], shuffled, seq_lens,
                                              0.4)
    assert torch.equal(out, out_gather)
    torch.testing.assert_close(out.double(), mla_decode_attention_oracle(
        q_latent, q_pe, key_cache, value_cache, contiguous, seq_lens, 0.4)[0], rtol=1e-5, atol=1e-6)


def test_device_path_matches_the_cpu_path_and_zeroes_padding_rows():
    """The sync-free path other devices take (whole table width, clamped ids, always masked) run on
    CPU tensors: same result as the CPU path for real rows; a seq_len 0 padding row (a captured
    batch's filler) gives zeros instead of NaN; garbage ids past a row's length are never read."""

    q_latent, q_pe, key_cache, value_cache, tables, seq_lens = _case(torch.float32, [6, 2, 9], block_size=4)
    expected = mla_ops.mla_decode_attention(q_latent, q_pe, key_cache, value_cache, tables, seq_lens, 0.3)
    tables = tables.clone()
    assert tables.shape[1] >= 3  # row 1 (2 tokens) uses only its first block
    tables[1, 1], tables[1, 2] = -7, 10**6
    out = decode_sync_free(q_latent, q_pe, key_cache, value_cache, tables, seq_lens, 0.3)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    padded = decode_sync_free(q_latent, q_pe, key_cache, value_cache, tables, torch.tensor([6, 0, 9]), 0.3)
    assert torch.equal(padded[1], torch.zeros_like(padded[1]))
    torch.testing.assert_close(padded[[0, 2]], expected[[0, 2]], rtol=1e-6, atol=1e-6)


def test_split_views_of_one_pool_are_read_in_place():
    """The caches may be two views of one [NB, bs, 1, L+R] pool (cache[..., :L], cache[..., L:]):
    non-contiguous, read without copying the pool; same result as contiguous copies, on both the
    CPU path and the device path."""

    q_latent, q_pe, key_cache, value_cache, tables, seq_lens = _case(torch.float32, [5, 11], block_size=4)
    pool = torch.cat((key_cache, value_cache), -1)
    latent_view, pe_view = pool[..., :key_cache.shape[-1]], pool[..., key_cache.shape[-1]:]
    assert not latent_view.is_contiguous() and not pe_view.is_contiguous()
    expected = mla_ops.mla_decode_attention(q_latent, q_pe, key_cache, value_cache, tables, seq_lens, 0.2)
    assert torch.equal(mla_ops.mla_decode_attention(q_latent, q_pe, latent_view, pe_view, tables, seq_lens, 0.2),
                       expected)
    torch.testing.assert_close(decode_sync_free(q_latent, q_pe, latent_view, pe_view, tables, seq_lens, 0.2),
                               expected, rtol=1e-6, atol=1e-6)


def test_inference_mode_first_call_then_normal_calls():
    """The reused CPU workspace is made outside inference mode whatever mode the first call ran in;
    an inference tensor could not be written by a later call under plain no_grad (generate)."""
    import threading

    results = {}

    def run():  # a fresh thread: a fresh per-thread workspace, first made here under inference_mode
        args = _case(torch.float32, [5, 3])
        with torch.inference_mode():
            results["inference"] = mla_ops.mla_decode_attention(*args, softmax_scale=0.3)
        with torch.no_grad():
            results["no_grad"] = mla_ops.mla_decode_attention(*args, softmax_scale=0.3)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert torch.equal(results["inference"], results["no_grad"])


# ------------------------------------------------------------ slots a row must not attend to
POISONS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _poison_unattended(cache: torch.Tensor, tables: torch.Tensor, lens: list[int], value: float) -> torch.Tensor:
    """A copy of cache with every slot no row attends to set to `value` (garbage of torch.empty, an
    fp16 overflow): blocks no row uses, and the slots past each row's length in its last block."""
    block_size = cache.shape[1]
    attended = torch.zeros(cache.shape[0], block_size, dtype=torch.bool)
    for b, n in enumerate(lens):
        for t in range(n):
            attended[int(tables[b, t // block_size]), t % block_size] = True
    poisoned = cache.clone()
    poisoned[~attended] = value
    return poisoned


@pytest.mark.parametrize("poison", POISONS)
def test_a_poisoned_slot_past_the_length_leaves_the_output_finite(poison):
    """One sequence whose last block is partly filled: the slots after its length hold NaN/inf."""
    q_latent, q_pe, key_cache, value_cache, tables, seq_lens = _case(torch.float32, [6], block_size=4)
    expected = mla_ops.mla_decode_attention(q_latent, q_pe, key_cache, value_cache, tables, seq_lens, 0.3)
    key_cache = _poison_unattended(key_cache, tables, [6], POISONS[poison])
    value_cache = _poison_unattended(value_cache, tables, [6], POISONS[poison])
    for fn in (mla_ops.mla_decode_attention, decode_sync_free):
        out = fn(q_latent, q_pe, key_cache, value_cache, tables, seq_lens, 0.3)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_an_inf_in_one_rows_latent_does_not_reach_a_row_whose_padding_ids_clamp_onto_it():
    """Row 1's padding ids (-1) are clamped to block 0 on the sync-free path; block 0 belongs to
    row 0, whose own latent holds an inf there. Row 1 never references it and must stay finite, and
    a seq_lens == 0 padding row gives zeros."""
    block_size, heads, lora, rope = 4, 2, 8, 4
    g = torch.Generator().manual_seed(2)
    key_cache = torch.randn(4, block_size, 1, lora, generator=g)
    value_cache = torch.randn(4, block_size, 1, rope, generator=g)
    tables = torch.tensor([[0, 1], [2, -1], [-1, -1]], dtype=torch.int32)
    q_latent, q_pe = torch.randn(3, heads, lora, generator=g), torch.randn(3, heads, rope, generator=g)
    key_cache[0, 3, 0, 0] = float("inf")  # row 0 attends to it (6 tokens); its output may be non-finite
    out = decode_sync_free(q_latent, q_pe, key_cache, value_cache, tables, torch.tensor([6, 3, 0]), 0.3)
    expected = mla_decode_attention_oracle(q_latent[1:2], q_pe[1:2], key_cache, value_cache, tables[1:2],
                                             torch.tensor([3]), 0.3)[0]
    torch.testing.assert_close(out[1:2].double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_property_poisoned_unattended_slots_never_reach_any_output(data):
    """Random ragged batches over a shuffled pool whose every unattended slot is NaN or inf: both
    the CPU path and the sync-free path equal the fp64 oracle over the attended slots; the
    sync-free path also takes seq_lens == 0 padding rows (zeros) and garbage ids past a length."""
    block_size = data.draw(st.sampled_from([1, 2, 4]))
    lens = data.draw(st.lists(st.integers(1, 10), min_size=1, max_size=4))
    poison = POISONS[data.draw(st.sampled_from(sorted(POISONS)))]
    heads, lora, rope = 2, 8, 4
    seed = data.draw(st.integers(0, 1000))
    key_cache, value_cache, tables, _, _ = paged_case(sum(-(-n // block_size) for n in lens) + 2, block_size, lens,
                                                      key_shape=(1, lora), value_shape=(1, rope),
                                                      dtype=torch.float32, seed=seed)
    g = torch.Generator().manual_seed(seed)
    q_latent, q_pe = torch.randn(len(lens), heads, lora, generator=g), torch.randn(len(lens), heads, rope, generator=g)
    key_cache = _poison_unattended(key_cache, tables, lens, poison)
    value_cache = _poison_unattended(value_cache, tables, lens, poison)
    seq_lens = torch.tensor(lens)
    expected = mla_decode_attention_oracle(q_latent, q_pe, key_cache, value_cache, tables, seq_lens, 0.3)[0]
    out = mla_ops.mla_decode_attention(q_latent, q_pe, key_cache, value_cache, tables, seq_lens, 0.3)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
    # sync-free: one row turned into padding (length 0), garbage ids past every length
    pad = data.draw(st.integers(0, len(lens) - 1))
    padded_lens = seq_lens.clone()
    padded_lens[pad] = 0
    garbage = tables.clone()
    garbage[garbage < 0] = data.draw(st.sampled_from([-5, 0, 10**6]))
    out = decode_sync_free(q_latent, q_pe, key_cache, value_cache, garbage, padded_lens, 0.3)
    keep = [b for b in range(len(lens)) if b != pad]
    torch.testing.assert_close(out[keep].double(), expected[keep], rtol=1e-5, atol=1e-6)
    assert torch.equal(out[pad], torch.zeros_like(out[pad]))


@pytest.mark.parametrize("lens", [[6], [8, 6]], ids=["one-row-view-of-the-pool", "back-to-back-ragged"])
def test_poison_past_the_length_of_back_to_back_blocks(lens):
    """Back-to-back blocks are read through a view of the pool (no copy, so nothing can be zeroed
    there): the poisoned tail past the longest row stays out of the output GEMM, and a ragged batch
    takes the gather copy whose unattended rows are zeroed."""
    block_size, heads, lora, rope = 4, 2, 8, 4
    g = torch.Generator().manual_seed(9)
    key_cache = torch.randn(len(lens) * 2 + 1, block_size, 1, lora, generator=g)
    value_cache = torch.randn(len(lens) * 2 + 1, block_size, 1, rope, generator=g)
    tables = torch.arange(len(lens) * 2, dtype=torch.int32).view(len(lens), 2)
    q_latent, q_pe = torch.randn(len(lens), heads, lora, generator=g), torch.randn(len(lens), heads, rope, generator=g)
    seq_lens = torch.tensor(lens)
    key_cache = _poison_unattended(key_cache, tables, lens, float("nan"))
    value_cache = _poison_unattended(value_cache, tables, lens, float("inf"))
    out = mla_ops.mla_decode_attention(q_latent, q_pe, key_cache, value_cache, tables, seq_lens, 0.3)
    expected = mla_decode_attention_oracle(q_latent, q_pe, key_cache, value_cache, tables, seq_lens, 0.3)[0]
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("poison", sorted(POISONS))
@pytest.mark.parametrize("bad_id", [-1, -7, 6, 10**6])
def test_an_invalid_id_inside_a_length_contributes_nothing_on_the_sync_free_path(bad_id, poison):
    """The defined meaning of an out-of-range block id at a position a row attends to: on the
    sync-free path (what device tensors run) that position contributes nothing, as if masked, and a
    row left with no valid position gives zeros — whatever the pool holds where the clamped id lands
    (blocks 0 and 5 here, poisoned). The eager CPU path refuses the same call, naming block_tables."""
    block_size, heads, lora, rope = 4, 2, 8, 4
    g = torch.Generator().manual_seed(3)
    key_cache = torch.randn(6, block_size, 1, lora, generator=g)
    value_cache = torch.randn(6, block_size, 1, rope, generator=g)
    for cache in (key_cache, value_cache):
        cache[0] = cache[5] = POISONS[poison]  # where ids below 0 / at or past 6 are clamped to
    tables = torch.tensor([[1, bad_id, 2], [bad_id, bad_id, -1], [3, 4, bad_id]])
    lens = torch.tensor([10, 5, 12])
    q_latent, q_pe = torch.randn(3, heads, lora, generator=g), torch.randn(3, heads, rope, generator=g)
    out = decode_sync_free(q_latent, q_pe, key_cache, value_cache, tables, lens, 0.3)
    # rows 0 and 2 attend to exactly their valid positions: blocks [1, 2] for 6 tokens, [3, 4] for 8
    expected = mla_decode_attention_oracle(q_latent[[0, 2]], q_pe[[0, 2]], key_cache, value_cache,
                                             torch.tensor([[1, 2], [3, 4]]), torch.tensor([6, 8]), 0.3)[0]
    torch.testing.assert_close(out[[0, 2]].double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    with pytest.raises(ValueError, match="block_tables"):
        mla_ops.mla_decode_attention(q_latent, q_pe, key_cache, value_cache, tables, lens, 0.3)
