// The cpu_native backend's reasons (reasons.h): what its kernels do not serve, in words.
#include "reasons.h"

#include "checks.h"

#include <ATen/native/CPUBlas.h>

#include <cstdlib>
#include <string>

namespace mla_native {
namespace {

bool native_dtype(const at::Tensor& t) {
  const auto d = t.scalar_type();
  return d == at::kFloat || d == at::kBFloat16 || d == at::kHalf;
}

void add_dtype_reason(Reasons& reasons, const at::Tensor& activation) {
  if (!native_dtype(activation)) {
    reasons.push_back(py_dtype(activation) +
                      " is not served by the native kernels (float32, bfloat16, float16); the reference kernel "
                      "serves it");
  }
}

// Whether a [.., S, R/2] table steps through pairs no slower than through positions.
bool position_major(const at::Tensor& t) {
  return t.dim() < 2 || t.size(-1) <= 1 || t.size(-2) <= 1 || t.stride(-1) <= t.stride(-2);
}

}  // namespace

Reasons prolog_reasons(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                       std::string_view rope_layout, std::string_view rope_compute_dtype) {
  Reasons reasons;
  add_dtype_reason(reasons, hidden);
  if (rope_compute_dtype == "activation" && hidden.scalar_type() != at::kFloat) {
    // In fp32 the kernel's separately rounded fp32 products and sums (-ffp-contract=off) are the
    // "activation" formula itself; in fp16 / bf16 that formula rounds every step to the half type.
    const std::string dtype = py_dtype(hidden);
    reasons.push_back("rope_compute_dtype 'activation' with " + dtype +
                      ": the native prolog kernels rotate k_pe in fp32 and round once; the reference kernel rounds "
                      "each product and sum to " +
                      dtype + " as the stock x*cos + rotate_half(x)*sin does");
  }
  if (!(position_major(cos) && position_major(sin))) {
    // transformers 4.54 - 5.1x build DeepSeek-V2's rotary tables transposed; ATen's complex multiply
    // over such a layout (the stock model's RoPE, and the reference kernel's) takes a loop whose
    // rounding the vectorised native formula does not reproduce
    reasons.push_back(
        "cos/sin are laid out pair-major (the rotary tables of a transposed freqs tensor); the reference kernel "
        "reproduces transformers' rounding for them");
  }
  if (rope_layout != "interleaved" && rope_layout != "half") {
    reasons.push_back("rope_layout " + py_repr(rope_layout) +
                      ": the native prolog kernels rotate adjacent pairs (interleaved or half); the reference "
                      "kernel serves it");
  }
  return reasons;
}

namespace {

// The attention kernels (decode, sparse and prefill: one kernel, decode_attention.cpp) read cached rows in place.
Reasons attention_reasons(const at::Tensor& q_latent, const at::Tensor& key_cache, const at::Tensor& value_cache,
                          std::string_view kernel) {
  Reasons reasons;
  add_dtype_reason(reasons, q_latent);
  if (key_cache.stride(3) != 1 || value_cache.stride(3) != 1) {
    reasons.push_back("the caches' last dim must be unit-stride for the native " + std::string(kernel) + " kernel");
  }
  return reasons;
}

}  // namespace

Reasons decode_reasons(const at::Tensor& q_latent, const at::Tensor& key_cache, const at::Tensor& value_cache) {
  return attention_reasons(q_latent, key_cache, value_cache, "decode");
}

Reasons sparse_attention_reasons(const at::Tensor& q_latent, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache) {
  return attention_reasons(q_latent, key_cache, value_cache, "sparse attention");
}

Reasons prefill_attention_reasons(const at::Tensor& q_latent, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache) {
  return attention_reasons(q_latent, key_cache, value_cache, "prefill attention");
}

Reasons shared_kv_attention_reasons(const at::Tensor& q, const at::Tensor& kv_cache,
                                    const std::optional<at::Tensor>& compressed_cache) {
  Reasons reasons;
  add_dtype_reason(reasons, q);
  if (kv_cache.stride(3) != 1 || (compressed_cache.has_value() && compressed_cache->stride(3) != 1)) {
    reasons.push_back("the pools' last dim (kv_cache, compressed_cache) must be unit-stride for the native shared-KV "
                      "attention kernel");
  }
  return reasons;
}

Reasons rms_norm_reasons(const at::Tensor& x, const at::Tensor& weight) {
  Reasons reasons;
  add_dtype_reason(reasons, x);
  if (weight.scalar_type() != x.scalar_type() && weight.scalar_type() != at::kFloat) {
    reasons.push_back("weight " + py_dtype(weight) + " with x " + py_dtype(x) +
                      ": the native rms_norm takes weight in x's dtype or float32; the reference kernel serves it");
  }
  if (!x.is_contiguous()) {
    // the reference's squares keep x's layout (empty_like), and ATen's sum over that layout may add in
    // another order than over rows
    reasons.push_back("x is not contiguous: the reference kernel reduces over its layout");
  }
  return reasons;
}

Reasons mha_prefill_reasons(const at::Tensor& q) {
  Reasons reasons;
  add_dtype_reason(reasons, q);
  const auto dtype = q.scalar_type();
  // MLA_OPS_NATIVE_AMX=0 (read on every call, as by the AMX engine) leaves AMX tiles out of mla-ops' choices
  const char* amx = std::getenv("MLA_OPS_NATIVE_AMX");
  const bool amx_off = amx != nullptr && std::string(amx) == "0";
  if ((dtype == at::kBFloat16 || dtype == at::kHalf) && !amx_off && at::native::cpublas::could_pack(dtype)) {
    // the native kernel widens to fp32; ATen's flash kernel runs these dtypes on AMX tiles here
    reasons.push_back(py_dtype(q) +
                      " on a CPU where oneDNN runs it on AMX tiles: the reference kernel (ATen's flash attention) "
                      "does; the native expanded-prefill kernel computes in fp32 (MLA_OPS_NATIVE_AMX=0 selects it)");
  }
  return reasons;
}

Reasons dtype_reasons(const at::Tensor& activation) {
  Reasons reasons;
  add_dtype_reason(reasons, activation);
  return reasons;
}

}  // namespace mla_native
