"""The two prefill attention ops beyond the case database's generic suites (tests/test_cases.py runs their
samples, error inputs, opcheck, compile and every kernel variant against the oracles):

* `mla.mla_prefill_attention` is `mla.mla_decode_attention` for one query token per request and
  `mla.sparse_mla_attention` with every token listing the positions up to its own;
* the absorbed form (`mla_prefill_attention`) and the expanded form (`mha_prefill_attention`) give the
  same attention once the latent is expanded with W_UK / W_UV;
* what a token does not see has no effect on its output, NaN and inf included, on every path of the
  reference kernels (the native kernel's own checks are in tests/test_native_cpu.py);
* the reference kernels hold no [heads, query tokens, keys] tensor.
"""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mla_ops
from mla_ops.ops.mha_prefill_attention import mha_prefill_attention_reference, mha_prefill_attention_sdpa
from mla_ops.ops.mla_prefill_attention import mla_prefill_attention_reference, mla_prefill_attention_sync_free
from mla_ops.testing.cases import CASES
from mla_ops.testing.oracles import mha_prefill_attention_oracle, mla_prefill_attention_oracle
from mla_ops.testing.suites import normalised_error

DTYPES = (torch.float32, torch.bfloat16, torch.float64)
dtype_ids = [str(d).removeprefix("torch.") for d in DTYPES]


def _bound(op: str, dtype: torch.dtype) -> float:
    return CASES[op].bound("reference", dtype)


def _starts(counts) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)


def _mla_case(dtype, seq_lens, q_lens, *, heads=4, L=32, R=8, block_size=4, seed=0):
    """(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, query_start_loc): split views of one
    [NB, bs, 1, L + R] pool, distinct random blocks per request, -1 past them."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 2
    pool = torch.randn(num_blocks, block_size, 1, L + R, generator=g).to(dtype)
    tables = torch.full((len(seq_lens), max(need + [1]) + 1), -1, dtype=torch.int32)
    perm, used = torch.randperm(num_blocks, generator=g), 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used:used + n]
        used += n
    tokens = sum(q_lens)
    q_latent = torch.randn(tokens, heads, L, generator=g).to(dtype)
    q_pe = torch.randn(tokens, heads, R, generator=g).to(dtype)
    return (q_latent, q_pe, pool[..., :L], pool[..., L:], tables, torch.tensor(seq_lens, dtype=torch.int32),
            _starts(q_lens))


# ------------------------------------------------------------------------------ the ops it generalises
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_mla_prefill_of_one_token_per_request_is_decode(dtype):
    q_latent, q_pe, kc, vc, tables, lens, starts = _mla_case(dtype, [5, 17, 1, 9], [1, 1, 1, 1])
    with mla_ops.use_backend("reference"):
        got = torch.ops.mla.mla_prefill_attention(q_latent, q_pe, kc, vc, tables, lens, starts, 0.3)
        want = torch.ops.mla.mla_decode_attention(q_latent, q_pe, kc, vc, tables, lens, 0.3)
    assert normalised_error(got, want.double()) <= 2 * _bound("mla_prefill_attention", dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_mla_prefill_is_sparse_attention_listing_every_earlier_position(dtype):
    seq_lens, q_lens = [7, 12, 10, 3], [7, 1, 3, 0]
    q_latent, q_pe, kc, vc, tables, lens, starts = _mla_case(dtype, seq_lens, q_lens, seed=1)
    width = max(seq_lens)
    listed = torch.full((sum(q_lens), width), -1, dtype=torch.int32)
    t = 0
    for n, q_len in zip(seq_lens, q_lens):
        for i in range(q_len):
            listed[t, : n - q_len + i + 1] = torch.arange(n - q_len + i + 1)
            t += 1
    with mla_ops.use_backend("reference"):
        got = torch.ops.mla.mla_prefill_attention(q_latent, q_pe, kc, vc, tables, lens, starts, 0.3)
        want = torch.ops.mla.sparse_mla_attention(q_latent, q_pe, kc, vc, tables, lens, starts, listed, 0.3)
    assert normalised_error(got, want.double()) <= 2 * _bound("mla_prefill_attention", dtype)


# float64 runs on the reference kernels whatever the backend; float32 on CPU on the native kernel (auto)
@pytest.mark.parametrize("dtype,backend", [(torch.float64, "reference"), (torch.float32, "reference"),
                                           (torch.float32, "auto")], ids=["float64", "float32", "float32-auto"])
def test_absorbed_and_expanded_forms_agree(dtype, backend):
    """q_latent = q_nope W_UK, keys [W_UK latent | k_pe], values W_UV latent: the expanded attention equals the
    absorbed one times W_UV, request by request (context, chunk, decode step, prefill from 0)."""
    heads, nope, L, R, V, block_size = 4, 8, 16, 8, 6, 4
    seq_lens, q_lens = [11, 6, 9], [4, 6, 1]
    g = torch.Generator().manual_seed(3)
    _, q_pe, kc, vc, tables, lens, starts = _mla_case(dtype, seq_lens, q_lens, heads=heads, L=L, R=R,
                                                      block_size=block_size, seed=3)
    w_uk = (torch.randn(heads, nope, L, generator=g) * L**-0.5).to(dtype)
    w_uv = (torch.randn(heads, V, L, generator=g) * L**-0.5).to(dtype)
    q_nope = torch.randn(sum(q_lens), heads, nope, generator=g).to(dtype)
    q_latent = torch.einsum("tnp,npl->tnl", q_nope, w_uk)
    keys, values = [], []
    for b, n in enumerate(seq_lens):
        positions = torch.arange(n)
        blocks, offsets = tables[b, positions // block_size].long(), positions % block_size
        latent, k_pe = kc[blocks, offsets, 0], vc[blocks, offsets, 0]  # [n, L], [n, R]
        k_nope = torch.einsum("npl,sl->snp", w_uk, latent)
        keys.append(torch.cat((k_nope, k_pe[:, None, :].expand(-1, heads, -1)), dim=-1))
        values.append(torch.einsum("nvl,sl->snv", w_uv, latent))
    scale = (nope + R) ** -0.5
    with mla_ops.use_backend(backend):
        absorbed = torch.ops.mla.mla_prefill_attention(q_latent, q_pe, kc, vc, tables, lens, starts, scale)
        expanded = torch.ops.mla.mha_prefill_attention(torch.cat((q_nope, q_pe), dim=-1), torch.cat(keys),
                                                       torch.cat(values), starts, _starts(seq_lens), scale)
    want = torch.einsum("tnl,nvl->tnv", absorbed.double(), w_uv.double())
    assert normalised_error(expanded, want) <= (1e-12 if dtype == torch.float64 else 1e-5)


# ----------------------------------------------------------------------- what a token does not see
def _assert_is_the_formula(got: torch.Tensor, want: torch.Tensor, bound: float) -> None:
    """NaN and inf exactly where the fp64 formula has them, the finite values within `bound`."""
    got = got.double()
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got[got.isinf()], want[want.isinf()])
    finite = want.isfinite()
    assert normalised_error(got[finite], want[finite]) <= bound


MLA_PATHS = {"reference": None, "sync-free": mla_prefill_attention_sync_free}


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("path", MLA_PATHS)
def test_mla_prefill_unattended_rows_never_reach_a_token(path, poison):
    """A poisoned latent and k_pe at one new token's position: the tokens before it get what the clean
    cache gives them, the tokens that attend it what the formula gives (NaN for NaN). Poison in slots past a
    request's length and in blocks no request uses changes nothing."""
    seq_lens, q_lens = [10, 7], [6, 7]
    args = _mla_case(torch.float32, seq_lens, q_lens, block_size=4, seed=5)
    q_latent, q_pe, kc, vc, tables, lens, starts = args
    clean = mla_prefill_attention_oracle(*args, 0.3)[0]
    poisoned_position = 7  # request 0's new token 3 (its first query token sits at position 4)
    block, offset = int(tables[0, poisoned_position // 4]), poisoned_position % 4
    kc[block, offset], vc[block, offset] = poison, poison
    used = {int(i) for i in tables.flatten() if i >= 0}
    for unused in set(range(kc.shape[0])) - used:
        kc[unused], vc[unused] = poison, poison
    last = int(tables[1, 1])  # request 1's 7 tokens fill 3 of its second block's 4 slots
    kc[last, 3], vc[last, 3] = poison, poison
    kernel = MLA_PATHS[path]
    with torch.no_grad(), mla_ops.use_backend("reference"):
        got = (torch.ops.mla.mla_prefill_attention(*args, 0.3) if kernel is None else kernel(*args, 0.3))
    bound = _bound("mla_prefill_attention", torch.float32)
    _assert_is_the_formula(got, mla_prefill_attention_oracle(*args, 0.3)[0], bound)
    before = slice(0, 3)  # request 0's tokens at positions 4, 5, 6
    assert normalised_error(got[before], clean[before]) <= bound
    assert normalised_error(got[6:], clean[6:]) <= bound
    if poison != poison:  # NaN: every head of the tokens that see it
        assert bool(got[3:6].isnan().all())


# the op as dispatched (the native kernel where the extension loads), and the reference's two paths
MHA_PATHS = {"op": None, "reference": mha_prefill_attention_reference, "sdpa": mha_prefill_attention_sdpa}


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["key", "value"])
@pytest.mark.parametrize("path", MHA_PATHS)
def test_mha_prefill_unattended_keys_never_reach_a_token(path, where, poison):
    """A poisoned key or value of one head at one new token: the tokens before it, and the other heads,
    get what the clean inputs give them; that head of the tokens that see it gets what the softmax of
    the formula gives (NaN or inf, or for an infinite key a score of -inf: a weight of 0)."""
    g = torch.Generator().manual_seed(7)
    q_lens, k_lens = [6, 3], [9, 3]
    q = torch.randn(9, 2, 8, generator=g)
    k, v = torch.randn(12, 2, 8, generator=g), torch.randn(12, 2, 4, generator=g)
    qsl, ksl = _starts(q_lens), _starts(k_lens)
    clean = mha_prefill_attention_oracle(q, k, v, qsl, ksl, 0.3)[0]
    (k if where == "key" else v)[6, 1, 0] = poison  # request 0's new token 3 (its keys 0-2 are context), head 1
    kernel = MHA_PATHS[path]
    with torch.no_grad():
        got = (torch.ops.mla.mha_prefill_attention(q, k, v, qsl, ksl, 0.3) if kernel is None
               else kernel(q, k, v, qsl, ksl, 0.3))
    bound = _bound("mha_prefill_attention", torch.float32)
    _assert_is_the_formula(got, mha_prefill_attention_oracle(q, k, v, qsl, ksl, 0.3)[0], bound)
    assert normalised_error(got[:3], clean[:3]) <= bound
    assert normalised_error(got[3:6, 0], clean[3:6, 0]) <= bound
    assert normalised_error(got[6:], clean[6:]) <= bound
    if poison != poison or where == "value":  # a NaN score, or a value the softmax weighs
        assert not bool(got[3:6, 1, 0].isfinite().any())


# ------------------------------------------------------------------------------------------- memory
class _LargestOutput(TorchDispatchMode):
    """The largest tensor any aten op returns inside the block, and the ops called."""

    def __init__(self):
        super().__init__()
        self.largest, self.ops = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(str(func.overloadpacket))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_the_reference_kernels_hold_no_heads_by_queries_by_keys_tensor():
    """A 1100-token prefill with 16 heads: [heads, queries, keys] would be 19.4M values; both references stay
    well below it (the mla reference's online softmax tiles, ATen's flash kernel for the expanded form)."""
    heads, tokens = 16, 1100
    full = heads * tokens * tokens
    q_latent, q_pe, kc, vc, tables, lens, starts = _mla_case(torch.float32, [tokens], [tokens], heads=heads, L=16,
                                                             R=8, block_size=64, seed=9)
    # the reference kernels themselves: the mode sees the aten ops they call
    with torch.no_grad(), _LargestOutput() as absorbed:
        mla_prefill_attention_reference(q_latent, q_pe, kc, vc, tables, lens, starts, 0.1)
    q, k, v = torch.randn(tokens, heads, 24), torch.randn(tokens, heads, 24), torch.randn(tokens, heads, 16)
    with torch.no_grad(), _LargestOutput() as expanded:
        mha_prefill_attention_reference(q, k, v, _starts([tokens]), _starts([tokens]), 0.2)
    assert absorbed.largest < full // 2 and expanded.largest < full // 2, (absorbed.largest, expanded.largest, full)
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in expanded.ops


def test_mha_prefill_of_long_requests_matches_the_oracle():
    """Requests longer than the CPU kernels' key and query blocks (ATen's flash kernel's and the native
    kernel's), with and without context, heads of DeepSeek-V2's head dims (192 / 128), bf16, the op as
    dispatched: within the case database's bound."""
    g = torch.Generator().manual_seed(11)
    q_lens, k_lens = [300, 257], [700, 257]
    q = torch.randn(sum(q_lens), 2, 192, generator=g).bfloat16()
    k, v = torch.randn(sum(k_lens), 2, 192, generator=g).bfloat16(), torch.randn(sum(k_lens), 2, 128, generator=g)
    args = (q, k, v.bfloat16(), _starts(q_lens), _starts(k_lens), 192**-0.5)
    got = torch.ops.mla.mha_prefill_attention(*args)
    assert got.shape == (557, 2, 128) and got.dtype == torch.bfloat16
    assert normalised_error(got, mha_prefill_attention_oracle(*args)[0]) <= _bound("mha_prefill_attention",
                                                                                  torch.bfloat16)
    assert math.isfinite(float(got.float().abs().max()))
