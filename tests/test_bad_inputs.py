"""Bad inputs beyond the case database's error inputs (which tests/test_cases.py runs for every op,
eagerly and compiled): the Python helpers' own value checks, the allocating gather's refusals before it
allocates, and the sync-free device paths never touching memory out of bounds whatever the ids."""
import re

import pytest
import torch

import mla_ops
from mla_ops.ops.gather_pa_kv_cache import gather_sync_free
from mla_ops.ops.scatter_pa_kv_cache import scatter_sync_free

from utils import paged_case


def _gather_args(**changes):
    kc, vc, tables, cumsum, offsets = paged_case(10, 4, [5, 3], key_shape=(1, 8), value_shape=(1, 4),
                                                 dtype=torch.float32, offsets=[4, 0], columns=4)
    args = dict(key_cache=kc, value_cache=vc, block_tables=tables, seq_lens=cumsum,
                key=torch.full((8, 1, 8), 3.0), value=torch.full((8, 1, 4), 3.0), seq_offset=offsets,
                is_seq_lens_cumsum=True)
    args.update(changes)
    return args



def test_explicit_validation_helpers_check_values():
    """The Python helpers run the same value checks on request (what non-CPU callers use)."""
    args = _gather_args(block_tables=torch.tensor([[0, 1, 99, 3], [4, 5, 6, 7]], dtype=torch.int32))
    with pytest.raises(ValueError, match=re.escape("block_tables[0, 2] = 99")):
        mla_ops.gather_pa_kv_cache(args["key_cache"], args["value_cache"], args["block_tables"], args["seq_lens"],
                                   seq_offset=args["seq_offset"], is_seq_lens_cumsum=True, validate=True)


@pytest.mark.parametrize("seq_lens,cumsum,message", [
    (torch.tensor([], dtype=torch.int64), True, r"seq_lens is empty, but with is_seq_lens_cumsum=True"),
    (torch.tensor([2**62, 2**62]), False, r"seq_lens adds up to 9223372036854775808 tokens"),
    (torch.tensor([0, 2**63 - 1]), True, r"seq_lens adds up to 9223372036854775807 tokens"),
], ids=["empty-cumsum", "sum-past-int64", "huge-cumsum"])
def test_allocating_gather_helper_names_seq_lens_before_allocating(seq_lens, cumsum, message):
    """The helper sizes its outputs from seq_lens on the host: values no table can address are
    refused there, naming seq_lens, not as an IndexError or a "negative dimension" allocation."""
    kc, vc, *_ = paged_case(4, 4, [3], key_shape=(1, 8), value_shape=(1, 4), dtype=torch.float32)
    tables = torch.zeros(max(seq_lens.shape[0] - int(cumsum), 0), 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        mla_ops.gather_pa_kv_cache(kc, vc, tables, seq_lens, is_seq_lens_cumsum=cumsum)


def _guarded(shape, fill):
    """A tensor living inside a larger buffer with sentinel regions before and after it."""
    numel = torch.Size(shape).numel()
    buf = torch.full((numel + 64,), fill, dtype=torch.float32)
    return buf, buf[32:32 + numel].view(shape)


def test_device_paths_never_touch_memory_out_of_bounds():
    """Invalid ids on the sync-free path: nothing outside the caches/outputs changes, out-of-range
    gathered rows read as zeros, out-of-range slots are skipped."""
    kbuf, key_cache = _guarded((4, 2, 1, 3), -5.0)
    vbuf, value_cache = _guarded((4, 2, 1, 2), -5.0)
    key_cache.normal_(), value_cache.normal_()
    before = kbuf.clone(), vbuf.clone()
    scatter_sync_free(torch.randn(4, 1, 3), torch.randn(4, 1, 2), key_cache, value_cache,
                           torch.tensor([8, 10**6, -3, 2**40]))
    assert torch.equal(kbuf[:32], before[0][:32]) and torch.equal(kbuf[-32:], before[0][-32:])
    assert torch.equal(vbuf[:32], before[1][:32]) and torch.equal(vbuf[-32:], before[1][-32:])
    okbuf, key = _guarded((5, 1, 3), 9.0)
    ovbuf, value = _guarded((5, 1, 2), 9.0)
    tables = torch.tensor([[1, 77], [-9, 2]], dtype=torch.int32)
    gather_sync_free(key_cache, value_cache, tables, torch.tensor([4, 1]), key, value, torch.tensor([0, 2**30]),
                          False)
    assert (okbuf[:32] == 9).all() and (okbuf[-32:] == 9).all()
    assert (ovbuf[:32] == 9).all() and (ovbuf[-32:] == 9).all()
    assert torch.equal(key[:2], key_cache[1].view(2, 1, 3))  # valid block 1
    assert torch.equal(value[:2], value_cache[1].view(2, 1, 2))
    assert not key[2:].any() and not value[2:].any(), "rows of invalid blocks / columns are written as zeros"


def test_mla_prefill_device_path_attends_only_cached_positions_whatever_the_values():
    """The sync-free path of mla_prefill_attention on values the CPU checks refuse: block ids outside the
    pool (77, -9), a length past the table's capacity, more query tokens than cached ones. It reads nothing
    outside the caches (NaN sentinels around them would reach the output) and attends exactly the
    positions the oracle can address: up to the token's own, within the length and the table, in a block
    of the pool; a token left with none gets zeros."""
    from mla_ops.ops.mla_prefill_attention import mla_prefill_attention_sync_free
    from mla_ops.testing.oracles import mla_prefill_attention_oracle

    _, key_cache = _guarded((4, 2, 1, 3), float("nan"))
    _, value_cache = _guarded((4, 2, 1, 2), float("nan"))
    key_cache.normal_(), value_cache.normal_()
    tables = torch.tensor([[1, 77, -9], [2, 0, 3], [3, 1, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([5, 1000, 1], dtype=torch.int32)
    starts = torch.tensor([0, 2, 5, 7], dtype=torch.int32)  # 2, 3 and 2 query tokens
    args = (torch.randn(7, 2, 3), torch.randn(7, 2, 2), key_cache, value_cache, tables, seq_lens, starts, 0.5)
    got = mla_prefill_attention_sync_free(*args)
    want = mla_prefill_attention_oracle(*args)[0]
    assert bool(got.isfinite().all())
    assert not got[5].any()  # position -1: nothing to attend
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 1000 needs 1000 cached tokens"):
        torch.ops.mla.mla_prefill_attention(*args)
