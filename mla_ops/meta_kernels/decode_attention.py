"""Fake kernel and shared argument checks for `mla::mla_decode_attention` (ARCHITECTURE §3.6)."""
import math

import torch

from ._checks import check_float, check_index, check_rank, check_same_device, check_same_dtype, check_size, eager_memo
from .paged_kv_cache import check_cache_pair

OP = "mla_decode_attention"


@eager_memo
def check_decode_attention_args(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens,
                                softmax_scale: float) -> None:
    """q_latent [B, N, L], q_pe [B, N, R]; key_cache [NB, bs, 1, L] (latent), value_cache
    [NB, bs, 1, R] (k_pe); block_tables [B, max_blocks]; seq_lens [B] (including the current token);
    softmax_scale a finite positive float."""
    if isinstance(softmax_scale, (int, float)):  # a traced symbolic scale is left to the kernel
        torch._check(math.isfinite(softmax_scale) and softmax_scale > 0,
                     lambda: f"mla.{OP}: softmax_scale must be a finite positive number "
                     f"(e.g. qk_head_dim ** -0.5), got {softmax_scale}")
    check_float(OP, "q_latent", q_latent)
    check_rank(OP, "q_latent", q_latent, 3, "[batch, heads, kv_lora_rank] (q_nope absorbed with W_UK)")
    check_rank(OP, "q_pe", q_pe, 3, "[batch, heads, rope_dim] (rotated)")
    check_same_dtype(OP, "q_pe", q_pe, "q_latent", q_latent)
    check_size(OP, "q_pe", q_pe.shape[0], q_latent.shape[0], "batch (dim 0) must equal q_latent's")
    check_size(OP, "q_pe", q_pe.shape[1], q_latent.shape[1], "heads (dim 1) must equal q_latent's")
    check_cache_pair(OP, key_cache, value_cache)
    check_size(OP, "key_cache", key_cache.shape[2], 1, "heads (dim 2) must be 1: MLA caches one shared latent")
    check_size(OP, "value_cache", value_cache.shape[2], 1, "heads (dim 2) must be 1: MLA caches one shared k_pe")
    check_size(OP, "key_cache", key_cache.shape[3], q_latent.shape[2],
               "dim (dim 3) must equal kv_lora_rank, the last dim of q_latent")
    check_size(OP, "value_cache", value_cache.shape[3], q_pe.shape[2],
               "dim (dim 3) must equal rope_dim, the last dim of q_pe")
    check_same_dtype(OP, "key_cache", key_cache, "q_latent", q_latent)
    check_same_dtype(OP, "value_cache", value_cache, "q_latent", q_latent)
    check_index(OP, "block_tables", block_tables)
    check_rank(OP, "block_tables", block_tables, 2, "[batch, max_blocks_per_seq]")
    check_size(OP, "block_tables", block_tables.shape[0], q_latent.shape[0], "rows must equal the batch size")
    check_index(OP, "seq_lens", seq_lens)
    check_rank(OP, "seq_lens", seq_lens, 1, "[batch]")
    check_size(OP, "seq_lens", seq_lens.shape[0], q_latent.shape[0], "length must equal the batch size")
    check_same_device(OP, {"q_latent": q_latent, "q_pe": q_pe, "key_cache": key_cache,
                           "value_cache": value_cache, "block_tables": block_tables, "seq_lens": seq_lens})


def _mla_decode_attention_fake(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, softmax_scale):
    check_decode_attention_args(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, softmax_scale)
    return q_latent.new_empty(q_latent.shape)
