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
//   out = O * (1 / l)                rounded once to the activation dtype
//
// the scheme of ATen's CPU flash attention (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp in
// pytorch/pytorch), which takes one head size for q, k and v: called from Python it needs V zero-padded
// to Dqk (half again the multiply-adds of P . V at DeepSeek-V2's dims) and a second call plus a merge for a
// request with context. Here the context and the new keys are one walk and P . V runs at Dv. The GEMM takes
// row-major operands without transposes, so each thread packs a head's keys (transposed) and values once
// (Scratch::keys_t, Scratch::values).
// Every GEMM is fp32: bf16 and fp16 queries, keys and values are widened (exactly) as they are packed, and
// P stays fp32 (ATen's kernel rounds it to the activation dtype), so the output is rounded once. Where
// oneDNN runs bf16 (fp16) on AMX tiles, ATen's flash kernel packs that dtype for them, and the reference
// serves it (reasons.cpp). The GEMMs' rows and key widths are padded to few shapes (kRowStep, kKeyStep):
// zero queries, zero keys and values, whose results are never read.
//
// Masking. A token never reads the scores of keys after its own: they are not scaled, maxed, exponentiated
// or summed, and their weights in P are exact zeros. P . V multiplies those zeros by the masked keys' values,
// 0 x inf = NaN, so a block that masks some keys for some rows of the unit takes the GEMM only when the
// values it masks are all finite, and otherwise adds each row's visible keys one by one: a value a token
// does not see never reaches it, whatever it holds (the formula's semantics; the reference's exact path).
// A visible NaN or +inf score makes the token's output NaN and a -inf score weighs 0, as the formula's
// softmax does; a visible non-finite value reaches the token through its weight; a row whose visible
// scores are all -inf gets 0 / 0 = NaN, as softmax over them does.
//
// Only rows key_start_loc[b] .. key_start_loc[b + 1] - 1 and query_start_loc[b] .. query_start_loc[b + 1] - 1
// of request b are read, after the values were checked (ValueError, the Python check's messages).
#include "../checks.h"
#include "common.h"
#include "kernels.h"

#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

namespace mla_native {
inline namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kKeyBlock = 512;
constexpr int64_t kMaxQueryBlock = 256;
// The GEMMs' query rows are rounded up to a multiple of kRowStep and their key widths to one of kKeyStep
// (zero rows and zero keys pad them): oneDNN compiles and keeps a kernel per GEMM shape for the life of a
// thread, so the shapes a serving process meets must stay few (16 row counts x 8 widths per GEMM).
constexpr int64_t kRowStep = 16;
constexpr int64_t kKeyStep = 64;
// The rows of a K^T panel lie this many elements apart: a key block and 16 more, so that the panel's
// rows do not all map to the same cache sets (a power-of-two stride does).
constexpr int64_t kPanelRow = kKeyBlock + 16;
constexpr int64_t kKeysPerPass = 16;  // K^T packing: 16 read streams, 16 consecutive writes per dim
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

int64_t round_up(int64_t x, int64_t step) { return (x + step - 1) / step * step; }

// Query tokens per unit (ATen's flash kernel's split): long requests in blocks of 256, whose score tile
// [256, 512] and accumulator stay in L2; short ones in smaller blocks, so that their units still spread
// over the threads. Every block is a multiple of kRowStep.
int64_t query_block(int64_t q_len) { return q_len >= 768 ? kMaxQueryBlock : (q_len >= 192 ? 64 : 32); }

struct Request {
  int64_t first_query, num_queries, first_key, num_keys;
};

// mla_ops/ops/sparse_attention.py: check_starts (a cumulative count runs from 0 to `total` without decreasing)
void check_starts(std::string_view op, std::string_view name, const IndexView& starts, int64_t count, int64_t total,
                  std::string_view counted) {
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
  constexpr std::string_view op = "mha_prefill_attention";
  const at::Tensor query_starts_t = query_start_loc.contiguous(), key_starts_t = key_start_loc.contiguous();
  const IndexView query_starts(query_starts_t), key_starts(key_starts_t);
  const int64_t count = query_starts_t.size(0);
  check_starts(op, "query_start_loc", query_starts, count, num_tokens, "query tokens");
  check_starts(op, "key_start_loc", key_starts, count, num_keys, "keys");
  std::vector<Request> requests;
  requests.reserve(count - 1);
  for (int64_t b = 0; b + 1 < count; ++b) {
    // both run from 0 to their totals without decreasing: no difference below overflows
    const int64_t q_len = query_starts[b + 1] - query_starts[b], k_len = key_starts[b + 1] - key_starts[b];
    TORCH_CHECK_VALUE(q_len <= k_len, prefix(op), "request ", b, " has ", q_len,
                      " query tokens (query_start_loc) but ", k_len,
                      " keys (key_start_loc); its keys must include its query tokens (q_len <= k_len)");
    requests.push_back({query_starts[b], q_len, key_starts[b], k_len});
  }
  return requests;
}

// t itself when its last dim is unit-stride (the packing reads rows of dims), else a contiguous copy.
at::Tensor with_unit_stride_dims(const at::Tensor& t) {
  return t.stride(2) == 1 ? t : t.clone(at::MemoryFormat::Contiguous);
}

bool all_finite(const float* rows, int64_t count, int64_t width) {
  for (int64_t e = 0; e < count * width; ++e) {
    if (!std::isfinite(rows[e])) return false;
  }
  return true;
}

// A float buffer that grows without initialising (and without keeping its contents).
class FloatBuffer {
 public:
  float* reserve(int64_t count) {
    if (count > capacity_) {
      data_.reset(new float[count]);
      capacity_ = count;
    }
    return data_.get();
  }
  float* data() const { return data_.get(); }

 private:
  std::unique_ptr<float[]> data_;
  int64_t capacity_ = 0;
};

// One thread's scratch, reused across the units it runs. Every GEMM operand is fp32: bf16 and fp16 inputs
// are widened (exactly) as they are packed, so every dtype runs the fp32 GEMM kernels.
struct Scratch {
  FloatBuffer scores;   // [kMaxQueryBlock, kKeyBlock]: S, then P
  FloatBuffer acc;      // [kMaxQueryBlock, Dv]
  FloatBuffer queries;  // [kMaxQueryBlock, Dqk]: the unit's queries, padded rows zero
  std::vector<float> row_max, row_sum;
  // The B operands of one (request, head), keys 0 .. keys_done - 1 packed so far. keys_t: K^T for S = Q . K^T
  // (the GEMM takes row-major operands without transposes), a [Dqk, kKeyBlock] panel per key block, its
  // rows kPanelRow apart. values: V [keys, Dv] for P . V (V's rows in the op's [S, N, Dv] lie N * Dv
  // apart, often a power of two, and a GEMM reading them in place slows down from cache-set conflicts).
  // A thread runs a head's units one after another, each seeing more keys, so each key is packed once per
  // thread and head: per thread, (Dqk + Dv) fp32 values per key of the request being served.
  FloatBuffer keys_t, values;
  int64_t operands_request = -1, operands_head = -1, keys_done = 0;

  Scratch(int64_t dim_qk, int64_t dim_v) : row_max(kMaxQueryBlock), row_sum(kMaxQueryBlock) {
    scores.reserve(kMaxQueryBlock * kKeyBlock);
    acc.reserve(kMaxQueryBlock * dim_v);
    queries.reserve(kMaxQueryBlock * dim_qk);
  }
};

struct Geometry {
  int64_t dim_qk, dim_v;
  int64_t q_token_stride, q_head_stride, k_token_stride, k_head_stride, v_token_stride, v_head_stride;
  float scale;
};

// Packs K^T and V (Scratch) of request `request`'s head `head` through key `upto` (exclusive), and zeroes
// the padding of the last key block the unit reads, [upto, padded_end): those keys lie past every key
// packed so far, and the next unit of the head packs over them. k_rows / v_rows: the head's first key and
// value.
template <typename T>
void pack_head_operands(Scratch& s, const Geometry& g, const T* k_rows, const T* v_rows, int64_t request, int64_t head,
                        int64_t num_keys, int64_t upto, int64_t padded_end) {
  const int64_t dim_qk = g.dim_qk, dim_v = g.dim_v, panels = (num_keys + kKeyBlock - 1) / kKeyBlock;
  if (s.operands_request != request || s.operands_head != head) {
    s.operands_request = request;
    s.operands_head = head;
    s.keys_done = 0;
    s.keys_t.reserve(panels * dim_qk * kPanelRow);
    s.values.reserve(panels * kKeyBlock * dim_v);  // whole panels: the padding of the last block fits
  }
  float* keys_t = s.keys_t.data();
  for (int64_t j0 = s.keys_done, j1; j0 < upto; j0 = j1) {
    j1 = std::min(upto, (j0 / kKeysPerPass + 1) * kKeysPerPass);  // [j0, j1) lies in one panel
    // panel j0 / kKeyBlock, offset back so that it is indexed by the key j itself
    float* panel = keys_t + (j0 / kKeyBlock) * (dim_qk * kPanelRow - kKeyBlock);
    for (int64_t d = 0; d < dim_qk; ++d) {
      for (int64_t j = j0; j < j1; ++j) panel[d * kPanelRow + j] = to_f32(k_rows[j * g.k_token_stride + d]);
    }
  }
  for (int64_t j = s.keys_done; j < upto; ++j) {
    const T* row = v_rows + j * g.v_token_stride;
    float* packed = s.values.data() + j * dim_v;
    int64_t d = 0;
    for (; d + fVec::size() <= dim_v; d += fVec::size()) load_f32(row + d).store(packed + d);
    for (; d < dim_v; ++d) packed[d] = to_f32(row[d]);
  }
  // keys past upto count as unpacked: the padding below overwrites them (a head's units run in order, so
  // keys_done never exceeds upto here, but nothing depends on that)
  s.keys_done = upto;
  if (padded_end > upto) {  // upto is the last block's end, so [upto, padded_end) lies in upto's panel
    float* panel = keys_t + ((upto - 1) / kKeyBlock) * (dim_qk * kPanelRow - kKeyBlock);
    for (int64_t d = 0; d < dim_qk; ++d) {
      std::fill(panel + d * kPanelRow + upto, panel + d * kPanelRow + padded_end, 0.f);
    }
    std::fill(s.values.data() + upto * dim_v, s.values.data() + padded_end * dim_v, 0.f);
  }
}

// Request r (number `request`), head n, query tokens [m0, m1) of the request -> its out rows (contiguous
// [T, N, Dv]).
template <typename T>
void attend_unit(const T* q, const T* k, const T* v, T* out, int64_t heads, const Geometry& g, const Request& r,
                 int64_t request, int64_t n, int64_t m0, int64_t m1, Scratch& s) {
  const int64_t rows = m1 - m0, gemm_rows = round_up(rows, kRowStep), Dqk = g.dim_qk, Dv = g.dim_v;
  const int64_t context = r.num_keys - r.num_queries;
  const int64_t keys_seen = context + m1;  // the last row sees keys 0 .. context + m1 - 1
  // the queries, widened, in rows Dqk apart; the padding rows zero
  const T* q_rows = q + (r.first_query + m0) * g.q_token_stride + n * g.q_head_stride;
  float* queries = s.queries.data();
  for (int64_t i = 0; i < rows; ++i) {
    const T* row = q_rows + i * g.q_token_stride;
    float* widened = queries + i * Dqk;
    int64_t d = 0;
    for (; d + fVec::size() <= Dqk; d += fVec::size()) load_f32(row + d).store(widened + d);
    for (; d < Dqk; ++d) widened[d] = to_f32(row[d]);
  }
  std::fill(queries + rows * Dqk, queries + gemm_rows * Dqk, 0.f);
  const int64_t last_block = (keys_seen - 1) / kKeyBlock * kKeyBlock;
  pack_head_operands(s, g, k + r.first_key * g.k_token_stride + n * g.k_head_stride,
                     v + r.first_key * g.v_token_stride + n * g.v_head_stride, request, n, r.num_keys, keys_seen,
                     last_block + round_up(keys_seen - last_block, kKeyStep));
  const float* keys_t = s.keys_t.data();
  const float* values = s.values.data();
  float* scores = s.scores.data();
  float* acc = s.acc.data();
  std::fill(acc, acc + gemm_rows * Dv, 0.f);
  std::fill(s.row_max.begin(), s.row_max.begin() + rows, kMinusInf);
  std::fill(s.row_sum.begin(), s.row_sum.begin() + rows, 0.f);
  const fVec scale_vec(g.scale);
  for (int64_t j0 = 0; j0 < keys_seen; j0 += kKeyBlock) {
    const int64_t width = std::min(kKeyBlock, keys_seen - j0), gemm_width = round_up(width, kKeyStep);
    // scores [gemm_rows, gemm_width] = Q [gemm_rows, Dqk] . K^T [Dqk, gemm_width], rows kKeyBlock apart
    at::native::cpublas::brgemm(gemm_rows, gemm_width, Dqk, Dqk, kPanelRow, kKeyBlock, false, queries,
                                keys_t + (j0 / kKeyBlock) * Dqk * kPanelRow, scores, /*is_vnni=*/false);
    bool masks_some = false;
    for (int64_t i = 0; i < rows; ++i) {
      // row i sees keys 0 .. context + m0 + i, so `seen` keys of this block
      const int64_t seen = std::clamp<int64_t>(context + m0 + i + 1 - j0, 0, width);
      masks_some |= seen < width;
      float* row = scores + i * kKeyBlock;
      if (seen == 0) {
        std::fill(row, row + gemm_width, 0.f);
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
        std::fill(row, row + gemm_width, 0.f);
        continue;
      }
      // NaN max: alpha is NaN, and the row's output with it. (exp_u20 of a NaN argument gives +inf on AVX2
      // and AVX-512, not NaN, so the output's NaN comes from alpha, or from inf / inf at the end.)
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
      std::fill(row + seen, row + gemm_width, 0.f);
      s.row_max[i] = new_max;
      s.row_sum[i] = s.row_sum[i] * alpha + block_sum;
      if (alpha != 1.f) {
        float* acc_row = acc + i * Dv;
        const fVec alpha_vec(alpha);
        int64_t d = 0;
        for (; d + fVec::size() <= Dv; d += fVec::size()) (fVec::loadu(acc_row + d) * alpha_vec).store(acc_row + d);
        for (; d < Dv; ++d) acc_row[d] *= alpha;
      }
    }
    // the padding rows' P feeds only the padding rows of acc, which are never read
    // keys this block masks for some row: context + m0 + 1 .. block end (the first row sees up to context + m0)
    const int64_t first_masked = std::max<int64_t>(context + m0 + 1 - j0, 0);
    if (!masks_some || all_finite(values + (j0 + first_masked) * Dv, width - first_masked, Dv)) {
      // acc [gemm_rows, Dv] += P [gemm_rows, gemm_width] . V [gemm_width, Dv] (the padding keys' V is zero)
      at::native::cpublas::brgemm(gemm_rows, Dv, gemm_width, kKeyBlock, Dv, Dv, true, scores, values + j0 * Dv, acc,
                                  /*is_vnni=*/false);
    } else {
      // a masked value is not finite (0 x inf = NaN in the GEMM): each row adds only the keys it sees
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t seen = std::clamp<int64_t>(context + m0 + i + 1 - j0, 0, width);
        float* acc_row = acc + i * Dv;
        for (int64_t j = 0; j < seen; ++j) {
          const float p = scores[i * kKeyBlock + j];
          const float* value = values + (j0 + j) * Dv;
          int64_t d = 0;
          for (; d + fVec::size() <= Dv; d += fVec::size()) {
            at::vec::fmadd(fVec(p), fVec::loadu(value + d), fVec::loadu(acc_row + d)).store(acc_row + d);
          }
          for (; d < Dv; ++d) acc_row[d] += p * value[d];
        }
      }
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    const float* acc_row = acc + i * Dv;
    T* o = out + ((r.first_query + m0 + i) * heads + n) * Dv;
    const float inv = 1.f / s.row_sum[i];  // l = 0 (every seen score -inf): 0 x inf = NaN, softmax's 0 / 0
    const fVec inv_vec(inv);
    int64_t d = 0;
    for (; d + fVec::size() <= Dv; d += fVec::size()) store_from_f32(o + d, fVec::loadu(acc_row + d) * inv_vec);
    for (; d < Dv; ++d) o[d] = from_f32<T>(acc_row[d] * inv);
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
  const at::Tensor q = with_unit_stride_dims(q_in), k = with_unit_stride_dims(k_in), v = with_unit_stride_dims(v_in);
  const Geometry g{q.size(2),   Dv,          q.stride(0), q.stride(1), k.stride(0),
                   k.stride(1), v.stride(0), v.stride(1), static_cast<float>(softmax_scale)};
  const auto run = [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    const scalar_t* q_data = q.const_data_ptr<scalar_t>();
    const scalar_t* k_data = k.const_data_ptr<scalar_t>();
    const scalar_t* v_data = v.const_data_ptr<scalar_t>();
    scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
      Scratch scratch(g.dim_qk, Dv);
      for (int64_t u = begin; u < end; ++u) {
        const Unit& unit = units[u];
        attend_unit(q_data, k_data, v_data, out_data, heads, g, requests[unit.request], unit.request, unit.head,
                    unit.m0, unit.m1, scratch);
      }
      // the GEMMs ran on oneDNN's fp32 kernels (no AMX tile state to release); brgemm_release is the end of
      // a thread's run of brgemm calls as cpublas defines it
      at::native::cpublas::brgemm_release(/*is_vnni=*/false);
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
