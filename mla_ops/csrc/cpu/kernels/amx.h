// AMX tiles through oneDNN's brgemm ukernel (at::native::cpublas::brgemm), shared by the attention
// kernels (decode_attention.cpp) and the sparse indexer (lightning_indexer.cpp).
//
// Both compute a product of cached rows with a few query rows transposed, rows . Q^T, so the cached
// rows are brgemm's A matrix, read in place (or gathered into a tile), and only the queries are
// packed into the VNNI layout B needs: B[k / 2][n][k % 2] = Q[n][k]. Only the AVX-512 build has the
// AMX code; it serves only where oneDNN runs AMX (`amx_engine_enabled`).
#pragma once

#include "common.h"

#include <cstdlib>
#include <string>

#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__)
#include <ATen/native/CPUBlas.h>
#if defined(CPUBLAS_BRGEMM_BF16BF16F32)
#define MLA_AMX 1
#endif
#endif

namespace mla_native {
inline namespace CPU_CAPABILITY {

#if defined(MLA_AMX)

// Whether the AMX kernels may serve: oneDNN runs AMX tiles here (its effective ISA, which
// DNNL_MAX_CPU_ISA caps, and torch.backends.mkldnn enabled) and MLA_OPS_NATIVE_AMX is not "0"
// (read on every call).
inline bool amx_engine_enabled() {
  const char* env = std::getenv("MLA_OPS_NATIVE_AMX");
  if (env != nullptr && std::string(env) == "0") return false;
  return at::native::cpublas::could_pack(at::kBFloat16);
}

// dst[d / 2][n][d % 2] = src[n * src_stride + d] for n < count, d < D (even): the VNNI layout of the
// transposed rows, ld columns per row pair (columns past count are left as they are).
inline void pack_transposed_vnni(const at::BFloat16* src, int64_t count, int64_t src_stride, int64_t D, int64_t ld,
                                 at::BFloat16* dst) {
  for (int64_t n = 0; n < count; ++n) {
    const at::BFloat16* row = src + n * src_stride;
    for (int64_t d = 0; d < D; d += 2) {
      dst[d * ld + 2 * n] = row[d];
      dst[d * ld + 2 * n + 1] = row[d + 1];
    }
  }
}

// The distance between consecutive rows when the n rows are equally spaced at least min_step
// elements apart (so they can be one strided matrix), else 0.
inline std::ptrdiff_t equal_row_step(const at::BFloat16* const* rows, int64_t n, int64_t min_step) {
  if (n == 1) return min_step;
  const std::ptrdiff_t step = rows[1] - rows[0];
  if (step < min_step) return 0;
  for (int64_t i = 2; i < n; ++i)
    if (rows[i] - rows[i - 1] != step) return 0;
  return step;
}

#endif  // MLA_AMX

}  // namespace CPU_CAPABILITY
}  // namespace mla_native
