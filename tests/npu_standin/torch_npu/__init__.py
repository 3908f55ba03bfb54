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
  record their calls (`CALLS`);
* `npu_fused_infer_attention_score_v2(query, key, value, *, query_rope, key_rope, atten_mask,
  actual_seq_kvlen, block_table, num_query_heads, num_key_value_heads, softmax_scale, input_layout,
  sparse_mode, block_size, ...) -> (out, lse)` (docs torch_npu-npu_fused_infer_attention_score_v2.md
  and -npu_fused_infer_attention_score.md), its MLA decode form with page attention only, and
  `npu_scatter_nd_update_(input, indices, updates)` (docs torch_npu-npu_scatter_nd_update_.md); both
  assert the documented limits, record their calls (`CALLS`) and are replayed by NPUGraph;
* `torch.npu`: is_available, device_count, current_device, set_device, synchronize, memory stats,
  NPUGraph / graph (records the aten ops and the torch_npu functions above issued during capture over
  the captured buffers and re-issues them on replay; a host synchronisation inside the capture —
  `.item()`, `.tolist()`, `.cpu()`, a copy between host and device, an output size read from the data —
  raises `HostSyncInCapture`, as a device graph cannot capture one).

What passing tests with it proves: mla-ops' Python control flow on the NPU path (registration
timing, backend and path choice, fallbacks, argument conventions of our torch_npu calls, the
selftest's steps). What it does not: device kernels, NPU numerics, PyPTO's NPU launch, aclgraph
capture of real kernels. The `torch.backends` entry point in the neighbouring dist-info lets
`TORCH_DEVICE_BACKEND_AUTOLOAD=1` import it from `import torch`, as the real package does.
"""
from __future__ import annotations

import contextlib
import functools

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


_aten = torch.ops.aten
# ops that read device values on the host: a device-to-host copy, a scalar read, or an output size that
# depends on the data (nonzero, masked selection, unique, repeat_interleave without output_size)
_HOST_READS = {_aten._local_scalar_dense.default, _aten.nonzero.default, _aten.masked_select.default,
               _aten._unique2.default, _aten.unique_dim.default, _aten.unique_consecutive.default}


class HostSyncInCapture(RuntimeError):
    """A host synchronisation inside `torch.npu.graph`: a device graph cannot capture it (aclgraph, like
    CUDA graphs, records device work only), so a kernel that does one is not capturable."""


def _syncs_with_host(func, args, kwargs, inputs_on_npu: bool) -> bool:
    """Whether `func` on these arguments moves data between host and device or reads device values."""
    if func in _HOST_READS or func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return inputs_on_npu
    if func is _aten._to_copy.default and kwargs.get("device") is not None:  # .cpu() / .to("npu")
        return _is_npu(kwargs["device"]) != inputs_on_npu
    if func is _aten.copy_.default:
        return isinstance(args[0], _NpuTensor) != isinstance(args[1], _NpuTensor)
    if func in (_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default):  # boolean masks
        return inputs_on_npu and any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return False


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
        if self.recording is not None and _syncs_with_host(func, args, kwargs, on_npu):
            raise HostSyncInCapture(f"{func} synchronises with the host inside torch.npu.graph (not capturable)")
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


CALLS: list = []  # (name, {argument: (shape, dtype, contiguous) or value}) of every recorded call


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
    CALLS.append(("npu_lightning_indexer", _describe(dict(
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
    CALLS.append(("npu_sparse_flash_attention", dict(_describe(dict(
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


# ------------------------------------------------------------------ paged decode attention, cache writes
def _device_function(impl):
    """`impl` (written on CPU tensors) as torch_npu runs it: npu tensors in and out, and inside
    `torch.npu.graph` recorded on the captured buffers so that `replay()` runs it again, as a device
    graph re-launches a captured kernel. A result that is one of the arguments (an in-place function)
    comes back as the caller's own tensor."""
    @functools.wraps(impl)
    def device_call(*args, **kwargs):
        cpu_args, cpu_kwargs = tree_map(_unwrap, args), tree_map(_unwrap, kwargs)
        out = impl(*cpu_args, **cpu_kwargs)
        if _MODE.recording is not None:
            _MODE.recording.append((impl, cpu_args, cpu_kwargs, out))
        for arg, cpu_arg in zip(args, cpu_args):
            if out is cpu_arg:
                return arg
        return tree_map(_wrap, out)

    return device_call


_FIA_RESERVED = ("query_dtype", "key_dtype", "value_dtype", "query_rope_dtype", "key_rope_dtype",
                 "key_shared_prefix_dtype", "value_shared_prefix_dtype", "dequant_scale_query_dtype",
                 "dequant_scale_key_dtype", "dequant_scale_value_dtype", "dequant_scale_key_rope_dtype", "out_dtype")


@_device_function
def npu_fused_infer_attention_score_v2(query, key, value, *, query_rope=None, key_rope=None, pse_shift=None,
                                       atten_mask=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                                       block_table=None, dequant_scale_query=None, dequant_scale_key=None,
                                       dequant_offset_key=None, dequant_scale_value=None, dequant_offset_value=None,
                                       dequant_scale_key_rope=None, quant_scale_out=None, quant_offset_out=None,
                                       quant_scale_p=None, learnable_sink=None, num_query_heads=1,
                                       num_key_value_heads=0, softmax_scale=1.0, pre_tokens=2147483647,
                                       next_tokens=2147483647, input_layout="BSH", sparse_mode=0, block_size=0,
                                       query_quant_mode=0, key_quant_mode=0, value_quant_mode=0, inner_precise=0,
                                       return_softmax_lse=False, **reserved):
    """The MLA decode form with page attention only (Ascend/op-plugin 517f2e7d,
    docs/zh/custom_APIs/torch_npu/torch_npu-npu_fused_infer_attention_score_v2.md: "MLA场景约束" D=512,
    "Q_S=1约束" page attention; block_size also as torch_npu-npu_fused_infer_attention_score.md's Q_S = 1
    limit): query [B, N, 1, 512] and query_rope [B, N, 1, 64] in "BNSD", key = value [NB, 1, bs, 512]
    (or [NB, bs, 512]) and key_rope [NB, 1, bs, 64] read through block_table [B, >= max blocks] int32,
    actual_seq_kvlen a host list of lengths (one shared, or one per batch), atten_mask [B or 1, 1, 1, >= W*bs]
    with nonzero = not computed (the incre-flash-attention convention, torch_npu-npu_incre_flash_attention.md).

    out[b] = softmax(softmax_scale * (q . k + q_rope . k_rope), masked) @ value over the batch's first
    actual_seq_kvlen positions, in fp32, rounded once to query's dtype -> (out [B, N, 1, 512], lse [1] = 0).
    A row with every position masked is not documented: it comes out NaN here, so no caller may rely on it.
    Asserts the documented argument limits."""
    same_kv = key is value
    CALLS.append(("npu_fused_infer_attention_score_v2", dict(_describe(dict(
        query=query, key=key, query_rope=query_rope, key_rope=key_rope, atten_mask=atten_mask,
        actual_seq_kvlen=actual_seq_kvlen, actual_seq_qlen=actual_seq_qlen, block_table=block_table,
        num_query_heads=num_query_heads, num_key_value_heads=num_key_value_heads, softmax_scale=softmax_scale,
        input_layout=input_layout, sparse_mode=sparse_mode, block_size=block_size, inner_precise=inner_precise,
        return_softmax_lse=return_softmax_lse)), value_is_key=same_kv)))
    assert set(reserved) <= set(_FIA_RESERVED) and all(v is None for v in reserved.values()), reserved
    unused = (pse_shift, dequant_scale_query, dequant_scale_key, dequant_offset_key, dequant_scale_value,
              dequant_offset_value, dequant_scale_key_rope, quant_scale_out, quant_offset_out, quant_scale_p,
              learnable_sink)
    assert all(t is None for t in unused) and (query_quant_mode, key_quant_mode, value_quant_mode) == (0, 0, 0)
    assert query_rope is not None and key_rope is not None, "this stand-in implements the MLA form only"
    assert input_layout == "BNSD" and sparse_mode == 0 and inner_precise in (0, 1) and not return_softmax_lse
    assert query.dtype in (torch.float16, torch.bfloat16), query.dtype
    assert query_rope.dtype == query.dtype and key.dtype == value.dtype == key_rope.dtype == query.dtype
    assert all(t.is_contiguous() for t in (query, key, value, query_rope, key_rope)), "non-contiguous input"
    assert key.shape == value.shape, (key.shape, value.shape)
    batch, heads, q_len, dim = query.shape
    assert q_len == 1 and dim == 512 and heads == num_query_heads and heads in (1, 2, 4, 8, 16, 32, 64, 128)
    assert query_rope.shape == (batch, heads, 1, 64), query_rope.shape
    assert num_key_value_heads == 1
    if key.dim() == 4:  # (blocknum, KV_N, blocksize, D)
        assert key.shape[1] == 1 and key.shape[2] == block_size and key.shape[3] == dim, key.shape
        assert key_rope.shape == (key.shape[0], 1, block_size, 64), key_rope.shape
    else:  # (blocknum, blocksize, H)
        assert key.shape[1:] == (block_size, dim) and key_rope.shape == (key.shape[0], block_size, 64)
    latent, k_rope = key.reshape(key.shape[0], block_size, dim), key_rope.reshape(key.shape[0], block_size, 64)
    assert key.numel() < 2**31 and key_rope.numel() < 2**31
    assert block_size > 0 and block_size % 16 == 0 and block_size <= 512, block_size
    assert block_table is not None and block_table.dtype == torch.int32 and block_table.dim() == 2
    assert block_table.shape[0] == batch, (block_table.shape, batch)
    assert isinstance(actual_seq_kvlen, (list, tuple)) and all(isinstance(n, int) for n in actual_seq_kvlen), \
        "actual_seq_kvlen is a host list of ints (SymInt[] in op_plugin_functions.yaml)"
    assert len(actual_seq_kvlen) == 1 or len(actual_seq_kvlen) >= batch, actual_seq_kvlen
    lens = [actual_seq_kvlen[0] if len(actual_seq_kvlen) == 1 else actual_seq_kvlen[b] for b in range(batch)]
    width = block_table.shape[1]
    assert all(0 <= n <= width * block_size and n <= 262144 for n in lens), (lens, width, block_size)
    blocks = [-(-n // block_size) for n in lens]
    assert sum(blocks) <= key.shape[0], f"blocknum {key.shape[0]} < the {sum(blocks)} blocks the lengths need"
    if atten_mask is not None:
        assert atten_mask.dtype in (torch.bool, torch.int8, torch.uint8) and atten_mask.is_contiguous()
        assert atten_mask.dim() == 4 and atten_mask.shape[0] in (1, batch) and atten_mask.shape[1:3] == (1, 1)
        assert atten_mask.shape[3] >= width * block_size, (atten_mask.shape, width, block_size)
    out = torch.zeros(batch, heads, 1, dim, dtype=torch.float32)
    for b, n in enumerate(lens):
        ids = block_table[b, : blocks[b]].long()
        assert bool(((ids >= 0) & (ids < key.shape[0])).all()), "block ids are the caller's to keep valid"
        rows, rope_rows = latent[ids].reshape(-1, dim)[:n].float(), k_rope[ids].reshape(-1, 64)[:n].float()
        scores = (query[b, :, 0].float() @ rows.T + query_rope[b, :, 0].float() @ rope_rows.T) * softmax_scale
        if atten_mask is not None:
            scores.masked_fill_(atten_mask[b if atten_mask.shape[0] > 1 else 0, 0, 0, :n].bool()[None, :],
                                float("-inf"))
        out[b, :, 0] = torch.softmax(scores, dim=-1) @ rows
    return out.to(query.dtype), torch.zeros(1, dtype=torch.float32)


_SCATTER_ND_DTYPES = (torch.float32, torch.float16, torch.bool, torch.bfloat16, torch.int64, torch.int8)


@_device_function
def npu_scatter_nd_update_(input, indices, updates):
    """input[indices[i]] = updates[i], in place (Ascend/op-plugin 517f2e7d,
    docs/zh/custom_APIs/torch_npu/torch_npu-npu_scatter_nd_update_.md): input 1-8 dims, any strides,
    dtypes of Atlas A2/A3; indices int32/int64, at least 2-D, last dim a <= input.dim(), no index out of
    range (asserted); updates of shape indices.shape[:-1] + input.shape[a:] and input's dtype. Returns input."""
    CALLS.append(("npu_scatter_nd_update_", _describe(dict(input=input, indices=indices, updates=updates))))
    assert input.dtype in _SCATTER_ND_DTYPES and updates.dtype == input.dtype, (input.dtype, updates.dtype)
    assert 1 <= input.dim() <= 8, input.shape
    assert indices.dtype in (torch.int32, torch.int64) and indices.dim() >= 2, (indices.dtype, indices.shape)
    depth = indices.shape[-1]
    assert depth <= input.dim(), (indices.shape, input.shape)
    assert updates.shape == indices.shape[:-1] + input.shape[depth:], (updates.shape, indices.shape, input.shape)
    flat = indices.reshape(-1, depth).long()
    assert bool(((flat >= 0) & (flat < torch.tensor(input.shape[:depth]))).all()), "indices out of range"
    input[tuple(flat.t())] = updates.reshape(-1, *input.shape[depth:])
    return input


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
    if _MODE.recording is not None:  # torch.tensor(data, device="npu"): a host-to-device copy
        raise HostSyncInCapture("a host-to-device copy inside torch.npu.graph (not capturable)")
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
