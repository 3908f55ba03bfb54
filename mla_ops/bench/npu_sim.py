"""Simulated-time benchmark of the PyPTO kernels (pypto SIM cost model of an Ascend 910B2, AICore
end-to-end µs at 1.8 GHz), with a record file and a regression check.

    mla-ops bench npu-sim [--quick] [--record]
    python -m mla_ops.bench.npu_sim [--quick] [--record] [--path P] [--stage2-sweep]

* default: measure and print a table, then compare with the record (exit 1 on a >10% regression);
* ``--record``: write the measurement to ``benchmarks/results/npu_sim.json`` (or ``--path``);
* ``--stage2-sweep``: run the stage-2 tiling sweep (:func:`stage2_sweep_configs`) at T = 1, 8, 13 and print
  the markdown table kept in ``benchmarks/pypto_tiling.md``.

Simulated time is deterministic (it depends on shapes and tiling, not on values), so one run per
configuration suffices. Every measured call also runs pypto's pass verification and fails on a
FAILED verdict, and its outputs are compared with the reference kernels of the ops, so a number is
only recorded for a verified, correct configuration.

Gather cases: the ten sweep levels of the original GatherPaKvCache sample's tests
(cann/pypto-gym, tests/ops/experimental/vector/GatherPaKvCache/test_gather_pa_kv_cache.py):
key_cache [num_blocks,128,1,512], value_cache [num_blocks,128,1,64], bf16, block_tables [Q,8] int32,
cumsum seq_lens, seq_offset; and two targeted shapes (heads 1, k 128 / v 64; heads 64, k 128 /
v 128 -> "large_token"). The sweep
levels use ``num_blocks=64`` instead of the sample's 5513: pypto's verifier dumps every kernel input
once per verified pass (7x), so a 722 MB cache costs ~140 s and ~12 GB RSS per simulated call on a
2-core machine, while the simulated time does not depend on num_blocks (measured: 4.56 µs for the
same sequences at 64 and at 5513 blocks).
"""

import argparse
import dataclasses
import json
import os
import platform
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import pypto_runtime
from ..ops.gather_pa_kv_cache import gather_pa_kv_cache_reference
from ..ops.kv_prolog import expand_latent
from ..ops.rope import rope_math

__all__ = [
    "GatherCase",
    "assert_rounding_close",
    "assert_stage2_close",
    "compare_to_record",
    "default_record_path",
    "gather_cases",
    "load_record",
    "make_gather_inputs",
    "make_stage2_inputs",
    "measure",
    "record",
    "stage2_reference",
    "stage2_sweep",
    "stage2_sweep_configs",
]

V2_LITE = dict(num_heads=16, qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=512, rope_dim=64)
STAGE2_TOKENS = (1, 2, 8, 13, 16, 24, 48, 128)
GATHER_NUM_BLOCKS = 64          # see the module docstring (the sample's sweep used 5513)
SAMPLE_SWEEP_TOTALS = ((4, 6), (4, 27), (4, 31), (4, 35), (4, 39), (4, 43), (4, 47), (4, 51), (4, 55), (3, 44))


def default_record_path() -> Path:
    """``<repo>/benchmarks/results/npu_sim.json`` (the repository holding this package)."""
    return Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "npu_sim.json"


# ----------------------------------------------------------------------------------------------
# inputs, and the reference the kernels are checked against
# ----------------------------------------------------------------------------------------------
def make_stage2_inputs(tokens: int, *, dtype=torch.bfloat16, num_heads=16, qk_nope_head_dim=128,
                       v_head_dim=128, kv_lora_rank=512, rope_dim=64, seed=0) -> Dict[str, torch.Tensor]:
    """Deterministic stage-2 inputs: normed_ckv [T,L], k_pe [T,R], kv_b_weight [N*(P+V),L], cos/sin
    [T,R/2] fp32 (angles of DeepSeek-V2's rotary embedding at positions 0..T-1)."""
    g = torch.Generator().manual_seed(seed)
    N, P, V, L, R = num_heads, qk_nope_head_dim, v_head_dim, kv_lora_rank, rope_dim
    inv_freq = 1.0 / (10000 ** (torch.arange(0, R, 2, dtype=torch.float32) / R))
    angles = torch.outer(torch.arange(tokens, dtype=torch.float32) + 3.0, inv_freq)
    return {
        "normed_ckv": torch.randn(tokens, L, generator=g).to(dtype),
        "k_pe": torch.randn(tokens, R, generator=g).to(dtype),
        "kv_b_weight": (torch.randn(N * (P + V), L, generator=g) / L ** 0.5).to(dtype),
        "cos": angles.cos(),
        "sin": angles.sin(),
    }


def stage2_reference(normed_ckv, k_pe, kv_b_weight, cos, sin, *, num_heads, qk_nope_head_dim, v_head_dim,
                     rope_layout="interleaved"):
    """Stage 2 computed by the reference kernels' own pieces (the kv_b projection of
    ``mla::kv_prolog`` and the RoPE of ``mla::rope``), as [T, N, P], [T, N, V], [T, R]."""
    k_nope, value = expand_latent(normed_ckv[None], kv_b_weight, num_heads, qk_nope_head_dim, v_head_dim)
    rot = rope_math(k_pe[None], cos, sin, rope_layout)
    return k_nope[0].transpose(0, 1), value[0].transpose(0, 1), rot[0]


def assert_rounding_close(actual: torch.Tensor, expected: torch.Tensor, abs_products: torch.Tensor,
                          depth: int) -> None:
    """``actual`` and ``expected`` are the same dot products of length ``depth``, accumulated in fp32
    in different orders and rounded once to the output dtype (pypto's calculator runs each per-head
    matmul through torch::matmul, the reference one F.linear over all heads). So they may differ by
    1 ulp of the output dtype, plus the fp32 accumulation-order error (at most
    ``depth * 2**-24 * sum|x_k*w_k|`` each), which only shows where the sum cancels to near zero.
    ``abs_products`` = sum |x_k*w_k| per element."""
    a, b = actual.double(), expected.double()
    mag = torch.maximum(a.abs(), b.abs()).clamp_min(torch.finfo(actual.dtype).tiny)
    ulp = torch.finfo(actual.dtype).eps * torch.exp2(torch.floor(torch.log2(mag)))
    bound = ulp + 2 * depth * 2.0 ** -24 * abs_products.double()
    excess = (a - b).abs() - bound
    if excess.numel() and excess.max() > 0:
        raise AssertionError(f"{int((excess > 0).sum())} of {excess.numel()} elements differ by more than "
                             f"rounding allows (worst by {excess.max().item():.3g})")


def assert_stage2_close(outputs, goldens, inputs, *, num_heads, qk_nope_head_dim, **_) -> None:
    """k_nope/value within :func:`assert_rounding_close`, k_pe bit-identical (same fp32 products and
    sums as the reference, one rounding)."""
    x, w = inputs["normed_ckv"].double().abs(), inputs["kv_b_weight"].double().abs()
    T, L = x.shape
    sums = (x @ w.T).view(T, num_heads, -1)
    assert_rounding_close(outputs[0], goldens[0], sums[..., :qk_nope_head_dim], L)
    assert_rounding_close(outputs[1], goldens[1], sums[..., qk_nope_head_dim:], L)
    if not torch.equal(outputs[2], goldens[2]):
        raise AssertionError("stage-2 k_pe differs from the reference rope")


@dataclasses.dataclass(frozen=True)
class GatherCase:
    """One gather problem: sequence lengths, per-sequence table offsets (multiples of block_size)
    and cache geometry. ``extra_rows`` output rows beyond the last sequence stay untouched."""

    name: str
    lengths: Tuple[int, ...]
    offsets: Optional[Tuple[int, ...]]
    num_blocks: int
    block_size: int = 128
    key_hd: Tuple[int, int] = (1, 512)
    value_hd: Tuple[int, int] = (1, 64)
    table_cols: int = 8
    extra_rows: int = 5

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def _split(total: int, parts: int, g: torch.Generator) -> Tuple[int, ...]:
    """Deterministic composition of ``total`` into ``parts`` positive lengths."""
    extra = torch.multinomial(torch.ones(parts), total - parts, replacement=True, generator=g) \
        if total > parts else torch.zeros(0, dtype=torch.long)
    return tuple(int(1 + (extra == i).sum()) for i in range(parts))


def gather_cases(num_blocks: int = GATHER_NUM_BLOCKS, seed: int = 0) -> List[GatherCase]:
    """The sample's ten sweep levels (Q=4 with 6..55 tokens, Q=3 with 44; lengths and offsets drawn
    from a seeded generator, some offsets nonzero multiples of the block size) and its two targeted
    shapes."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for level, (q, total) in enumerate(SAMPLE_SWEEP_TOTALS):
        lengths = _split(total, q, g)
        # Each sequence (<= 55 tokens) needs one 128-token block; offsets pick columns 0..7.
        offsets = tuple(int(c) * 128 for c in torch.randint(0, 8, (q,), generator=g))
        if not any(offsets):
            offsets = (128,) + offsets[1:]
        cases.append(GatherCase(f"level{level}", lengths, offsets, num_blocks))
    cases.append(GatherCase("heads1_k128_v64", (6,), None, 64, key_hd=(1, 128), value_hd=(1, 64)))
    cases.append(GatherCase("heads64_k128_v128", (6,), None, 64, key_hd=(64, 128), value_hd=(64, 128)))
    return cases


def make_gather_inputs(case: GatherCase, *, dtype=torch.bfloat16, cumsum=True, seed=0) -> Dict[str, object]:
    """Caches with random values, a block table of distinct random block ids, seq_lens (cumsum [Q+1]
    or lengths [Q]), seq_offset (or None) and sentinel-filled outputs with ``extra_rows`` spare rows."""
    g = torch.Generator().manual_seed(seed)
    (hk, dk), (hv, dv) = case.key_hd, case.value_hd
    q = len(case.lengths)
    key_cache = torch.randn(case.num_blocks, case.block_size, hk, dk, generator=g).to(dtype)
    value_cache = torch.randn(case.num_blocks, case.block_size, hv, dv, generator=g).to(dtype)
    ids = torch.randperm(case.num_blocks, generator=g)
    block_tables = ids.repeat((q * case.table_cols) // case.num_blocks + 1)[:q * case.table_cols]
    block_tables = block_tables.view(q, case.table_cols).to(torch.int32)
    lengths = torch.tensor(case.lengths, dtype=torch.int32)
    seq_lens = lengths
    if cumsum:
        seq_lens = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    rows = case.tokens + case.extra_rows
    return {
        "key_cache": key_cache, "value_cache": value_cache,
        "block_tables": block_tables, "seq_lens": seq_lens,
        "seq_offset": None if case.offsets is None else torch.tensor(case.offsets, dtype=torch.int32),
        "key": torch.full((rows, hk, dk), -7.0, dtype=dtype),
        "value": torch.full((rows, hv, dv), 5.0, dtype=dtype),
        "is_seq_lens_cumsum": cumsum,
    }


# ----------------------------------------------------------------------------------------------
# measuring
# ----------------------------------------------------------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def measure_stage2(tokens: int, *, rope_layout="interleaved", dtype=torch.bfloat16, config=None) -> Dict:
    """One verified, golden-checked stage-2 run on V2-Lite dims -> a result row."""
    from ..kernels.pypto import kv_prolog_stage2 as s2
    config = config or s2.DEFAULT_STAGE2_CONFIG
    dims = dict(num_heads=16, qk_nope_head_dim=128, v_head_dim=128)
    inputs = make_stage2_inputs(tokens, dtype=dtype)
    outputs, res = s2.run_with_result(**inputs, **dims, rope_layout=rope_layout, config=config)
    assert_stage2_close(outputs, stage2_reference(**inputs, **dims, rope_layout=rope_layout), inputs, **dims)
    return {"kernel": "kv_prolog_stage2", "case": f"v2lite_{rope_layout}", "config": config.name,
            "tokens": tokens, "dtype": _dtype_name(dtype), "aicore_us": round(res.aicore_us, 3),
            "total_cycles": res.total_cycles}


def measure_gather(case: GatherCase, *, tile=None, dtype=torch.bfloat16) -> Dict:
    """One verified gather run, bit-exact against the reference kernel -> a result row."""
    from ..kernels.pypto import gather_pa_kv_cache as gpa
    inputs = make_gather_inputs(case, dtype=dtype)
    golden = inputs["key"].clone(), inputs["value"].clone()
    gather_pa_kv_cache_reference(inputs["key_cache"], inputs["value_cache"], inputs["block_tables"],
                                 inputs["seq_lens"], *golden, seq_offset=inputs["seq_offset"],
                                 is_seq_lens_cumsum=inputs["is_seq_lens_cumsum"])
    tile = tile or gpa.select_gather_tile_config(*case.key_hd, *case.value_hd)
    res = gpa.run_with_result(**inputs, tile=tile)
    if not (torch.equal(inputs["key"], golden[0]) and torch.equal(inputs["value"], golden[1])):
        raise AssertionError(f"gather {case.name} [{tile.name}] differs from the golden")
    return {"kernel": "gather_pa_kv_cache", "case": case.name, "config": tile.name, "tokens": case.tokens,
            "dtype": _dtype_name(dtype), "aicore_us": round(res.aicore_us, 3),
            "total_cycles": res.total_cycles}


def measure(quick: bool = False, *, log=None) -> List[Dict]:
    """Measure the kernels; rows ``{kernel, case, config, tokens, dtype, aicore_us, total_cycles}``.

    Full: stage 2 at T = 1, 2, 8, 13, 16 (the largest fused count), 24, 48 and 128 (beyond it) for
    both RoPE layouts; gather on every case of
    :func:`gather_cases` with both tile configurations. Quick: stage 2 at T = 1, 13 (interleaved),
    gather level0 / level9 (selected tile) and heads1_k128_v64 with both tiles.
    """
    from ..kernels.pypto import gather_pa_kv_cache as gpa
    rows = []

    def add(row):
        rows.append(row)
        if log:
            log(_format_row(row))

    layouts = ("interleaved",) if quick else ("interleaved", "half")
    for layout in layouts:
        for t in ((1, 13) if quick else STAGE2_TOKENS):
            add(measure_stage2(t, rope_layout=layout))
    for case in gather_cases():
        if quick and case.name not in ("level0", "level9", "heads1_k128_v64"):
            continue
        # Both tile configurations where they compile: a default [16, 64, 128] bf16 tile of the
        # heads-64 case is 256 KiB, more than the 192 KiB unified buffer.
        tiles = [t for t in (gpa.DEFAULT_GATHER_TILE, gpa.LARGE_TOKEN_GATHER_TILE)
                 if gpa.tile_fits_ub(t, case.key_hd, case.value_hd, 2)]
        if quick and case.name != "heads1_k128_v64":
            tiles = [gpa.select_gather_tile_config(*case.key_hd, *case.value_hd)]
        for tile in tiles:
            add(measure_gather(case, tile=tile))
    return rows


def _key(row: Dict) -> Tuple:
    return (row["kernel"], row.get("case", ""), row["config"], row["tokens"], row["dtype"])


def record(rows: Sequence[Dict], path: Optional[os.PathLike] = None) -> Path:
    """Write ``rows`` (plus the environment they were measured in) as JSON; returns the path."""
    path = Path(path or default_record_path())
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "description": "Simulated Ascend 910B2 AICore end-to-end time (us at 1.8 GHz) of mla_ops' "
                       "PyPTO kernels, from pypto's SIM cost model; every row is a pass-verified, "
                       "golden-checked run.",
        "generated_by": "mla-ops bench npu-sim --record",
        "pypto": pypto_runtime.installed_pypto_version(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "rows": sorted(rows, key=_key),
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def load_record(path: Optional[os.PathLike] = None) -> Dict:
    """The recorded document (``{"rows": [...], ...}``)."""
    path = Path(path or default_record_path())
    doc = json.loads(path.read_text())
    if "rows" not in doc:
        raise ValueError(f"{path} is not an npu_sim record (no 'rows')")
    return doc


def compare_to_record(rows: Sequence[Dict], record: Dict, tolerance: float = 0.10) -> List[str]:
    """Regressions of ``rows`` against ``record``: a measured ``aicore_us`` more than ``tolerance``
    above the recorded one, or a measured configuration missing from the record."""
    recorded = {_key(r): r for r in record["rows"]}
    problems = []
    for row in rows:
        ref = recorded.get(_key(row))
        if ref is None:
            problems.append(f"{_format_key(row)}: not in the record (re-record with --record)")
        elif row["aicore_us"] > ref["aicore_us"] * (1.0 + tolerance):
            problems.append(f"{_format_key(row)}: {row['aicore_us']:.2f} us > recorded "
                            f"{ref['aicore_us']:.2f} us +{tolerance:.0%}")
    return problems


def _format_key(row: Dict) -> str:
    return f"{row['kernel']}[{row.get('case', '')}/{row['config']}] T={row['tokens']} {row['dtype']}"


def _format_row(row: Dict) -> str:
    return (f"{row['kernel']:<20} {row.get('case', ''):<22} {row['config']:<12} {row['tokens']:>6} "
            f"{row['dtype']:<9} {row['aicore_us']:>9.2f} {row['total_cycles']:>10}")


TABLE_HEADER = (f"{'kernel':<20} {'case':<22} {'config':<12} {'tokens':>6} {'dtype':<9} {'aicore_us':>9} "
                f"{'cycles':>10}")


# ----------------------------------------------------------------------------------------------
# stage-2 tiling sweep (benchmarks/pypto_tiling.md)
# ----------------------------------------------------------------------------------------------
def stage2_sweep_configs():
    """The stage-2 tiling variants of benchmarks/pypto_tiling.md (all give identical outputs)."""
    from ..kernels.pypto.kv_prolog_stage2 import Stage2Config as C
    base = dict(cube_nbuffer=None)
    return [
        C("tile16/cube128x256/no-merge", **base),
        C("tile16/cube128x256/nbuf2 (default)"),
        C("tile16/cube128x256/nbuf4", cube_nbuffer=4),
        C("tile16/cube128x256/l1reuse2", cube_nbuffer=None, cube_l1_reuse=2),
        C("tile16/cube128x256/l1reuse4", cube_nbuffer=None, cube_l1_reuse=4),
        C("tile16/cube128x256/l1reuse1+nbuf2", cube_l1_reuse=1),
        C("tile16/k256x512,n128/nbuf2", cube_tiles=((16, 16), (256, 512), (128, 128))),
        C("tile16/k64x512,n128/nbuf2", cube_tiles=((16, 16), (64, 512), (128, 128))),
        C("tile16/k128x256,n128/nbuf2", cube_tiles=((16, 16), (128, 256), (128, 128))),
        C("tile16/sample k256x256,n64/nbuf2", cube_tiles=((16, 16), (256, 256), (64, 64))),
        C("tile16/sample k256x256,n64/l1reuse4", cube_tiles=((16, 16), (256, 256), (64, 64)), cube_nbuffer=None,
          cube_l1_reuse=4),
        C("tile16/k512x512,n64/nbuf2", cube_tiles=((16, 16), (512, 512), (64, 64))),
        C("tile8/nbuf2", tile_t=8),
        C("tile8/nbuf2/unroll[2,1]", tile_t=8, unroll_list=(2, 1)),
        C("tile8/nbuf2/unroll[8,4,2,1]", tile_t=8, unroll_list=(8, 4, 2, 1)),
        C("tile16/nbuf2/unroll[2,1]", unroll_list=(2, 1)),
        C("tile16/nbuf2/valid_shape_optimize", valid_shape_optimize=True),
        C("tile16/nbuf2/rope tile last 8", rope_tile_last=8),
        C("tile16/nbuf2/rope tile rows 16", rope_tile_t=16),
        C("tile16/nbuf2/rope tile rows 4", rope_tile_t=4),
        C("tile32/m16/nbuf2", tile_t=32),
        C("tile32/m32/nbuf2", tile_t=32, cube_tiles=((32, 32), (128, 512), (128, 256))),
        C("tile16/nbuf2/rope permute-matmul", rope_impl="permute"),
    ]


def stage2_sweep(tokens: Sequence[int] = (1, 8, 13), *, log=None) -> List[Dict]:
    """Every :func:`stage2_sweep_configs` variant at each T (interleaved, bf16, V2-Lite dims).
    A variant that fails to compile or verify is reported with its error instead of a time (after a
    failed compile pypto 0.2.0 refuses further compiles in the process: rerun without that variant)."""
    rows = []
    for config in stage2_sweep_configs():
        settings = {k: v for k, v in dataclasses.asdict(config).items() if k != "name"}
        row = {"config": config.name, "settings": settings}
        for t in tokens:
            try:
                row[f"T={t}"] = measure_stage2(t, config=config)["aicore_us"]
            except Exception as exc:  # noqa: BLE001 -- a sweep records failures instead of stopping
                row[f"T={t}"] = f"error: {str(exc).splitlines()[0][:80]}"
        rows.append(row)
        if log:
            log(f"{row['config']:<40} " + "  ".join(f"{k}={row[k]}" for k in row if k.startswith("T=")))
    return rows


def _markdown_sweep(rows: Sequence[Dict], tokens: Sequence[int]) -> str:
    head = "| config | " + " | ".join(f"T={t} µs" for t in tokens) + " | verify |\n"
    head += "|---|" + "---|" * len(tokens) + "---|\n"
    lines = []
    for r in rows:
        vals = [r[f"T={t}"] for t in tokens]
        ok = all(isinstance(v, float) for v in vals)
        cells = [f"{v:.2f}" if isinstance(v, float) else str(v) for v in vals]
        status = "0 FAILED, golden ok" if ok else "see cell"
        lines.append(f"| {r['config']} | " + " | ".join(cells) + f" | {status} |")
    return head + "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mla_ops.bench.npu_sim",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small subset (used by the regression test)")
    parser.add_argument("--record", action="store_true", help="write the measurement to the record file")
    parser.add_argument("--path", default=None, help=f"record file (default {default_record_path()})")
    parser.add_argument("--tolerance", type=float, default=0.10, help="allowed growth over the record")
    parser.add_argument("--stage2-sweep", action="store_true", help="print the stage-2 tiling sweep table")
    args = parser.parse_args(argv)
    reasons = pypto_runtime.unavailable_reasons()
    if reasons:
        print("PyPTO simulation unavailable: " + "; ".join(reasons), file=sys.stderr)
        return 2
    if args.stage2_sweep:
        tokens = (1, 8, 13)
        rows = stage2_sweep(tokens, log=print)
        print()
        print(_markdown_sweep(rows, tokens))
        return 0
    print(TABLE_HEADER)
    rows = measure(quick=args.quick, log=print)
    if args.record:
        print(f"recorded {len(rows)} rows in {record(rows, args.path)}")
        return 0
    path = Path(args.path or default_record_path())
    if not path.exists():
        print(f"no record at {path}; run with --record to create it")
        return 0
    problems = compare_to_record(rows, load_record(path), tolerance=args.tolerance)
    for p in problems:
        print("REGRESSION:", p)
    print("no regression against the record" if not problems else f"{len(problems)} regression(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
