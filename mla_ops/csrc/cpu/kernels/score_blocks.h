// fp32 score micro-kernels shared by the attention kernels (decode_attention.cpp) and the sparse
// indexer (lightning_indexer.cpp): register blocks of query rows x cached rows, each accumulator a
// dot product with lanes over the dims, reduced a whole block at once.
#pragma once

#include "common.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace mla_native {
inline namespace CPU_CAPABILITY {

inline float hsum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, v);
}

// ------------------------------------------------------------------ register-block reductions

// out[h * out_stride + t] += sum of the lanes of acc[h][t], for an NH x NT block of accumulators.
template <int NH, int NT>
inline void add_block_sums(const fVec (&acc)[NH][NT], float* out, int64_t out_stride) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (NH == 4 && NT == 4) {
    // Transpose-and-add tree: 16 vectors -> one vector whose lane 4h+t is the sum of acc[h][t]
    // (45 shuffles/adds for 16 sums instead of ~8 operations per horizontal sum).
    __m512 s[8];
    for (int i = 0; i < 8; ++i) {
      const __m512 a = acc[(2 * i) / 4][(2 * i) % 4], b = acc[(2 * i + 1) / 4][(2 * i + 1) % 4];
      s[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
    __m512 w[4];
    for (int i = 0; i < 4; ++i) {
      w[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    }
    const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(z01, z23, _MM_SHUFFLE(3, 1, 3, 1)));
    alignas(64) float sums[16];
    _mm512_store_ps(sums, r);
    for (int h = 0; h < 4; ++h) {
      float* o = out + h * out_stride;
      _mm_storeu_ps(o, _mm_add_ps(_mm_loadu_ps(o), _mm_load_ps(sums + 4 * h)));
    }
    return;
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (NH == 2 && NT == 4) {
    // 8 vectors -> one vector whose lane 4h+t is the sum of acc[h][t].
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0][0], acc[0][1]), _mm256_hadd_ps(acc[0][2], acc[0][3]));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[1][0], acc[1][1]), _mm256_hadd_ps(acc[1][2], acc[1][3]));
    const __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
    _mm_storeu_ps(out, _mm_add_ps(_mm_loadu_ps(out), _mm256_castps256_ps128(r)));
    float* o1 = out + out_stride;
    _mm_storeu_ps(o1, _mm_add_ps(_mm_loadu_ps(o1), _mm256_extractf128_ps(r, 1)));
    return;
  }
#endif
  for (int h = 0; h < NH; ++h)
    for (int t = 0; t < NT; ++t) out[h * out_stride + t] += hsum(acc[h][t]);
}

// Register block of the fp32 score micro-kernel: kScoreHeads query rows x kScoreTokens cached rows of
// accumulators (16 on AVX-512's 32 registers, 8 on AVX2's 16: enough independent FMA chains to cover
// the FMA latency).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kScoreHeads = 4;
#else
constexpr int kScoreHeads = 2;
#endif
constexpr int kScoreTokens = 4;

// out[h][t] += ql[h] . lat[t] + qp[h] . pe[t]: one register block and one reduction for both
// parts. The accumulators stay local to this function so that GCC keeps them in registers.
template <int NH, int NT>
inline void f32_score_block(const float* const* ql, const float* const* lat, int64_t L, const float* const* qp,
                            const float* const* pe, int64_t R, float* out, int64_t out_stride) {
  constexpr int64_t W = fVec::size();
  fVec acc[NH][NT];
  for (int h = 0; h < NH; ++h)
    for (int t = 0; t < NT; ++t) acc[h][t] = fVec(0.f);
  for (int part = 0; part < 2; ++part) {
    const float* const* q = part == 0 ? ql : qp;
    const float* const* rows = part == 0 ? lat : pe;
    const int64_t Dv = (part == 0 ? L : R) / W * W;
    for (int64_t d = 0; d < Dv; d += W) {
      fVec r[NT];
      for (int t = 0; t < NT; ++t) {
        r[t] = fVec::loadu(rows[t] + d);
        pin(r[t]);
      }
      for (int h = 0; h < NH; ++h) {
        fVec x = fVec::loadu(q[h] + d);
        pin(x);
        for (int t = 0; t < NT; ++t) acc[h][t] = at::vec::fmadd(x, r[t], acc[h][t]);
      }
    }
  }
  add_block_sums<NH, NT>(acc, out, out_stride);
  for (int part = 0; part < 2; ++part) {
    const float* const* q = part == 0 ? ql : qp;
    const float* const* rows = part == 0 ? lat : pe;
    const int64_t D = part == 0 ? L : R;
    for (int64_t d = D / W * W; d < D; ++d)
      for (int h = 0; h < NH; ++h)
        for (int t = 0; t < NT; ++t) out[h * out_stride + t] += q[h][d] * rows[t][d];
  }
}

// Row `src` (D elements of T, element stride `stride`) -> fp32 `dst`.
template <typename T>
inline void row_to_f32(float* dst, const T* src, int64_t D, int64_t stride) {
  constexpr int64_t W = fVec::size();
  int64_t d = 0;
  if (stride == 1) {
    for (; d + W <= D; d += W) load_f32<T>(src + d).store(dst + d);
    for (; d < D; ++d) dst[d] = to_f32(src[d]);
  } else {
    for (; d < D; ++d) dst[d] = to_f32(src[d * stride]);
  }
}


}  // namespace CPU_CAPABILITY
}  // namespace mla_native
