// mla.rms_norm on CPU: out = weight * (x_fp32 * rsqrt(mean(x_fp32^2, -1) + eps)).to(x.dtype), in
// promote_types(weight, x), bit-identical to the reference kernel (and so to transformers'
// DeepseekV2RMSNorm): the fp32 squares of every row, ATen's sum over them (the reference's mean is that
// sum, then a division), then one vectorised pass per row (norm.h says why each step matches).
#include "common.h"
#include "kernels.h"
#include "norm.h"

#include <ATen/ops/sum.h>

namespace mla_native {
inline namespace CPU_CAPABILITY {
namespace {

template <typename T, typename Wt, typename O>
void normalize_rows(const T* x, int64_t rows, int64_t H, const float* sum_sq, float eps, const Wt* weight, O* out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      normalize_row<T, Wt, O>(x + row * H, H, inverse_rms(sum_sq[row], H, eps), weight, out + row * H);
    }
  });
}

}  // namespace

// x [..., H] contiguous; weight [H] in x's dtype or float32 (what reasons.cpp lets through).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t H = x.size(-1);
  const at::ScalarType out_dtype = c10::promoteTypes(weight.scalar_type(), x.scalar_type());
  at::Tensor out = new_cpu_tensor(x.sizes(), out_dtype);
  const int64_t rows = H == 0 ? 0 : x.numel() / H;
  if (rows == 0) return out;
  auto scratch = scratch_tensors({{{rows, H}, at::kFloat}, {{rows, 1}, at::kFloat}});
  at::Tensor &sq = scratch[0], &sum_sq = scratch[1];
  const at::Tensor w = weight.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "mla_rms_norm", [&] {
    using T = scalar_t;
    if constexpr (std::is_same_v<T, double>) {
      TORCH_CHECK(false, "mla native rms_norm: float64 is served by the reference kernel");
    } else {
      const T* xp = x.const_data_ptr<T>();
      squares<T>(xp, rows, H, H, sq.data_ptr<float>());
      at::sum_out(sum_sq, sq, {-1}, /*keepdim=*/true);
      const float* sums = sum_sq.const_data_ptr<float>();
      if (weight.scalar_type() == at::kFloat) {
        normalize_rows<T, float, float>(xp, rows, H, sums, static_cast<float>(eps), w.const_data_ptr<float>(),
                                        out.data_ptr<float>());
      } else {
        normalize_rows<T, T, T>(xp, rows, H, sums, static_cast<float>(eps), w.const_data_ptr<T>(), out.data_ptr<T>());
      }
    }
  });
  return out;
}

}  // namespace CPU_CAPABILITY
}  // namespace mla_native

MLA_REGISTER_ISA_KERNEL(rms_norm)
