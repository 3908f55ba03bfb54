"""Public wrapper for `torch.ops.mla.mla_decode_attention` (ARCHITECTURE §3.6)."""
import torch
from torch import Tensor

from ..meta_kernels.decode_attention import check_decode_attention_args
from .value_checks import check_decode_values, validates_on_host


def mla_decode_attention(q_latent: Tensor, q_pe: Tensor, key_cache: Tensor, value_cache: Tensor,
                         block_tables: Tensor, seq_lens: Tensor, softmax_scale: float, *,
                         validate: bool = False) -> Tensor:
    """Absorbed MQA decode over the paged latent cache: one query token per sequence.

    Args:
        q_latent: `[B, N, L]`, q_nope multiplied by W_UK (the k_nope half of kv_b_proj).
        q_pe: `[B, N, R]`, rotated.
        key_cache: `[num_blocks, block_size, 1, L]` latent cache; value_cache: `[num_blocks, block_size, 1, R]`
            rotated k_pe cache.
        block_tables: `[B, max_blocks]`; seq_lens: `[B]`, cached tokens per sequence including the
            current one.
        softmax_scale: the attention scale (DeepSeek-V2: qk_head_dim**-0.5 times the YaRN mscale²).
        validate: check seq_lens / block ids on non-CPU devices (CPU always checks).
    Returns:
        `o_latent [B, N, L]` = softmax(scale * (q_latent·latent + q_pe·k_pe)) · latent, to be
        multiplied by W_UV and o_proj by the caller.
    """
    if validates_on_host(validate, key_cache):
        check_decode_attention_args(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, softmax_scale)
        check_decode_values("mla_decode_attention", block_tables, seq_lens, key_cache.shape[0], key_cache.shape[1])
    return torch.ops.mla.mla_decode_attention.default(q_latent, q_pe, key_cache, value_cache, block_tables,
                                                      seq_lens, softmax_scale)
