// mla.kv_prolog / mla.latent_kv_prolog on CPU.
//
//   compressed = hidden @ kv_a_weight^T (+ bias)               [B, S, L+R]   (ATen GEMM)
//   latent     = rms_norm(compressed[..., :L])                  [B, S, L]
//   k_pe       = rope(compressed[..., L:])                      [B, S, R]
//   kv         = latent @ kv_b_weight^T                         [B, S, N*(P+V)] (ATen GEMM)
//   k_nope, value = kv viewed [B, S, N, P+V], heads first       [B, N, S, P], [B, N, S, V]
//
// The GEMMs are the ATen GEMM the reference's at::linear reaches (`project`), so with an identical
// latent they give identical results. Everything between and after them is one vectorised pass per token
// row, with no Python; the intermediates (the projections, the fp32 squares that feed the mean and their
// row sums) share one scratch allocation.
//
// Numerics follow the reference kernels operation by operation, so outputs are bit-identical:
// * RMSNorm: as the reference computes it, step for step (norm.h).
// * RoPE: one fp32 complex multiply per pair, products rounded separately:
//   (x0*c - x1*s, x0*s + x1*c). This file is compiled with -ffp-contract=off so the compiler
//   cannot fuse a product and a sum into an FMA (one rounding instead of two).
#include "common.h"
#include "kernels.h"
#include "norm.h"
#include "prolog.h"

#include <ATen/ops/sum.h>

#include <cmath>

namespace mla_native {
inline namespace CPU_CAPABILITY {
namespace {

// RMSNorm of the latent part + RoPE of the rope part for every token row.
template <typename T>
void norm_rope(const T* compressed, int64_t B, int64_t S, int64_t L, int64_t R, const float* sum_sq, float eps,
               const T* norm_weight, const RopeTables& tab, bool interleaved, T* latent, T* k_pe) {
  const int64_t width = L + R, half = R / 2;
  at::parallel_for(0, B * S, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* x = compressed + row * width;
      normalize_row<T, T, T>(x, L, inverse_rms(sum_sq[row], L, eps), norm_weight, latent + row * L);
      const int64_t b = row / S, s = row % S;
      const float* c = tab.cos + b * tab.batch_stride + s * tab.seq_stride;
      const float* sn = tab.sin + b * tab.batch_stride + s * tab.seq_stride;
      const T* xp = x + L;
      T* op = k_pe + row * R;
      for (int64_t i = 0; i < half; ++i) {
        const float x0 = to_f32(xp[2 * i]), x1 = to_f32(xp[2 * i + 1]);
        const float o0 = x0 * c[i] - x1 * sn[i];
        const float o1 = x0 * sn[i] + x1 * c[i];
        if (interleaved) {
          op[2 * i] = from_f32<T>(o0);
          op[2 * i + 1] = from_f32<T>(o1);
        } else {
          op[i] = from_f32<T>(o0);
          op[i + half] = from_f32<T>(o1);
        }
      }
    }
  });
}

// Stage 1 shared by both prologs: writes latent [B*S, L] and k_pe [B*S, R] (row-major). `scratch`: the
// intermediates, compressed [B*S, L+R] in hidden's dtype and the fp32 squares [B*S, L] and their row sums
// [B*S, 1] (the `*_part` shapes below).
void stage1(const at::Tensor& hidden, const at::Tensor& kv_a_weight, const std::optional<at::Tensor>& kv_a_bias,
            const at::Tensor& kv_norm_weight, const at::Tensor& cos, const at::Tensor& sin, double eps,
            bool interleaved, const at::Tensor* scratch, at::Tensor& latent, at::Tensor& k_pe) {
  const int64_t B = hidden.size(0), S = hidden.size(1);
  const int64_t L = kv_norm_weight.size(0), R = kv_a_weight.size(0) - L;
  if (B * S == 0) return;
  const at::Tensor compressed = project(hidden, kv_a_weight, kv_a_bias, scratch[0]);
  const at::Tensor &sq = scratch[1], &sum_sq = scratch[2];
  const at::Tensor cos32 = as_f32_contiguous(cos), sin32 = as_f32_contiguous(sin);
  const at::Tensor weight = kv_norm_weight.contiguous();
  const RopeTables tab = rope_tables(cos32, sin32);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(), "mla_kv_prolog", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "mla native kv_prolog: float64 is served by the reference kernel");
    } else {
      const scalar_t* cp = compressed.const_data_ptr<scalar_t>();
      squares<scalar_t>(cp, B * S, L, L + R, sq.data_ptr<float>());
      // ATen's reduction, exactly as the reference's mean runs it (see the header comment), into the scratch.
      at::sum_out(const_cast<at::Tensor&>(sum_sq), sq, {-1}, /*keepdim=*/true);
      // eps reaches ATen's `variance + eps` as a float scalar: round it the same way.
      norm_rope<scalar_t>(cp, B, S, L, R, sum_sq.const_data_ptr<float>(), static_cast<float>(eps),
                          weight.const_data_ptr<scalar_t>(), tab, interleaved, latent.data_ptr<scalar_t>(),
                          k_pe.data_ptr<scalar_t>());
    }
  });
}

// The scratch parts stage 1 takes, for `rows` token rows.
ScratchPart compressed_part(int64_t rows, int64_t L, int64_t R, at::ScalarType dtype) { return {{rows, L + R}, dtype}; }
ScratchPart squares_part(int64_t rows, int64_t L) { return {{rows, L}, at::kFloat}; }
ScratchPart sums_part(int64_t rows) { return {{rows, 1}, at::kFloat}; }

}  // namespace

// rope_layout is "interleaved" or "half" and rope_compute_dtype "float32" (or "activation" with fp32
// activations, the same formula): the cases reasons.cpp lets through.
std::tuple<at::Tensor, at::Tensor> latent_kv_prolog(const at::Tensor& hidden, const at::Tensor& kv_a_weight,
                                                    const std::optional<at::Tensor>& kv_a_bias,
                                                    const at::Tensor& kv_norm_weight, const at::Tensor& cos,
                                                    const at::Tensor& sin, double eps, std::string_view rope_layout,
                                                    std::string_view /*rope_compute_dtype*/) {
  const bool interleaved = rope_layout == "interleaved";
  const int64_t B = hidden.size(0), S = hidden.size(1);
  const int64_t L = kv_norm_weight.size(0), R = kv_a_weight.size(0) - L;
  const at::ScalarType dtype = hidden.scalar_type();
  at::Tensor latent = new_cpu_tensor({B, S, L}, dtype);
  at::Tensor k_pe = new_cpu_tensor({B, S, R}, dtype);
  const auto scratch = scratch_tensors({compressed_part(B * S, L, R, dtype), squares_part(B * S, L), sums_part(B * S)});
  stage1(hidden, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin, eps, interleaved, scratch.data(), latent, k_pe);
  return {latent, k_pe};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> kv_prolog(
    const at::Tensor& hidden, const at::Tensor& kv_a_weight, const std::optional<at::Tensor>& kv_a_bias,
    const at::Tensor& kv_norm_weight, const at::Tensor& kv_b_weight, const at::Tensor& cos, const at::Tensor& sin,
    int64_t num_heads, int64_t qk_nope_head_dim, int64_t v_head_dim, double eps, std::string_view rope_layout,
    std::string_view /*rope_compute_dtype*/) {
  const bool interleaved = rope_layout == "interleaved";
  const int64_t B = hidden.size(0), S = hidden.size(1);
  const int64_t L = kv_norm_weight.size(0), R = kv_a_weight.size(0) - L;
  const int64_t N = num_heads, P = qk_nope_head_dim, V = v_head_dim;
  const at::ScalarType dtype = hidden.scalar_type();
  at::Tensor k_pe = new_cpu_tensor({B, 1, S, R}, dtype);  // same memory order as [B, S, R]
  at::Tensor k_nope = new_cpu_tensor({B, N, S, P}, dtype);
  at::Tensor value = new_cpu_tensor({B, N, S, V}, dtype);
  if (B * S == 0) return {k_nope, value, k_pe};
  // stage 1's intermediates, then the normed latent [B, S, L] and kv [B*S, N*(P+V)]: one allocation, which
  // keeps stage 1's intermediates alive through the kv GEMM (at V2-Lite dims in bf16 ≈ 3 KB a token more
  // at the peak, against ≈ 17 KB a token of latent, kv and outputs) for one allocation instead of five
  auto scratch = scratch_tensors({compressed_part(B * S, L, R, dtype), squares_part(B * S, L), sums_part(B * S),
                                  {{B, S, L}, dtype}, {{B * S, N * (P + V)}, dtype}});
  at::Tensor& latent = scratch[3];
  stage1(hidden, kv_a_weight, kv_a_bias, kv_norm_weight, cos, sin, eps, interleaved, scratch.data(), latent, k_pe);
  const at::Tensor kv = project(latent, kv_b_weight, std::nullopt, scratch[4]);
  // [B, S, N, P|V] -> [B, N, S, P] and [B, N, S, V]: one pass of row copies.
  const int64_t el = kv.element_size();
  const char* src = static_cast<const char*>(kv.const_data_ptr());
  char* kn = static_cast<char*>(k_nope.data_ptr());
  char* vv = static_cast<char*>(value.data_ptr());
  at::parallel_for(0, B * S * N, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (S * N), s = (i / N) % S, n = i % N;
      const char* row = src + i * (P + V) * el;
      const int64_t dst = (b * N + n) * S + s;
      std::memcpy(kn + dst * P * el, row, P * el);
      std::memcpy(vv + dst * V * el, row + P * el, V * el);
    }
  });
  return {k_nope, value, k_pe};
}

}  // namespace CPU_CAPABILITY
}  // namespace mla_native

MLA_REGISTER_ISA_KERNEL(kv_prolog)
MLA_REGISTER_ISA_KERNEL(latent_kv_prolog)
