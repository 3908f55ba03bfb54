"""Native CPU kernels (mla_ops/csrc/cpu, the cpu_native backend) against the reference kernels.

Every test runs once per ISA build this machine can execute (avx512, avx2, default). The reference
ops (`torch.ops.mla.*` with the default backend) are the oracle:
* kv_prolog / latent_kv_prolog, and DeepSeek-V4's shared_kv_q_prolog / shared_kv_prolog: bit-identical (same
  ATen GEMMs and reduction, same roundings).
* kv_compressor: bit-identical state and entry pool, call after call (ATen's softmax kernel, ATen's summation
  order over the slots, the same roundings), whatever ATen's thread count.
* gather / scatter: bit-identical (byte copies).
* lightning indexer: on random floats the native summation order differs from the reference's GEMMs,
  so the selected sets are compared up to positions whose scores tie with the k-th within rounding
  (the case database's integer inputs, where scores are exact, demand bit-identical output).
* sparse attention: the decode kernel over listed positions, compared like decode attention.
* decode attention: fp32 accumulation and softmax throughout, where the reference rounds its score
  GEMMs and probabilities to bf16/fp16, so it is compared with an fp64 oracle: never less accurate
  than the reference (within one output ulp; fp32, where both only differ in summation order, within
  three) and within a dtype tolerance.
"""

import os
import platform
import re
import shutil
import subprocess

import pytest
import torch

import mla_ops
from mla_ops.backends import cpu_native as native_cpu
from mla_ops.testing.cases import CASES
from mla_ops.testing.oracles import (
    mha_prefill_attention_oracle,
    mla_decode_attention_oracle,
    mla_prefill_attention_oracle,
)
from mla_ops.testing.suites import normalised_error

from utils import paged_case, rope_tables

ISAS = native_cpu.available_isas()
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
dtype_ids = [str(d).removeprefix("torch.") for d in DTYPES]
pytestmark = pytest.mark.skipif(
    not ISAS, reason=f"native CPU kernels unavailable: {native_cpu.unavailable_reason()}"
)


@pytest.fixture(params=ISAS or ["none"])
def isa(request):
    """The test runs once per ISA build this CPU runs; `native(...)` calls are served by that build."""
    with native_cpu.use_isa(request.param):
        yield request.param


def native(op, *args, **kwargs):
    """`torch.ops.mla.<op>` served by the native kernel (cpu_native requested by name: a call it cannot
    serve is refused, never handed to the reference kernel this file compares it with)."""
    with mla_ops.use_backend("cpu_native"):
        return getattr(torch.ops.mla, op)(*args, **kwargs)


@pytest.fixture(autouse=True)
def _ops_are_the_reference():
    """In this file `torch.ops.mla.*` is the reference the native kernels are compared with (on CPU the
    native kernels are the automatic choice); tests that need the op served natively say so."""
    with mla_ops.use_backend("reference"):
        yield


def test_the_kernels_run_the_build_chosen_for_this_cpu():
    """MLA_OPS_NATIVE_ISA's build, else the one at ATen's own level (ATEN_CPU_CAPABILITY lowers both)."""
    assert native_cpu.unavailable_reason() is None
    aten = torch.backends.cpu.get_cpu_capability().upper()
    at_atens_level = "avx512" if aten.startswith("AVX512") else "avx2" if aten == "AVX2" else "default"
    assert native_cpu.isa() == (native_cpu.requested_isa() or at_atens_level)
    assert native_cpu.available_isas()[-1] == "default"


def test_an_isa_this_cpu_cannot_run_is_refused_with_the_ones_it_can():
    with pytest.raises(RuntimeError, match="unknown ISA 'sse9'"):
        torch.ops.mla_native.set_isa("sse9")
    for isa in set(native_cpu.ISAS) - set(ISAS):
        with pytest.raises(RuntimeError, match=f"cannot run the {isa} build"):
            torch.ops.mla_native.set_isa(isa)


@pytest.mark.parametrize("isa", ISAS)
def test_the_isa_override_at_import(isa):
    """MLA_OPS_NATIVE_ISA, read when mla_ops is imported, picks the build (here in a fresh interpreter)."""
    import subprocess
    import sys

    code = "import mla_ops; from mla_ops.backends import cpu_native; print(cpu_native.isa())"
    env = dict(os.environ, **{native_cpu.ENV_ISA: isa, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == isa


@pytest.mark.parametrize("value", ["sse9", "avx1024"])
def test_an_unknown_isa_override_leaves_the_reference_kernels_with_the_reason(value):
    """A build the extension does not have: the native kernels stay unloaded (nothing registered), the import
    warns with the reason, and the ops run on the reference kernels."""
    import subprocess
    import sys

    code = ("import warnings, torch\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    import mla_ops\n"
            "from mla_ops.backends import cpu_native\n"
            "print(cpu_native.unavailable_reason())\n"
            "print(any('native CPU kernels are unavailable' in str(w.message) for w in caught))\n"
            "print(torch._C._dispatch_has_kernel_for_dispatch_key('mla::rms_norm', 'CPU'))\n"
            "x = torch.randn(2, 8)\n"
            "from mla_ops.ops.rms_norm import rms_norm_reference\n"
            "print(torch.equal(torch.ops.mla.rms_norm(x, torch.ones(8)), rms_norm_reference(x, torch.ones(8))))\n")
    env = dict(os.environ, **{native_cpu.ENV_ISA: value, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    env.pop(native_cpu.ENV_NO_NATIVE, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    reason, warned, registered, equal = out.stdout.strip().splitlines()
    assert reason == f"{native_cpu.ENV_ISA}={value!r} is not one of {native_cpu.ISAS}"
    assert (warned, registered, equal) == ("True", "False", "True")


# Instructions that need more than baseline x86-64: AVX / AVX2 / AVX-512 registers and VEX / EVEX mnemonics.
_BEYOND_BASELINE = re.compile(r"%[yz]mm\d|%k[0-7]\b|^\s*[0-9a-f]+:\s+v[a-z0-9]+\s", re.MULTILINE)


# Names of the copies the compiler makes of a function for one file (clones, cold parts): local to that file.
_FILE_LOCAL_COPY = re.compile(r"\.(isra|constprop|cold|part)\b")


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the ISA builds are x86-64's")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump (installed with the compiler)")
def test_code_shared_by_the_isa_builds_runs_on_any_x86_64_cpu():
    """One library holds every ISA build and loads on every CPU: each function that uses AVX / AVX2 / AVX-512
    instructions belongs to one build (its CPU_CAPABILITY namespace, or a copy local to one of its files). The
    load-time code and the one copy the linker keeps of an inline function several builds emit (c10's error
    formatting, say, which the AVX512 build compiles with VEX encodings) need nothing beyond baseline x86-64:
    setup.py puts the DEFAULT build first on the link line."""
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", native_cpu.load().__file__], capture_output=True,
                             text=True, check=True).stdout
    offending, own = [], 0
    for function in re.split(r"\n(?=[0-9a-f]+ <)", listing):
        name = re.match(r"[0-9a-f]+ <([^>]+)>:", function)
        if name is None or not _BEYOND_BASELINE.search(function):
            continue
        if "4AVX2" in name.group(1) or "6AVX512" in name.group(1) or _FILE_LOCAL_COPY.search(name.group(1)):
            own += 1
        else:
            offending.append(name.group(1))
    assert offending == []
    assert own > 100  # the builds' own vector code is in the listing


# ------------------------------------------------------------------------------------ decode attention

N, L, R = 4, 64, 16  # small heads; L/R exercise the vector body and (L=67 below) scalar tails


def _pool_case(
    dtype, block_size, lens, *, num_blocks=None, L=L, R=R, contiguous=False, index_dtype=torch.int32, seed=0
):
    """A vLLM-style pool [NB, bs, L+R] split into key_cache [..., :L] / value_cache [..., L:] views (or
    contiguous caches), tables with distinct random blocks padded with -1, and queries."""
    g = torch.Generator().manual_seed(seed)
    need = [max(1, -(-n // block_size)) for n in lens]
    columns = max(need) + 1
    num_blocks = num_blocks or sum(need) + 3
    pool = torch.randn(num_blocks, block_size, L + R, generator=g).to(dtype)
    key_cache, value_cache = pool[..., :L].unsqueeze(2), pool[..., L:].unsqueeze(2)
    if contiguous:
        key_cache, value_cache = key_cache.contiguous(), value_cache.contiguous()
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(lens), columns), -1, dtype=index_dtype)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used : used + n]
        used += n
    B = len(lens)
    q_latent = torch.randn(B, N, L, generator=g).to(dtype)
    q_pe = torch.randn(B, N, R, generator=g).to(dtype)
    return q_latent, q_pe, key_cache, value_cache, tables, torch.tensor(lens, dtype=index_dtype)


_DECODE_TOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
# How many output ulps the kernel may be behind the reference. In bf16/fp16 the reference rounds its
# scores and probabilities to the dtype and the kernel does not, so one ulp (the output rounding) is
# all the slack it needs. In fp32 neither rounds anything the other does not: both sum the same
# products in fp32 in different orders (ATen's GEMM blocking against the kernel's register blocks),
# each lands a few ulps from the exact answer and which is closer is chance; over 9-48 heads and
# several seeds the kernel's largest error was up to 2 ulps past the reference's.
_ORDER_ULPS = {torch.float32: 3, torch.bfloat16: 1, torch.float16: 1}


def _check_decode_accuracy(out, ref, exact, dtype):
    err = (out.double() - exact).abs().max().item()
    ref_err = (ref.double() - exact).abs().max().item()
    ulp = torch.finfo(dtype).eps * max(1.0, exact.abs().max().item())
    assert err <= ref_err + _ORDER_ULPS[dtype] * ulp, (err, ref_err)
    assert err <= _DECODE_TOL[dtype], err


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("block_size", [1, 3, 16, 64, 128])
def test_decode_matches_reference(isa, dtype, block_size):
    lens = [5, 1, 2 * block_size + 1, 300]
    args = _pool_case(dtype, block_size, lens)
    scale = (L + R) ** -0.5
    out = native("mla_decode_attention", *args, scale)
    ref = torch.ops.mla.mla_decode_attention(*args, scale)
    assert out.shape == ref.shape and out.dtype == dtype and out.is_contiguous()
    _check_decode_accuracy(out, ref, mla_decode_attention_oracle(*args, scale)[0], dtype)


def _expected_bf16_engine(isa: str, amx: bool) -> str:
    """The tile engine a build should pick for bf16 caches with L, R multiples of 32 on this CPU."""
    if isa != "avx512":
        return "fp32"
    if amx and torch.cpu._is_amx_tile_supported() and "DNNL_MAX_CPU_ISA" not in os.environ:
        return "amx"
    return "avx512_bf16" if torch.cpu._is_avx512_bf16_supported() else "fp32"


@pytest.mark.parametrize("amx", [True, False], ids=["amx-allowed", "amx-off"])
@pytest.mark.parametrize("heads", [1, 5, 16, 128])
@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
@pytest.mark.parametrize("fused", [True, False], ids=["pool-views", "two-caches"])
def test_decode_bf16_tile_engines(isa, heads, block_size, fused, amx, monkeypatch):
    """bf16 caches whose latent and rope dims are multiples of 32 take the AMX engine on CPUs whose
    oneDNN runs AMX tiles, the AVX512-BF16 dot-product engine where AMX is off (MLA_OPS_NATIVE_AMX=0)
    or absent, the fp32 engine elsewhere: against the fp64 oracle and the reference, over head counts
    that fill no tile or register block, ragged lengths (tiles across blocks, unit tails), one pool
    split into views (latent and rope side by side: one product over L + R) and two caches."""
    monkeypatch.setitem(globals(), "N", heads)  # _pool_case's query heads
    if not amx:
        monkeypatch.setenv(native_cpu.ENV_AMX, "0")
    args = _pool_case(torch.bfloat16, block_size, [1, 31, 32, 33, 2 * block_size + 7, 300], L=96, R=32,
                      contiguous=not fused)
    assert native_cpu.attention_engine(args[0], args[2], args[3]) == _expected_bf16_engine(isa, amx)
    scale = 128**-0.5
    out = native("mla_decode_attention", *args, scale)
    ref = torch.ops.mla.mla_decode_attention(*args, scale)
    _check_decode_accuracy(out, ref, mla_decode_attention_oracle(*args, scale)[0], torch.bfloat16)


@pytest.mark.parametrize("amx", [True, False], ids=["amx-allowed", "amx-off"])
@pytest.mark.parametrize("batch", [1, 3])
def test_decode_bf16_engines_at_v2_lite_dims(isa, batch, amx, monkeypatch):
    """V2-Lite dims (16 heads, 512 + 64) over 64-token blocks, 2000+ tokens: every tile one run of one
    block (the AMX engine reads the rows in place) but the split units' tails."""
    monkeypatch.setitem(globals(), "N", 16)
    if not amx:
        monkeypatch.setenv(native_cpu.ENV_AMX, "0")
    args = _pool_case(torch.bfloat16, 64, [2051, 64, 700][:batch], L=512, R=64)
    assert native_cpu.attention_engine(args[0], args[2], args[3]) == _expected_bf16_engine(isa, amx)
    scale = 192**-0.5
    out = native("mla_decode_attention", *args, scale)
    ref = torch.ops.mla.mla_decode_attention(*args, scale)
    _check_decode_accuracy(out, ref, mla_decode_attention_oracle(*args, scale)[0], torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("heads", [9, 20, 24, 40])
@pytest.mark.parametrize("dims", [(80, 16), (70, 6)], ids=["dims-of-16", "ragged-dims"])
@pytest.mark.parametrize("fused", [True, False], ids=["pool-views", "two-caches"])
def test_decode_fp32_engine_head_groups_and_row_orders(isa, dtype, heads, dims, fused, monkeypatch):
    """The fp32 engine (the one every dtype takes on an AVX2 or portable build): head counts that
    leave a partial vector of heads, or one vector after whole register blocks of heads (AVX2 holds
    the heads in the lanes, 16 per block); bf16 rows widened in lane order (dims in whole groups of
    16) or in source order (dims that are not, with tails past the vector width); lengths across
    several tiles with ragged tails; against the fp64 oracle and the reference."""
    monkeypatch.setitem(globals(), "N", heads)
    L_, R_ = dims
    args = _pool_case(dtype, 16, [1, 47, 48, 49, 150, 300], L=L_, R=R_, contiguous=not fused)
    if dtype != torch.bfloat16 or isa != "avx512":
        assert native_cpu.attention_engine(args[0], args[2], args[3]) == "fp32"
    scale = (L_ + R_) ** -0.5
    out = native("mla_decode_attention", *args, scale)
    ref = torch.ops.mla.mla_decode_attention(*args, scale)
    _check_decode_accuracy(out, ref, mla_decode_attention_oracle(*args, scale)[0], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_decode_engine_of_other_dtypes_and_dims_is_fp32(isa, dtype):
    args = _pool_case(dtype, 16, [5], L=96, R=32)
    assert native_cpu.attention_engine(args[0], args[2], args[3]) == "fp32"
    args = _pool_case(torch.bfloat16, 16, [5], L=80, R=16)  # not multiples of 32
    assert native_cpu.attention_engine(args[0], args[2], args[3]) == "fp32"


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_decode_contiguous_int64_and_tails(isa, dtype):
    """Contiguous caches, int64 indices, and dims that are no multiple of any vector width."""
    args = _pool_case(dtype, 16, [33, 200], L=67, R=10, contiguous=True, index_dtype=torch.int64)
    scale = 0.1
    out = native("mla_decode_attention", *args, scale)
    ref = torch.ops.mla.mla_decode_attention(*args, scale)
    _check_decode_accuracy(out, ref, mla_decode_attention_oracle(*args, scale)[0], dtype)


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "lens",
    [[5000], [300, 7, 129], [65, 64, 1, 200, 90], [100, 110], [110, 100], [1051, 1050, 1049, 1047, 1046, 1045]],
    ids=["one", "three", "five", "cut-near-row-start", "cut-near-row-end", "near-equal"],
)
def test_decode_split_over_threads(isa, threads, lens):
    """The rows' positions, laid end to end, are cut into one equal slice per thread (split-K: none under 64
    positions; a cut within 16 positions of a row's edge moves to that edge), a row cut by a slice boundary is
    merged from its pieces, and a row held by one piece skips the merge. Every split agrees with the fp64 oracle,
    and a NaN in an attended row makes that row's output NaN whichever way it was split."""
    args = _pool_case(torch.float32, 16, lens)
    exact = mla_decode_attention_oracle(*args, 0.05)[0]
    q_latent, q_pe, key_cache, value_cache, tables, seq_lens = args
    poisoned_cache = key_cache.clone()
    poisoned_cache[tables[0, 0].item(), 3, 0, 5] = float("nan")  # position 3 of row 0: attended
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = native("mla_decode_attention", *args, 0.05)
        poisoned = native("mla_decode_attention", 
            q_latent, q_pe, poisoned_cache, value_cache, tables, seq_lens, 0.05
        )
    finally:
        torch.set_num_threads(previous)
    assert (out.double() - exact).abs().max().item() < 1e-5
    assert poisoned[0].isnan().all()
    assert torch.equal(poisoned[1:], out[1:])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_decode_scratch_reused_across_call_sizes(isa, dtype):
    """A call's scratch (partials, staging rows, scores) is uninitialised memory a thread keeps from call to call up
    to a size, and fresh memory past it: a small call repeated after a larger one and after one past that size
    (eight single-thread rows of 16 heads: 66k partial floats) gives the same bits as the first time."""
    small = _pool_case(dtype, 16, [20], seed=1)
    larger = _pool_case(dtype, 16, [300, 7, 129], seed=2)
    past_cache = _pool_case(dtype, 16, [40, 70, 3, 90, 16, 33, 64, 5], seed=3)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first = native("mla_decode_attention", *small, 0.1)
        for other in (larger, past_cache):
            out = native("mla_decode_attention", *other, 0.1)
            exact = mla_decode_attention_oracle(*other, 0.1)[0]
            assert (out.double() - exact).abs().max().item() <= _DECODE_TOL[dtype]
            assert torch.equal(native("mla_decode_attention", *small, 0.1), first)
    finally:
        torch.set_num_threads(previous)
    assert (first.double() - mla_decode_attention_oracle(*small, 0.1)[0]).abs().max().item() <= _DECODE_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_decode_unattended_poison_never_leaks(isa, dtype, poison):
    """NaN/inf in slots past a row's length, in padding blocks and in blocks no row uses leaves the
    output bit for bit unchanged."""
    block_size, lens = 16, [20, 3, 33]
    q_latent, q_pe, key_cache, value_cache, tables, seq_lens = _pool_case(dtype, block_size, lens)
    clean = native("mla_decode_attention", 
        q_latent, q_pe, key_cache, value_cache, tables, seq_lens, 0.1
    )
    attended = torch.zeros(key_cache.shape[:2], dtype=torch.bool)
    for b, n in enumerate(lens):
        for t in range(n):
            attended[int(tables[b, t // block_size]), t % block_size] = True
    key_cache[~attended] = poison
    value_cache[~attended] = poison
    poisoned = native("mla_decode_attention", 
        q_latent, q_pe, key_cache, value_cache, tables, seq_lens, 0.1
    )
    assert torch.equal(poisoned, clean)


def test_decode_empty_batch(isa):
    args = _pool_case(torch.bfloat16, 16, [1])
    q_latent, q_pe, key_cache, value_cache, tables, seq_lens = args
    out = native("mla_decode_attention", 
        q_latent[:0], q_pe[:0], key_cache, value_cache, tables[:0], seq_lens[:0], 0.1
    )
    assert out.shape == (0, N, L)


DECODE_BAD = [
    ("zero length", lambda t, s: (t, s.index_fill(0, torch.tensor([1]), 0))),
    ("past capacity", lambda t, s: (t, s.index_fill(0, torch.tensor([0]), 10**6))),
    ("id too large", lambda t, s: (t.index_fill(1, torch.tensor([0]), 10**5), s)),
    ("negative id", lambda t, s: (t.index_fill(1, torch.tensor([0]), -1), s)),
]


@pytest.mark.parametrize("case", DECODE_BAD, ids=[c[0] for c in DECODE_BAD])
def test_decode_bad_values_same_error(isa, case):
    q_latent, q_pe, key_cache, value_cache, tables, seq_lens = _pool_case(torch.float32, 16, [20, 7])
    tables, seq_lens = case[1](tables, seq_lens)
    with pytest.raises(ValueError) as expected, mla_ops.use_backend("reference"):
        torch.ops.mla.mla_decode_attention(q_latent, q_pe, key_cache, value_cache, tables, seq_lens, 0.1)
    with pytest.raises(ValueError) as got:
        native("mla_decode_attention", 
            q_latent, q_pe, key_cache, value_cache, tables, seq_lens, 0.1
        )
    assert str(got.value) == str(expected.value)


def test_decode_float64_is_served_by_the_reference_and_explained(isa):
    args = _pool_case(torch.float64, 16, [20, 7])
    expected = torch.ops.mla.mla_decode_attention(*args, 0.1)
    with mla_ops.use_backend("auto"):
        text = mla_ops.explain("mla_decode_attention", *args, 0.1)
        assert "not cpu_native: torch.float64 is not served by the native kernels" in text, text
        assert torch.equal(torch.ops.mla.mla_decode_attention(*args, 0.1), expected)


# ------------------------------------------------------------------------------------------ kv_prolog


def _prolog_case(
    dtype, B, S, *, H=96, Lr=64, Rr=16, heads=3, P=16, V=24, bias=False, tables="batched", seed=0
):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    hidden = rand(B, S, H)
    kv_a = rand(Lr + Rr, H, scale=H**-0.5)
    kv_a_b = rand(Lr + Rr, scale=0.1) if bias else None
    norm_w = (1.0 + 0.1 * torch.randn(Lr, generator=g)).to(dtype)
    kv_b = rand(heads * (P + V), Lr, scale=Lr**-0.5)
    cos, sin = rope_tables(B, S, Rr, offset=3, batched=tables == "batched")
    if tables == "broadcast":
        cos, sin = cos[None], sin[None]  # [1, S, R/2]
    elif tables in ("bf16", "fp64"):
        table_dtype = torch.bfloat16 if tables == "bf16" else torch.float64
        cos, sin = cos.to(table_dtype), sin.to(table_dtype)
    return (hidden, kv_a, kv_a_b, norm_w, kv_b, cos, sin), dict(
        num_heads=heads, qk_nope_head_dim=P, v_head_dim=V
    )


def _assert_identical(outs, refs):
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert o.shape == r.shape and o.dtype == r.dtype and o.is_contiguous()
        assert torch.equal(o, r), (o.float() - r.float()).abs().max()


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize(
    "B,S,bias,tables",
    [
        (1, 1, False, "batched"),
        (2, 7, True, "unbatched"),
        (3, 5, False, "broadcast"),
        (2, 4, True, "bf16"),
        (2, 3, False, "fp64"),
        (1, 40, False, "batched"),
    ],
)
def test_kv_prolog_bit_identical(isa, dtype, layout, B, S, bias, tables):
    args, kwargs = _prolog_case(dtype, B, S, bias=bias, tables=tables)
    ref = torch.ops.mla.kv_prolog(*args, **kwargs, rope_layout=layout, eps=1e-5)
    out = native("kv_prolog", *args, **kwargs, rope_layout=layout, eps=1e-5)
    _assert_identical(out, ref)
    hidden, kv_a, kv_a_b, norm_w, _, cos, sin = args
    ref = torch.ops.mla.latent_kv_prolog(hidden, kv_a, kv_a_b, norm_w, cos, sin, rope_layout=layout)
    out = native("latent_kv_prolog", hidden, kv_a, kv_a_b, norm_w, cos, sin, rope_layout=layout)
    _assert_identical(out, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_kv_prolog_v2_lite_dims(isa, dtype):
    """DeepSeek-V2-Lite's real dims: H=2048, L=512, R=64, N=16, P=V=128."""
    args, kwargs = _prolog_case(dtype, 1, 3, H=2048, Lr=512, Rr=64, heads=16, P=128, V=128)
    _assert_identical(
        native("kv_prolog", *args, **kwargs), torch.ops.mla.kv_prolog(*args, **kwargs)
    )


@pytest.mark.parametrize("B,S", [(0, 3), (2, 0)])
def test_kv_prolog_empty(isa, B, S):
    args, kwargs = _prolog_case(torch.bfloat16, B, S, tables="unbatched")
    _assert_identical(
        native("kv_prolog", *args, **kwargs), torch.ops.mla.kv_prolog(*args, **kwargs)
    )
    hidden, kv_a, kv_a_b, norm_w, _, cos, sin = args
    _assert_identical(
        native("latent_kv_prolog", hidden, kv_a, kv_a_b, norm_w, cos, sin),
        torch.ops.mla.latent_kv_prolog(hidden, kv_a, kv_a_b, norm_w, cos, sin),
    )


def test_kv_prolog_float64_is_served_by_the_reference(isa):
    args, kwargs = _prolog_case(torch.float64, 2, 3)
    expected = torch.ops.mla.kv_prolog(*args, **kwargs)
    with mla_ops.use_backend("auto"):
        assert mla_ops.explain("kv_prolog", *args, **kwargs).startswith("mla.kv_prolog: reference")
        _assert_identical(torch.ops.mla.kv_prolog(*args, **kwargs), expected)


def test_kv_prolog_with_pair_major_tables_is_served_by_the_reference(isa):
    """transformers 4.54 - 5.1x hand DeepSeek-V2 a transposed freqs tensor, so cos/sin step through
    positions faster than through pairs; the stock RoPE's rounding over that layout is ATen's, which the
    reference kernel shares and the vectorised native formula does not: auto picks the reference."""
    from mla_ops.ops.kv_prolog import kv_prolog_reference

    args, kwargs = _prolog_case(torch.float32, 2, 9)
    cos, sin = args[5], args[6]
    transposed = [t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (cos, sin)]
    assert torch.equal(transposed[0], cos) and transposed[0].stride(-1) > transposed[0].stride(-2)
    args = (*args[:5], *transposed)
    with mla_ops.use_backend("auto"):
        text = mla_ops.explain("kv_prolog", *args, **kwargs)
        assert text.startswith("mla.kv_prolog: reference") and "pair-major" in text, text
        _assert_identical(torch.ops.mla.kv_prolog(*args, **kwargs), kv_prolog_reference(*args, **kwargs))


# ------------------------------------------------------------------------------------------- rms_norm
# (weight dtype, x dtype): the same dtype, or an fp32 weight (output fp32)
RMS_DTYPES = [(d, d) for d in DTYPES] + [(torch.float32, torch.bfloat16), (torch.float32, torch.float16)]


@pytest.mark.parametrize("weight_dtype,dtype", RMS_DTYPES, ids=[f"{str(w)[6:]}-{str(d)[6:]}" for w, d in RMS_DTYPES])
@pytest.mark.parametrize("shape", [(1, 1, 2048), (3, 5, 512), (7, 67), (4, 1, 13), (2, 0, 64), (300, 96)],
                         ids=["decode-token", "batch-seq", "ragged-tail", "short-rows", "empty", "many-rows"])
def test_rms_norm_bit_identical_to_the_reference(isa, weight_dtype, dtype, shape):
    """The reference is bit-identical to transformers' DeepseekV2RMSNorm; the native kernel to the reference,
    for every ISA build, vector body and scalar tail, one row or many."""
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    weight = (1.0 + 0.1 * torch.randn(shape[-1], generator=g)).to(weight_dtype)
    for eps in (1e-6, 1e-5, 0.0):
        want = torch.ops.mla.rms_norm(x, weight, eps)  # the reference (this file's default)
        got = native("rms_norm", x, weight, eps)
        assert got.dtype == want.dtype == torch.promote_types(weight_dtype, dtype) and got.shape == x.shape
        assert torch.equal(got, want), (eps, (got.float() - want.float()).abs().max())


def test_rms_norm_declines_what_the_reference_serves_with_the_reason(isa):
    x = torch.randn(4, 6, 32)
    cases = {
        "x is not contiguous": (x.transpose(0, 1), torch.ones(32)),
        "weight torch.bfloat16 with x torch.float32": (x, torch.ones(32, dtype=torch.bfloat16)),
        "torch.float64 is not served by the native kernels": (x.double(), torch.ones(32, dtype=torch.float64)),
    }
    for reason, (xi, w) in cases.items():
        with mla_ops.use_backend("auto"):
            assert reason in mla_ops.explain("rms_norm", xi, w, 1e-6)
        with pytest.raises(NotImplementedError, match=reason):
            native("rms_norm", xi, w, 1e-6)
        with mla_ops.use_backend("reference"):
            expected = torch.ops.mla.rms_norm(xi, w, 1e-6)
        with mla_ops.use_backend("auto"):
            assert torch.equal(torch.ops.mla.rms_norm(xi, w, 1e-6), expected)


# ------------------------------------------------------------------------------------- gather / scatter


def _split_pool(dtype, num_blocks, block_size, Lk=32, Rv=8, seed=0):
    """[NB, bs, Lk+Rv] pool -> (key_cache [NB, bs, 1, Lk], value_cache [NB, bs, 1, Rv]) strided views."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(num_blocks, block_size, Lk + Rv, generator=g).to(dtype)
    return pool[..., :Lk].unsqueeze(2), pool[..., Lk:].unsqueeze(2)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("block_size", [1, 3, 16, 64, 128])
@pytest.mark.parametrize("layout", ["split", "dense"])
@pytest.mark.parametrize("cumsum", [False, True], ids=["lens", "cumsum"])
def test_gather_matches_reference(isa, dtype, block_size, layout, cumsum):
    lens = [5, 0, 2 * block_size, block_size + 1, 1]
    if layout == "split":
        need = sum(-(-n // block_size) for n in lens) + 2
        key_cache, value_cache = _split_pool(dtype, need + 4, block_size)
        _, _, tables, cum, _ = paged_case(need + 4, block_size, lens, dtype=dtype)
    else:
        key_cache, value_cache, tables, cum, _ = paged_case(
            60, block_size, lens, key_shape=(2, 8), value_shape=(1, 5), dtype=dtype
        )
    seq_lens = cum if cumsum else torch.tensor(lens, dtype=torch.int64)
    total = sum(lens)
    key = torch.randn(total + 3, *key_cache.shape[2:]).to(dtype)
    value = torch.randn(total + 3, *value_cache.shape[2:]).to(dtype)
    rk, rv = key.clone(), value.clone()
    torch.ops.mla.gather_pa_kv_cache(
        key_cache, value_cache, tables, seq_lens, rk, rv, is_seq_lens_cumsum=cumsum
    )
    native("gather_pa_kv_cache", 
        key_cache, value_cache, tables, seq_lens, key, value, is_seq_lens_cumsum=cumsum
    )
    assert torch.equal(key, rk) and torch.equal(value, rv)


def test_gather_seq_offset_and_strided_outputs(isa):
    block_size, lens, offsets = 4, [6, 3, 9], [4, 0, 8]
    key_cache, value_cache, tables, cum, offs = paged_case(
        40, block_size, lens, key_shape=(1, 16), value_shape=(1, 8), offsets=offsets, columns=6
    )
    total = sum(lens)
    out_pool = torch.zeros(total, 1, 30, dtype=key_cache.dtype)
    key, value = out_pool[..., :16], out_pool[..., 20:28]  # strided outputs
    rk, rv = key.clone(), value.clone()
    torch.ops.mla.gather_pa_kv_cache(
        key_cache, value_cache, tables, cum, rk, rv, seq_offset=offs, is_seq_lens_cumsum=True
    )
    native("gather_pa_kv_cache", 
        key_cache, value_cache, tables, cum, key, value, seq_offset=offs, is_seq_lens_cumsum=True
    )
    assert torch.equal(key, rk) and torch.equal(value, rv)
    assert torch.equal(out_pool[..., 16:20], torch.zeros_like(out_pool[..., 16:20]))  # gaps untouched
    kf, vf = native("gather_pa_kv_cache_functional", 
        key_cache,
        value_cache,
        tables,
        cum,
        key * 0,
        value * 0,
        seq_offset=offs,
        is_seq_lens_cumsum=True,
            )
    assert torch.equal(kf, rk) and torch.equal(vf, rv)


@pytest.mark.parametrize("layout", ["row-major", "size-1 dim strided", "transposed"])
def test_gather_functional_outputs_are_clones_in_the_inputs_layout(isa, layout):
    """The functional gather's outputs are copies of key / value (their rows beyond the gathered ones
    included) with empty_like's strides, the layout its fake kernel promises, for every input layout."""
    block_size, lens = 4, [6, 3]
    key_cache, value_cache, tables, cum, _ = paged_case(20, block_size, lens, key_shape=(1, 16), value_shape=(1, 8))
    rows = sum(lens) + 2
    dtype = key_cache.dtype
    key, value = torch.randn(rows, 1, 16).to(dtype), torch.randn(rows, 1, 8).to(dtype)
    if layout == "size-1 dim strided":  # contiguous, with another stride on its size-1 dim
        key, value = key.as_strided(key.shape, (16, 7, 1)), value.as_strided(value.shape, (8, 3, 1))
    elif layout == "transposed":
        key = torch.randn(16, 1, rows).to(dtype).permute(2, 1, 0)
        value = torch.randn(8, 1, rows).to(dtype).permute(2, 1, 0)
    rk, rv = key.clone(), value.clone()
    torch.ops.mla.gather_pa_kv_cache(key_cache, value_cache, tables, cum, rk, rv, is_seq_lens_cumsum=True)
    kf, vf = native("gather_pa_kv_cache_functional", 
        key_cache, value_cache, tables, cum, key, value, is_seq_lens_cumsum=True
    )
    assert torch.equal(kf, rk) and torch.equal(vf, rv)
    assert kf.stride() == torch.empty_like(key).stride() and vf.stride() == torch.empty_like(value).stride()
    assert kf.data_ptr() != key.data_ptr() and vf.data_ptr() != value.data_ptr()


GATHER_BAD = {
    "cumsum not from 0": dict(cumsum=True, seq_lens=[1, 4, 9]),
    "cumsum decreasing": dict(cumsum=True, seq_lens=[0, 5, 3]),
    "negative length": dict(seq_lens=[3, -1]),
    "negative offset": dict(seq_lens=[3, 2], seq_offset=[-4, 0]),
    "offset not block multiple": dict(seq_lens=[3, 2], seq_offset=[2, 0]),
    "too few output rows": dict(seq_lens=[30, 30], rows=10),
    "too many columns": dict(seq_lens=[4 * 5, 1]),
    "id out of range": dict(seq_lens=[3, 2], bad_id=99),
    "negative id": dict(seq_lens=[3, 2], bad_id=-1),
}


@pytest.mark.parametrize("case", GATHER_BAD.values(), ids=GATHER_BAD.keys())
def test_gather_bad_values_same_error_nothing_written(isa, case):
    key_cache, value_cache = _split_pool(torch.float32, 10, 4)
    tables = torch.arange(8, dtype=torch.int32).view(2, 4)
    if "bad_id" in case:
        tables[1, 0] = case["bad_id"]
    seq_lens = torch.tensor(case["seq_lens"], dtype=torch.int32)
    offsets = torch.tensor(case["seq_offset"], dtype=torch.int32) if "seq_offset" in case else None
    rows = case.get("rows", 64)
    key, value = torch.zeros(rows, 1, 32), torch.zeros(rows, 1, 8)
    kwargs = dict(seq_offset=offsets, is_seq_lens_cumsum=case.get("cumsum", False))
    with pytest.raises(ValueError) as expected, mla_ops.use_backend("reference"):
        torch.ops.mla.gather_pa_kv_cache(
            key_cache,
            value_cache,
            tables[: len(seq_lens) - kwargs["is_seq_lens_cumsum"]],
            seq_lens,
            key.clone(),
            value.clone(),
            **kwargs,
        )
    with pytest.raises(ValueError) as got:
        native("gather_pa_kv_cache", 
            key_cache,
            value_cache,
            tables[: len(seq_lens) - kwargs["is_seq_lens_cumsum"]],
            seq_lens,
            key,
            value,
            **kwargs,
                    )
    assert str(got.value) == str(expected.value)
    assert not key.any() and not value.any()  # nothing written


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("block_size", [1, 3, 16, 64, 128])
@pytest.mark.parametrize("layout", ["split", "dense"])
def test_scatter_matches_reference(isa, dtype, block_size, layout):
    num_blocks = 6
    if layout == "split":
        key_cache, value_cache = _split_pool(dtype, num_blocks, block_size)
    else:
        key_cache = torch.randn(num_blocks, block_size, 2, 8).to(dtype)
        value_cache = torch.randn(num_blocks, block_size, 1, 5).to(dtype)
    num_slots = num_blocks * block_size
    # a prefill run (block-aligned, in order), scattered single tokens and padding
    run = list(range(block_size, min(num_slots, 3 * block_size + 2)))
    rest = torch.randperm(num_slots)[:7].tolist()
    slots = torch.tensor(run + [s for s in rest if s not in run] + [-1, -5], dtype=torch.int64)
    T = slots.shape[0]
    key = torch.randn(T, *key_cache.shape[2:]).to(dtype)
    value = torch.randn(T, *value_cache.shape[2:]).to(dtype)
    rkc, rvc = key_cache.clone(), value_cache.clone()
    torch.ops.mla.scatter_pa_kv_cache(key, value, rkc, rvc, slots)
    native("scatter_pa_kv_cache", key, value, key_cache, value_cache, slots.to(torch.int32))
    assert torch.equal(key_cache, rkc) and torch.equal(value_cache, rvc)


def test_scatter_strided_tokens(isa):
    key_cache, value_cache = _split_pool(torch.bfloat16, 4, 16)
    src = torch.randn(10, 1, 50).to(torch.bfloat16)
    key, value = src[..., :32], src[..., 40:48]
    slots = torch.arange(3, 13)
    rkc, rvc = key_cache.clone(), value_cache.clone()
    torch.ops.mla.scatter_pa_kv_cache(key, value, rkc, rvc, slots)
    native("scatter_pa_kv_cache", key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, rkc) and torch.equal(value_cache, rvc)


def test_scatter_bad_slot_same_error_nothing_written(isa):
    key_cache, value_cache = _split_pool(torch.float32, 4, 16)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    key, value = torch.randn(5, 1, 32), torch.randn(5, 1, 8)
    slots = torch.tensor([0, 1, 2, 64, 3])  # 64 == num_slots: one past the end
    with pytest.raises(ValueError) as expected:
        torch.ops.mla.scatter_pa_kv_cache(key, value, key_cache.clone(), value_cache.clone(), slots)
    with pytest.raises(ValueError) as got:
        native("scatter_pa_kv_cache", key, value, key_cache, value_cache, slots)
    assert str(got.value) == str(expected.value)
    assert torch.equal(key_cache, before_k) and torch.equal(value_cache, before_v)


# ----------------------------------------------------------------------------------------- sparse MLA


def _indexer_case(dtype, seq_lens, q_lens, *, heads, dim, block_size, seed=0):
    """Random floats (not the case database's integers): q [T, H, D], weights [T, H], k_cache, the
    keys of every request in position order (fp64, for the exact scores), and the request tensors."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(seq_lens), max(need) + 1), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used : used + n]
        used += n
    starts = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    tokens = int(starts[-1])
    k_cache = torch.randn(num_blocks, block_size, 1, dim, generator=g).to(dtype)
    q = torch.randn(tokens, heads, dim, generator=g).to(dtype)
    weights = torch.randn(tokens, heads, generator=g) * heads**-0.5
    keys = [k_cache[tables[b, torch.arange(n) // block_size].long(), torch.arange(n) % block_size, 0].double()
            for b, n in enumerate(seq_lens)]
    return q, weights, k_cache, keys, tables, torch.tensor(seq_lens, dtype=torch.int32), starts


def _token_positions(seq_lens, starts):
    """(request, position) of every query token."""
    out = []
    for b, n in enumerate(seq_lens.tolist()):
        q_len = int(starts[b + 1] - starts[b])
        out += [(b, n - q_len + i) for i in range(q_len)]
    return out


@pytest.mark.parametrize("amx", [True, False], ids=["amx-allowed", "amx-off"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("q_len", [1, 64], ids=["decode", "prefill-chunk"])
def test_indexer_random_floats_at_v32_dims(isa, dtype, q_len, amx, monkeypatch):
    """DeepSeek-V3.2's indexer (64 heads x 128, top-2048) over ~3000 cached tokens: the native top-k
    equals the reference's except for positions whose exact score lies within a relative 1e-5 of the
    k-th (where the two summation orders may rank differently), and is in descending score order; bf16
    keys scored on AMX tiles where the CPU has them, and with AMX off."""
    if not amx:
        monkeypatch.setenv(native_cpu.ENV_AMX, "0")
    topk, scale = 2048, 128**-0.5
    q, weights, k_cache, keys, tables, seq_lens, starts = _indexer_case(
        dtype, [3000 + q_len, 700], [q_len, 1], heads=64, dim=128, block_size=64, seed=q_len)
    args = (q, weights, k_cache, tables, seq_lens, starts, topk, scale)
    got = native("lightning_indexer", *args)
    want = torch.ops.mla.lightning_indexer(*args)
    assert got.shape == want.shape and got.dtype == torch.int32
    for t, (b, p) in enumerate(_token_positions(seq_lens, starts)):
        exact = torch.relu(scale * (q[t].double() @ keys[b][: p + 1].t())).t() @ weights[t].double()
        k = min(topk, p + 1)
        assert torch.equal(got[t, k:], torch.full_like(got[t, k:], -1))
        chosen = got[t, :k].long()
        assert len(set(chosen.tolist())) == k and int(chosen.min()) >= 0 and int(chosen.max()) <= p
        kth = exact.sort(descending=True).values[k - 1]
        near = (exact - kth).abs() <= 1e-5 * kth.abs()
        differ = torch.tensor(sorted(set(chosen.tolist()) ^ set(want[t, :k].long().tolist())), dtype=torch.long)
        assert bool(near[differ].all()), (t, differ[~near[differ]])
        ranked = exact[chosen]  # best first, up to the same rounding
        assert bool((ranked[1:] <= ranked[:-1] + 1e-5 * torch.maximum(ranked[:-1].abs(), kth.abs())).all())


def _sparse_case(dtype, tables, seq_lens, starts, *, topk, heads, L, R, block_size=16, indices=None, seed=0):
    """(q_latent, q_pe, key_cache, value_cache, tables, seq_lens, starts, topk_indices): random caches
    over the blocks of `tables`; indices: each token's own positions in a random order with -1 mixed in
    and a repeat, unless given (e.g. an indexer's output)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = int(tables.max()) + 1
    pool = torch.randn(num_blocks, block_size, L + R, generator=g).to(dtype)
    key_cache, value_cache = pool[..., :L].unsqueeze(2), pool[..., L:].unsqueeze(2)
    positions = _token_positions(seq_lens, starts)
    if indices is None:
        indices = torch.full((len(positions), topk), -1, dtype=torch.int32)
        for t, (_, p) in enumerate(positions):
            listed = torch.randperm(p + 1, generator=g)[: topk - 2]
            indices[t, : listed.shape[0]] = listed
            indices[t, -1] = listed[0]  # listed twice: counted twice
            indices[t] = indices[t, torch.randperm(topk, generator=g)]
    q_latent = torch.randn(len(positions), heads, L, generator=g).to(dtype)
    q_pe = torch.randn(len(positions), heads, R, generator=g).to(dtype)
    return q_latent, q_pe, key_cache, value_cache, tables, seq_lens, starts, indices


def _sparse_exact(q_latent, q_pe, key_cache, value_cache, tables, seq_lens, starts, indices, scale):
    """fp64 attention of every token over its listed positions (zeros when none)."""
    block_size = key_cache.shape[1]
    out = torch.zeros(q_latent.shape, dtype=torch.float64)
    for t, (b, _) in enumerate(_token_positions(seq_lens, starts)):
        listed = indices[t].long()
        listed = listed[listed >= 0]
        if listed.numel() == 0:
            continue
        blocks, offsets = tables[b, listed // block_size].long(), listed % block_size
        latent, k_pe = key_cache[blocks, offsets, 0].double(), value_cache[blocks, offsets, 0].double()
        scores = (q_latent[t].double() @ latent.t() + q_pe[t].double() @ k_pe.t()) * scale
        out[t] = torch.softmax(scores, dim=-1) @ latent
    return out


_SPARSE_TOL = {torch.float32: 64 * 2.0**-23, torch.bfloat16: 2 * 2.0**-7, torch.float16: 2 * 2.0**-10}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_sparse_attention_matches_reference(isa, dtype, block_size):
    """Mixed requests (a prefill chunk, decode steps, an idle request), repeats and -1 in the lists, a
    token that lists nothing: within the case database's bound of the fp64 result, like the reference."""
    seq_lens, q_lens = [50, 1, 300, 7], [5, 1, 1, 0]
    need = [-(-n // block_size) for n in seq_lens]
    tables = torch.full((4, max(need) + 2), -1, dtype=torch.int32)
    perm = torch.randperm(sum(need) + 3, generator=torch.Generator().manual_seed(1))
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used : used + n]
        used += n
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = _sparse_case(dtype, tables, torch.tensor(seq_lens), starts, topk=40, heads=5, L=64, R=16,
                        block_size=block_size)
    indices = args[-1].clone()
    indices[2] = -1  # lists nothing: zeros
    args = (*args[:-1], indices)
    scale = 80**-0.5
    got = native("sparse_mla_attention", *args, scale)
    want = torch.ops.mla.sparse_mla_attention(*args, scale)
    exact = _sparse_exact(*args, scale)
    assert got.shape == want.shape and got.dtype == dtype
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    assert normalised_error(got, exact) <= max(_SPARSE_TOL[dtype], normalised_error(want, exact))


@pytest.mark.parametrize("amx", [True, False], ids=["amx-allowed", "amx-off"])
@pytest.mark.parametrize("q_len", [1, 64], ids=["decode", "prefill-chunk"])
def test_sparse_attention_of_the_indexers_choice_at_v32_dims(isa, q_len, amx, monkeypatch):
    """The indexer's top-2048 of ~3000 tokens attended with DeepSeek-V3.2's latent / rope dims (bf16;
    T = 1 splits the 2048 positions over the cores and merges them), on each bf16 tile engine the CPU
    has (AMX gathers the listed rows into its tile)."""
    if not amx:
        monkeypatch.setenv(native_cpu.ENV_AMX, "0")
    q, weights, k_cache, _, tables, seq_lens, starts = _indexer_case(
        torch.bfloat16, [3000 + q_len], [q_len], heads=64, dim=128, block_size=64, seed=3)
    topk = native("lightning_indexer", q, weights, k_cache, tables, seq_lens, starts, 2048, 128**-0.5)
    args = _sparse_case(torch.bfloat16, tables, seq_lens, starts, topk=2048, heads=16 if q_len > 1 else 128, L=512,
                        R=64, block_size=64, indices=topk)
    assert native_cpu.attention_engine(args[0], args[2], args[3]) == _expected_bf16_engine(isa, amx)
    scale = 192**-0.5
    got = native("sparse_mla_attention", *args, scale)
    want = torch.ops.mla.sparse_mla_attention(*args, scale)
    exact = _sparse_exact(*args, scale)
    assert normalised_error(got, exact) <= max(_SPARSE_TOL[torch.bfloat16], normalised_error(want, exact))


def test_sparse_bad_index_same_error(isa):
    args = _sparse_case(torch.float32, torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([20]),
                        torch.tensor([0, 2], dtype=torch.int32), topk=4, heads=2, L=16, R=8)
    indices = args[-1].clone()
    indices[1, 2] = 20  # one past the request's 20 cached tokens
    args = (*args[:-1], indices)
    with pytest.raises(ValueError) as expected:
        torch.ops.mla.sparse_mla_attention(*args, 0.1)
    with pytest.raises(ValueError) as got:
        native("sparse_mla_attention", *args, 0.1)
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_indexer_ties_nan_and_strided_keys(isa, dtype):
    """Exact scores (integer inputs) with many ties, NaN and inf keys, a strided key pool and fp16/bf16
    weights: bit-identical to the reference."""
    q, weights, k_cache, _, tables, seq_lens, starts = _indexer_case(dtype, [37, 70], [4, 2], heads=3, dim=20,
                                                                     block_size=8)
    q, k_pool = q.round().clamp(-2, 2), torch.randint(-1, 2, (k_cache.shape[0], 8, 1, 40)).to(dtype)
    k_cache = k_pool[..., ::2]  # element stride 2
    k_cache[0, 3, 0, 0] = float("nan")
    k_cache[1, 2, 0, :] = float("inf")
    weights = weights.sign().to(dtype)
    args = (q, weights, k_cache, tables, seq_lens, starts, 16, 0.5)
    assert torch.equal(native("lightning_indexer", *args), torch.ops.mla.lightning_indexer(*args))


@pytest.mark.parametrize("amx", [True, False], ids=["amx-allowed", "amx-off"])
@pytest.mark.parametrize("heads", [3, 64])
def test_indexer_exact_ties_nan_and_inf_on_every_bf16_engine(isa, heads, amx, monkeypatch):
    """bf16 keys with unit-stride rows and 32-multiple dims (the AMX scorer's, where the CPU has AMX
    tiles): integer inputs, so every summation order gives the exact scores, with many ties, a NaN and
    an inf key, prefill chunks and decode tokens, tiles of keys across blocks: bit-identical to the
    reference."""
    if not amx:
        monkeypatch.setenv(native_cpu.ENV_AMX, "0")
    q, weights, k_cache, _, tables, seq_lens, starts = _indexer_case(
        torch.bfloat16, [45, 300, 33], [5, 1, 33], heads=heads, dim=64, block_size=16, seed=heads)
    q, k_cache = q.round().clamp(-2, 2), k_cache.round().clamp(-1, 1)
    k_cache[0, 3, 0, 0] = float("nan")
    k_cache[1, 2, 0, :] = float("inf")
    weights = weights.sign()
    args = (q, weights, k_cache, tables, seq_lens, starts, 24, 0.5)
    assert torch.equal(native("lightning_indexer", *args), torch.ops.mla.lightning_indexer(*args))


def test_sparse_attention_float64_and_strided_caches_are_served_by_the_reference(isa):
    args = _sparse_case(torch.float32, torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([20]),
                        torch.tensor([0, 2], dtype=torch.int32), topk=4, heads=2, L=16, R=8)
    strided = (*args[:2], args[2].transpose(1, 3).contiguous().transpose(1, 3), *args[3:])  # last dim stride 16
    assert strided[2].stride(3) != 1
    as_double = tuple(a.double() if a.is_floating_point() else a for a in args)
    for call, reason in [(strided, "the caches' last dim must be unit-stride for the native sparse attention kernel"),
                         (as_double, "torch.float64 is not served by the native kernels")]:
        expected = torch.ops.mla.sparse_mla_attention(*call, 0.1)  # the reference (this file's default)
        with mla_ops.use_backend("auto"):
            assert f"not cpu_native: {reason}" in mla_ops.explain("sparse_mla_attention", *call, 0.1)
            assert torch.equal(torch.ops.mla.sparse_mla_attention(*call, 0.1), expected)


def test_scatter_pa_cache_matches_reference(isa):
    cache = torch.randn(6, 16, 1, 128).to(torch.bfloat16)
    key = torch.randn(20, 1, 128).to(torch.bfloat16)
    slots = torch.tensor(list(range(16, 32)) + [3, -1, 95, 40])
    want = cache.clone()
    torch.ops.mla.scatter_pa_cache(key, want, slots)
    native("scatter_pa_cache", key, cache, slots)
    assert torch.equal(cache, want)


# ----------------------------------------------------------------------------------------- MLA prefill
def _prefill_case(dtype, seq_lens, q_lens, *, heads, L, R, block_size, contiguous=False, seed=0):
    """(q_latent, q_pe, key_cache, value_cache, tables, seq_lens, query_start_loc): split views of one pool
    (or contiguous caches), distinct random blocks per request with -1 past them."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 3
    pool = torch.randn(num_blocks, block_size, 1, L + R, generator=g).to(dtype)
    key_cache, value_cache = pool[..., :L], pool[..., L:]
    if contiguous:
        key_cache, value_cache = key_cache.contiguous(), value_cache.contiguous()
    tables = torch.full((len(seq_lens), max(need + [1]) + 1), -1, dtype=torch.int32)
    perm, used = torch.randperm(num_blocks, generator=g), 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used : used + n]
        used += n
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q_latent = torch.randn(sum(q_lens), heads, L, generator=g).to(dtype)
    q_pe = torch.randn(sum(q_lens), heads, R, generator=g).to(dtype)
    return q_latent, q_pe, key_cache, value_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), starts


def _check_prefill(args, scale, dtype):
    """The native kernel within the case database's bound of the fp64 result, like the reference."""
    got = native("mla_prefill_attention", *args, scale)
    want = torch.ops.mla.mla_prefill_attention(*args, scale)
    exact = mla_prefill_attention_oracle(*args, scale)[0]
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    assert normalised_error(got, exact) <= max(_SPARSE_TOL[dtype], normalised_error(want, exact))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_prefill_attention_matches_reference(isa, dtype, block_size):
    """Mixed requests: a prefill from 0, a decode step, a chunk over a long context, an idle request, a chunk
    over a short one; runs of positions across blocks and split over the threads."""
    args = _prefill_case(dtype, [50, 1, 300, 7, 40], [50, 1, 5, 0, 12], heads=5, L=64, R=16, block_size=block_size)
    _check_prefill(args, 80**-0.5, dtype)


@pytest.mark.parametrize("amx", [True, False], ids=["amx-allowed", "amx-off"])
def test_prefill_bf16_engines_at_v2_lite_dims(isa, amx, monkeypatch):
    """V2-Lite dims (16 heads, 512 + 64) over 64-token blocks: a chunk of 64 tokens over 700 cached and a
    130-token prompt, on each bf16 tile engine this CPU has."""
    if not amx:
        monkeypatch.setenv(native_cpu.ENV_AMX, "0")
    args = _prefill_case(torch.bfloat16, [700, 130], [64, 130], heads=16, L=512, R=64, block_size=64, seed=1)
    assert native_cpu.attention_engine(args[0], args[2], args[3]) == _expected_bf16_engine(isa, amx)
    _check_prefill(args, 192**-0.5, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("token", [650, 740])
def test_expanded_prefill_unattended_poison_never_leaks(isa, dtype, poison, token, monkeypatch):
    """mha_prefill_attention over several key blocks (512) and query blocks (256): a NaN/inf key and value of
    one head at a new token inside a key block that the tokens before it also read (their masked keys;
    token 740's block, keys 1024 .. 1067 of the query block from token 512, is one that its first 212 rows
    see none of): the other head and the other request get the clean output bit for bit, the tokens before
    it the formula's output (the block's P . V then adds their visible keys one by one: the rounding differs
    from the GEMM's), and the tokens that see it NaN/inf in that head. With the AMX engine off, so that the
    native kernel serves bf16 on AMX CPUs too (there it otherwise leaves bf16 to ATen's AMX flash kernel)."""
    monkeypatch.setenv(native_cpu.ENV_AMX, "0")
    g = torch.Generator().manual_seed(5)
    q_lens, k_lens = [800, 9], [1100, 9]
    q = torch.randn(sum(q_lens), 2, 24, generator=g).to(dtype)
    k = torch.randn(sum(k_lens), 2, 24, generator=g).to(dtype)
    v = torch.randn(sum(k_lens), 2, 16, generator=g).to(dtype)
    starts = (torch.tensor([0, 800, 809]), torch.tensor([0, 1100, 1109]))
    bound = CASES["mha_prefill_attention"].bound("reference", dtype)
    want = mha_prefill_attention_oracle(q, k, v, *starts, 0.2)[0]
    clean = native("mha_prefill_attention", q, k, v, *starts, 0.2)
    assert normalised_error(clean, want) <= bound
    k[300 + token, 1], v[300 + token, 1] = poison, poison  # request 0's new token (after 300 context keys)
    got = native("mha_prefill_attention", q, k, v, *starts, 0.2)
    assert torch.equal(got[:, 0], clean[:, 0]) and torch.equal(got[800:], clean[800:])
    assert normalised_error(got[:token, 1], want[:token, 1]) <= bound
    assert not bool(got[token:800, 1].isfinite().any())


def test_prefill_of_many_heads_runs_in_groups_of_rows(isa):
    """128 heads x 512: a group holds 2**24 / (128 * 514) = 255 rows of fp32 partials, so a 300-token prompt
    runs in two groups."""
    args = _prefill_case(torch.float32, [300], [300], heads=128, L=512, R=64, block_size=64, seed=2)
    _check_prefill(args, 192**-0.5, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_prefill_of_one_token_per_request_is_decode_bit_for_bit(isa, dtype):
    """One query token per request: the same entries, tiles and thread split as decode, so the same bits."""
    q_latent, q_pe, key_cache, value_cache, tables, seq_lens, starts = _prefill_case(
        dtype, [5, 300, 1, 64], [1, 1, 1, 1], heads=5, L=64, R=16, block_size=16, seed=3)
    got = native("mla_prefill_attention", q_latent, q_pe, key_cache, value_cache, tables, seq_lens, starts, 0.1)
    want = native("mla_decode_attention", q_latent, q_pe, key_cache, value_cache, tables, seq_lens, 0.1)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_prefill_unattended_poison_never_leaks(isa, dtype, poison):
    """NaN/inf at a token's later positions (this call's later tokens), past a request's length and in
    blocks no request uses: the tokens that do not attend them are unchanged bit for bit."""
    block_size, seq_lens, q_lens = 4, [10, 7], [6, 7]
    args = _prefill_case(dtype, seq_lens, q_lens, heads=3, L=32, R=16, block_size=block_size, seed=4)
    q_latent, q_pe, key_cache, value_cache, tables, lens, starts = args
    clean = native("mla_prefill_attention", *args, 0.1)
    attended = torch.zeros(key_cache.shape[:2], dtype=torch.bool)
    for b, n in enumerate(seq_lens):
        for t in range(n):
            attended[int(tables[b, t // block_size]), t % block_size] = True
    key_cache[~attended], value_cache[~attended] = poison, poison
    block, offset = int(tables[0, 9 // block_size]), 9 % block_size  # request 0's last token, position 9
    key_cache[block, offset], value_cache[block, offset] = poison, poison
    poisoned = native("mla_prefill_attention", *args, 0.1)
    assert torch.equal(poisoned[:5], clean[:5])  # request 0's tokens at positions 4..8
    assert torch.equal(poisoned[6:], clean[6:])  # request 1
    if poison != poison:
        assert bool(poisoned[5].isnan().all())


def test_prefill_attention_float64_and_strided_caches_are_served_by_the_reference(isa):
    args = _prefill_case(torch.float32, [20, 3], [4, 3], heads=2, L=16, R=8, block_size=4)
    strided = (*args[:2], args[2].transpose(1, 3).contiguous().transpose(1, 3), *args[3:])  # last dim stride > 1
    assert strided[2].stride(3) != 1
    as_double = tuple(a.double() if a.is_floating_point() else a for a in args)
    for call, reason in [(strided, "the caches' last dim must be unit-stride for the native prefill attention kernel"),
                         (as_double, "torch.float64 is not served by the native kernels")]:
        expected = torch.ops.mla.mla_prefill_attention(*call, 0.1)  # the reference (this file's default)
        with mla_ops.use_backend("auto"):
            assert f"not cpu_native: {reason}" in mla_ops.explain("mla_prefill_attention", *call, 0.1)
            assert torch.equal(torch.ops.mla.mla_prefill_attention(*call, 0.1), expected)


def test_prefill_bad_values_same_error(isa):
    args = _prefill_case(torch.float32, [20, 3], [4, 3], heads=2, L=16, R=8, block_size=4)
    for bad in ({5: torch.tensor([20, 2], dtype=torch.int32)},  # fewer cached tokens than query tokens
                {4: args[4].index_fill(1, torch.tensor([1]), 99)}):  # a block id outside the pool
        call = tuple(bad.get(i, a) for i, a in enumerate(args))
        with pytest.raises(ValueError) as expected:
            torch.ops.mla.mla_prefill_attention(*call, 0.1)
        with pytest.raises(ValueError) as got:
            native("mla_prefill_attention", *call, 0.1)
        assert str(got.value) == str(expected.value)


# ------------------------------------------------------------------- DeepSeek-V4: shared-KV attention


def _blocks_of(rows, block_size, g, *, first=0):
    """Distinct random block ids for row ranges: a table [B, max columns + 1] (-1 padded) whose row b
    addresses rows 0 .. rows[b] - 1, with columns before `first[b] // block_size` left -1 (never read),
    and the pool's block count (the blocks addressed plus 2 spare)."""
    first = first if isinstance(first, list) else [first] * len(rows)
    need = [-(-n // block_size) for n in rows]
    kept = [range(f // block_size if n else 0, c) for f, n, c in zip(first, rows, need)]
    num_blocks = sum(len(k) for k in kept) + 2
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(rows), max(need, default=0) + 1), -1, dtype=torch.int32)
    used = 0
    for b, columns in enumerate(kept):
        tables[b, columns.start:columns.stop] = perm[used : used + len(columns)].to(torch.int32)
        used += len(columns)
    return tables, num_blocks


def _shared_kv_case(dtype, seq_lens, q_lens, *, heads, dim=512, window=128, block_size=64, ratio=None,
                    entry_block_size=64, topk=None, sinks=True, seed=0):
    """The arguments of mla.shared_kv_attention: random pools whose window tables hold only the blocks a
    request's query tokens read (the columns before its first window are -1: freed blocks); with
    `ratio`, seq_lens // ratio compressed entries per request in a second pool, all visible ones attended
    (topk None) or `topk` listed per token: distinct visible entries in a random order, -1 mixed in and
    the first repeated (attended twice). Positional, with every optional argument given."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.tensor([0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    firsts = [max(0, n - q - window + 1) for n, q in zip(seq_lens, q_lens)]
    tables, num_blocks = _blocks_of(seq_lens, block_size, g, first=firsts)
    kv_cache = torch.randn(num_blocks, block_size, 1, dim, generator=g).to(dtype)
    positions = _token_positions(torch.tensor(seq_lens), starts)
    q = torch.randn(len(positions), heads, dim, generator=g).to(dtype)
    sink_logits = torch.randn(heads, generator=g) * 1.5 if sinks else None
    args = [q, kv_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), starts, sink_logits, dim**-0.5, window,
            None, None, 1, None]
    if ratio is not None:
        entries = [n // ratio for n in seq_lens]
        entry_tables, entry_blocks = _blocks_of(entries, entry_block_size, g)
        args[8:11] = [torch.randn(entry_blocks, entry_block_size, 1, dim, generator=g).to(dtype), entry_tables, ratio]
        if topk is not None:
            listed = torch.full((len(positions), topk), -1, dtype=torch.int32)
            for t, (_, p) in enumerate(positions):
                picked = torch.randperm((p + 1) // ratio, generator=g)[: max(topk - 2, 0)]
                listed[t, : picked.shape[0]] = picked
                if picked.numel():
                    listed[t, -1] = picked[0]
                listed[t] = listed[t, torch.randperm(topk, generator=g)]
            args[11] = listed
    return tuple(args)


def _shared_kv_exact(*args):
    """The reference kernel in fp64: the exact attention, to judge both kernels by."""
    return torch.ops.mla.shared_kv_attention(*(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point()
                                               else a for a in args))


def _check_shared_kv_accuracy(out, ref, exact, dtype):
    """As `_check_decode_accuracy`, with more fp32 slack for 512-dim rows: the AVX2 and portable fp32
    engine (heads in the lanes) sums each score's 512 products in one chain, where ATen's GEMM sums them
    in blocks, so its fp32 scores, and outputs, land up to ~8 ulps further from the exact ones (the case
    database's fp32 bound is 64)."""
    err = (out.double() - exact).abs().max().item()
    ref_err = (ref.double() - exact).abs().max().item()
    ulp = torch.finfo(dtype).eps * max(1.0, exact.abs().max().item())
    assert err <= ref_err + (16 if dtype == torch.float32 else 1) * ulp, (err, ref_err)
    assert err <= _DECODE_TOL[dtype], err


SHARED_KV_MODES = {
    # DeepSeek-V4-Flash: sliding window 128; CSA entries every 4 tokens, 512 of them listed; HCA every 128
    "window-only": dict(seq_lens=[3000], ratio=None),
    "csa-512-listed": dict(seq_lens=[8192], ratio=4, topk=512),
    "hca-all-512-visible": dict(seq_lens=[65536], ratio=128),
}


# (dtype, AMX allowed): bf16 on each tile engine the CPU has, fp32 and fp16 on the fp32 engine
SHARED_KV_ENGINES = {"bfloat16-amx-allowed": (torch.bfloat16, True), "bfloat16-amx-off": (torch.bfloat16, False),
                     "float32": (torch.float32, True), "float16": (torch.float16, True)}


@pytest.mark.parametrize("engine", list(SHARED_KV_ENGINES))
@pytest.mark.parametrize("q_len", [1, 16], ids=["decode", "prefill-chunk"])
@pytest.mark.parametrize("mode", list(SHARED_KV_MODES))
def test_shared_kv_at_v4_flash_dims(isa, mode, q_len, engine, monkeypatch):
    """DeepSeek-V4-Flash's attention (head_dim 512, window 128; 64 heads decoding one token, 16 for a
    prefill chunk, plus a second request decoding next to it) on each tile engine the CPU has: never
    less accurate than the reference against the fp64 result (within one output ulp; fp32 within a few),
    bf16 on the engine the decode kernel would pick."""
    dtype, amx = SHARED_KV_ENGINES[engine]
    if not amx:
        monkeypatch.setenv(native_cpu.ENV_AMX, "0")
    spec = dict(SHARED_KV_MODES[mode])
    seq_lens = [spec.pop("seq_lens")[0] + q_len - 1, 700]
    args = _shared_kv_case(dtype, seq_lens, [q_len, 1], heads=64 if q_len == 1 else 16, seed=q_len, **spec)
    if dtype == torch.bfloat16:
        assert native_cpu.attention_engine(args[0], args[1], args[1][..., :0]) == _expected_bf16_engine(isa, amx)
    got = native("shared_kv_attention", *args)
    want = torch.ops.mla.shared_kv_attention(*args)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    _check_shared_kv_accuracy(got, want, _shared_kv_exact(*args), dtype)


@pytest.mark.parametrize("amx", [True, False], ids=["amx-allowed", "amx-off"])
def test_shared_kv_output_is_the_fp32_result_rounded_once(isa, amx, monkeypatch):
    """The weights stay fp32 through P . rows (the bf16 engines add each weight's bf16 rounding back in a
    second product): with positive rows in [1, 2) every bf16 output is the exact result rounded to
    nearest, to within what fp32 sums lose (a kernel that rounded the weights to bf16 would be off by
    up to 2^-9 more, past the half-ulp bound on some of these 64 heads x 512 dims)."""
    if not amx:
        monkeypatch.setenv(native_cpu.ENV_AMX, "0")
    args = list(_shared_kv_case(torch.bfloat16, [2000, 300], [1, 1], heads=64, ratio=4, topk=256, sinks=False,
                                seed=5))
    for i in (1, 8):  # rows of both pools in [1, 2) (no sinks: weights summing to 1): bf16 spacing 2^-7
        rows = torch.rand(args[i].shape, generator=torch.Generator().manual_seed(i))
        args[i] = (1 + 0.99 * rows).to(torch.bfloat16)
    args[0] = args[0] * 4  # peaked weights: a few rows carry most of each output
    got = native("shared_kv_attention", *args).double()
    exact = _shared_kv_exact(*args)
    assert bool(((exact >= 1) & (exact < 2)).all())
    bound = 2.0**-8 + 1e-5  # half the spacing, plus fp32's share
    assert (got - exact).abs().max().item() <= bound
    assert (torch.ops.mla.shared_kv_attention(*args).double() - exact).abs().max().item() <= bound


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("mode", ["window", "listed", "all-visible"])
def test_shared_kv_split_over_threads(isa, threads, mode):
    """Prefill from 0, a chunk, decode steps and an idle request in one call, their entries cut into one
    slice per thread and merged (with the sinks) per head: every split within fp32 rounding of the fp64
    result; a NaN in the row only the last token of request 0 reads makes that token's output NaN and
    leaves every other token's bits alone."""
    ratio, topk = {"window": (None, None), "listed": (4, 24), "all-visible": (4, None)}[mode]
    seq_lens, q_lens = [170, 300, 41, 90, 7], [170, 1, 20, 1, 0]
    args = _shared_kv_case(torch.float32, seq_lens, q_lens, heads=5, dim=48, window=32, block_size=16, ratio=ratio,
                           entry_block_size=5, topk=topk, seed=7)
    exact = _shared_kv_exact(*args)
    poisoned = list(args)
    poisoned[1] = args[1].clone()
    poisoned[1][int(args[2][0, (170 - 1) // 16]), (170 - 1) % 16, 0, 3] = float("nan")  # position 169
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = native("shared_kv_attention", *args)
        bad = native("shared_kv_attention", *poisoned)
    finally:
        torch.set_num_threads(previous)
    assert (out.double() - exact).abs().max().item() < 1e-5
    assert bad[169].isnan().all()
    assert torch.equal(bad[:169], out[:169]) and torch.equal(bad[170:], out[170:])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("mode", ["listed", "all-visible"])
def test_shared_kv_unattended_poison_never_leaks(isa, dtype, poison, mode):
    """NaN/inf in every row no token attends — window rows before or past every window, spare blocks,
    entries not listed or not yet visible, the slots past the last entry — leaves the output bit for bit
    unchanged."""
    seq_lens, q_lens, window, bs, ebs, ratio = [45, 30, 17], [3, 1, 17], 6, 4, 3, 2
    args = _shared_kv_case(dtype, seq_lens, q_lens, heads=4, dim=64, window=window, block_size=bs, ratio=ratio,
                           entry_block_size=ebs, topk=5 if mode == "listed" else None, seed=11)
    clean = native("shared_kv_attention", *args)
    read_rows = torch.zeros(args[1].shape[:2], dtype=torch.bool)
    read_entries = torch.zeros(args[8].shape[:2], dtype=torch.bool)
    for t, (b, p) in enumerate(_token_positions(torch.tensor(seq_lens), args[4])):
        for j in range(max(0, p - window + 1), p + 1):
            read_rows[int(args[2][b, j // bs]), j % bs] = True
        listed = range((p + 1) // ratio) if args[11] is None else [int(w) for w in args[11][t] if w >= 0]
        for w in listed:
            read_entries[int(args[9][b, w // ebs]), w % ebs] = True
    poisoned = list(args)
    poisoned[1], poisoned[8] = args[1].clone(), args[8].clone()
    poisoned[1][~read_rows] = poison
    poisoned[8][~read_entries] = poison
    assert torch.equal(native("shared_kv_attention", *poisoned), clean)


def test_shared_kv_sinks(isa):
    """Sinks of -inf are no sinks (bit for bit); a sink far above every logit leaves a small output, as the
    fp64 result does; a NaN or +inf sink makes its head's output NaN, as the reference's softmax does, and
    leaves the other heads alone; sinks in q's dtype are their fp32 values."""
    args = list(_shared_kv_case(torch.bfloat16, [300, 20], [1, 4], heads=8, dim=64, window=16, block_size=16, ratio=4,
                                entry_block_size=8, seed=13))
    args[5] = None
    plain = native("shared_kv_attention", *args)
    args[5] = torch.full((8,), float("-inf"))
    assert torch.equal(native("shared_kv_attention", *args), plain)
    args[5] = torch.arange(-4.0, 4.0) * 0.75
    base = native("shared_kv_attention", *args)
    args[5] = args[5].to(torch.bfloat16)  # exact in bf16
    assert torch.equal(native("shared_kv_attention", *args), base)
    args[5] = torch.arange(-4.0, 4.0) * 0.75
    args[5][7] = 40.0
    dominant = native("shared_kv_attention", *args)
    assert normalised_error(dominant[:, 7], _shared_kv_exact(*args)[:, 7]) <= 2 * 2.0**-7
    assert torch.equal(dominant[:, :7], base[:, :7])
    for value in (float("nan"), float("inf")):
        args[5][2] = value
        got, want = native("shared_kv_attention", *args), torch.ops.mla.shared_kv_attention(*args)
        assert got[:, 2].isnan().all() and want[:, 2].isnan().all()
        assert torch.equal(got[:, :2], base[:, :2]) and torch.equal(got[:, 3:7], base[:, 3:7])


def test_shared_kv_extreme_windows_and_ratios(isa):
    """A window and a compress ratio near 2**63 (every position in the window; no entry visible) and a
    window of one row (the token itself): the same attention as the windows and entries they stand for."""
    args = list(_shared_kv_case(torch.float32, [40, 9], [3, 1], heads=3, dim=32, window=64, block_size=8, ratio=4,
                                entry_block_size=4, seed=17))
    whole = native("shared_kv_attention", *args)
    assert torch.equal(native("shared_kv_attention", *args[:7], 2**63 - 1, *args[8:]), whole)
    no_entries = native("shared_kv_attention", *args[:8])
    assert torch.equal(native("shared_kv_attention", *args[:10], 2**63 - 1, None), no_entries)
    itself = native("shared_kv_attention", *args[:7], 1)
    assert (itself.double() - _shared_kv_exact(*args[:7], 1)).abs().max().item() < 1e-5


SHARED_KV_BAD = {
    "window-block-read-is-freed": lambda a: a[2].__setitem__((0, (40 - 3 - 4 + 1) // 8), -1),
    "window-block-past-pool": lambda a: a[2].__setitem__((1, 0), 10**6),
    "seq-len-past-capacity": lambda a: a[3].__setitem__(1, 10**4),
    "fewer-tokens-than-queries": lambda a: a[3].__setitem__(0, 2),
    "listed-entry-not-visible": lambda a: a[11].__setitem__((1, 0), 10),
    "listed-entry-near-2**63": lambda a: a.__setitem__(11, a[11].long().index_fill(1, torch.tensor([2]), 2**63 - 1)),
    "listed-entry-block-freed": lambda a: a[9].__setitem__((0, 0), -1),
    "visible-entry-block-freed": lambda a: (a.__setitem__(11, None), a[9].__setitem__((1, 0), -1)),
}


@pytest.mark.parametrize("case", list(SHARED_KV_BAD))
def test_shared_kv_bad_values_same_error(isa, case):
    """Index values the CPU refuses: the reference's ValueError, word for word."""
    args = list(_shared_kv_case(torch.float32, [40, 9], [3, 1], heads=2, dim=16, window=4, block_size=8, ratio=4,
                                entry_block_size=2, topk=3, seed=19))
    args[11][:, 0] = 0  # every token lists entry 0 (each sees at least 2)
    SHARED_KV_BAD[case](args)
    with pytest.raises(ValueError) as expected:
        torch.ops.mla.shared_kv_attention(*args)
    with pytest.raises(ValueError) as got:
        native("shared_kv_attention", *args)
    assert str(got.value) == str(expected.value)


def test_shared_kv_float64_and_strided_pools_are_served_by_the_reference(isa):
    args = _shared_kv_case(torch.float32, [20], [2], heads=2, dim=16, window=4, block_size=4, ratio=2,
                           entry_block_size=4, seed=23)
    strided = list(args)
    strided[8] = args[8].transpose(1, 3).contiguous().transpose(1, 3)  # last dim stride 4
    as_double = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    for call, reason in [(strided, "the pools' last dim (kv_cache, compressed_cache) must be unit-stride"),
                         (as_double, "torch.float64 is not served by the native kernels")]:
        expected = torch.ops.mla.shared_kv_attention(*call)  # the reference (this file's default)
        with mla_ops.use_backend("auto"):
            assert f"not cpu_native: {reason}" in mla_ops.explain("shared_kv_attention", *call)
            assert torch.equal(torch.ops.mla.shared_kv_attention(*call), expected)


def test_shared_kv_long_prefill_runs_in_groups_of_rows(isa):
    """A prefill of 600 tokens x 128 heads x 512 dims: more rows than one group's fp32 partials hold (255
    rows of 128 x 514 floats in 64 MiB), so the rows run in three groups, each over its own entries."""
    args = _shared_kv_case(torch.float32, [600, 50], [600, 1], heads=128, window=8, block_size=16, ratio=16,
                           entry_block_size=8, seed=37)
    got = native("shared_kv_attention", *args)
    _check_shared_kv_accuracy(got, torch.ops.mla.shared_kv_attention(*args), _shared_kv_exact(*args), torch.float32)


def test_shared_kv_empty_calls(isa):
    """No query token, and a listed width of 0 (only the window)."""
    args = _shared_kv_case(torch.bfloat16, [9, 6], [0, 0], heads=2, dim=32, window=4, block_size=4, ratio=2,
                           entry_block_size=4, topk=3, seed=29)
    assert native("shared_kv_attention", *args).shape == (0, 2, 32)
    args = _shared_kv_case(torch.bfloat16, [9, 6], [1, 2], heads=2, dim=32, window=4, block_size=4, ratio=2,
                           entry_block_size=4, topk=3, seed=29)
    no_list = native("shared_kv_attention", *args[:11], args[11][:, :0])
    assert torch.equal(no_list, native("shared_kv_attention", *args[:8]))


# ------------------------------------------------------------- DeepSeek-V4: the compressed indexer


@pytest.mark.parametrize("amx", [True, False], ids=["amx-allowed", "amx-off"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("q_len", [1, 64], ids=["decode", "prefill-chunk"])
@pytest.mark.parametrize("ratio", [4, 128])
def test_indexer_compressed_entries_random_floats_at_v4_dims(isa, ratio, q_len, dtype, amx, monkeypatch):
    """DeepSeek-V4's indexer (64 heads x 128, top-512) over compressed keys (one per `ratio` tokens): each
    token ranks the entries w < (p + 1) // ratio it sees, the native top-k equal to the reference's but
    for entries whose exact score lies within a relative 1e-5 of the k-th, in descending score order,
    -1 past what it sees (the first tokens of a prefill from 0 see none)."""
    if not amx:
        monkeypatch.setenv(native_cpu.ENV_AMX, "0")
    topk, scale = 512, 128**-0.5
    entries = [700 + q_len // ratio, 300, 3]
    q_lens = [q_len, 1, 4 * ratio - 1]  # the last request: a prefill of all its tokens
    q, weights, k_cache, keys, tables, _, starts = _indexer_case(dtype, entries, q_lens, heads=64, dim=128,
                                                                 block_size=64, seed=ratio + q_len)
    seq_lens = torch.tensor([n * ratio + ratio - 1 for n in entries], dtype=torch.int32)  # n entries, a window open
    args = (q, weights, k_cache, tables, seq_lens, starts, topk, scale, ratio)
    got = native("lightning_indexer", *args)
    want = torch.ops.mla.lightning_indexer(*args)
    assert got.shape == want.shape and got.dtype == torch.int32
    for t, (b, p) in enumerate(_token_positions(seq_lens, starts)):
        seen = (p + 1) // ratio
        k = min(topk, seen)
        assert torch.equal(got[t, k:], torch.full_like(got[t, k:], -1))
        if k == 0:
            continue
        exact = torch.relu(scale * (q[t].double() @ keys[b][:seen].t())).t() @ weights[t].double()
        chosen = got[t, :k].long()
        assert len(set(chosen.tolist())) == k and int(chosen.min()) >= 0 and int(chosen.max()) < seen
        kth = exact.sort(descending=True).values[k - 1]
        near = (exact - kth).abs() <= 1e-5 * kth.abs()
        differ = torch.tensor(sorted(set(chosen.tolist()) ^ set(want[t, :k].long().tolist())), dtype=torch.long)
        assert bool(near[differ].all()), (t, differ[~near[differ]])
        ranked = exact[chosen]
        assert bool((ranked[1:] <= ranked[:-1] + 1e-5 * torch.maximum(ranked[:-1].abs(), kth.abs())).all())


def test_indexer_ratio_1_is_the_uncompressed_indexer(isa):
    """compress_ratio=1 (the default) is the indexer over one key per token, bit for bit."""
    q, weights, k_cache, _, tables, seq_lens, starts = _indexer_case(torch.bfloat16, [300, 40], [5, 1], heads=8,
                                                                     dim=64, block_size=16, seed=31)
    args = (q, weights, k_cache, tables, seq_lens, starts, 32, 0.125)
    assert torch.equal(native("lightning_indexer", *args, 1), native("lightning_indexer", *args))
    assert torch.equal(native("lightning_indexer", *args), torch.ops.mla.lightning_indexer(*args))


def test_indexer_ratio_near_2_63_sees_no_entry(isa):
    """A compress ratio past every length: no request holds an entry, every row is -1 (no block read)."""
    q, weights, k_cache, _, tables, seq_lens, starts = _indexer_case(torch.float32, [30, 4], [5, 1], heads=2, dim=16,
                                                                     block_size=8, seed=41)
    tables = torch.full_like(tables, -1)  # none is read
    args = (q, weights, k_cache, tables, seq_lens, starts, 4, 0.25, 2**63 - 1)
    got = native("lightning_indexer", *args)
    assert torch.equal(got, torch.full((6, 4), -1, dtype=torch.int32))
    assert torch.equal(got, torch.ops.mla.lightning_indexer(*args))


# ------------------------------------------------------------------ DeepSeek-V4: the query and K=V prologs
def _v4_prolog_case(dtype, B, S, *, hidden=64, lora=48, heads=3, head_dim=40, rope_dim=16, norm_dtype=torch.float32,
                    tables="batched", seed=0):
    """(q prolog args, kv prolog args, num_heads): weights at nn.Linear's scale; tables "batched" [B, S, R/2],
    "shared" [S, R/2], "broadcast" [1, S, R/2], or in the activation dtype ("activation", as stock passes them)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    x = rand(B, S, hidden)
    q_a, q_b = rand(lora, hidden, scale=hidden**-0.5), rand(heads * head_dim, lora, scale=lora**-0.5)
    kv_w = rand(head_dim, hidden, scale=hidden**-0.5)
    q_norm = (1 + 0.2 * torch.randn(lora, generator=g)).to(norm_dtype)
    kv_norm = (1 + 0.2 * torch.randn(head_dim, generator=g)).to(norm_dtype)
    angles = torch.randn(1 if tables in ("shared", "broadcast") else B, S, rope_dim // 2, generator=g) * 3
    cos, sin = angles.cos(), angles.sin()
    if tables == "shared":
        cos, sin = cos[0], sin[0]
    elif tables == "activation":
        cos, sin = cos.to(dtype), sin.to(dtype)
    return (x, q_a, q_norm, q_b, cos, sin), (x, kv_w, kv_norm, cos, sin), heads


def _assert_prologs_identical(q_args, kv_args, heads, eps=1e-6):
    got = native("shared_kv_q_prolog", *q_args, num_heads=heads, eps=eps)
    want = torch.ops.mla.shared_kv_q_prolog(*q_args, num_heads=heads, eps=eps)
    _assert_identical(got, want)
    _assert_identical((native("shared_kv_prolog", *kv_args, eps=eps),),
                      (torch.ops.mla.shared_kv_prolog(*kv_args, eps=eps),))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("norm_dtype", ["float32", "activation"])
@pytest.mark.parametrize("tables", ["batched", "shared", "broadcast", "activation"])
@pytest.mark.parametrize("B,S", [(1, 1), (2, 5), (3, 17)], ids=["decode", "batch", "prefill"])
def test_shared_kv_prologs_bit_identical(isa, dtype, norm_dtype, tables, B, S):
    """Both DeepSeek-V4 prologs, bit for bit the reference's (hence stock transformers'): norm weights in fp32 (as
    the stock model keeps them) or the activation dtype, every table layout the ops take, head and rotary dims
    that are no multiple of a vector (40 and 16)."""
    q_args, kv_args, heads = _v4_prolog_case(dtype, B, S, tables=tables,
                                             norm_dtype=torch.float32 if norm_dtype == "float32" else dtype)
    _assert_prologs_identical(q_args, kv_args, heads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("B,S", [(2, 1), (1, 6)], ids=["decode", "prefill"])
def test_shared_kv_prologs_at_v4_flash_dims(isa, dtype, B, S):
    """DeepSeek-V4-Flash's dims: hidden 4096, q_lora_rank 1024, 64 heads of 512 with a rotary tail of 64."""
    q_args, kv_args, heads = _v4_prolog_case(dtype, B, S, hidden=4096, lora=1024, heads=64, head_dim=512,
                                             rope_dim=64, seed=1)
    _assert_prologs_identical(q_args, kv_args, heads)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_shared_kv_prologs_split_over_threads(isa, threads):
    q_args, kv_args, heads = _v4_prolog_case(torch.bfloat16, 2, 33, hidden=256, lora=128, heads=8, head_dim=128,
                                             rope_dim=64, seed=2)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _assert_prologs_identical(q_args, kv_args, heads, eps=1e-5)
    finally:
        torch.set_num_threads(previous)


def test_shared_kv_prologs_strided_inputs_and_whole_row_rotation(isa):
    """A hidden state that is a column slice of a wider buffer, transposed weights, pair-major tables, and a rotary
    dim equal to the head dim (every channel rotated)."""
    q_args, kv_args, heads = _v4_prolog_case(torch.float32, 2, 4, head_dim=16, rope_dim=16, seed=3)
    x, q_a, q_norm, q_b, cos, sin = q_args
    wide = torch.cat([x, torch.randn(2, 4, 7)], dim=-1)[..., :64]
    strided = [wide, q_a.t().contiguous().t(), q_norm, q_b.t().contiguous().t(),
               cos.transpose(-1, -2).contiguous().transpose(-1, -2), sin]
    assert not strided[0].is_contiguous() and not strided[1].is_contiguous()
    _assert_prologs_identical(strided, (wide, kv_args[1].t().contiguous().t(), *kv_args[2:4], sin), heads)


@pytest.mark.parametrize("B,S", [(0, 3), (2, 0)])
def test_shared_kv_prologs_empty(isa, B, S):
    q_args, kv_args, heads = _v4_prolog_case(torch.bfloat16, B, S, tables="shared")
    _assert_prologs_identical(q_args, kv_args, heads)


def test_shared_kv_prologs_float64_is_served_by_the_reference(isa):
    q_args, kv_args, heads = _v4_prolog_case(torch.float64, 2, 3)
    with mla_ops.use_backend("auto"):
        calls = [("shared_kv_q_prolog", q_args, {"num_heads": heads}), ("shared_kv_prolog", kv_args, {})]
        for op, args, kwargs in calls:
            text = mla_ops.explain(op, *args, **kwargs)
            assert text.startswith(f"mla.{op}: reference") and "torch.float64 is not served" in text, text
            got = getattr(torch.ops.mla, op)(*args, **kwargs)
            with mla_ops.use_backend("reference"):
                want = getattr(torch.ops.mla, op)(*args, **kwargs)
            _assert_identical(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,))


# --------------------------------------------------------------------- DeepSeek-V4: the KV compressor
# (head_dim D, compress_ratio m, overlap) of DeepSeek-V4-Flash's compressors: CSA (two series of 512, m = 4),
# HCA (512, m = 128) and the CSA indexer's own compressor (two series of 128, m = 4)
V4_COMPRESSORS = {"csa": (512, 4, True), "hca": (512, 128, False), "indexer": (128, 4, True)}


class _Compressor:
    """One layer's compressor inputs for B requests: weights, rope tables, a state and an entry pool of
    random rows (what earlier calls left), shuffled entry blocks; `step(q_lens)` makes the kv / gate and
    request tensors of a call adding q_lens[b] tokens to request b."""

    def __init__(self, dtype, head_dim, ratio, overlap, *, batch=3, bias_dtype=torch.float32, rope_dim=None,
                 block_size=16, blocks_per_request=12, positions=2048, seed=0):
        self.g = torch.Generator().manual_seed(seed)
        self.dtype, self.head_dim, self.ratio, self.overlap = dtype, head_dim, ratio, overlap
        self.channels = 2 * head_dim if overlap else head_dim
        rope_dim = rope_dim or min(64, head_dim)
        self.bias = self.rand(ratio, self.channels, scale=2.0).to(bias_dtype)
        self.weight = (1 + 0.2 * torch.randn(head_dim, generator=self.g)).to(bias_dtype)
        self.cos, self.sin = self.rand(positions, rope_dim // 2), self.rand(positions, rope_dim // 2)
        self.state = self.rand(batch, 2 * ratio if overlap else ratio, 2, self.channels).to(dtype)
        num_blocks = batch * blocks_per_request + 2
        self.pool = self.rand(num_blocks, block_size, 1, head_dim).to(dtype)
        self.tables = torch.randperm(num_blocks, generator=self.g)[:batch * blocks_per_request].view(batch, -1).int()
        self.seq_lens = [0] * batch

    def rand(self, *shape, scale=1.0):
        return torch.randn(*shape, generator=self.g) * scale

    def step(self, q_lens):
        self.seq_lens = [n + q for n, q in zip(self.seq_lens, q_lens)]
        tokens = sum(q_lens)
        kv = self.rand(tokens, self.channels, scale=2.0).to(self.dtype)
        gate = self.rand(tokens, self.channels, scale=3.0).to(self.dtype)
        starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        return [kv, gate, self.bias, self.weight, self.cos, self.sin, self.state, self.pool, self.tables,
                torch.tensor(self.seq_lens, dtype=torch.int32), starts]

    def kwargs(self):
        return {"compress_ratio": self.ratio, "overlap": self.overlap}


def _compress_both(args, kwargs):
    """The reference's and the native kernel's (state, pool) after the call, each on its own copies."""
    results = []
    for run in (lambda a: torch.ops.mla.kv_compressor(*a, **kwargs), lambda a: native("kv_compressor", *a, **kwargs)):
        copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        run(copies)
        results.append((copies[6], copies[7]))
    return results


def _assert_bits_equal(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)), (
            (g.float() - w.float()).abs().max(), int((g != w).sum()))


def _compress_in_steps(compressor, steps, threads=None):
    """Runs `steps` (q_lens per call) through the reference and the native kernel, from the same state and
    pool, each call's results bit for bit equal; returns how many entries the calls wrote."""
    written = 0
    previous = threads and torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        for q_lens in steps:
            args = compressor.step(q_lens)
            want, got = _compress_both(args, compressor.kwargs())
            _assert_bits_equal(got, want)
            written += int((want[1] != compressor.pool).any(-1).sum())
            compressor.state.copy_(want[0])
            compressor.pool.copy_(want[1])
    finally:
        if threads:
            torch.set_num_threads(previous)
    return written


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("bias_dtype", ["float32", "activation"])
@pytest.mark.parametrize("compressor", list(V4_COMPRESSORS))
def test_kv_compressor_bit_identical_at_v4_flash_dims(isa, compressor, dtype, bias_dtype):
    """DeepSeek-V4-Flash's three compressors through a prefill, a chunk and decode steps of three requests
    (state carried between the calls): every call's state and entry pool bit for bit the reference's, with
    position_bias and the norm weight in fp32 (as the stock model keeps them) or in the activation dtype."""
    head_dim, ratio, overlap = V4_COMPRESSORS[compressor]
    c = _Compressor(dtype, head_dim, ratio, overlap, bias_dtype=torch.float32 if bias_dtype == "float32" else dtype,
                    seed=ratio + head_dim)
    if ratio == 128:
        steps = [(300, 130, 127), (1, 1, 1), (2, 0, 1), (1, 1, 1)]
    else:
        steps = [(37, 13, 5), (13, 1, 2), (1, 1, 1), (1, 1, 1), (1, 1, 1), (1, 1, 1), (9, 0, 4)]
    assert _compress_in_steps(c, steps) > 0


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("dims", [(512, 128, False), (512, 4, True), (96, 3, True), (40, 5, False), (64, 128, True)],
                         ids=["hca", "csa", "ragged-96", "ragged-40", "256-slots"])
def test_kv_compressor_split_over_threads(isa, dims, dtype, threads):
    """ATen's softmax and sum split their work over its threads in ways that change which exp and which
    summation order an element gets: the kernel follows them on 1, 2 and 3 threads (a lone window split
    along its channels, requests of many windows split along them, channels not a multiple of 64 whose
    columns ATen sums in other orders, 256 slots summed in chunks of chunks)."""
    head_dim, ratio, overlap = dims
    c = _Compressor(dtype, head_dim, ratio, overlap, block_size=8, blocks_per_request=64, positions=4096, seed=7)
    steps = [(5 * ratio + 1, ratio, 1), (1, ratio - 1, ratio + 2), (2 * ratio, 0, 4 * ratio - 2), (1, 1, 1)]
    assert _compress_in_steps(c, steps, threads=threads) > 0


@pytest.mark.parametrize("threads", [1, 2])
def test_kv_compressor_prefill_of_4096_tokens(isa, threads):
    """A prefill of 4096 tokens beside a short one: more windows (1025) than one batch of gates holds (1024 CSA
    windows), so they run in two batches."""
    c = _Compressor(torch.bfloat16, 512, 4, True, batch=2, block_size=64, blocks_per_request=20, positions=4200,
                    seed=5)
    assert _compress_in_steps(c, [(4096, 4), (1, 1)], threads=threads) == 1024 + 1


def test_kv_compressor_unread_poison_never_leaks(isa):
    """NaN in every state row the call does not read (rows of tokens before the windows it closes, other
    requests' rows) and in every pool slot it does not write: the entries are bit for bit the clean ones,
    the poisoned slots stay as they were."""
    c = _Compressor(torch.bfloat16, 64, 4, True, batch=2, block_size=4, blocks_per_request=6, seed=9)
    c.step((10, 6))  # positions 0..9 and 0..5 already seen
    # request 0: tokens 10..12 close entry 2 (Ca of tokens 4..7 and Cb of 8..9 from the state); request 1:
    # tokens 6..7 close entry 1 (Ca of 0..3 and Cb of 4..5 from the state)
    args = c.step((3, 2))
    clean_state, clean_pool = _compress_both(args, c.kwargs())[1]
    read_rows = {(0, p % 8) for p in range(4, 10)} | {(1, p % 8) for p in range(0, 6)}
    poisoned = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    for b in range(2):
        for row in range(8):
            if (b, row) not in read_rows:
                poisoned[6][b, row] = float("nan")
    written = (clean_pool != args[7]).any(-1)  # [blocks, block_size, 1]: the slots the call writes
    assert int(written.sum()) == 2
    poisoned[7][~written] = float("nan")
    native("kv_compressor", *poisoned, **c.kwargs())
    assert torch.equal(poisoned[7][written], clean_pool[written])
    assert bool(poisoned[7][~written].isnan().all())
    kept = [(b, p % 8) for b, ps in ((0, range(10, 13)), (1, range(6, 8))) for p in ps]
    for b, row in kept:
        assert torch.equal(poisoned[6][b, row], clean_state[b, row])


def test_kv_compressor_strided_and_aliased_arguments(isa):
    """Inputs of any strides (kv / gate columns of a wider projection, a transposed table, a state and a pool
    inside larger buffers with a strided last dim), and kv / gate that are views of the state the call
    writes (read in full first): the reference's results, written through the strides."""
    c = _Compressor(torch.float32, 32, 4, True, batch=2, block_size=4, blocks_per_request=6, rope_dim=16, seed=13)
    c.step((9, 5))
    kv, gate, bias, weight, cos, sin, state, pool, tables, lens, starts = c.step((4, 3))
    wide = torch.cat([kv, gate, torch.randn(7, 5)], dim=1)
    state_buffer = torch.randn(2, 8, 2, 64, 2)
    state_buffer[..., 0] = state
    pool_buffer = torch.randn(pool.shape[0], 4, 1, 32, 2)
    pool_buffer[..., 1] = pool
    cos_t = cos.t().contiguous().t()
    strided = [wide[:, :64], wide[:, 64:128], bias, weight, cos_t, sin, state_buffer[..., 0], pool_buffer[..., 1],
               tables, lens, starts]
    want = _compress_both([kv, gate, bias, weight, cos, sin, state, pool, tables, lens, starts], c.kwargs())[0]
    native("kv_compressor", *strided, **c.kwargs())
    _assert_bits_equal((strided[6], strided[7]), want)
    # kv / gate rows that are views of the state the call writes

    def aliased_call():
        copies = [a.clone() for a in (kv, gate, bias, weight, cos, sin, state, pool, tables, lens, starts)]
        copies[0], copies[1] = copies[6][0, :7, 0], copies[6][1, :7, 1]
        return copies

    reference, served = aliased_call(), aliased_call()
    torch.ops.mla.kv_compressor(*reference, **c.kwargs())
    native("kv_compressor", *served, **c.kwargs())
    _assert_bits_equal((served[6], served[7]), (reference[6], reference[7]))


COMPRESSOR_BAD = {
    "query-starts-not-from-0": lambda a: a.__setitem__(10, torch.tensor([1, 4, 7], dtype=torch.int32)),
    "query-starts-decrease": lambda a: a.__setitem__(10, torch.tensor([0, 5, 4], dtype=torch.int32)),
    "fewer-tokens-than-new": lambda a: a[9].__setitem__(1, 2),
    "entries-past-capacity": lambda a: a[9].__setitem__(0, 10**4),
    "seq-len-near-2**63": lambda a: a.__setitem__(9, a[9].long().index_fill(0, torch.tensor([1]), 2**63 - 1)),
    "rope-position-past-the-tables": lambda a: (a.__setitem__(4, a[4][:4]), a.__setitem__(5, a[5][:4])),
    "written-block-freed": lambda a: a[8].__setitem__((1, 0), -1),
    "written-block-past-pool": lambda a: a[8].__setitem__((0, 0), 10**6),
}


@pytest.mark.parametrize("case", list(COMPRESSOR_BAD))
def test_kv_compressor_bad_values_same_error_nothing_written(isa, case):
    """Index values the CPU refuses: the reference's ValueError word for word, the state and pool untouched."""
    c = _Compressor(torch.bfloat16, 32, 4, True, batch=2, block_size=4, blocks_per_request=6, positions=64, seed=17)
    args = c.step((9, 7))
    COMPRESSOR_BAD[case](args)
    with pytest.raises(ValueError) as expected:
        torch.ops.mla.kv_compressor(*args, **c.kwargs())
    state, pool = args[6].clone(), args[7].clone()
    with pytest.raises(ValueError) as got:
        native("kv_compressor", *args, **c.kwargs())
    assert str(got.value) == str(expected.value)
    assert torch.equal(args[6], state) and torch.equal(args[7], pool)


def test_kv_compressor_empty_calls(isa):
    """No new token (the values are still checked), and no request."""
    c = _Compressor(torch.bfloat16, 32, 4, False, batch=2, block_size=4, blocks_per_request=4, seed=19)
    c.step((6, 3))
    args = c.step((0, 0))
    want, got = _compress_both(args, c.kwargs())
    _assert_bits_equal(got, want)
    assert torch.equal(got[0], c.state) and torch.equal(got[1], c.pool)
    args[9][0] = -1
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = -1 is less than"):
        native("kv_compressor", *args, **c.kwargs())
    empty = [args[0], args[1], *args[2:6], args[6][:0], args[7], args[8][:0], args[9][:0], args[10][:1]]
    want, got = _compress_both(empty, c.kwargs())
    _assert_bits_equal(got, want)


def test_kv_compressor_float64_is_served_by_the_reference_and_explained(isa):
    c = _Compressor(torch.float64, 32, 4, True, batch=2, block_size=4, blocks_per_request=6, seed=23)
    args = c.step((9, 3))
    expected = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    torch.ops.mla.kv_compressor(*expected, **c.kwargs())
    with mla_ops.use_backend("auto"):
        text = mla_ops.explain("kv_compressor", *args, **c.kwargs())
        assert "not cpu_native: torch.float64 is not served by the native kernels" in text, text
        torch.ops.mla.kv_compressor(*args, **c.kwargs())
    _assert_bits_equal((args[6], args[7]), (expected[6], expected[7]))


# ------------------------------------------------------------------------------------------- opcheck


@pytest.fixture
def native_registered(isa):
    """cpu_native requested by name for the ops, with this fixture's ISA build."""
    with mla_ops.use_backend("cpu_native"):
        assert ("kv_prolog", "cpu", "cpu_native") in mla_ops.backends.serving_report()  # a demand: no fallback
        yield isa


# ------------------------------------------------------------------------------ on the dispatcher
def _python_frames_of_mla_ops(fn) -> list[str]:
    """The mla_ops functions Python enters while `fn()` runs."""
    import sys

    package = mla_ops.__file__.rsplit("/", 1)[0]
    entered = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            entered.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return entered


def _tiny_calls():
    q_latent, q_pe, key_cache, value_cache, tables, seq_lens = _pool_case(torch.float32, 16, [20, 7])
    key, value = torch.zeros(3, 1, L), torch.zeros(3, 1, R)
    slots = torch.tensor([5, -1, 40])
    prolog_args, prolog_kwargs = _prolog_case(torch.bfloat16, 1, 1)
    q, weights, k_cache, _, sparse_tables, sparse_lens, starts = _indexer_case(torch.float32, [40, 9], [3, 1], heads=4,
                                                                                 dim=16, block_size=16)
    sparse = _sparse_case(torch.float32, sparse_tables, sparse_lens, starts, topk=8, heads=4, L=32, R=8)
    shared_kv = _shared_kv_case(torch.float32, [40, 9], [3, 1], heads=4, dim=32, window=8, block_size=16, ratio=4,
                                entry_block_size=4, topk=4)
    compressor = _Compressor(torch.float32, 32, 4, True, batch=2, block_size=4, blocks_per_request=4)
    compressor_args = compressor.step((5, 1))
    v4_q_args, v4_kv_args, v4_heads = _v4_prolog_case(torch.bfloat16, 1, 1)
    return {
        "mla_decode_attention": lambda: torch.ops.mla.mla_decode_attention(
            q_latent, q_pe, key_cache, value_cache, tables, seq_lens, 0.1),
        "scatter_pa_kv_cache": lambda: torch.ops.mla.scatter_pa_kv_cache(key, value, key_cache, value_cache, slots),
        "gather_pa_kv_cache": lambda: torch.ops.mla.gather_pa_kv_cache(
            key_cache, value_cache, tables[:, :1], torch.tensor([3, 0]), key, value),
        "gather_pa_kv_cache_functional": lambda: torch.ops.mla.gather_pa_kv_cache_functional(
            key_cache, value_cache, tables[:, :1], torch.tensor([3, 0]), key, value),
        "kv_prolog": lambda: torch.ops.mla.kv_prolog(*prolog_args, **prolog_kwargs),
        "latent_kv_prolog": lambda: torch.ops.mla.latent_kv_prolog(*prolog_args[:4], *prolog_args[5:]),
        "scatter_pa_cache": lambda: torch.ops.mla.scatter_pa_cache(key, key_cache, slots),
        "rms_norm": lambda: torch.ops.mla.rms_norm(prolog_args[0], torch.ones(prolog_args[0].shape[-1]), 1e-6),
        "lightning_indexer": lambda: torch.ops.mla.lightning_indexer(
            q, weights, k_cache, sparse_tables, sparse_lens, starts, 8, 0.25),
        "sparse_mla_attention": lambda: torch.ops.mla.sparse_mla_attention(*sparse, 0.1),
        "mla_prefill_attention": lambda: torch.ops.mla.mla_prefill_attention(*sparse[:7], 0.1),
        "mha_prefill_attention": lambda: torch.ops.mla.mha_prefill_attention(
            key[:1], key, value, torch.tensor([0, 1]), torch.tensor([0, 3]), 0.25),
        "shared_kv_attention": lambda: torch.ops.mla.shared_kv_attention(*shared_kv),
        "kv_compressor": lambda: torch.ops.mla.kv_compressor(*compressor_args, **compressor.kwargs()),
        "shared_kv_q_prolog": lambda: torch.ops.mla.shared_kv_q_prolog(*v4_q_args, num_heads=v4_heads),
        "shared_kv_prolog": lambda: torch.ops.mla.shared_kv_prolog(*v4_kv_args),
    }


def test_every_dispatcher_op_has_a_tiny_call(isa):
    """The no-Python test below, and the benchmark's fixed cost of a call, cover every op the extension
    serves from the dispatcher."""
    from mla_ops.bench.native import tiny_arguments

    assert set(_tiny_calls()) == set(native_cpu.NATIVE_OPS)
    assert set(tiny_arguments()) == set(native_cpu.NATIVE_OPS)


def test_the_benchmarks_entry_floor_twins_do_no_work():
    """`mla-ops bench ops` times every op's schema on a do-nothing C++ kernel (torch's own entry from
    Python): each twin returns its first tensor argument for every output and writes nothing, and the
    native kernel serves the op's real tiny call (the benchmark demands the cpu_native backend, which
    refuses a call it cannot serve), so the two columns time the same arguments."""
    from mla_ops.bench.native import ENTRY_FLOOR_NAMESPACE, entry_floor_calls, tiny_arguments

    entry_floor_calls()  # defines and binds the twins
    for name, (args, kwargs) in tiny_arguments().items():
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        before = [t.clone() for t in tensors]
        outputs = getattr(getattr(torch.ops, ENTRY_FLOOR_NAMESPACE), name)(*args, **kwargs)
        outputs = () if outputs is None else outputs if isinstance(outputs, tuple) else (outputs,)
        assert len(outputs) == len(getattr(torch.ops.mla, name).default._schema.returns), name
        assert all(o.data_ptr() == tensors[0].data_ptr() for o in outputs), name
        assert all(torch.equal(t, b) for t, b in zip(tensors, before)), name
        with torch.no_grad(), mla_ops.use_backend("cpu_native"):
            getattr(torch.ops.mla, name)(*args, **kwargs)


@pytest.mark.parametrize("op", list(_tiny_calls()))
@pytest.mark.parametrize("grad_mode", ["no_grad", "grad enabled, no input requires grad"])
def test_a_native_call_runs_no_python_of_the_package(isa, op, grad_mode):
    """With cpu_native the automatic choice, `torch.ops.mla.<op>` on CPU tensors goes from the dispatcher
    to the C++ kernel: no Python frame of mla_ops (check, chooser, autograd wrapper) on the way."""
    call = _tiny_calls()[op]
    with mla_ops.use_backend("auto"):
        with torch.no_grad() if grad_mode == "no_grad" else torch.enable_grad():
            call()  # first call: lazy initialisation is not the steady state
            assert _python_frames_of_mla_ops(call) == []


def test_a_call_the_native_kernel_cannot_serve_goes_to_the_reference_kernel(isa):
    """float64 is not served natively: the C++ kernel hands the call to the reference (Python) kernel."""
    args = _pool_case(torch.float64, 16, [20, 7])
    expected = torch.ops.mla.mla_decode_attention(*args, 0.1)  # the reference (this file's default)
    with mla_ops.use_backend("auto"):
        frames = _python_frames_of_mla_ops(lambda: torch.ops.mla.mla_decode_attention(*args, 0.1))
        assert any("mla_decode_attention_reference" in f for f in frames), frames
        assert torch.equal(torch.ops.mla.mla_decode_attention(*args, 0.1), expected)


def test_a_demanded_native_backend_refuses_from_cpp_with_the_backend_layers_message(native_registered):
    args = _pool_case(torch.float64, 16, [20, 7])
    with pytest.raises(NotImplementedError) as refused:
        torch.ops.mla.mla_decode_attention(*args, 0.1)
    reason = ("torch.float64 is not served by the native kernels (float32, bfloat16, float16); the reference "
              "kernel serves it")
    expected = mla_ops.backends.refusal("mla_decode_attention", "cpu_native", reason)
    assert str(refused.value) == expected


def test_gradients_through_the_native_prolog_equal_the_reference(isa):
    """Inputs that require grad leave the C++ fast path for the op's autograd formula, whose forward is
    the native kernel again; gradients equal the reference's (fp32)."""
    args, kwargs = _prolog_case(torch.float32, 2, 3, bias=True)

    def grads():
        leaves = [a.detach().clone().requires_grad_(True) if a is not None else None for a in args[:5]]
        outs = torch.ops.mla.kv_prolog(*leaves, *args[5:], **kwargs)
        sum(o.square().sum() for o in outs).backward()
        return [leaf.grad for leaf in leaves if leaf is not None]

    expected = grads()  # reference
    with mla_ops.use_backend("auto"):
        got = grads()
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_the_native_write_ops_bump_the_version_of_what_they_write(isa):
    """What ADInplaceOrView does for ATen's in-place ops: autograd can tell a cache was modified."""
    key, value = torch.randn(2, 1, L), torch.randn(2, 1, R)
    key_cache, value_cache = torch.zeros(4, 16, 1, L), torch.zeros(4, 16, 1, R)
    before = (key_cache._version, value_cache._version)
    with mla_ops.use_backend("auto"), torch.no_grad():
        torch.ops.mla.scatter_pa_kv_cache(key, value, key_cache, value_cache, torch.tensor([0, 17]))
    assert key_cache._version > before[0] and value_cache._version > before[1]
    assert torch.equal(key_cache[1, 1], key[1])


def test_changing_the_backend_registers_nothing_and_takes_effect_at_the_next_call(isa):
    """The backend setting is read by the calls (the C++ kernel's route): switching it leaves the dispatcher's
    registrations as they are, and the same compiled-in kernel then serves, declines or refuses."""
    args = _pool_case(torch.float64, 16, [20, 7])
    dump = torch._C._dispatch_dump("mla::mla_decode_attention")
    with mla_ops.use_backend("cpu_native"):
        with pytest.raises(NotImplementedError, match="backend 'cpu_native' was requested"):
            torch.ops.mla.mla_decode_attention(*args, 0.1)
    with mla_ops.use_backend("auto"):
        expected = torch.ops.mla.mla_decode_attention(*args, 0.1)  # handed to the reference kernel
    assert torch.equal(torch.ops.mla.mla_decode_attention(*args, 0.1), expected)  # this file's default: reference
    assert torch._C._dispatch_dump("mla::mla_decode_attention") == dump
    assert "registration.cpp" in dump


def test_a_graph_compiled_under_one_backend_follows_the_setting_when_it_runs(isa):
    q_latent, q_pe, key_cache, value_cache, tables, seq_lens = _pool_case(torch.bfloat16, 16, [20, 7])

    @torch.compile(fullgraph=True, backend="eager")
    def decode(q_latent, q_pe):
        return torch.ops.mla.mla_decode_attention(q_latent, q_pe, key_cache, value_cache, tables, seq_lens, 0.1)

    reference = decode(q_latent, q_pe)  # compiled under this file's "reference"
    assert any("mla_decode_attention_reference" in f for f in _python_frames_of_mla_ops(lambda: decode(q_latent, q_pe)))
    with mla_ops.use_backend("auto"):
        served = decode(q_latent, q_pe)
        assert not any("mla_ops/_library.py" in f or "mla_ops/ops/" in f
                       for f in _python_frames_of_mla_ops(lambda: decode(q_latent, q_pe)))
    assert torch.equal(reference, torch.ops.mla.mla_decode_attention(q_latent, q_pe, key_cache, value_cache, tables,
                                                                       seq_lens, 0.1))
    assert torch.equal(served, native("mla_decode_attention", q_latent, q_pe, key_cache, value_cache, tables,
                                      seq_lens, 0.1))


@pytest.mark.filterwarnings("ignore:Warning only once for all operators")
def test_opcheck_native(native_registered):
    from torch.library import opcheck

    args, kwargs = _prolog_case(torch.bfloat16, 2, 3, bias=True)
    for op, a, k in [
        (torch.ops.mla.kv_prolog.default, args, dict(kwargs, rope_layout="half")),
        (torch.ops.mla.latent_kv_prolog.default, args[:4] + args[5:], {}),
    ]:
        result = opcheck(op, a, k, raise_exception=True)
        assert all(v == "SUCCESS" for v in result.values()), result
    dec = _pool_case(torch.bfloat16, 16, [20, 3])
    result = opcheck(torch.ops.mla.mla_decode_attention.default, dec + (0.1,), raise_exception=True)
    assert all(v == "SUCCESS" for v in result.values()), result
    key_cache, value_cache, tables, cum, _ = paged_case(12, 4, [5, 2])
    key, value = torch.zeros(7, 1, 16, dtype=key_cache.dtype), torch.zeros(7, 1, 8, dtype=key_cache.dtype)
    for op in (torch.ops.mla.gather_pa_kv_cache.default, torch.ops.mla.gather_pa_kv_cache_functional.default):
        result = opcheck(
            op,
            (key_cache, value_cache, tables, cum, key, value),
            {"is_seq_lens_cumsum": True},
            raise_exception=True,
        )
        assert all(v == "SUCCESS" for v in result.values()), result
    slots = torch.tensor([3, -1, 9, 10, 11, 40, 2])
    result = opcheck(
        torch.ops.mla.scatter_pa_kv_cache.default,
        (key, value, key_cache, value_cache, slots),
        raise_exception=True,
    )
    assert all(v == "SUCCESS" for v in result.values()), result
    # the registered kernel really is the native one: decode is not bit-equal to the reference's
    # bf16-rounded composition, but it is to the native function
    out = torch.ops.mla.mla_decode_attention(*dec, 0.1)
    assert torch.equal(out, native("mla_decode_attention", *dec, 0.1))


def test_reference_restored_after_the_native_binding():
    dec = _pool_case(torch.bfloat16, 16, [20, 3])
    from mla_ops.ops.decode_attention import mla_decode_attention_reference as reference

    assert torch.equal(torch.ops.mla.mla_decode_attention(*dec, 0.1), reference(*dec, 0.1))


def test_native_is_the_automatic_choice_on_cpu():
    with mla_ops.use_backend("auto"):
        bound = {(op, dev): who for op, dev, who in mla_ops.backends.serving_report()}
    assert bound[("gather_pa_kv_cache", "cpu")] == "cpu_native"  # it serves every call the op's check lets through
    assert bound[("scatter_pa_kv_cache", "cpu")] == "cpu_native"
    assert bound[("scatter_pa_cache", "cpu")] == "cpu_native"
    assert bound[("lightning_indexer", "cpu")] == "cpu_native or reference"
    assert bound[("sparse_mla_attention", "cpu")] == "cpu_native or reference"
    assert bound[("kv_prolog", "cpu")] == "cpu_native or reference"  # float64 goes to the reference


def test_large_gather_scatter_streaming_path(isa):
    """Calls over 24 MiB take the non-temporal-store path (x86 builds): still bit-exact, with rows of
    a split [NB, bs, 576] pool (1152-byte strides) and a partial tail block."""
    block_size, tokens = 16, 28 * 1024
    key_cache, value_cache = _split_pool(torch.bfloat16, tokens // block_size + 2, block_size, Lk=512, Rv=64)
    num_blocks = key_cache.shape[0]
    tables = torch.randperm(num_blocks)[: tokens // block_size].view(2, -1).int()
    lens = torch.tensor([tokens // 2, tokens // 2 - 5], dtype=torch.int32)
    key = torch.zeros(tokens, 1, 512, dtype=torch.bfloat16)
    value = torch.zeros(tokens, 1, 64, dtype=torch.bfloat16)
    rk, rv = key.clone(), value.clone()
    torch.ops.mla.gather_pa_kv_cache(key_cache, value_cache, tables, lens, rk, rv)
    native("gather_pa_kv_cache", key_cache, value_cache, tables, lens, key, value)
    assert torch.equal(key, rk) and torch.equal(value, rv)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    rkc, rvc = key_cache.clone(), value_cache.clone()
    torch.ops.mla.scatter_pa_kv_cache(key, value, rkc, rvc, slots)
    native("scatter_pa_kv_cache", key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, rkc) and torch.equal(value_cache, rvc)
