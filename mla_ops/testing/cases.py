"""The case database: for every `mla::` op, its sample inputs, its error inputs, its oracle and the
rounding bound each backend must meet against it.

One `OpCases` entry per op in `CASES` (PyTorch's OpInfo idea, none of its machinery). Everything that
exercises the ops draws from here: the generic test suites (tests/test_cases.py: opcheck, compile,
export, gradcheck, errors, every backend x op x sample against the oracle), `mla-ops selftest` and
the benchmarks' correctness checks. Adding an op means one entry here; every suite then covers it.

* samples(dtype) -> [Sample]: every layout, table shape, split-pool view, empty, zero-length and
  ragged case the op promises, on the CPU in that activation dtype.
* errors() -> [ErrorInput]: bad calls with the argument the message must name. RuntimeError ones
  are metadata checks (no host sync: raised eagerly and at trace time alike); ValueError ones are
  index values, checked on the host by every CPU kernel before anything is written.
* oracle: `mla_ops.testing.oracles`, the contract as plain float64 code.
* bounds: the largest normalised error (max |got - want| / max |want|) a kernel may have against the
  oracle, in units of the activation dtype's machine epsilon; 0 for the ops that only move data,
  which must be bit-exact. `backend_bounds` widens it for a backend whose arithmetic differs.
* paths: reference-kernel code paths other than the one CPU dispatch takes (the sync-free device
  path, run here on CPU tensors), checked against the same oracle.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Optional

import torch
from torch import Tensor

from .. import _library
from ..ops.decode_attention import decode_sync_free
from ..ops.gather_pa_kv_cache import gather_sync_free
from ..ops.kv_compressor import kv_compressor_sync_free
from ..ops.mha_prefill_attention import mha_prefill_attention_sdpa
from ..ops.mla_prefill_attention import mla_prefill_attention_sync_free
from ..ops.scatter_pa_kv_cache import scatter_pa_cache_sync_free, scatter_sync_free
from ..ops.shared_kv_attention import shared_kv_attention_sync_free
from ..ops.sparse_attention import INDEXER as INDEXER_OP
from ..ops.sparse_attention import SPARSE as SPARSE_OP
from ..ops.sparse_attention import lightning_indexer_sync_free, sparse_mla_attention_sync_free
from . import oracles
from .inputs import LITE, PREFILL, SMALL, Dims, paged_case, prolog_inputs, prolog_kwargs, rope_tables, split_pool

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the ops serve in inference
ALL_DTYPES = ACTIVATION_DTYPES + (torch.float64,)  # plus gradcheck's dtype (the reference kernels serve it)


@dataclasses.dataclass(frozen=True)
class Sample:
    """One call of an op: positional and keyword arguments (CPU tensors unless moved)."""

    name: str
    args: tuple
    kwargs: Mapping = dataclasses.field(default_factory=dict)
    # args -> args with the arguments that are views of another argument made again from it: a sample
    # whose input is a view of the cache the op writes keeps that aliasing through clone() and to()
    rebuild: Optional[Callable[[tuple], tuple]] = None

    def map(self, fn: Callable[[Tensor], Tensor]) -> "Sample":
        def apply(v):
            return fn(v) if isinstance(v, Tensor) else v
        args = tuple(apply(a) for a in self.args)
        if self.rebuild:
            rebuilt = self.rebuild(args)
            # a view made again from its base keeps the flag fn gave the mapped tensor
            args = tuple(r.requires_grad_(True) if isinstance(a, Tensor) and a.requires_grad and not r.requires_grad
                         else r for a, r in zip(args, rebuilt))
        return Sample(self.name, args, {k: apply(v) for k, v in self.kwargs.items()}, self.rebuild)

    def to(self, device) -> "Sample":
        return self.map(lambda t: t.to(device))

    def clone(self) -> "Sample":
        """Fresh copies of every tensor, keeping strides and requires_grad (ops that write in place
        get their own buffers)."""
        def copy(t):
            c = t.detach().clone()
            return c.requires_grad_(t.requires_grad) if t.is_floating_point() else c
        return self.map(copy)

    def detach(self) -> "Sample":
        return self.map(lambda t: t.detach())

    def tensors(self) -> list[Tensor]:
        return [v for v in (*self.args, *self.kwargs.values()) if isinstance(v, Tensor)]


@dataclasses.dataclass(frozen=True)
class ErrorInput:
    """A bad call and what its error must say."""

    name: str
    sample: Sample
    argument: str  # the argument the message names
    match: str  # regex the message matches
    error: type = RuntimeError  # RuntimeError: metadata (eager and compiled); ValueError: index values (eager)
    op_named: Optional[str] = None  # the op the message names, when not the one called (a twin sharing a check)


@dataclasses.dataclass(frozen=True)
class OpCases:
    op: str
    samples: Callable[[torch.dtype], list[Sample]]
    oracle: Callable
    errors: Callable[[], list[ErrorInput]]
    bounds: Mapping[torch.dtype, float]  # in units of finfo(dtype).eps; 0: bit-exact
    backend_bounds: Mapping[str, Mapping[torch.dtype, float]] = dataclasses.field(default_factory=dict)
    paths: Mapping[str, Callable] = dataclasses.field(default_factory=dict)
    selftest: tuple[str, ...] = ()  # sample names `mla-ops selftest` runs (DeepSeek-V2-Lite dims)
    # backends whose kernel promises each output row's entries, not their order (a vendor kernel
    # documented to return the top-k set): compared after sorting every row
    unordered_backends: tuple[str, ...] = ()
    # calls whose index values the host checks refuse (CPU kernels raise ValueError): what the unchecked
    # `paths` (the sync-free device path: no host sync, nothing validated) must still answer, the oracle's
    # result with every entry that addresses nothing taken as none, never reading out of bounds
    unchecked_samples: Callable[[torch.dtype], list[Sample]] = lambda dtype: []

    def comparable(self, backend: str, outputs) -> tuple[Tensor, ...]:
        """`outputs` as `backend`'s contract is checked: each row sorted for an unordered backend."""
        if backend not in self.unordered_backends:
            return tuple(outputs)
        return tuple(t.sort(dim=-1).values for t in outputs)

    @property
    def definition(self) -> _library.OpDef:
        return _library.OPS[self.op]

    def bound(self, backend: str, dtype: torch.dtype) -> float:
        """Largest normalised error allowed for `backend` against the oracle in `dtype`."""
        ulps = self.backend_bounds.get(backend, self.bounds).get(dtype, self.bounds[dtype])
        return ulps * torch.finfo(dtype).eps

    def samples_in(self, dtype: torch.dtype) -> tuple[Sample, ...]:
        """`samples(dtype)`, built once per process (callers that run them clone their tensors first)."""
        key = (self.op, dtype)
        if key not in _SAMPLE_CACHE:
            _SAMPLE_CACHE[key] = tuple(self.samples(dtype))
        return _SAMPLE_CACHE[key]

    def sample(self, dtype: torch.dtype, name: str) -> Sample:
        for s in self.samples_in(dtype):
            if s.name == name:
                return s
        raise KeyError(f"mla.{self.op} has no sample {name!r} in {dtype}")


_SAMPLE_CACHE: dict[tuple[str, torch.dtype], tuple[Sample, ...]] = {}


CASES: dict[str, OpCases] = {}


def _register(cases: OpCases) -> OpCases:
    if cases.op not in _library.OPS:
        raise RuntimeError(f"case database entry for mla.{cases.op}, which is not an op")
    CASES[cases.op] = cases
    return cases


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype, seed=0, scale=1.0) -> Tensor:
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype)


def _tables(dtype: torch.dtype, *shape_args, **kwargs):
    # fp32 tables for every activation dtype, as the rotary modules hand them over; fp64 under gradcheck
    return rope_tables(*shape_args, dtype=torch.promote_types(dtype, torch.float32), **kwargs)


def _eps_bounds(fp32: float, bf16: float, fp16: float, fp64: Optional[float] = None) -> dict:
    return {torch.float32: fp32, torch.bfloat16: bf16, torch.float16: fp16,
            torch.float64: fp32 if fp64 is None else fp64}


EXACT = _eps_bounds(0, 0, 0, 0)


# ------------------------------------------------------------------------------------------ rms_norm
def _rms_norm_samples(dtype):
    d = SMALL
    wide = _randn(d.B, d.S, 2 * d.L, dtype=dtype, seed=3)
    samples = [
        Sample("small", (_randn(d.B, d.S, d.L, dtype=dtype), 1 + 0.1 * _randn(d.L, dtype=dtype, seed=1), 1e-6)),
        Sample("v2lite", (_randn(1, 2, LITE.L, dtype=dtype), 1 + 0.1 * _randn(LITE.L, dtype=dtype, seed=1), 1e-6)),
        Sample("one-dim", (_randn(d.L, dtype=dtype), _randn(d.L, dtype=dtype, seed=1), 1e-5)),
        Sample("strided-view", (wide[..., : d.L], _randn(d.L, dtype=dtype, seed=1), 1e-6)),
        Sample("empty", (_randn(0, d.S, d.L, dtype=dtype), _randn(d.L, dtype=dtype, seed=1), 1e-6)),
    ]
    if dtype in (torch.bfloat16, torch.float16):  # transformers' norm: an fp32 weight promotes the output
        samples.append(Sample("fp32-weight", (_randn(d.B, d.S, d.L, dtype=dtype), 1 + 0.1 * _randn(d.L,
                                                                                                   dtype=torch.float32,
                                                                                                  seed=1), 1e-6)))
    return samples


def _rms_norm_errors():
    x = torch.randn(2, 3, 16)
    return [
        ErrorInput("weight-length", Sample("", (x, torch.randn(15), 1e-6)), "weight",
                   r"rms_norm: weight length must equal the last dim of x"),
        ErrorInput("weight-rank", Sample("", (x, torch.randn(4, 4), 1e-6)), "weight", r"rms_norm: weight must be 1-D"),
        ErrorInput("x-dtype", Sample("", (x.int(), torch.randn(16), 1e-6)), "x",
                   r"rms_norm: x must be float32, float16 or bfloat16"),
        ErrorInput("device", Sample("", (x, torch.randn(16, device="meta"), 1e-6)), "weight",
                   r"rms_norm: all tensors must be on one device"),
        ErrorInput("eps", Sample("", (x, torch.randn(16), -1.0)), "eps", r"rms_norm: eps must be >= 0"),
    ]


_register(OpCases("rms_norm", _rms_norm_samples, oracles.rms_norm_oracle, _rms_norm_errors,
                  # two roundings to the activation dtype (the normed value, then the product with weight)
                  bounds=_eps_bounds(8, 2, 2), selftest=("v2lite",)))


# ---------------------------------------------------------------------------------------------- rope
def _rope_samples(dtype):
    d = SMALL
    x = _randn(d.B, d.N, d.S, d.R, dtype=dtype)
    cos, sin = _tables(dtype, d.B, d.S, d.R, offset=5)
    shared = _tables(dtype, d.B, d.S, d.R, offset=5, batched=False)
    q = _randn(d.B, d.N, d.S, d.P + d.R, dtype=dtype, seed=2)
    lite_x = _randn(1, LITE.N, 2, LITE.R, dtype=dtype, seed=4)
    lite_tables = _tables(dtype, 1, 2, LITE.R, offset=100)
    samples = [Sample(f"{layout}", (x, cos, sin), {"layout": layout}) for layout in ("interleaved", "half", "neox")]
    samples += [
        Sample("tables-SR", (x, *shared), {"layout": "interleaved"}),
        Sample("tables-1SR", (x, cos[:1], sin[:1]), {"layout": "half"}),
        Sample("three-dim", (_randn(d.B, d.S, d.R, dtype=dtype, seed=3), cos, sin), {"layout": "half"}),
        Sample("strided-q_pe-view", (q[..., d.P:], cos, sin), {"layout": "interleaved"}),
        Sample("v2lite", (lite_x, *lite_tables), {"layout": "interleaved"}),
        Sample("v2lite-half", (lite_x, *lite_tables), {"layout": "half"}),
        Sample("empty-seq", (x[:, :, :0], cos[:, :0], sin[:, :0]), {"layout": "half"}),
    ]
    # rounded op for op in the activation dtype, as the stock rotate_half formulas compute it
    samples += [Sample(f"activation-{layout}", (x, cos, sin), {"layout": layout, "compute_dtype": "activation"})
                for layout in ("interleaved", "half", "neox")]
    samples.append(Sample("v2lite-activation-half", (lite_x, *lite_tables), {"layout": "half",
                                                                             "compute_dtype": "activation"}))
    return samples


def _rope_errors():
    cos, sin = rope_tables(2, 3, 8)
    x = torch.randn(2, 4, 3, 8)
    return [
        ErrorInput("odd-dim", Sample("", (torch.randn(2, 4, 3, 7), cos, sin)), "x",
                   r"rope: the rotary dim of x must be even"),
        ErrorInput("layout", Sample("", (x, cos, sin), {"layout": "gptj"}), "layout", r"rope: layout must be one of"),
        ErrorInput("seq", Sample("", (torch.randn(2, 4, 5, 8), cos, sin)), "cos", r"rope: cos sequence dim must equal"),
        ErrorInput("batch", Sample("", (torch.randn(3, 4, 3, 8), cos, sin)), "cos",
                   r"rope: cos batch dim must be 1 or 3"),
        ErrorInput("sin-shape", Sample("", (x, cos, sin[..., :2])), "sin", r"rope: cos and sin must have the same"),
        ErrorInput("cos-dtype", Sample("", (x, cos.int(), sin)), "cos", r"rope: cos must be float32"),
        ErrorInput("compute-dtype", Sample("", (x, cos, sin), {"compute_dtype": "bf16"}), "compute_dtype",
                   r"rope: compute_dtype must be one of"),
    ]


_register(OpCases("rope", _rope_samples, oracles.rope_oracle, _rope_errors,
                  # fp32 math rounded once, or ("activation" samples) each product and the sum rounded
                  bounds=_eps_bounds(8, 2, 2), selftest=("v2lite", "v2lite-half", "v2lite-activation-half")))


# ------------------------------------------------------------------------------------------ prologs
def _prolog_sample(name: str, d: Dims, dtype, *, bias=False, layout="interleaved", tables="BSR", seed=0,
                   rounding="float32"):
    hidden, kv_a, kv_a_b, norm_w, kv_b, cos, sin = prolog_inputs(d, dtype, bias=bias, generator=_gen(seed))
    if tables == "SR":
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
    kwargs = prolog_kwargs(d, rope_layout=layout)
    if rounding != "float32":
        kwargs["rope_compute_dtype"] = rounding
    return Sample(name, (hidden, kv_a, kv_a_b, norm_w, kv_b, cos, sin), kwargs)


def _with_dims(d: Dims, **changes) -> Dims:
    return dataclasses.replace(d, **changes)


def _kv_prolog_samples(dtype):
    return [
        _prolog_sample("small", SMALL, dtype),
        _prolog_sample("small-bias-half", SMALL, dtype, bias=True, layout="half"),
        _prolog_sample("small-neox-tables-SR", SMALL, dtype, layout="neox", tables="SR"),
        _prolog_sample("prefill-bias", PREFILL, dtype, bias=True),
        _prolog_sample("v2lite", LITE, dtype),
        _prolog_sample("v2lite-decode-half", _with_dims(LITE, S=1), dtype, layout="half"),
        _prolog_sample("small-activation-half", SMALL, dtype, layout="half", rounding="activation"),
        _prolog_sample("v2lite-decode-activation-half", _with_dims(LITE, S=1), dtype, layout="half",
                       rounding="activation"),
        _prolog_sample("empty-batch", _with_dims(SMALL, B=0), dtype, bias=True),
        _prolog_sample("empty-seq", _with_dims(SMALL, S=0), dtype),
    ]


def _latent_only(sample: Sample) -> Sample:
    hidden, kv_a, kv_a_b, norm_w, _, cos, sin = sample.args
    kwargs = {k: v for k, v in sample.kwargs.items() if k in ("rope_layout", "rope_compute_dtype")}
    return Sample(sample.name, (hidden, kv_a, kv_a_b, norm_w, cos, sin), kwargs)


def _latent_kv_prolog_samples(dtype):
    keep = ("small", "small-bias-half", "small-neox-tables-SR", "prefill-bias", "v2lite", "v2lite-decode-half",
            "small-activation-half", "empty-batch", "empty-seq")
    return [_latent_only(s) for s in _kv_prolog_samples(dtype) if s.name in keep]


def _prolog_errors(op: str):
    d = SMALL
    names = ("hidden_states", "kv_a_weight", "kv_a_bias", "kv_norm_weight", "kv_b_weight", "cos", "sin")
    base = dict(zip(names, prolog_inputs(d, torch.float32, bias=True)))

    def call(**changes):
        args = dict(base, **changes)
        if op == "latent_kv_prolog":
            del args["kv_b_weight"]
            return Sample("", tuple(args.values()))
        return Sample("", tuple(args.values()), prolog_kwargs(d))

    hidden = base["hidden_states"]
    cases = [
        ErrorInput("hidden-rank", call(hidden_states=hidden[0]), "hidden_states", rf"{op}: hidden_states must be 3-D"),
        ErrorInput("kv_a-in", call(kv_a_weight=torch.randn(d.L + d.R, d.H + 1)), "kv_a_weight",
                   rf"{op}: kv_a_weight in_features .* must equal the hidden size"),
        ErrorInput("norm-size", call(kv_norm_weight=torch.randn(d.L + d.R)), "kv_a_weight",
                   rf"{op}: kv_a_weight has .* output rows"),
        ErrorInput("norm-odd", call(kv_norm_weight=torch.randn(d.L + 1)), "kv_norm_weight",
                   rf"{op}: kv_norm_weight has {d.L + 1} entries, .* leave kv_lora_rank = {d.L}"),
        ErrorInput("bias", call(kv_a_bias=torch.randn(3)), "kv_a_bias", rf"{op}: kv_a_bias length must equal"),
        ErrorInput("cos-dim", call(cos=torch.randn(d.B, d.S, 3), sin=torch.randn(d.B, d.S, 3)), "cos",
                   rf"{op}: cos last dim must be half the rotary dim of k_pe"),
        ErrorInput("device", call(cos=torch.randn(d.B, d.S, d.R // 2, device="meta")), "cos",
                   rf"{op}: all tensors must be on one device"),
        ErrorInput("layout", dataclasses.replace(call(), kwargs={**call().kwargs, "rope_layout": "gptj"}),
                   "rope_layout", rf"{op}: rope_layout must be one of"),
        ErrorInput("rope-compute-dtype", dataclasses.replace(call(), kwargs={**call().kwargs,
                                                                              "rope_compute_dtype": "float16"}),
                   "rope_compute_dtype", rf"{op}: rope_compute_dtype must be one of"),
    ]
    if op == "kv_prolog":
        cases += [
            ErrorInput("kv_b-rows", call(kv_b_weight=torch.randn(d.N * (d.P + d.V) + 1, d.L)), "kv_b_weight",
                       r"kv_prolog: kv_b_weight rows must be num_heads \* \(qk_nope_head_dim \+ v_head_dim\)"),
            ErrorInput("kv_b-dtype", call(kv_b_weight=torch.randn(d.N * (d.P + d.V), d.L).half()), "kv_b_weight",
                       r"kv_prolog: kv_b_weight has dtype torch.float16 but hidden_states has torch.float32"),
            ErrorInput("num_heads", dataclasses.replace(call(), kwargs={**call().kwargs, "num_heads": 0}), "num_heads",
                       r"kv_prolog: num_heads must be positive"),
        ]
    return cases


# A GEMM over K inputs: fp32 accumulation of products whose inputs were rounded to the activation
# dtype on the way (compressed kv, the normed latent), so a few epsilons of the output's scale.
_PROLOG_BOUNDS = _eps_bounds(32, 2, 2)
# The PyPTO stage-2 kernel accumulates kv_b per head in its own order (and rounds its matmul
# inputs to the activation dtype): a few more ulps than ATen's GEMM.
_PYPTO_PROLOG_BOUNDS = {"pypto_sim": _eps_bounds(64, 8, 8)}

_register(OpCases("kv_prolog", _kv_prolog_samples, oracles.kv_prolog_oracle, lambda: _prolog_errors("kv_prolog"),
                  bounds=_PROLOG_BOUNDS, backend_bounds=_PYPTO_PROLOG_BOUNDS,
                  selftest=("v2lite", "v2lite-decode-half", "v2lite-decode-activation-half")))
_register(OpCases("latent_kv_prolog", _latent_kv_prolog_samples, oracles.latent_kv_prolog_oracle,
                  lambda: _prolog_errors("latent_kv_prolog"), bounds=_PROLOG_BOUNDS,
                  selftest=("v2lite", "v2lite-decode-half")))


# ------------------------------------------------------------------------------------------ q_prolog
def _q_prolog_sample(name, d: Dims, dtype, *, lora: Optional[int], bias=False, layout="interleaved", seed=0,
                     rounding="float32"):
    g = _gen(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    hidden = rand(d.B, d.S, d.H)
    in_features = d.H if lora is None else lora
    q_a = rand(lora, d.H, scale=d.H ** -0.5) if lora else None
    q_a_b = rand(lora, scale=0.1) if lora and bias else None
    q_norm = (1 + 0.1 * torch.randn(lora, generator=g)).to(dtype) if lora else None
    q_b = rand(d.N * (d.P + d.R), in_features, scale=in_features ** -0.5)
    cos, sin = _tables(dtype, d.B, d.S, d.R, offset=2)
    kwargs = {"num_heads": d.N, "qk_nope_head_dim": d.P, "rope_layout": layout}
    if rounding != "float32":
        kwargs["rope_compute_dtype"] = rounding
    return Sample(name, (hidden, q_a, q_a_b, q_norm, q_b, cos, sin), kwargs)


def _q_prolog_samples(dtype):
    return [
        _q_prolog_sample("small-lora", SMALL, dtype, lora=24),
        _q_prolog_sample("small-lora-bias-half", SMALL, dtype, lora=24, bias=True, layout="half"),
        _q_prolog_sample("small-no-lora-neox", SMALL, dtype, lora=None, layout="neox"),
        _q_prolog_sample("prefill-lora", PREFILL, dtype, lora=48),
        _q_prolog_sample("v2lite-no-lora", LITE, dtype, lora=None),
        _q_prolog_sample("v2-lora-decode", _with_dims(LITE, S=1), dtype, lora=1536),
        _q_prolog_sample("v3-lora-decode-activation", _with_dims(LITE, S=1), dtype, lora=1536, layout="half",
                         rounding="activation"),
        _q_prolog_sample("empty-seq", _with_dims(SMALL, S=0), dtype, lora=24),
    ]


def _q_prolog_errors():
    base = _q_prolog_sample("", SMALL, torch.float32, lora=24)
    hidden, q_a, q_a_b, q_norm, q_b, cos, sin = base.args

    def call(*args, **kwargs):
        return Sample("", args, {**base.kwargs, **kwargs})

    return [
        ErrorInput("norm-missing", call(hidden, q_a, None, None, q_b, cos, sin), "q_norm_weight",
                   r"q_prolog: q_a_weight and q_norm_weight come together"),
        ErrorInput("bias-alone", call(hidden, None, torch.randn(24), None, torch.randn(q_b.shape[0], SMALL.H), cos,
                                      sin),
                   "q_a_bias", r"q_prolog: q_a_bias was given without q_a_weight"),
        ErrorInput("q_b-in", call(hidden, q_a, None, q_norm, torch.randn(q_b.shape[0], 23), cos, sin), "q_b_weight",
                   r"q_prolog: q_b_weight in_features .* must equal q_lora_rank"),
        ErrorInput("q_b-rows", call(hidden, q_a, None, q_norm, q_b[:-1], cos, sin), "q_b_weight",
                   r"q_prolog: q_b_weight rows must be num_heads \* \(qk_nope_head_dim \+ rope_dim\)"),
        ErrorInput("norm-size", call(hidden, q_a, None, torch.randn(23), q_b, cos, sin), "q_norm_weight",
                   r"q_prolog: q_norm_weight length must equal q_lora_rank"),
        ErrorInput("heads", call(hidden, q_a, None, q_norm, q_b, cos, sin, num_heads=0), "num_heads",
                   r"q_prolog: num_heads must be positive"),
        ErrorInput("rope-compute-dtype", call(hidden, q_a, None, q_norm, q_b, cos, sin, rope_compute_dtype="fp32"),
                   "rope_compute_dtype", r"q_prolog: rope_compute_dtype must be one of"),
    ]


_register(OpCases("q_prolog", _q_prolog_samples, oracles.q_prolog_oracle, _q_prolog_errors, bounds=_PROLOG_BOUNDS,
                  selftest=("v2lite-no-lora", "v2-lora-decode", "v3-lora-decode-activation")))


# --------------------------------------------------------------------------------------- paged ops
def _mla_pool(d: Dims, dtype, num_blocks: int, block_size: int, lens, *, offsets=None, columns=None, seed=0):
    """(key_cache latent [NB, bs, 1, L], value_cache k_pe [NB, bs, 1, R], tables, cumsum, offsets)."""
    return paged_case(num_blocks, block_size, lens, key_shape=(1, d.L), value_shape=(1, d.R), dtype=dtype,
                      offsets=offsets, columns=columns, seed=seed)


def _gather_samples(dtype):
    d = SMALL
    kc, vc, tables, cumsum, offsets = _mla_pool(d, dtype, 12, 4, [5, 1, 9], offsets=[4, 0, 0], columns=5)
    total = int(cumsum[-1])
    lens = (cumsum[1:] - cumsum[:-1]).long()

    def outputs(rows, like_k=kc, like_v=vc):
        return (_randn(rows, *like_k.shape[2:], dtype=dtype, seed=7), _randn(rows, *like_v.shape[2:], dtype=dtype,
                                                                               seed=8))

    pool, latent_view, k_pe_view = split_pool(12, 4, d.L, d.R, dtype, seed=3)
    _, _, view_tables, view_cumsum, _ = _mla_pool(d, dtype, 12, 4, [7, 6])
    zkc, zvc, z_tables, _, _ = _mla_pool(d, dtype, 6, 4, [3, 0, 6], columns=2)
    lite_kc, lite_vc, lite_tables, lite_cumsum, _ = _mla_pool(LITE, dtype, 6, 128, [130, 1, 200], columns=2)
    wide = torch.zeros(total + 3, 1, 2 * d.L, dtype=dtype)
    # heads x dim above 4096: the PyPTO gather's large-token tile (its other variant)
    big_kc, big_vc, big_tables, big_cumsum, _ = paged_case(6, 16, [17, 30], key_shape=(8, 576), value_shape=(1, 64),
                                                           dtype=dtype, seed=4)
    return [
        Sample("cumsum-offset-uncovered-rows", (kc, vc, tables, cumsum, *outputs(total + 2)),
               {"seq_offset": offsets, "is_seq_lens_cumsum": True}),
        Sample("lengths-int64", (kc, vc, tables.long(), lens, *outputs(total))),
        Sample("lengths-offset", (kc, vc, tables, lens.int(), *outputs(total)), {"seq_offset": offsets}),
        Sample("split-pool-views", (latent_view, k_pe_view, view_tables, view_cumsum, *outputs(13)),
               {"is_seq_lens_cumsum": True}),
        Sample("strided-output", (kc, vc, tables, lens.int(), wide[:total, :, : d.L], outputs(total)[1]),
               {"seq_offset": offsets}),
        Sample("zero-length-sequence", (zkc, zvc, z_tables, torch.tensor([3, 0, 6], dtype=torch.int32),
                                        *outputs(9))),
        Sample("no-tokens", (zkc, zvc, z_tables[:, :0], torch.zeros(3, dtype=torch.int32), *outputs(2))),
        Sample("no-sequences", (zkc, zvc, z_tables[:0], torch.zeros(0, dtype=torch.int32), *outputs(3))),
        Sample("many-heads-large-tile", (big_kc, big_vc, big_tables, big_cumsum, *outputs(47, big_kc, big_vc)),
               {"is_seq_lens_cumsum": True}),
        Sample("v2lite-tail-blocks", (lite_kc, lite_vc, lite_tables, lite_cumsum, *outputs(331, lite_kc, lite_vc)),
               {"is_seq_lens_cumsum": True}),
    ]


def _gather_errors(op: str):
    kc, vc, tables, cumsum, offsets = paged_case(10, 4, [5, 3], key_shape=(1, 8), value_shape=(1, 4),
                                                 dtype=torch.float32, offsets=[4, 0], columns=4)
    base = dict(key_cache=kc, value_cache=vc, block_tables=tables, seq_lens=cumsum,
                key=torch.full((8, 1, 8), 3.0), value=torch.full((8, 1, 4), 3.0))

    def call(seq_offset=offsets, is_seq_lens_cumsum=True, **changes):
        return Sample("", tuple(dict(base, **changes).values()),
                      {"seq_offset": seq_offset, "is_seq_lens_cumsum": is_seq_lens_cumsum})

    i32 = torch.int32
    cases = [
        ErrorInput("key_cache-rank", call(key_cache=torch.randn(10, 4, 8)), "key_cache",
                   rf"{op}: key_cache must be 4-D"),
        ErrorInput("value_cache-blocks", call(value_cache=torch.randn(9, 4, 1, 4)), "value_cache",
                   rf"{op}: value_cache num_blocks .* must equal key_cache's"),
        ErrorInput("value_cache-block-size", call(value_cache=torch.randn(10, 2, 1, 4)), "value_cache",
                   rf"{op}: value_cache block_size .* must equal key_cache's"),
        ErrorInput("key-dim", call(key=torch.zeros(8, 1, 7)), "key", rf"{op}: key head dim .* must equal key_cache"),
        ErrorInput("key-heads", call(key=torch.zeros(8, 2, 8)), "key", rf"{op}: key heads .* must equal key_cache"),
        ErrorInput("key-dtype", call(key=torch.zeros(8, 1, 8, dtype=torch.float16)), "key",
                   rf"{op}: key has dtype torch.float16 but key_cache"),
        ErrorInput("tables-dtype", call(block_tables=torch.zeros(2, 4)), "block_tables",
                   rf"{op}: block_tables must be an int32"),
        ErrorInput("cumsum-length", call(seq_lens=torch.tensor([0, 5])), "seq_lens",
                   rf"{op}: seq_lens must have num_seqs \+ 1 entries"),
        ErrorInput("lengths-length", call(is_seq_lens_cumsum=False), "seq_lens",
                   rf"{op}: seq_lens must have one length per"),
        ErrorInput("offset-dtype", call(seq_offset=torch.tensor([0.0, 4.0])), "seq_offset",
                   rf"{op}: seq_offset must be an int"),
        ErrorInput("offset-length", call(seq_offset=torch.tensor([0])), "seq_offset",
                   rf"{op}: seq_offset needs one offset per"),
        # index values: validated on the host before anything is written
        ErrorInput("cumsum-start", call(seq_lens=torch.tensor([1, 5, 8], dtype=i32)), "seq_lens",
                   r"cumulative seq_lens must start at 0, got seq_lens\[0\] = 1", ValueError),
        ErrorInput("cumsum-decreasing", call(seq_lens=torch.tensor([0, 5, 4], dtype=i32)), "seq_lens",
                   r"cumulative seq_lens must never decrease, but seq_lens\[2\] = 4 < seq_lens\[1\] = 5", ValueError),
        ErrorInput("negative-length", call(seq_lens=torch.tensor([5, -1]), is_seq_lens_cumsum=False), "seq_lens",
                   r"seq_lens\[1\] = -1 is negative", ValueError),
        ErrorInput("negative-offset", call(seq_offset=torch.tensor([-4, 0], dtype=i32)), "seq_offset",
                   r"seq_offset\[0\] = -4 is negative", ValueError),
        ErrorInput("unaligned-offset", call(seq_offset=torch.tensor([2, 0], dtype=i32)), "seq_offset",
                   r"seq_offset\[0\] = 2 is not a multiple of block_size 4", ValueError),
        ErrorInput("offset-past-table", call(seq_offset=torch.tensor([12, 0], dtype=i32)), "block_tables",
                   r"sequence 0 needs block-table columns 3..4 .* but block_tables has only 4 columns", ValueError),
        ErrorInput("block-id-high", call(block_tables=torch.tensor([[0, 1, 10, 3], [4, 5, 6, 7]], dtype=i32)),
                   "block_tables",
                   r"block_tables\[0, 2\] = 10 is used by sequence 0 but is not a block id in \[0, 10\)", ValueError),
        ErrorInput("block-id-negative", call(block_tables=torch.tensor([[0, 1, 2, 3], [-1, 5, 6, 7]], dtype=i32)),
                   "block_tables", r"block_tables\[1, 0\] = -1 is used by sequence 1", ValueError),
        ErrorInput("too-few-rows", call(key=torch.zeros(7, 1, 8), value=torch.zeros(7, 1, 4)), "key",
                   r"the sequences hold 8 tokens but key/value have only 7 rows", ValueError),
        # values near 2**63: checked before any int64 arithmetic could wrap around
        ErrorInput("huge-offset", call(seq_offset=torch.tensor([2**63 - 4, 0])), "seq_offset",
                   r"seq_offset\[0\] = 9223372036854775804 starts at block-table column .* only 4 columns",
                   ValueError),
        ErrorInput("huge-lengths", call(seq_offset=None, is_seq_lens_cumsum=False,
                                        block_tables=torch.zeros(2, 4, dtype=i32),
                                        seq_lens=torch.tensor([2**62, 2**62])),
                   "seq_lens", r"sequence 0 needs block-table columns .* seq_lens may hold at most 16 tokens",
                   ValueError),
        ErrorInput("huge-cumsum", call(seq_lens=torch.tensor([0, 2**63 - 1, 2**63 - 1])), "seq_lens",
                   r"sequence 0 needs block-table columns", ValueError),
    ]
    if op == "gather_pa_kv_cache_functional":  # the twin runs the in-place op's value checks, named after it
        cases = [dataclasses.replace(e, op_named="gather_pa_kv_cache") if e.error is ValueError else e for e in cases]
    if op == "gather_pa_kv_cache":  # only the in-place op writes into the caller's key / value
        cases += [
            ErrorInput("value-overlapping", call(value=torch.full((1, 1, 4), 3.0).expand(8, 1, 4)), "value",
                       r"gather_pa_kv_cache: value has overlapping memory .* stride-0"),
            ErrorInput("key-overlapping", call(key=torch.full((8, 1, 1), 3.0).expand(8, 1, 8)), "key",
                       r"gather_pa_kv_cache: key has overlapping memory"),
        ]
    return cases


def _gather_sync_free(key_cache, value_cache, block_tables, seq_lens, key, value, *, seq_offset=None,
                      is_seq_lens_cumsum=False):
    """The reference gather's device path with the op's calling convention."""
    gather_sync_free(key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset, is_seq_lens_cumsum)


_register(OpCases("gather_pa_kv_cache", _gather_samples, oracles.gather_pa_kv_cache_oracle,
                  lambda: _gather_errors("gather_pa_kv_cache"), bounds=EXACT,
                  paths={"sync-free": _gather_sync_free}, selftest=("cumsum-offset-uncovered-rows",
                                                                      "lengths-int64", "v2lite-tail-blocks")))
_register(OpCases("gather_pa_kv_cache_functional", _gather_samples, oracles.gather_pa_kv_cache_oracle,
                  lambda: _gather_errors("gather_pa_kv_cache_functional"), bounds=EXACT,
                  selftest=("cumsum-offset-uncovered-rows", "v2lite-tail-blocks")))


def _scatter_samples(dtype):
    d = SMALL
    kc, vc, *_ = _mla_pool(d, dtype, 6, 4, [1])
    tokens = 7
    slots = torch.randperm(24, generator=_gen(1))[:tokens]
    slots[2] = -1  # padding
    key, value = _randn(tokens, 1, d.L, dtype=dtype, seed=5), _randn(tokens, 1, d.R, dtype=dtype, seed=6)
    pool, latent_view, k_pe_view = split_pool(6, 4, d.L, d.R, dtype, seed=2)
    lite_kc, lite_vc, *_ = _mla_pool(LITE, dtype, 4, 128, [1])
    lite_slots = torch.tensor([0, 129, 511, -1, 300], dtype=torch.int32)
    wide = _randn(tokens, 1, 2 * d.L, dtype=dtype, seed=9)
    return [
        Sample("padding", (key, value, kc, vc, slots.int())),
        Sample("int64-slots", (key, value, kc, vc, slots.long())),
        Sample("split-pool-views", (key, value, latent_view, k_pe_view, slots.int())),
        Sample("strided-tokens", (wide[..., : d.L], value, kc, vc, slots.int())),
        Sample("all-padding", (key, value, kc, vc, torch.full((tokens,), -1, dtype=torch.int32))),
        Sample("no-tokens", (key[:0], value[:0], kc, vc, slots[:0].int())),
        Sample("v2lite", (_randn(5, 1, LITE.L, dtype=dtype, seed=3), _randn(5, 1, LITE.R, dtype=dtype, seed=4),
                          lite_kc, lite_vc, lite_slots)),
        *_scatter_aliased_samples(dtype),
    ]


def _aliased_pool(dtype, width: int, start: float = 0.0) -> Tensor:
    """[4 blocks, 4, 1, width] holding start, start + 1, ... (rows of 16 values: 32 bytes or more in every
    activation dtype, the PyPTO kernels' tile granule)."""
    return (torch.arange(16 * width, dtype=torch.float32) + start).to(dtype).view(4, 4, 1, width)


# (name, rows of the pool the input rows are, slots written): the first reads rows 1..3 and writes slots
# 2..4, so two of the rows it reads are rows it writes; the second reads rows 5..6 and writes 12 and 11
ALIASED_ROWS = (("rows-of-the-cache-overlapping-written-slots", slice(1, 4), [2, 3, 4]),
                ("rows-of-the-cache-apart-from-written-slots", slice(5, 7), [12, 11]))


def _scatter_aliased_samples(dtype):
    """key and value are views of the pools the call writes: every row is read as it was before the call."""
    samples = []
    for name, rows, slots in ALIASED_ROWS:
        def rebuild(args, rows=rows):
            key_cache, value_cache = args[2], args[3]
            return (key_cache.view(16, 1, -1)[rows], value_cache.view(16, 1, -1)[rows], *args[2:])
        args = (None, None, _aliased_pool(dtype, 16), _aliased_pool(dtype, 16, start=256.0), torch.tensor(slots))
        samples.append(Sample(name, rebuild(args), rebuild=rebuild))
    return samples


def _scatter_one_pool_aliased_samples(dtype):
    samples = []
    for name, rows, slots in ALIASED_ROWS:
        def rebuild(args, rows=rows):
            return (args[1].view(16, 1, -1)[rows], *args[1:])
        samples.append(Sample(name, rebuild((None, _aliased_pool(dtype, 16), torch.tensor(slots))), rebuild=rebuild))
    return samples


def _scatter_errors():
    kc, vc, *_ = paged_case(4, 4, [3], key_shape=(1, 8), value_shape=(1, 4), dtype=torch.float32)
    base = dict(key=torch.randn(3, 1, 8), value=torch.randn(3, 1, 4), key_cache=kc, value_cache=vc,
                slot_mapping=torch.tensor([0, 5, -1]))

    def call(**changes):
        return Sample("", tuple(dict(base, **changes).values()))

    op = "scatter_pa_kv_cache"
    return [
        ErrorInput("key_cache-overlapping", call(key_cache=torch.zeros(1, 4, 1, 8).expand(4, 4, 1, 8)), "key_cache",
                   rf"{op}: key_cache has overlapping memory"),
        ErrorInput("value_cache-overlapping", call(value_cache=torch.zeros(4, 1, 1, 4).expand(4, 4, 1, 4)),
                   "value_cache", rf"{op}: value_cache has overlapping memory"),
        ErrorInput("slots-length", call(slot_mapping=torch.tensor([0, 1])), "slot_mapping",
                   rf"{op}: slot_mapping length must equal the token count of key"),
        ErrorInput("slots-dtype", call(slot_mapping=torch.tensor([0.0, 1.0, 2.0])), "slot_mapping",
                   rf"{op}: slot_mapping must be an int32 or int64"),
        ErrorInput("value-tokens", call(value=torch.randn(2, 1, 4)), "value", rf"{op}: value token count"),
        ErrorInput("key-rank", call(key=torch.randn(3, 8)), "key", rf"{op}: key must be 3-D"),
        ErrorInput("slot-outside", call(slot_mapping=torch.tensor([0, 16, -1])), "slot_mapping",
                   r"slot_mapping\[1\] = 16 is outside the cache \(num_blocks \* block_size = 16 slots\)", ValueError),
        ErrorInput("slot-near-2**63", call(slot_mapping=torch.tensor([0, -1, 2**63 - 1])), "slot_mapping",
                   r"slot_mapping\[2\] = 9223372036854775807 is outside the cache", ValueError),
    ]


_register(OpCases("scatter_pa_kv_cache", _scatter_samples, oracles.scatter_pa_kv_cache_oracle, _scatter_errors,
                  bounds=EXACT, paths={"sync-free": scatter_sync_free}, selftest=("padding", "v2lite")))


def _scale_errors(op: str, call):
    """Scales finite as a double that the kernels' float32 cannot hold: inf (1e39), zero (1e-46), a
    subnormal (1e-40: fewer significant bits, zero under FTZ/DAZ), negative."""
    bounds = r"within \[1.1754943508222875e-38, 3.4028234663852886e\+38\] \(the kernels scale in float32\)"
    return [ErrorInput(f"scale-{name}", call(softmax_scale=value), "softmax_scale",
                       rf"{op}: softmax_scale must be a positive normal float32 number.*{bounds}, got {pattern}")
            for name, value, pattern in (("1e39-inf-in-float32", 1e39, r"1e\+39"),
                                         ("1e-46-zero-in-float32", 1e-46, "1e-46"),
                                         ("subnormal-in-float32", 1e-40, "1e-40"),
                                         ("negative", -0.5, r"-0\.5"))]


def _decode_sample(name, d: Dims, dtype, block_size: int, lens, *, num_blocks=None, view=False, int64=False,
                   seed=0) -> Sample:
    need = sum(-(-n // block_size) for n in lens)
    num_blocks = num_blocks or need + 2
    kc, vc, tables, _, _ = _mla_pool(d, dtype, num_blocks, block_size, lens, seed=seed)
    if view:
        _, kc, vc = split_pool(num_blocks, block_size, d.L, d.R, dtype, seed=seed + 1)
    batch = len(lens)
    q_latent = _randn(batch, d.N, d.L, dtype=dtype, seed=seed + 2)
    q_pe = _randn(batch, d.N, d.R, dtype=dtype, seed=seed + 3)
    seq_lens = torch.tensor(lens, dtype=torch.int64 if int64 else torch.int32)
    tables = tables.long() if int64 else tables
    return Sample(name, (q_latent, q_pe, kc, vc, tables, seq_lens, (d.P + d.R) ** -0.5))


def _with_sinks(sample: Sample, name: str, sink_dtype, seed: int) -> Sample:
    """`sample` of an absorbed attention op (q_latent [rows, N, L] first) with per-head sinks [N] appended:
    O(1) logits against O(1) scores, so the sink's share of each denominator is far from 0 and 1."""
    heads = sample.args[0].shape[1]
    return Sample(name, (*sample.args, _randn(heads, dtype=sink_dtype, seed=seed, scale=1.5)))


def _with_q_scale(sample: Sample, name: str, scale_dtype, seed: int) -> Sample:
    """`sample` of an absorbed attention op (q_latent [rows, N, L] first, sinks next to last) with a query scale
    [rows, N] appended: factors around 1, some negative (a learned scale_h * log(p + 1) + bias_h may be), which
    turn the scores' order around."""
    rows, heads = sample.args[0].shape[:2]
    scale = (1 + 0.8 * _randn(rows, heads, dtype=torch.float32, seed=seed)).to(scale_dtype)
    return Sample(name, (*sample.args, scale))


def _q_scale_errors(op: str, call, rows: int, heads: int):
    """The q_scale argument's metadata errors, for ops whose q_latent (float32 in the error bases) is
    [rows, heads, L]."""
    return [
        ErrorInput("q_scale-heads", call(q_scale=torch.ones(rows, heads + 1)), "q_scale",
                   rf"{op}: q_scale heads \(dim 1\) must equal q_latent's"),
        ErrorInput("q_scale-rows", call(q_scale=torch.ones(rows + 1, heads)), "q_scale",
                   rf"{op}: q_scale rows \(dim 0\) must equal q_latent's"),
        ErrorInput("q_scale-rank", call(q_scale=torch.ones(rows * heads)), "q_scale", rf"{op}: q_scale must be 2-D"),
        ErrorInput("q_scale-other-half-dtype", call(q_scale=torch.ones(rows, heads).half()), "q_scale",
                   rf"{op}: q_scale must be float32 or q_latent's dtype torch.float32, got torch.float16"),
    ]


def _sink_errors(op: str, call, heads: int, q_name: str):
    """The sinks argument's metadata errors, for ops whose q (`q_name`, float32 in the error bases) has `heads`."""
    return [
        ErrorInput("sinks-length", call(sinks=torch.randn(heads + 1)), "sinks",
                   rf"{op}: sinks length must equal the heads of {q_name}"),
        ErrorInput("sinks-rank", call(sinks=torch.randn(heads, 1)), "sinks", rf"{op}: sinks must be 1-D"),
        ErrorInput("sinks-other-half-dtype", call(sinks=torch.randn(heads).half()), "sinks",
                   rf"{op}: sinks must be float32 or {q_name}'s dtype torch.float32, got torch.float16"),
        ErrorInput("sinks-device", call(sinks=torch.randn(heads, device="meta")), "sinks",
                   rf"{op}: all tensors must be on one device"),
    ]


def _decode_samples(dtype):
    d = SMALL
    return [
        _decode_sample("ragged", d, dtype, 4, [5, 1, 12]),
        _decode_sample("equal-lengths-int64", d, dtype, 4, [8, 8], int64=True),
        _decode_sample("block-size-1", d, dtype, 1, [3, 7]),
        _decode_sample("split-pool-views", d, dtype, 4, [6, 9], view=True),
        _decode_sample("one-token", d, dtype, 16, [1]),
        _decode_sample("v2lite-ragged", LITE, dtype, 64, [300, 17, 64]),
        _decode_sample("v2lite-block-128", LITE, dtype, 128, [129, 256]),
        _decode_sample("empty-batch", d, dtype, 4, []),
        _with_sinks(_decode_sample("", d, dtype, 4, [5, 1, 12], seed=20), "sinks-ragged", torch.float32, seed=24),
        _with_sinks(_decode_sample("", LITE, dtype, 64, [300, 17], seed=30), "v2lite-sinks-activation-dtype", dtype,
                    seed=34),
        _windowed(_decode_sample("", d, dtype, 4, [5, 1, 12, 9], seed=40), "sliding-window-freed-blocks", 6),
        _windowed(_with_sinks(_decode_sample("", LITE, dtype, 16, [300, 40], seed=44), "", torch.float32, seed=48),
                  "v2lite-window-128-sinks", 128),
        _with_q_scale(_windowed(_decode_sample("", d, dtype, 4, [5, 1, 12], seed=50), "", 0), "q-scale-ragged",
                      torch.float32, seed=54),
        _with_q_scale(_windowed(_with_sinks(_decode_sample("", LITE, dtype, 64, [300, 17], seed=56), "", dtype,
                                            seed=58), "", 0), "v2lite-q-scale-sinks-activation-dtype", dtype, seed=60),
    ]


def _windowed(sample: Sample, name: str, window: int) -> Sample:
    """A decode `sample` (sinks appended or not) attending to each sequence's last `window` tokens (0: all of them):
    sinks None where the sample has none, and the block-table entries wholly before a window set to -1, as freed
    blocks are."""
    q_latent, q_pe, kc, vc, tables, seq_lens, scale, *sinks = sample.args
    block_size = kc.shape[1]
    tables = tables.clone()
    for b, n in enumerate(seq_lens.tolist() if window else ()):
        tables[b, : max(0, n - window) // block_size] = -1
    return Sample(name, (q_latent, q_pe, kc, vc, tables, seq_lens, scale, sinks[0] if sinks else None, window))


def _decode_errors():
    kc, vc, tables, _, _ = paged_case(6, 4, [5, 3], key_shape=(1, 8), value_shape=(1, 4), dtype=torch.float32)
    base = dict(q_latent=torch.randn(2, 3, 8), q_pe=torch.randn(2, 3, 4), key_cache=kc, value_cache=vc,
                block_tables=tables, seq_lens=torch.tensor([5, 3]), softmax_scale=0.5)

    def call(**changes):
        return Sample("", tuple(dict(base, **changes).values()))

    op = "mla_decode_attention"
    return [
        ErrorInput("key_cache-heads", call(key_cache=torch.randn(6, 4, 2, 8)), "key_cache",
                   rf"{op}: key_cache heads .* must be 1"),
        ErrorInput("value_cache-dim", call(q_pe=torch.randn(2, 3, 5)), "value_cache",
                   rf"{op}: value_cache dim .* must equal rope_dim"),
        ErrorInput("seq_lens-length", call(seq_lens=torch.tensor([5])), "seq_lens",
                   rf"{op}: seq_lens length must equal the batch"),
        ErrorInput("q_pe-dtype", call(q_pe=torch.randn(2, 3, 4).double()), "q_pe", rf"{op}: q_pe has dtype"),
        ErrorInput("scale-nan", call(softmax_scale=float("nan")), "softmax_scale",
                   rf"{op}: softmax_scale must be a positive normal float32 number"),
        ErrorInput("scale-zero", call(softmax_scale=0.0), "softmax_scale",
                   rf"{op}: softmax_scale must be a positive normal float32 number"),
        *_scale_errors(op, call),
        ErrorInput("empty-pool", call(key_cache=torch.randn(0, 4, 1, 8), value_cache=torch.randn(0, 4, 1, 4)),
                   "key_cache", rf"{op}: key_cache needs at least one block"),
        ErrorInput("zero-length", call(seq_lens=torch.tensor([5, 0])), "seq_lens",
                   r"seq_lens\[1\] = 0; each decoding sequence", ValueError),
        ErrorInput("past-capacity", call(seq_lens=torch.tensor([5, 9])), "seq_lens",
                   r"seq_lens\[1\] = 9 exceeds the block table's capacity", ValueError),
        ErrorInput("block-id", call(block_tables=torch.tensor([[0, 7], [1, 2]], dtype=torch.int32)), "block_tables",
                   r"block_tables\[0, 1\] = 7 is used by sequence 0 but is not a block id in \[0, 6\)", ValueError),
        # values near 2**63: refused, never wrapped into range by the length / block arithmetic
        ErrorInput("length-near-2**63", call(seq_lens=torch.tensor([5, 2**63 - 1])), "seq_lens",
                   r"seq_lens\[1\] = 9223372036854775807 exceeds the block table's capacity", ValueError),
        ErrorInput("block-id-near-2**63", call(block_tables=torch.tensor([[0, 2**63 - 1], [1, 2]])), "block_tables",
                   r"block_tables\[0, 1\] = 9223372036854775807 is used by sequence 0 but is not a block id",
                   ValueError),
        ErrorInput("block-id-near--2**63", call(block_tables=torch.tensor([[0, 1], [-(2**63), 2]])), "block_tables",
                   r"block_tables\[1, 0\] = -9223372036854775808 is used by sequence 1", ValueError),
        *_sink_errors(op, call, 3, "q_latent"),
        ErrorInput("sliding_window-negative", call(sinks=None, sliding_window=-1), "sliding_window",
                   rf"{op}: sliding_window must be >= 0"),
        # a window reads its own blocks only: a bad id there is refused, one before it is never read
        *_q_scale_errors(op, lambda **c: call(sinks=None, sliding_window=0, **c), 2, 3),
        ErrorInput("window-block-id", call(sinks=None, sliding_window=1,
                                           block_tables=torch.tensor([[-1, 7], [0, 2]], dtype=torch.int32)),
                   "block_tables", r"block_tables\[0, 1\] = 7 is used by sequence 0 but is not a block id in \[0, 6\)",
                   ValueError),
    ]


_register(OpCases("mla_decode_attention", _decode_samples, oracles.mla_decode_attention_oracle, _decode_errors,
                  # scores and softmax in fp32, P rounded to the activation dtype before P @ latent
                  bounds=_eps_bounds(64, 2, 2), paths={"sync-free": decode_sync_free},
                  selftest=("v2lite-ragged", "v2lite-block-128")))


# -------------------------------------------------------------------------------------- sparse MLA
def _requests(seq_lens: list[int], q_lens: list[int], block_size: int, *, spare_blocks: int = 2, seed: int = 0):
    """(block_tables, seq_lens, query_start_loc, num_blocks) for requests holding `seq_lens` cached
    tokens of which the last `q_lens` are this call's query tokens."""
    need = sum(-(-n // block_size) for n in seq_lens)
    _, _, tables, _, _ = paged_case(need + spare_blocks, block_size, seq_lens, key_shape=(1, 1), value_shape=(1, 1),
                                    dtype=torch.float32, seed=seed)
    starts = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    return tables, torch.tensor(seq_lens, dtype=torch.int32), starts, need + spare_blocks


def _grid(*shape, dtype, seed, low=-2, high=2) -> Tensor:
    """Small integers: every product and sum of the indexer's scores is exact in fp32 whatever the
    summation order, so each kernel's top-k (ties included) must equal the oracle's bit for bit."""
    return torch.randint(low, high + 1, shape, generator=_gen(seed)).to(dtype)


def _indexer_sample(name, dtype, seq_lens, q_lens, *, heads=4, dim=16, block_size=4, topk=5, weights_dtype=None,
                    view=False, int64=False, zero_q=False, q_high=2, compress_ratio=1, seed=0) -> Sample:
    """compress_ratio m > 1: the cache holds seq_lens[b] // m compressed entries per request (the
    table addresses those), and the sample passes m as the op's last argument."""
    tables, _, starts, num_blocks = _requests([n // compress_ratio for n in seq_lens], q_lens, block_size, seed=seed)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    tokens = int(starts[-1])
    k_cache = _grid(num_blocks, block_size, 1, 2 * dim if view else dim, dtype=dtype, seed=seed + 1)[..., :dim]
    q = _grid(tokens, heads, dim, dtype=dtype, seed=seed + 2, high=q_high) * (0 if zero_q else 1)
    weights = _grid(tokens, heads, dtype=weights_dtype or torch.float32, seed=seed + 3)
    if int64:
        tables, lens, starts = tables.long(), lens.long(), starts.long()
    ratio = () if compress_ratio == 1 else (compress_ratio,)
    return Sample(name, (q, weights, k_cache, tables, lens, starts, topk, 2.0 ** -2, *ratio))


def _indexer_samples(dtype):
    mixed = ([7, 12, 10], [7, 1, 3])  # a prefill from 0, a decode step, a chunk continuing a prefill
    return [
        _indexer_sample("prefill-decode-chunk", dtype, *mixed),
        _indexer_sample("topk-wider-than-context", dtype, *mixed, topk=32),
        _indexer_sample("weights-in-activation-dtype", dtype, *mixed, weights_dtype=dtype, seed=4),
        _indexer_sample("strided-key-pool-int64", dtype, *mixed, view=True, int64=True, seed=8),
        _indexer_sample("all-ties-lowest-positions-first", dtype, [9, 6], [2, 6], zero_q=True),
        # 4 heads, queries mostly below 0: many scores exactly 0 after the ReLU, tied across the k-th place
        _indexer_sample("relu-zero-ties-across-the-kth-place", dtype, *mixed, q_high=0, seed=20),
        _indexer_sample("block-size-1-idle-request", dtype, [5, 3, 4], [5, 0, 1], block_size=1, seed=12),
        _indexer_sample("no-tokens", dtype, [3, 0], [0, 0]),
        # DeepSeek-V3.2's indexer (64 heads x 128, top-2048) past the top-k: the choice matters
        _indexer_sample("v32-dims", dtype, [2100, 40], [1, 3], heads=64, dim=128, block_size=64, topk=2048,
                        seed=16),
        # DeepSeek-V4's compressed entries (one per m tokens, entry w seen from position (w+1)m - 1 on): a
        # prefill whose first m - 1 tokens see none, a decode step, a chunk; fewer entries than topk for some
        _indexer_sample("compressed-entries-ratio-4", dtype, [30, 13, 22], [30, 1, 5], topk=3, compress_ratio=4,
                        seed=24),
        _indexer_sample("compressed-entries-ratio-3-tail-block-int64", dtype, [17, 11], [4, 11], block_size=3,
                        topk=8, int64=True, compress_ratio=3, seed=28),
        # DeepSeek-V4-Flash's CSA indexer: 64 heads x 128, m = 4, top-512 out of 600 entries
        _indexer_sample("v4-dims-ratio-4", dtype, [2400, 40], [1, 3], heads=64, dim=128, block_size=64, topk=512,
                        compress_ratio=4, seed=32),
    ]


def _zero_column_requests():
    """One request with one query token and no cached token, through a block table without columns:
    values the host checks refuse (seq_lens[0] < its query tokens); the device paths read nothing."""
    return dict(block_tables=torch.zeros(1, 0, dtype=torch.int32), seq_lens=torch.zeros(1, dtype=torch.int32),
                query_start_loc=torch.tensor([0, 1], dtype=torch.int32))


def _indexer_unchecked_samples(dtype):
    requests = _zero_column_requests()
    return [Sample("zero-column-table", (_grid(1, 4, 16, dtype=dtype, seed=1), _grid(1, 4, dtype=torch.float32, seed=2),
                                         _grid(2, 4, 1, 16, dtype=dtype, seed=3), *requests.values(), 3, 0.25))]


def _sparse_unchecked_samples(dtype):
    d = SMALL
    requests = _zero_column_requests()
    kc, vc, *_ = paged_case(2, 4, [1], key_shape=(1, d.L), value_shape=(1, d.R), dtype=dtype, seed=1)
    q_latent, q_pe = _randn(1, d.N, d.L, dtype=dtype, seed=2), _randn(1, d.N, d.R, dtype=dtype, seed=3)
    return [Sample(f"zero-column-table-{name}", (q_latent, q_pe, kc, vc, *requests.values(),
                                                  torch.tensor([listed], dtype=torch.int32), (d.P + d.R) ** -0.5))
            for name, listed in (("none-listed", [-1]), ("positions-listed", [0, 3, -1]))]


def _request_errors(op: str, call):
    """The errors every sparse op shares on the request layout (block tables 2 x 3, block size 4, pool 6)."""
    i32 = torch.int32
    return [
        ErrorInput("tables-dtype", call(block_tables=torch.zeros(2, 3)), "block_tables",
                   rf"{op}: block_tables must be an int32"),
        ErrorInput("seq_lens-length", call(seq_lens=torch.tensor([9])), "seq_lens",
                   rf"{op}: seq_lens length must equal the number of block-table rows"),
        ErrorInput("query_start_loc-length", call(query_start_loc=torch.tensor([0, 3])), "query_start_loc",
                   rf"{op}: query_start_loc must have one entry per request plus one"),
        ErrorInput("query_start_loc-start", call(query_start_loc=torch.tensor([1, 2, 3], dtype=i32)), "query_start_loc",
                   r"query_start_loc must start at 0, got query_start_loc\[0\] = 1", ValueError),
        ErrorInput("query_start_loc-decreasing", call(query_start_loc=torch.tensor([0, 3, 2], dtype=i32)),
                   "query_start_loc", r"query_start_loc must never decrease, but query_start_loc\[2\] = 2",
                   ValueError),
        ErrorInput("query_start_loc-end", call(query_start_loc=torch.tensor([0, 1, 2], dtype=i32)), "query_start_loc",
                   r"query_start_loc\[-1\] = 2 must equal the number of query tokens \(3\)", ValueError),
        ErrorInput("fewer-cached-than-queries", call(seq_lens=torch.tensor([9, 1], dtype=i32)), "seq_lens",
                   r"seq_lens\[1\] = 1 is less than the request's 2 query tokens", ValueError),
        ErrorInput("past-capacity", call(seq_lens=torch.tensor([13, 2], dtype=i32)), "seq_lens",
                   r"seq_lens\[0\] = 13 needs 13 cached tokens, more than the block table's capacity \(3 blocks x 4\)",
                   ValueError),
        ErrorInput("length-near-2**63", call(seq_lens=torch.tensor([2**63 - 1, 2])), "seq_lens",
                   r"seq_lens\[0\] = 9223372036854775807 needs .* more than the block table's capacity", ValueError),
        ErrorInput("block-id", call(block_tables=torch.tensor([[0, 1, 6], [3, -1, -1]], dtype=i32)), "block_tables",
                   r"block_tables\[0, 2\] = 6 is used by sequence 0 but is not a block id in \[0, 6\)", ValueError),
        ErrorInput("block-id-near--2**63", call(block_tables=torch.tensor([[0, 1, 2], [-(2**63), 0, 0]])),
                   "block_tables", r"block_tables\[1, 0\] = -9223372036854775808 is used by sequence 1", ValueError),
    ]


def _request_base():
    """Two requests: 9 cached tokens (1 query token), 2 cached (2 query tokens); block size 4, 6 blocks."""
    return dict(block_tables=torch.tensor([[0, 1, 2], [3, -1, -1]], dtype=torch.int32),
                seq_lens=torch.tensor([9, 2], dtype=torch.int32),
                query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32))


def _indexer_errors():
    op = INDEXER_OP
    requests = _request_base()
    base = dict(q=torch.randn(3, 4, 8), weights=torch.randn(3, 4), k_cache=torch.randn(6, 4, 1, 8), **requests,
                topk=4, softmax_scale=0.5)

    def call(**changes):
        return Sample("", tuple(dict(base, **changes).values()))

    return [
        ErrorInput("q-rank", call(q=torch.randn(3, 32)), "q", rf"{op}: q must be 3-D"),
        ErrorInput("weights-dtype", call(weights=torch.ones(3, 4, dtype=torch.int32)), "weights",
                   rf"{op}: weights must be float32"),
        ErrorInput("weights-other-half-dtype", call(weights=torch.ones(3, 4, dtype=torch.float16)), "weights",
                   rf"{op}: weights must be float32 or q's dtype torch.float32, got torch.float16"),
        ErrorInput("weights-heads", call(weights=torch.randn(3, 5)), "weights", rf"{op}: weights heads .* must equal"),
        ErrorInput("k_cache-dim", call(k_cache=torch.randn(6, 4, 1, 7)), "k_cache",
                   rf"{op}: k_cache dim .* must equal index_head_dim"),
        ErrorInput("k_cache-heads", call(k_cache=torch.randn(6, 4, 2, 8)), "k_cache", rf"{op}: k_cache heads"),
        ErrorInput("k_cache-dtype", call(k_cache=torch.randn(6, 4, 1, 8).half()), "k_cache",
                   rf"{op}: k_cache has dtype torch.float16 but q"),
        ErrorInput("topk-zero", call(topk=0), "topk", rf"{op}: topk must be >= 1"),
        ErrorInput("scale-nan", call(softmax_scale=float("nan")), "softmax_scale",
                   rf"{op}: softmax_scale must be a positive normal float32 number"),
        *_scale_errors(op, call),
        *_request_errors(op, call),
        ErrorInput("compress_ratio-zero", Sample("", (*call().args, 0)), "compress_ratio",
                   rf"{op}: compress_ratio must be >= 1"),
        # 26 tokens at m = 2 are 13 entries: one more than 3 blocks of 4 hold
        ErrorInput("entries-past-capacity", Sample("", (*call(seq_lens=torch.tensor([26, 2])).args, 2)), "seq_lens",
                   r"seq_lens\[0\] = 26 needs 13 cached entries \(seq_lens // compress_ratio 2\), more than the block "
                   r"table's capacity \(3 blocks x 4\)", ValueError),
    ]


def _sparse_sample(name, d: Dims, dtype, seq_lens, q_lens, *, topk, block_size=4, view=False, int64=False,
                   seed=0) -> Sample:
    """Each token lists `topk` entries: distinct positions it can see in a shuffled order, -1 mixed in
    (and a token of each request lists nothing when its request has 2 or more tokens)."""
    tables, lens, starts, num_blocks = _requests(seq_lens, q_lens, block_size, seed=seed)
    tokens = int(starts[-1])
    if view:
        _, kc, vc = split_pool(num_blocks, block_size, d.L, d.R, dtype, seed=seed + 1)
    else:
        kc, vc, *_ = paged_case(num_blocks, block_size, [1], key_shape=(1, d.L), value_shape=(1, d.R), dtype=dtype,
                                seed=seed + 1)
    g = _gen(seed + 2)
    indices = torch.full((tokens, topk), -1, dtype=torch.int64)
    t = 0
    for n, q_len in zip(seq_lens, q_lens):
        for i in range(q_len):
            if q_len > 1 and i == 1:  # lists nothing: zeros
                t += 1
                continue
            seen = n - q_len + i + 1
            keep = torch.randperm(seen, generator=g)[: max(topk - 1, 0)]
            slots = torch.randperm(topk, generator=g)[: keep.shape[0]]
            indices[t, slots] = keep
            t += 1
    q_latent = _randn(tokens, d.N, d.L, dtype=dtype, seed=seed + 3)
    q_pe = _randn(tokens, d.N, d.R, dtype=dtype, seed=seed + 4)
    if int64:
        tables, lens, starts = tables.long(), lens.long(), starts.long()
    else:
        indices = indices.int()
    return Sample(name, (q_latent, q_pe, kc, vc, tables, lens, starts, indices, (d.P + d.R) ** -0.5))


def _sparse_samples(dtype):
    d = SMALL
    mixed = ([7, 12, 10], [7, 1, 3])
    v32 = dataclasses.replace(LITE, N=16, L=512, R=64)  # DeepSeek-V3.2's latent and rope dims, 16 heads
    return [
        _sparse_sample("prefill-decode-chunk", d, dtype, *mixed, topk=5),
        _sparse_sample("split-pool-views-int64", d, dtype, *mixed, topk=6, view=True, int64=True, seed=4),
        _sparse_sample("block-size-1", d, dtype, [6, 3], [2, 1], topk=4, block_size=1, seed=8),
        _sparse_sample("topk-width-0", d, dtype, [5], [1], topk=0),
        _sparse_sample("no-tokens", d, dtype, [3, 0], [0, 0], topk=3),
        _sparse_sample("v32-dims-top-2048", v32, dtype, [2100, 40], [1, 2], topk=2048, block_size=64, seed=12),
        _with_sinks(_sparse_sample("", d, dtype, *mixed, topk=5, seed=20), "prefill-decode-chunk-sinks", torch.float32,
                    seed=26),
        _with_sinks(_sparse_sample("", d, dtype, [6, 3], [2, 1], topk=4, block_size=1, seed=28),
                    "block-size-1-sinks-activation-dtype", dtype, seed=34),
        _with_q_scale(_with_sinks(_sparse_sample("", d, dtype, *mixed, topk=5, seed=36), "", torch.float32, seed=38),
                      "prefill-decode-chunk-q-scale-sinks", torch.float32, seed=40),
        _with_q_scale(Sample("", (*_sparse_sample("", d, dtype, [6, 3], [2, 1], topk=4, seed=42).args, None)),
                      "q-scale-activation-dtype", dtype, seed=44),
    ]


def _sparse_errors():
    op = SPARSE_OP
    requests = _request_base()
    base = dict(q_latent=torch.randn(3, 2, 8), q_pe=torch.randn(3, 2, 4), key_cache=torch.randn(6, 4, 1, 8),
                value_cache=torch.randn(6, 4, 1, 4), **requests,
                topk_indices=torch.tensor([[0, 8, -1], [0, -1, -1], [1, 0, -1]], dtype=torch.int32),
                softmax_scale=0.5)

    def call(**changes):
        return Sample("", tuple(dict(base, **changes).values()))

    return [
        ErrorInput("key_cache-heads", call(key_cache=torch.randn(6, 4, 2, 8)), "key_cache",
                   rf"{op}: key_cache heads .* must be 1"),
        ErrorInput("value_cache-dim", call(q_pe=torch.randn(3, 2, 5)), "value_cache",
                   rf"{op}: value_cache dim .* must equal rope_dim"),
        ErrorInput("q_pe-dtype", call(q_pe=torch.randn(3, 2, 4).double()), "q_pe", rf"{op}: q_pe has dtype"),
        ErrorInput("indices-dtype", call(topk_indices=torch.zeros(3, 3)), "topk_indices",
                   rf"{op}: topk_indices must be an int32"),
        ErrorInput("indices-rows", call(topk_indices=torch.zeros(2, 3, dtype=torch.int32)), "topk_indices",
                   rf"{op}: topk_indices tokens .* must equal q_latent's"),
        ErrorInput("scale-zero", call(softmax_scale=0.0), "softmax_scale",
                   rf"{op}: softmax_scale must be a positive normal float32 number"),
        *_scale_errors(op, call),
        *_request_errors(op, call),
        ErrorInput("index-past-length", call(topk_indices=torch.tensor([[0, 9, -1], [0, -1, -1], [1, 0, -1]])),
                   "topk_indices", r"topk_indices\[0, 1\] = 9 is not a position of request 0 \(its 9 cached tokens\)",
                   ValueError),
        ErrorInput("index-below--1", call(topk_indices=torch.tensor([[0, -1, -1], [0, -1, -1], [1, -2, -1]])),
                   "topk_indices", r"topk_indices\[2, 1\] = -2 is not a position of request 1", ValueError),
        ErrorInput("index-near-2**63", call(topk_indices=torch.tensor([[0, -1, -1], [2**63 - 1, -1, -1],
                                                                        [1, 0, -1]])),
                   "topk_indices", r"topk_indices\[1, 0\] = 9223372036854775807 is not a position of request 1",
                   ValueError),
        *_sink_errors(op, call, 2, "q_latent"),
        *_q_scale_errors(op, lambda **c: call(sinks=None, **c), 3, 2),
    ]


def _scatter_one_pool_samples(dtype):
    pair = [s for s in _scatter_samples(dtype) if s.rebuild is None]
    return ([dataclasses.replace(s, args=(s.args[0], s.args[2], s.args[4])) for s in pair]
            + _scatter_one_pool_aliased_samples(dtype))


def _scatter_one_pool_errors():
    cache = torch.zeros(4, 4, 1, 8)
    base = dict(key=torch.randn(3, 1, 8), cache=cache, slot_mapping=torch.tensor([0, 5, -1]))

    def call(**changes):
        return Sample("", tuple(dict(base, **changes).values()))

    op = "scatter_pa_cache"
    return [
        ErrorInput("cache-overlapping", call(cache=torch.zeros(1, 4, 1, 8).expand(4, 4, 1, 8)), "cache",
                   rf"{op}: cache has overlapping memory"),
        ErrorInput("cache-rank", call(cache=torch.zeros(16, 1, 8)), "cache", rf"{op}: cache must be 4-D"),
        ErrorInput("key-dim", call(key=torch.randn(3, 1, 7)), "key", rf"{op}: key head dim .* must equal cache"),
        ErrorInput("key-dtype", call(key=torch.randn(3, 1, 8).half()), "key", rf"{op}: key has dtype torch.float16"),
        ErrorInput("slots-length", call(slot_mapping=torch.tensor([0, 1])), "slot_mapping",
                   rf"{op}: slot_mapping length must equal the token count of key"),
        ErrorInput("slot-outside", call(slot_mapping=torch.tensor([0, 16, -1])), "slot_mapping",
                   r"scatter_pa_cache: slot_mapping\[1\] = 16 is outside the cache", ValueError),
        ErrorInput("slot-near-2**63", call(slot_mapping=torch.tensor([0, -1, 2**63 - 1])), "slot_mapping",
                   r"slot_mapping\[2\] = 9223372036854775807 is outside the cache", ValueError),
    ]


_register(OpCases("lightning_indexer", _indexer_samples, oracles.lightning_indexer_oracle, _indexer_errors,
                  bounds=EXACT, selftest=("prefill-decode-chunk", "v32-dims"),
                  paths={"sync-free": lightning_indexer_sync_free}, unchecked_samples=_indexer_unchecked_samples,
                  # torch_npu's npu_lightning_indexer documents the top-k set, not its order
                  unordered_backends=("npu",)))
_register(OpCases("sparse_mla_attention", _sparse_samples, oracles.sparse_mla_attention_oracle, _sparse_errors,
                  # as mla_decode_attention: fp32 scores and softmax, P rounded to the activation dtype
                  bounds=_eps_bounds(64, 2, 2), selftest=("prefill-decode-chunk", "v32-dims-top-2048"),
                  paths={"sync-free": sparse_mla_attention_sync_free}, unchecked_samples=_sparse_unchecked_samples))
_register(OpCases("scatter_pa_cache", _scatter_one_pool_samples, oracles.scatter_pa_cache_oracle,
                  _scatter_one_pool_errors, bounds=EXACT, paths={"sync-free": scatter_pa_cache_sync_free},
                  selftest=("padding", "v2lite")))


# ------------------------------------------------------------------------------------ MLA prefill
def _mla_prefill_sample(name, d: Dims, dtype, seq_lens, q_lens, *, block_size=4, view=False, int64=False,
                        seed=0) -> Sample:
    """Requests holding `seq_lens` cached tokens of which the last `q_lens` are the call's query tokens."""
    tables, lens, starts, num_blocks = _requests(seq_lens, q_lens, block_size, seed=seed)
    tokens = int(starts[-1])
    if view:
        _, kc, vc = split_pool(num_blocks, block_size, d.L, d.R, dtype, seed=seed + 1)
    else:
        kc, vc, *_ = paged_case(num_blocks, block_size, [1], key_shape=(1, d.L), value_shape=(1, d.R), dtype=dtype,
                                seed=seed + 1)
    q_latent = _randn(tokens, d.N, d.L, dtype=dtype, seed=seed + 2)
    q_pe = _randn(tokens, d.N, d.R, dtype=dtype, seed=seed + 3)
    if int64:
        tables, lens, starts = tables.long(), lens.long(), starts.long()
    return Sample(name, (q_latent, q_pe, kc, vc, tables, lens, starts, (d.P + d.R) ** -0.5))


def _mla_prefill_samples(dtype):
    d = SMALL
    return [
        # a prefill from 0, a decode step, a chunk continuing a prefill
        _mla_prefill_sample("prefill-decode-chunk", d, dtype, [7, 12, 10], [7, 1, 3]),
        _mla_prefill_sample("split-pool-views-int64", d, dtype, [7, 12, 10], [7, 1, 3], view=True, int64=True,
                            seed=4),
        _mla_prefill_sample("block-size-1", d, dtype, [6, 3], [2, 1], block_size=1, seed=8),
        _mla_prefill_sample("idle-request", d, dtype, [5, 3, 4], [5, 0, 1], seed=12),
        _mla_prefill_sample("no-tokens", d, dtype, [3, 0], [0, 0]),
        # more positions than one tile of the reference's online softmax (512), in blocks of 16
        _mla_prefill_sample("long-context-tiles", d, dtype, [1100, 530], [3, 530], block_size=16, seed=16),
        _mla_prefill_sample("v2lite-chunk", LITE, dtype, [300, 70], [40, 70], block_size=64, seed=20),
    ]


def _mla_prefill_unchecked_samples(dtype):
    d = SMALL
    requests = _zero_column_requests()
    kc, vc, *_ = paged_case(2, 4, [1], key_shape=(1, d.L), value_shape=(1, d.R), dtype=dtype, seed=1)
    q_latent, q_pe = _randn(1, d.N, d.L, dtype=dtype, seed=2), _randn(1, d.N, d.R, dtype=dtype, seed=3)
    return [Sample("zero-column-table", (q_latent, q_pe, kc, vc, *requests.values(), (d.P + d.R) ** -0.5))]


def _mla_prefill_errors():
    op = "mla_prefill_attention"
    requests = _request_base()
    base = dict(q_latent=torch.randn(3, 2, 8), q_pe=torch.randn(3, 2, 4), key_cache=torch.randn(6, 4, 1, 8),
                value_cache=torch.randn(6, 4, 1, 4), **requests, softmax_scale=0.5)

    def call(**changes):
        return Sample("", tuple(dict(base, **changes).values()))

    return [
        ErrorInput("q_latent-rank", call(q_latent=torch.randn(3, 16)), "q_latent", rf"{op}: q_latent must be 3-D"),
        ErrorInput("q_pe-tokens", call(q_pe=torch.randn(2, 2, 4)), "q_pe",
                   rf"{op}: q_pe tokens \(dim 0\) must equal q_latent's"),
        ErrorInput("key_cache-heads", call(key_cache=torch.randn(6, 4, 2, 8)), "key_cache",
                   rf"{op}: key_cache heads .* must be 1"),
        ErrorInput("value_cache-dim", call(q_pe=torch.randn(3, 2, 5)), "value_cache",
                   rf"{op}: value_cache dim .* must equal rope_dim"),
        ErrorInput("value_cache-blocks", call(value_cache=torch.randn(5, 4, 1, 4)), "value_cache",
                   rf"{op}: value_cache num_blocks"),
        ErrorInput("q_pe-dtype", call(q_pe=torch.randn(3, 2, 4).double()), "q_pe", rf"{op}: q_pe has dtype"),
        ErrorInput("key_cache-dtype", call(key_cache=torch.randn(6, 4, 1, 8).half()), "key_cache",
                   rf"{op}: key_cache has dtype torch.float16"),
        ErrorInput("empty-pool", call(key_cache=torch.randn(0, 4, 1, 8), value_cache=torch.randn(0, 4, 1, 4)),
                   "key_cache", rf"{op}: key_cache needs at least one block"),
        ErrorInput("scale-nan", call(softmax_scale=float("nan")), "softmax_scale",
                   rf"{op}: softmax_scale must be a positive normal float32 number \(e\.g\. qk_head_dim"),
        *_scale_errors(op, call),
        *_request_errors(op, call),
    ]


_register(OpCases("mla_prefill_attention", _mla_prefill_samples, oracles.mla_prefill_attention_oracle,
                  _mla_prefill_errors,
                  # as mla_decode_attention: fp32 scores and softmax, P rounded to the activation dtype
                  bounds=_eps_bounds(64, 2, 2), selftest=("prefill-decode-chunk", "v2lite-chunk"),
                  paths={"sync-free": mla_prefill_attention_sync_free},
                  unchecked_samples=_mla_prefill_unchecked_samples))


def _starts(counts, int64: bool) -> Tensor:
    starts = torch.zeros(len(counts) + 1, dtype=torch.int64 if int64 else torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0)
    return starts


def _mha_prefill_sample(name, dtype, q_lens, k_lens, *, heads=4, qk_dim=12, v_dim=8, views=False,
                        shared_heads=False, int64=False, seed=0) -> Sample:
    """Requests of `q_lens` query tokens over `k_lens` keys (context first, then the query tokens' own);
    with `views`, k and v are column views of one [S, N, Dqk + Dv] tensor and q a column view of a wider one;
    with `shared_heads`, k and v are one head expanded over all (stride 0 on the heads dim)."""
    tokens, keys = sum(q_lens), sum(k_lens)
    if shared_heads:
        q = _randn(tokens, heads, qk_dim, dtype=dtype, seed=seed)
        k = _randn(keys, 1, qk_dim, dtype=dtype, seed=seed + 1).expand(keys, heads, qk_dim)
        v = _randn(keys, 1, v_dim, dtype=dtype, seed=seed + 2).expand(keys, heads, v_dim)
    elif views:
        q = _randn(tokens, heads, qk_dim + 5, dtype=dtype, seed=seed)[..., 5:]
        kv = _randn(keys, heads, qk_dim + v_dim, dtype=dtype, seed=seed + 1)
        k, v = kv[..., :qk_dim], kv[..., qk_dim:]
    else:
        q = _randn(tokens, heads, qk_dim, dtype=dtype, seed=seed)
        k = _randn(keys, heads, qk_dim, dtype=dtype, seed=seed + 1)
        v = _randn(keys, heads, v_dim, dtype=dtype, seed=seed + 2)
    return Sample(name, (q, k, v, _starts(q_lens, int64), _starts(k_lens, int64), qk_dim ** -0.5))


def _mha_prefill_samples(dtype):
    return [
        # a chunk over context, a decode-like token (q_len == k_len == 1), a chunk over context
        _mha_prefill_sample("context-and-new", dtype, [5, 1, 3], [9, 1, 7]),
        _mha_prefill_sample("no-context-square", dtype, [4, 6], [4, 6], seed=4),
        _mha_prefill_sample("one-token-each", dtype, [1, 1], [17, 5], int64=True, seed=8),
        # requests without query tokens, one with keys and one without
        _mha_prefill_sample("idle-requests", dtype, [3, 0, 2, 0], [5, 4, 2, 0], seed=12),
        _mha_prefill_sample("no-tokens", dtype, [0, 0], [3, 0], seed=16),
        _mha_prefill_sample("v-head-wider-than-qk", dtype, [3, 2], [6, 2], qk_dim=8, v_dim=12, seed=20),
        _mha_prefill_sample("strided-views-int64", dtype, [5, 1, 3], [9, 1, 7], views=True, int64=True, seed=24),
        # DeepSeek-V2's head dims: 192 = 128 nope + 64 rope for q and k, 128 for v
        _mha_prefill_sample("v2-dims", dtype, [40, 70], [300, 70], heads=16, qk_dim=192, v_dim=128, seed=28),
        # past the native kernel's blocks: 800 queries (blocks of 256) over 1400 keys (blocks of 512), a chunk of
        # 40 over 600 keys
        _mha_prefill_sample("past-one-block", dtype, [800, 40], [1400, 600], heads=2, seed=32),
        _mha_prefill_sample("shared-heads-expanded", dtype, [5, 2], [9, 2], shared_heads=True, seed=36),
    ]


def _mha_prefill_errors():
    op = "mha_prefill_attention"
    i32 = torch.int32
    base = dict(q=torch.randn(3, 2, 8), k=torch.randn(5, 2, 8), v=torch.randn(5, 2, 4),
                query_start_loc=torch.tensor([0, 1, 3], dtype=i32), key_start_loc=torch.tensor([0, 3, 5], dtype=i32),
                softmax_scale=0.5)

    def call(**changes):
        return Sample("", tuple(dict(base, **changes).values()))

    return [
        ErrorInput("q-dtype", call(q=torch.ones(3, 2, 8, dtype=i32)), "q", rf"{op}: q must be float32"),
        ErrorInput("q-rank", call(q=torch.randn(3, 16)), "q", rf"{op}: q must be 3-D"),
        ErrorInput("q-head-dim-0", call(q=torch.randn(3, 2, 0), k=torch.randn(5, 2, 0)), "q",
                   rf"{op}: q head dim \(dim 2\) must be >= 1"),
        ErrorInput("k-rank", call(k=torch.randn(5, 16)), "k", rf"{op}: k must be 3-D"),
        ErrorInput("k-dtype", call(k=torch.randn(5, 2, 8).half()), "k", rf"{op}: k has dtype torch.float16"),
        ErrorInput("k-heads", call(k=torch.randn(5, 3, 8)), "k", rf"{op}: k heads \(dim 1\) must equal q's"),
        ErrorInput("k-head-dim", call(k=torch.randn(5, 2, 6)), "k", rf"{op}: k head dim \(dim 2\) must equal q's"),
        ErrorInput("v-dtype", call(v=torch.randn(5, 2, 4).double()), "v", rf"{op}: v has dtype torch.float64"),
        ErrorInput("v-keys", call(v=torch.randn(4, 2, 4)), "v", rf"{op}: v keys \(dim 0\) must equal k's"),
        ErrorInput("v-heads", call(v=torch.randn(5, 1, 4)), "v", rf"{op}: v heads \(dim 1\) must equal q's"),
        ErrorInput("v-head-dim-0", call(v=torch.randn(5, 2, 0)), "v", rf"{op}: v head dim \(dim 2\) must be >= 1"),
        ErrorInput("query_start_loc-dtype", call(query_start_loc=torch.tensor([0.0, 1.0, 3.0])), "query_start_loc",
                   rf"{op}: query_start_loc must be an int32"),
        ErrorInput("key_start_loc-rank", call(key_start_loc=torch.tensor([[0, 3, 5]])), "key_start_loc",
                   rf"{op}: key_start_loc must be 1-D"),
        ErrorInput("key_start_loc-length", call(key_start_loc=torch.tensor([0, 5])), "key_start_loc",
                   rf"{op}: key_start_loc length must equal query_start_loc's"),
        ErrorInput("query_start_loc-empty", call(query_start_loc=torch.zeros(0, dtype=i32),
                                                 key_start_loc=torch.zeros(0, dtype=i32)), "query_start_loc",
                   rf"{op}: query_start_loc must have one entry per request plus one"),
        ErrorInput("scale-zero", call(softmax_scale=0.0), "softmax_scale",
                   rf"{op}: softmax_scale must be a positive normal float32 number \(e\.g\. qk_head_dim"),
        *_scale_errors(op, call),
        ErrorInput("query_start_loc-start", call(query_start_loc=torch.tensor([1, 2, 3], dtype=i32)), "query_start_loc",
                   r"query_start_loc must start at 0, got query_start_loc\[0\] = 1", ValueError),
        ErrorInput("query_start_loc-decreasing", call(query_start_loc=torch.tensor([0, 3, 2], dtype=i32)),
                   "query_start_loc", r"query_start_loc must never decrease, but query_start_loc\[2\] = 2",
                   ValueError),
        ErrorInput("query_start_loc-end", call(query_start_loc=torch.tensor([0, 1, 2], dtype=i32)), "query_start_loc",
                   r"query_start_loc\[-1\] = 2 must equal the number of query tokens \(3\)", ValueError),
        ErrorInput("key_start_loc-start", call(key_start_loc=torch.tensor([2, 3, 5], dtype=i32)), "key_start_loc",
                   r"key_start_loc must start at 0, got key_start_loc\[0\] = 2", ValueError),
        ErrorInput("key_start_loc-end", call(key_start_loc=torch.tensor([0, 3, 4], dtype=i32)), "key_start_loc",
                   r"key_start_loc\[-1\] = 4 must equal the number of keys \(5\)", ValueError),
        ErrorInput("key_start_loc-near-2**63", call(key_start_loc=torch.tensor([0, 2**63 - 1, 5])), "key_start_loc",
                   r"key_start_loc must never decrease, but key_start_loc\[2\] = 5 < key_start_loc\[1\] = "
                   r"9223372036854775807", ValueError),
        ErrorInput("fewer-keys-than-queries", call(key_start_loc=torch.tensor([0, 4, 5], dtype=i32)), "key_start_loc",
                   r"request 1 has 2 query tokens \(query_start_loc\) but 1 keys \(key_start_loc\); its keys must "
                   r"include its query tokens", ValueError),
    ]


_register(OpCases("mha_prefill_attention", _mha_prefill_samples, oracles.mha_prefill_attention_oracle,
                  _mha_prefill_errors,
                  # the reference (ATen's flash kernel): fp32 scores, softmax and accumulation, its output
                  # rounded to the activation dtype; with context, two such outputs merged in fp32 and rounded
                  # once more (the native kernel rounds once)
                  bounds=_eps_bounds(64, 2, 2), selftest=("context-and-new", "v2-dims"),
                  paths={"sdpa": mha_prefill_attention_sdpa}))


# ------------------------------------------------------------------------------------ DeepSeek-V4
def _free_columns_before_windows(tables: Tensor, seq_lens, q_lens, block_size: int, window: int) -> Tensor:
    """-1 in every block-table column wholly before the window of a request's first query token: the
    blocks a serving engine frees once no window reads them."""
    tables = tables.clone()
    for b, (n, q_len) in enumerate(zip(seq_lens, q_lens)):
        if q_len:
            tables[b, : max(0, n - q_len - window + 1) // block_size] = -1
    return tables


def _listed_entries(seq_lens, q_lens, ratio: int, topk: int, *, repeat: bool, seed: int) -> Tensor:
    """[T, topk] int64: each token lists up to topk - 1 distinct entries it sees (w < (p + 1) // m) in
    a shuffled order, -1 elsewhere; with `repeat`, the last token listing two or more lists its first
    entry once more (attended twice)."""
    g = _gen(seed)
    rows = []
    for n, q_len in zip(seq_lens, q_lens):
        for i in range(q_len):
            row = torch.full((topk,), -1, dtype=torch.int64)
            keep = torch.randperm((n - q_len + i + 1) // ratio, generator=g)[: max(topk - 1, 0)]
            row[torch.randperm(topk, generator=g)[: keep.shape[0]]] = keep
            rows.append(row)
    listed = torch.stack(rows) if rows else torch.zeros(0, topk, dtype=torch.int64)
    if repeat:
        t = max(t for t in range(listed.shape[0]) if int((listed[t] >= 0).sum()) >= 2)
        slots = torch.nonzero(listed[t] >= 0)[:, 0]
        listed[t, slots[1]] = listed[t, slots[0]]
    return listed


def _shared_kv_sample(name, dtype, seq_lens, q_lens, *, window, heads=4, dim=32, block_size=4, ratio=None,
                      entry_block_size=3, topk=None, repeat=False, sinks="float32", freed=False, view=False,
                      int64=False, seed=0) -> Sample:
    """Requests of `seq_lens` tokens whose last `q_lens` are this call's query tokens, a window pool and,
    with `ratio`, a pool of seq_lens // ratio compressed entries per request (every visible one attended,
    or with `topk` the listed ones); sinks "float32", "activation" (q's dtype) or None; `freed`: -1 in
    the columns before each request's window; `view`: both pools are views [..., :D] of wider ones."""
    tables, lens, starts, num_blocks = _requests(seq_lens, q_lens, block_size, seed=seed)
    if freed:
        tables = _free_columns_before_windows(tables, seq_lens, q_lens, block_size, window)
    tokens = int(starts[-1])
    width = 2 * dim if view else dim
    kv_cache = _randn(num_blocks, block_size, 1, width, dtype=dtype, seed=seed + 1)[..., :dim]
    q = _randn(tokens, heads, dim, dtype=dtype, seed=seed + 2)
    sink_dtype = {"float32": torch.float32, "activation": dtype, None: None}[sinks]
    # O(1) sink logits against O(1) scores: the sink's share of the denominator is far from 0 and 1
    sink_logits = None if sink_dtype is None else _randn(heads, dtype=sink_dtype, seed=seed + 3, scale=1.5)
    args = [q, kv_cache, tables, lens, starts, sink_logits, dim ** -0.5, window]
    if ratio is not None:
        entries = [n // ratio for n in seq_lens]
        entry_tables, _, _, entry_blocks = _requests(entries, q_lens, entry_block_size, seed=seed + 4)
        entry_cache = _randn(entry_blocks, entry_block_size, 1, width, dtype=dtype, seed=seed + 5)[..., :dim]
        listed = None if topk is None else _listed_entries(seq_lens, q_lens, ratio, topk, repeat=repeat,
                                                           seed=seed + 6)
        if int64:
            entry_tables = entry_tables.long()
        elif listed is not None:
            listed = listed.int()
        args += [entry_cache, entry_tables, ratio, listed]
    if int64:
        args[2:5] = [t.long() for t in args[2:5]]
    return Sample(name, tuple(args))


# DeepSeek-V4-Flash's attention dims, 16 of its 64 heads: head_dim 512, window 128, block size 64
_V4 = dict(heads=16, dim=512, window=128, block_size=64, entry_block_size=64)


def _shared_kv_samples(dtype):
    mixed = ([7, 12, 10], [7, 1, 3])  # a prefill from 0, a decode step, a chunk continuing a prefill
    return [
        _shared_kv_sample("window-prefill-decode-chunk", dtype, *mixed, window=5),
        _shared_kv_sample("window-no-sinks", dtype, *mixed, window=5, sinks=None, seed=2),
        _shared_kv_sample("window-1-only-itself", dtype, *mixed, window=1, seed=4),
        _shared_kv_sample("window-wider-than-every-context", dtype, *mixed, window=64, seed=6),
        # every visible entry (heavily compressed attention)
        _shared_kv_sample("window-and-all-visible-entries", dtype, *mixed, window=5, ratio=2, seed=8),
        _shared_kv_sample("all-visible-entries-no-sinks-ratio-4", dtype, [13, 9, 20], [13, 1, 6], window=3,
                          ratio=4, sinks=None, seed=10),
        _shared_kv_sample("sinks-in-activation-dtype", dtype, *mixed, window=5, ratio=2, sinks="activation",
                          seed=12),
        # the indexer's picks (compressed sparse attention), -1 mixed in, int64 tables and indices
        _shared_kv_sample("window-and-listed-entries-int64", dtype, *mixed, window=5, ratio=2, topk=4, int64=True,
                          seed=14),
        _shared_kv_sample("listed-entry-repeated-no-sinks", dtype, [19, 9], [5, 1], window=4, ratio=2, topk=5,
                          repeat=True, sinks=None, seed=16),
        _shared_kv_sample("listed-width-0", dtype, [9, 6], [1, 2], window=3, ratio=2, topk=0, seed=18),
        _shared_kv_sample("prefill-from-0", dtype, [37], [37], window=8, ratio=4, seed=20),
        _shared_kv_sample("chunked-prefill-freed-blocks", dtype, [30], [11], window=8, ratio=4, topk=3, freed=True,
                          seed=22),
        _shared_kv_sample("decode-batch-freed-blocks", dtype, [21, 9, 34], [1, 1, 1], window=6, ratio=4, freed=True,
                          seed=24),
        # windows and entries straddling blocks of 3 and 5
        _shared_kv_sample("block-size-not-dividing", dtype, [23, 17], [9, 2], window=7, block_size=3, ratio=3,
                          entry_block_size=5, topk=4, freed=True, seed=26),
        _shared_kv_sample("split-pool-views", dtype, *mixed, window=5, ratio=2, view=True, seed=28),
        _shared_kv_sample("idle-request", dtype, [5, 3, 8], [5, 0, 2], window=4, ratio=2, seed=30),
        _shared_kv_sample("no-tokens", dtype, [3, 0], [0, 0], window=4, ratio=2, seed=32),
        # DeepSeek-V4-Flash dims: CSA (m = 4, 64 of the entries listed) decode and a chunk, HCA (m = 128)
        # prefill of 300 tokens (two chunks of the reference's query-token loop)
        _shared_kv_sample("v4-flash-csa-decode-chunk", dtype, [700, 300], [1, 2], ratio=4, topk=64, freed=True,
                          seed=34, **_V4),
        _shared_kv_sample("v4-flash-hca-prefill", dtype, [520], [300], ratio=128, freed=True, seed=36, **_V4),
    ]


def _shared_kv_unchecked_samples(dtype):
    """Values the CPU checks refuse; the device path attends to what they address and nothing else."""
    d = dict(window=5, ratio=2, seed=40)
    zero = _shared_kv_sample("zero-column-table", dtype, [1], [1], window=4, ratio=1, seed=38)
    requests = _zero_column_requests()
    zero = Sample("zero-column-table", (zero.args[0], zero.args[1], *requests.values(), *zero.args[5:8],
                                        zero.args[8], torch.zeros(1, 0, dtype=torch.int32), 1, None))
    read_freed = _shared_kv_sample("", dtype, [12, 6], [2, 1], **d)
    tables = read_freed.args[2].clone()
    tables[0, 2] = -1  # holds positions 8..11, in the window of both query tokens of request 0
    listed = _shared_kv_sample("", dtype, [12, 6], [2, 1], topk=4, **d)
    indices = listed.args[11].clone()
    indices[0] = torch.tensor([5, 6, 0, 9], dtype=indices.dtype)  # position 10 sees entries 0..4
    outside = list(listed.args[:10])
    outside[9] = outside[9].clone()
    outside[9][1, 0] = 99  # request 1's entries 0..2: not a block of the pool
    return [
        zero,
        Sample("window-block-outside-pool", (*read_freed.args[:2], tables, *read_freed.args[3:])),
        Sample("listed-entries-not-visible", (*listed.args[:11], indices)),
        Sample("entry-block-outside-pool", (*outside, *listed.args[10:])),
    ]


def _shared_kv_errors():
    op = "shared_kv_attention"
    requests = _request_base()  # request 0: 9 tokens, 1 query token (position 8); request 1: 2 and 2
    base = dict(q=torch.randn(3, 2, 8), kv_cache=torch.randn(6, 4, 1, 8), **requests, sinks=torch.randn(2),
                softmax_scale=0.5, sliding_window=4, compressed_cache=torch.randn(4, 2, 1, 8),
                compressed_block_tables=torch.tensor([[0, 1], [2, -1]], dtype=torch.int32), compress_ratio=2,
                topk_indices=torch.tensor([[3, 0, -1], [-1, -1, -1], [0, -1, -1]], dtype=torch.int32))

    def call(**changes):
        return Sample("", tuple(dict(base, **changes).values()))

    no_entries = dict(compressed_cache=None, compressed_block_tables=None, topk_indices=None)
    all_visible = dict(topk_indices=None)
    i32 = torch.int32
    return [
        ErrorInput("q-rank", call(q=torch.randn(3, 16)), "q", rf"{op}: q must be 3-D"),
        ErrorInput("q-dtype", call(q=torch.ones(3, 2, 8, dtype=torch.int32)), "q", rf"{op}: q must be float32"),
        ErrorInput("kv_cache-heads", call(kv_cache=torch.randn(6, 4, 2, 8)), "kv_cache",
                   rf"{op}: kv_cache heads \(dim 2\) must be 1"),
        ErrorInput("kv_cache-dim", call(kv_cache=torch.randn(6, 4, 1, 7)), "kv_cache",
                   rf"{op}: kv_cache dim \(dim 3\) must equal head_dim"),
        ErrorInput("kv_cache-dtype", call(kv_cache=torch.randn(6, 4, 1, 8).half()), "kv_cache",
                   rf"{op}: kv_cache has dtype torch.float16 but q"),
        ErrorInput("kv_cache-empty-pool", call(kv_cache=torch.randn(0, 4, 1, 8)), "kv_cache",
                   rf"{op}: kv_cache needs at least one block"),
        *_sink_errors(op, call, 2, "q"),
        ErrorInput("sliding_window-zero", call(sliding_window=0), "sliding_window",
                   rf"{op}: sliding_window must be >= 1"),
        ErrorInput("compress_ratio-zero", call(compress_ratio=0), "compress_ratio",
                   rf"{op}: compress_ratio must be >= 1"),
        ErrorInput("compressed-tables-missing", call(compressed_block_tables=None, topk_indices=None),
                   "compressed_block_tables", rf"{op}: compressed_cache was given without compressed_block_tables"),
        ErrorInput("compressed-tables-without-cache", call(compressed_cache=None, topk_indices=None),
                   "compressed_block_tables", rf"{op}: compressed_block_tables was given without compressed_cache"),
        ErrorInput("topk-without-entries", call(compressed_cache=None, compressed_block_tables=None), "topk_indices",
                   rf"{op}: topk_indices lists compressed entries, but compressed_cache is None"),
        ErrorInput("compressed_cache-dim", call(compressed_cache=torch.randn(4, 2, 1, 7)), "compressed_cache",
                   rf"{op}: compressed_cache dim \(dim 3\) must equal head_dim"),
        ErrorInput("compressed_cache-heads", call(compressed_cache=torch.randn(4, 2, 2, 8)), "compressed_cache",
                   rf"{op}: compressed_cache heads \(dim 2\) must be 1"),
        ErrorInput("compressed_cache-dtype", call(compressed_cache=torch.randn(4, 2, 1, 8).bfloat16()),
                   "compressed_cache", rf"{op}: compressed_cache has dtype torch.bfloat16 but q"),
        ErrorInput("compressed-tables-rows", call(compressed_block_tables=torch.zeros(1, 2, dtype=i32)),
                   "compressed_block_tables", rf"{op}: compressed_block_tables rows must equal block_tables'"),
        ErrorInput("compressed-tables-dtype", call(compressed_block_tables=torch.zeros(2, 2)),
                   "compressed_block_tables", rf"{op}: compressed_block_tables must be an int32"),
        ErrorInput("topk-rows", call(topk_indices=torch.zeros(2, 3, dtype=i32)), "topk_indices",
                   rf"{op}: topk_indices tokens \(dim 0\) must equal q's"),
        ErrorInput("topk-dtype", call(topk_indices=torch.zeros(3, 3)), "topk_indices",
                   rf"{op}: topk_indices must be an int32"),
        ErrorInput("scale-nan", call(softmax_scale=float("nan")), "softmax_scale",
                   rf"{op}: softmax_scale must be a positive normal float32 number"),
        *_scale_errors(op, call),
        # request 0's window (positions 5..8) reads columns 1 and 2 only; request 1's column 0
        *_request_errors(op, call),
        ErrorInput("window-block-freed-but-read", call(block_tables=torch.tensor([[0, -1, 2], [3, -1, -1]], dtype=i32)),
                   "block_tables", r"block_tables\[0, 1\] = -1 is used by sequence 0 but is not a block id in \[0, 6\)",
                   ValueError),
        ErrorInput("window-only-block-id", call(**no_entries, block_tables=torch.tensor([[0, 1, 2], [6, -1, -1]])),
                   "block_tables", r"block_tables\[1, 0\] = 6 is used by sequence 1", ValueError),
        ErrorInput("entries-past-capacity", call(compressed_block_tables=torch.tensor([[0], [2]], dtype=i32)),
                   "compressed_block_tables",
                   r"seq_lens\[0\] = 9 needs 4 compressed entries \(seq_lens // compress_ratio 2\), more than "
                   r"compressed_block_tables' capacity \(1 blocks x 2\)", ValueError),
        ErrorInput("entry-not-visible", call(topk_indices=torch.tensor([[4, 0, -1], [-1, -1, -1], [0, -1, -1]])),
                   "topk_indices", r"topk_indices\[0, 0\] = 4 is neither -1 \(none\) nor a compressed entry token 0 "
                   r"sees \(request 0, position 8: the entries w < \(position \+ 1\) // compress_ratio = 4\)",
                   ValueError),
        ErrorInput("entry-not-yet-visible-in-prefill",
                   call(topk_indices=torch.tensor([[3, 0, -1], [0, -1, -1], [0, -1, -1]], dtype=i32)), "topk_indices",
                   r"topk_indices\[1, 0\] = 0 is neither -1 \(none\) nor a compressed entry token 1 sees \(request 1, "
                   r"position 0: .* = 0\)", ValueError),
        ErrorInput("entry-below--1", call(topk_indices=torch.tensor([[3, -2, -1], [-1, -1, -1], [0, -1, -1]])),
                   "topk_indices", r"topk_indices\[0, 1\] = -2 is neither -1", ValueError),
        ErrorInput("entry-near-2**63", call(topk_indices=torch.tensor([[3, 0, -1], [-1, -1, -1], [2**63 - 1, -1, -1]])),
                   "topk_indices", r"topk_indices\[2, 0\] = 9223372036854775807 is neither -1", ValueError),
        ErrorInput("listed-entry-block-id", call(compressed_block_tables=torch.tensor([[0, 9], [2, -1]], dtype=i32)),
                   "compressed_block_tables", r"compressed_block_tables\[0, 1\] = 9 is used by sequence 0 "
                   r"\(topk_indices\[0, 0\] = 3\) but is not a block id in \[0, 4\)", ValueError),
        ErrorInput("visible-entry-block-id",
                   call(**all_visible, compressed_block_tables=torch.tensor([[0, -1], [2, -1]], dtype=i32)),
                   "compressed_block_tables",
                   r"compressed_block_tables\[0, 1\] = -1 is used by sequence 0 but is not a block id in \[0, 4\)",
                   ValueError),
    ]


_register(OpCases("shared_kv_attention", _shared_kv_samples, oracles.shared_kv_attention_oracle, _shared_kv_errors,
                  # fp32 logits, softmax and P @ rows (the rows copied exactly), the output rounded once
                  bounds=_eps_bounds(64, 2, 2),
                  selftest=("v4-flash-csa-decode-chunk", "v4-flash-hca-prefill"),
                  paths={"sync-free": shared_kv_attention_sync_free},
                  unchecked_samples=_shared_kv_unchecked_samples))


def _v4_rope_tables(dtype, batch: int, seq: int, rope_dim: int, *, rounded: bool, shared: bool = False):
    """cos / sin per token [B, S, R/2] (or [S, R/2]): fp32 as computed, or rounded to the model dtype as
    stock's rotary module hands them over."""
    cos, sin = _tables(dtype, batch, seq, rope_dim, offset=11, batched=not shared)
    return (cos.to(dtype), sin.to(dtype)) if rounded else (cos, sin)


def _norm_weight(size: int, dtype, seed: int) -> Tensor:
    return (1 + 0.1 * torch.randn(size, generator=_gen(seed))).to(dtype)


def _shared_kv_q_prolog_sample(name, dtype, *, batch=2, seq=5, hidden=64, lora=32, heads=4, head_dim=32, rope_dim=8,
                               norm_dtype=torch.float32, rounded_tables=False, shared_tables=False, seed=0):
    g = _gen(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    cos, sin = _v4_rope_tables(dtype, batch, seq, rope_dim, rounded=rounded_tables, shared=shared_tables)
    return Sample(name, (rand(batch, seq, hidden), rand(lora, hidden, scale=hidden ** -0.5),
                         _norm_weight(lora, norm_dtype, seed + 1), rand(heads * head_dim, lora, scale=lora ** -0.5),
                         cos, sin), {"num_heads": heads})


def _shared_kv_q_prolog_samples(dtype):
    return [
        _shared_kv_q_prolog_sample("small", dtype),
        _shared_kv_q_prolog_sample("tables-SR", dtype, shared_tables=True, seed=2),
        # a bf16 / fp16 model loaded without keeping the norm weight in fp32; tables rounded to the model dtype
        _shared_kv_q_prolog_sample("norm-weight-and-tables-in-activation-dtype", dtype, norm_dtype=dtype,
                                   rounded_tables=True, seed=4),
        _shared_kv_q_prolog_sample("decode", dtype, seq=1, seed=6),
        # DeepSeek-V4-Flash's rotary dim 64 (its head_dim 512 and q_lora_rank 1024 at a smaller hidden size)
        _shared_kv_q_prolog_sample("v4-flash-rope-64", dtype, batch=1, seq=3, hidden=256, lora=1024, heads=2,
                                   head_dim=512, rope_dim=64, rounded_tables=True, seed=8),
        _shared_kv_q_prolog_sample("empty-seq", dtype, seq=0, seed=10),
    ]


def _shared_kv_prolog_sample(name, dtype, *, batch=2, seq=5, hidden=64, head_dim=32, rope_dim=8,
                             norm_dtype=torch.float32, rounded_tables=False, shared_tables=False, seed=0):
    g = _gen(seed)
    cos, sin = _v4_rope_tables(dtype, batch, seq, rope_dim, rounded=rounded_tables, shared=shared_tables)
    return Sample(name, ((torch.randn(batch, seq, hidden, generator=g)).to(dtype),
                         (torch.randn(head_dim, hidden, generator=g) * hidden ** -0.5).to(dtype),
                         _norm_weight(head_dim, norm_dtype, seed + 1), cos, sin))


def _shared_kv_prolog_samples(dtype):
    return [
        _shared_kv_prolog_sample("small", dtype),
        _shared_kv_prolog_sample("tables-SR", dtype, shared_tables=True, seed=2),
        _shared_kv_prolog_sample("norm-weight-and-tables-in-activation-dtype", dtype, norm_dtype=dtype,
                                 rounded_tables=True, seed=4),
        _shared_kv_prolog_sample("rope-on-the-whole-row", dtype, head_dim=8, rope_dim=8, seed=6),
        _shared_kv_prolog_sample("v4-flash-rope-64", dtype, batch=1, seq=3, hidden=256, head_dim=512, rope_dim=64,
                                 rounded_tables=True, seed=8),
        _shared_kv_prolog_sample("empty-seq", dtype, seq=0, seed=10),
    ]


def _v4_prolog_errors(op: str):
    hidden = torch.randn(2, 5, 64)
    cos, sin = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    if op == "shared_kv_q_prolog":
        base = dict(hidden_states=hidden, q_a_weight=torch.randn(32, 64), q_norm_weight=torch.ones(32),
                    q_b_weight=torch.randn(4 * 32, 32), cos=cos, sin=sin)
        kwargs = {"num_heads": 4}
        weight, norm, head = "q_a_weight", "q_norm_weight", "head_dim"
    else:
        base = dict(hidden_states=hidden, kv_weight=torch.randn(32, 64), kv_norm_weight=torch.ones(32), cos=cos,
                    sin=sin)
        kwargs = {}
        weight, norm, head = "kv_weight", "kv_norm_weight", "head_dim"

    def call(extra=None, **changes):
        return Sample("", tuple(dict(base, **changes).values()), {**kwargs, **(extra or {})})

    errors = [
        ErrorInput("hidden-rank", call(hidden_states=hidden[0]), "hidden_states", rf"{op}: hidden_states must be 3-D"),
        ErrorInput("hidden-dtype", call(hidden_states=hidden.int()), "hidden_states",
                   rf"{op}: hidden_states must be float32"),
        ErrorInput("weight-dtype", call(**{weight: base[weight].half()}), weight,
                   rf"{op}: {weight} has dtype torch.float16 but hidden_states"),
        ErrorInput("weight-in-features", call(**{weight: base[weight][:, :63]}), weight,
                   rf"{op}: {weight} in_features \(dim 1\) must equal the hidden size"),
        ErrorInput("norm-length", call(**{norm: torch.ones(31)}), norm, rf"{op}: {norm} length must equal"),
        ErrorInput("norm-dtype", call(**{norm: torch.ones(32).half()}), norm,
                   rf"{op}: {norm} must be float32 \(stock keeps the norm weights in fp32\) or hidden_states's dtype"),
        ErrorInput("cos-batch", call(cos=torch.randn(3, 5, 4), sin=torch.randn(3, 5, 4)), "cos",
                   rf"{op}: cos batch dim must be 1 or 2"),
        ErrorInput("cos-seq", call(cos=cos[:, :4], sin=sin[:, :4]), "cos", rf"{op}: cos sequence dim must equal"),
        ErrorInput("rope-wider-than-head", call(cos=torch.randn(2, 5, 17), sin=torch.randn(2, 5, 17)), "cos",
                   rf"{op}: the rotary dim R = 34 \(twice the last dim of cos\) must not exceed {head}"),
        ErrorInput("no-rotation-pair", call(cos=cos[..., :0], sin=sin[..., :0]), "cos",
                   rf"{op}: cos has no rotation pair"),
        ErrorInput("sin-shape", call(sin=sin[..., :2]), "sin", rf"{op}: cos and sin must have the same shape"),
        ErrorInput("sin-dtype", call(sin=sin.long()), "sin", rf"{op}: sin must be float32"),
        ErrorInput("device", call(cos=torch.randn(2, 5, 4, device="meta")), "cos",
                   rf"{op}: all tensors must be on one device"),
        ErrorInput("eps", call({"eps": -1.0}), "eps", rf"{op}: eps must be >= 0"),
    ]
    if op == "shared_kv_q_prolog":
        errors += [
            ErrorInput("q_b-in-features", call(q_b_weight=base["q_b_weight"][:, :31]), "q_b_weight",
                       rf"{op}: q_b_weight in_features \(dim 1\) must equal q_lora_rank"),
            ErrorInput("q_b-rows", call(q_b_weight=base["q_b_weight"][:127]), "q_b_weight",
                       rf"{op}: q_b_weight has 127 rows, which must be num_heads \(4\) \* head_dim"),
            ErrorInput("num_heads", call({"num_heads": 0}), "num_heads", rf"{op}: num_heads must be positive"),
        ]
    return errors


# The stock arithmetic rounds to the activation dtype on the way (the q_a / kv projection, the normed
# q_residual, the q_b projection, the unweighted norm's factor and product) where the oracle does not:
# a few epsilons of the output's scale; fp32 GEMMs over up to 1024 inputs.
_V4_PROLOG_BOUNDS = _eps_bounds(64, 4, 4)

_register(OpCases("shared_kv_q_prolog", _shared_kv_q_prolog_samples, oracles.shared_kv_q_prolog_oracle,
                  lambda: _v4_prolog_errors("shared_kv_q_prolog"), bounds=_V4_PROLOG_BOUNDS,
                  selftest=("v4-flash-rope-64",)))
_register(OpCases("shared_kv_prolog", _shared_kv_prolog_samples, oracles.shared_kv_prolog_oracle,
                  lambda: _v4_prolog_errors("shared_kv_prolog"), bounds=_V4_PROLOG_BOUNDS,
                  selftest=("v4-flash-rope-64",)))


def _kv_compressor_sample(name, dtype, lens, *, overlap, ratio, head_dim=16, rope_dim=8, block_size=3,
                          bias_dtype=torch.float32, positions=64, int64=False, seed=0) -> Sample:
    """Requests of (seq_len, new tokens); a state of random rows (what earlier calls left), a pool of
    random rows (the entries this call does not write must stay as they are), shuffled entry blocks."""
    g = _gen(seed)
    channels = 2 * head_dim if overlap else head_dim
    seq_lens, q_lens = [n for n, _ in lens], [q for _, q in lens]
    tables, _, starts, num_blocks = _requests([n // ratio for n in seq_lens], q_lens, block_size, seed=seed)
    tokens = int(starts[-1])

    def rand(*shape, to=dtype):
        return torch.randn(*shape, generator=g).to(to)

    rows = 2 * ratio if overlap else ratio
    args = [rand(tokens, channels), rand(tokens, channels), rand(ratio, channels, to=bias_dtype),
            _norm_weight(head_dim, bias_dtype, seed + 1), rand(positions, rope_dim // 2, to=torch.float32),
            rand(positions, rope_dim // 2, to=torch.float32), rand(len(lens), rows, 2, channels),
            rand(num_blocks, block_size, 1, head_dim), tables, torch.tensor(seq_lens, dtype=torch.int32), starts]
    if int64:
        args[8:] = [t.long() for t in args[8:]]
    return Sample(name, tuple(args), {"compress_ratio": ratio, "overlap": overlap})


def _kv_compressor_samples(dtype):
    csa = dict(overlap=True, ratio=4)
    return [
        # a prefill from 0, a chunk, a decode step that closes a window, a prefill closing none
        _kv_compressor_sample("csa-mixed", dtype, ((9, 9), (6, 2), (13, 1), (3, 3)), **csa),
        _kv_compressor_sample("hca-mixed", dtype, ((17, 17), (9, 3)), overlap=False, ratio=8, seed=2),
        _kv_compressor_sample("csa-decode", dtype, ((8, 1), (5, 1), (12, 1)), int64=True, seed=4, **csa),
        _kv_compressor_sample("nothing-closes", dtype, ((7, 2), (2, 2)), seed=6, **csa),
        # a bf16 / fp16 model loaded without keeping position_bias and the norm weight in fp32
        _kv_compressor_sample("bias-and-norm-in-activation-dtype", dtype, ((12, 12), (9, 4)), bias_dtype=dtype,
                              seed=8, **csa),
        _kv_compressor_sample("no-new-tokens", dtype, ((4, 0),), seed=10, **csa),
        # DeepSeek-V4-Flash's CSA compressor dims (D = 512, two series, R = 64, m = 4), entry blocks of 64
        _kv_compressor_sample("v4-flash-csa", dtype, ((37, 37), (130, 3)), head_dim=512, rope_dim=64, block_size=64,
                              positions=160, seed=12, **csa),
        # HCA's rate 128: a prefill of 260 tokens (two entries) and a decode step closing entry 1
        _kv_compressor_sample("hca-ratio-128", dtype, ((260, 260), (256, 1)), overlap=False, ratio=128, head_dim=32,
                              block_size=2, positions=300, seed=14),
    ]


def _kv_compressor_errors():
    op = "kv_compressor"
    base_sample = _kv_compressor_sample("", torch.float32, ((9, 9), (6, 2)), overlap=True, ratio=4, block_size=3,
                                        seed=20)
    names = ("kv", "gate", "position_bias", "norm_weight", "cos_cache", "sin_cache", "state", "entry_cache",
             "block_tables", "seq_lens", "query_start_loc")
    base = dict(zip(names, base_sample.args))

    def call(extra=None, **changes):
        return Sample("", tuple(dict(base, **changes).values()), {**base_sample.kwargs, **(extra or {})})

    i32 = torch.int32
    return [
        ErrorInput("kv-channels", call(kv=base["kv"][:, :16]), "kv", rf"{op}: kv channels \(dim 1\) must be 2 \* "
                   r"head_dim with overlap=True"),
        ErrorInput("gate-tokens", call(gate=base["gate"][:-1]), "gate", rf"{op}: gate tokens \(dim 0\) must equal"),
        ErrorInput("gate-dtype", call(gate=base["gate"].bfloat16()), "gate", rf"{op}: gate has dtype torch.bfloat16"),
        ErrorInput("position_bias-rows", call(position_bias=base["position_bias"][:3]), "position_bias",
                   rf"{op}: position_bias rows \(dim 0\) must equal compress_ratio"),
        ErrorInput("position_bias-dtype", call(position_bias=base["position_bias"].half()), "position_bias",
                   rf"{op}: position_bias must be float32 \(stock keeps it in fp32\) or kv's dtype"),
        ErrorInput("norm_weight-dtype", call(norm_weight=base["norm_weight"].half()), "norm_weight",
                   rf"{op}: norm_weight must be float32"),
        ErrorInput("rope-wider-than-head", call(cos_cache=torch.randn(64, 9), sin_cache=torch.randn(64, 9)),
                   "cos_cache", rf"{op}: the rotary dim R = 18 .* must not exceed head_dim"),
        ErrorInput("sin_cache-shape", call(sin_cache=base["sin_cache"][:3]), "sin_cache",
                   rf"{op}: cos_cache and sin_cache must have the same shape"),
        ErrorInput("state-rows", call(state=base["state"][:, :4]), "state",
                   rf"{op}: state rows \(dim 1\) must be 2 \* compress_ratio with overlap=True"),
        ErrorInput("state-batch", call(state=base["state"][:1]), "state",
                   rf"{op}: state batch \(dim 0\) must equal the number of block-table rows"),
        ErrorInput("state-dtype", call(state=base["state"].bfloat16()), "state", rf"{op}: state has dtype"),
        ErrorInput("state-overlapping", call(state=base["state"][:, :, :1].expand(-1, -1, 2, -1)), "state",
                   rf"{op}: state has overlapping memory"),
        ErrorInput("entry_cache-dim", call(entry_cache=base["entry_cache"][..., :8]), "entry_cache",
                   rf"{op}: entry_cache dim \(dim 3\) must equal head_dim"),
        ErrorInput("entry_cache-overlapping", call(entry_cache=base["entry_cache"][:1].expand(4, -1, -1, -1)),
                   "entry_cache", rf"{op}: entry_cache has overlapping memory"),
        ErrorInput("block_tables-dtype", call(block_tables=base["block_tables"].float()), "block_tables",
                   rf"{op}: block_tables must be an int32 or int64"),
        ErrorInput("query_start_loc-length", call(query_start_loc=base["query_start_loc"][:2]), "query_start_loc",
                   rf"{op}: query_start_loc must have one entry per request plus one"),
        ErrorInput("compress_ratio-zero", call({"compress_ratio": 0}), "compress_ratio",
                   rf"{op}: compress_ratio must be >= 1"),
        ErrorInput("device", call(norm_weight=base["norm_weight"].to("meta")), "norm_weight",
                   rf"{op}: all tensors must be on one device"),
        # values, checked on the host before anything is written
        ErrorInput("query_start_loc-end", call(query_start_loc=torch.tensor([0, 9, 10], dtype=i32)),
                   "query_start_loc", r"query_start_loc\[-1\] = 10 must equal the number of query tokens \(11\)",
                   ValueError),
        ErrorInput("fewer-tokens-than-new", call(seq_lens=torch.tensor([9, 1], dtype=i32)), "seq_lens",
                   r"seq_lens\[1\] = 1 is less than the request's 2 new tokens", ValueError),
        ErrorInput("written-block-freed", call(block_tables=torch.full_like(base["block_tables"], -1)),
                   "block_tables", r"block_tables\[0, 0\] = -1 holds entries this call writes", ValueError),
        ErrorInput("entries-past-capacity", call(seq_lens=torch.tensor([9, 32], dtype=i32)), "seq_lens",
                   r"seq_lens\[1\] = 32 closes entry 7 \(entries are seq_lens // compress_ratio 4\), beyond the "
                   r"block table's capacity", ValueError),
        ErrorInput("rope-position-past-the-tables",
                   call(cos_cache=base["cos_cache"][:4], sin_cache=base["sin_cache"][:4]), "cos_cache",
                   r"entry 1 of request 0 is rotated at position 4, but cos_cache / sin_cache hold positions 0..3",
                   ValueError),
    ]


def _kv_compressor_unchecked_samples(dtype):
    """Values the CPU checks refuse: the device path writes only the entries it can address, at
    positions the tables hold."""
    sample = _kv_compressor_sample("", dtype, ((9, 9), (13, 6)), overlap=True, ratio=4, seed=22)
    tables = sample.args[8].clone()
    tables[0, 0] = -1  # request 0's entries 0 and 1 (request 1 writes its entries 1 and 2)
    args = sample.args
    return [Sample("written-block-freed", (*args[:8], tables, *args[9:]), sample.kwargs),
            # entry 2 of request 1 is rotated at position 8, past tables of 8 positions
            Sample("rope-position-past-the-tables", (*args[:4], args[4][:8], args[5][:8], *args[6:]), sample.kwargs)]


_register(OpCases("kv_compressor", _kv_compressor_samples, oracles.kv_compressor_oracle, _kv_compressor_errors,
                  # softmax over the slots in fp32, then the product and the sum in the activation dtype (stock),
                  # the norm in fp32 and the rotation rounded once; the softmax is fp32 for fp64 inputs too
                  # (stock's softmax(dtype=torch.float32)): 64 float32 epsilons there
                  bounds=_eps_bounds(64, 4, 4, fp64=64 * 2.0 ** 29), selftest=("v4-flash-csa", "hca-ratio-128"),
                  paths={"sync-free": kv_compressor_sync_free}, unchecked_samples=_kv_compressor_unchecked_samples))
