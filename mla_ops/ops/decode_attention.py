"""`mla::mla_decode_attention`: absorbed MQA decode over the paged latent cache.

One query token per sequence. With q_nope already multiplied by W_UK (`q_latent`), every head
attends over the same cached rows — the latent [L] and the rotated k_pe [R] — so per cached token
the kernel reads L+R values shared by all heads, instead of N*(P+R+V) for materialised K/V:

    scores[b, n, t] = scale * (q_latent[b, n] . latent[b, t] + q_pe[b, n] . k_pe[b, t])
    o_latent[b, n]  = softmax_t(scores[b, n, :seq_lens[b]]) . latent[b, :seq_lens[b]]

The caller multiplies o_latent by W_UV and o_proj.

Sinks (optional, `sinks [N]` fp32 or the query dtype): one learned logit per head that joins the softmax
denominator and contributes no value (HY-V4's `sinks`, DeepSeek-V4's and gpt-oss's attention sinks): with
M = max(max_t scores[b, n, t], sinks[n]),

    p[b, n, t] = exp(scores[b, n, t] - M) / (sum_t' exp(scores[b, n, t'] - M) + exp(sinks[n] - M))

A sink of -inf is no sink.

Query scale (optional, `q_scale [B, N]` fp32 or the query dtype): row b's head n scores with softmax_scale *
q_scale[b, n] (the product formed in fp32), a per-row and per-head query scale such as Mistral-Large-4's
log-position scale, scale_h * log(p + 1) + bias_h, without a pass over the queries; stock scales q itself in the
model's dtype, which rounds otherwise.

Sliding window (optional, `sliding_window` W >= 1; 0: none): sequence b attends to its last W cached tokens only,
positions max(0, seq_lens[b] - W) .. seq_lens[b] - 1 (its current token included), and only their blocks are
read (blocks before the window may hold anything, ids of freed blocks included): a sliding-window layer's decode
(dots3_note).

Precision: the score GEMMs and the output GEMM run in the activation dtype with fp32 accumulation,
and the softmax runs in fp32. For bf16/fp16 that rounds each of the two score terms (latent and
rope parts, summed in fp32) and each probability once to the activation dtype (relative 2^-9 for
bf16) — ATen's CPU bmm has no bf16-in/fp32-out variant, and upcasting the whole
gathered context to fp32 would cost more than the rest of the step (measured at T=4096: fp32 GEMM
0.8 ms + conversion 0.4 ms, against 0.17 ms for the bf16 GEMM). fp32 inputs compute in fp32.
"""
import math
import threading
from typing import Optional

import torch
from torch import Tensor

from .._checks import (
    check_index,
    check_rank,
    check_same_device,
    check_size,
    check_softmax_scale,
    memo_by_signature,
)
from .._library import define_op
from ._paged import (
    check_latent_query_and_caches,
    check_q_scale,
    check_sinks,
    check_used_block_ids,
    row_scales,
    softmax_with_sinks,
    validates_on_host,
)

OP = "mla_decode_attention"


# ----------------------------------------------------------------------------------------- checks
@memo_by_signature
def check_decode_attention_args(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens,
                                softmax_scale: float, sinks=None, sliding_window: int = 0, q_scale=None) -> None:
    """q_latent [B, N, L], q_pe [B, N, R]; key_cache [NB, bs, 1, L] (latent), value_cache
    [NB, bs, 1, R] (k_pe); block_tables [B, max_blocks]; seq_lens [B] (including the current token);
    softmax_scale a positive normal float32 number (`check_softmax_scale`); sinks [N] (fp32 or
    q_latent's dtype) or None; sliding_window >= 0; q_scale [B, N] (fp32 or q_latent's dtype) or None."""
    check_softmax_scale(OP, softmax_scale, " (e.g. qk_head_dim ** -0.5)")
    torch._check(sliding_window >= 0, lambda: f"mla.{OP}: sliding_window must be >= 0 (0: every cached token; W >= 1: "
                 f"the last W, the current one included), got {sliding_window}")
    check_latent_query_and_caches(OP, "batch", q_latent, q_pe, key_cache, value_cache)
    check_index(OP, "block_tables", block_tables)
    check_rank(OP, "block_tables", block_tables, 2, "[batch, max_blocks_per_seq]")
    check_size(OP, "block_tables", block_tables.shape[0], q_latent.shape[0], "rows must equal the batch size")
    check_index(OP, "seq_lens", seq_lens)
    check_rank(OP, "seq_lens", seq_lens, 1, "[batch]")
    check_size(OP, "seq_lens", seq_lens.shape[0], q_latent.shape[0], "length must equal the batch size")
    check_sinks(OP, sinks, q_latent, "q_latent")
    check_q_scale(OP, q_scale, q_latent)
    check_same_device(OP, {"q_latent": q_latent, "q_pe": q_pe, "key_cache": key_cache,
                           "value_cache": value_cache, "block_tables": block_tables, "seq_lens": seq_lens,
                           "sinks": sinks, "q_scale": q_scale})


def check_decode_values(block_tables: Tensor, seq_lens: Tensor, num_blocks: int, block_size: int,
                        sliding_window: int = 0) -> int:
    """1 <= seq_lens <= table capacity, every block id read in range (with a sliding window W, those of the
    window's blocks only). Returns max(seq_lens).

    Runs on every CPU decode step, so it stays at a handful of small ops (lengths as a Python list,
    one min/max over the used window) and only locates the offending entry once something is wrong."""
    lens = seq_lens.tolist()
    if not lens:
        return 0
    capacity = block_tables.shape[1] * block_size
    for b, n in enumerate(lens):
        if n < 1:
            raise ValueError(f"mla.{OP}: seq_lens[{b}] = {n}; each decoding sequence holds at least its current "
                             f"token (seq_lens >= 1)")
        if n > capacity:
            raise ValueError(f"mla.{OP}: seq_lens[{b}] = {n} exceeds the block table's capacity "
                             f"({block_tables.shape[1]} blocks x {block_size} tokens)")
    used = [-(-n // block_size) for n in lens]
    first = [max(0, n - sliding_window) // block_size for n in lens] if sliding_window else None
    check_used_block_ids(OP, block_tables, used, num_blocks, first=first)
    return max(lens)


def _mla_decode_attention_fake(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, softmax_scale,
                               sinks=None, sliding_window=0, q_scale=None):
    check_decode_attention_args(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, softmax_scale, sinks,
                                sliding_window, q_scale)
    return q_latent.new_empty(q_latent.shape)


# -------------------------------------------------------------------------------------- reference
_scratch = threading.local()


def _workspace(name: str, shape: tuple, like: Tensor) -> Tensor:
    """A per-thread reusable CPU buffer: the gathered context is rebuilt every decode step, and a
    fresh multi-MB allocation per step and layer costs page faults (glibc returns it to the OS)."""
    numel = math.prod(shape)
    if like.device.type != "cpu":
        return like.new_empty(shape)
    buffers = _scratch.__dict__.setdefault("buffers", {})
    key = (name, like.dtype)
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        # a normal tensor even when first made under inference_mode: an inference tensor could not
        # be written by later calls outside it (generate runs under no_grad)
        with torch.inference_mode(False):
            buf = torch.empty(numel, dtype=like.dtype)
        buffers[key] = buf
    return buf[:numel].view(shape)


def _gather_context(name: str, cache: Tensor, block_ids: Tensor) -> Tensor:
    """cache [NB, bs, 1, D] gathered by block_ids [B, nb] -> [B, nb*bs, D] (whole blocks)."""
    batch, blocks = block_ids.shape
    block_size, dim = cache.shape[1], cache.shape[3]
    out = _workspace(name, (batch * blocks, block_size * dim), cache)
    if cache.is_contiguous():  # rows of one block each: the fewest, widest index_select rows
        torch.index_select(cache.view(cache.shape[0], block_size * dim), 0, block_ids.reshape(-1), out=out)
    else:  # a strided pool (e.g. cache[..., :L] of a wider one): copy only the blocks used
        torch.index_select(cache, 0, block_ids.reshape(-1), out=out.view(batch * blocks, *cache.shape[1:]))
    return out.view(batch, blocks * block_size, dim)


def _strided_context(cache: Tensor, block_ids: Tensor):
    """When every row's blocks are consecutive ids and each row starts where the previous one's
    window ends (one sequence fed by a fresh allocator, or back-to-back rows), the context is a
    dense view of the pool: no gather copy. None otherwise — including evenly spaced rows with gaps,
    which bmm would copy anyway (measured 2.5x slower than the gather). CPU only (reads ids)."""
    if not cache.is_contiguous():
        return None
    batch, blocks = block_ids.shape
    first = int(block_ids[0, 0])
    # consecutive and back to back == the window reads ids first, first+1, ... in row-major order
    if not torch.equal(block_ids.reshape(-1), torch.arange(first, first + batch * blocks)):
        return None
    block_size, dim = cache.shape[1], cache.shape[3]
    row = block_size * dim
    return cache.as_strided((batch, blocks * block_size, dim), (blocks * row, dim, 1),
                            cache.storage_offset() + first * row)


def _attend(q_latent: Tensor, q_pe: Tensor, latent: Tensor, k_pe: Tensor, seq_lens: Tensor,
            softmax_scale: float, mask: bool, out_len: Optional[int] = None,
            attended: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
            q_scale: Optional[Tensor] = None) -> Tensor:
    """Scores over the gathered context [B, T, L] / [B, T, R] -> o_latent [B, N, L]. With `mask`,
    positions at or past a row's length are not attended (or, when given, those where `attended`
    [B, T] bool is False), and a row with no position left (seq_lens <= 0: a padding row of a
    captured batch) yields zeros, not the NaN of an all -inf softmax. The caller guarantees the
    latent rows of unattended positions are zeros (or absent): a zero probability times a NaN/inf
    there would still be NaN in `probs @ latent`. Scores need
    no such care: masked_fill replaces a NaN score too. `out_len`: only the first positions enter
    `probs @ latent` (those past it are masked, and may hold anything); the score GEMM keeps the
    whole-block width, because ATen's CPU bf16 GEMM is ~60x slower when that width is not a
    multiple of the block (measured 14 ms vs 0.23 ms at 2000 vs 2048 positions), while the output
    GEMM is not (it reduces over the positions). `sinks` [N]: one more logit per head in the softmax
    denominator (`softmax_with_sinks`); `q_scale` [B, N]: each row's and head's factor on softmax_scale."""
    score_dtype = torch.promote_types(q_latent.dtype, torch.float32)  # fp32; fp64 stays fp64
    scores = torch.bmm(q_latent, latent.transpose(1, 2)).to(score_dtype)  # [B, N, T]
    scores += torch.bmm(q_pe, k_pe.transpose(1, 2)).to(score_dtype)
    scores *= row_scales(softmax_scale, q_scale, score_dtype)
    if mask:
        if attended is None:
            positions = torch.arange(latent.shape[1], device=latent.device)
            attended = positions[None, :] < seq_lens.long()[:, None]
        scores.masked_fill_(~attended[:, None, :], float("-inf"))
    probs = softmax_with_sinks(scores, sinks)
    if mask:
        probs.masked_fill_(~attended.any(dim=1)[:, None, None], 0.0)
    if out_len is not None and out_len != latent.shape[1]:
        probs, latent = probs[..., :out_len], latent[:, :out_len]
    return torch.bmm(probs.to(latent.dtype), latent)


def decode_sync_free(q_latent: Tensor, q_pe: Tensor, key_cache: Tensor, value_cache: Tensor,
                      block_tables: Tensor, seq_lens: Tensor, softmax_scale: float,
                      sinks: Optional[Tensor] = None, sliding_window: int = 0,
                      q_scale: Optional[Tensor] = None) -> Tensor:
    """Device path (CUDA, ...): no host sync, so graph-capturable. The whole table width is gathered
    (a static shape), ids are clamped into the pool so nothing is read out of bounds whatever the
    values, and every row is masked to its length (ids past it are never attended). A position
    inside a length whose block id is invalid (outside [0, num_blocks): the CPU path refuses it,
    naming block_tables) contributes nothing, as if masked; a row left with no valid position gives
    zeros. The gathered latent of unattended positions is zeroed: whatever the pool holds there
    (torch.empty garbage, an fp16 overflow in another sequence's block that a clamped id points at)
    stays out of every output."""
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    if q_latent.shape[0] == 0 or block_tables.shape[1] == 0:
        return q_latent.new_zeros(q_latent.shape)
    ids = block_tables.long()
    block_ids = ids.clamp(0, num_blocks - 1)
    latent = _gather_context("latent", key_cache, block_ids)  # [B, T, L]
    k_pe = _gather_context("k_pe", value_cache, block_ids)  # [B, T, R]
    positions = torch.arange(latent.shape[1], device=latent.device)
    valid_ids = ((ids >= 0) & (ids < num_blocks)).repeat_interleave(block_size, dim=1)  # [B, T]
    attended = (positions[None, :] < seq_lens.long()[:, None]) & valid_ids
    if sliding_window:
        attended &= positions[None, :] >= seq_lens.long()[:, None] - sliding_window
    latent.masked_fill_(~attended[:, :, None], 0)
    return _attend(q_latent, q_pe, latent, k_pe, seq_lens, softmax_scale, mask=True, attended=attended, sinks=sinks,
                   q_scale=q_scale)


def mla_decode_attention_reference(q_latent: Tensor, q_pe: Tensor, key_cache: Tensor, value_cache: Tensor,
                                   block_tables: Tensor, seq_lens: Tensor, softmax_scale: float,
                                   sinks: Optional[Tensor] = None, sliding_window: int = 0,
                                   q_scale: Optional[Tensor] = None) -> Tensor:
    """-> o_latent [B, N, L] in q_latent's dtype."""
    if key_cache.device.type != "cpu":
        return decode_sync_free(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, softmax_scale,
                                sinks, sliding_window, q_scale)
    batch = q_latent.shape[0]
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    # Only the blocks the longest sequence uses (host-known on CPU, and validated).
    longest = check_decode_values(block_tables, seq_lens, num_blocks, block_size, sliding_window)
    if sliding_window and longest > sliding_window:  # blocks before a window may hold anything: masked, zeroed
        return decode_sync_free(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, softmax_scale,
                                sinks, sliding_window, q_scale)
    blocks = math.ceil(longest / block_size)
    if batch == 0 or blocks == 0:
        return q_latent.new_zeros(q_latent.shape)
    lens = seq_lens.tolist()
    ragged = min(lens) != longest
    # Shorter rows' entries past their length may be padding (-1): clamped, and masked below.
    block_ids = block_tables[:, :blocks].long().clamp(0, num_blocks - 1)
    # A view of the pool cannot have its unattended rows zeroed: ragged rows take the gather copy.
    latent = k_pe = None
    if not ragged:
        latent, k_pe = _strided_context(key_cache, block_ids), _strided_context(value_cache, block_ids)
    if latent is None or k_pe is None:
        latent = _gather_context("latent", key_cache, block_ids)  # [B, T, L]
        k_pe = _gather_context("k_pe", value_cache, block_ids)  # [B, T, R]
        # Zero what shorter rows must not attend to (our own workspace): 0 * NaN would leak into
        # probs @ latent. Only the tails, on the host-known lengths: a few small fills, no pass
        # over the whole context.
        for b, n in enumerate(lens):
            if n < longest:
                latent[b, n:longest].zero_()
    # Positions past the longest row (the tail of its last block, possibly a view of the pool) are
    # masked in the scores and left out of the output GEMM.
    mask = ragged or longest != latent.shape[1]
    return _attend(q_latent, q_pe, latent, k_pe, seq_lens, softmax_scale, mask, out_len=longest, sinks=sinks,
                   q_scale=q_scale)


MLA_DECODE_ATTENTION = define_op(
    "mla_decode_attention(Tensor q_latent, Tensor q_pe, Tensor key_cache, Tensor value_cache, "
    "Tensor block_tables, Tensor seq_lens, float softmax_scale, Tensor? sinks=None, int sliding_window=0, "
    "Tensor? q_scale=None) -> Tensor",
    check=check_decode_attention_args, fake=_mla_decode_attention_fake, reference=mla_decode_attention_reference,
)


# ---------------------------------------------------------------------------------- public wrapper
def mla_decode_attention(q_latent: Tensor, q_pe: Tensor, key_cache: Tensor, value_cache: Tensor,
                         block_tables: Tensor, seq_lens: Tensor, softmax_scale: float,
                         sinks: Optional[Tensor] = None, sliding_window: int = 0, q_scale: Optional[Tensor] = None,
                         *, validate: bool = False) -> Tensor:
    """Absorbed MQA decode over the paged latent cache: one query token per sequence.

    Args:
        q_latent: `[B, N, L]`, q_nope multiplied by W_UK (the k_nope half of kv_b_proj).
        q_pe: `[B, N, R]`, rotated.
        key_cache: `[num_blocks, block_size, 1, L]` latent cache; value_cache: `[num_blocks, block_size, 1, R]`
            rotated k_pe cache (the "value" slot of the cache pair holds k_pe: MLA's values are the latent).
        block_tables: `[B, max_blocks]`; seq_lens: `[B]`, cached tokens per sequence including the
            current one.
        softmax_scale: the attention scale (DeepSeek-V2: qk_head_dim**-0.5 times the YaRN mscale squared).
        sinks: `[N]` per-head sink logits (fp32 or q_latent's dtype) in the softmax denominator, or None.
        sliding_window: W >= 1 attends to each sequence's last W cached tokens only (0: all of them).
        q_scale: `[B, N]` a factor on softmax_scale per row and head (fp32 or q_latent's dtype), or None.
        validate: check seq_lens / block ids on non-CPU devices (CPU always checks).
    Returns:
        `o_latent [B, N, L]` = softmax(scale * (q_latent·latent + q_pe·k_pe), sinks) · latent, to be
        multiplied by W_UV and o_proj by the caller.
    """
    if validates_on_host(validate, key_cache):
        check_decode_attention_args(q_latent, q_pe, key_cache, value_cache, block_tables, seq_lens, softmax_scale,
                                    sinks, sliding_window, q_scale)
        check_decode_values(block_tables, seq_lens, key_cache.shape[0], key_cache.shape[1], sliding_window)
    return torch.ops.mla.mla_decode_attention.default(q_latent, q_pe, key_cache, value_cache, block_tables,
                                                      seq_lens, softmax_scale, sinks, sliding_window, q_scale)
