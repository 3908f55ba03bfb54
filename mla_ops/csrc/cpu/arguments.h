// The metadata checks of the ops the native kernels serve (arguments.cpp): each is the C++ twin of the
// Python check named in its comment there — same conditions, same order, same messages (checks.h) —
// with its op's schema signature. They look at ranks, sizes, dtypes and devices only (RuntimeError);
// index values are the kernels' own checks (ValueError).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string_view>

namespace mla_native {

void check_decode_attention_args(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, const at::Tensor& block_tables,
                                 const at::Tensor& seq_lens, double softmax_scale,
                                 const std::optional<at::Tensor>& sinks, int64_t sliding_window,
                                 const std::optional<at::Tensor>& q_scale);
void check_sparse_mla_attention_args(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                     const at::Tensor& topk_indices, double softmax_scale,
                                     const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& q_scale);
void check_mla_prefill_attention_args(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                                      const at::Tensor& value_cache, const at::Tensor& block_tables,
                                      const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                      double softmax_scale);
void check_mha_prefill_attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& query_start_loc, const at::Tensor& key_start_loc,
                                      double softmax_scale);
void check_lightning_indexer_args(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& k_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  const at::Tensor& query_start_loc, int64_t topk, double softmax_scale,
                                  int64_t compress_ratio);
void check_shared_kv_attention_args(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                    const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                    const std::optional<at::Tensor>& sinks, double softmax_scale,
                                    int64_t sliding_window, const std::optional<at::Tensor>& compressed_cache,
                                    const std::optional<at::Tensor>& compressed_block_tables, int64_t compress_ratio,
                                    const std::optional<at::Tensor>& topk_indices);
void check_kv_prolog_args(const at::Tensor& hidden, const at::Tensor& kv_a_weight,
                          const std::optional<at::Tensor>& kv_a_bias, const at::Tensor& kv_norm_weight,
                          const at::Tensor& kv_b_weight, const at::Tensor& cos, const at::Tensor& sin,
                          int64_t num_heads, int64_t qk_nope_head_dim, int64_t v_head_dim, double eps,
                          std::string_view rope_layout, std::string_view rope_compute_dtype);
void check_latent_kv_prolog_args(const at::Tensor& hidden, const at::Tensor& kv_a_weight,
                                 const std::optional<at::Tensor>& kv_a_bias, const at::Tensor& kv_norm_weight,
                                 const at::Tensor& cos, const at::Tensor& sin, double eps,
                                 std::string_view rope_layout, std::string_view rope_compute_dtype);
void check_gather_pa_kv_cache_args(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                   const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& key,
                                   const at::Tensor& value, const std::optional<at::Tensor>& seq_offset,
                                   bool is_seq_lens_cumsum);
void check_gather_pa_kv_cache_functional_args(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                              const at::Tensor& key, const at::Tensor& value,
                                              const std::optional<at::Tensor>& seq_offset, bool is_seq_lens_cumsum);
void check_scatter_pa_kv_cache_args(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                                    const at::Tensor& value_cache, const at::Tensor& slot_mapping);
void check_shared_kv_q_prolog_args(const at::Tensor& hidden, const at::Tensor& q_a_weight,
                                   const at::Tensor& q_norm_weight, const at::Tensor& q_b_weight, const at::Tensor& cos,
                                   const at::Tensor& sin, int64_t num_heads, double eps);
void check_shared_kv_prolog_args(const at::Tensor& hidden, const at::Tensor& kv_weight,
                                 const at::Tensor& kv_norm_weight, const at::Tensor& cos, const at::Tensor& sin,
                                 double eps);
void check_kv_compressor_args(const at::Tensor& kv, const at::Tensor& gate, const at::Tensor& position_bias,
                              const at::Tensor& norm_weight, const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                              const at::Tensor& state, const at::Tensor& entry_cache, const at::Tensor& block_tables,
                              const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t compress_ratio,
                              bool overlap, double eps);
void check_rms_norm_args(const at::Tensor& x, const at::Tensor& weight, double eps);
void check_scatter_pa_cache_args(const at::Tensor& key, const at::Tensor& cache, const at::Tensor& slot_mapping);

}  // namespace mla_native
