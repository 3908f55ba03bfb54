// Shared by the prolog kernels (kv_prolog.cpp, shared_kv_prolog.cpp) and the compressor: the projection
// GEMM the reference's F.linear reaches, the rope tables as fp32, and DeepSeek-V4's rotation of a row's
// trailing pairs.
#pragma once

#include "common.h"

#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>

#include <optional>

namespace mla_native {
inline namespace CPU_CAPABILITY {

struct RopeTables {
  const float* cos;
  const float* sin;
  int64_t batch_stride;  // 0 when the tables broadcast over the batch
  int64_t seq_stride;
};

// The tables as contiguous fp32 (usually what they already are: no copy, no dispatcher call).
inline at::Tensor as_f32_contiguous(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat ? t.contiguous() : t.to(at::kFloat).contiguous();
}

// [B, S, R/2] (B may be 1: broadcast) or [S, R/2] contiguous fp32 tables.
inline RopeTables rope_tables(const at::Tensor& cos32, const at::Tensor& sin32) {
  const int64_t half = cos32.size(-1);
  const bool batched = cos32.dim() == 3 && cos32.size(0) > 1;
  return {cos32.const_data_ptr<float>(), sin32.const_data_ptr<float>(), batched ? cos32.size(1) * half : 0, half};
}

// x @ weight^T for a [B, S, K] activation, as [B*S, O] rows: the GEMM at::linear computes. Without a
// bias, linear folds a contiguous 3-D activation to [B*S, K] and calls mm with weight.t()
// (aten/src/ATen/native/LinearAlgebra.cpp, matmul's fold), so mm_out on those operands is the same
// kernel with the same operands, minus linear's and matmul's own dispatcher round trips, which cost more
// than the GEMM on a one-token call (the operands' views are built in place, `alias_with_geometry`).
// The result goes to `out` ([B*S, O], contiguous) and is returned. With a bias or a strided activation,
// linear itself (a new tensor; `out` unused).
inline at::Tensor project(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          const at::Tensor& out) {
  if ((bias.has_value() && bias->defined()) || !x.is_contiguous()) return at::linear(x, weight, bias).contiguous();
  const int64_t rows = x.size(0) * x.size(1), K = x.size(2);
  if (rows == 0) return out;
  const at::Tensor x2 = alias_with_geometry(x, {rows, K}, {K, 1}, x.storage_offset());
  const at::Tensor weight_t = alias_with_geometry(weight, {weight.size(1), weight.size(0)},
                                                  {weight.stride(1), weight.stride(0)}, weight.storage_offset());
  at::mm_out(const_cast<at::Tensor&>(out), x2, weight_t);
  return out;
}

// DeepSeek-V4's apply_rotary_pos_emb on the trailing 2 * half channels of a row of `width`, in place: pairs
// (x0, x1) = (row[2i], row[2i+1]) become (x0*c - x1*s, x1*c + x0*s), computed in fp32 from the row's T
// values with every product rounded separately (the kernel files are compiled with -ffp-contract=off) and
// rounded to T once: `x32 * cos + rotate_half(x)32 * sin` (rotate_half: (-x1, x0)), whose negation is exact.
template <typename T>
inline void rotate_trailing_pairs(T* row, int64_t width, const float* cos, const float* sin, int64_t half) {
  T* rope = row + width - 2 * half;
  for (int64_t i = 0; i < half; ++i) {
    const float x0 = to_f32(rope[2 * i]), x1 = to_f32(rope[2 * i + 1]);
    rope[2 * i] = from_f32<T>(x0 * cos[i] - x1 * sin[i]);
    rope[2 * i + 1] = from_f32<T>(x1 * cos[i] + x0 * sin[i]);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace mla_native
