"""Sync-free argument checks shared by the fake kernels and the eager kernels of every op.

Everything here looks only at metadata (rank, sizes, dtype, device), so it runs unchanged on
real tensors, FakeTensors under torch.compile / export, and symbolic sizes: `torch._check` turns a
symbolic condition into a guard or a runtime assert instead of a host sync. Messages are built
lazily (only on failure) and always name the op, the argument, what was expected and how to fix it.
"""
from __future__ import annotations

from typing import Optional

import torch

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def check_rank(op: str, name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    torch._check(
        t.dim() == rank,
        lambda: f"mla.{op}: {name} must be {rank}-D {layout}, got a {t.dim()}-D tensor of shape {_shape(t)}",
    )


def check_float(op: str, name: str, t: torch.Tensor) -> None:
    torch._check(
        t.dtype in ACTIVATION_DTYPES,
        lambda: f"mla.{op}: {name} must be float32, float16 or bfloat16 (float64 for gradcheck), "
        f"got {t.dtype}",
    )


def check_index(op: str, name: str, t: torch.Tensor) -> None:
    torch._check(
        t.dtype in INDEX_DTYPES,
        lambda: f"mla.{op}: {name} must be an int32 or int64 tensor, got {t.dtype}; "
        f"convert it with .to(torch.int32)",
    )


def check_same_dtype(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    torch._check(
        t.dtype == ref.dtype,
        lambda: f"mla.{op}: {name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; "
        f"they must match (cast with .to({ref.dtype}))",
    )


def check_same_device(op: str, tensors: dict[str, Optional[torch.Tensor]]) -> None:
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {v.device for v in present.values()}
    torch._check(
        len(devices) <= 1,
        lambda: f"mla.{op}: all tensors must be on one device, got "
        + ", ".join(f"{k} on {v.device}" for k, v in present.items()),
    )


def check_size(op: str, name: str, actual, expected, what: str) -> None:
    """`actual == expected` where `what` says which dimension and why it must match."""
    torch._check(
        actual == expected,
        lambda: f"mla.{op}: {name} {what}: expected {expected}, got {actual}",
    )


def check_writable_layout(op: str, name: str, t: torch.Tensor) -> None:
    """An output or cache the op writes must not overlap itself: with a stride-0 dim (an
    `expand`ed tensor) several elements share one memory location, so writes race or land twice
    (ATen only warns for index_put_). Sync-free: strides are metadata."""
    torch._check(
        all(size <= 1 or stride != 0 for size, stride in zip(t.shape, t.stride())),
        lambda: f"mla.{op}: {name} has overlapping memory (a stride-0 dim, e.g. from expand: shape "
        f"{_shape(t)}, strides {tuple(t.stride())}) and cannot be written; pass a tensor that owns its "
        f"elements (.contiguous() or .clone())",
    )


# The kernels scale scores in float32: a scale that is no normal float32 number would become inf or 0
# (1e39, 1e-46) or lose precision and be flushed to zero where the hardware runs with FTZ/DAZ (a
# subnormal such as 1e-40), so the answer would depend on the backend. Python floats print these bounds
# as 1.1754943508222875e-38 and 3.4028234663852886e+38.
FLOAT32_NORMAL_MIN = torch.finfo(torch.float32).tiny
FLOAT32_MAX = torch.finfo(torch.float32).max


def check_softmax_scale(op: str, softmax_scale, example: str = "") -> None:
    """softmax_scale must be a positive normal float32 number: FLOAT32_NORMAL_MIN <= scale <= FLOAT32_MAX
    (NaN fails both). A traced symbolic scale is left to the kernel."""
    if not isinstance(softmax_scale, (int, float)):
        return
    torch._check(
        FLOAT32_NORMAL_MIN <= softmax_scale <= FLOAT32_MAX,
        lambda: f"mla.{op}: softmax_scale must be a positive normal float32 number{example}, within "
        f"[{FLOAT32_NORMAL_MIN!r}, {FLOAT32_MAX!r}] (the kernels scale in float32), got {float(softmax_scale)!r}",
    )


# Where the rotation pairs are, and where the rotated pair goes:
#   "interleaved": pairs (x[2i], x[2i+1]), written back in place (transformers' DeepSeek-V2 apply_rotary_emb);
#   "half": pairs (x[2i], x[2i+1]), written de-interleaved to (out[i], out[i+D/2]) (the hub DeepSeek code,
#           DeepSeek-V3's apply_rotary_pos_emb_interleave, torch_npu.npu_interleave_rope);
#   "neox": pairs (x[i], x[i+D/2]), written in place (GPT-NeoX / Llama apply_rotary_pos_emb with rotate_half).
ROPE_LAYOUTS = ("interleaved", "half", "neox")
INTERLEAVED_INPUT_LAYOUTS = ("interleaved", "half")  # the layouts whose pairs are adjacent in the input
HALF_DTYPES = (torch.float16, torch.bfloat16)  # the activation dtypes the Ascend kernels compute in


def check_layout(op: str, name: str, layout: str, allowed=ROPE_LAYOUTS) -> None:
    torch._check(
        layout in allowed,
        lambda: f"mla.{op}: {name} must be one of {allowed}, got {layout!r}",
    )


# What the rotation is computed in:
#   "float32": fp32 math (fp64 for fp64 inputs), one rounding to the activation dtype at the end
#              (transformers' DeepSeek-V2 apply_rotary_emb: complex fp32 multiplication);
#   "activation": cos/sin cast to the activation dtype, each product and the sum rounded to it
#              (x*cos + rotate_half(x)*sin as DeepSeek-V3's family and the hub remote code compute it).
# In fp32 / fp64 both compute the same formula in that dtype; they can differ by an ulp only in rows of
# fewer than 8 pairs, where ATen's complex multiplication ("float32") contracts into fused multiply-adds.
ROPE_COMPUTE_DTYPES = ("float32", "activation")


def check_rope_compute_dtype(op: str, name: str, value: str) -> None:
    torch._check(
        value in ROPE_COMPUTE_DTYPES,
        lambda: f"mla.{op}: {name} must be one of {ROPE_COMPUTE_DTYPES} (\"float32\": rotate in fp32 and round "
        f"once; \"activation\": round like x*cos + rotate_half(x)*sin in x's dtype), got {value!r}",
    )


def check_rope_tables(op: str, x_name: str, cos: torch.Tensor, sin: torch.Tensor, rope_dim, seq_len,
                      batch) -> None:
    """cos/sin: one fp value per rotation pair, `[B, S, R/2]` or `[S, R/2]`, for the rotated tensor
    named `x_name` of rotary dim `rope_dim` and `seq_len` tokens (devices are the caller's check).

    `batch` is the batch size the tables may broadcast over (None when x has no batch dim).
    """
    for name, t in (("cos", cos), ("sin", sin)):
        check_float(op, name, t)
        torch._check(
            t.dim() in (2, 3),
            lambda: f"mla.{op}: {name} must be [B, S, R/2] or [S, R/2] (one value per rotation pair, "
            f"e.g. freqs_cis.real / .imag), got shape {_shape(t)}",
        )
    torch._check(
        cos.shape == sin.shape,
        lambda: f"mla.{op}: cos and sin must have the same shape, got {_shape(cos)} and {_shape(sin)}",
    )
    torch._check(
        rope_dim % 2 == 0,
        lambda: f"mla.{op}: the rotary dim of {x_name} must be even (rotation pairs), got {rope_dim}",
    )
    check_size(op, "cos", cos.shape[-1], rope_dim // 2, f"last dim must be half the rotary dim of {x_name}")
    check_size(op, "cos", cos.shape[-2], seq_len, f"sequence dim must equal the sequence length of {x_name}")
    if cos.dim() == 3:
        torch._check(
            batch is not None,
            lambda: f"mla.{op}: cos is [B, S, R/2] but {x_name} has no batch dim; pass cos as [S, R/2]",
        )
        torch._check(
            (cos.shape[0] == batch) | (cos.shape[0] == 1),
            lambda: f"mla.{op}: cos batch dim must be 1 or {batch} (the batch of {x_name}), "
            f"got {cos.shape[0]}",
        )


_MEMO_SIZE = 512


def _signature(value):
    if isinstance(value, torch.Tensor):
        # strides too: a check may reject an overlapping (stride-0) layout of an accepted shape
        return (tuple(value.shape), tuple(value.stride()), value.dtype, value.device)
    return value


def _tracing(args, kwargs) -> bool:
    """True under torch.compile / export or with fake or meta tensors: checks must run in full then
    (a bad call fails at trace time) and their results must not be cached."""
    if torch.compiler.is_compiling():
        return True
    return any(isinstance(a, torch.Tensor) and (isinstance(a, torch._subclasses.FakeTensor) or a.device.type == "meta")
               for a in (*args, *kwargs.values()))


def memo_by_signature(fn):
    """Cache `fn(*args, **kwargs)` per call signature (tensor shapes, dtypes, devices and the other
    argument values) in eager mode.

    For functions that look only at metadata: a metadata check that passed once passes again, and a
    backend's "why I cannot serve this" answer is the same for the same signature. Decode calls the
    same ops with the same shapes every step, and the ~30-60 us of a full check would otherwise be
    paid per op and layer. Under tracing (fake tensors, torch.compile, export) `fn` always runs, so
    bad calls still fail at trace time. Exceptions are never cached. Thread-safe: serving threads
    share the memo.
    """
    import threading
    from collections import OrderedDict

    results: OrderedDict = OrderedDict()
    lock = threading.Lock()  # OrderedDict moves are not atomic

    def memoized(*args, **kwargs):
        if _tracing(args, kwargs):
            return fn(*args, **kwargs)
        key = (tuple(_signature(a) for a in args), tuple((k, _signature(v)) for k, v in sorted(kwargs.items())))
        with lock:
            if key in results:
                results.move_to_end(key)
                return results[key]
        result = fn(*args, **kwargs)  # outside the lock: a failing check raises, and checks may be slow
        with lock:
            results[key] = result
            if len(results) > _MEMO_SIZE:
                results.popitem(last=False)
        return result

    memoized.__name__ = getattr(fn, "__name__", type(fn).__name__)
    memoized.__qualname__ = getattr(fn, "__qualname__", memoized.__name__)
    memoized.__doc__ = fn.__doc__
    memoized.__wrapped__ = fn
    memoized.cache_clear = results.clear  # for tests that change what `fn` depends on (a package version)
    return memoized
