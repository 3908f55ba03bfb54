// Why the native kernels cannot serve a call (reasons.cpp): the cpu_native backend's declaration of
// what it supports, in words. An empty list: the kernel serves the call; otherwise the reference
// kernel takes it (automatic choice) or it is refused with these sentences (cpu_native requested by
// name), and `mla_ops.explain` prints them. They assume the op's metadata check passed.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace mla_native {

using Reasons = std::vector<std::string>;

// mla_decode_attention / sparse_mla_attention / mla_prefill_attention: the cached rows are read in place.
Reasons decode_reasons(const at::Tensor& q_latent, const at::Tensor& key_cache, const at::Tensor& value_cache);
Reasons sparse_attention_reasons(const at::Tensor& q_latent, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache);
Reasons prefill_attention_reasons(const at::Tensor& q_latent, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache);
// kv_prolog / latent_kv_prolog
Reasons prolog_reasons(const at::Tensor& hidden_states, const at::Tensor& cos, const at::Tensor& sin,
                       std::string_view rope_layout, std::string_view rope_compute_dtype);
// shared_kv_attention: both pools' rows are read in place.
Reasons shared_kv_attention_reasons(const at::Tensor& q, const at::Tensor& kv_cache,
                                    const std::optional<at::Tensor>& compressed_cache);
// mha_prefill_attention (every layout: inputs whose rows the GEMM cannot read in place are copied): float64, and
// bf16 / fp16 where oneDNN runs them on AMX tiles (ATen's flash attention, the reference, does there).
Reasons mha_prefill_reasons(const at::Tensor& q);
// The kernels that serve every layout and decline only a dtype (that of `activation`): lightning_indexer (q),
// shared_kv_q_prolog and shared_kv_prolog (hidden_states), kv_compressor (kv; strided inputs are copied, the state
// and the pool written through their strides).
Reasons dtype_reasons(const at::Tensor& activation);
Reasons rms_norm_reasons(const at::Tensor& x, const at::Tensor& weight);

// The reasons of an op whose arguments number I... are the arguments of `reasons`, in order (for
// registration.cpp: an op's reasons read a few of its arguments).
template <auto reasons, std::size_t... I>
struct ReasonsOf {
  template <typename... Args>
  Reasons operator()(const Args&... args) const {
    const auto all = std::forward_as_tuple(args...);
    return reasons(std::get<I>(all)...);
  }
};

// A kernel that serves every call its op's check lets through.
struct ServesEveryCall {
  template <typename... Args>
  Reasons operator()(const Args&...) const {
    return {};
  }
};

}  // namespace mla_native
