// mla.shared_kv_prolog / mla.shared_kv_q_prolog on CPU: DeepSeek-V4's K=V and query prologs
// (mla_ops/ops/shared_kv_prolog.py).
//
//   kv         = rope_trailing(weighted_rms(hidden @ kv_weight^T))                       [B, S, D]
//   q_residual = weighted_rms(hidden @ q_a_weight^T)                                    [B, S, Q]
//   q          = rope_trailing(unweighted_rms(q_residual @ q_b_weight^T), per head)      [B, S, N, D]
//
// The GEMMs are the ATen GEMM the reference's F.linear reaches (prolog.h: `project`), written straight into
// the outputs; the rest is one pass per token row (per head for q), in place. Bit-identical to the reference:
// * weighted RMSNorm (DeepseekV4RMSNorm): the fp32 squares and ATen's sum over them (norm.h), then
//   T(float(weight) * (x * r)), rounded once (norm.h: normalize_row_rounded_once).
// * unweighted RMSNorm (DeepseekV4UnweightedRMSNorm): the same r, rounded to T, then the multiply in T:
//   T(float(x) * float(T(r))).
// * rope of each row's (each head's) trailing R channels, in fp32 with one rounding (prolog.h).
#include "common.h"
#include "kernels.h"
#include "norm.h"
#include "prolog.h"

#include <ATen/ops/sum.h>

namespace mla_native {
inline namespace CPU_CAPABILITY {
namespace {

// sums[r] = ATen's sum of the fp32 squares of row r of `rows` rows of H (the reference's mean numerator);
// sq: scratch [rows, H] fp32, sums: [rows, 1] fp32.
template <typename T>
void sums_of_squares(const T* x, int64_t rows, int64_t H, const at::Tensor& sq, const at::Tensor& sums) {
  squares<T>(x, rows, H, H, sq.data_ptr<float>());
  at::sum_out(const_cast<at::Tensor&>(sums), sq, {-1}, /*keepdim=*/true);
}

// out row r = weighted_rms(x row r) for rows of H (out may be x).
template <typename T>
void weighted_rms_rows(const T* x, int64_t rows, int64_t H, const float* sums, float eps, const at::Tensor& weight,
                       T* out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float r = inverse_rms(sums[row], H, eps);
      if (weight.scalar_type() == at::kFloat) {
        normalize_row_rounded_once<T, float>(x + row * H, H, r, weight.const_data_ptr<float>(), out + row * H);
      } else {
        normalize_row_rounded_once<T, T>(x + row * H, H, r, weight.const_data_ptr<T>(), out + row * H);
      }
    }
  });
}

// Every row of `rows` rows of H, in place: x * T(r) in T (DeepseekV4UnweightedRMSNorm).
template <typename T>
void unweighted_rms_rows(T* x, int64_t rows, int64_t H, const float* sums, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    constexpr int64_t W = fVec::size();
    for (int64_t row = begin; row < end; ++row) {
      T* xr = x + row * H;
      const float r = to_f32(from_f32<T>(inverse_rms(sums[row], H, eps)));  // .to(x.dtype)
      const fVec rv(r);
      int64_t d = 0;
      for (; d + W <= H; d += W) store_from_f32<T>(xr + d, load_f32<T>(xr + d) * rv);
      for (; d < H; ++d) xr[d] = from_f32<T>(to_f32(xr[d]) * r);
    }
  });
}

// Rotates the trailing pairs of every head row of `heads` rows of D per token of a [B, S] grid, in place.
template <typename T>
void rotate_rows(T* rows, int64_t B, int64_t S, int64_t heads, int64_t D, const RopeTables& tab, int64_t half) {
  at::parallel_for(0, B * S, 16, [&](int64_t begin, int64_t end) {
    for (int64_t token = begin; token < end; ++token) {
      const int64_t b = token / S, s = token % S;
      const float* c = tab.cos + b * tab.batch_stride + s * tab.seq_stride;
      const float* sn = tab.sin + b * tab.batch_stride + s * tab.seq_stride;
      for (int64_t h = 0; h < heads; ++h) rotate_trailing_pairs<T>(rows + (token * heads + h) * D, D, c, sn, half);
    }
  });
}

// [B, S, O] activation rows of weighted_rms(hidden @ weight^T) into `out` ([B, S, O] contiguous).
template <typename T>
void normed_projection(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& norm_weight, float eps,
                       const at::Tensor& out) {
  const int64_t rows = hidden.size(0) * hidden.size(1), O = weight.size(0);
  const at::Tensor out2 = alias_with_geometry(out, {rows, O}, {O, 1}, out.storage_offset());
  const at::Tensor projected = project(hidden, weight, std::nullopt, out2);
  const auto scratch = scratch_tensors({{{rows, O}, at::kFloat}, {{rows, 1}, at::kFloat}});
  const T* x = projected.const_data_ptr<T>();
  sums_of_squares<T>(x, rows, O, scratch[0], scratch[1]);
  weighted_rms_rows<T>(x, rows, O, scratch[1].const_data_ptr<float>(), eps, norm_weight.contiguous(),
                       out.data_ptr<T>());
}

}  // namespace

at::Tensor shared_kv_prolog(const at::Tensor& hidden, const at::Tensor& kv_weight, const at::Tensor& kv_norm_weight,
                            const at::Tensor& cos, const at::Tensor& sin, double eps) {
  const int64_t B = hidden.size(0), S = hidden.size(1), D = kv_weight.size(0);
  at::Tensor kv = new_cpu_tensor({B, S, D}, hidden.scalar_type());
  if (B * S == 0) return kv;
  const at::Tensor cos32 = as_f32_contiguous(cos), sin32 = as_f32_contiguous(sin);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(), "mla_shared_kv_prolog", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "mla native shared_kv_prolog: float64 is served by the reference kernel");
    } else {
      normed_projection<scalar_t>(hidden, kv_weight, kv_norm_weight, static_cast<float>(eps), kv);
      rotate_rows<scalar_t>(kv.data_ptr<scalar_t>(), B, S, 1, D, rope_tables(cos32, sin32), cos.size(-1));
    }
  });
  return kv;
}

std::tuple<at::Tensor, at::Tensor> shared_kv_q_prolog(const at::Tensor& hidden, const at::Tensor& q_a_weight,
                                                      const at::Tensor& q_norm_weight, const at::Tensor& q_b_weight,
                                                      const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                                                      double eps) {
  const int64_t B = hidden.size(0), S = hidden.size(1), Q = q_a_weight.size(0);
  const int64_t N = num_heads, D = q_b_weight.size(0) / num_heads;
  const at::ScalarType dtype = hidden.scalar_type();
  at::Tensor q_residual = new_cpu_tensor({B, S, Q}, dtype);
  at::Tensor q = new_cpu_tensor({B, S, N, D}, dtype);
  if (B * S == 0) return {q, q_residual};
  const at::Tensor cos32 = as_f32_contiguous(cos), sin32 = as_f32_contiguous(sin);
  const float eps32 = static_cast<float>(eps);  // `+ eps` adds it as a float scalar
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "mla_shared_kv_q_prolog", [&] {
    using T = scalar_t;
    if constexpr (std::is_same_v<T, double>) {
      TORCH_CHECK(false, "mla native shared_kv_q_prolog: float64 is served by the reference kernel");
    } else {
      normed_projection<T>(hidden, q_a_weight, q_norm_weight, eps32, q_residual);
      const int64_t rows = B * S * N;
      project(q_residual, q_b_weight, std::nullopt, alias_with_geometry(q, {B * S, N * D}, {N * D, 1}, 0));
      const auto scratch = scratch_tensors({{{rows, D}, at::kFloat}, {{rows, 1}, at::kFloat}});
      T* heads = q.data_ptr<T>();
      sums_of_squares<T>(heads, rows, D, scratch[0], scratch[1]);
      unweighted_rms_rows<T>(heads, rows, D, scratch[1].const_data_ptr<float>(), eps32);
      rotate_rows<T>(heads, B, S, N, D, rope_tables(cos32, sin32), cos.size(-1));
    }
  });
  return {q, q_residual};
}

}  // namespace CPU_CAPABILITY
}  // namespace mla_native

MLA_REGISTER_ISA_KERNEL(shared_kv_prolog)
MLA_REGISTER_ISA_KERNEL(shared_kv_q_prolog)
