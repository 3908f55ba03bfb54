// Declarations of the native CPU kernels (one copy per ISA build, see common.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace mla_native {
inline namespace CPU_CAPABILITY {

// q_latent [B, N, L], q_pe [B, N, R]; key_cache [NB, bs, 1, L], value_cache [NB, bs, 1, R] (any
// strides); block_tables [B, maxb] and seq_lens [B] int32/int64 -> o_latent [B, N, L] in q's dtype.
// validate=true: returns an undefined tensor (None in Python) when a length is outside
// [1, maxb * bs] or a used block id is outside [0, NB), before computing anything.
// validate=false: lengths are clamped into [0, maxb * bs] (0 -> a zero row) and tokens whose
// block id is out of range are skipped (never read).
at::Tensor decode_attention(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double softmax_scale, bool validate);

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

// Returns 0 when the values are valid and the copy was done, 1 when a value is invalid (nothing
// written; the caller formats the error).
int64_t gather_pa_kv_cache(const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& key,
                           at::Tensor& value, const std::optional<at::Tensor>& seq_offset, bool is_seq_lens_cumsum);

int64_t scatter_pa_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                            at::Tensor& value_cache, const at::Tensor& slot_mapping);

}  // namespace CPU_CAPABILITY
}  // namespace mla_native
