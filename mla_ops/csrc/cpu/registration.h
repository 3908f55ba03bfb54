// The dispatcher registration of the native kernels and the direct entry points (registration.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace mla_native {
inline namespace CPU_CAPABILITY {

// Why this backend cannot serve a call, in words (empty: it can).
using Reasons = std::vector<std::string>;

Reasons prolog_reasons(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                       std::string_view rope_layout, std::string_view rope_compute_dtype);
Reasons decode_reasons(const at::Tensor& q_latent, const at::Tensor& key_cache, const at::Tensor& value_cache);
Reasons sparse_attention_reasons(const at::Tensor& q_latent, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache);
Reasons indexer_reasons(const at::Tensor& q);

// One op to serve from the dispatcher: `demand` (the backend was requested by name) refuses what the
// kernel cannot serve with refusal_head + "; ".join(reasons) + refusal_tail; otherwise the reference
// kernel takes those calls.
struct OpRequest {
  std::string op;
  bool demand;
  std::string refusal_head, refusal_tail;
};

std::vector<std::string> dispatcher_ops();                 // the ops `bind` can serve
void bind(const std::vector<OpRequest>& requests);          // replaces any earlier binding of this build
void unbind();                                              // removes this build's registrations
std::string registration_file();                            // the file the dispatcher records for them
// A do-nothing kernel for each `ns::name` (schemas defined elsewhere, in Python): what a call of that
// schema costs from Python before any work (the benchmark's entry floor; outputs alias an input).
void bind_entry_floor(const std::string& ns, const std::vector<std::string>& names);

// Direct calls (checks + kernel; a call the kernel cannot serve raises NotImplementedError).
// validate_values=false: the decode kernel's own guarantees instead of the value checks (lengths
// clamped into the table, out-of-range block ids never read; see ops.h), for the tests of them.
at::Tensor call_decode_attention(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, const at::Tensor& block_tables,
                                 const at::Tensor& seq_lens, double softmax_scale, bool validate_values = true);
std::tuple<at::Tensor, at::Tensor, at::Tensor> call_kv_prolog(
    const at::Tensor& hidden, const at::Tensor& kv_a_weight, const std::optional<at::Tensor>& kv_a_bias,
    const at::Tensor& kv_norm_weight, const at::Tensor& kv_b_weight, const at::Tensor& cos, const at::Tensor& sin,
    int64_t num_heads, int64_t qk_nope_head_dim, int64_t v_head_dim, double eps, const std::string& rope_layout,
    const std::string& rope_compute_dtype);
std::tuple<at::Tensor, at::Tensor> call_latent_kv_prolog(const at::Tensor& hidden, const at::Tensor& kv_a_weight,
                                                         const std::optional<at::Tensor>& kv_a_bias,
                                                         const at::Tensor& kv_norm_weight, const at::Tensor& cos,
                                                         const at::Tensor& sin, double eps,
                                                         const std::string& rope_layout,
                                                         const std::string& rope_compute_dtype);
void call_gather_pa_kv_cache(const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& key,
                             const at::Tensor& value, const std::optional<at::Tensor>& seq_offset,
                             bool is_seq_lens_cumsum);
std::tuple<at::Tensor, at::Tensor> call_gather_pa_kv_cache_functional(
    const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& seq_offset, bool is_seq_lens_cumsum);
void call_scatter_pa_kv_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                              const at::Tensor& value_cache, const at::Tensor& slot_mapping);
void call_scatter_pa_cache(const at::Tensor& key, const at::Tensor& cache, const at::Tensor& slot_mapping);
at::Tensor call_lightning_indexer(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& k_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  const at::Tensor& query_start_loc, int64_t topk, double softmax_scale);
at::Tensor call_sparse_mla_attention(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                     const at::Tensor& topk_indices, double softmax_scale);

}  // namespace CPU_CAPABILITY
}  // namespace mla_native
