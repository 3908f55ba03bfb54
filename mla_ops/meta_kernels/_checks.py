"""Sync-free argument checks shared by the fake kernels and the eager kernels.

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


ROPE_LAYOUTS = ("interleaved", "half")  # §3.2: transformers' apply_rotary_emb pairs / the hub code's halves
HALF_DTYPES = (torch.float16, torch.bfloat16)  # the activation dtypes the Ascend kernels compute in


def check_layout(op: str, name: str, layout: str, allowed=ROPE_LAYOUTS) -> None:
    torch._check(
        layout in allowed,
        lambda: f"mla.{op}: {name} must be one of {allowed}, got {layout!r}",
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


_EAGER_MEMO_SIZE = 512


def eager_memo(check):
    """Run a metadata check once per distinct call signature in eager mode.

    The checks look only at shapes, dtypes, devices and scalar arguments, so a signature that passed
    once passes again; decode calls the same ops with the same shapes every step, and the ~30-60 µs of
    a full check would otherwise be paid per op and layer. Fake tensors (torch.compile, export) and
    anything traced always run the full check, so bad calls still fail at trace time.
    """
    import threading
    from collections import OrderedDict

    passed: OrderedDict = OrderedDict()
    lock = threading.Lock()  # serving threads share the memo; OrderedDict moves are not atomic

    def signature(value):
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), value.dtype, value.device)
        return value

    def memoized(*args):
        if torch.compiler.is_compiling() or any(
                isinstance(a, torch.Tensor) and (isinstance(a, torch._subclasses.FakeTensor) or a.device.type == "meta")
                for a in args):
            return check(*args)
        key = tuple(signature(a) for a in args)
        with lock:
            if key in passed:
                passed.move_to_end(key)
                return None
        check(*args)  # outside the lock: a failing check raises, and checks may be slow
        with lock:
            passed[key] = None
            if len(passed) > _EAGER_MEMO_SIZE:
                passed.popitem(last=False)
        return None

    memoized.__name__ = check.__name__
    memoized.__doc__ = check.__doc__
    memoized.__wrapped__ = check
    return memoized
