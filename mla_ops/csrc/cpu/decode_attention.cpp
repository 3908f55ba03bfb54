// mla.mla_decode_attention on CPU: absorbed MQA over the paged latent cache.
//
//   scores[b, n, t] = scale * (q_latent[b, n] . latent[b, t] + q_pe[b, n] . k_pe[b, t])
//   o_latent[b, n]  = softmax_t(scores[b, n, :seq_lens[b]]) . latent[b, :seq_lens[b]]
//
// Every head attends over the same cached rows, so the kernel is organised around the cache:
// each work unit owns one chunk of one sequence's context and ALL heads; it reads each cached
// row once (converting bf16/fp16 to fp32 once per row), scores it against every head, and
// accumulates every head's output with an online (flash-decoding style) softmax in fp32. Units
// split a sequence's context (split-K) so one sequence keeps every core busy; a final pass merges
// the per-unit (max, sum, accumulator) triples per head and writes the output dtype.
//
// Positions at or past a row's length are never read: the chunks cover [0, len) only, so
// whatever sits in unattended slots (NaN/inf included) cannot reach the output.
#include "common.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace mla_native {
inline namespace CPU_CAPABILITY {
namespace {

// Tokens scored together: the unit of the online-softmax update (one max / rescale per tile per
// head) and a multiple of every fVec width (4 NEON, 8 AVX2/default, 16 AVX-512).
constexpr int64_t kTile = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float hsum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, v);
}

// out[h][t] += dot(q[h], rows[t]) over D, for NH heads x NT tokens held in registers at once:
// each loaded query / row vector feeds several FMAs (2x4 -> 8 FMAs per 6 loads).
template <int NH, int NT>
inline void dot_block(const float* const* q, const float* const* rows, int64_t D, float* out, int64_t out_stride) {
  constexpr int64_t W = fVec::size();
  const int64_t Dv = D - D % W;
  fVec acc[NH][NT];
  for (int h = 0; h < NH; ++h)
    for (int t = 0; t < NT; ++t) acc[h][t] = fVec(0.f);
  for (int64_t d = 0; d < Dv; d += W) {
    fVec r[NT];
    for (int t = 0; t < NT; ++t) {
      r[t] = fVec::loadu(rows[t] + d);
      pin(r[t]);
    }
    for (int h = 0; h < NH; ++h) {
      const fVec x = fVec::loadu(q[h] + d);
      for (int t = 0; t < NT; ++t) acc[h][t] = at::vec::fmadd(x, r[t], acc[h][t]);
    }
  }
  for (int h = 0; h < NH; ++h) {
    for (int t = 0; t < NT; ++t) {
      float s = hsum(acc[h][t]);
      for (int64_t d = Dv; d < D; ++d) s += q[h][d] * rows[t][d];
      out[h * out_stride + t] += s;
    }
  }
}

// scores[n * kTile + t] += q[n] . rows[t] for all N heads and nt tokens.
void add_scores(const float* q, int64_t N, const float* const* rows, int64_t nt, int64_t D, float* scores) {
  int64_t n = 0;
  for (; n + 2 <= N; n += 2) {
    const float* qh[2] = {q + n * D, q + (n + 1) * D};
    int64_t t = 0;
    for (; t + 4 <= nt; t += 4) dot_block<2, 4>(qh, rows + t, D, scores + n * kTile + t, kTile);
    for (; t < nt; ++t) dot_block<2, 1>(qh, rows + t, D, scores + n * kTile + t, kTile);
  }
  for (; n < N; ++n) {
    const float* qh[1] = {q + n * D};
    int64_t t = 0;
    for (; t + 4 <= nt; t += 4) dot_block<1, 4>(qh, rows + t, D, scores + n * kTile + t, kTile);
    for (; t < nt; ++t) dot_block<1, 1>(qh, rows + t, D, scores + n * kTile + t, kTile);
  }
}

// o[h] += sum_t p[h][t] * rows[t] for NH heads, two output vectors per head in registers while
// the tile's rows stream through (NH*2 FMAs per 2 row loads + NH broadcasts).
template <int NH>
inline void accumulate_heads(float* const* o, const float* const* p, const float* const* rows, int64_t nt,
                             int64_t L) {
  constexpr int64_t W = fVec::size();
  int64_t d = 0;
  for (; d + 2 * W <= L; d += 2 * W) {
    fVec acc[NH][2];
    for (int h = 0; h < NH; ++h) {
      acc[h][0] = fVec::loadu(o[h] + d);
      acc[h][1] = fVec::loadu(o[h] + d + W);
    }
    for (int64_t t = 0; t < nt; ++t) {
      const fVec r0 = fVec::loadu(rows[t] + d);
      const fVec r1 = fVec::loadu(rows[t] + d + W);
      for (int h = 0; h < NH; ++h) {
        const fVec w(p[h][t]);
        acc[h][0] = at::vec::fmadd(w, r0, acc[h][0]);
        acc[h][1] = at::vec::fmadd(w, r1, acc[h][1]);
      }
    }
    for (int h = 0; h < NH; ++h) {
      acc[h][0].store(o[h] + d);
      acc[h][1].store(o[h] + d + W);
    }
  }
  for (; d + W <= L; d += W) {
    for (int h = 0; h < NH; ++h) {
      fVec acc = fVec::loadu(o[h] + d);
      for (int64_t t = 0; t < nt; ++t) acc = at::vec::fmadd(fVec(p[h][t]), fVec::loadu(rows[t] + d), acc);
      acc.store(o[h] + d);
    }
  }
  for (; d < L; ++d) {
    for (int h = 0; h < NH; ++h) {
      float acc = o[h][d];
      for (int64_t t = 0; t < nt; ++t) acc += p[h][t] * rows[t][d];
      o[h][d] = acc;
    }
  }
}

void accumulate(float* o, int64_t N, const float* p, const float* const* rows, int64_t nt, int64_t L) {
  int64_t n = 0;
  for (; n + 4 <= N; n += 4) {
    float* oh[4] = {o + n * L, o + (n + 1) * L, o + (n + 2) * L, o + (n + 3) * L};
    const float* ph[4] = {p + n * kTile, p + (n + 1) * kTile, p + (n + 2) * kTile, p + (n + 3) * kTile};
    accumulate_heads<4>(oh, ph, rows, nt, L);
  }
  for (; n < N; ++n) {
    float* oh[1] = {o + n * L};
    const float* ph[1] = {p + n * kTile};
    accumulate_heads<1>(oh, ph, rows, nt, L);
  }
}

void scale_row(float* o, int64_t L, float alpha) {
  constexpr int64_t W = fVec::size();
  const fVec a(alpha);
  int64_t d = 0;
  for (; d + W <= L; d += W) (fVec::loadu(o + d) * a).store(o + d);
  for (; d < L; ++d) o[d] *= alpha;
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

struct Unit {
  int64_t b, t0, t1;  // sequence b, tokens [t0, t1)
};

template <typename T>
void decode_kernel(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, const at::Tensor& block_tables, const std::vector<int64_t>& lens,
                   double softmax_scale, at::Tensor& out) {
  const int64_t B = q_latent.size(0), N = q_latent.size(1), L = q_latent.size(2), R = q_pe.size(2);
  const int64_t NB = key_cache.size(0), bs = key_cache.size(1), maxb = block_tables.size(1);
  const int64_t ks0 = key_cache.stride(0), ks1 = key_cache.stride(1), ks3 = key_cache.stride(3);
  const int64_t vs0 = value_cache.stride(0), vs1 = value_cache.stride(1), vs3 = value_cache.stride(3);
  const T* kc = key_cache.const_data_ptr<T>();
  const T* vc = value_cache.const_data_ptr<T>();
  const IndexView table(block_tables);

  // Queries in fp32 with the softmax scale folded in (B*N*(L+R) values: negligible).
  std::vector<float> ql(B * N * L), qp(B * N * R);
  {
    const at::Tensor qlc = q_latent.contiguous(), qpc = q_pe.contiguous();
    const T* a = qlc.const_data_ptr<T>();
    const T* c = qpc.const_data_ptr<T>();
    const float s = static_cast<float>(softmax_scale);
    for (int64_t i = 0; i < B * N * L; ++i) ql[i] = to_f32(a[i]) * s;
    for (int64_t i = 0; i < B * N * R; ++i) qp[i] = to_f32(c[i]) * s;
  }

  // Split-K: enough units for every thread to get several (load balance across mixed lengths),
  // but chunks of at least 256 tokens so the merge stays small next to the attention work.
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += lens[b];
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t chunk = std::max<int64_t>(256, (total + 4 * threads - 1) / (4 * threads));
  chunk = (chunk + kTile - 1) / kTile * kTile;
  std::vector<Unit> units;
  std::vector<int64_t> first_unit(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    first_unit[b] = static_cast<int64_t>(units.size());
    for (int64_t t0 = 0; t0 < lens[b]; t0 += chunk) units.push_back({b, t0, std::min(lens[b], t0 + chunk)});
  }
  first_unit[B] = static_cast<int64_t>(units.size());
  const int64_t U = first_unit[B];

  // Per unit and head: running max, running sum, unnormalised accumulator [L].
  std::vector<float> m_part(U * N, kNegInf), l_part(U * N, 0.f);
  at::Tensor acc_buf = at::empty({std::max<int64_t>(U, 1), N, L}, q_latent.options().dtype(at::kFloat));
  float* acc_all = acc_buf.data_ptr<float>();
  constexpr bool kIsFloat = std::is_same_v<T, float>;

  at::parallel_for(0, U, 1, [&](int64_t u_begin, int64_t u_end) {
    // Per-thread scratch: fp32 copies of one tile of rows (not needed for fp32 unit-stride
    // caches, which are read in place), scores and probabilities for every head.
    std::vector<float> lat32(kTile * L), pe32(kTile * R), scores(N * kTile), probs(N * kTile);
    const float* lat_rows[kTile];
    const float* pe_rows[kTile];
    for (int64_t u = u_begin; u < u_end; ++u) {
      const Unit unit = units[u];
      float* acc = acc_all + u * N * L;
      std::fill(acc, acc + N * L, 0.f);
      float* m = m_part.data() + u * N;
      float* l = l_part.data() + u * N;
      const float* qlb = ql.data() + unit.b * N * L;
      const float* qpb = qp.data() + unit.b * N * R;
      for (int64_t t = unit.t0; t < unit.t1;) {
        int64_t nt = 0;
        const int64_t tile_end = std::min(unit.t1, t + kTile);
        for (; t < tile_end; ++t) {
          // t < len <= maxb * bs, so the table column is in range.
          const int64_t id = table[unit.b * maxb + t / bs];
          if (id < 0 || id >= NB) continue;  // only reachable unvalidated: skip, never read
          const int64_t off = t % bs;
          const T* kp = kc + id * ks0 + off * ks1;
          const T* vp = vc + id * vs0 + off * vs1;
          if (kIsFloat && ks3 == 1) {
            lat_rows[nt] = reinterpret_cast<const float*>(kp);
          } else {
            row_to_f32<T>(lat32.data() + nt * L, kp, L, ks3);
            lat_rows[nt] = lat32.data() + nt * L;
          }
          if (kIsFloat && vs3 == 1) {
            pe_rows[nt] = reinterpret_cast<const float*>(vp);
          } else {
            row_to_f32<T>(pe32.data() + nt * R, vp, R, vs3);
            pe_rows[nt] = pe32.data() + nt * R;
          }
          ++nt;
        }
        if (nt == 0) continue;
        std::fill(scores.begin(), scores.end(), 0.f);
        add_scores(qlb, N, lat_rows, nt, L, scores.data());
        add_scores(qpb, N, pe_rows, nt, R, scores.data());
        // Online softmax, one update per tile and head.
        for (int64_t n = 0; n < N; ++n) {
          float* sc = scores.data() + n * kTile;
          float* pr = probs.data() + n * kTile;
          float tile_max = kNegInf;
          for (int64_t i = 0; i < nt; ++i) tile_max = std::max(tile_max, sc[i]);
          const float m_new = std::max(m[n], tile_max);
          if (m_new == kNegInf) {  // every score so far is -inf: nothing to weight yet
            std::fill(pr, pr + kTile, 0.f);
            continue;
          }
          const fVec mv(m_new);
          for (int64_t i = 0; i < kTile; i += fVec::size()) (fVec::loadu(sc + i) - mv).exp_u20().store(pr + i);
          float sum = 0.f;
          for (int64_t i = 0; i < nt; ++i) sum += pr[i];
          const float alpha = std::exp(m[n] - m_new);  // 0 on the first tile (m = -inf)
          if (alpha != 1.f && l[n] != 0.f) scale_row(acc + n * L, L, alpha);
          l[n] = l[n] * alpha + sum;
          m[n] = m_new;
        }
        accumulate(acc, N, probs.data(), lat_rows, nt, L);
      }
    }
  });

  // Merge the units of every (row, head) and write the output dtype; rows without any attended
  // token (length 0, or every block skipped) get zeros.
  T* o = out.data_ptr<T>();
  at::parallel_for(0, B * N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(L);
    constexpr int64_t W = fVec::size();
    for (int64_t bn = begin; bn < end; ++bn) {
      const int64_t b = bn / N, n = bn % N;
      T* dst = o + bn * L;
      float mx = kNegInf;
      for (int64_t u = first_unit[b]; u < first_unit[b + 1]; ++u)
        if (l_part[u * N + n] > 0.f) mx = std::max(mx, m_part[u * N + n]);
      std::fill(merged.begin(), merged.end(), 0.f);
      float denom = 0.f;
      if (mx != kNegInf) {
        for (int64_t u = first_unit[b]; u < first_unit[b + 1]; ++u) {
          const float lu = l_part[u * N + n];
          if (!(lu > 0.f)) continue;
          const float w = std::exp(m_part[u * N + n] - mx);
          denom += w * lu;
          const float* src = acc_all + (u * N + n) * L;
          const fVec wv(w);
          int64_t d = 0;
          for (; d + W <= L; d += W) at::vec::fmadd(wv, fVec::loadu(src + d), fVec::loadu(merged.data() + d)).store(merged.data() + d);
          for (; d < L; ++d) merged[d] += w * src[d];
        }
      }
      const float inv = denom > 0.f ? 1.f / denom : 0.f;
      const fVec iv(inv);
      int64_t d = 0;
      for (; d + W <= L; d += W) store_from_f32<T>(dst + d, fVec::loadu(merged.data() + d) * iv);
      for (; d < L; ++d) dst[d] = from_f32<T>(merged[d] * inv);
    }
  });
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double softmax_scale, bool validate) {
  const int64_t B = q_latent.size(0);
  const int64_t NB = key_cache.size(0), bs = key_cache.size(1);
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens_t = seq_lens.contiguous();
  const int64_t maxb = tables.size(1);
  const int64_t capacity = maxb * bs;
  const IndexView lens_v(lens_t), table(tables);
  std::vector<int64_t> lens(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = lens_v[b];
    if (validate) {
      if (n < 1 || n > capacity) return at::Tensor();
      const int64_t used = (n + bs - 1) / bs;
      for (int64_t j = 0; j < used; ++j) {
        const int64_t id = table[b * maxb + j];
        if (id < 0 || id >= NB) return at::Tensor();
      }
      lens[b] = n;
    } else {
      lens[b] = std::clamp<int64_t>(n, 0, capacity);
    }
  }
  at::Tensor out = at::empty(q_latent.sizes(), q_latent.options());
  if (B == 0 || out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q_latent.scalar_type(), "mla_decode_attention", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "mla native decode_attention: float64 is served by the reference kernel");
    } else {
      decode_kernel<scalar_t>(q_latent, q_pe, key_cache, value_cache, tables, lens, softmax_scale, out);
    }
  });
  return out;
}

}  // namespace CPU_CAPABILITY
}  // namespace mla_native
