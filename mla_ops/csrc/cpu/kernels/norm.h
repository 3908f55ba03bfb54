// RMSNorm as the reference computes it (mla_ops/ops/rms_norm.py: rms_norm_math), shared by the
// rms_norm kernel and the KV prologs:
//
//   variance = mean(x_fp32^2)   ATen's CPU mean is its sum followed by an IEEE division by the reduced
//                               size (aten/src/ATen/native/ReduceOps.cpp, mean_out): the sum here is
//                               ATen's own sum over the same [rows, H] fp32 squares tensor the reference
//                               builds (a vector reduction's summation order is an implementation detail
//                               of ATen, different per ISA; calling it is the only way to match it bit for
//                               bit) and the division happens per row, in fp32
//   r = 1 / sqrt(variance + eps)   ATen's rsqrt: a correctly rounded sqrt, then a division; eps reaches
//                                  `variance + eps` as a float scalar
//   out = O(float(weight) * float(T(x * r)))   h rounded to x's dtype T, then ATen's multiply in the
//                                              promoted output dtype O (computed in fp32, rounded once)
#pragma once

#include "common.h"

#include <cmath>

namespace mla_native {
inline namespace CPU_CAPABILITY {

// fp32 -> T -> fp32: the rounding the reference applies with `.to(input_dtype)`.
template <typename T>
inline fVec round_through(const fVec& v) {
  return std::get<0>(at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v)));
}
template <>
inline fVec round_through<float>(const fVec& v) {
  return v;
}

// Squares in fp32 of `rows` rows of H elements (row r at x + r * x_stride): the tensor the reference's
// `h.pow(2)` makes, [rows, H] contiguous.
template <typename T>
void squares(const T* x, int64_t rows, int64_t H, int64_t x_stride, float* sq) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    constexpr int64_t W = fVec::size();
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * x_stride;
      float* o = sq + r * H;
      int64_t d = 0;
      for (; d + W <= H; d += W) {
        const fVec v = load_f32<T>(row + d);
        (v * v).store(o + d);
      }
      for (; d < H; ++d) {
        const float v = to_f32(row[d]);
        o[d] = v * v;
      }
    }
  });
}

// r = 1 / sqrt(mean + eps) of one row from its sum of squares.
inline float inverse_rms(float sum_of_squares, int64_t H, float eps) {
  const float variance = sum_of_squares / static_cast<float>(H);  // mean_out's div_(H), exact in fp32
  return 1.f / std::sqrt(variance + eps);
}

// One row: out[d] = O(float(weight[d]) * float(T(x[d] * r))).
template <typename T, typename Wt, typename O>
inline void normalize_row(const T* x, int64_t H, float r, const Wt* weight, O* out) {
  constexpr int64_t W = fVec::size();
  const fVec rv(r);
  int64_t d = 0;
  for (; d + W <= H; d += W) {
    const fVec h = round_through<T>(load_f32<T>(x + d) * rv);
    store_from_f32<O>(out + d, load_f32<Wt>(weight + d) * h);
  }
  for (; d < H; ++d) {
    const float h = to_f32(from_f32<T>(to_f32(x[d]) * r));
    out[d] = from_f32<O>(to_f32(weight[d]) * h);
  }
}

// One row of DeepSeek-V4's RMSNorm (DeepseekV4RMSNorm: `(weight * (x32 * r)).to(T)`): the weight multiplies
// the unrounded fp32 value and the product is rounded once, out[d] = T(float(weight[d]) * (float(x[d]) * r)).
// In place when out == x.
template <typename T, typename Wt>
inline void normalize_row_rounded_once(const T* x, int64_t H, float r, const Wt* weight, T* out) {
  constexpr int64_t W = fVec::size();
  const fVec rv(r);
  int64_t d = 0;
  for (; d + W <= H; d += W) store_from_f32<T>(out + d, load_f32<Wt>(weight + d) * (load_f32<T>(x + d) * rv));
  for (; d < H; ++d) out[d] = from_f32<T>(to_f32(weight[d]) * (to_f32(x[d]) * r));
}

}  // namespace CPU_CAPABILITY
}  // namespace mla_native
