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
* `npu_lightning_indexer(query, key, weights, *, actual_seq_lengths_query, actual_seq_lengths_key,
  block_table, layout_query, layout_key, sparse_count, sparse_mode, ...) -> (indices, values)` and
  `npu_sparse_flash_attention(query, key, value, sparse_indices, scale_value, *, ...) -> (out, max,
  sum)` (op-plugin docs torch_npu-npu_lightning_indexer.md / -npu_sparse_flash_attention.md and the
  reference implementations of test/test_custom_ops/test_npu_{lightning_indexer,sparse_flash_attention}.py),
  for the TND query / PA_BSND cache layouts only; both assert the documented argument limits and
  record their calls (`SPARSE_CALLS`);
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


SPARSE_CALLS: list = []  # (name, {argument: (shape, dtype) or value}) of every sparse call


def _describe(kwargs):
    return {k: (tuple(v.shape), v.dtype, v.is_contiguous()) if isinstance(v, torch.Tensor) else v
            for k, v in kwargs.items()}


def _pa_rows(cache, table_row, length):
    """The first `length` tokens of one request from a PA_BSND cache [NB, bs, 1, D] -> [length, D]."""
    block_size = cache.shape[1]
    blocks = [int(b) for b in table_row[: -(-length // block_size)]]
    rows = cache[blocks].reshape(-1, cache.shape[-1]) if blocks else cache.new_zeros((0, cache.shape[-1]))
    return rows[:length]


def _check_tnd_pa(query, key, block_table, seq_q, seq_k, layout_query, layout_key):
    assert layout_query == "TND" and layout_key == "PA_BSND", (layout_query, layout_key)
    assert query.is_contiguous() and key.is_contiguous(), "query/key must be contiguous"
    for t in (block_table, seq_q, seq_k):
        assert t is not None and t.dtype == torch.int32, "block_table / actual_seq_lengths_* must be int32"
    assert seq_q.shape == seq_k.shape == (block_table.shape[0],), (seq_q.shape, seq_k.shape, block_table.shape)
    assert key.shape[1] % 16 == 0 and key.shape[1] <= 1024 and key.shape[2] == 1, key.shape
    ends = seq_q.tolist()
    assert ends == sorted(ends) and ends[-1] == query.shape[0], "TND: cumulative query lengths ending at T"
    return [0] + ends, seq_k.tolist()


def npu_lightning_indexer(query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                          block_table=None, layout_query="BSND", layout_key="BSND", sparse_count=2048, sparse_mode=3,
                          pre_tokens=2**63 - 1, next_tokens=2**63 - 1, return_value=False):
    """score[i, j] = sum_h weights[i, h] * relu(query[i, h] . key[j]) (fp32) over the request's
    actual_seq_lengths_key tokens, sparse_mode=3 masking j > (Lk - Lq) + i; the top sparse_count
    positions by descending score (an unstable sort, as the documentation's test), -1 after the visible ones."""
    query, key, weights, seq_q, seq_k, table = (_unwrap(t) for t in (
        query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key, block_table))
    SPARSE_CALLS.append(("npu_lightning_indexer", _describe(dict(
        query=query, key=key, weights=weights, actual_seq_lengths_query=seq_q, actual_seq_lengths_key=seq_k,
        block_table=table, layout_query=layout_query, layout_key=layout_key, sparse_count=sparse_count,
        sparse_mode=sparse_mode))))
    assert query.dtype in (torch.float16, torch.bfloat16) and key.dtype == query.dtype, (query.dtype, key.dtype)
    assert weights.dtype in (torch.float32, query.dtype) and weights.is_contiguous(), weights.dtype
    assert query.shape[1] <= 64 and query.shape[2] == key.shape[3] == 128, (query.shape, key.shape)
    assert 1 <= sparse_count <= 2048 or sparse_count in (3072, 4096, 5120, 6144, 7168, 8192), sparse_count
    assert sparse_mode in (0, 3) and not return_value
    starts, lens = _check_tnd_pa(query, key, table, seq_q, seq_k, layout_query, layout_key)
    out = torch.full((query.shape[0], 1, sparse_count), -1, dtype=torch.int32)
    for b, length in enumerate(lens):
        q, w = query[starts[b]:starts[b + 1]].float(), weights[starts[b]:starts[b + 1]].float()
        k = _pa_rows(key, table[b], length).float()
        scores = (torch.relu(torch.einsum("shd,jd->shj", q, k)) * w[..., None]).sum(1)  # [s, Lk]
        if sparse_mode == 3:
            causal = torch.arange(length)[None, :] > (length - q.shape[0]) + torch.arange(q.shape[0])[:, None]
            scores.masked_fill_(causal, float("-inf"))
        order = torch.sort(scores, dim=1, descending=True).indices[:, :sparse_count]
        picked = torch.gather(scores, 1, order) > float("-inf")
        out[starts[b]:starts[b + 1], 0, : order.shape[1]] = torch.where(picked, order, -1).to(torch.int32)
    return _wrap(out), _wrap(torch.empty(0, dtype=query.dtype))


def npu_sparse_flash_attention(query, key, value, sparse_indices, scale_value, *, block_table=None,
                               actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
                               key_rope=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                               sparse_mode=3, pre_tokens=2**63 - 1, next_tokens=2**63 - 1, attention_mode=0,
                               return_softmax_lse=False, sinks=None):
    """MLA-absorb (attention_mode=2): softmax(scale * ([q, q_rope] . [k, k_rope])) @ value over each
    row's sparse_indices up to its first -1 (fp32 here), sparse_mode=3 masking j > (Lkv - Lq) + i."""
    same_kv = key is value
    query, key, value, sparse_indices, table, seq_q, seq_k, query_rope, key_rope = (_unwrap(t) for t in (
        query, key, value, sparse_indices, block_table, actual_seq_lengths_query, actual_seq_lengths_kv, query_rope,
        key_rope))
    SPARSE_CALLS.append(("npu_sparse_flash_attention", dict(_describe(dict(
        query=query, key=key, sparse_indices=sparse_indices, scale_value=scale_value, block_table=table,
        actual_seq_lengths_query=seq_q, actual_seq_lengths_kv=seq_k, query_rope=query_rope, key_rope=key_rope,
        sparse_block_size=sparse_block_size, layout_query=layout_query, layout_kv=layout_kv,
        sparse_mode=sparse_mode, attention_mode=attention_mode)), value_is_key=same_kv)))
    assert attention_mode == 2 and sparse_block_size == 1 and not return_softmax_lse and sinks is None
    assert query.dtype in (torch.float16, torch.bfloat16), query.dtype
    assert all(t.dtype == query.dtype for t in (key, value, query_rope, key_rope))
    assert query.shape[2] == key.shape[3] == 512 and query_rope.shape[2] == key_rope.shape[3] == 64
    assert query.shape[1] in (1, 2, 4, 8, 16, 32, 64, 128) and query_rope.is_contiguous()
    assert sparse_indices.dtype == torch.int32 and sparse_indices.is_contiguous()
    assert sparse_indices.shape[:2] == (query.shape[0], 1) and sparse_indices.shape[2] > 0, sparse_indices.shape
    assert sparse_mode in (0, 3)
    starts, lens = _check_tnd_pa(query, key, table, seq_q, seq_k, layout_query, layout_kv)
    out = torch.zeros(query.shape, dtype=torch.float32)
    for b, length in enumerate(lens):
        latent, k_pe = _pa_rows(key, table[b], length).float(), _pa_rows(key_rope, table[b], length).float()
        q_len = starts[b + 1] - starts[b]
        for i in range(q_len):
            t = starts[b] + i
            row = sparse_indices[t, 0].tolist()
            listed = row[: row.index(-1)] if -1 in row else row  # valid entries first: stop at the first -1
            assert all(x >= 0 for x in listed), "valid entries must precede the -1s"
            listed = [j for j in listed if j < length]
            if not listed:
                continue
            idx = torch.tensor(listed)
            scores = (query[t].float() @ latent[idx].T + query_rope[t].float() @ k_pe[idx].T) * scale_value
            if sparse_mode == 3:
                scores.masked_fill_((idx > (length - q_len) + i)[None, :], -1e12)
            out[t] = torch.softmax(scores, dim=-1) @ latent[idx]
    empty = torch.empty(0, dtype=torch.float32)
    return _wrap(out.to(query.dtype)), _wrap(empty), _wrap(empty.clone())


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
