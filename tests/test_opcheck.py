"""torch.library.opcheck with all four default utils (schema, autograd registration, fake tensor,
aot dispatch dynamic) for every op, on small dims, DeepSeek-V2-Lite's real dims and a prefill
(S > 1) set, in fp32, bf16 and fp16."""
import pytest
import torch

from utils import DIM_SETS, DTYPES, opcheck, paged_case, prolog_inputs, prolog_kwargs, rope_tables

ids = [d.name for d in DIM_SETS]
dtype_ids = [str(dt).removeprefix("torch.") for dt in DTYPES]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("dims", DIM_SETS, ids=ids)
@pytest.mark.parametrize("requires_grad", [False, True], ids=["nograd", "grad"])
def test_rms_norm(dims, dtype, requires_grad):
    x = torch.randn(dims.B, dims.S, dims.L, dtype=dtype, requires_grad=requires_grad)
    w = torch.rand(dims.L, dtype=dtype, requires_grad=requires_grad)
    opcheck(torch.ops.mla.rms_norm.default, (x, w, 1e-6))


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("dims", DIM_SETS, ids=ids)
def test_rope(dims, dtype, layout):
    x = torch.randn(dims.B, dims.N, dims.S, dims.R, dtype=dtype, requires_grad=True)
    cos, sin = rope_tables(dims.B, dims.S, dims.R)
    opcheck(torch.ops.mla.rope.default, (x, cos, sin), {"layout": layout})
    # [S, R/2] tables broadcast over batch and heads
    cos2, sin2 = rope_tables(dims.B, dims.S, dims.R, batched=False)
    opcheck(torch.ops.mla.rope.default, (x.detach(), cos2, sin2), {"layout": layout})


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("dims", DIM_SETS, ids=ids)
def test_kv_prolog(dims, dtype):
    args = prolog_inputs(dims, dtype, bias=dims.name == "prefill", requires_grad=True)
    opcheck(torch.ops.mla.kv_prolog.default, args, prolog_kwargs(dims))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("dims", DIM_SETS, ids=ids)
def test_latent_kv_prolog(dims, dtype):
    hidden, kv_a, kv_a_b, norm_w, _, cos, sin = prolog_inputs(dims, dtype, bias=True, requires_grad=True)
    opcheck(torch.ops.mla.latent_kv_prolog.default, (hidden, kv_a, kv_a_b, norm_w, cos, sin),
            {"rope_layout": "half" if dims.name == "small" else "interleaved"})


def _paged(dims, dtype):
    """(caches, tables, cumsum, offsets) in the MLA layout: key = latent [L], value = k_pe [R]."""
    block_size = 4 if dims.name != "v2lite" else 128
    lens = [dims.S + 2, 1, 2 * block_size + 1][: max(2, dims.B)]
    return paged_case(12, block_size, lens, key_shape=(1, dims.L), value_shape=(1, dims.R), dtype=dtype,
                      offsets=[block_size] + [0] * (len(lens) - 1), columns=5)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("dims", DIM_SETS, ids=ids)
def test_gather_pa_kv_cache(dims, dtype):
    key_cache, value_cache, tables, cumsum, offsets = _paged(dims, dtype)
    total = int(cumsum[-1]) + 2  # two rows no sequence covers
    key = torch.randn(total, 1, dims.L).to(dtype)
    value = torch.randn(total, 1, dims.R).to(dtype)
    kwargs = {"seq_offset": offsets, "is_seq_lens_cumsum": True}
    opcheck(torch.ops.mla.gather_pa_kv_cache.default, (key_cache, value_cache, tables, cumsum, key, value), kwargs)
    opcheck(torch.ops.mla.gather_pa_kv_cache_functional.default,
            (key_cache, value_cache, tables, cumsum, key, value), kwargs)
    lens = (cumsum[1:] - cumsum[:-1]).to(torch.int64)
    opcheck(torch.ops.mla.gather_pa_kv_cache.default, (key_cache, value_cache, tables.long(), lens, key, value))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("dims", DIM_SETS, ids=ids)
def test_scatter_pa_kv_cache(dims, dtype):
    key_cache, value_cache, *_ = _paged(dims, dtype)
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    tokens = dims.S + 2
    slots = torch.randperm(num_slots)[:tokens]
    slots[1] = -1  # padding
    key = torch.randn(tokens, 1, dims.L).to(dtype)
    value = torch.randn(tokens, 1, dims.R).to(dtype)
    opcheck(torch.ops.mla.scatter_pa_kv_cache.default, (key, value, key_cache, value_cache, slots.int()))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("dims", DIM_SETS, ids=ids)
def test_mla_decode_attention(dims, dtype):
    key_cache, value_cache, tables, cumsum, _ = _paged(dims, dtype)
    batch = tables.shape[0]
    lens = (cumsum[1:] - cumsum[:-1]).clamp(min=1)
    q_latent = torch.randn(batch, dims.N, dims.L).to(dtype)
    q_pe = torch.randn(batch, dims.N, dims.R).to(dtype)
    opcheck(torch.ops.mla.mla_decode_attention.default,
            (q_latent, q_pe, key_cache, value_cache, tables, lens, dims.L ** -0.5))


@pytest.mark.parametrize("batch,seq", [(0, 3), (2, 0)], ids=["no-batch", "no-tokens"])
def test_empty_batches_and_sequences(batch, seq):
    """Zero rows or zero tokens run eagerly as the fake kernels promise (no ambiguous reshapes)."""
    import dataclasses

    from utils import SMALL

    d = dataclasses.replace(SMALL, B=batch, S=seq)
    args = prolog_inputs(d, torch.float32, bias=True, requires_grad=True)
    opcheck(torch.ops.mla.kv_prolog.default, args, prolog_kwargs(d))
    hidden, kv_a, kv_a_b, norm_w, _, cos, sin = args
    opcheck(torch.ops.mla.latent_kv_prolog.default, (hidden, kv_a, kv_a_b, norm_w, cos, sin))
    x = torch.randn(batch, d.N, seq, d.R, requires_grad=True)
    opcheck(torch.ops.mla.rope.default, (x, cos, sin), {"layout": "half"})
    opcheck(torch.ops.mla.rms_norm.default, (hidden, torch.rand(d.H), 1e-6))
