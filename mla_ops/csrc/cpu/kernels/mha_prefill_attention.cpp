// mla.mha_prefill_attention on CPU: causal flash attention over per-head keys and values, the value
// head its own width (MLA's expanded form: Dqk = 192, Dv = 128 for DeepSeek-V2/V3).
//
// Work units are (request, head, block of up to 256 query tokens), split over the threads. A unit walks
// its request's keys in blocks of 512 up to the last key its last token sees (context first, then the
// new tokens, causal bottom-right) with an online softmax in fp32:
//
//   S = Q_blk . K_blk^T            [q, k] fp32   at::native::cpublas::brgemm (oneDNN's brgemm kernel where
//                                                oneDNN has one for the dtype and CPU, else BLAS's GEMM)
//   m' = max(m, scale * rowmax(S)); P = exp(scale * S - m'); l = l * exp(m - m') + rowsum(P)
//   O = O * exp(m - m') + P . V_blk   [q, Dv]   fp32 accumulator
//   out = O / l                      rounded once to the activation dtype
//
// the scheme of ATen's CPU flash attention (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp in
// pytorch/pytorch), which takes one head size for q, k and v: called from Python it needs V zero-padded
// to Dqk (half again the multiply-adds of P . V at DeepSeek-V2's dims) and a second call plus a merge for a
// request with context. Here the context and the new keys are one walk and P . V runs at Dv. The GEMM takes
// row-major operands without transposes, so each thread packs a head's keys (transposed) and values once
// (Scratch::keys_t, Scratch::values).
// Every GEMM is fp32: bf16 and fp16 queries, keys and values are widened (exactly) as they are packed, and
// P stays fp32 (ATen's kernel rounds it to the activation dtype), so the output is rounded once. oneDNN's
// bf16 brgemm kernels need AMX tiles and their packed layout; on such a CPU the reference serves bf16 and
// fp16 (reasons.cpp).
//
// Masking. A token never reads the scores of keys after its own: they are not scaled, maxed, exponentiated
// or summed, and their weights in P are exact zeros. P . V multiplies those zeros by the masked keys' values,
// 0 x inf = NaN, so a block that masks some keys for some rows of the unit takes the GEMM only when the
// values it masks are all finite, and otherwise adds each row's visible keys one by one: a value a token
// does not see never reaches it, whatever it holds (the formula's semantics; the reference's exact path).
// A visible NaN or infinite score or value reaches the token as the formula's softmax carries it; a row
// whose visible scores are all -inf gets 0 / 0 = NaN, as softmax over them does.
//
// Only rows key_start_loc[b] .. key_start_loc[b + 1] - 1 and query_start_loc[b] .. query_start_loc[b + 1] - 1
// of request b are read, after the values were checked (ValueError, the Python check's messages).
#include "../checks.h"
#include "common.h"
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace mla_native {
inline namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kKeyBlock = 512;
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// Query tokens per unit (ATen's flash kernel's split): long requests in blocks of 256, whose score tile
// [256, 512] and accumulator stay in L2; short ones in smaller blocks, so that their units still spread
// over the threads.
int64_t query_block(int64_t q_len) { return q_len >= 768 ? 256 : (q_len >= 192 ? 64 : 32); }

struct Request {
  int64_t first_query, num_queries, first_key, num_keys;
};

// mla_ops/ops/sparse_attention.py: check_starts
void check_starts(std::string_view name, const IndexView& starts, int64_t count, int64_t total,
                  std::string_view counted) {
  constexpr std::string_view op = "mha_prefill_attention";
  TORCH_CHECK_VALUE(starts[0] == 0, prefix(op), name, " must start at 0, got ", name, "[0] = ", starts[0]);
  for (int64_t b = 0; b + 1 < count; ++b) {
    TORCH_CHECK_VALUE(starts[b + 1] >= starts[b], prefix(op), name, " must never decrease, but ", name, "[", b + 1,
                      "] = ", starts[b + 1], " < ", name, "[", b, "] = ", starts[b]);
  }
  TORCH_CHECK_VALUE(starts[count - 1] == total, prefix(op), name, "[-1] = ", starts[count - 1],
                    " must equal the number of ", counted, " (", total, ")");
}

// mla_ops/ops/mha_prefill_attention.py: check_mha_prefill_values (same checks, order and messages)
std::vector<Request> check_mha_prefill_values(int64_t num_tokens, int64_t num_keys, const at::Tensor& query_start_loc,
                                              const at::Tensor& key_start_loc) {
  const at::Tensor query_starts_t = query_start_loc.contiguous(), key_starts_t = key_start_loc.contiguous();
  const IndexView query_starts(query_starts_t), key_starts(key_starts_t);
  const int64_t count = query_starts_t.size(0);
  check_starts("query_start_loc", query_starts, count, num_tokens, "query tokens");
  check_starts("key_start_loc", key_starts, count, num_keys, "keys");
  std::vector<Request> requests;
  requests.reserve(count - 1);
  for (int64_t b = 0; b + 1 < count; ++b) {
    // both run from 0 to their totals without decreasing: no difference below overflows
    const int64_t q_len = query_starts[b + 1] - query_starts[b], k_len = key_starts[b + 1] - key_starts[b];
    TORCH_CHECK_VALUE(q_len <= k_len, "mla.mha_prefill_attention: request ", b, " has ", q_len,
                      " query tokens (query_start_loc) but ", k_len,
                      " keys (key_start_loc); its keys must include its query tokens (q_len <= k_len)");
    requests.push_back({query_starts[b], q_len, key_starts[b], k_len});
  }
  return requests;
}

// t itself when BLAS can read its rows of one head in place (unit-stride last dim, rows at least a head
// apart), else a contiguous copy.
at::Tensor blas_rows(const at::Tensor& t) {
  if (t.stride(2) == 1 && t.stride(0) >= t.size(2) && t.stride(1) >= 0) return t;
  return t.clone(at::MemoryFormat::Contiguous);
}

template <typename T>
bool all_finite(const T* rows, int64_t count, int64_t row_stride, int64_t width) {
  for (int64_t j = 0; j < count; ++j) {
    const T* row = rows + j * row_stride;
    for (int64_t d = 0; d < width; ++d) {
      if (!std::isfinite(to_f32(row[d]))) return false;
    }
  }
  return true;
}

// One thread's scratch, reused across the units it runs. Every GEMM operand is fp32: bf16 and fp16 inputs
// are widened as they are packed (exactly), so every dtype runs the fp32 GEMM kernels.
struct Scratch {
  std::vector<float> scores;  // [q_block, kKeyBlock]: S, then P
  std::vector<float> acc;     // [q_block, Dv]
  std::vector<float> queries;  // [q_block, Dqk]: the unit's queries widened (bf16 / fp16 only)
  std::vector<float> row_max, row_sum;
  // The GEMM operands of one (request, head), keys 0 .. keys_done - 1 so far. keys_t: K^T, the B operand of
  // S = Q . K^T (the GEMM takes row-major operands without transposes), a [Dqk, kKeyBlock] panel per key
  // block, its rows kPanelRow apart. values: V [k_b, Dv] packed, the B operand of P . V (V's rows in the
  // op's [S, N, Dv] lie N * Dv apart, often a power of two, and a GEMM reading them in place slows down
  // from cache-set conflicts). A thread runs a head's units one after another, each seeing more keys, so
  // each key is packed once per thread and head.
  std::vector<float> keys_t, values;
  int64_t operands_request = -1, operands_head = -1, keys_done = 0;
  Scratch(int64_t rows, int64_t dim_qk, int64_t dim_v)
      : scores(rows * kKeyBlock), acc(rows * dim_v), queries(rows * dim_qk), row_max(rows), row_sum(rows) {}
};

// The rows of a K^T panel lie this many elements apart: a key block and 16 more, so that the panel's
// rows do not all map to the same cache sets (a power-of-two stride does).
constexpr int64_t kPanelRow = kKeyBlock + 16;

// The packed K^T panels and V rows (Scratch) of request `request`'s head `head` through key `upto`
// (exclusive); k_rows / v_rows: the head's first key / value, k_row / v_row elements between keys.
template <typename T>
void pack_head_operands(Scratch& s, const T* k_rows, int64_t k_row, int64_t dim, const T* v_rows, int64_t v_row,
                        int64_t dim_v, int64_t request, int64_t head, int64_t num_keys, int64_t upto) {
  if (s.operands_request != request || s.operands_head != head) {
    s.operands_request = request;
    s.operands_head = head;
    s.keys_done = 0;
    const int64_t panels = (num_keys + kKeyBlock - 1) / kKeyBlock;
    if (static_cast<int64_t>(s.keys_t.size()) < panels * dim * kPanelRow) s.keys_t.resize(panels * dim * kPanelRow);
    if (static_cast<int64_t>(s.values.size()) < num_keys * dim_v) s.values.resize(num_keys * dim_v);
  }
  constexpr int64_t kRows = 16;  // keys per pass: 16 read streams, 16 consecutive writes per dim
  for (int64_t j0 = s.keys_done, j1; j0 < upto; j0 = j1) {
    j1 = std::min(upto, (j0 / kRows + 1) * kRows);  // up to the next multiple of 16: [j0, j1) lies in one panel
    float* panel = s.keys_t.data() + (j0 / kKeyBlock) * dim * kPanelRow - (j0 / kKeyBlock) * kKeyBlock;
    for (int64_t d = 0; d < dim; ++d) {
      for (int64_t j = j0; j < j1; ++j) panel[d * kPanelRow + j] = to_f32(k_rows[j * k_row + d]);
    }
  }
  for (int64_t j = s.keys_done; j < upto; ++j) {
    const T* row = v_rows + j * v_row;
    float* packed = s.values.data() + j * dim_v;
    int64_t d = 0;
    for (; d + fVec::size() <= dim_v; d += fVec::size()) load_f32(row + d).store(packed + d);
    for (; d < dim_v; ++d) packed[d] = to_f32(row[d]);
  }
  s.keys_done = std::max(s.keys_done, upto);
}

struct Geometry {
  int64_t dim_qk, dim_v;
  int64_t q_row, q_head, k_row, k_head, v_row, v_head;  // strides (elements)
  float scale;
};

// Request r, head n, query tokens [m0, m1) of the request -> out rows (contiguous [T, N, Dv]).
template <typename T>
void attend_unit(const T* q, const T* k, const T* v, T* out, int64_t heads, const Geometry& g, const Request& r,
                 int64_t request, int64_t n, int64_t m0, int64_t m1, Scratch& s) {
  const int64_t rows = m1 - m0, Dv = g.dim_v;
  const int64_t context = r.num_keys - r.num_queries;
  const int64_t keys_seen = context + m1;  // the last row sees keys 0 .. context + m1 - 1
  const T* q_in = q + (r.first_query + m0) * g.q_row + n * g.q_head;
  const float* q_rows;  // the unit's queries as the GEMM reads them, q_ld apart
  int64_t q_ld;
  if constexpr (std::is_same_v<T, float>) {
    q_rows = q_in;
    q_ld = g.q_row;
  } else {
    for (int64_t i = 0; i < rows; ++i) {
      const T* row = q_in + i * g.q_row;
      float* widened = s.queries.data() + i * g.dim_qk;
      int64_t d = 0;
      for (; d + fVec::size() <= g.dim_qk; d += fVec::size()) load_f32(row + d).store(widened + d);
      for (; d < g.dim_qk; ++d) widened[d] = to_f32(row[d]);
    }
    q_rows = s.queries.data();
    q_ld = g.dim_qk;
  }
  const T* k_rows = k + r.first_key * g.k_row + n * g.k_head;
  const T* v_rows = v + r.first_key * g.v_row + n * g.v_head;
  std::fill(s.acc.begin(), s.acc.begin() + rows * Dv, 0.f);
  std::fill(s.row_max.begin(), s.row_max.begin() + rows, kMinusInf);
  std::fill(s.row_sum.begin(), s.row_sum.begin() + rows, 0.f);
  const fVec scale_vec(g.scale);
  pack_head_operands(s, k_rows, g.k_row, g.dim_qk, v_rows, g.v_row, Dv, request, n, r.num_keys, keys_seen);
  const float* keys_t = s.keys_t.data();
  const float* values = s.values.data();
  for (int64_t j0 = 0; j0 < keys_seen; j0 += kKeyBlock) {
    const int64_t width = std::min(kKeyBlock, keys_seen - j0);
    float* scores = s.scores.data();
    // scores [rows, width] = Q [rows, Dqk] . K^T [Dqk, width]
    at::native::cpublas::brgemm(rows, width, g.dim_qk, q_ld, kPanelRow, width, false, q_rows,
                                keys_t + (j0 / kKeyBlock) * g.dim_qk * kPanelRow, scores,
                                /*is_vnni=*/false);
    bool masks_some = false;
    for (int64_t i = 0; i < rows; ++i) {
      // row i sees keys 0 .. context + m0 + i: `seen` of this block's
      const int64_t seen = std::clamp<int64_t>(context + m0 + i + 1 - j0, 0, width);
      masks_some |= seen < width;
      float* row = scores + i * width;
      if (seen == 0) {
        std::fill(row, row + width, 0.f);
        continue;
      }
      // the max of the seen scores, scaled after: softmax_scale > 0 and rounding is monotonic, so
      // fl(scale * max) is the max of the fl(scale * s); NaN carried (at::vec::maximum propagates it), as
      // the formula's softmax is NaN then
      int64_t j = 0;
      fVec max_vec(kMinusInf);
      for (; j + fVec::size() <= seen; j += fVec::size()) max_vec = at::vec::maximum(max_vec, fVec::loadu(row + j));
      float raw_max =
          at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, max_vec);
      for (; j < seen; ++j) raw_max = std::isnan(row[j]) || row[j] > raw_max ? row[j] : raw_max;
      const float block_max = raw_max * g.scale;
      const float old_max = s.row_max[i];
      const float new_max = std::isnan(old_max) || std::isnan(block_max) ? std::numeric_limits<float>::quiet_NaN()
                                                                          : std::max(old_max, block_max);
      if (new_max == kMinusInf) {  // every score seen so far is -inf: weights 0, nothing to add yet
        std::fill(row, row + width, 0.f);
        continue;
      }
      const float alpha = std::exp(old_max - new_max);  // 0 for the first block (old max -inf)
      // P = exp(scale * S - m') in one pass, the product and the difference rounded once (fused)
      const fVec minus_max(-new_max);
      fVec sum_vec(0.f);
      j = 0;
      for (; j + fVec::size() <= seen; j += fVec::size()) {
        const fVec p = at::vec::fmadd(fVec::loadu(row + j), scale_vec, minus_max).exp_u20();
        p.store(row + j);
        sum_vec = sum_vec + p;
      }
      float block_sum = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, sum_vec);
      for (; j < seen; ++j) {
        row[j] = std::exp(std::fma(row[j], g.scale, -new_max));
        block_sum += row[j];
      }
      std::fill(row + seen, row + width, 0.f);
      s.row_max[i] = new_max;
      s.row_sum[i] = s.row_sum[i] * alpha + block_sum;
      if (alpha != 1.f) {
        float* acc = s.acc.data() + i * Dv;
        const fVec alpha_vec(alpha);
        int64_t d = 0;
        for (; d + fVec::size() <= Dv; d += fVec::size()) (fVec::loadu(acc + d) * alpha_vec).store(acc + d);
        for (; d < Dv; ++d) acc[d] *= alpha;
      }
    }
    const float* probs = scores;
    // keys this block masks for some row: context + m0 + 1 .. block end (the first row sees up to context + m0)
    const int64_t first_masked = std::max<int64_t>(context + m0 + 1 - j0, 0);
    if (!masks_some || all_finite(values + (j0 + first_masked) * Dv, width - first_masked, Dv, Dv)) {
      // acc [rows, Dv] += P [rows, width] . V [width, Dv]
      at::native::cpublas::brgemm(rows, Dv, width, width, Dv, Dv, true, probs, values + j0 * Dv, s.acc.data(),
                                  /*is_vnni=*/false);
    } else {
      // a masked value is not finite: each row adds only the keys it sees
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t seen = std::clamp<int64_t>(context + m0 + i + 1 - j0, 0, width);
        float* acc = s.acc.data() + i * Dv;
        for (int64_t j = 0; j < seen; ++j) {
          const fVec p(probs[i * width + j]);
          const float* value = values + (j0 + j) * Dv;
          int64_t d = 0;
          for (; d + fVec::size() <= Dv; d += fVec::size()) {
            at::vec::fmadd(p, fVec::loadu(value + d), fVec::loadu(acc + d)).store(acc + d);
          }
          for (; d < Dv; ++d) acc[d] += probs[i * width + j] * value[d];
        }
      }
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    const float* acc = s.acc.data() + i * Dv;
    T* o = out + ((r.first_query + m0 + i) * heads + n) * Dv;
    const fVec inv(1.f / s.row_sum[i]);  // l = 0 (every seen score -inf): 0 x inf = NaN, softmax's 0 / 0
    int64_t d = 0;
    for (; d + fVec::size() <= Dv; d += fVec::size()) store_from_f32(o + d, fVec::loadu(acc + d) * inv);
    for (; d < Dv; ++d) o[d] = from_f32<T>(acc[d] * (1.f / s.row_sum[i]));
  }
}

struct Unit {
  int64_t request, head, m0, m1;
};

}  // namespace

at::Tensor mha_prefill_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                 const at::Tensor& query_start_loc, const at::Tensor& key_start_loc,
                                 double softmax_scale) {
  const int64_t T = q_in.size(0), heads = q_in.size(1), Dv = v_in.size(2);
  const std::vector<Request> requests = check_mha_prefill_values(T, k_in.size(0), query_start_loc, key_start_loc);
  at::Tensor out = new_cpu_tensor({T, heads, Dv}, q_in.scalar_type());
  std::vector<Unit> units;
  for (size_t b = 0; b < requests.size(); ++b) {
    const int64_t q_len = requests[b].num_queries;
    const int64_t block = query_block(q_len);
    // heads outermost within a request: the threads' contiguous shares of the units hold whole heads, each
    // with its short (first) and long (last) query blocks
    for (int64_t n = 0; n < heads; ++n) {
      for (int64_t m0 = 0; m0 < q_len; m0 += block) {
        units.push_back({static_cast<int64_t>(b), n, m0, std::min(q_len, m0 + block)});
      }
    }
  }
  if (units.empty()) return out;
  const at::Tensor q = blas_rows(q_in), k = blas_rows(k_in), v = blas_rows(v_in);
  const Geometry g{q.size(2), Dv, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                   static_cast<float>(softmax_scale)};
  const auto run = [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    const scalar_t* q_data = q.const_data_ptr<scalar_t>();
    const scalar_t* k_data = k.const_data_ptr<scalar_t>();
    const scalar_t* v_data = v.const_data_ptr<scalar_t>();
    scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
      Scratch scratch(256, g.dim_qk, Dv);
      for (int64_t u = begin; u < end; ++u) {
        const Unit& unit = units[u];
        attend_unit(q_data, k_data, v_data, out_data, heads, g, requests[unit.request], unit.request, unit.head,
                    unit.m0, unit.m1, scratch);
      }
      at::native::cpublas::brgemm_release();
    });
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(at::BFloat16{}); break;
    case at::kHalf: run(at::Half{}); break;
    default: TORCH_CHECK(false, "mla native attention kernels: ", py_dtype(q), " is served by the reference kernel");
  }
  return out;
}

}  // namespace CPU_CAPABILITY
}  // namespace mla_native

MLA_REGISTER_ISA_KERNEL(mha_prefill_attention)
