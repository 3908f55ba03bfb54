// mla.mla_decode_attention, mla.sparse_mla_attention and mla.shared_kv_attention on CPU: multi-query
// attention of every head over rows cached in paged pools.
//
//   scores[b, n, t] = scale * (q_latent[b, n] . latent[b, t] + q_pe[b, n] . k_pe[b, t])
//   o_latent[b, n]  = softmax_t(scores[b, n, :seq_lens[b]]) . latent[b, :seq_lens[b]]
//
// Decode attends to positions 0 .. seq_lens[b) of sequence b; sparse attention (one row per query
// token) to the positions its topk_indices row lists (-1 skipped, a position listed twice counted
// twice); shared-KV attention (DeepSeek-V4: one row per token that is key and value, so latent = the
// whole row and R = 0) to its window positions, then the compressed entries it sees from a second pool,
// with per-head sinks in the softmax denominator and fp32 weights (`Geometry::split_probs`); prefill
// (mla_prefill_attention: one row per query token) to the positions 0 .. p of its request, p its own
// position. All four are the same kernel over a row's list of entries (`DecodePositions` /
// `SparsePositions` / `SharedKvPositions` / `PrefillPositions` say where entry t is cached), so
// everything below serves all of them.
//
// Every head attends over the same cached rows, so the kernel is organised around the cache:
// each work unit owns one piece of one sequence's context and ALL heads (head folding: a cached
// row is read once for the N heads), walks it in tiles of tokens, scores each tile against every
// head, and accumulates every head's output with an online (flash-decoding style) softmax in fp32.
// Units split a sequence's context (split-K), one equal slice of the batch's positions per thread, so one
// sequence keeps every core busy and unequal lengths still load every core alike; a final pass
// merges the per-unit (max, sum, accumulator) triples per head and writes the output dtype.
//
// Three tile engines, picked at run time (`choose_engine`; `attention_engine` names the choice):
//  * AmxTiles (AVX-512 build, bf16 caches, CPUs whose oneDNN runs AMX tiles): both products on AMX
//    through at::native::cpublas::brgemm (oneDNN's brgemm ukernel), fp32 accumulation. The scores
//    are computed transposed, S^T[tokens, heads] = rows . Q^T, so the cached rows are the A matrix read
//    in place (a tile of consecutive rows of one block; copied only when a tile spans blocks or
//    positions, as sparse index lists do) and only the query is packed to the VNNI layout, once
//    per unit; P . latent takes the tile's rows interleaved in token pairs (VNNI), as SGLang's
//    sgl-kernel/csrc/cpu/decode.cpp packs them. Probabilities rounded to bf16 as below.
//    MLA_OPS_NATIVE_AMX=0 turns it off (the AVX512-BF16 engine then serves).
//  * Bf16DotTiles (AVX-512 build, bf16 caches, CPUs with AVX512-BF16): bf16 products with fp32
//    accumulation through vdpbf16ps. The score dots read the cached rows in place (the reduction
//    runs along the row, lanes over its dims); for P . latent the tile's rows are interleaved in
//    token pairs once (the VNNI layout) and the probabilities are rounded to bf16, the rounding the
//    MLA ops' reference kernels apply too. The softmax denominator sums the rounded probabilities, so
//    numerator and denominator share the same weights. Shared-KV attention keeps them fp32: each is
//    split into two bf16 parts, both multiplied (`Geometry::split_probs`; AMX likewise).
//  * fp32 FMA (every build, every dtype; `F32Engine`): rows converted to fp32 once per tile (fp32
//    caches read in place), register-blocked fp32 FMA micro-kernels. On AVX2 (and the portable
//    build) F32LaneTiles puts the heads in the vector lanes: S^T = rows . Q^T and
//    O^T += rows^T . P^T as small GEMMs whose broadcast operand is a cached row's element, 12
//    accumulators per block and no horizontal sums; bf16 rows are widened in "lane order" (two
//    in-lane unpacks per 16 values), the query and the accumulator sharing that order. On AVX-512,
//    F32Tiles keeps the lanes over the dims (one accumulator per (head, token), a 4 x 4 block reduced
//    at once by a transpose-and-add tree), which its 32 registers of 16 lanes make cheap in loads.
//
// Positions at or past a row's length (decode), not listed (sparse), outside the window or not
// visible (shared KV), after the token's own (prefill) are never read, so whatever sits in unattended slots (NaN/inf included) cannot
// reach the output. The engines that read rows in place prefetch the next tile's rows while a tile
// is computed (a sequence's blocks are scattered over the pool). Rows run in groups whose fp32
// partial results stay bounded (`attend`).
#include "amx.h"
#include "../checks.h"
#include "kernels.h"
#include "score_blocks.h"

#include <ATen/cpu/Utils.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__)
// vdpbf16ps is not part of the build's baseline flags: only the functions that use it are compiled
// for it, and they run only where the CPU reports AVX512-BF16.
#define MLA_BF16_DOT 1
#define MLA_TARGET_BF16 __attribute__((target("avx512bf16,avx512bw,avx512vl,avx512f,avx512dq")))
#endif

namespace mla_native {
inline namespace CPU_CAPABILITY {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr const char* kOpPrefix = "mla.mla_decode_attention: ";

// Per-row / per-token counts of a call (lengths, requests, unit offsets): inline for a few rows, so a small call
// allocates nothing for them.
using Counts = c10::SmallVector<int64_t, 8>;

// ------------------------------------------------------------------------------ index values

// The first position each row attends to: 0, or with a sliding window W >= 1 the first of its last W.
inline int64_t window_start(int64_t len, int64_t sliding_window) {
  return sliding_window > 0 && len > sliding_window ? len - sliding_window : 0;
}

// The lengths the kernel attends to, per row: the first invalid value raises the ValueError text of
// the Python check `check_decode_values` (every length in order first, then the first bad block id a
// row reads, row-major: from the window's first block with a sliding window). All products and sums are
// overflow-checked: lengths and ids may be any int64.
Counts attended_lengths(const IndexView& lens, const IndexView& table, int64_t B, int64_t maxb, int64_t NB,
                        int64_t bs, int64_t sliding_window) {
  int64_t capacity = 0;
  if (__builtin_mul_overflow(maxb, bs, &capacity)) capacity = std::numeric_limits<int64_t>::max();
  Counts out(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = lens[b];
    TORCH_CHECK_VALUE(n >= 1, kOpPrefix, "seq_lens[", b, "] = ", n,
                      "; each decoding sequence holds at least its current token (seq_lens >= 1)");
    TORCH_CHECK_VALUE(n <= capacity, kOpPrefix, "seq_lens[", b, "] = ", n,
                      " exceeds the block table's capacity (", maxb, " blocks x ", bs, " tokens)");
    out[b] = n;
  }
  for (int64_t b = 0; b < B; ++b) {
    const int64_t used = (out[b] - 1) / bs + 1;  // 1 <= n <= maxb * bs, so bs >= 1 and used <= maxb
    for (int64_t j = window_start(out[b], sliding_window) / bs; j < used; ++j) {
      const int64_t id = table[b * maxb + j];
      TORCH_CHECK_VALUE(id >= 0 && id < NB, kOpPrefix, "block_tables[", b, ", ", j, "] = ", id,
                        " is used by sequence ", b, " but is not a block id in [0, ", NB, ")");
    }
  }
  return out;
}

// ------------------------------------------------------------------------------ fp32 engines

// Problem geometry shared by the engines and the driver.
struct Geometry {
  int64_t N, L, R;
  int64_t ks3, vs3;  // element strides of a cached row
  // The weights of P . latent kept to fp32 precision (the shared-KV op's "fp32 math, rounded once"): the bf16
  // engines then split each fp32 weight p into bf16 parts hi = bf16(p) and lo = bf16(p - hi) and accumulate
  // hi * row + lo * row (p to within 2^-16 of itself, at twice the cost of P . latent); otherwise they round p to
  // bf16 (the MLA ops' reference does too).
  bool split_probs = false;
};

// Who holds an UninitFloats: at most one of each kind is alive on a thread at a time (the calling thread's partials,
// and, on every thread the call runs on, its tile engine's block and its score buffers).
enum class Scratch { kPartials, kTileBlock, kScores, kCount };

// A float buffer left uninitialised, for what a kernel writes before it reads: std::vector<float>(n)
// zero-fills, and for the fp32 engines' staging rows and transposed query and accumulator (≈ 190 KB a
// thread at V2-Lite dims) that memset was paid on every call, however short. A buffer of up to
// kCachedFloats comes from its thread's cache, one block per Scratch kind kept from call to call, so a
// steady stream of small calls allocates nothing: a fresh block of tens of KiB per call also makes malloc
// consolidate its fast bins first, ≈ 7% of the C++ side of a tiny decode call. Larger buffers are
// allocated and freed per call, so no thread keeps more than kCachedFloats per kind (768 KiB in all).
class UninitFloats {
 public:
  static constexpr size_t kCachedFloats = size_t{1} << 16;

  UninitFloats(size_t n, Scratch kind) {
    if (n > kCachedFloats) {
      owned_.reset(new float[n]);
      data_ = owned_.get();
      return;
    }
    thread_local std::array<std::unique_ptr<float[]>, static_cast<size_t>(Scratch::kCount)> blocks;
    thread_local std::array<size_t, static_cast<size_t>(Scratch::kCount)> sizes{};
    const size_t k = static_cast<size_t>(kind);
    if (sizes[k] < n) {
      blocks[k].reset();  // release the smaller block before taking the larger one
      blocks[k].reset(new float[n]);
      sizes[k] = n;
    }
    data_ = blocks[k].get();
  }
  UninitFloats(const UninitFloats&) = delete;
  UninitFloats& operator=(const UninitFloats&) = delete;
  float* data() { return data_; }

 private:
  std::unique_ptr<float[]> owned_;  // a buffer past the cache's size, this call's own
  float* data_;
};

// A tile's cached rows as fp32 row pointers, for the fp32 engines: fp32 rows with unit stride are
// read in place, others converted once into a staging buffer whose row stride is padded by one
// cache line (unpadded, the rows of a tile, 2 KiB apart at L = 512, share a handful of L1 sets).
template <typename T, int64_t kTile>
class F32Rows {
 public:
  // Stage cached token `i` of the tile (row pointers into the cache).
  void stage(int64_t i, const T* latent, const T* k_pe) {
    if (std::is_same_v<T, float> && g_.ks3 == 1) {
      lat_[i] = reinterpret_cast<const float*>(latent);
    } else {
      row_to_f32<T>(lat32_ + i * lat_stride_, latent, g_.L, g_.ks3);
      lat_[i] = lat32_ + i * lat_stride_;
    }
    if (std::is_same_v<T, float> && g_.vs3 == 1) {
      pe_[i] = reinterpret_cast<const float*>(k_pe);
    } else {
      row_to_f32<T>(pe32_ + i * pe_stride_, k_pe, g_.R, g_.vs3);
      pe_[i] = pe32_ + i * pe_stride_;
    }
  }

 protected:
  // `extra`: floats the engine wants besides the staging rows, left uninitialised at `extra_` (one allocation
  // for all of a thread's buffers).
  explicit F32Rows(const Geometry& g, int64_t extra = 0)
      : g_(g),
        lat_stride_(g.L + 16),
        pe_stride_(g.R + 16),
        zeros_size_(std::max(g.L, g.R)),
        block_(whole_lines(kTile * lat_stride_) + whole_lines(kTile * pe_stride_) + whole_lines(zeros_size_) + extra,
               Scratch::kTileBlock),
        lat32_(block_.data()),
        pe32_(lat32_ + whole_lines(kTile * lat_stride_)),
        zeros_(pe32_ + whole_lines(kTile * pe_stride_)),
        extra_(zeros_ + whole_lines(zeros_size_)) {
    std::fill_n(zeros_, zeros_size_, 0.f);
  }

  // Points rows nt .. (nt rounded up to a multiple of `multiple`, at most kTile) at zeros, so that
  // micro-kernels may run past nt; returns that row count.
  int64_t pad(int64_t nt, int64_t multiple) {
    const int64_t padded = std::min<int64_t>(kTile, (nt + multiple - 1) / multiple * multiple);
    for (int64_t i = nt; i < padded; ++i) lat_[i] = pe_[i] = zeros_;
    return padded;
  }

  // n floats rounded up to whole 64-byte lines: each part of the block starts on a line.
  static int64_t whole_lines(int64_t n) { return (n + 15) / 16 * 16; }

  Geometry g_;
  int64_t lat_stride_, pe_stride_, zeros_size_;
  UninitFloats block_;
  float* lat32_;  // staged rows (written before they are read; the row padding never read)
  float* pe32_;
  float* zeros_;  // max(L, R) zeros: the rows past a tile's tokens
  float* extra_;
  const float* lat_[kTile];
  const float* pe_[kTile];
};

#if defined(CPU_CAPABILITY_AVX512)
// Register block of the head-major fp32 P . latent micro-kernel: NH heads x NC output vectors per
// token step (the score block is score_blocks.h's).
constexpr int kAccHeads = 4, kAccVecs = 4;

// o[h][d0 : d0 + NC*W] += sum_t p[h][t] * rows[t][d0 : ...] for NH heads. Not inlined: inside the
// driver GCC's register allocation spills the row vectors of this loop.
template <int NH, int NC>
__attribute__((noinline)) void f32_acc_block(float* const* o, const float* const* p, const float* const* rows, int64_t nt,
                          int64_t d0) {
  constexpr int64_t W = fVec::size();
  fVec acc[NH][NC];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < NC; ++c) acc[h][c] = fVec::loadu(o[h] + d0 + c * W);
  for (int64_t t = 0; t < nt; ++t) {
    const float* row = rows[t] + d0;
    fVec r[NC];
    for (int c = 0; c < NC; ++c) r[c] = fVec::loadu(row + c * W);
    for (int h = 0; h < NH; ++h) {
      const fVec w(p[h][t]);
      for (int c = 0; c < NC; ++c) acc[h][c] = at::vec::fmadd(w, r[c], acc[h][c]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < NC; ++c) acc[h][c].store(o[h] + d0 + c * W);
}

template <int NH>
inline void f32_acc_heads(float* const* o, const float* const* p, const float* const* rows, int64_t nt, int64_t L) {
  constexpr int64_t W = fVec::size();
  int64_t d = 0;
  for (; d + kAccVecs * W <= L; d += kAccVecs * W) f32_acc_block<NH, kAccVecs>(o, p, rows, nt, d);
  for (; d + W <= L; d += W) f32_acc_block<NH, 1>(o, p, rows, nt, d);
  for (; d < L; ++d) {
    for (int h = 0; h < NH; ++h) {
      float acc = o[h][d];
      for (int64_t t = 0; t < nt; ++t) acc += p[h][t] * rows[t][d];
      o[h][d] = acc;
    }
  }
}

// Head-major fp32 tile engine (one per thread): lanes over the dims, scores[n * kTile + t]. With 32
// registers of 16 lanes, the 4 x 4 blocks load 8 vectors per 16 FMAs. Queries are fp32 [N, L] /
// [N, R] per sequence.
template <typename T>
class F32Tiles : public F32Rows<T, 16> {
 public:
  using Query = float;
  static constexpr int64_t kTile = 16;
  static constexpr bool kRoundsProbs = false;
  static constexpr bool kHeadsInLanes = false;
  static constexpr bool kPrefetchesRows = true;  // the next tile's rows, while this one is computed

  explicit F32Tiles(const Geometry& g) : F32Rows<T, 16>(g) {}

  // scores[n * kTile + t] = q[n] . row[t] (unscaled) for the nt staged tokens (and zero-row padding).
  void scores(const float* ql, const float* qp, int64_t nt, float* scores) {
    const int64_t padded = this->pad(nt, kScoreTokens);
    std::fill(scores, scores + this->g_.N * kTile, 0.f);
    const int64_t N = this->g_.N, L = this->g_.L, R = this->g_.R;
    int64_t n = 0;
    for (; n + kScoreHeads <= N; n += kScoreHeads) {
      const float* qlh[kScoreHeads];
      const float* qph[kScoreHeads];
      for (int h = 0; h < kScoreHeads; ++h) {
        qlh[h] = ql + (n + h) * L;
        qph[h] = qp + (n + h) * R;
      }
      for (int64_t t = 0; t < padded; t += kScoreTokens)
        f32_score_block<kScoreHeads, kScoreTokens>(qlh, this->lat_ + t, L, qph, this->pe_ + t, R,
                                                   scores + n * kTile + t, kTile);
    }
    for (; n < N; ++n) {
      const float* qlh[1] = {ql + n * L};
      const float* qph[1] = {qp + n * R};
      for (int64_t t = 0; t < padded; t += kScoreTokens)
        f32_score_block<1, kScoreTokens>(qlh, this->lat_ + t, L, qph, this->pe_ + t, R, scores + n * kTile + t,
                                         kTile);
    }
  }

  // acc[n] += sum_t probs[n * kTile + t] * latent[t] for the nt staged tokens.
  void accumulate(const float* probs, int64_t nt, float* acc) {
    const int64_t N = this->g_.N, L = this->g_.L;
    int64_t n = 0;
    for (; n + kAccHeads <= N; n += kAccHeads) {
      float* oh[kAccHeads];
      const float* ph[kAccHeads];
      for (int h = 0; h < kAccHeads; ++h) {
        oh[h] = acc + (n + h) * L;
        ph[h] = probs + (n + h) * kTile;
      }
      f32_acc_heads<kAccHeads>(oh, ph, this->lat_, nt, L);
    }
    for (; n < N; ++n) {
      float* oh[1] = {acc + n * L};
      const float* ph[1] = {probs + n * kTile};
      f32_acc_heads<1>(oh, ph, this->lat_, nt, L);
    }
  }
};
#else
// Heads-in-lanes fp32 micro-kernels. Every head attends over the same rows, so both products are
// small GEMMs whose M dimension is the heads: S^T[t, heads] = rows[t] . Q^T and
// O^T[d, heads] += sum_t rows[t][d] * P^T[t, heads]. With the heads in the lanes, one broadcast
// element of a cached row feeds NV FMAs and no accumulator needs a horizontal reduction. Register
// block: MT tokens (scores) or MD dims (P . latent) x NV vectors of heads; 6 x 2 = 12 accumulators,
// 2 operand vectors and the broadcast fit AVX2's 16 registers with enough independent FMA chains to
// cover the FMA latency.
constexpr int kLaneVecs = 2;
template <int NV>
constexpr int kLaneBlock = NV == 2 ? 6 : 8;

// st[t * np + v * W + lane] = sum_d lat[t][d] * ql_t[d * np + v * W + lane]
//                           + sum_d pe[t][d] * qp_t[d * np + v * W + lane]
// for MT tokens and NV vectors of heads (ql_t, qp_t and st point at the head group).
template <int NV, int MT>
__attribute__((noinline)) void f32_lane_scores(const float* ql_t, const float* qp_t, int64_t np, const float* const* lat,
                                               int64_t L, const float* const* pe, int64_t R, float* st) {
  constexpr int64_t W = fVec::size();
  fVec acc[MT][NV];
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < NV; ++v) acc[t][v] = fVec(0.f);
  for (int part = 0; part < 2; ++part) {
    const float* q = part == 0 ? ql_t : qp_t;
    const int64_t D = part == 0 ? L : R;
    const float* r[MT];
    for (int t = 0; t < MT; ++t) r[t] = part == 0 ? lat[t] : pe[t];
    for (int64_t d = 0; d < D; ++d, q += np) {
      fVec qv[NV];
      for (int v = 0; v < NV; ++v) {
        qv[v] = fVec::loadu(q + v * W);
        pin(qv[v]);
      }
      for (int t = 0; t < MT; ++t) {
        const fVec b(r[t][d]);
        for (int v = 0; v < NV; ++v) acc[t][v] = at::vec::fmadd(b, qv[v], acc[t][v]);
      }
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < NV; ++v) acc[t][v].store(st + t * np + v * W);
}

// acc_t[(d0 + j) * np + v * W + lane] += sum_{t < nt} rows[t][d0 + j] * probs[t * np + v * W + lane]
// for MD dims and NV vectors of heads (acc_t and probs point at the head group); `fresh`: acc_t holds nothing yet
// and the sums start from 0 (what a zero-filled acc_t would give, without the fill).
template <int NV, int MD>
__attribute__((noinline)) void f32_lane_acc(float* acc_t, int64_t np, const float* probs, const float* const* rows,
                                            int64_t nt, int64_t d0, bool fresh) {
  constexpr int64_t W = fVec::size();
  fVec acc[MD][NV];
  for (int j = 0; j < MD; ++j)
    for (int v = 0; v < NV; ++v) acc[j][v] = fresh ? fVec(0.f) : fVec::loadu(acc_t + (d0 + j) * np + v * W);
  for (int64_t t = 0; t < nt; ++t) {
    fVec p[NV];
    for (int v = 0; v < NV; ++v) {
      p[v] = fVec::loadu(probs + t * np + v * W);
      pin(p[v]);
    }
    const float* r = rows[t] + d0;
    for (int j = 0; j < MD; ++j) {
      const fVec b(r[j]);
      for (int v = 0; v < NV; ++v) acc[j][v] = at::vec::fmadd(b, p[v], acc[j][v]);
    }
  }
  for (int j = 0; j < MD; ++j)
    for (int v = 0; v < NV; ++v) acc[j][v].store(acc_t + (d0 + j) * np + v * W);
}

// Scores of `count` tokens (count even) for one head group of NV vectors: blocks of kLaneBlock<NV>
// tokens, then of 4 and 2.
template <int NV>
void f32_lane_scores_group(const float* ql_t, const float* qp_t, int64_t np, const float* const* lat, int64_t L,
                           const float* const* pe, int64_t R, float* st, int64_t count) {
  constexpr int MT = kLaneBlock<NV>;
  int64_t t = 0;
  for (; t + MT <= count; t += MT) f32_lane_scores<NV, MT>(ql_t, qp_t, np, lat + t, L, pe + t, R, st + t * np);
  for (; t + 4 <= count; t += 4) f32_lane_scores<NV, 4>(ql_t, qp_t, np, lat + t, L, pe + t, R, st + t * np);
  for (; t < count; t += 2) f32_lane_scores<NV, 2>(ql_t, qp_t, np, lat + t, L, pe + t, R, st + t * np);
}

// P . latent of nt tokens for one head group of NV vectors, all L dims.
template <int NV>
void f32_lane_acc_group(float* acc_t, int64_t np, const float* probs, const float* const* rows, int64_t nt,
                        int64_t L, bool fresh) {
  constexpr int MD = kLaneBlock<NV>;
  int64_t d = 0;
  for (; d + MD <= L; d += MD) f32_lane_acc<NV, MD>(acc_t, np, probs, rows, nt, d, fresh);
  for (; d < L; ++d) f32_lane_acc<NV, 1>(acc_t, np, probs, rows, nt, d, fresh);
}

#if defined(CPU_CAPABILITY_AVX2)
// The fp32 values of a bf16 row (D % 16 == 0) in "lane order": each group of 16 values comes out as
// values 0-3, 8-11, 4-7, 12-15 of the group, what two in-lane unpacks against zero give from one
// 256-bit load (a bf16 is the high half of its fp32). Against two widening loads and two shifts per
// 16 values in source order, this is the cheaper conversion; dot products do not care about the
// order of their terms as long as both operands share it.
inline void bf16_to_f32_lane_order(float* dst, const at::BFloat16* src, int64_t D) {
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t d = 0; d < D; d += 16) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), _mm256_unpacklo_epi16(zero, x));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d + 8), _mm256_unpackhi_epi16(zero, x));
  }
}
constexpr bool kHasLaneOrder = true;
#else
constexpr bool kHasLaneOrder = false;
#endif

// Heads-in-lanes fp32 tile engine (one per thread): heads padded to np lanes (a multiple of the
// vector width; the padding heads have zero queries), scores st[t * np + n], and the unit's
// accumulator kept transposed, acc_t[d * np + n], until `finish`. Queries are fp32 [N, L] / [N, R]
// per sequence, transposed once per unit.
template <typename T>
class F32LaneTiles : public F32Rows<T, 48> {
 public:
  using Query = float;
  static constexpr int64_t kTile = 48;  // a multiple of every token block (6, 8, 4, 2)
  static constexpr bool kRoundsProbs = false;
  static constexpr bool kHeadsInLanes = true;
  // No software prefetch: it converts every row it reads, a block's run of rows is contiguous for the
  // hardware prefetcher, and requesting the next tile's rows made the kernel 15-25% slower on the
  // AVX2-only Zen 3 it was measured on (the requests fill the miss buffers the conversion needs).
  static constexpr bool kPrefetchesRows = false;

  explicit F32LaneTiles(const Geometry& g)
      : F32Rows<T, 48>(g, (2 * g.L + g.R) * lanes_for(g.N)),
        np_(lanes_for(g.N)),
        lane_order_(std::is_same_v<T, at::BFloat16> && kHasLaneOrder && g.ks3 == 1 && g.vs3 == 1 && g.L % 16 == 0 &&
                    g.R % 16 == 0),
        qt_(this->extra_),
        acc_t_(qt_ + (g.L + g.R) * np_) {}

  int64_t lanes() const { return np_; }

  // Stage cached token `i` of the tile. bf16 rows with unit stride and dims in whole groups of 16
  // are widened in lane order (bf16_to_f32_lane_order); the transposed query and the accumulator
  // use the same order (`source`), and `finish` restores the source order.
  void stage(int64_t i, const T* latent, const T* k_pe) {
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (lane_order_) {
        float* lat = this->lat32_ + i * this->lat_stride_;
        float* pe = this->pe32_ + i * this->pe_stride_;
        bf16_to_f32_lane_order(lat, latent, this->g_.L);
        bf16_to_f32_lane_order(pe, k_pe, this->g_.R);
        this->lat_[i] = lat;
        this->pe_[i] = pe;
        return;
      }
    }
#endif
    F32Rows<T, 48>::stage(i, latent, k_pe);
  }

  // A new unit over query row `row` (ql [N, L], qp [N, R]): a zero accumulator, and Q^T [L + R, np]
  // unless the previous unit was of the same row (a thread's units are consecutive, so a sequence
  // split over its cores is transposed once per core).
  void begin(int64_t row, const float* ql, const float* qp) {
    fresh_ = true;
    if (row == row_) return;
    row_ = row;
    to_lanes(qt_, ql, this->g_.L);
    to_lanes(qt_ + this->g_.L * np_, qp, this->g_.R);
  }

  // st[t * np + n] = q[n] . row[t] (unscaled) for the nt staged tokens (rows past nt, up to the next
  // even count, are zero rows).
  void scores(int64_t nt, float* st) {
    const int64_t padded = this->pad(nt, 2);
    const int64_t L = this->g_.L, R = this->g_.R;
    constexpr int64_t G = kLaneVecs * fVec::size();
    for (int64_t n0 = 0; n0 < np_; n0 += G) {
      const float* ql_t = qt_ + n0;
      const float* qp_t = qt_ + L * np_ + n0;
      if (n0 + G <= np_) {
        f32_lane_scores_group<kLaneVecs>(ql_t, qp_t, np_, this->lat_, L, this->pe_, R, st + n0, padded);
      } else {
        f32_lane_scores_group<1>(ql_t, qp_t, np_, this->lat_, L, this->pe_, R, st + n0, padded);
      }
    }
  }

  // acc_t[d][n] *= alpha[n].
  void rescale(const float* alpha) {
    if (fresh_) return;  // nothing accumulated: the zeros stay zeros
    constexpr int64_t W = fVec::size();
    for (int64_t v = 0; v < np_; v += W) {
      const fVec a = fVec::loadu(alpha + v);
      for (int64_t d = 0; d < this->g_.L; ++d) {
        float* o = acc_t_ + d * np_ + v;
        (fVec::loadu(o) * a).store(o);
      }
    }
  }

  // acc_t[d][n] += sum_t probs[t * np + n] * latent[t][d] for the nt staged tokens.
  void accumulate(const float* probs, int64_t nt) {
    constexpr int64_t G = kLaneVecs * fVec::size();
    for (int64_t n0 = 0; n0 < np_; n0 += G) {
      if (n0 + G <= np_) {
        f32_lane_acc_group<kLaneVecs>(acc_t_ + n0, np_, probs + n0, this->lat_, nt, this->g_.L, fresh_);
      } else {
        f32_lane_acc_group<1>(acc_t_ + n0, np_, probs + n0, this->lat_, nt, this->g_.L, fresh_);
      }
    }
    fresh_ = false;
  }

  // acc[n * L + d] = acc_t[d][n] for the real heads: the unit's accumulator in the merge's layout
  // (and the source order).
  void finish(float* acc) const {
    if (fresh_) {  // a unit whose every entry was skipped
      std::fill_n(acc, this->g_.N * this->g_.L, 0.f);
      return;
    }
    from_lanes(acc, acc_t_, this->g_.L);
  }

 private:
  // The transposes between the heads' [D] rows and the lanes go in 8 x 8 blocks (a register transpose on AVX2):
  // element by element, walking one dim across the heads touches N lines D floats apart, and at V2-Lite dims the
  // two transposes of a unit cost more than attending to a 16-token context. Lane order permutes runs of 4 dims
  // (`source`), so a block's 8 positions are two runs, moved through a small staging tile.
  static constexpr int64_t kBlock = 8;

  // dst[p * np + n] = src[n * D + source(p)] for p < D and the real heads n < N; the padding lanes 0.
  void to_lanes(float* dst, const float* src, int64_t D) const {
    const int64_t N = this->g_.N, full_p = D / kBlock * kBlock, full_n = N / kBlock * kBlock;
    alignas(64) float tile[kBlock * kBlock];
    for (int64_t p0 = 0; p0 < full_p; p0 += kBlock) {
      for (int64_t n0 = 0; n0 < full_n; n0 += kBlock) {
        for (int64_t i = 0; i < kBlock; ++i) {  // tile[i][j] = head n0 + i at position p0 + j
          const float* row = src + (n0 + i) * D;
          std::memcpy(tile + i * kBlock, row + source(p0), 4 * sizeof(float));
          std::memcpy(tile + i * kBlock + 4, row + source(p0 + 4), 4 * sizeof(float));
        }
        at::vec::transpose_mxn<float, kBlock, kBlock>(tile, kBlock, dst + p0 * np_ + n0, np_);
      }
    }
    for (int64_t p = 0; p < D; ++p) {  // what the blocks left: the last heads, the last positions, the padding
      float* lanes = dst + p * np_;
      for (int64_t n = p < full_p ? full_n : 0; n < N; ++n) lanes[n] = src[n * D + source(p)];
      std::fill(lanes + N, lanes + np_, 0.f);
    }
  }

  // dst[n * D + source(p)] = src[p * np + n] for p < D and the real heads n < N.
  void from_lanes(float* dst, const float* src, int64_t D) const {
    const int64_t N = this->g_.N, full_p = D / kBlock * kBlock, full_n = N / kBlock * kBlock;
    alignas(64) float tile[kBlock * kBlock];
    for (int64_t p0 = 0; p0 < full_p; p0 += kBlock) {
      for (int64_t n0 = 0; n0 < full_n; n0 += kBlock) {
        at::vec::transpose_mxn<float, kBlock, kBlock>(src + p0 * np_ + n0, np_, tile, kBlock);
        for (int64_t i = 0; i < kBlock; ++i) {  // tile[i][j] = head n0 + i at position p0 + j
          float* row = dst + (n0 + i) * D;
          std::memcpy(row + source(p0), tile + i * kBlock, 4 * sizeof(float));
          std::memcpy(row + source(p0 + 4), tile + i * kBlock + 4, 4 * sizeof(float));
        }
      }
    }
    for (int64_t p = 0; p < D; ++p)
      for (int64_t n = p < full_p ? full_n : 0; n < N; ++n) dst[n * D + source(p)] = src[p * np_ + n];
  }

  // The source dim of staged position p (within the latent or the rope part).
  int64_t source(int64_t p) const {
    if (!lane_order_) return p;
    const int64_t q = p % 16;
    return p - q + (q < 4 || q >= 12 ? q : (q < 8 ? q + 4 : q - 4));
  }

  int64_t np_;
  bool lane_order_;
  int64_t row_ = -1;  // the query row qt_ holds
  bool fresh_ = true;  // nothing accumulated in this unit yet: acc_t_ is garbage, read as zeros
  float* qt_;     // [L + R, np], filled by `begin` on a unit's first row
  float* acc_t_;  // [L, np], filled by a unit's first `accumulate`

  // N heads padded to whole vectors.
  static int64_t lanes_for(int64_t N) { return (N + fVec::size() - 1) / fVec::size() * fVec::size(); }
};
#endif

// The fp32 engine of this build: head-major where 32 registers of 16 lanes make its 4 x 4 blocks
// cheap in loads; heads in lanes on AVX2's 16 registers (and the portable builds).
#if defined(CPU_CAPABILITY_AVX512)
template <typename T>
using F32Engine = F32Tiles<T>;
#else
template <typename T>
using F32Engine = F32LaneTiles<T>;
#endif

// ---------------------------------------------------------------------- AVX512-BF16 engine
#if defined(MLA_BF16_DOT)

bool cpu_has_avx512_bf16() {
  static const bool has = [] {
    const auto caps = at::cpu::get_cpu_capabilities();
    const auto it = caps.find("avx512_bf16");
    return it != caps.end() && it->second.isBool() && it->second.toBool();
  }();
  return has;
}

// out[h][t] += ql[h] . lat[t] + qp[h] . pe[t] over L and R bf16 values (exact products, fp32
// accumulation; L and R multiples of 32), NH heads x 4 tokens: one register block and one
// reduction for both parts. The accumulators stay local to this function (and the loads unmasked)
// so that GCC keeps them in registers.
template <int NH>
MLA_TARGET_BF16 inline void bf16_score_block(const at::BFloat16* const* ql, const at::BFloat16* const* lat, int64_t L,
                                             const at::BFloat16* const* qp, const at::BFloat16* const* pe, int64_t R,
                                             float* out, int64_t out_stride) {
  fVec acc[NH][4];
  for (int h = 0; h < NH; ++h)
    for (int t = 0; t < 4; ++t) acc[h][t] = fVec(0.f);
  for (int part = 0; part < 2; ++part) {
    // Plain local pointers: loads through the caller's pointer arrays inside the loop would keep
    // GCC from holding the accumulators in registers (the vector loads may alias them).
    const at::BFloat16* qh[NH];
    const at::BFloat16* rt[4];
    for (int h = 0; h < NH; ++h) qh[h] = part == 0 ? ql[h] : qp[h];
    for (int t = 0; t < 4; ++t) rt[t] = part == 0 ? lat[t] : pe[t];
    const int64_t D = part == 0 ? L : R;
    for (int64_t d = 0; d < D; d += 32) {
      __m512i r[4];
      for (int t = 0; t < 4; ++t) {
        r[t] = _mm512_loadu_si512(rt[t] + d);
        asm("" : "+v"(r[t]));
      }
      for (int h = 0; h < NH; ++h) {
        __m512i x = _mm512_loadu_si512(qh[h] + d);
        asm("" : "+v"(x));
        for (int t = 0; t < 4; ++t) acc[h][t] = fVec(_mm512_dpbf16_ps(acc[h][t], (__m512bh)x, (__m512bh)r[t]));
      }
    }
  }
  add_block_sums<NH, 4>(acc, out, out_stride);
}

// acc[h][d0 : d0 + 16*NC] += sum_j dot(p_pair[h][j], packed[j][d]) over token pairs j, NH heads.
// packed[j] holds rows 2j and 2j+1 interleaved (dword d = (row_2j[d], row_2j+1[d])); p_pair[h][j]
// is the matching pair of bf16 probabilities. kSplit: p_pair holds their hi parts and lo_pair[h][j] the lo
// parts (Geometry::split_probs), both accumulated.
template <int NH, int NC, bool kSplit>
MLA_TARGET_BF16 inline void bf16_acc_block(float* const* o, const int32_t* const* p_pair,
                                           const int32_t* const* lo_pair, const uint16_t* packed, int64_t pairs,
                                           int64_t L, int64_t d0) {
  __m512 acc[NH][NC];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < NC; ++c) acc[h][c] = _mm512_loadu_ps(o[h] + d0 + 16 * c);
  for (int64_t j = 0; j < pairs; ++j) {
    const uint16_t* row = packed + j * 2 * L + 2 * d0;
    __m512i v[NC];
    for (int c = 0; c < NC; ++c) {
      v[c] = _mm512_loadu_si512(row + 32 * c);
      asm("" : "+v"(v[c]));
    }
    for (int h = 0; h < NH; ++h) {
      const __m512i w = _mm512_set1_epi32(p_pair[h][j]);
      for (int c = 0; c < NC; ++c) acc[h][c] = _mm512_dpbf16_ps(acc[h][c], (__m512bh)w, (__m512bh)v[c]);
      if constexpr (kSplit) {
        const __m512i w_lo = _mm512_set1_epi32(lo_pair[h][j]);
        for (int c = 0; c < NC; ++c) acc[h][c] = _mm512_dpbf16_ps(acc[h][c], (__m512bh)w_lo, (__m512bh)v[c]);
      }
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o[h] + d0 + 16 * c, acc[h][c]);
}

// packed[j][d] = (rows[2j][d], rows[2j+1][d]) as one dword, j < pairs, d < L (L % 32 == 0): the
// VNNI layout of a [2 * pairs, L] bf16 matrix. One two-source word permute (vpermt2w) per 16 output
// dwords.
MLA_TARGET_BF16 inline void pack_token_pairs(const at::BFloat16* const* rows, int64_t pairs, int64_t L,
                                             uint16_t* packed) {
  alignas(64) static constexpr uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                   24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
  for (int64_t j = 0; j < pairs; ++j) {
    const at::BFloat16* r0 = rows[2 * j];
    const at::BFloat16* r1 = rows[2 * j + 1];
    uint16_t* dst = packed + j * 2 * L;
    for (int64_t d = 0; d < L; d += 32) {
      const __m512i a = _mm512_loadu_si512(r0 + d), b = _mm512_loadu_si512(r1 + d);
      _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// dst[n][i] = bf16(src[n][i]) for n < rows, i < stride (a multiple of 32): the tile's probabilities,
// already bf16 values.
MLA_TARGET_BF16 inline void probs_to_bf16(const float* src, int64_t rows, int64_t stride, at::BFloat16* dst) {
  for (int64_t n = 0; n < rows; ++n) {
    for (int64_t i = n * stride; i < (n + 1) * stride; i += 32) {
      const __m512 lo = _mm512_loadu_ps(src + i), hi = _mm512_loadu_ps(src + i + 16);
      _mm512_storeu_si512(dst + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// hi[n][i] = bf16(src[n][i]) and lo[n][i] = bf16(src[n][i] - hi[n][i]) for n < rows, i < stride (a multiple
// of 32): each fp32 probability as the sum of two bf16 values to within 2^-16 of itself (the difference is
// exact in fp32; Geometry::split_probs).
MLA_TARGET_BF16 inline void probs_split_bf16(const float* src, int64_t rows, int64_t stride, at::BFloat16* hi,
                                             at::BFloat16* lo) {
  for (int64_t i = 0; i < rows * stride; i += 32) {
    const __m512 a = _mm512_loadu_ps(src + i), b = _mm512_loadu_ps(src + i + 16);
    const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(b, a);
    // bf16 -> fp32: the bf16 bits are the high half of the fp32 ones
    const __m512 ha = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
    const __m512 hb =
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
    _mm512_storeu_si512(hi + i, h);
    _mm512_storeu_si512(lo + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, hb), _mm512_sub_ps(a, ha)));
  }
}

// bf16 tile engine (one per thread). Needs unit-stride cached rows and L, R multiples of 32;
// queries are the bf16 inputs themselves [N, L] / [N, R] (the scale is applied to the fp32 scores).
class Bf16DotTiles {
 public:
  using Query = at::BFloat16;
  static constexpr int64_t kTile = 32;
  static constexpr bool kRoundsProbs = true;
  static constexpr bool kHeadsInLanes = false;
  static constexpr bool kPrefetchesRows = true;  // the next tile's rows, while this one is computed

  static bool serves(const Geometry& g) {
    return cpu_has_avx512_bf16() && g.ks3 == 1 && g.vs3 == 1 && g.L % 32 == 0 && g.R % 32 == 0;
  }

  explicit Bf16DotTiles(const Geometry& g)
      : g_(g),
        packed_(kTile * g.L),
        probs16_(g.N * kTile),
        probs_lo_(g.split_probs ? g.N * kTile : 0),
        zeros_(std::max(g.L, g.R), at::BFloat16(0.f)) {}

  void stage(int64_t i, const at::BFloat16* latent, const at::BFloat16* k_pe) {
    lat_[i] = latent;
    pe_[i] = k_pe;
  }

  MLA_TARGET_BF16 void scores(const at::BFloat16* ql, const at::BFloat16* qp, int64_t nt, float* scores) {
    const int64_t N = g_.N, L = g_.L, R = g_.R;
    const int64_t padded = std::min<int64_t>(kTile, (nt + 3) / 4 * 4);
    for (int64_t i = nt; i < padded; ++i) lat_[i] = pe_[i] = zeros_.data();
    std::fill(scores, scores + N * kTile, 0.f);
    // Token blocks outer: a block's 4 rows (4.6 KB at L=512) stay in L1 while every head's query
    // (18 KB at N=16) streams past them.
    for (int64_t t = 0; t < padded; t += 4) {
      int64_t n = 0;
      for (; n + 4 <= N; n += 4) {
        const at::BFloat16* qlh[4] = {ql + n * L, ql + (n + 1) * L, ql + (n + 2) * L, ql + (n + 3) * L};
        const at::BFloat16* qph[4] = {qp + n * R, qp + (n + 1) * R, qp + (n + 2) * R, qp + (n + 3) * R};
        bf16_score_block<4>(qlh, lat_ + t, L, qph, pe_ + t, R, scores + n * kTile + t, kTile);
      }
      for (; n < N; ++n) {
        const at::BFloat16* qlh[1] = {ql + n * L};
        const at::BFloat16* qph[1] = {qp + n * R};
        bf16_score_block<1>(qlh, lat_ + t, L, qph, pe_ + t, R, scores + n * kTile + t, kTile);
      }
    }
  }

  // probs are already bf16 values (kRoundsProbs) unless split_probs, zero past nt.
  MLA_TARGET_BF16 void accumulate(const float* probs, int64_t nt, float* acc) {
    const int64_t pairs = (nt + 1) / 2;
    if (nt % 2 == 1) lat_[nt] = zeros_.data();  // the odd token's partner: weight 0 and finite
    pack_token_pairs(lat_, pairs, g_.L, packed_.data());
    if (g_.split_probs) {
      probs_split_bf16(probs, g_.N, kTile, probs16_.data(), probs_lo_.data());
      accumulate_pairs<true>(pairs, acc);
    } else {
      probs_to_bf16(probs, g_.N, kTile, probs16_.data());
      accumulate_pairs<false>(pairs, acc);
    }
  }

 private:
  // acc[n] += the packed tile's token pairs weighted by probs16_ (and probs_lo_: kSplit).
  template <bool kSplit>
  MLA_TARGET_BF16 void accumulate_pairs(int64_t pairs, float* acc) {
    const int64_t N = g_.N, L = g_.L;
    const int32_t* pp = reinterpret_cast<const int32_t*>(probs16_.data());
    const int32_t* pl = reinterpret_cast<const int32_t*>(probs_lo_.data());
    // Dim blocks outer: the block's slice of the packed tile (pairs x 256 bytes) stays in L1 for all
    // heads. L % 32 == 0, so the blocks are 64 dims, then at most one of 32.
    for (int64_t d = 0; d < L;) {
      const bool wide = d + 64 <= L;
      int64_t n = 0;
      for (; n + 4 <= N; n += 4) {
        float* oh[4] = {acc + n * L, acc + (n + 1) * L, acc + (n + 2) * L, acc + (n + 3) * L};
        const int32_t* ph[4] = {pp + n * kTile / 2, pp + (n + 1) * kTile / 2, pp + (n + 2) * kTile / 2,
                                pp + (n + 3) * kTile / 2};
        const int32_t* pl4[4] = {pl + n * kTile / 2, pl + (n + 1) * kTile / 2, pl + (n + 2) * kTile / 2,
                                 pl + (n + 3) * kTile / 2};
        if (wide) {
          bf16_acc_block<4, 4, kSplit>(oh, ph, pl4, packed_.data(), pairs, L, d);
        } else {
          bf16_acc_block<4, 2, kSplit>(oh, ph, pl4, packed_.data(), pairs, L, d);
        }
      }
      for (; n < N; ++n) {
        float* oh[1] = {acc + n * L};
        const int32_t* ph[1] = {pp + n * kTile / 2};
        const int32_t* pl1[1] = {pl + n * kTile / 2};
        if (wide) {
          bf16_acc_block<1, 4, kSplit>(oh, ph, pl1, packed_.data(), pairs, L, d);
        } else {
          bf16_acc_block<1, 2, kSplit>(oh, ph, pl1, packed_.data(), pairs, L, d);
        }
      }
      d += wide ? 64 : 32;
    }
  }

  Geometry g_;
  std::vector<uint16_t> packed_;
  std::vector<at::BFloat16> probs16_, probs_lo_, zeros_;
  const at::BFloat16* lat_[kTile];
  const at::BFloat16* pe_[kTile];
};

// ------------------------------------------------------------------------------- AMX engine
#if defined(MLA_AMX)

// AMX tile engine (one per thread; releases the tile state when the thread's work ends). Needs
// unit-stride cached rows and L, R multiples of 32. The scores are computed transposed,
// S^T[tokens, heads] = rows . Q^T, so the cached rows are brgemm's A matrix read in place when the
// tile's rows are equally spaced (consecutive rows of a block; latent and rope dims side by side, as
// in vLLM's [.., L + R] pool, make it one product over L + R dims) and only the query is packed to
// the VNNI layout, once per unit. Other tiles (across blocks, sparse index lists, the tail of a
// unit) are copied into a [kTile, L + R] tile first. Heads are padded to a multiple of 16 (one AMX
// tile's columns) with zero queries and token counts to a multiple of 16 (its rows) with zero rows,
// so the kernel shapes (oneDNN JIT-compiles one per shape and thread, then caches it) stay few.
class AmxTiles {
 public:
  using Query = at::BFloat16;
  static constexpr int64_t kTile = 64;
  static constexpr int64_t kRows = 16;
  static constexpr bool kRoundsProbs = true;
  static constexpr bool kHeadsInLanes = false;
  static constexpr bool kPrefetchesRows = true;  // the next tile's rows, while this one is computed

  static bool serves(const Geometry& g) {
    return g.ks3 == 1 && g.vs3 == 1 && g.L % 32 == 0 && g.R % 32 == 0 && amx_engine_enabled();
  }

  explicit AmxTiles(const Geometry& g)
      : g_(g),
        D_(g.L + g.R),
        NP_((g.N + 15) / 16 * 16),
        q_(D_ * NP_, at::BFloat16(0.f)),
        rows_(kTile * D_),
        st_(kTile * NP_),
        packed_(kTile * g.L),
        probs16_(NP_ * kTile, at::BFloat16(0.f)),
        probs_lo_(g.split_probs ? NP_ * kTile : 0, at::BFloat16(0.f)) {}
  ~AmxTiles() { at::native::cpublas::brgemm_release(); }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;

  void stage(int64_t i, const at::BFloat16* latent, const at::BFloat16* k_pe) {
    lat_[i] = latent;
    pe_[i] = k_pe;
  }

  // scores[n * kTile + t] = q[n] . row[t] (unscaled), t < nt; 0 past nt.
  void scores(const at::BFloat16* ql, const at::BFloat16* qp, int64_t nt, float* scores) {
    const int64_t N = g_.N, L = g_.L, R = g_.R;
    if (ql != packed_ql_ || qp != packed_qp_) pack_query(ql, qp);
    const int64_t M = (nt + kRows - 1) / kRows * kRows;
    const std::ptrdiff_t lat_step = nt == M ? equal_row_step(lat_, nt, L) : 0;
    const std::ptrdiff_t pe_step = lat_step != 0 ? equal_row_step(pe_, nt, R) : 0;
    const at::BFloat16* q_pe_part = q_.data() + L * NP_;  // the packed rows of the rope dims
    if (lat_step >= D_ && pe_step == lat_step && pe_[0] == lat_[0] + L) {
      // [latent | rope] rows: one product over L + R dims.
      at::native::cpublas::brgemm(M, NP_, D_, lat_step, NP_, NP_, false, lat_[0], q_.data(), st_.data());
      rows_are_copied_ = false;
    } else if (lat_step != 0 && pe_step != 0) {
      at::native::cpublas::brgemm(M, NP_, L, lat_step, NP_, NP_, false, lat_[0], q_.data(), st_.data());
      at::native::cpublas::brgemm(M, NP_, R, pe_step, NP_, NP_, true, pe_[0], q_pe_part, st_.data());
      rows_are_copied_ = false;
    } else {
      for (int64_t i = 0; i < nt; ++i) {
        at::BFloat16* row = rows_.data() + i * D_;
        std::memcpy(row, lat_[i], L * sizeof(at::BFloat16));
        std::memcpy(row + L, pe_[i], R * sizeof(at::BFloat16));
      }
      std::fill(rows_.data() + nt * D_, rows_.data() + M * D_, at::BFloat16(0.f));
      at::native::cpublas::brgemm(M, NP_, D_, D_, NP_, NP_, false, rows_.data(), q_.data(), st_.data());
      rows_are_copied_ = true;
    }
    for (int64_t n = 0; n < N; ++n) {
      float* out = scores + n * kTile;
      for (int64_t t = 0; t < nt; ++t) out[t] = st_[t * NP_ + n];
      std::fill(out + nt, out + kTile, 0.f);
    }
  }

  // acc[n] += sum_t probs[n * kTile + t] * latent[t]; probs are bf16 values unless split_probs, zero past
  // nt (rows past nt exist only in the copied tile, as zero rows).
  void accumulate(const float* probs, int64_t nt, float* acc) {
    const int64_t N = g_.N, L = g_.L;
    const int64_t K = (nt + kRows - 1) / kRows * kRows;  // even: whole token pairs
    if (rows_are_copied_) {
      for (int64_t i = 0; i < K; ++i) lat_[i] = rows_.data() + i * D_;
    }
    pack_token_pairs(lat_, K / 2, L, packed_.data());
    const auto* packed = reinterpret_cast<const at::BFloat16*>(packed_.data());
    if (g_.split_probs) {
      probs_split_bf16(probs, N, kTile, probs16_.data(), probs_lo_.data());
      at::native::cpublas::brgemm(N, L, K, kTile, L, L, true, probs_lo_.data(), packed, acc);
    } else {
      probs_to_bf16(probs, N, kTile, probs16_.data());  // padded heads keep their zero rows
    }
    at::native::cpublas::brgemm(N, L, K, kTile, L, L, true, probs16_.data(), packed, acc);
  }

 private:
  // q_[p][n][e] = concat(ql[n], qp[n])[2p + e]: the VNNI layout of Q^T [L + R, NP_]; padded heads
  // stay zero.
  void pack_query(const at::BFloat16* ql, const at::BFloat16* qp) {
    pack_transposed_vnni(ql, g_.N, g_.L, g_.L, NP_, q_.data());
    pack_transposed_vnni(qp, g_.N, g_.R, g_.R, NP_, q_.data() + g_.L * NP_);
    packed_ql_ = ql;
    packed_qp_ = qp;
  }

  Geometry g_;
  int64_t D_, NP_;
  std::vector<at::BFloat16> q_, rows_;
  std::vector<float> st_;
  std::vector<uint16_t> packed_;
  std::vector<at::BFloat16> probs16_, probs_lo_;
  const at::BFloat16* packed_ql_ = nullptr;
  const at::BFloat16* packed_qp_ = nullptr;
  bool rows_are_copied_ = false;
  const at::BFloat16* lat_[kTile];
  const at::BFloat16* pe_[kTile];
};

#endif  // MLA_AMX
#endif  // MLA_BF16_DOT

// --------------------------------------------------------------------------------- driver

// Where the entries a query row attends to are cached. Decode: entry t of row b is position t of
// sequence b (runs of consecutive positions share a block). Sparse: entry e of token t is the
// position its index list holds there, -1 none. Shared KV: the token's window positions, then its
// compressed entries, from a second pool. `slot` returns the pool (`Pools`) and block id of an entry
// (an id outside [0, the pool's blocks) is skipped, never read), its offset in the block and how many
// consecutive entries (at most `max_run`) continue in that block.
struct Slot {
  int64_t id, offset, run;
  int pool = 0;
};

struct DecodePositions {
  IndexView table;
  int64_t maxb, bs;
  const int64_t* first = nullptr;  // each row's first attended position (a sliding window), or none: 0
  Slot slot(int64_t row, int64_t entry, int64_t max_run) const {
    const int64_t position = first != nullptr ? first[row] + entry : entry;
    const int64_t off = position % bs;  // position < len <= maxb * bs: the column is < maxb
    return {table[row * maxb + position / bs], off, std::min(bs - off, max_run)};
  }
};

// Prefill: entry e of query token t is position e of its request (the token at position p has p + 1
// entries); runs of consecutive positions share a block, as in decode.
struct PrefillPositions {
  IndexView table;
  int64_t maxb, bs;
  const int64_t* request;  // the request of every query token
  Slot slot(int64_t row, int64_t entry, int64_t max_run) const {
    const int64_t off = entry % bs;  // entry <= p < seq_lens <= maxb * bs: the column is < maxb
    return {table[request[row] * maxb + entry / bs], off, std::min(bs - off, max_run)};
  }
};

struct SparsePositions {
  IndexView table, indices;
  int64_t maxb, bs, width;                // width: entries per token (topk_indices.size(1))
  const int64_t* request;                 // the request of every query token
  Slot slot(int64_t row, int64_t entry, int64_t) const {
    const int64_t position = indices[row * width + entry];  // validated: -1 or < seq_lens <= maxb * bs
    if (position < 0) return {-1, 0, 1};
    return {table[request[row] * maxb + position / bs], position % bs, 1};
  }
};

// The shared-KV op's entries of one query token: its window positions [window_first, window_first +
// window) of its request's kv pool, then `compressed` entries of the compressed pool (all it sees,
// ascending, without an index list; else the first `compressed` entries of its index row).
struct SharedKvToken {
  int64_t request, window_first, window, compressed;
};

struct SharedKvPositions {
  IndexView table, compressed_table, indices;  // indices: none without an index list
  int64_t maxb, bs, maxc, bsc;
  int64_t width;  // entries per index row (topk_indices.size(1)); 0 without an index list
  const SharedKvToken* tokens;
  Slot slot(int64_t row, int64_t entry, int64_t max_run) const {
    const SharedKvToken& token = tokens[row];
    if (entry < token.window) {  // validated: a position < seq_len <= maxb * bs, in a checked block
      const int64_t position = token.window_first + entry, off = position % bs;
      return {table[token.request * maxb + position / bs], off,
              std::min({bs - off, max_run, token.window - entry}), 0};
    }
    entry -= token.window;
    if (width > 0) {
      const int64_t index = indices[row * width + entry];  // validated: -1 or a visible entry
      if (index < 0) return {-1, 0, 1, 1};
      return {compressed_table[token.request * maxc + index / bsc], index % bsc, 1, 1};
    }
    const int64_t off = entry % bsc;  // entry < the visible entries <= maxc * bsc
    return {compressed_table[token.request * maxc + entry / bsc], off, std::min(bsc - off, max_run), 1};
  }
};

struct Unit {
  int64_t row, t0, t1;  // query row, entries [t0, t1)
};

// The paged pools a call reads: pool 0 for every op, and pool 1, the shared-KV op's compressed entries.
// A cached row is its latent part in `key` [NB, bs, 1, L] and its rope part in `value` [NB, bs, 1, R];
// value nullptr: the shared-KV op's rows, read whole as the latent (R = 0).
struct CachePool {
  const at::Tensor* key;
  const at::Tensor* value;
};
struct Pools {
  CachePool pool[2];
  int count;
};

// What a call adds to plain attention: per-head sink logits in the softmax denominator, fp32 [N] (none:
// nullptr), the fp32 weights of Geometry::split_probs, and a factor on the softmax scale per query row and head,
// fp32 [rows, N] (none: nullptr).
struct AttentionExtras {
  const float* sinks = nullptr;
  bool split_probs = false;
  const float* q_scale = nullptr;
};

// An op's optional tensor argument (sinks, q_scale) as the contiguous fp32 values AttentionExtras points at,
// kept alive with the call; nullptr when absent.
class Fp32Values {
 public:
  explicit Fp32Values(const std::optional<at::Tensor>& t)
      : fp32_(t.has_value() ? t->to(at::kFloat).contiguous() : at::Tensor()) {}
  const float* data() const { return fp32_.defined() ? fp32_.const_data_ptr<float>() : nullptr; }

 private:
  at::Tensor fp32_;
};

// Rounds fp32 values to the nearest bf16 (ties to even), kept in fp32.
inline fVec round_to_bf16(const fVec& v) {
  return std::get<0>(at::vec::convert_to_float<at::BFloat16>(at::vec::convert_from_float<at::BFloat16>(v, v)));
}

// A head's running max after a tile whose max score is tile_max. A NaN score (NaN/inf in an
// attended row) makes the head's output NaN, as in the reference.
inline float next_max(float m, float tile_max) { return std::isnan(tile_max) ? tile_max : std::max(m, tile_max); }

// One online-softmax step over a tile of lane-major scores st[t * np + n], t < nt, n < np (heads in
// lanes), with the same arithmetic per head as the head-major step: scales the scores and replaces
// them by their weights exp(s - m_new) against each head's new running max (0 for heads whose
// scores so far are all -inf), and updates the running maxima m and sums l. alpha[n] receives the
// factor head n's accumulator is to be multiplied by; returns whether any accumulated head has one
// other than 1.
inline bool lane_softmax(float* st, int64_t nt, int64_t np, const float* scale, float* m, float* l, float* alpha) {
  constexpr int64_t W = fVec::size();
  for (int64_t v = 0; v < np; v += W) {
    const fVec sv = fVec::loadu(scale + v);  // each head's scale (lanes: heads)
    fVec mx(kNegInf);
    for (int64_t t = 0; t < nt; ++t) {
      float* s = st + t * np + v;
      const fVec x = fVec::loadu(s) * sv;
      x.store(s);
      mx = at::vec::maximum(mx, x);
    }
    mx.store(alpha + v);  // the tile's max, until the loop below
  }
  bool rescale = false;
  for (int64_t n = 0; n < np; ++n) {
    const float m_new = next_max(m[n], alpha[n]);
    if (m_new == kNegInf) {  // nothing to weight yet: m stays -inf, l and the accumulator 0
      alpha[n] = 1.f;
      continue;
    }
    alpha[n] = std::exp(m[n] - m_new);  // 0 on the first weighted tile (m = -inf)
    rescale = rescale || (alpha[n] != 1.f && l[n] != 0.f);
    m[n] = m_new;
  }
  for (int64_t v = 0; v < np; v += W) {
    const fVec mv = fVec::loadu(m + v);
    const fVec live = mv != fVec(kNegInf);  // all-ones lanes where the head has a finite max
    fVec sum(0.f);
    for (int64_t t = 0; t < nt; ++t) {
      float* s = st + t * np + v;
      const fVec e = (fVec::loadu(s) - mv).exp_u20() & live;
      e.store(s);
      sum = sum + e;
    }
    (fVec::loadu(l + v) * fVec::loadu(alpha + v) + sum).store(l + v);
  }
  return rescale;
}

// The shortest slice of work a thread gets (see attention_kernel's split).
constexpr int64_t kMinSliceEntries = 64;
// The shortest piece a slice boundary may cut off a row (see attention_kernel's split); under kMinSliceEntries / 2.
constexpr int64_t kMinPieceEntries = 16;

// Attention of every query row over its `entries[row]` entries (where they are cached: `positions`).
template <typename T, typename Tiles, typename Positions>
void attention_kernel(const at::Tensor& q_latent, const at::Tensor* q_pe, const Geometry& geo, const Pools& pools,
                      const Positions& positions, c10::ArrayRef<int64_t> entries, double softmax_scale,
                      const AttentionExtras& extras, at::Tensor& out) {
  constexpr int64_t kTile = Tiles::kTile;
  using Query = typename Tiles::Query;
  const int64_t B = q_latent.size(0), N = geo.N, L = geo.L, R = geo.R;
  // Each pool's rows as the engines read them: row `offset` of block `id` of pool `k` starts at
  // kc[k] + id * ks0[k] + offset * ks1[k] (latent) and vc[k] + ... (rope; R = 0: just past the latent part,
  // never read, where the AMX engine sees one [L + 0] row).
  const T* kc[2] = {nullptr, nullptr};
  const T* vc[2] = {nullptr, nullptr};
  int64_t NB[2] = {0, 0}, ks0[2] = {0, 0}, ks1[2] = {0, 0}, vs0[2] = {0, 0}, vs1[2] = {0, 0};
  for (int k = 0; k < pools.count; ++k) {
    const at::Tensor& key = *pools.pool[k].key;
    const at::Tensor* value = pools.pool[k].value;
    kc[k] = key.const_data_ptr<T>();
    NB[k] = key.size(0);
    ks0[k] = key.stride(0);
    ks1[k] = key.stride(1);
    vc[k] = value != nullptr ? value->const_data_ptr<T>() : kc[k] + L * key.stride(3);
    vs0[k] = value != nullptr ? value->stride(0) : ks0[k];
    vs1[k] = value != nullptr ? value->stride(1) : ks1[k];
  }
  const float scale = static_cast<float>(softmax_scale);

  // Queries in the engine's input type, contiguous: the inputs themselves where they already are,
  // else converted with the partials below (B*N*(L+R) values: negligible). Without a rope part the
  // rope queries point at the latent ones (R = 0: never read).
  const at::Tensor qlc = q_latent.contiguous(), qpc = q_pe != nullptr ? q_pe->contiguous() : qlc;
  const Query* ql_all;
  const Query* qp_all;

  // Split-K by work, not by row: the rows' entries laid end to end and cut into one equal slice per thread,
  // each slice at least kMinSliceEntries long; a slice holds one unit per row it overlaps (a unit costs its
  // own accumulator transpose and merge, ≈ N * L moves, a few µs at V2-Lite dims, against ≈ 0.5 µs a token on
  // one core). Every thread gets the same number of entries, to within kMinPieceEntries, whatever the
  // lengths: a row is cut only where a slice ends inside it, and a cut that would leave a piece under
  // kMinPieceEntries moves to that row's edge. (Equal pieces per row handed out by count leave threads
  // unequal when lengths differ by a few entries: eight rows of 1045-1051 entries on two threads make 11
  // pieces, 6 on one thread and 5 on the other, one thread doing 5 rows' work while the other does 3.)
  Counts starts(B + 1, 0);  // row b's entries are [starts[b], starts[b + 1]) of the concatenation
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(!__builtin_add_overflow(starts[b], std::max<int64_t>(entries[b], 0), &starts[b + 1]),
                "mla native attention kernels: the attended lengths sum past int64");
  const int64_t total = starts[B];
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t slices = std::clamp<int64_t>(total / kMinSliceEntries, 1, threads);
  const int64_t base = total / slices, longer = total % slices;  // the first `longer` slices get one more
  Counts cuts(slices + 1, total);  // slice s is [cuts[s], cuts[s + 1])
  cuts[0] = 0;
  for (int64_t s = 1, b = 0; s < slices; ++s) {
    int64_t cut = s * base + std::min(s, longer);  // < total: base >= kMinSliceEntries
    while (starts[b + 1] <= cut) ++b;  // the row holding position `cut`
    if (cut - starts[b] < kMinPieceEntries) cut = starts[b];
    else if (starts[b + 1] - cut < kMinPieceEntries) cut = starts[b + 1];
    cuts[s] = cut;  // moved by under kMinPieceEntries < base / 2: the cuts stay ordered
  }
  c10::SmallVector<Unit, 8> units;
  Counts first_unit(B + 1, 0), slice_first(slices + 1, 0);
  int64_t slice = 0;
  for (int64_t b = 0; b < B; ++b) {
    first_unit[b] = static_cast<int64_t>(units.size());
    for (int64_t g = starts[b]; g < starts[b + 1];) {
      while (cuts[slice + 1] <= g) slice_first[++slice] = static_cast<int64_t>(units.size());
      const int64_t e = std::min(starts[b + 1], cuts[slice + 1]);
      units.push_back({b, g - starts[b], e - starts[b]});
      g = e;
    }
  }
  first_unit[B] = static_cast<int64_t>(units.size());
  while (slice < slices) slice_first[++slice] = first_unit[B];
  const int64_t U = first_unit[B];

  // Per unit and head: running max, running sum, unnormalised accumulator [L] (every unit initialises its own
  // part); then the queries as fp32 where the engine wants them and the cache is not (written just below). One
  // allocation.
  constexpr bool kConvertsQueries = !std::is_same_v<T, Query>;
  static_assert(!kConvertsQueries || std::is_same_v<Query, float>, "the engines take their cache dtype or fp32 queries");
  UninitFloats partials(U * N * (L + 2) + (kConvertsQueries ? B * N * (L + R) : 0), Scratch::kPartials);
  float* const acc_all = partials.data();
  float* const m_all = acc_all + U * N * L;
  float* const l_all = m_all + U * N;
  if constexpr (kConvertsQueries) {
    float* const q_converted = l_all + U * N;
    row_to_f32<T>(q_converted, qlc.const_data_ptr<T>(), B * N * L, 1);
    row_to_f32<T>(q_converted + B * N * L, qpc.const_data_ptr<T>(), B * N * R, 1);
    ql_all = q_converted;
    qp_all = q_converted + B * N * L;
  } else {
    ql_all = qlc.const_data_ptr<T>();
    qp_all = qpc.const_data_ptr<T>();
  }

  // Requests the cache lines of entries [t0, t1) of a row (the next tile) while the current one
  // is computed: the blocks are scattered over the pool, so the hardware prefetcher loses the
  // stream at every block boundary.
  const int64_t lat_bytes = L * static_cast<int64_t>(sizeof(T)), pe_bytes = R * static_cast<int64_t>(sizeof(T));
  const bool unit_rows = geo.ks3 == 1 && geo.vs3 == 1;
  auto prefetch_tile = [&](int64_t row, int64_t t0, int64_t t1) {
    if (!unit_rows) return;
    for (int64_t t = t0; t < t1;) {
      const Slot s = positions.slot(row, t, t1 - t);  // a run of one block: one slot lookup
      t += s.run;
      const int k = s.pool;
      if (s.id < 0 || s.id >= NB[k]) continue;
      for (int64_t r = 0; r < s.run; ++r) {
        const char* kp = reinterpret_cast<const char*>(kc[k] + s.id * ks0[k] + (s.offset + r) * ks1[k]);
        const char* vp = reinterpret_cast<const char*>(vc[k] + s.id * vs0[k] + (s.offset + r) * vs1[k]);
        for (int64_t i = 0; i < lat_bytes; i += 64) __builtin_prefetch(kp + i, 0, 3);
        for (int64_t i = 0; i < pe_bytes; i += 64) __builtin_prefetch(vp + i, 0, 3);
      }
    }
  };

  at::parallel_for(0, slices, 1, [&](int64_t s_begin, int64_t s_end) {
    Tiles tiles(geo);
    constexpr int64_t W = fVec::size();
    const int64_t NP = (N + W - 1) / W * W;  // heads padded to whole vectors (the lane engines' layout)
    // scores [NP, kTile], probs [N, kTile] and the lane engines' running max, sum and rescale factor per
    // head [NP] each: every one written before it is read, so one uninitialised block
    UninitFloats buffers(NP * kTile + N * kTile + 4 * NP, Scratch::kScores);
    float* const scores = buffers.data();
    float* const probs = scores + NP * kTile;
    float* const m_lanes = probs + N * kTile;
    float* const l_lanes = m_lanes + NP;
    float* const alpha = l_lanes + NP;
    float* const head_scale = alpha + NP;  // the unit's scale per head: softmax_scale (* q_scale[row, n])
    for (int64_t u = slice_first[s_begin]; u < slice_first[s_end]; ++u) {
      const Unit unit = units[u];
      for (int64_t n = 0; n < NP; ++n)
        head_scale[n] = n < N && extras.q_scale != nullptr ? scale * extras.q_scale[unit.row * N + n] : scale;
      float* acc = acc_all + u * N * L;
      float* m = m_all + u * N;
      float* l = l_all + u * N;
      const Query* qlb = ql_all + unit.row * N * L;
      const Query* qpb = qp_all + unit.row * N * R;
      int64_t t = unit.t0;
      // Stages the next tile: up to kTile entries from t on, a run of one block at a time; an entry
      // whose block id is out of range (-1 in an index list; a bad table entry never gets here:
      // the lengths and ids were validated) is skipped, never read. Returns the staged count and, for the engines that
      // read rows in place, prefetches the tile after.
      auto stage_tile = [&]() {
        int64_t nt = 0;
        while (nt < kTile && t < unit.t1) {
          const Slot s = positions.slot(unit.row, t, std::min(unit.t1 - t, kTile - nt));
          const int k = s.pool;
          if (s.id >= 0 && s.id < NB[k]) {
            const T* kp = kc[k] + s.id * ks0[k] + s.offset * ks1[k];
            const T* vp = vc[k] + s.id * vs0[k] + s.offset * vs1[k];
            for (int64_t i = 0; i < s.run; ++i) tiles.stage(nt + i, kp + i * ks1[k], vp + i * vs1[k]);
            nt += s.run;
          }
          t += s.run;
        }
        if (Tiles::kPrefetchesRows && nt > 0) prefetch_tile(unit.row, t, std::min(unit.t1, t + kTile));
        return nt;
      };
      if constexpr (Tiles::kHeadsInLanes) {
        const int64_t np = tiles.lanes();
        tiles.begin(unit.row, qlb, qpb);
        std::fill_n(m_lanes, NP, kNegInf);
        std::fill_n(l_lanes, NP, 0.f);
        while (t < unit.t1) {
          const int64_t nt = stage_tile();
          if (nt == 0) continue;
          tiles.scores(nt, scores);
          if (lane_softmax(scores, nt, np, head_scale, m_lanes, l_lanes, alpha)) tiles.rescale(alpha);
          tiles.accumulate(scores, nt);
        }
        tiles.finish(acc);
        std::copy_n(m_lanes, N, m);
        std::copy_n(l_lanes, N, l);
      } else {
        std::fill(acc, acc + N * L, 0.f);
        std::fill(m, m + N, kNegInf);
        std::fill(l, l + N, 0.f);
        while (t < unit.t1) {
          const int64_t nt = stage_tile();
          if (nt == 0) continue;
          tiles.scores(qlb, qpb, nt, scores);
          // Online softmax, one update per tile and head.
          for (int64_t n = 0; n < N; ++n) {
            float* sc = scores + n * kTile;
            float* pr = probs + n * kTile;
            // Padding past nt is -inf for the max, set after the scale (a negative one would make it +inf); the
            // probabilities there are set to 0 below.
            const fVec sv(head_scale[n]);
            for (int64_t i = 0; i < kTile; i += W) (fVec::loadu(sc + i) * sv).store(sc + i);
            std::fill(sc + nt, sc + kTile, kNegInf);
            fVec vmax(kNegInf);
            for (int64_t i = 0; i < kTile; i += W) vmax = at::vec::maximum(vmax, fVec::loadu(sc + i));
            const float tile_max =
                at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, vmax);
            const float m_new = next_max(m[n], tile_max);
            if (m_new == kNegInf) {  // every score so far is -inf: nothing to weight yet
              std::fill(pr, pr + kTile, 0.f);
              continue;
            }
            const fVec mv(m_new);
            fVec vsum(0.f);
            for (int64_t i = 0; i < kTile; i += W) {
              fVec e = (fVec::loadu(sc + i) - mv).exp_u20();
              if constexpr (Tiles::kRoundsProbs) {
                if (!geo.split_probs) e = round_to_bf16(e);
              }
              if (i + W > nt) e = fVec::set(fVec(0.f), e, std::max<int64_t>(0, nt - i));
              e.store(pr + i);
              vsum = vsum + e;
            }
            const float sum = hsum(vsum);
            const float alpha_n = std::exp(m[n] - m_new);  // 0 on the first tile (m = -inf)
            if (alpha_n != 1.f && l[n] != 0.f) {
              float* o = acc + n * L;
              const fVec a(alpha_n);
              int64_t d = 0;
              for (; d + W <= L; d += W) (fVec::loadu(o + d) * a).store(o + d);
              for (; d < L; ++d) o[d] *= alpha_n;
            }
            l[n] = l[n] * alpha_n + sum;
            m[n] = m_new;
          }
          tiles.accumulate(probs, nt, acc);
        }
      }
    }
  });

  // Merge the units of every (row, head) and write the output dtype; rows without any attended
  // entry (length 0, nothing listed, or every block skipped) get zeros, heads with a NaN or +inf score NaN.
  // A sink s (extras.sinks) joins the denominator: with M = max(the scores' max, s), each unit's terms are
  // weighted exp(m_u - M) and exp(s - M) is added to the denominator (without sinks s = -inf adds 0).
  T* o = out.data_ptr<T>();
  at::parallel_for(0, B * N, 16, [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> merged;  // the general merge's sums, allocated by the first row that needs them
    constexpr int64_t W = fVec::size();
    for (int64_t bn = begin; bn < end; ++bn) {
      const int64_t b = bn / N, n = bn % N;
      const float sink = extras.sinks != nullptr ? extras.sinks[n] : kNegInf;
      T* dst = o + bn * L;
      if (first_unit[b + 1] - first_unit[b] == 1) {
        // One unit with weights (l > 0), a finite max and a finite sink or none: the general merge below gives it
        // weight w = exp(m - M) and denominator w * l + exp(s - M), and its sum adds the unit to zeros, so the
        // output is (acc + 0) * (w / (w * l + exp(s - M))) (without a sink: (acc + 0) * (1 / l)), computed here
        // without the merge buffer; every other case (a NaN or infinite max or sink, nothing weighted) takes the
        // general path.
        const int64_t u = first_unit[b];
        const float lu = l_all[u * N + n], mu = m_all[u * N + n];
        if (lu > 0.f && std::isfinite(mu) && (sink == kNegInf || std::isfinite(sink))) {
          const float* src = acc_all + (u * N + n) * L;
          const float top = std::max(mu, sink), w = std::exp(mu - top);
          const float inv = w / (w * lu + std::exp(sink - top));
          const fVec iv(inv), zero(0.f);
          int64_t d = 0;
          for (; d + W <= L; d += W) store_from_f32<T>(dst + d, (fVec::loadu(src + d) + zero) * iv);
          for (; d < L; ++d) dst[d] = from_f32<T>((src[d] + 0.f) * inv);
          continue;
        }
      }
      // A NaN or +inf score in any unit (a NaN running max or sum) makes the head's output NaN, as the
      // reference's softmax does; units with nothing weighted (sum 0) take no part.
      // A NaN or +inf sink makes it NaN too (exp(s - M) is then NaN).
      float mx = kNegInf;
      bool not_a_number = std::isnan(sink) || sink == std::numeric_limits<float>::infinity();
      for (int64_t u = first_unit[b]; u < first_unit[b + 1]; ++u) {
        const float lu = l_all[u * N + n], mu = m_all[u * N + n];
        not_a_number = not_a_number || std::isnan(lu) || std::isnan(mu);
        if (lu > 0.f) mx = std::max(mx, mu);
      }
      if (not_a_number) {
        std::fill_n(dst, L, from_f32<T>(std::numeric_limits<float>::quiet_NaN()));
        continue;
      }
      if (!merged) merged.reset(new float[L]);
      std::fill_n(merged.get(), L, 0.f);
      float denom = 0.f;
      if (mx != kNegInf) {
        const float top = std::max(mx, sink);
        for (int64_t u = first_unit[b]; u < first_unit[b + 1]; ++u) {
          const float lu = l_all[u * N + n];
          if (!(lu > 0.f)) continue;
          const float w = std::exp(m_all[u * N + n] - top);
          denom += w * lu;
          const float* src = acc_all + (u * N + n) * L;
          const fVec wv(w);
          int64_t d = 0;
          for (; d + W <= L; d += W)
            at::vec::fmadd(wv, fVec::loadu(src + d), fVec::loadu(merged.get() + d)).store(merged.get() + d);
          for (; d < L; ++d) merged[d] += w * src[d];
        }
        denom += std::exp(sink - top);  // 0 without a sink
      }
      const float inv = denom > 0.f ? 1.f / denom : 0.f;
      const fVec iv(inv);
      int64_t d = 0;
      for (; d + W <= L; d += W) store_from_f32<T>(dst + d, fVec::loadu(merged.get() + d) * iv);
      for (; d < L; ++d) dst[d] = from_f32<T>(merged[d] * inv);
    }
  });
}

// The tile engine serving a call: the first that can, in the order fastest first.
enum class Engine { kAmx, kBf16Dot, kF32 };

Engine choose_engine(at::ScalarType dtype, const Geometry& geo) {
  if (dtype == at::kBFloat16) {
#if defined(MLA_AMX)
    if (AmxTiles::serves(geo)) return Engine::kAmx;
#endif
#if defined(MLA_BF16_DOT)
    if (Bf16DotTiles::serves(geo)) return Engine::kBf16Dot;
#endif
  }
  return Engine::kF32;
}

Geometry geometry_of(const at::Tensor& q_latent, const at::Tensor& key_cache, const at::Tensor& value_cache) {
  return {q_latent.size(1), q_latent.size(2), value_cache.size(3), key_cache.stride(3), value_cache.stride(3)};
}

// The output of one attention call: the dtype dispatch and the tile engine. q_pe nullptr: no rope part
// (R = 0, the shared-KV op, whose pools have no value tensor).
// Query rows [first, ..) of a call as rows 0, 1, .. (a group of rows run on its own; `attend`).
template <typename Positions>
struct RowsFrom {
  const Positions& positions;
  int64_t first;
  Slot slot(int64_t row, int64_t entry, int64_t max_run) const { return positions.slot(first + row, entry, max_run); }
};

// The fp32 partial results a group of rows may hold at once: a unit's are N * (L + 2) floats, and a row
// has at least one unit, so a long prefill of many heads (DeepSeek-V4: 64 x 512 floats a row) runs in
// groups of rows rather than holding [T, N, L] fp32 partials (8.6 GB for 64k tokens).
constexpr int64_t kGroupPartialFloats = int64_t{1} << 24;  // 64 MiB

template <typename Positions>
at::Tensor attend(const at::Tensor& q_latent, const at::Tensor* q_pe, const Pools& pools, const Positions& positions,
                  c10::ArrayRef<int64_t> entries, double softmax_scale, const AttentionExtras& extras = {}) {
  at::Tensor out = new_cpu_tensor(q_latent.sizes(), q_latent.scalar_type());
  if (q_latent.size(0) == 0 || out.numel() == 0) return out;
  const at::Tensor& key = *pools.pool[0].key;
  const at::Tensor* value = pools.pool[0].value;
  Geometry geo{q_latent.size(1), q_latent.size(2), q_pe != nullptr ? q_pe->size(2) : 0, key.stride(3),
               value != nullptr ? value->stride(3) : 1};
  geo.split_probs = extras.split_probs;
  [[maybe_unused]] const Engine engine = choose_engine(q_latent.scalar_type(), geo);
  // rows [0, rows) of q and out with where their entries are cached
  auto run = [&](const at::Tensor& q_rows, const at::Tensor* q_pe_rows, const auto& rows_positions,
                 c10::ArrayRef<int64_t> rows_entries, const AttentionExtras& rows_extras, at::Tensor& out_rows) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q_latent.scalar_type(), "mla_attention", [&] {
      if constexpr (std::is_same_v<scalar_t, double>) {
        TORCH_CHECK(false, "mla native attention kernels: float64 is served by the reference kernel");
      } else {
        if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
#if defined(MLA_AMX)
          if (engine == Engine::kAmx) {
            attention_kernel<scalar_t, AmxTiles>(q_rows, q_pe_rows, geo, pools, rows_positions, rows_entries,
                                                 softmax_scale, rows_extras, out_rows);
            return;
          }
#endif
#if defined(MLA_BF16_DOT)
          if (engine == Engine::kBf16Dot) {
            attention_kernel<scalar_t, Bf16DotTiles>(q_rows, q_pe_rows, geo, pools, rows_positions, rows_entries,
                                                     softmax_scale, rows_extras, out_rows);
            return;
          }
#endif
        }
        attention_kernel<scalar_t, F32Engine<scalar_t>>(q_rows, q_pe_rows, geo, pools, rows_positions, rows_entries,
                                                       softmax_scale, rows_extras, out_rows);
      }
    });
  };
  const int64_t rows = q_latent.size(0);
  const int64_t group = std::max<int64_t>(1, kGroupPartialFloats / (geo.N * (geo.L + 2)));
  if (rows <= group) {
    run(q_latent, q_pe, positions, entries, extras, out);
    return out;
  }
  for (int64_t first = 0; first < rows; first += group) {
    const int64_t count = std::min(group, rows - first);
    const at::Tensor q_rows = q_latent.narrow(0, first, count);
    const at::Tensor q_pe_rows = q_pe != nullptr ? q_pe->narrow(0, first, count) : at::Tensor();
    at::Tensor out_rows = out.narrow(0, first, count);  // contiguous rows of out
    AttentionExtras rows_extras = extras;  // (the group's rows of the per-row scales)
    if (extras.q_scale != nullptr) rows_extras.q_scale = extras.q_scale + first * geo.N;
    run(q_rows, q_pe != nullptr ? &q_pe_rows : nullptr, RowsFrom<Positions>{positions, first},
        entries.slice(first, count), rows_extras, out_rows);
  }
  return out;
}

// The request of every query token, after the Python check_index_values (ValueError, the same
// message): every index of request b's tokens is -1 (none) or a position in [0, seq_lens[b]).
Counts check_index_values(const IndexView& indices, int64_t num_tokens, int64_t width, const SparseRequests& requests) {
  Counts request(num_tokens, 0);
  for (size_t b = 0; b < requests.size(); ++b)
    for (int64_t i = 0; i < requests[b].num_queries; ++i) request[requests[b].first_token + i] = b;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t limit = requests[request[t]].seq_len;
    for (int64_t k = 0; k < width; ++k) {
      const int64_t v = indices[t * width + k];
      TORCH_CHECK_VALUE(v >= -1 && v < limit, "mla.sparse_mla_attention: topk_indices[", t, ", ", k, "] = ", v,
                        " is not a position of request ", request[t], " (its ", limit,
                        " cached tokens) nor -1 (none)");
    }
  }
  return request;
}

constexpr std::string_view kSharedKv = "shared_kv_attention";

// mla_ops/ops/shared_kv_attention.py: _check_read_block_ids. Every block id row b of `table` [B, maxb] reads
// (columns[b].first <= j < columns[b].second) lies in [0, num_blocks); the first bad one row-major raises.
void check_read_block_ids(std::string_view name, const IndexView& table, int64_t maxb,
                          c10::ArrayRef<std::pair<int64_t, int64_t>> columns, int64_t num_blocks) {
  for (size_t b = 0; b < columns.size(); ++b) {
    for (int64_t j = columns[b].first; j < columns[b].second; ++j) {
      const int64_t id = table[b * maxb + j];
      TORCH_CHECK_VALUE(id >= 0 && id < num_blocks, prefix(kSharedKv), name, "[", b, ", ", j, "] = ", id,
                        " is used by sequence ", b, " but is not a block id in [0, ", num_blocks, ")");
    }
  }
}

// mla_ops/ops/shared_kv_attention.py: check_shared_kv_values, the same checks in the same order with the same
// messages (ValueError); every length is checked before it is used in a product, and the differences below
// cannot wrap (0 <= q_b <= n, 1 <= W). Returns each query token's entries (SharedKvToken).
c10::SmallVector<SharedKvToken, 4> check_shared_kv_values(
    int64_t num_tokens, const at::Tensor& kv_cache, const IndexView& table, int64_t maxb, const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc, int64_t window_size, const at::Tensor* compressed_cache,
    const IndexView& compressed_table, int64_t maxc, int64_t ratio, const at::Tensor* topk_indices) {
  const at::Tensor lens_t = seq_lens.contiguous(), starts_t = query_start_loc.contiguous();
  const IndexView lens(lens_t), starts(starts_t);
  const int64_t B = lens_t.size(0), bs = kv_cache.size(1);
  TORCH_CHECK_VALUE(starts[0] == 0, prefix(kSharedKv), "query_start_loc must start at 0, got query_start_loc[0] = ",
                    starts[0]);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(starts[b + 1] >= starts[b], prefix(kSharedKv),
                      "query_start_loc must never decrease, but query_start_loc[", b + 1, "] = ", starts[b + 1],
                      " < query_start_loc[", b, "] = ", starts[b]);
  }
  TORCH_CHECK_VALUE(starts[B] == num_tokens, prefix(kSharedKv), "query_start_loc[-1] = ", starts[B],
                    " must equal the number of query tokens (", num_tokens, ")");
  // 128 bits: a table's capacity must not wrap into an accepted length
  const __int128 capacity = static_cast<__int128>(maxb) * bs;
  const int64_t bsc = compressed_cache != nullptr ? compressed_cache->size(1) : 1;
  const __int128 entry_capacity = static_cast<__int128>(maxc) * bsc;
  SparseRequests requests(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = lens[b];
    // from 0, never decreasing, ending at num_tokens: every entry is in [0, num_tokens], no overflow
    const int64_t q_len = starts[b + 1] - starts[b];
    TORCH_CHECK_VALUE(n >= q_len, prefix(kSharedKv), "seq_lens[", b, "] = ", n, " is less than the request's ", q_len,
                      " query tokens; seq_lens counts the cached tokens including the new ones (write them first)");
    TORCH_CHECK_VALUE(n <= capacity, prefix(kSharedKv), "seq_lens[", b, "] = ", n, " needs ", n,
                      " cached tokens, more than the block table's capacity (", maxb, " blocks x ", bs, ")");
    if (compressed_cache != nullptr) {
      TORCH_CHECK_VALUE(n / ratio <= entry_capacity, prefix(kSharedKv), "seq_lens[", b, "] = ", n, " needs ",
                        n / ratio, " compressed entries (seq_lens // compress_ratio ", ratio,
                        "), more than compressed_block_tables' capacity (", maxc, " blocks x ", bsc, ")");
    }
    requests[b] = {starts[b], q_len, n, n / ratio};
  }
  // the window rows read: from the first query token's window start to the last token
  c10::SmallVector<std::pair<int64_t, int64_t>, 4> columns(B, {0, 0});
  for (int64_t b = 0; b < B; ++b) {
    const SparseRequest& r = requests[b];
    if (r.num_queries > 0)
      columns[b] = {std::max<int64_t>(0, r.seq_len - r.num_queries - window_size + 1) / bs,
                    r.seq_len / bs + (r.seq_len % bs != 0)};
  }
  check_read_block_ids("block_tables", table, maxb, columns, kv_cache.size(0));

  c10::SmallVector<SharedKvToken, 4> tokens(num_tokens);
  for (int64_t b = 0; b < B; ++b) {
    const SparseRequest& r = requests[b];
    for (int64_t i = 0; i < r.num_queries; ++i) {
      const int64_t p = r.seq_len - r.num_queries + i;
      const int64_t first = std::max<int64_t>(0, p - window_size + 1);
      tokens[r.first_token + i] = {b, first, p - first + 1, 0};
    }
  }
  if (compressed_cache == nullptr) return tokens;
  const int64_t NBc = compressed_cache->size(0);
  if (topk_indices == nullptr) {  // every entry visible to the request's last token: w < seq_lens // m
    for (int64_t b = 0; b < B; ++b) {
      const SparseRequest& r = requests[b];
      columns[b] = {0, r.num_queries > 0 ? r.entries / bsc + (r.entries % bsc != 0) : 0};
    }
    check_read_block_ids("compressed_block_tables", compressed_table, maxc, columns, NBc);
    for (SharedKvToken& token : tokens) token.compressed = (token.window_first + token.window) / ratio;
    return tokens;
  }
  // _check_listed_entries: every listed index -1 or an entry its token sees, then the blocks of the listed ones
  const int64_t width = topk_indices->size(1);
  for (SharedKvToken& token : tokens) token.compressed = width;
  if (num_tokens == 0 || width == 0) return tokens;
  const at::Tensor indices_t = topk_indices->contiguous();
  const IndexView indices(indices_t);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const SharedKvToken& token = tokens[t];
    const int64_t position = token.window_first + token.window - 1, visible = (position + 1) / ratio;
    for (int64_t k = 0; k < width; ++k) {
      const int64_t v = indices[t * width + k];
      TORCH_CHECK_VALUE(v >= -1 && v < visible, prefix(kSharedKv), "topk_indices[", t, ", ", k, "] = ", v,
                        " is neither -1 (none) nor a compressed entry token ", t, " sees (request ", token.request,
                        ", position ", position, ": the entries w < (position + 1) // compress_ratio = ", visible,
                        ")");
    }
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t b = tokens[t].request;
    for (int64_t k = 0; k < width; ++k) {
      const int64_t w = indices[t * width + k];
      if (w < 0) continue;
      const int64_t j = w / bsc;  // w < visible <= seq_lens // m <= the compressed capacity: j < maxc
      const int64_t id = compressed_table[b * maxc + j];
      TORCH_CHECK_VALUE(id >= 0 && id < NBc, prefix(kSharedKv), "compressed_block_tables[", b, ", ", j, "] = ", id,
                        " is used by sequence ", b, " (topk_indices[", t, ", ", k, "] = ", w,
                        ") but is not a block id in [0, ", NBc, ")");
    }
  }
  return tokens;
}

}  // namespace

std::string attention_engine(const at::Tensor& q_latent, const at::Tensor& key_cache, const at::Tensor& value_cache) {
  switch (choose_engine(q_latent.scalar_type(), geometry_of(q_latent, key_cache, value_cache))) {
    case Engine::kAmx:
      return "amx";
    case Engine::kBf16Dot:
      return "avx512_bf16";
    case Engine::kF32:
      break;
  }
  return "fp32";
}

at::Tensor mla_decode_attention(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, double softmax_scale,
                                const std::optional<at::Tensor>& sinks, int64_t sliding_window,
                                const std::optional<at::Tensor>& q_scale) {
  const int64_t B = q_latent.size(0);
  const int64_t NB = key_cache.size(0), bs = key_cache.size(1);
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens_t = seq_lens.contiguous();
  const Counts lens =
      attended_lengths(IndexView(lens_t), IndexView(tables), B, tables.size(1), NB, bs, sliding_window);
  const Pools pools{{{&key_cache, &value_cache}}, 1};
  const Fp32Values sink_logits(sinks), row_scale(q_scale);
  AttentionExtras extras;
  extras.sinks = sink_logits.data();
  extras.q_scale = row_scale.data();
  if (sliding_window == 0) {
    return attend(q_latent, &q_pe, pools, DecodePositions{IndexView(tables), tables.size(1), bs}, lens,
                  softmax_scale, extras);
  }
  Counts first(B), entries(B);
  for (int64_t b = 0; b < B; ++b) {
    first[b] = window_start(lens[b], sliding_window);
    entries[b] = lens[b] - first[b];
  }
  return attend(q_latent, &q_pe, pools, DecodePositions{IndexView(tables), tables.size(1), bs, first.data()}, entries,
                softmax_scale, extras);
}

at::Tensor sparse_mla_attention(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                const at::Tensor& topk_indices, double softmax_scale,
                                const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& q_scale) {
  const int64_t T = q_latent.size(0), NB = key_cache.size(0), bs = key_cache.size(1);
  const at::Tensor tables = block_tables.contiguous(), indices_t = topk_indices.contiguous();
  const SparseRequests requests =
      check_request_values("sparse_mla_attention", T, tables, seq_lens, query_start_loc, NB, bs);
  const int64_t width = indices_t.size(1);
  const IndexView indices(indices_t);
  const Counts request = check_index_values(indices, T, width, requests);
  const SparsePositions positions{IndexView(tables), indices, tables.size(1), bs, width, request.data()};
  const Pools pools{{{&key_cache, &value_cache}}, 1};
  const Fp32Values sink_logits(sinks), row_scale(q_scale);
  AttentionExtras extras;
  extras.sinks = sink_logits.data();
  extras.q_scale = row_scale.data();
  return attend(q_latent, &q_pe, pools, positions, Counts(T, width), softmax_scale, extras);
}

at::Tensor mla_prefill_attention(const at::Tensor& q_latent, const at::Tensor& q_pe, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, const at::Tensor& block_tables,
                                 const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double softmax_scale) {
  const int64_t T = q_latent.size(0), NB = key_cache.size(0), bs = key_cache.size(1);
  const at::Tensor tables = block_tables.contiguous();
  const SparseRequests requests =
      check_request_values("mla_prefill_attention", T, tables, seq_lens, query_start_loc, NB, bs);
  // token i of a request's q_b sits at position seq_len - q_b + i and attends its positions 0 .. that one
  Counts request(T, 0), entries(T, 0);
  for (size_t b = 0; b < requests.size(); ++b) {
    const SparseRequest& r = requests[b];
    for (int64_t i = 0; i < r.num_queries; ++i) {
      request[r.first_token + i] = static_cast<int64_t>(b);
      entries[r.first_token + i] = r.seq_len - r.num_queries + i + 1;  // 0 <= q_b <= seq_len: no overflow
    }
  }
  const PrefillPositions positions{IndexView(tables), tables.size(1), bs, request.data()};
  const Pools pools{{{&key_cache, &value_cache}}, 1};
  return attend(q_latent, &q_pe, pools, positions, entries, softmax_scale);
}

at::Tensor shared_kv_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                               const std::optional<at::Tensor>& sinks, double softmax_scale, int64_t sliding_window,
                               const std::optional<at::Tensor>& compressed_cache,
                               const std::optional<at::Tensor>& compressed_block_tables, int64_t compress_ratio,
                               const std::optional<at::Tensor>& topk_indices) {
  const at::Tensor tables = block_tables.contiguous();
  const bool compressed = compressed_cache.has_value();
  const at::Tensor compressed_tables = compressed ? compressed_block_tables->contiguous() : at::Tensor();
  const IndexView compressed_table = compressed ? IndexView(compressed_tables) : IndexView();
  const int64_t maxc = compressed ? compressed_tables.size(1) : 0;
  const at::Tensor* listed = compressed && topk_indices.has_value() ? &*topk_indices : nullptr;
  const at::Tensor indices_t = listed != nullptr ? listed->contiguous() : at::Tensor();
  const auto tokens = check_shared_kv_values(q.size(0), kv_cache, IndexView(tables), tables.size(1), seq_lens,
                                             query_start_loc, sliding_window, compressed ? &*compressed_cache : nullptr,
                                             compressed_table, maxc, compress_ratio, listed);
  Counts entries(tokens.size());
  for (size_t t = 0; t < tokens.size(); ++t) entries[t] = tokens[t].window + tokens[t].compressed;
  const int64_t width = listed != nullptr ? indices_t.size(1) : 0;
  const SharedKvPositions positions{IndexView(tables), compressed_table,
                                    listed != nullptr ? IndexView(indices_t) : IndexView(),
                                    tables.size(1), kv_cache.size(1), maxc,
                                    compressed ? compressed_cache->size(1) : 1, width, tokens.data()};
  Pools pools{{{&kv_cache, nullptr}}, 1};
  if (compressed) pools = Pools{{{&kv_cache, nullptr}, {&*compressed_cache, nullptr}}, 2};
  const Fp32Values sink_logits(sinks);
  AttentionExtras extras;
  extras.sinks = sink_logits.data();
  extras.split_probs = true;  // fp32 weights: the op rounds once
  return attend(q, nullptr, pools, positions, entries, softmax_scale, extras);
}

}  // namespace CPU_CAPABILITY
}  // namespace mla_native

MLA_REGISTER_ISA_KERNEL(mla_decode_attention)
MLA_REGISTER_ISA_KERNEL(sparse_mla_attention)
MLA_REGISTER_ISA_KERNEL(mla_prefill_attention)
MLA_REGISTER_ISA_KERNEL(shared_kv_attention)
MLA_REGISTER_ISA_KERNEL(attention_engine)
