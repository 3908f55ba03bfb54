"""A CPU stand-in for torch_npu, for mla-ops' tests only. There is no NPU code here.

What it provides: an "npu" device (PrivateUse1 renamed, as torch_npu does) whose tensors are CPU
tensors wrapped in a tensor subclass, with every aten op run on the wrapped CPU data by a dispatch
mode; `mla::` ops are redispatched to the PrivateUse1 key, so the kernels mla-ops binds there run
through the real dispatcher exactly as on an Ascend machine. And CPU implementations, written from
their documented semantics, of the torch_npu functions mla-ops calls:

* `npu_rms_norm(self, gamma, epsilon=1e-6) -> (y, rstd)` (op-plugin docs, torch_npu.npu_rms_norm:
  y = self * rsqrt(mean(self^2, last dims) + epsilon) * gamma, rstd the fp32 reciprocal std);
* `npu_gather_pa_kv_cache(key_cache, value_cache, block_tables, seq_lens, key, value, *,
  seq_offset=None, is_seq_lens_cumsum=False)` (op-plugin op_plugin_functions.yaml schema and docs
  torch_npu-npu_gather_pa_kv_cache.md: ND caches, in place; rows whose block id is invalid
  (negative or >= num_blocks) are written as zeros);
* `torch.npu`: is_available, device_count, current_device, set_device, synchronize, memory stats,
  NPUGraph / graph (records the aten ops issued during capture over the captured buffers and
  re-issues them on replay).

What passing tests with it proves: mla-ops' Python control flow on the NPU path (registration
timing, backend and path choice, fallbacks, argument conventions of our torch_npu calls, the
selftest's steps). What it does not: device kernels, NPU numerics, PyPTO's NPU launch, aclgraph
capture of real kernels. The `torch.backends` entry point in the neighbouring dist-info lets
`TORCH_DEVICE_BACKEND_AUTOLOAD=1` import it from `import torch`, as the real package does.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils import _python_dispatch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

__version__ = "0.0.0+standin"
STANDIN = True

from torch.utils import backend_registration as _registration  # noqa: E402


class _NpuModule(_registration._DummyBackendModule):
    """`torch.npu` (filled in below)."""


npu = _NpuModule()
# torch's own hook for a Python-only PrivateUse1 backend (device guard, hooks, device module),
# renamed to "npu" as torch_npu renames it: "npu" device strings and `.to("npu")` work from here on.
_registration._setup_privateuseone_for_python_backend(rename="npu", backend_module=npu)
_DEVICE = torch.device("npu", 0)


class _NpuTensor(torch.Tensor):
    """An "npu" tensor: metadata of its own, data in a CPU tensor (`.cpu_data`)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                                storage_offset=data.storage_offset(), dtype=data.dtype,
                                                device=_DEVICE, requires_grad=data.requires_grad)
        t.cpu_data = data
        return t

    def __repr__(self, *, tensor_contents=None):
        return f"npu_standin({self.cpu_data!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        with _MODE:
            return func(*args, **(kwargs or {}))


def _is_npu(x) -> bool:
    return isinstance(x, torch.device) and x.type == "npu" or isinstance(x, str) and x.startswith("npu")


def _unwrap(x):
    if isinstance(x, _NpuTensor):
        return x.cpu_data
    if _is_npu(x):
        return torch.device("cpu")
    return x


def _wrap(x):
    return _NpuTensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, _NpuTensor) else x


class _Mode(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.recording: list | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "mla":
            # what the dispatcher does for a real NPU tensor: the PrivateUse1 kernel (or, with none
            # bound there, the CompositeExplicitAutograd reference kernel)
            with self:
                return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1), *args, **kwargs)
        leaves = tree_leaves((args, kwargs))
        on_npu = any(isinstance(a, _NpuTensor) for a in leaves)
        target = kwargs.get("device")
        if target is not None:
            on_npu = _is_npu(target)
        cpu_args, cpu_kwargs = tree_map(_unwrap, args), tree_map(_unwrap, kwargs)
        out = func(*cpu_args, **cpu_kwargs)
        if self.recording is not None and on_npu:
            self.recording.append((func, cpu_args, cpu_kwargs, out))
        return tree_map(_wrap, out) if on_npu else out


_MODE = _Mode()


# ------------------------------------------------------------------------------ torch_npu functions
def npu_rms_norm(self, gamma, epsilon=1e-6):
    x = self.float()
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    rstd = torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + epsilon)
    return (x * rstd * gamma.float()).to(self.dtype), rstd


def npu_gather_pa_kv_cache(key_cache, value_cache, block_tables, seq_lens, key, value, *, seq_offset=None,
                           is_seq_lens_cumsum=False):
    # on the wrapped CPU data (reads of index values are host reads here; the device op reads them
    # on the device); writes land in key / value's storage
    key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset = (
        _unwrap(t) for t in (key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset))
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    lens = seq_lens.tolist()
    if is_seq_lens_cumsum:
        bases, counts = lens[:-1], [b - a for a, b in zip(lens[:-1], lens[1:])]
    else:
        counts = lens
        bases = [sum(lens[:q]) for q in range(len(lens))]
    offsets = seq_offset.tolist() if seq_offset is not None else [0] * len(counts)
    for q, (base, count) in enumerate(zip(bases, counts)):
        for t in range(count):
            column = offsets[q] // block_size + t // block_size
            block = int(block_tables[q, column]) if column < block_tables.shape[1] else -1
            if 0 <= block < num_blocks:
                key[base + t] = key_cache[block, t % block_size]
                value[base + t] = value_cache[block, t % block_size]
            else:
                key[base + t] = 0
                value[base + t] = 0


# ------------------------------------------------------------------------------------ torch.npu
class NPUGraph:
    """Records the aten ops issued on npu tensors during capture; replay re-issues them on the same
    buffers (results copied into the captured outputs), as a device graph re-launches its kernels."""

    def __init__(self):
        self.ops: list = []

    def replay(self):
        for func, args, kwargs, out in self.ops:
            new = func(*args, **kwargs)
            for old_t, new_t in zip(tree_leaves(out), tree_leaves(new)):
                if isinstance(old_t, torch.Tensor) and old_t.data_ptr() != new_t.data_ptr():
                    old_t.copy_(new_t)


@contextlib.contextmanager
def graph(npu_graph: NPUGraph, **_options):
    _MODE.recording = npu_graph.ops
    try:
        yield
    finally:
        _MODE.recording = None


npu.is_available = lambda: True
npu.device_count = lambda: 1
npu.current_device = lambda: 0
npu.set_device = lambda device: None
npu.synchronize = lambda device=None: None
npu.reset_peak_memory_stats = lambda device=None: None
npu.max_memory_allocated = lambda device=None: 0
npu.NPUGraph = NPUGraph
npu.graph = graph
npu.is_initialized = lambda: True

torch._C._push_on_torch_dispatch_stack(_MODE)

# Kernels for the few paths that reach the PrivateUse1 key without passing through a Python dispatch
# mode (torch.tensor(data, device="npu") builds the tensor with Python dispatch excluded).
_LIB = torch.library.Library("aten", "IMPL")


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return _NpuTensor(torch.empty_strided(size, stride, dtype=dtype, device="cpu"))


def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return _NpuTensor(torch.empty(size, dtype=dtype, device="cpu"))


def _copy_from(src, dst, non_blocking=False):
    _unwrap(dst).copy_(_unwrap(src))
    return dst


_LIB.impl("empty_strided", _empty_strided, "PrivateUse1")
_LIB.impl("empty.memory_format", _empty, "PrivateUse1")
_LIB.impl("_copy_from", _copy_from, "PrivateUse1")


@contextlib.contextmanager
def standin_paused():
    """Take the device mode off the dispatch stack (torch.compile refuses to trace under a
    non-infra dispatch mode); npu tensors cannot be used inside."""
    _python_dispatch._pop_mode()
    try:
        yield
    finally:
        _python_dispatch._push_mode(_MODE)


def _autoload():
    """`torch.backends` entry point (TORCH_DEVICE_BACKEND_AUTOLOAD=1): importing is the work."""


def npu_fusion_attention(*args, **kwargs):
    """Imported (not called) by transformers when torch_npu is installed; mla-ops never calls it."""
    raise NotImplementedError("the torch_npu stand-in has no npu_fusion_attention")
