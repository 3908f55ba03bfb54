// The native CPU kernels: one declaration each (its signature, once), compiled per ISA (isa.h).
//
// The op kernels take their op's schema signature (mla_ops/ops/*.py), so registration.cpp serves the
// op with them directly; they run after the op's metadata check (arguments.cpp) and this backend's
// reasons (reasons.cpp) passed, and validate index values themselves (ValueError, with the Python
// value check's message) before writing anything.
#pragma once

#include "../isa.h"

#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>

#include <optional>
#include <string>
#include <string_view>
#include <tuple>

namespace mla_native {

// q_latent [B, N, L], q_pe [B, N, R]; key_cache [NB, bs, 1, L], value_cache [NB, bs, 1, R] (any
// strides); block_tables [B, maxb] and seq_lens [B] int32/int64; sinks [N] (fp32 or q's dtype: one logit per
// head in the softmax denominator) or none; sliding_window W >= 1: each row's last W positions only (0: all);
// q_scale [B, N] (fp32 or q's dtype: a factor on softmax_scale per row and head) or none
// -> o_latent [B, N, L] in q's dtype.
// Raises ValueError (the message of the Python check_decode_values) when a length is outside
// [1, maxb * bs] or a used block id is outside [0, NB), before computing anything.
MLA_ISA_KERNEL(mla_decode_attention,
               at::Tensor(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          double softmax_scale, const std::optional<at::Tensor>& sinks, int64_t sliding_window,
                          const std::optional<at::Tensor>& q_scale))

// Sparse MLA. Requests as the Python ops lay them out (mla_ops/ops/sparse_attention.py):
// block_tables [B, maxb], seq_lens [B], query_start_loc [B + 1].
// q_latent [T, N, L], q_pe [T, N, R]; the cache pair of decode; topk_indices [T, K] int32/int64
// (request-local positions, -1 none); sinks and q_scale [T, N] as for decode -> o_latent [T, N, L] in q's dtype.
MLA_ISA_KERNEL(sparse_mla_attention,
               at::Tensor(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, const at::Tensor& topk_indices, double softmax_scale,
                          const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& q_scale))

// MLA prefill, causal: the request tensors and cache pair of sparse MLA; query token i of request b
// (q_b tokens) sits at position seq_lens[b] - q_b + i and attends the request's positions 0 .. that one
// -> o_latent [T, N, L] in q's dtype. Raises ValueError (the messages of the Python check_request_values)
// before computing anything.
MLA_ISA_KERNEL(mla_prefill_attention,
               at::Tensor(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, double softmax_scale))

// MLA prefill, expanded: q [T, N, Dqk], k [S, N, Dqk], v [S, N, Dv] (last dims unit-stride or copied);
// query_start_loc / key_start_loc [B + 1]; query token i of request b (q_b tokens, k_b keys) attends the
// request's keys 0 .. k_b - q_b + i -> [T, N, Dv] in q's dtype. Raises ValueError (the messages of the
// Python check_mha_prefill_values) before computing anything.
MLA_ISA_KERNEL(mha_prefill_attention,
               at::Tensor(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& query_start_loc, const at::Tensor& key_start_loc, double softmax_scale))

// DeepSeek-V4's attention core: q [T, H, D]; kv_cache [NB, bs, 1, D], one row per token that is key and
// value of every head; the request tensors of sparse MLA; sinks [H] (fp32 or q's dtype) or none;
// compressed_cache [NBc, bsc, 1, D] with compressed_block_tables [B, maxc], or none. The token at position
// p attends to its window rows max(0, p - sliding_window + 1) .. p and to the compressed entries it sees,
// w < (p + 1) // compress_ratio: all of them, or those topk_indices [T, K] lists (-1 none). fp32 scores,
// softmax (sinks in the denominator) and weights -> [T, H, D] in q's dtype. Raises ValueError (the
// messages of the Python check_shared_kv_values) before computing anything.
MLA_ISA_KERNEL(shared_kv_attention,
               at::Tensor(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                          const std::optional<at::Tensor>& sinks, double softmax_scale, int64_t sliding_window,
                          const std::optional<at::Tensor>& compressed_cache,
                          const std::optional<at::Tensor>& compressed_block_tables, int64_t compress_ratio,
                          const std::optional<at::Tensor>& topk_indices))

// q [T, H, D], weights [T, H] (fp32 or q's dtype), k_cache [NB, bs, 1, D] (any strides) -> int32
// [T, topk]: the entries of each token's topk best scores, best first (ties: lower entry first; NaN
// above every number), -1 past the (p + 1) // compress_ratio entries token t at position p sees
// (request b holds seq_lens[b] // compress_ratio; one per token for 1).
MLA_ISA_KERNEL(lightning_indexer,
               at::Tensor(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& k_cache,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, int64_t topk, double softmax_scale,
                          int64_t compress_ratio))

// hidden [B, S, H] -> (k_nope [B, N, S, P], value [B, N, S, V], k_pe [B, 1, S, R]); bit-identical to
// the reference kernel for the layouts reasons.cpp accepts.
MLA_ISA_KERNEL(kv_prolog,
               std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                   const at::Tensor& hidden_states, const at::Tensor& kv_a_weight,
                   const std::optional<at::Tensor>& kv_a_bias, const at::Tensor& kv_norm_weight,
                   const at::Tensor& kv_b_weight, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                   int64_t qk_nope_head_dim, int64_t v_head_dim, double eps, std::string_view rope_layout,
                   std::string_view rope_compute_dtype))

// hidden [B, S, H] -> (latent [B, S, L] normed, k_pe [B, S, R] rotated).
MLA_ISA_KERNEL(latent_kv_prolog,
               std::tuple<at::Tensor, at::Tensor>(const at::Tensor& hidden_states, const at::Tensor& kv_a_weight,
                                                  const std::optional<at::Tensor>& kv_a_bias,
                                                  const at::Tensor& kv_norm_weight, const at::Tensor& cos,
                                                  const at::Tensor& sin, double eps, std::string_view rope_layout,
                                                  std::string_view rope_compute_dtype))

// DeepSeek-V4's K = V prolog: hidden [B, S, Hd], kv_weight [D, Hd], kv_norm_weight [D] (fp32 or hidden's
// dtype), cos / sin [B, S, R/2] or [S, R/2] -> kv [B, S, D]; bit-identical to the reference kernel.
MLA_ISA_KERNEL(shared_kv_prolog,
               at::Tensor(const at::Tensor& hidden_states, const at::Tensor& kv_weight, const at::Tensor& kv_norm_weight,
                          const at::Tensor& cos, const at::Tensor& sin, double eps))

// DeepSeek-V4's query prolog: hidden [B, S, Hd], q_a_weight [Q, Hd], q_norm_weight [Q], q_b_weight [N*D, Q],
// cos / sin as above -> (q [B, S, N, D], q_residual [B, S, Q]); bit-identical to the reference kernel.
MLA_ISA_KERNEL(shared_kv_q_prolog,
               std::tuple<at::Tensor, at::Tensor>(const at::Tensor& hidden_states, const at::Tensor& q_a_weight,
                                                  const at::Tensor& q_norm_weight, const at::Tensor& q_b_weight,
                                                  const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                                                  double eps))

// DeepSeek-V4's KV compressor: kv, gate [T, C] (C = 2D with overlap, D without); position_bias [m, C] and
// norm_weight [D] (fp32 or kv's dtype); cos_cache / sin_cache [P, R/2]; state [B, L, 2, C] and entry_cache
// [NB, bs, 1, D] in kv's dtype (written in place, any strides); the request tensors of sparse MLA. Writes
// the entries of the windows the call closes and the state rows of each request's last min(q_b, L) new
// tokens, bit-identical to the reference kernel. Raises ValueError (the messages of the Python
// check_compressor_values) before writing anything.
MLA_ISA_KERNEL(kv_compressor,
               void(const at::Tensor& kv, const at::Tensor& gate, const at::Tensor& position_bias,
                    const at::Tensor& norm_weight, const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                    const at::Tensor& state, const at::Tensor& entry_cache, const at::Tensor& block_tables,
                    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t compress_ratio,
                    bool overlap, double eps))

// Every sequence's cached tokens, in order, into key [T, Hk, Dk] / value [T, Hv, Dv] (block-run copies,
// any cache strides).
MLA_ISA_KERNEL(gather_pa_kv_cache,
               void(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_tables,
                    const at::Tensor& seq_lens, const at::Tensor& key, const at::Tensor& value,
                    const std::optional<at::Tensor>& seq_offset, bool is_seq_lens_cumsum))

// The out-of-place twin: gathers into clones of key and value (their strides kept) and returns them.
MLA_ISA_KERNEL(gather_pa_kv_cache_functional,
               std::tuple<at::Tensor, at::Tensor>(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                                  const at::Tensor& key, const at::Tensor& value,
                                                  const std::optional<at::Tensor>& seq_offset,
                                                  bool is_seq_lens_cumsum))

// key_cache[slot // bs, slot % bs] = key[t] (same for value) for every token t with slot >= 0.
MLA_ISA_KERNEL(scatter_pa_kv_cache,
               void(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& slot_mapping))

// The one-pool twin (the sparse indexer's key cache): key [T, H, D] into cache [NB, bs, H, D].
MLA_ISA_KERNEL(scatter_pa_cache, void(const at::Tensor& key, const at::Tensor& cache, const at::Tensor& slot_mapping))

// x [..., H] (contiguous), weight [H] in x's dtype or float32 -> [..., H] in promote_types(weight, x):
// weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(x.dtype), bit-identical to the reference kernel.
MLA_ISA_KERNEL(rms_norm, at::Tensor(const at::Tensor& x, const at::Tensor& weight, double eps))

// The tile engine mla_decode_attention / sparse_mla_attention / mla_prefill_attention run for these operands
// (after their checks): "amx" (bf16 on AMX tiles through oneDNN's brgemm), "avx512_bf16" (vdpbf16ps) or "fp32".
MLA_ISA_KERNEL(attention_engine,
               std::string(const at::Tensor& q_latent, const at::Tensor& key_cache, const at::Tensor& value_cache))

// ------------------------------------------------------- shared by the kernel files of one ISA build
inline namespace CPU_CAPABILITY {

// A request's query tokens are rows [first_token, first_token + num_queries); it holds seq_len
// cached tokens, its queries included, and `entries` = seq_len // compress_ratio cached entries.
struct SparseRequest {
  int64_t first_token, num_queries, seq_len, entries;
};
// A call's requests: inline for a few (no heap allocation on a small call).
using SparseRequests = c10::SmallVector<SparseRequest, 4>;

// The Python check_request_values: the same checks in the same order, ValueError with its
// messages (values near 2**63 included); returns the requests. compress_ratio >= 1: tokens per cached
// entry (the block table addresses entries).
SparseRequests check_request_values(std::string_view op, int64_t num_tokens, const at::Tensor& block_tables,
                                    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t num_blocks,
                                    int64_t block_size, int64_t compress_ratio = 1);

}  // namespace CPU_CAPABILITY
}  // namespace mla_native
