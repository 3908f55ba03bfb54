"""A CPU stand-in for CANN's `cann_ops_transformer` torch extension, for mla-ops' tests only. There is
no NPU code here.

It provides the two functions of `sparse_flash_mla` (hicann/ops-transformer,
attention/sparse_flash_mla/docs/torchapi_sparse_flash_mla.md): `sparse_flash_mla_metadata(...)` and
`sparse_flash_mla(q, *, ori_kv, cmp_kv, cmp_sparse_indices, ...)`, the shared-KV attention of
DeepSeek-V4 (K = V) over a sliding window of `ori_kv` and compressed entries of `cmp_kv`, with sinks,
written from that page: its argument limits are asserted (the Atlas A2/A3 ones where the products
differ), both calls are recorded in `torch_npu.CALLS`, and the attention is computed from the page's
definitions:

* ori side, `ori_mask_mode=4` (band): query token i of a request with q_len query tokens and
  `seqused_ori_kv` = L tokens sits at p = L - q_len + i and sees positions [p - ori_win_left, p + ori_win_right]
  of [0, L);
* cmp side, `cmp_mask_mode=3` (right-down causal on the uncompressed length): the request's
  uncompressed length is `seqused_cmp_kv * cmp_ratio + cmp_residual_kv`, and token i sees the entries
  w < (that - q_len + i + 1) // cmp_ratio; CSA lists them in `cmp_sparse_indices` (-1 = none), HCA takes
  every visible one;
* softmax with the per-head sink in the denominator (exp(sink - max) added, no value), in fp32 here.

The metadata tensor carries nothing real; the stand-in remembers the arguments it was made from and
asserts the main call passes the same ones, as the page requires.
"""
from __future__ import annotations

import torch
from torch_npu import CALLS, _describe, _unwrap, _wrap

STANDIN = True
_METADATA: dict[int, dict] = {}  # data_ptr of a metadata tensor -> the arguments it was generated from
_SPLIT_ARGS = ("cmp_ratio", "ori_mask_mode", "cmp_mask_mode", "ori_win_left", "ori_win_right", "layout_q", "layout_kv")


def sparse_flash_mla_metadata(num_heads_q, num_heads_kv, head_dim, *, cu_seqlens_q=None, cu_seqlens_ori_kv=None,
                              cu_seqlens_cmp_kv=None, seqused_q=None, seqused_ori_kv=None, seqused_cmp_kv=None,
                              cmp_residual_kv=None, ori_topk_length=None, cmp_topk_length=None, batch_size=0,
                              max_seqlen_q=0, max_seqlen_ori_kv=0, max_seqlen_cmp_kv=0, ori_topk=0, cmp_topk=0,
                              cmp_ratio=1, ori_mask_mode=0, cmp_mask_mode=0, ori_win_left=-1, ori_win_right=-1,
                              layout_q="BSND", layout_kv="BSND", has_ori_kv=True, has_cmp_kv=True):
    args = dict(num_heads_q=num_heads_q, num_heads_kv=num_heads_kv, head_dim=head_dim, max_seqlen_q=max_seqlen_q,
                cmp_topk=cmp_topk, ori_topk=ori_topk, has_ori_kv=has_ori_kv, has_cmp_kv=has_cmp_kv,
                cmp_ratio=cmp_ratio, ori_mask_mode=ori_mask_mode, cmp_mask_mode=cmp_mask_mode,
                ori_win_left=ori_win_left, ori_win_right=ori_win_right, layout_q=layout_q, layout_kv=layout_kv)
    CALLS.append(("sparse_flash_mla_metadata", _describe({
        **args, "cu_seqlens_q": _unwrap(cu_seqlens_q), "seqused_ori_kv": _unwrap(seqused_ori_kv),
        "seqused_cmp_kv": _unwrap(seqused_cmp_kv), "cmp_residual_kv": _unwrap(cmp_residual_kv)})))
    assert num_heads_q in (1, 2, 4, 8, 16, 32, 64, 128), num_heads_q  # Atlas A3: powers of two up to 128
    assert num_heads_kv == 1 and head_dim == 512, (num_heads_kv, head_dim)
    assert layout_q == "TND" and max_seqlen_q > 0, "TND queries need max_seqlen_q (the longest request)"
    assert ori_topk == 0 and has_ori_kv
    metadata = torch.zeros(1024, dtype=torch.int32)
    _METADATA[metadata.data_ptr()] = args
    return _wrap(metadata)


def sparse_flash_mla(q, *, ori_kv=None, cmp_kv=None, ori_sparse_indices=None, cmp_sparse_indices=None,
                     ori_block_table=None, cmp_block_table=None, cu_seqlens_q=None, cu_seqlens_ori_kv=None,
                     cu_seqlens_cmp_kv=None, seqused_q=None, seqused_ori_kv=None, seqused_cmp_kv=None,
                     cmp_residual_kv=None, ori_topk_length=None, cmp_topk_length=None, sinks=None, metadata=None,
                     softmax_scale=1.0, cmp_ratio=1, ori_mask_mode=4, cmp_mask_mode=3, ori_win_left=-1,
                     ori_win_right=-1, layout_q="BSND", layout_kv="BSND", topk_value_mode=1,
                     return_softmax_lse=False):
    q, ori_kv, cmp_kv, indices, ori_table, cmp_table, starts, ori_lens, cmp_lens, residual, sinks, metadata = (
        _unwrap(t) for t in (q, ori_kv, cmp_kv, cmp_sparse_indices, ori_block_table, cmp_block_table, cu_seqlens_q,
                             seqused_ori_kv, seqused_cmp_kv, cmp_residual_kv, sinks, metadata))
    CALLS.append(("sparse_flash_mla", _describe(dict(
        q=q, ori_kv=ori_kv, cmp_kv=cmp_kv, cmp_sparse_indices=indices, ori_block_table=ori_table,
        cmp_block_table=cmp_table, cu_seqlens_q=starts, seqused_ori_kv=ori_lens, seqused_cmp_kv=cmp_lens,
        cmp_residual_kv=residual, sinks=sinks, softmax_scale=softmax_scale, cmp_ratio=cmp_ratio,
        ori_mask_mode=ori_mask_mode, cmp_mask_mode=cmp_mask_mode, ori_win_left=ori_win_left,
        ori_win_right=ori_win_right, layout_q=layout_q, layout_kv=layout_kv))))
    split = _METADATA[metadata.data_ptr()]
    assert all(split[name] == value for name, value in dict(
        cmp_ratio=cmp_ratio, ori_mask_mode=ori_mask_mode, cmp_mask_mode=cmp_mask_mode, ori_win_left=ori_win_left,
        ori_win_right=ori_win_right, layout_q=layout_q, layout_kv=layout_kv).items()), "metadata from other arguments"
    assert split["num_heads_q"] == q.shape[1] and split["has_cmp_kv"] == (cmp_kv is not None)
    assert ori_sparse_indices is None and topk_value_mode == 1 and not return_softmax_lse
    assert q.dtype in (torch.float16, torch.bfloat16) and q.dim() == 3 and q.shape[2] == 512, (q.dtype, q.shape)
    assert layout_q == "TND" and layout_kv == "PA_BBND"
    assert sinks is not None and sinks.dtype == torch.float32 and sinks.shape == (q.shape[1],), "sinks are required"
    assert ori_mask_mode == 4 and ori_win_left == 127 and ori_win_right == 0, "A2/A3: a 128-token band only"
    caches = [(ori_kv, ori_table, ori_lens)] + ([(cmp_kv, cmp_table, cmp_lens)] if cmp_kv is not None else [])
    for cache, table, lens in caches:
        assert cache.dtype == q.dtype and cache.dim() == 4 and cache.shape[2] == 1 and cache.shape[3] == 512
        assert cache.shape[1] % 16 == 0 and cache.shape[1] <= 1024, f"block_size {cache.shape[1]}"
        assert table is not None and table.dtype == torch.int32 and bool((table >= 0).all()), "int32 block ids >= 0"
        assert lens is not None and lens.dtype == torch.int32 and lens.shape == (table.shape[0],)
    assert starts.dtype == torch.int32 and starts.shape == (ori_table.shape[0] + 1,) and int(starts[0]) == 0
    if cmp_kv is None:
        assert cmp_ratio == 1 and cmp_mask_mode == 0 and indices is None and residual is None
    else:
        assert cmp_mask_mode == 3 and residual is not None and residual.dtype == torch.int32
        assert bool((residual >= 0).all()) and bool((residual < cmp_ratio).all())
        assert cmp_ratio == (4 if indices is not None else 128), "A2/A3: CSA takes ratio 4, HCA 128"
        if indices is not None:
            assert indices.dtype == torch.int32 and indices.shape[:2] == (q.shape[0], 1)
            assert 0 < indices.shape[2] <= 8192 and split["cmp_topk"] == indices.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32)
    bounds = starts.tolist()
    for b in range(ori_table.shape[0]):
        q_len, ori_len = bounds[b + 1] - bounds[b], int(ori_lens[b])
        for i in range(q_len):
            t, p = bounds[b] + i, ori_len - q_len + i
            rows = [_row(ori_kv, ori_table[b], j) for j in range(max(0, p - ori_win_left), p + 1)]
            if cmp_kv is not None:
                visible = (int(cmp_lens[b]) * cmp_ratio + int(residual[b]) - q_len + i + 1) // cmp_ratio
                listed = range(visible) if indices is None else [w for w in indices[t, 0].tolist() if w != -1]
                assert all(0 <= w < visible for w in listed), "cmp_sparse_indices must be visible entries or -1"
                rows += [_row(cmp_kv, cmp_table[b], w) for w in listed]
            keys = torch.stack(rows).float()  # [L, 512]
            scores = q[t].float() @ keys.T * softmax_scale  # [H, L]
            top = torch.maximum(scores.max(dim=1).values, sinks)
            weights = torch.exp(scores - top[:, None])
            out[t] = (weights / (weights.sum(dim=1) + torch.exp(sinks - top))[:, None]) @ keys
    return _wrap(out.to(q.dtype)), _wrap(torch.zeros(1, dtype=torch.float32))


def _row(cache, table_row, index):
    """Row `index` of one request's PA_BBND pool [NB, bs, 1, D] -> [D]."""
    block_size = cache.shape[1]
    return cache[int(table_row[index // block_size]), index % block_size, 0]
