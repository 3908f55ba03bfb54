// mla.lightning_indexer on CPU: the top-k cached entries of every query token.
//
//   score[t, j] = sum_h weights[t, h] * relu(softmax_scale * q[t, h] . k[j])    (fp32, j < (p_t + 1) // m)
//
// With compress_ratio m = 1 the cache holds one key per token and j runs over positions 0..p_t; with
// m > 1 it holds one entry per m tokens (DeepSeek-V4's compressed indexer keys) and the token at
// position p sees the entries whose m tokens are all at or before p.
//
// Scoring is a GEMM of query rows (tokens x heads) against cached keys. Work items are (a tile of
// up to kTileTokens query tokens of one request, a chunk of its context): a decode step (one token)
// splits its context over every core, and in a prefill each key row is read and converted to fp32
// once per tile, then scored against all of the tile's tokens x heads with the register-blocked
// fp32 micro-kernel of the attention kernels (score_blocks.h). The head reduction (scale, relu,
// weights) runs on a key tile's dot products while they are in L1 and writes each token's score
// row into a buffer of the call, which holds groups of tokens at a time to bound its size.
//
// On CPUs where oneDNN runs AMX tiles, bf16 keys are scored on AMX instead (AmxKeyScores, amx.h):
// S^T[keys, tokens x heads] = keys . Q^T per tile of 32 keys, the keys read in place when they are
// consecutive rows of a block, then the head reduction per key with lanes over the heads.
//
// Top-k: a token's scores become 64-bit keys (the score's bits mapped so that unsigned order is
// descending score, NaN above every number and -0 equal to +0; then the position) whose ascending
// order is exactly the op's order: descending score, equal scores by ascending position (the
// reference's stable sort). std::nth_element selects the first k keys, std::sort orders them.
//
// Only entries 0..(p_t + 1) // m - 1 of a token's own request are read, all inside validated blocks.
#include "amx.h"
#include "../checks.h"
#include "kernels.h"
#include "score_blocks.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace mla_native {
inline namespace CPU_CAPABILITY {

// mla_ops/ops/sparse_attention.py: check_request_values
SparseRequests check_request_values(std::string_view op, int64_t num_tokens, const at::Tensor& block_tables,
                                    const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t num_blocks,
                                    int64_t block_size, int64_t compress_ratio) {
  const at::Tensor tables_t = block_tables.contiguous(), lens_t = seq_lens.contiguous();
  const at::Tensor starts_t = query_start_loc.contiguous();
  const IndexView table(tables_t), lens(lens_t), starts(starts_t);
  const int64_t B = lens_t.size(0), columns = tables_t.size(1);
  TORCH_CHECK_VALUE(starts[0] == 0, prefix(op), "query_start_loc must start at 0, got query_start_loc[0] = ",
                    starts[0]);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(starts[b + 1] >= starts[b], prefix(op), "query_start_loc must never decrease, but query_start_loc[",
                      b + 1, "] = ", starts[b + 1], " < query_start_loc[", b, "] = ", starts[b]);
  }
  TORCH_CHECK_VALUE(starts[B] == num_tokens, prefix(op), "query_start_loc[-1] = ", starts[B],
                    " must equal the number of query tokens (", num_tokens, ")");
  // 128 bits: the table's capacity must not wrap into an accepted length
  const __int128 capacity = static_cast<__int128>(columns) * block_size;
  SparseRequests requests(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = lens[b];
    // from 0, never decreasing, ending at num_tokens: every entry is in [0, num_tokens], no overflow
    const int64_t q_len = starts[b + 1] - starts[b];
    TORCH_CHECK_VALUE(n >= q_len, prefix(op), "seq_lens[", b, "] = ", n, " is less than the request's ", q_len,
                      " query tokens; seq_lens counts the cached tokens including the new ones (write them first)");
    // n >= q_len >= 0: C++ division is Python's floor division here
    const int64_t entries = n / compress_ratio;
    if (entries > capacity) {
      const std::string held = compress_ratio == 1 ? std::string("tokens")
                                                   : "entries (seq_lens // compress_ratio " +
                                                         std::to_string(compress_ratio) + ")";
      TORCH_CHECK_VALUE(false, prefix(op), "seq_lens[", b, "] = ", n, " needs ", entries, " cached ", held,
                        ", more than the block table's capacity (", columns, " blocks x ", block_size, ")");
    }
    requests[b] = {starts[b], q_len, n, entries};
  }
  // mla_ops/ops/_paged.py: check_used_block_ids (the first bad id a request uses, row-major)
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = requests[b].entries;  // in [0, capacity]: the used columns are < columns
    const int64_t used = n / block_size + (n % block_size != 0);
    for (int64_t j = 0; j < used; ++j) {
      const int64_t id = table[b * columns + j];
      TORCH_CHECK_VALUE(id >= 0 && id < num_blocks, prefix(op), "block_tables[", b, ", ", j, "] = ", id,
                        " is used by sequence ", b, " but is not a block id in [0, ", num_blocks, ")");
    }
  }
  return requests;
}

namespace {

constexpr int64_t kTileTokens = 4;    // query tokens that share every key row read
constexpr int64_t kKeyTile = 16;      // keys converted and scored together (their dots stay in L1)
constexpr int64_t kKeyChunk = 512;    // keys of one work item
constexpr int64_t kGroupScores = int64_t{1} << 24;  // score-buffer floats per group of tokens (64 MiB)
static_assert(kKeyTile % kScoreTokens == 0, "key tiles are whole score blocks");

// Query tokens [first, first + count) of request `request`, the first at position `first_position`,
// over entries of `ratio` tokens each: token tt of the tile sees entries [0, seen(tt)), the tile
// [0, width()).
struct TokenTile {
  int64_t first, count, request, first_position, ratio;
  int64_t seen(int64_t tt) const { return (first_position + tt + 1) / ratio; }
  int64_t width() const { return seen(count - 1); }
};

struct WorkItem {
  int64_t tile, j0, j1;  // keys [j0, j1) of tile `tile`
};

// Ascending order of the keys = the op's order of (score, position).
inline uint64_t order_key(float score, int64_t position) {
  uint32_t descending = 0;  // NaN: before every number
  if (!std::isnan(score)) {
    if (score == 0.f) score = 0.f;  // -0 ties with +0, as the reference's comparisons say
    uint32_t bits;
    std::memcpy(&bits, &score, sizeof bits);
    const uint32_t ascending = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    descending = ~ascending;
  }
  return (static_cast<uint64_t>(descending) << 32) | static_cast<uint32_t>(position);
}

#if defined(MLA_AMX)
// The dot products of a work item's query rows (tokens x heads, contiguous [rows, D] bf16) with
// tiles of up to kKeys keys on AMX tiles (one per thread; releases the tile state at the end).
// Rows are padded to a multiple of 16 (a tile's columns) with zero queries, keys to a multiple of 16
// (a tile's rows) with zero keys: few kernel shapes for oneDNN to compile.
class AmxKeyScores {
 public:
  static constexpr int64_t kKeys = 32;

  AmxKeyScores(int64_t max_rows, int64_t D)
      : D_(D), q_(D * round16(max_rows)), keys_(kKeys * D), dots_(kKeys * round16(max_rows)) {}
  ~AmxKeyScores() { at::native::cpublas::brgemm_release(); }
  AmxKeyScores(const AmxKeyScores&) = delete;
  AmxKeyScores& operator=(const AmxKeyScores&) = delete;

  void set_queries(const at::BFloat16* q, int64_t rows) {
    ld_ = round16(rows);
    std::fill(q_.begin(), q_.begin() + D_ * ld_, at::BFloat16(0.f));
    pack_transposed_vnni(q, rows, D_, D_, ld_, q_.data());
  }

  // dots[i * ld() + r] = key[i] . query row r, i < nk <= kKeys.
  const float* dots(const at::BFloat16* const* keys, int64_t nk) {
    const int64_t M = round16(nk);
    const std::ptrdiff_t step = nk == M ? equal_row_step(keys, nk, D_) : 0;
    const at::BFloat16* a = keys[0];
    if (step == 0) {
      for (int64_t i = 0; i < nk; ++i) std::memcpy(keys_.data() + i * D_, keys[i], D_ * sizeof(at::BFloat16));
      std::fill(keys_.data() + nk * D_, keys_.data() + M * D_, at::BFloat16(0.f));
      a = keys_.data();
    }
    at::native::cpublas::brgemm(M, ld_, D_, step == 0 ? D_ : step, ld_, ld_, false, a, q_.data(), dots_.data());
    return dots_.data();
  }
  int64_t ld() const { return ld_; }

 private:
  static int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }
  int64_t D_, ld_ = 0;
  std::vector<at::BFloat16> q_, keys_;
  std::vector<float> dots_;
};
#endif  // MLA_AMX

template <typename T>
void indexer_kernel(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& k_cache, const IndexView& table,
                    int64_t maxb, const SparseRequests& requests, int64_t topk, float scale, int64_t ratio,
                    int32_t* out) {
  constexpr int64_t W = fVec::size();
  static_assert(kKeyTile % W == 0, "a key tile is whole vectors");
  constexpr bool kQueriesInPlace = std::is_same_v<T, float>;
  const int64_t H = q.size(1), D = q.size(2), bs = k_cache.size(1);
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks3 = k_cache.stride(3);
  const bool keys_in_place = std::is_same_v<T, float> && ks3 == 1;
  const T* kc = k_cache.const_data_ptr<T>();
  const T* qd = q.const_data_ptr<T>();               // contiguous [T, H, D]
  const float* w = weights.const_data_ptr<float>();  // contiguous fp32 [T, H]
#if defined(MLA_AMX)
  const bool use_amx = std::is_same_v<T, at::BFloat16> && ks3 == 1 && D % 32 == 0 && amx_engine_enabled();
#endif

  std::vector<TokenTile> tiles;
  for (int64_t b = 0; b < static_cast<int64_t>(requests.size()); ++b) {
    const SparseRequest& r = requests[b];
    for (int64_t i = 0; i < r.num_queries; i += kTileTokens)
      tiles.push_back(
          {r.first_token + i, std::min(kTileTokens, r.num_queries - i), b, r.seq_len - r.num_queries + i, ratio});
  }

  std::vector<float> scores;
  for (size_t g0 = 0; g0 < tiles.size();) {
    // A group of tiles whose score rows fit the buffer (at least one tile).
    std::vector<int64_t> offset;  // of each tile's [count, width] scores in the buffer
    int64_t floats = 0;
    size_t g1 = g0;
    while (g1 < tiles.size() && (g1 == g0 || floats + tiles[g1].count * tiles[g1].width() <= kGroupScores)) {
      offset.push_back(floats);
      floats += tiles[g1].count * tiles[g1].width();
      ++g1;
    }
    scores.resize(floats);
    std::vector<WorkItem> items;
    for (size_t g = g0; g < g1; ++g)
      for (int64_t j0 = 0; j0 < tiles[g].width(); j0 += kKeyChunk)
        items.push_back({static_cast<int64_t>(g), j0, std::min(tiles[g].width(), j0 + kKeyChunk)});

    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> q32(kQueriesInPlace ? 0 : kTileTokens * H * D), keys32(kKeyTile * D), zeros(D, 0.f);
      std::vector<float> dots(kTileTokens * H * kKeyTile);
      std::vector<const float*> qrows(kTileTokens * H);
      const float* krows[kKeyTile];
      const fVec sv(scale), zero(0.f);
#if defined(MLA_AMX)
      std::optional<AmxKeyScores> amx;
      // score[t][j] = sum_h w[t][h] * relu(scale * dots[j][t * H + h]) for the item's keys.
      auto score_keys_on_amx = [&](AmxKeyScores& engine, const TokenTile& tile, const WorkItem& item,
                                   float* tile_scores) {
        const at::BFloat16* keys[AmxKeyScores::kKeys];
        const int64_t width = tile.width();
        for (int64_t j = item.j0; j < item.j1; j += AmxKeyScores::kKeys) {
          const int64_t nk = std::min(AmxKeyScores::kKeys, item.j1 - j);
          for (int64_t i = 0; i < nk; ++i) {
            const int64_t entry = j + i;  // < the request's entries <= maxb * bs, in a validated block
            const int64_t id = table[tile.request * maxb + entry / bs];
            keys[i] = reinterpret_cast<const at::BFloat16*>(kc) + id * ks0 + (entry % bs) * ks1;
          }
          const float* dots = engine.dots(keys, nk);
          const int64_t ld = engine.ld();
          for (int64_t tt = 0; tt < tile.count; ++tt) {
            const float* wt = w + (tile.first + tt) * H;
            for (int64_t i = 0; i < nk; ++i) {
              const float* row = dots + i * ld + tt * H;
              fVec acc(0.f);
              int64_t h = 0;
              // at::vec::maximum propagates NaN, as torch.relu does
              for (; h + W <= H; h += W)
                acc = at::vec::fmadd(fVec::loadu(wt + h), at::vec::maximum(fVec::loadu(row + h) * sv, zero), acc);
              float score = hsum(acc);
              for (; h < H; ++h) {
                const float x = row[h] * scale;
                score += wt[h] * (x < 0.f ? 0.f : x);  // NaN stays NaN
              }
              tile_scores[tt * width + j + i] = score;
            }
          }
        }
      };
#endif
      for (int64_t it = begin; it < end; ++it) {
        const WorkItem item = items[it];
        const TokenTile& tile = tiles[item.tile];
        const int64_t rows = tile.count * H, width = tile.width();
#if defined(MLA_AMX)
        if constexpr (std::is_same_v<T, at::BFloat16>) {
          if (use_amx) {
            if (!amx) amx.emplace(kTileTokens * H, D);
            amx->set_queries(qd + tile.first * H * D, rows);
            score_keys_on_amx(*amx, tile, item, scores.data() + offset[item.tile - g0]);
            continue;
          }
        }
#endif
        for (int64_t r = 0; r < rows; ++r) {
          const T* src = qd + (tile.first * H + r) * D;
          if constexpr (kQueriesInPlace) {
            qrows[r] = src;
          } else {
            row_to_f32<T>(q32.data() + r * D, src, D, 1);
            qrows[r] = q32.data() + r * D;
          }
        }
        float* tile_scores = scores.data() + offset[item.tile - g0];
        for (int64_t j = item.j0; j < item.j1; j += kKeyTile) {
          const int64_t nk = std::min(kKeyTile, item.j1 - j);
          for (int64_t i = 0; i < nk; ++i) {
            const int64_t entry = j + i;  // < the request's entries <= maxb * bs, in a validated block
            const int64_t id = table[tile.request * maxb + entry / bs];
            const T* src = kc + id * ks0 + (entry % bs) * ks1;
            if (keys_in_place) {
              krows[i] = reinterpret_cast<const float*>(src);
            } else {
              row_to_f32<T>(keys32.data() + i * D, src, D, ks3);
              krows[i] = keys32.data() + i * D;
            }
          }
          const int64_t padded = (nk + kScoreTokens - 1) / kScoreTokens * kScoreTokens;
          for (int64_t i = nk; i < padded; ++i) krows[i] = zeros.data();
          std::fill(dots.begin(), dots.begin() + rows * kKeyTile, 0.f);
          // one part only (R = 0): the query rows against the keys
          int64_t r = 0;
          for (; r + kScoreHeads <= rows; r += kScoreHeads)
            for (int64_t k = 0; k < padded; k += kScoreTokens)
              f32_score_block<kScoreHeads, kScoreTokens>(qrows.data() + r, krows + k, D, qrows.data() + r, krows + k,
                                                         0, dots.data() + r * kKeyTile + k, kKeyTile);
          for (; r < rows; ++r)
            for (int64_t k = 0; k < padded; k += kScoreTokens)
              f32_score_block<1, kScoreTokens>(qrows.data() + r, krows + k, D, qrows.data() + r, krows + k, 0,
                                               dots.data() + r * kKeyTile + k, kKeyTile);
          for (int64_t tt = 0; tt < tile.count; ++tt) {
            fVec acc[kKeyTile / W];
            for (auto& a : acc) a = fVec(0.f);
            const float* wt = w + (tile.first + tt) * H;
            for (int64_t h = 0; h < H; ++h) {
              const fVec wv(wt[h]);
              const float* row = dots.data() + (tt * H + h) * kKeyTile;
              // at::vec::maximum propagates NaN, as torch.relu does
              for (int64_t c = 0; c < kKeyTile / W; ++c)
                acc[c] = at::vec::fmadd(wv, at::vec::maximum(fVec::loadu(row + c * W) * sv, zero), acc[c]);
            }
            float tile_row[kKeyTile];
            for (int64_t c = 0; c < kKeyTile / W; ++c) acc[c].store(tile_row + c * W);
            std::copy(tile_row, tile_row + nk, tile_scores + tt * width + j);
          }
        }
      }
    });

    // Top-k of every token of the group.
    std::vector<std::pair<int64_t, int64_t>> tokens;  // (tile, token of the tile)
    for (size_t g = g0; g < g1; ++g)
      for (int64_t tt = 0; tt < tiles[g].count; ++tt) tokens.emplace_back(static_cast<int64_t>(g), tt);
    at::parallel_for(0, static_cast<int64_t>(tokens.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<uint64_t> keys;
      for (int64_t i = begin; i < end; ++i) {
        const auto [g, tt] = tokens[i];
        const TokenTile& tile = tiles[g];
        const int64_t seen = tile.seen(tt);  // entries 0 .. (p + 1) // m - 1 (positions 0..p for m = 1)
        const float* row = scores.data() + offset[g - g0] + tt * tile.width();
        keys.resize(seen);
        for (int64_t j = 0; j < seen; ++j) keys[j] = order_key(row[j], j);
        const int64_t k = std::min(topk, seen);
        if (k < seen) std::nth_element(keys.begin(), keys.begin() + k, keys.end());
        std::sort(keys.begin(), keys.begin() + k);
        int32_t* dst = out + (tile.first + tt) * topk;
        for (int64_t j = 0; j < k; ++j) dst[j] = static_cast<int32_t>(keys[j] & 0xffffffffu);
      }
    });
    g0 = g1;
  }
}

}  // namespace

at::Tensor lightning_indexer(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& k_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, int64_t topk, double softmax_scale,
                             int64_t compress_ratio) {
  const int64_t T = q.size(0);
  const at::Tensor tables = block_tables.contiguous();
  const SparseRequests requests = check_request_values("lightning_indexer", T, tables, seq_lens, query_start_loc,
                                                       k_cache.size(0), k_cache.size(1), compress_ratio);
  for (const SparseRequest& r : requests) {
    // the order keys and the int32 output hold entry indices in 32 bits
    TORCH_CHECK(r.entries <= std::numeric_limits<int32_t>::max(), prefix("lightning_indexer"),
                "the native kernel indexes at most 2**31 - 1 cached entries per request, got ", r.entries);
  }
  at::Tensor out = new_cpu_tensor({T, topk}, at::kInt);
  int32_t* o = out.data_ptr<int32_t>();
  std::fill(o, o + out.numel(), -1);
  if (T == 0) return out;
  const at::Tensor qc = q.contiguous(), w32 = weights.to(at::kFloat).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "lightning_indexer", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "mla native lightning_indexer: float64 is served by the reference kernel");
    } else {
      indexer_kernel<scalar_t>(qc, w32, k_cache, IndexView(tables), tables.size(1), requests, topk,
                               static_cast<float>(softmax_scale), compress_ratio, o);
    }
  });
  return out;
}

}  // namespace CPU_CAPABILITY
}  // namespace mla_native

MLA_REGISTER_ISA_KERNEL(lightning_indexer)
