"""PyPTO kernels of mla_ops (stage 2 of kv_prolog, paged gather, paged scatter) run functionally on
the CPU through pypto 0.2.0's SIM mode with pass verification (mla_ops.pypto_runtime).

Each kernel call compiles, interprets the tensor graph and six compiler passes on the CPU, compares
them (and the outputs against the goldens given to pypto's verifier), and runs the Ascend 910B2 cost
model: about 1 s per call, 25 s for the [64,128,64,128] caches. Tests that run kernels are marked
``pypto``; they are skipped only when pypto 0.2.0 is not installed (the reason says so).

Goldens come from the reference kernels (``torch.ops.mla.*`` on CPU, and the kv_prolog module's
stage-2 pieces via ``npu_sim.stage2_reference``), and for the paged ops also from a plain Python
loop over the gather semantics (``mla_ops.testing.oracles.gather_pa_kv_cache_oracle``).
"""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mla_ops
from mla_ops import pypto_runtime as sim
from mla_ops.bench import npu_sim as bench
from mla_ops.ops.kv_prolog import latent_stage
from mla_ops.testing.oracles import gather_pa_kv_cache_oracle

REASONS = sim.unavailable_reasons()
needs_pypto = pytest.mark.skipif(bool(REASONS), reason="; ".join(REASONS) or "pypto 0.2.0 available")

V2_LITE = dict(num_heads=16, qk_nope_head_dim=128, v_head_dim=128)
SMALL = dict(num_heads=4, qk_nope_head_dim=32, v_head_dim=32)


@pytest.fixture(scope="session")
def pypto_sim():
    """Apply the CPU-verify fix and load the cached calculator once (the first build is 20-45 s)."""
    from mla_ops.pypto_runtime.calculator import load_calculator

    sim.ensure_supported()
    load_calculator()
    return sim


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def check_stage2(outputs, goldens, result, inputs, dims=V2_LITE):
    # k_nope/value: the same products as the reference, fp32 accumulation in another order, one
    # rounding -> 1 ulp of the output dtype except where a sum cancels to near zero
    # (bench.assert_rounding_close bounds that exactly); most elements are bit-identical.
    # RoPE: bit-identical.
    bench.assert_stage2_close(outputs, goldens, inputs, **dims)
    assert (outputs[0] == goldens[0]).double().mean() > 0.99
    assert result.failed == []
    assert result.errors == [], "every verified pass should be checkable for this kernel"
    assert result.tensor_graph[5:8] == ["PASS", "PASS", "PASS"]      # k_nope, value, k_pe_rot
    assert result.passed > 0 and result.aicore_us > 0


def run_stage2(tokens, *, rope_layout, dtype=torch.bfloat16, dims=V2_LITE, seed=0, config=None):
    from mla_ops.kernels.pypto import kv_prolog_stage2 as s2
    lora = 512 if dims is V2_LITE else 32
    rope = 64 if dims is V2_LITE else 16
    inputs = bench.make_stage2_inputs(tokens, dtype=dtype, kv_lora_rank=lora, rope_dim=rope, seed=seed,
                                      **dims)
    goldens = bench.stage2_reference(**inputs, rope_layout=rope_layout, **dims)
    outputs, result = s2.run_with_result(**inputs, **dims, rope_layout=rope_layout, goldens=goldens,
                                         config=config or s2.DEFAULT_STAGE2_CONFIG)
    return outputs, goldens, result, inputs


# ----------------------------------------------------------------------------------------------
# stage 2 of kv_prolog
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rope_layout", ["interleaved", "half"])
@pytest.mark.parametrize("tokens", [1, 2, 8, 13, 24])
@pytest.mark.pypto
@needs_pypto
def test_stage2_matches_reference_bf16(pypto_sim, tokens, rope_layout):
    outputs, goldens, result, inputs = run_stage2(tokens, rope_layout=rope_layout)
    check_stage2(outputs, goldens, result, inputs)
    assert [o.shape for o in outputs] == [(tokens, 16, 128), (tokens, 16, 128), (tokens, 64)]
    assert all(o.is_contiguous() and o.dtype == torch.bfloat16 for o in outputs)


@pytest.mark.parametrize("tokens,rope_layout", [(1, "interleaved"), (13, "half")])
@pytest.mark.pypto
@needs_pypto
def test_stage2_matches_reference_fp16(pypto_sim, tokens, rope_layout):
    outputs, goldens, result, inputs = run_stage2(tokens, rope_layout=rope_layout, dtype=torch.float16)
    check_stage2(outputs, goldens, result, inputs)


@pytest.mark.parametrize("rope_layout", ["interleaved", "half"])
@pytest.mark.pypto
@needs_pypto
def test_stage2_small_dims(pypto_sim, rope_layout):
    """No dimension is hard-coded: N=4, L=32, R=16, P=V=32, a tail tile (T=21 = 16 + 5)."""
    outputs, goldens, result, inputs = run_stage2(21, rope_layout=rope_layout, dims=SMALL)
    check_stage2(outputs, goldens, result, inputs, dims=SMALL)


@pytest.mark.parametrize("rope_layout", ["interleaved", "half"])
@pytest.mark.pypto
@needs_pypto
def test_stage2_permutation_matmul_fallback(pypto_sim, rope_layout):
    """rope_impl="permute" (exact 0/1 permutation matmuls instead of strided pair views)."""
    from mla_ops.kernels.pypto.kv_prolog_stage2 import Stage2Config
    outputs, goldens, result, inputs = run_stage2(21, rope_layout=rope_layout, dims=SMALL,
                                                  config=Stage2Config("permute", rope_impl="permute"))
    check_stage2(outputs, goldens, result, inputs, dims=SMALL)


@pytest.mark.pypto
@needs_pypto
def test_stage2_layouts_differ_only_in_rope_order(pypto_sim):
    """Guards the layout plumbing: the two layouts hold the same values in different positions."""
    (_, _, inter), _, _, _ = run_stage2(8, rope_layout="interleaved")
    (_, _, half), _, _, _ = run_stage2(8, rope_layout="half")
    assert torch.equal(inter[:, 0::2], half[:, :32]) and torch.equal(inter[:, 1::2], half[:, 32:])
    assert not torch.equal(inter, half)


@pytest.mark.pypto
@needs_pypto
def test_stage2_batched_prefill_matches_kv_prolog(pypto_sim):
    """End to end against torch.ops.mla.kv_prolog with B=2, S=3: stage 1 by the reference, stage 2 by
    the kernel on the flattened B*S tokens, then [B*S, N, D] -> [B, N, S, D] by view + transpose."""
    from mla_ops.kernels.pypto import kv_prolog_stage2 as s2
    g = torch.Generator().manual_seed(3)
    B, S, H, L, R = 2, 3, 64, 512, 64
    hidden = torch.randn(B, S, H, generator=g).bfloat16()
    kv_a = (torch.randn(L + R, H, generator=g) / H ** 0.5).bfloat16()
    norm_w = (1 + 0.1 * torch.randn(L, generator=g)).bfloat16()
    kv_b = (torch.randn(16 * 256, L, generator=g) / L ** 0.5).bfloat16()
    angles = torch.rand(S, R // 2, generator=g) * 6.28
    cos, sin = angles.cos(), angles.sin()
    with mla_ops.use_backend("reference"):
        ref = torch.ops.mla.kv_prolog(hidden, kv_a, None, norm_w, kv_b, cos, sin, **V2_LITE)
        _, latent, k_pe = latent_stage(hidden, kv_a, None, norm_w, 1e-6)
    T = B * S
    k_nope, value, k_pe_rot = s2.kv_prolog_stage2(latent.reshape(T, L), k_pe.reshape(T, R), kv_b,
                                                  cos.repeat(B, 1), sin.repeat(B, 1), **V2_LITE)
    sums = (latent.reshape(T, L).double().abs() @ kv_b.double().abs().T).view(B, S, 16, 256).transpose(1, 2)
    bench.assert_rounding_close(k_nope.view(B, S, 16, 128).transpose(1, 2), ref[0], sums[..., :128], L)
    bench.assert_rounding_close(value.view(B, S, 16, 128).transpose(1, 2), ref[1], sums[..., 128:], L)
    assert torch.equal(k_pe_rot.view(B, 1, S, R), ref[2])


@pytest.mark.pypto
@needs_pypto
def test_stage2_simulated_time_is_deterministic(pypto_sim):
    _, _, first, _ = run_stage2(8, rope_layout="interleaved", seed=1)
    _, _, second, _ = run_stage2(8, rope_layout="interleaved", seed=2)
    assert (first.aicore_us, first.total_cycles) == (second.aicore_us, second.total_cycles)
    assert sim.last_result() is second


@needs_pypto
def test_stage2_zero_tokens_runs_nothing():
    from mla_ops.kernels.pypto import kv_prolog_stage2 as s2
    inputs = bench.make_stage2_inputs(0)
    outputs, result = s2.run_with_result(**inputs, **V2_LITE)
    assert result is None and [tuple(o.shape) for o in outputs] == [(0, 16, 128), (0, 16, 128), (0, 64)]


def test_stage2_rejects_unsupported_inputs():
    """Clear ValueErrors naming the argument, before pypto is involved."""
    from mla_ops.kernels.pypto import kv_prolog_stage2 as s2
    good = bench.make_stage2_inputs(2, **SMALL, kv_lora_rank=32, rope_dim=16)
    cases = {
        "normed_ckv dtype must be float16 or bfloat16": dict(good, normed_ckv=good["normed_ckv"].float()),
        "rope dim must be even": dict(good, k_pe=good["k_pe"][:, :15], cos=good["cos"][:, :7],
                                      sin=good["sin"][:, :7]),
        "kv_b_weight must be [num_heads*(qk_nope_head_dim+v_head_dim)":
            dict(good, kv_b_weight=good["kv_b_weight"][:64]),
        "cos must be float32": dict(good, cos=good["cos"].bfloat16()),
        "kv_b_weight must be contiguous": dict(good, kv_b_weight=good["kv_b_weight"].t().contiguous().t()),
    }
    for needle, inputs in cases.items():
        reasons = s2.kv_prolog_stage2_not_supported_reasons(**inputs, **SMALL)
        assert any(needle in r for r in reasons), (needle, reasons)
        with pytest.raises(ValueError, match="kv_prolog_stage2: "):
            s2.kv_prolog_stage2(**inputs, **SMALL)
    with pytest.raises(ValueError, match="rope_layout 'neox': the kernel rotates adjacent pairs"):
        s2.kv_prolog_stage2(**good, **SMALL, rope_layout="neox")
    with pytest.raises(ValueError, match="mode must be one of"):
        s2.kv_prolog_stage2(**good, **SMALL, mode="gpu")
    assert any("mode='npu' needs torch_npu tensors" in r
               for r in s2.kv_prolog_stage2_not_supported_reasons(**good, **SMALL, mode="npu"))


# ----------------------------------------------------------------------------------------------
# paged gather
# ----------------------------------------------------------------------------------------------
def reference_gather(inputs):
    """(key, value) after torch.ops.mla.gather_pa_kv_cache (reference backend) on copies."""
    key, value = inputs["key"].clone(), inputs["value"].clone()
    with mla_ops.use_backend("reference"):
        torch.ops.mla.gather_pa_kv_cache(inputs["key_cache"], inputs["value_cache"], inputs["block_tables"],
                                         inputs["seq_lens"], key, value, seq_offset=inputs["seq_offset"],
                                         is_seq_lens_cumsum=inputs["is_seq_lens_cumsum"])
    return key, value


def run_gather(inputs, **kwargs):
    from mla_ops.kernels.pypto import gather_pa_kv_cache as gpa
    loop_golden = gather_pa_kv_cache_oracle(**inputs)
    ref_golden = reference_gather(inputs)
    assert torch.equal(loop_golden[0], ref_golden[0]) and torch.equal(loop_golden[1], ref_golden[1])
    sentinel = inputs["key"][-1].clone(), inputs["value"][-1].clone()
    result = gpa.run_with_result(**inputs, goldens=ref_golden, **kwargs)
    key, value = inputs["key"], inputs["value"]
    assert torch.equal(key, ref_golden[0]) and torch.equal(value, ref_golden[1])      # bit-exact
    covered = int(inputs["seq_lens"][-1]) if inputs["is_seq_lens_cumsum"] else int(inputs["seq_lens"].sum())
    assert covered < key.shape[0], "the cases keep spare rows to check they are left untouched"
    assert (key[covered:] == sentinel[0]).all() and (value[covered:] == sentinel[1]).all()
    assert result.failed == [] and result.errors == []
    assert result.tensor_graph[-2:] == ["PASS", "PASS"]
    return result


@pytest.mark.parametrize("case", bench.gather_cases()[:10], ids=lambda c: c.name)
@pytest.mark.pypto
@needs_pypto
def test_gather_sample_sweep_levels(pypto_sim, case):
    """The original sample's ten network levels: key_cache [*,128,1,512], value_cache [*,128,1,64], bf16,
    block_tables [Q,8] int32, cumsum seq_lens, seq_offset with nonzero block multiples
    (num_blocks=64 instead of 5513: see mla_ops.bench.npu_sim)."""
    assert case.offsets is not None and any(case.offsets)
    result = run_gather(bench.make_gather_inputs(case))
    assert result.kernel == "gather_pa_kv_cache[default]"


@pytest.mark.parametrize("name,tile", [("heads1_k128_v64", "default"), ("heads64_k128_v128", "large_token")])
@pytest.mark.pypto
@needs_pypto
def test_gather_targeted_shapes(pypto_sim, name, tile):
    case = next(c for c in bench.gather_cases() if c.name == name)
    result = run_gather(bench.make_gather_inputs(case))
    assert result.kernel == f"gather_pa_kv_cache[{tile}]"


TAIL_CASE = bench.GatherCase("tails", lengths=(37, 16, 0, 1, 20), offsets=(16, 0, 32, 48, 32), num_blocks=12,
                             block_size=16, key_hd=(2, 32), value_hd=(1, 16), table_cols=6)


@pytest.mark.parametrize("cumsum", [True, False], ids=["cumsum", "lengths"])
@pytest.mark.pypto
@needs_pypto
def test_gather_tail_blocks_offsets_and_seq_lens_modes(pypto_sim, cumsum):
    """Sequences spanning several blocks with partial tails, an empty sequence, table offsets, and
    both seq_lens conventions (lengths: the running base is a device cumsum on the host side)."""
    run_gather(bench.make_gather_inputs(TAIL_CASE, cumsum=cumsum, seed=5))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.pypto
@needs_pypto
def test_gather_other_dtypes_and_int64_indices(pypto_sim, dtype):
    inputs = bench.make_gather_inputs(TAIL_CASE, dtype=dtype, seed=6)
    for name in ("block_tables", "seq_lens", "seq_offset"):
        inputs[name] = inputs[name].long()
    run_gather(inputs)


@pytest.mark.pypto
@needs_pypto
def test_gather_without_seq_offset(pypto_sim):
    case = bench.GatherCase("no_offset", lengths=(5, 17), offsets=None, num_blocks=8, block_size=16,
                            key_hd=(1, 64), value_hd=(1, 32), table_cols=2)
    run_gather(bench.make_gather_inputs(case, seed=7))


@pytest.mark.pypto
@needs_pypto
def test_gather_clamps_bad_values_instead_of_reading_out_of_bounds(pypto_sim):
    """Values the caller should have rejected: the kernel stays in bounds by clamping (documented,
    wrong-but-defined data): block id 999 -> the last block, a table offset past the last column ->
    the last column, a sequence running past the output -> cut at the output's end."""
    from mla_ops.kernels.pypto import gather_pa_kv_cache as gpa
    g = torch.Generator().manual_seed(11)
    key_cache = torch.randn(4, 16, 1, 32, generator=g).bfloat16()
    value_cache = torch.randn(4, 16, 1, 16, generator=g).bfloat16()
    block_tables = torch.tensor([[0, 1], [999, 2], [-3, 1]], dtype=torch.int32)
    seq_lens = torch.tensor([0, 5, 9, 30], dtype=torch.int32)
    seq_offset = torch.tensor([0, 0, 16 * 5], dtype=torch.int32)
    key, value = torch.zeros(20, 1, 32).bfloat16(), torch.zeros(20, 1, 16).bfloat16()
    result = gpa.run_with_result(key_cache, value_cache, block_tables, seq_lens, key, value,
                                 seq_offset=seq_offset, is_seq_lens_cumsum=True)
    assert result.failed == []
    for out, cache in ((key, key_cache), (value, value_cache)):
        assert torch.equal(out[0:5], cache[0, 0:5])
        assert torch.equal(out[5:9], cache[3, 0:4])        # 999 clamped to num_blocks-1
        assert torch.equal(out[9:20], cache[1, 0:11])      # column 5 clamped to 1, 21 rows cut to 11


def test_select_gather_tile_config():
    from mla_ops.kernels.pypto import gather_pa_kv_cache as gpa
    select = gpa.select_gather_tile_config
    assert select(1, 512, 1, 64).name == "default"
    assert select(1, 128, 1, 64) == gpa.GatherTileConfig("default", 16, 32)
    assert select(64, 128, 64, 128) == gpa.GatherTileConfig("large_token", 8, 8)
    assert select(1, 4096, 1, 64).name == "default"          # the threshold is strict: heads*dim > 4096
    assert select(1, 4097, 1, 64).name == "large_token"
    assert select(1, 64, 2, 4096).name == "large_token"      # the value side counts too
    # fp32 halves the rows (same bytes per tile), and no tile may exceed the 192 KiB unified buffer
    assert select(1, 512, 1, 64, element_size=4) == gpa.GatherTileConfig("default", 8, 16)
    assert select(64, 128, 64, 128, element_size=4) == gpa.GatherTileConfig("large_token", 4, 4)
    assert select(1, 65536, 1, 64) == gpa.GatherTileConfig("large_token", 1, 8)
    with pytest.raises(ValueError, match="key_dim must be a positive int"):
        select(1, 0, 1, 64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        gpa.DEFAULT_GATHER_TILE.key_tile_tokens = 4


def test_gather_kernel_checks_metadata_with_the_ops_own_check():
    """Shapes and dtypes are the op's contract: the kernel runs the op's check, same message."""
    from mla_ops.kernels.pypto import gather_pa_kv_cache as gpa
    inputs = bench.make_gather_inputs(TAIL_CASE)
    bad = dict(inputs, seq_lens=inputs["seq_lens"][:-1])
    with pytest.raises(RuntimeError, match=r"mla.gather_pa_kv_cache: seq_lens must have num_seqs \+ 1 entries"):
        gpa.gather_pa_kv_cache(**bad)
    bad = dict(inputs, block_tables=inputs["block_tables"].float())
    with pytest.raises(RuntimeError, match="mla.gather_pa_kv_cache: block_tables must be an int32 or int64"):
        gpa.gather_pa_kv_cache(**bad)


def test_gather_kernel_reasons_are_only_what_the_kernel_adds():
    from mla_ops.kernels.pypto import gather_pa_kv_cache as gpa
    inputs = bench.make_gather_inputs(TAIL_CASE)
    assert gpa.gather_pa_kv_cache_not_supported_reasons(**inputs) == list(REASONS)
    wide = inputs["key_cache"].new_zeros(*inputs["key_cache"].shape[:3], 2 * inputs["key_cache"].shape[3])
    strided = dict(inputs, key_cache=wide[..., ::2])
    assert any("key_cache must be contiguous" in r for r in gpa.gather_pa_kv_cache_not_supported_reasons(**strided))
    doubles = {k: (v.double() if k in ("key_cache", "value_cache", "key", "value") else v) for k, v in inputs.items()}
    assert any("dtype must be bfloat16, float16 or float32" in r
               for r in gpa.gather_pa_kv_cache_not_supported_reasons(**doubles))
    with pytest.raises(ValueError, match="key_cache must be contiguous"):
        gpa.gather_pa_kv_cache(**strided)


def test_scatter_kernel_checks_metadata_with_the_ops_own_check():
    from mla_ops.kernels.pypto import scatter_pa_kv_cache as spa
    inputs = scatter_inputs(5)
    cases = {
        r"mla.scatter_pa_kv_cache: value head dim \(dim 2\) must equal value_cache.shape\[3\]":
            dict(inputs, value=inputs["value"][..., :16].contiguous()),
        r"mla.scatter_pa_kv_cache: value_cache num_blocks":
            dict(inputs, key_cache=inputs["key_cache"][:-1].contiguous()),
        r"mla.scatter_pa_kv_cache: slot_mapping length must equal":
            dict(inputs, slot_mapping=inputs["slot_mapping"][:4]),
        r"mla.scatter_pa_kv_cache: slot_mapping must be an int32 or int64": dict(
            inputs, slot_mapping=inputs["slot_mapping"].float()),
    }
    for pattern, bad in cases.items():
        with pytest.raises(RuntimeError, match=pattern):
            spa.scatter_pa_kv_cache(**bad)


# ----------------------------------------------------------------------------------------------
# paged scatter
# ----------------------------------------------------------------------------------------------
def scatter_loop_golden(key, value, key_cache, value_cache, slot_mapping):
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if 0 <= slot < key_cache.shape[0] * block_size:
            key_cache[slot // block_size, slot % block_size] = key[t]
            value_cache[slot // block_size, slot % block_size] = value[t]
    return key_cache, value_cache


def scatter_inputs(tokens, *, num_blocks=6, block_size=16, key_hd=(1, 128), value_hd=(1, 32),
                   dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        key=torch.randn(tokens, *key_hd, generator=g).to(dtype),
        value=torch.randn(tokens, *value_hd, generator=g).to(dtype),
        key_cache=torch.randn(num_blocks, block_size, *key_hd, generator=g).to(dtype),
        value_cache=torch.randn(num_blocks, block_size, *value_hd, generator=g).to(dtype),
        slot_mapping=torch.randperm(num_blocks * block_size, generator=g)[:tokens].to(torch.int32),
    )


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.pypto
@needs_pypto
def test_scatter_matches_reference_and_skips_padding(pypto_sim, slot_dtype):
    from mla_ops.kernels.pypto import scatter_pa_kv_cache as spa
    inputs = scatter_inputs(9, seed=int(slot_dtype == torch.int64))
    inputs["slot_mapping"][[1, 4, 8]] = -1                           # padding tokens
    inputs["slot_mapping"] = inputs["slot_mapping"].to(slot_dtype)
    loop = scatter_loop_golden(**inputs)
    ref_kc, ref_vc = inputs["key_cache"].clone(), inputs["value_cache"].clone()
    with mla_ops.use_backend("reference"):
        torch.ops.mla.scatter_pa_kv_cache(inputs["key"], inputs["value"], ref_kc, ref_vc,
                                          inputs["slot_mapping"])
    assert torch.equal(loop[0], ref_kc) and torch.equal(loop[1], ref_vc)
    before = inputs["key_cache"].clone()
    result = spa.run_with_result(**inputs, goldens=(ref_kc, ref_vc))
    assert torch.equal(inputs["key_cache"], ref_kc) and torch.equal(inputs["value_cache"], ref_vc)
    written = (inputs["key_cache"] != before).flatten(2).any(-1).sum().item()
    assert 0 < written <= 6                                           # 6 real tokens, the rest untouched
    assert result.failed == [] and result.errors == [] and result.tensor_graph[-2:] == ["PASS", "PASS"]


@pytest.mark.pypto
@needs_pypto
def test_scatter_all_padding_and_out_of_range_slots_write_nothing(pypto_sim):
    """Negative slots are padding; slots >= num_blocks*block_size are caller errors the kernel
    skips rather than writing out of bounds."""
    from mla_ops.kernels.pypto import scatter_pa_kv_cache as spa
    inputs = scatter_inputs(4, num_blocks=2, block_size=16, key_hd=(2, 16), value_hd=(2, 16),
                            dtype=torch.float16)
    inputs["slot_mapping"] = torch.tensor([-1, 32, -7, 1000], dtype=torch.int32)
    before = inputs["key_cache"].clone(), inputs["value_cache"].clone()
    spa.scatter_pa_kv_cache(**inputs)
    assert torch.equal(inputs["key_cache"], before[0]) and torch.equal(inputs["value_cache"], before[1])
    assert sim.last_result().failed == []


# ----------------------------------------------------------------------------------------------
# the harness
# ----------------------------------------------------------------------------------------------
def test_version_guard_refuses_other_pypto(monkeypatch):
    from mla_ops.pypto_runtime import compat

    try:
        monkeypatch.setattr(compat, "installed_pypto_version", lambda: "0.3.0")
        compat.unavailable_reasons.cache_clear()
        with pytest.raises(RuntimeError, match=r"pypto 0\.3\.0 is installed.*exactly pypto 0\.2\.0"):
            sim.ensure_supported()
        assert "pypto 0.3.0" in compat.unavailable_reasons()[0]
        monkeypatch.setattr(compat, "installed_pypto_version", lambda: None)
        compat.unavailable_reasons.cache_clear()
        with pytest.raises(RuntimeError, match=r"pypto 0\.2\.0 not installed"):
            sim.ensure_supported()
    finally:
        monkeypatch.undo()
        compat.unavailable_reasons.cache_clear()


def test_the_version_check_is_not_paid_per_call(monkeypatch):
    """Every kernel call's "can this run" check consults the pypto version; reading package metadata
    costs about half a millisecond, so it is read once per process (pypto_runtime.compat), never per
    call: with importlib.metadata.version counting its calls, reasons for calls of new signatures
    (nothing memoised for them) read nothing."""
    import importlib.metadata

    from mla_ops.kernels.pypto.kv_prolog_stage2 import kv_prolog_stage2_not_supported_reasons
    from mla_ops.pypto_runtime import compat

    compat.unavailable_reasons()  # the one read per process (already done by earlier tests, or now)
    reads = []
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: reads.append(name) or real_version(name))
    for tokens in (1, 2, 3, 5, 8):
        latent, k_pe = torch.zeros(tokens, 16, dtype=torch.bfloat16), torch.zeros(tokens, 8, dtype=torch.bfloat16)
        table = torch.zeros(tokens, 4)
        kv_prolog_stage2_not_supported_reasons(latent, k_pe, torch.zeros(4 * 20, 16, dtype=torch.bfloat16), table,
                                               table, num_heads=4, qk_nope_head_dim=8, v_head_dim=12)
    assert reads == []


def test_importing_the_package_does_not_import_pypto():
    code = ("import sys, mla_ops, mla_ops.pypto_runtime as rt; rt.unavailable_reasons(); "
            "from mla_ops.kernels.pypto import gather_pa_kv_cache as g; g.select_gather_tile_config(1, 512, 1, 64); "
            "from mla_ops.bench import npu_sim; "
            "assert 'pypto' not in sys.modules, 'pypto imported'")
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


def test_calculator_cache_location(monkeypatch, tmp_path):
    from mla_ops.pypto_runtime.calculator import _calculator_cache_dir

    monkeypatch.setenv("MLA_OPS_PYPTO_CACHE", str(tmp_path))
    path = _calculator_cache_dir()
    assert path.parent == tmp_path
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    assert path.name == f"{sim.installed_pypto_version()}-{torch.__version__}-abi{abi}"


def test_parse_verify_lines():
    lines = [
        "[INFO ] PYPTO(1):2026 x [flow_verifier.cpp:113][VERIFY]:tensor_graph Verify for 8 data view "
        "list index 5 result PASS",
        "[ERROR] PYPTO(1):2026 x [flow_verifier.cpp:107][VERIFY]:ErrCode: FB4001! tensor_graph Verify for "
        "3 data view list index 2 result FAILED",
        "[INFO ] x [VERIFY]:LOOP_T_hiddenfunc0_8_Pass_36_CodegenPreproc Verify for 3 data view list "
        "index 0 result PASS",
        "[ERROR] x ErrCode: FB4001! VerifyPass failed for function f0, pass ExpandFunction (passIndex: 4, "
        "captureIndex: 0): Errcode: FB200B!",
        "[INFO ] unrelated line",
    ]
    verdicts, errors = sim.parse_verify_lines(lines)
    assert verdicts == [("tensor_graph", 5, "PASS"), ("tensor_graph", 2, "FAILED"),
                        ("LOOP_T_hiddenfunc0_8_Pass_36_CodegenPreproc", 0, "PASS")]
    assert errors == [("f0:ExpandFunction", "FB200B")]


@pytest.mark.pypto
@needs_pypto
def test_failed_verdict_raises_and_restores_cwd(pypto_sim, tmp_path, monkeypatch):
    """A wrong golden is a FAILED tensor_graph verdict -> SimVerificationError; the cwd is restored
    and pypto's working directory removed."""
    from mla_ops.kernels.pypto import gather_pa_kv_cache as gpa
    monkeypatch.chdir(tmp_path)
    case = bench.GatherCase("small", lengths=(3,), offsets=None, num_blocks=2, block_size=16,
                            key_hd=(1, 16), value_hd=(1, 16))
    inputs = bench.make_gather_inputs(case)
    wrong = [g + 1 for g in gather_pa_kv_cache_oracle(**inputs)]
    with pytest.raises(sim.SimVerificationError, match=r"reported \d+ FAILED verdict"):
        gpa.run_with_result(**inputs, goldens=wrong)
    assert Path.cwd() == tmp_path and list(tmp_path.iterdir()) == []
    result = sim.last_result()
    assert result.failed and result.work_dir is None
    assert torch.equal(inputs["key"], gather_pa_kv_cache_oracle(**bench.make_gather_inputs(case))[0])


@pytest.mark.pypto
@needs_pypto
def test_missing_plog_is_an_error(pypto_sim, tmp_path, monkeypatch):
    """If the plog is not where the harness looks, a run must not pass as 'verified'."""
    from mla_ops.kernels.pypto import gather_pa_kv_cache as gpa
    from mla_ops.pypto_runtime import compat

    monkeypatch.setattr(compat, "plog_root", lambda: tmp_path)
    case = bench.GatherCase("small", lengths=(2,), offsets=None, num_blocks=2, block_size=16,
                            key_hd=(1, 16), value_hd=(1, 16))
    with pytest.raises(RuntimeError, match="nothing was logged to this process's pypto plog"):
        gpa.run_with_result(**bench.make_gather_inputs(case))


@pytest.mark.pypto
@needs_pypto
def test_keep_output_keeps_the_working_directory(pypto_sim, monkeypatch):
    import shutil

    from mla_ops.kernels.pypto import gather_pa_kv_cache as gpa
    monkeypatch.setenv("MLA_OPS_PYPTO_KEEP_OUTPUT", "1")
    case = bench.GatherCase("small", lengths=(2,), offsets=None, num_blocks=2, block_size=16,
                            key_hd=(1, 16), value_hd=(1, 16))
    result = gpa.run_with_result(**bench.make_gather_inputs(case))
    try:
        assert result.work_dir and list(Path(result.work_dir).glob("output/*/CostModelSimulationOutput"))
        assert (Path(result.work_dir) / "console.log").exists()
    finally:
        shutil.rmtree(result.work_dir, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# recorded simulated time
# ----------------------------------------------------------------------------------------------
def test_compare_to_record_flags_growth_and_missing_rows():
    row = {"kernel": "k", "case": "c", "config": "default", "tokens": 1, "dtype": "bfloat16",
           "aicore_us": 10.0, "total_cycles": 1}
    record = {"rows": [row]}
    assert bench.compare_to_record([dict(row, aicore_us=10.99)], record) == []
    problems = bench.compare_to_record([dict(row, aicore_us=11.01)], record)
    assert len(problems) == 1 and "11.01 us > recorded 10.00 us" in problems[0]
    assert "not in the record" in bench.compare_to_record([dict(row, tokens=2)], record)[0]
