"""Reference `mla::mla_decode_attention` (ARCHITECTURE §3.6): absorbed MQA over the paged latent cache.

One query token per sequence. With q_nope already multiplied by W_UK (`q_latent`), every head
attends over the same cached rows — the latent [L] and the rotated k_pe [R] — so per cached token
the kernel reads L+R values shared by all heads, instead of N*(P+R+V) for materialised K/V:

    scores[b, n, t] = scale * (q_latent[b, n] . latent[b, t] + q_pe[b, n] . k_pe[b, t])   (fp32)
    o_latent[b, n]  = softmax_t(scores[b, n, :seq_lens[b]]) . latent[b, :seq_lens[b]]

The caller multiplies o_latent by W_UV and o_proj. Scores, softmax and the weighted sum run in
fp32 (activations are upcast), so bf16 results differ from a materialised bf16 attention only by
the final rounding and the stock path's own bf16 roundings.
"""
import math

import torch
from torch import Tensor

from ...meta_kernels.decode_attention import check_decode_attention_args
from ..value_checks import check_decode_values
from .rms_norm import compute_dtype


def _gather_context(cache: Tensor, block_ids: Tensor) -> Tensor:
    """cache [NB, bs, 1, D] gathered by block_ids [B, nb] -> [B, nb*bs, D] (whole blocks)."""
    batch, blocks = block_ids.shape
    block_size, dim = cache.shape[1], cache.shape[3]
    flat = cache.reshape(cache.shape[0], block_size * dim)
    return flat.index_select(0, block_ids.reshape(-1)).view(batch, blocks * block_size, dim)


def mla_decode_attention(q_latent: Tensor, q_pe: Tensor, key_cache: Tensor, value_cache: Tensor,
                         block_tables: Tensor, seq_lens: Tensor, softmax_scale: float) -> Tensor:
    """-> o_latent [B, N, L] in q_latent's dtype."""
    op = "mla_decode_attention"
    check_decode_attention_args(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, softmax_scale)
    batch = q_latent.shape[0]
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    if key_cache.device.type == "cpu":
        # Only the blocks the longest sequence uses (host-known on CPU, and validated).
        longest = check_decode_values(op, block_tables, seq_lens, num_blocks, block_size)
        blocks = math.ceil(longest / block_size)
    else:
        blocks = block_tables.shape[1]  # static: no host sync, graph-capturable
    if batch == 0 or blocks == 0:
        return q_latent.new_zeros(q_latent.shape)
    # Unused table entries (padding ids such as -1) are clamped; their positions are masked below.
    block_ids = block_tables[:, :blocks].long().clamp(0, num_blocks - 1)
    cdt = compute_dtype(q_latent.dtype)
    latent = _gather_context(key_cache, block_ids).to(cdt)  # [B, T, L]
    k_pe = _gather_context(value_cache, block_ids).to(cdt)  # [B, T, R]
    scores = torch.baddbmm(torch.bmm(q_pe.to(cdt), k_pe.transpose(1, 2)), q_latent.to(cdt),
                           latent.transpose(1, 2), alpha=softmax_scale, beta=softmax_scale)  # [B, N, T]
    positions = torch.arange(latent.shape[1], device=latent.device)
    masked = positions[None, :] >= seq_lens.long()[:, None]  # [B, T]
    scores = scores.masked_fill(masked[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs, latent).to(q_latent.dtype)
