// Declarations of the native CPU kernels (one copy per ISA build, see common.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>

#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace mla_native {
inline namespace CPU_CAPABILITY {

// q_latent [B, N, L], q_pe [B, N, R]; key_cache [NB, bs, 1, L], value_cache [NB, bs, 1, R] (any
// strides); block_tables [B, maxb] and seq_lens [B] int32/int64 -> o_latent [B, N, L] in q's dtype.
// validate=true: raises ValueError (the message of the Python check_decode_values) when a length is
// outside [1, maxb * bs] or a used block id is outside [0, NB), before computing anything.
// validate=false: lengths are clamped into [0, maxb * bs] (0 -> a zero row) and tokens whose
// block id is out of range are skipped (never read).
at::Tensor decode_attention(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double softmax_scale, bool validate);

// The tile engine decode_attention / sparse_mla_attention use for these operands (after their checks):
// "amx" (bf16 on AMX tiles through oneDNN's brgemm), "avx512_bf16" (vdpbf16ps) or "fp32" (fp32 FMA).
std::string attention_engine(const at::Tensor& q_latent, const at::Tensor& key_cache, const at::Tensor& value_cache);

// Sparse MLA (lightning_indexer.cpp, decode_attention.cpp). Requests as the Python ops lay them out
// (mla_ops/ops/sparse_attention.py): block_tables [B, maxb], seq_lens [B], query_start_loc [B + 1].
// A request's query tokens are rows [first_token, first_token + num_queries); it holds seq_len
// cached tokens, its queries included.
struct SparseRequest {
  int64_t first_token, num_queries, seq_len;
};
// A call's requests: inline for a few (no heap allocation on a small call).
using SparseRequests = c10::SmallVector<SparseRequest, 4>;

// The Python check_request_values: the same checks in the same order, ValueError with its
// messages (values near 2**63 included); returns the requests.
SparseRequests check_request_values(std::string_view op, int64_t num_tokens, const at::Tensor& block_tables,
                                    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t num_blocks,
                                    int64_t block_size);

// q [T, H, D], weights [T, H] (fp32 or q's dtype), k_cache [NB, bs, 1, D] (any strides) -> int32
// [T, topk]: the positions of each token's topk best scores, best first (ties: lower position first;
// NaN above every number), -1 past the p + 1 positions token t at position p sees.
at::Tensor lightning_indexer(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& k_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, int64_t topk, double softmax_scale);

// q_latent [T, N, L], q_pe [T, N, R]; the cache pair of decode_attention; topk_indices [T, K]
// int32/int64 (request-local positions, -1 none) -> o_latent [T, N, L] in q's dtype. Raises the
// ValueError of check_request_values / check_index_values before computing anything.
at::Tensor sparse_mla_attention(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                const at::Tensor& topk_indices, double softmax_scale);

// hidden [B, S, H] -> (latent [B, S, L], k_pe [B, S, R]).
std::tuple<at::Tensor, at::Tensor> latent_kv_prolog(const at::Tensor& hidden, const at::Tensor& kv_a_weight,
                                                    const std::optional<at::Tensor>& kv_a_bias,
                                                    const at::Tensor& kv_norm_weight, const at::Tensor& cos,
                                                    const at::Tensor& sin, double eps, bool interleaved);

// hidden [B, S, H] -> (k_nope [B, N, S, P], value [B, N, S, V], k_pe [B, 1, S, R]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> kv_prolog(
    const at::Tensor& hidden, const at::Tensor& kv_a_weight, const std::optional<at::Tensor>& kv_a_bias,
    const at::Tensor& kv_norm_weight, const at::Tensor& kv_b_weight, const at::Tensor& cos, const at::Tensor& sin,
    int64_t num_heads, int64_t qk_nope_head_dim, int64_t v_head_dim, double eps, bool interleaved);

// Index values are validated before the first byte is written; an invalid one raises ValueError
// with the message of the Python value check (check_gather_values / check_scatter_values).
void gather_pa_kv_cache(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, const at::Tensor& key, const at::Tensor& value,
                        const std::optional<at::Tensor>& seq_offset, bool is_seq_lens_cumsum,
                        std::string_view op = "gather_pa_kv_cache");

void scatter_pa_kv_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& slot_mapping);
// The one-pool twin (mla.scatter_pa_cache): key [T, H, D] into cache [NB, bs, H, D].
void scatter_pa_cache(const at::Tensor& key, const at::Tensor& cache, const at::Tensor& slot_mapping);

// Metadata checks (arguments.cpp): the C++ twins of the ops' Python checks, same messages.
void check_decode_attention_args(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, const at::Tensor& block_tables,
                                 const at::Tensor& seq_lens, double softmax_scale);
void check_latent_kv_prolog_args(const at::Tensor& hidden, const at::Tensor& kv_a_weight,
                                 const std::optional<at::Tensor>& kv_a_bias, const at::Tensor& kv_norm_weight,
                                 const at::Tensor& cos, const at::Tensor& sin, double eps,
                                 std::string_view rope_layout, std::string_view rope_compute_dtype);
void check_kv_prolog_args(const at::Tensor& hidden, const at::Tensor& kv_a_weight,
                          const std::optional<at::Tensor>& kv_a_bias, const at::Tensor& kv_norm_weight,
                          const at::Tensor& kv_b_weight, const at::Tensor& cos, const at::Tensor& sin,
                          int64_t num_heads, int64_t qk_nope_head_dim, int64_t v_head_dim, double eps,
                          std::string_view rope_layout, std::string_view rope_compute_dtype);
void check_scatter_pa_kv_cache_args(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                                    const at::Tensor& value_cache, const at::Tensor& slot_mapping);
void check_scatter_pa_cache_args(const at::Tensor& key, const at::Tensor& cache, const at::Tensor& slot_mapping);
void check_lightning_indexer_args(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& k_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  const at::Tensor& query_start_loc, int64_t topk, double softmax_scale);
void check_sparse_mla_attention_args(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                     const at::Tensor& topk_indices, double softmax_scale);
void check_gather_pa_kv_cache_args(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                   const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& key,
                                   const at::Tensor& value, const std::optional<at::Tensor>& seq_offset,
                                   bool is_seq_lens_cumsum, bool functional);

}  // namespace CPU_CAPABILITY
}  // namespace mla_native
