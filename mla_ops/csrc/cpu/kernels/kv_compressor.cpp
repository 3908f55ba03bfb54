// mla.kv_compressor on CPU: DeepSeek-V4's KV compressor over a paged entry pool (mla_ops/ops/kv_compressor.py).
//
// Entry w of request b pools the window's S slots (S = m without overlap, 2m with) of D channels:
//
//   g      = gate[slots] + position_bias                       [S, D]  (fp32 when the bias is fp32)
//   p      = softmax(g, over the slots, in fp32)               [S, D]
//   pooled = sum_s T(kv[s] * T(p[s]))                          [D]     (T: kv's dtype)
//   entry  = rope_trailing(weighted_rms(pooled), cos[w*m], sin[w*m])
//
// bit-identical to the reference kernel, which runs these as torch ops on one [K, S, D] tensor per request
// (its K windows of the call). Step by step:
// * gate + bias: one fp32 addition (exact widening of T), rounded to T when the bias is in T (ATen's add).
// * softmax: ATen's own softmax kernel (`at::_softmax_out`) on the [K, S, D] fp32 gates. Its vectorised and
//   scalar paths use different exp implementations (SLEEF's and libm's), and which elements take which
//   depends on the channel, the vector width of the ISA ATen runs and ATen's split of the work over its
//   threads; only ATen's kernel on the same tensor reproduces every bit. With one thread the split is none and
//   an element's path depends only on its channel, so one call serves all the windows at hand; with several,
//   one call per request, on the reference's shape.
// * weights and products rounded to T (ATen's .to and bf16/fp16 multiply: fp32 product, one rounding).
// * the sum over the slots: ATen's CPU sum of [K, S, D] over dim 1 is an outer reduction
//   (aten/src/ATen/native/cpu/SumKernel.cpp in pytorch/pytorch: cascade_sum, vectorized_outer_sum). Every
//   column in one of its blocks of four fp32 vectors is summed over the slots by `multi_row_sum`'s cascade,
//   in fp32 (slots in chunks of 2**max(4, ceil_log2(S) / 4), chunk sums added level by level: `cascade_sum`
//   below), then stored as T(0 + T(sum)) (the output is zero-filled, then accumulated into). The columns of a
//   call are all in such blocks when D is a multiple of 64 (four vectors of 16 lanes, ATen's widest) and,
//   when ATen splits the reduction over its threads along D, every thread's columns start and end on a
//   multiple of 64 (`sum_is_cascade`); the others (ragged D, other splits) take ATen's sum of the products,
//   the tensor the reference sums.
// * weighted RMSNorm (DeepseekV4RMSNorm): the fp32 squares and ATen's sum over them as norm.h does, then
//   T(float(weight) * (x * r)) (V4 multiplies by the weight in fp32 and rounds once: norm.h).
// * rope of the trailing R channels at position w * m, in fp32 with one rounding (prolog.h).
//
// Everything is read before anything is written: the entries are kept until every one is computed, then
// written, then the state rows. Index values are checked first (the reference's ValueErrors); after that
// every read (kv / gate rows, state rows, rope rows) and write (entry slots, state rows) is in bounds.
#include "../checks.h"
#include "common.h"
#include "kernels.h"
#include "norm.h"
#include "prolog.h"

#include <ATen/ops/_softmax.h>
#include <ATen/ops/sum.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace mla_native {
inline namespace CPU_CAPABILITY {
namespace {

constexpr std::string_view kOp = "kv_compressor";
// fp32 gate elements ([windows, S, D]) per batch of windows, whose gates and softmax (2 x 4 bytes an element)
// stay in a core's L2 between the passes over them (the scratch serves every batch of the call). When ATen
// runs several threads, a batch is whole requests (at least one) and may hold up to kGroupGates, so that
// few parallel regions serve many short requests.
constexpr int64_t kBatchGates = int64_t{1} << 16;
constexpr int64_t kGroupGates = int64_t{1} << 22;
// at::internal::GRAIN_SIZE (ATen/TensorIterator.h, a header heavier than this file needs): below this many
// elements ATen reduces serially
constexpr int64_t kAtenGrainSize = 32768;

struct CompressorRequest {
  int64_t first_row;       // kv / gate row of its first new token
  int64_t first_position;  // n0 = seq_lens[b] - q_b
  int64_t num_new;         // q_b
};

struct ClosedWindow {
  int64_t request, window;
};

struct CompressorCall {
  c10::SmallVector<CompressorRequest, 4> requests;
  std::vector<ClosedWindow> windows;  // by request, then window
};

// mla_ops/ops/kv_compressor.py: check_compressor_values (query_start_loc from
// mla_ops/ops/sparse_attention.py: check_query_starts), the same checks in the same order.
CompressorCall check_compressor_values(int64_t num_tokens, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                       const at::Tensor& query_start_loc, int64_t m, int64_t num_positions,
                                       int64_t num_blocks, int64_t block_size) {
  const at::Tensor tables_t = block_tables.contiguous(), lens_t = seq_lens.contiguous();
  const at::Tensor starts_t = query_start_loc.contiguous();
  const IndexView table(tables_t), lens(lens_t), starts(starts_t);
  const int64_t B = lens_t.size(0), width = tables_t.size(1);
  TORCH_CHECK_VALUE(starts[0] == 0, prefix(kOp), "query_start_loc must start at 0, got query_start_loc[0] = ",
                    starts[0]);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(starts[b + 1] >= starts[b], prefix(kOp), "query_start_loc must never decrease, but ",
                      "query_start_loc[", b + 1, "] = ", starts[b + 1], " < query_start_loc[", b, "] = ", starts[b]);
  }
  TORCH_CHECK_VALUE(starts[B] == num_tokens, prefix(kOp), "query_start_loc[-1] = ", starts[B],
                    " must equal the number of query tokens (", num_tokens, ")");
  // 128 bits: the table's capacity must not wrap into an accepted entry count
  const __int128 capacity = static_cast<__int128>(width) * block_size;
  CompressorCall call;
  call.requests.resize(B);
  struct Closing {
    int64_t request, first, end;
  };
  c10::SmallVector<Closing, 4> closing;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = lens[b];
    // from 0, never decreasing, ending at num_tokens: every entry is in [0, num_tokens], no overflow
    const int64_t q_len = starts[b + 1] - starts[b];
    TORCH_CHECK_VALUE(n >= q_len, prefix(kOp), "seq_lens[", b, "] = ", n, " is less than the request's ", q_len,
                      " new tokens; seq_lens counts the request's tokens including the new ones");
    call.requests[b] = {starts[b], n - q_len, q_len};
    // n >= q_len >= 0: C++ division is Python's floor division here
    const int64_t first = (n - q_len) / m, end = n / m;
    if (end <= first) continue;
    TORCH_CHECK_VALUE(end <= capacity, prefix(kOp), "seq_lens[", b, "] = ", n, " closes entry ", end - 1,
                      " (entries are seq_lens // compress_ratio ", m, "), beyond the block table's capacity (", width,
                      " blocks x ", block_size, " entries)");
    const int64_t last_position = (end - 1) * m;  // <= n - m: no overflow
    TORCH_CHECK_VALUE(last_position < num_positions, prefix(kOp), "entry ", end - 1, " of request ", b,
                      " is rotated at position ", last_position, ", but cos_cache / sin_cache hold positions 0..",
                      num_positions - 1, "; pass tables of at least ", last_position + 1, " positions");
    closing.push_back({b, first, end});
  }
  size_t num_windows = 0;
  for (const Closing& c : closing) {
    // end <= capacity: the columns are < width
    for (int64_t j = c.first / block_size; j <= (c.end - 1) / block_size; ++j) {
      const int64_t id = table[c.request * width + j];
      TORCH_CHECK_VALUE(id >= 0 && id < num_blocks, prefix(kOp), "block_tables[", c.request, ", ", j, "] = ", id,
                        " holds entries this call writes (request ", c.request, ") but is not a block id in [0, ",
                        num_blocks, ")");
    }
    num_windows += static_cast<size_t>(c.end - c.first);
  }
  call.windows.reserve(num_windows);
  for (const Closing& c : closing) {
    for (int64_t w = c.first; w < c.end; ++w) call.windows.push_back({c.request, w});
  }
  return call;
}

// utils::CeilLog2 of ATen (aten/src/ATen/native/cpu/utils.h): 1 up to 2.
inline int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<uint64_t>(x) - 1);
}

// multi_row_sum of aten/src/ATen/native/cpu/SumKernel.cpp for one column (or one vector of columns):
// term(0) + ... + term(size - 1) in ATen's order.
template <typename Acc, typename Term>
inline Acc cascade_sum(int64_t size, const Term& term) {
  constexpr int64_t kLevels = 4;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size) / kLevels);
  const int64_t level_step = int64_t{1} << level_power;
  const int64_t level_mask = level_step - 1;
  Acc acc[kLevels] = {Acc(0.f), Acc(0.f), Acc(0.f), Acc(0.f)};
  int64_t i = 0;
  while (i + level_step <= size) {
    for (int64_t j = 0; j < level_step; ++j, ++i) acc[0] = acc[0] + term(i);
    for (int64_t j = 1; j < kLevels; ++j) {
      acc[j] = acc[j] + acc[j - 1];
      acc[j - 1] = Acc(0.f);
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i) acc[0] = acc[0] + term(i);
  for (int64_t j = 1; j < kLevels; ++j) acc[0] = acc[0] + acc[j];
  return acc[0];
}

// Whether ATen sums every column of a [K, S, D] tensor of `element_size`-byte elements over dim 1 with the
// cascade alone (see the top of the file). ATen's reduction (aten/src/ATen/TensorIteratorReduce.cpp) runs
// serially under GRAIN_SIZE elements, on one thread or inside a parallel region; otherwise it splits the
// outermost kept dim (K) when it has at least as many rows as threads, else D, whose thread ranges it rounds
// to 128-byte columns.
bool sum_is_cascade(int64_t K, int64_t S, int64_t D, int64_t element_size) {
  constexpr int64_t kBlock = 64;
  if (D % kBlock != 0) return false;
  const int64_t threads = at::get_num_threads();
  if (S == 1 || K * S * D < kAtenGrainSize || threads == 1 || at::in_parallel_region()) return true;
  const bool splits_d = K == 1 || (K < threads && (D >= threads || D > K));
  if (!splits_d) return true;
  const int64_t columns_per_128_bytes = 128 / element_size;
  const int64_t workers = std::min(threads, D);
  const int64_t chunk = (D + workers - 1) / workers;
  for (int64_t t = 0; t < workers && t * chunk < D; ++t) {
    int64_t begin = t * chunk, end = std::min(D, begin + chunk);
    begin -= begin % columns_per_128_bytes;
    if (end != D) end -= end % columns_per_128_bytes;
    if (begin != end && (begin % kBlock != 0 || (end - begin) % kBlock != 0)) return false;
  }
  return true;
}

// A contiguous [sizes] view of `base`'s memory from element `offset` on.
at::Tensor contiguous_view(const at::Tensor& base, at::IntArrayRef sizes, int64_t offset) {
  c10::SmallVector<int64_t, 4> strides(sizes.size());
  int64_t stride = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    strides[d] = stride;
    stride *= sizes[d];
  }
  return alias_with_geometry(base, sizes, strides, base.storage_offset() + offset);
}

template <typename T>
struct Compressor {
  const CompressorCall& call;
  const T* kv;    // [tokens, C] contiguous
  const T* gate;  // [tokens, C] contiguous
  const T* state;  // read view: [B, L, 2, C], unit stride over C
  int64_t state_b, state_r, state_j;
  int64_t C, D, m, S, L;
  bool overlap;

  // Raw kv (which = 0) or gate (1) row [C] of request b's token at position p (>= 0, < seq_lens[b]).
  const T* row(int64_t b, int64_t p, int which) const {
    const CompressorRequest& r = call.requests[b];
    if (p >= r.first_position) return (which ? gate : kv) + (r.first_row + p - r.first_position) * C;
    return state + b * state_b + (p % L) * state_r + which * state_j;
  }

  // The window's slot s: its kv (nullptr: kv 0, gate -inf, the missing Ca slots of entry 0) or gate
  // channels [D] and its position_bias row offset (row * C + channel offset).
  const T* slot(int64_t b, int64_t w, int64_t s, int which, int64_t* bias_offset) const {
    if (!overlap) {
      *bias_offset = s * C;
      return row(b, w * m + s, which);
    }
    if (s < m) {
      *bias_offset = s * C;
      return w >= 1 ? row(b, (w - 1) * m + s, which) : nullptr;
    }
    *bias_offset = (s - m) * C + D;
    return row(b, w * m + s - m, which) + D;
  }
};

// dst[d] = g[d] + bias[d] in fp32; rounded to T when the bias is in T (T + T is T in ATen).
template <typename T, typename Bias>
void gate_plus_bias(const T* g, const Bias* bias, int64_t D, float* dst) {
  constexpr int64_t W = fVec::size();
  int64_t d = 0;
  for (; d + W <= D; d += W) {
    fVec sum = load_f32<T>(g + d) + load_f32<Bias>(bias + d);
    if constexpr (!std::is_same_v<Bias, float>) sum = round_through<T>(sum);
    sum.store(dst + d);
  }
  for (; d < D; ++d) {
    const float sum = to_f32(g[d]) + to_f32(bias[d]);
    dst[d] = std::is_same_v<Bias, float> ? sum : to_f32(from_f32<T>(sum));
  }
}

// The window's [S, D] fp32 gates (+ bias) into `dst`.
template <typename T, typename Bias>
void window_gates(const Compressor<T>& c, const Bias* bias, int64_t b, int64_t w, float* dst) {
  for (int64_t s = 0; s < c.S; ++s) {
    int64_t bias_offset = 0;
    const T* g = c.slot(b, w, s, 1, &bias_offset);
    float* out = dst + s * c.D;
    if (g == nullptr) {
      std::fill(out, out + c.D, -std::numeric_limits<float>::infinity());
    } else {
      gate_plus_bias<T, Bias>(g, bias + bias_offset, c.D, out);
    }
  }
}

// T(float(kv) * float(T(p))) of one slot's vector of channels.
template <typename T>
inline fVec product(const T* kv, const float* p) {
  const fVec weight = round_through<T>(fVec::loadu(p));
  return round_through<T>((kv == nullptr ? fVec(0.f) : load_f32<T>(kv)) * weight);
}
template <typename T>
inline float product(const T* kv, float p) {
  const float weight = to_f32(from_f32<T>(p));
  return to_f32(from_f32<T>((kv == nullptr ? 0.f : to_f32(*kv)) * weight));
}

// pooled [D] of one window from its softmax [S, D] (kv pointers of its slots in `kv_slots`), ATen's cascade.
template <typename T>
void pool_window(const T* const* kv_slots, const float* probs, int64_t S, int64_t D, T* pooled) {
  constexpr int64_t W = fVec::size();
  int64_t d = 0;
  for (; d + W <= D; d += W) {
    const fVec sum = cascade_sum<fVec>(S, [&](int64_t s) {
      return product<T>(kv_slots[s] == nullptr ? nullptr : kv_slots[s] + d, probs + s * D + d);
    });
    store_from_f32<T>(pooled + d, fVec(0.f) + round_through<T>(sum));
  }
  for (; d < D; ++d) {
    const float sum = cascade_sum<float>(S, [&](int64_t s) {
      return product<T>(kv_slots[s] == nullptr ? nullptr : kv_slots[s] + d, probs[s * D + d]);
    });
    pooled[d] = from_f32<T>(0.f + to_f32(from_f32<T>(sum)));
  }
}

// The products [S, D] of one window (what the reference sums), for ATen's sum.
template <typename T>
void window_products(const T* const* kv_slots, const float* probs, int64_t S, int64_t D, T* out) {
  constexpr int64_t W = fVec::size();
  for (int64_t s = 0; s < S; ++s) {
    const T* kv = kv_slots[s];
    int64_t d = 0;
    for (; d + W <= D; d += W) {
      store_from_f32<T>(out + s * D + d, product<T>(kv == nullptr ? nullptr : kv + d, probs + s * D + d));
    }
    for (; d < D; ++d) out[s * D + d] = from_f32<T>(product<T>(kv == nullptr ? nullptr : kv + d, probs[s * D + d]));
  }
}

// Row `position` of a [P, R/2] rope table (any float dtype, any strides) as fp32: the reference's .to(float32).
void table_row(const at::Tensor& table, int64_t position, float* out) {
  const int64_t half = table.size(1), s0 = table.stride(0), s1 = table.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, table.scalar_type(), "mla_kv_compressor_rope", [&] {
    const scalar_t* row = table.const_data_ptr<scalar_t>() + position * s0;
    for (int64_t i = 0; i < half; ++i) out[i] = static_cast<float>(row[i * s1]);
  });
}

template <typename T>
void compress(const Compressor<T>& c, const at::Tensor& position_bias, const at::Tensor& norm_weight,
              const at::Tensor& cos_cache, const at::Tensor& sin_cache, float eps, T* entries) {
  const auto& windows = c.call.windows;
  const int64_t total = static_cast<int64_t>(windows.size());
  const int64_t S = c.S, D = c.D, half = cos_cache.size(1);
  const bool bias_f32 = position_bias.scalar_type() == at::kFloat;
  const bool weight_f32 = norm_weight.scalar_type() == at::kFloat;
  // with several ATen threads the softmax (and maybe the sum) must see each request's own tensor
  const bool per_request = at::get_num_threads() > 1 && !at::in_parallel_region();
  const int64_t window_grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, S * D));
  // the batches [k0, k1) of windows: whole requests when per_request, else any run
  c10::SmallVector<std::pair<int64_t, int64_t>, 8> batches;
  int64_t largest = 0;
  for (int64_t k0 = 0; k0 < total;) {
    int64_t k1 = k0;
    while (k1 < total) {
      int64_t next = k1 + 1;
      if (per_request) {
        while (next < total && windows[next].request == windows[k1].request) ++next;
      }
      if (k1 > k0 && (next - k0) * S * D > (per_request ? kGroupGates : kBatchGates)) break;
      k1 = next;
    }
    batches.emplace_back(k0, k1);
    largest = std::max(largest, k1 - k0);
    k0 = k1;
  }
  const at::ScalarType dtype = c10::CppTypeToScalarType<T>::value;
  const auto scratch = scratch_tensors({{{largest, S, D}, at::kFloat}, {{largest, S, D}, at::kFloat},
                                        {{largest, D}, dtype}, {{largest, D}, at::kFloat}, {{largest, 1}, at::kFloat}});
  for (const auto& batch : batches) {
    const int64_t k0 = batch.first, K = batch.second - batch.first;
    float* gates = scratch[0].data_ptr<float>();
    float* probs = scratch[1].data_ptr<float>();
    T* pooled = scratch[2].data_ptr<T>();

    at::parallel_for(0, K, window_grain, [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k) {
        const ClosedWindow& win = windows[k0 + k];
        if (bias_f32) {
          window_gates<T, float>(c, position_bias.const_data_ptr<float>(), win.request, win.window,
                                 gates + k * S * D);
        } else {
          window_gates<T, T>(c, position_bias.const_data_ptr<T>(), win.request, win.window, gates + k * S * D);
        }
      }
    });

    // the segments the reference's tensors are: one request each, or the whole batch
    c10::SmallVector<std::pair<int64_t, int64_t>, 8> segments;
    for (int64_t k = 0; k < K;) {
      int64_t e = k + 1;
      if (per_request) {
        while (e < K && windows[k0 + e].request == windows[k0 + k].request) ++e;
      } else {
        e = K;
      }
      segments.emplace_back(k, e);
      k = e;
    }
    for (const auto& [begin, end] : segments) {
      at::Tensor out = contiguous_view(scratch[1], {end - begin, S, D}, begin * S * D);
      at::_softmax_out(out, contiguous_view(scratch[0], {end - begin, S, D}, begin * S * D), 1, false);
    }

    const auto kv_slots_of = [&](int64_t k, const T** kv_slots) {
      const ClosedWindow& win = windows[k0 + k];
      int64_t unused = 0;
      for (int64_t s = 0; s < S; ++s) kv_slots[s] = c.slot(win.request, win.window, s, 0, &unused);
    };
    for (const auto& segment : segments) {
      const int64_t begin = segment.first, end = segment.second;  // named: lambdas capture them
      if (sum_is_cascade(end - begin, S, D, sizeof(T))) {
        at::parallel_for(begin, end, window_grain, [&](int64_t first, int64_t last) {
          std::vector<const T*> kv_slots(S);
          for (int64_t k = first; k < last; ++k) {
            kv_slots_of(k, kv_slots.data());
            pool_window<T>(kv_slots.data(), probs + k * S * D, S, D, pooled + k * D);
          }
        });
      } else {
        at::Tensor products = new_cpu_tensor({end - begin, S, D}, dtype);
        T* out = products.data_ptr<T>();
        at::parallel_for(begin, end, window_grain, [&](int64_t first, int64_t last) {
          std::vector<const T*> kv_slots(S);
          for (int64_t k = first; k < last; ++k) {
            kv_slots_of(k, kv_slots.data());
            window_products<T>(kv_slots.data(), probs + k * S * D, S, D, out + (k - begin) * S * D);
          }
        });
        at::Tensor sums = contiguous_view(scratch[2], {end - begin, D}, begin * D);
        at::sum_out(sums, products, {1}, /*keepdim=*/false);
      }
    }

    // the weighted RMSNorm's mean: ATen's sum of the fp32 squares (norm.h), per request where ATen would
    // reduce a lone row in two passes (a row of GRAIN_SIZE elements or more on several threads)
    squares<T>(pooled, K, D, D, scratch[3].data_ptr<float>());
    const bool per_request_norm = per_request && D >= kAtenGrainSize;
    const decltype(segments) whole_batch(1, {0, K});
    for (const auto& [begin, end] : per_request_norm ? segments : whole_batch) {
      at::Tensor sums = contiguous_view(scratch[4], {end - begin, 1}, begin);
      at::sum_out(sums, contiguous_view(scratch[3], {end - begin, D}, begin * D), {-1}, /*keepdim=*/true);
    }
    const float* sum_sq = scratch[4].const_data_ptr<float>();

    at::parallel_for(0, K, window_grain, [&](int64_t begin, int64_t end) {
      std::vector<float> rope(2 * half);
      for (int64_t k = begin; k < end; ++k) {
        const int64_t position = windows[k0 + k].window * c.m;
        table_row(cos_cache, position, rope.data());
        table_row(sin_cache, position, rope.data() + half);
        const float r = inverse_rms(sum_sq[k], D, eps);
        T* entry = entries + (k0 + k) * D;
        if (weight_f32) {
          normalize_row_rounded_once<T, float>(pooled + k * D, D, r, norm_weight.const_data_ptr<float>(), entry);
        } else {
          normalize_row_rounded_once<T, T>(pooled + k * D, D, r, norm_weight.const_data_ptr<T>(), entry);
        }
        rotate_trailing_pairs<T>(entry, D, rope.data(), rope.data() + half, half);
      }
    });
  }
}

// dst[i * dst_stride] = src[i] for i < count.
template <typename T>
inline void copy_row(T* dst, int64_t dst_stride, const T* src, int64_t count) {
  if (dst_stride == 1) {
    std::memcpy(dst, src, count * sizeof(T));
  } else {
    for (int64_t i = 0; i < count; ++i) dst[i * dst_stride] = src[i];
  }
}

}  // namespace

void kv_compressor(const at::Tensor& kv, const at::Tensor& gate, const at::Tensor& position_bias,
                   const at::Tensor& norm_weight, const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                   const at::Tensor& state, const at::Tensor& entry_cache, const at::Tensor& block_tables,
                   const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t compress_ratio, bool overlap,
                   double eps) {
  const int64_t num_tokens = kv.size(0), m = compress_ratio;
  const CompressorCall call = check_compressor_values(num_tokens, block_tables, seq_lens, query_start_loc, m,
                                                      cos_cache.size(0), entry_cache.size(0), entry_cache.size(1));
  if (num_tokens == 0) return;
  // kv and gate feed the state rows, written after the entries: copies of them where they live in memory the
  // call writes (everything else is read in full before the first write)
  const auto readable = [&](const at::Tensor& t) {
    return overlaps_memory(t, state) || overlaps_memory(t, entry_cache) ? t.clone(at::MemoryFormat::Contiguous)
                                                                        : t.contiguous();
  };
  const at::Tensor kv_rows = readable(kv), gate_rows = readable(gate);
  const at::Tensor bias = position_bias.contiguous(), weight = norm_weight.contiguous();
  const at::Tensor state_read = state.stride(3) == 1 ? state : state.contiguous();
  const int64_t D = weight.size(0), C = kv.size(1), L = state.size(1);
  const int64_t entry_block_size = entry_cache.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv.scalar_type(), "mla_kv_compressor", [&] {
    using T = scalar_t;
    if constexpr (std::is_same_v<T, double>) {
      TORCH_CHECK(false, "mla native kv_compressor: float64 is served by the reference kernel");
    } else {
      const Compressor<T> c{call,
                            kv_rows.const_data_ptr<T>(),
                            gate_rows.const_data_ptr<T>(),
                            state_read.const_data_ptr<T>(),
                            state_read.stride(0),
                            state_read.stride(1),
                            state_read.stride(2),
                            C,
                            D,
                            m,
                            overlap ? 2 * m : m,
                            L,
                            overlap};
      const int64_t num_windows = static_cast<int64_t>(call.windows.size());
      at::Tensor entries = new_cpu_tensor({num_windows, D}, kv.scalar_type());
      if (num_windows > 0) {
        compress<T>(c, bias, weight, cos_cache, sin_cache, static_cast<float>(eps), entries.data_ptr<T>());
      }
      // the entries, in the reference's order (requests, then windows: a slot named twice keeps the last)
      const int64_t width = block_tables.size(1);
      const at::Tensor tables_t = block_tables.contiguous();
      const IndexView tables(tables_t);
      T* pool = entry_cache.data_ptr<T>();
      for (int64_t k = 0; k < num_windows; ++k) {
        const ClosedWindow& win = call.windows[k];
        const int64_t block = tables[win.request * width + win.window / entry_block_size];
        T* dst = pool + block * entry_cache.stride(0) + (win.window % entry_block_size) * entry_cache.stride(1);
        copy_row(dst, entry_cache.stride(3), entries.const_data_ptr<T>() + k * D, D);
      }
      // the state rows of every request's last min(q_b, L) new tokens
      T* state_out = state.data_ptr<T>();
      const T* kv_p = kv_rows.const_data_ptr<T>();
      const T* gate_p = gate_rows.const_data_ptr<T>();
      for (int64_t b = 0; b < static_cast<int64_t>(call.requests.size()); ++b) {
        const CompressorRequest& r = call.requests[b];
        for (int64_t i = std::max<int64_t>(0, r.num_new - L); i < r.num_new; ++i) {
          T* dst = state_out + b * state.stride(0) + ((r.first_position + i) % L) * state.stride(1);
          copy_row(dst, state.stride(3), kv_p + (r.first_row + i) * C, C);
          copy_row(dst + state.stride(2), state.stride(3), gate_p + (r.first_row + i) * C, C);
        }
      }
    }
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace mla_native

MLA_REGISTER_ISA_KERNEL(kv_compressor)
