// mla.gather_pa_kv_cache / mla.scatter_pa_kv_cache / mla.scatter_pa_cache on CPU.
//
// Caches are [num_blocks, block_size, heads, dim] with any strides (e.g. pool[..., :512].unsqueeze(2)
// of a vLLM-style [NB, bs, 576] pool): element (blk, off, h, d) lives at
// blk*s0 + off*s1 + h*s2 + d*s3. Token tensors are [T, heads, dim], any strides.
//
// Copies are byte moves (no arithmetic, any dtype). A token row (heads*dim elements) is one memcpy
// when it is contiguous on both sides; a run of tokens that is contiguous on both sides (a whole
// block of a dense cache into dense rows) is one memcpy of the run. Work is split over blocks
// (gather) or tokens (scatter) with at::parallel_for; small calls run inline on the caller.
//
// All index values are validated before the first byte is written; an invalid value raises the
// ValueError of the Python value checks (same order, same message) and writes nothing. The checks
// use 128-bit arithmetic where int64 values are added or multiplied: a length or offset near 2**63
// must be refused, never wrap into an accepted value.
#include "../checks.h"
#include "common.h"
#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <vector>

namespace mla_native {
inline namespace CPU_CAPABILITY {
namespace {

// Where the rows of one [*, heads, dim] tensor live: strides in bytes of the token (or slot) step,
// whether a row is a single contiguous run, and the row size.
struct RowLayout {
  char* base;
  int64_t heads, dim, elem;
  int64_t s_h, s_d;  // element strides of heads and dim
  bool row_contiguous;
  int64_t row_bytes;
};

RowLayout row_layout(const at::Tensor& t, int64_t head_dim_index) {
  RowLayout r;
  r.base = static_cast<char*>(const_cast<void*>(t.const_data_ptr()));
  r.heads = t.size(head_dim_index);
  r.dim = t.size(head_dim_index + 1);
  r.elem = t.element_size();
  r.s_h = t.stride(head_dim_index);
  r.s_d = t.stride(head_dim_index + 1);
  r.row_contiguous = (r.dim <= 1 || r.s_d == 1) && (r.heads <= 1 || r.s_h == r.dim);
  r.row_bytes = r.heads * r.dim * r.elem;
  return r;
}

// Calls that move more than this many bytes use non-temporal (streaming) stores on x86: the data
// cannot stay in the last-level cache anyway, and streaming skips the read-for-ownership of every
// destination line (a third of the memory traffic of a plain copy).
constexpr int64_t kStreamBytes = int64_t{24} << 20;

// Move n bytes: memcpy, or with `stream` vector loads + non-temporal stores (x86 builds; byte moves
// through vector registers are bit-exact, NaN payloads included).
inline void copy_bytes(char* dst, const char* src, int64_t n, bool stream) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#if defined(CPU_CAPABILITY_AVX512)
  using V = __m512i;
  constexpr int64_t kV = 64;
  auto load = [](const char* p) { return _mm512_loadu_si512(reinterpret_cast<const void*>(p)); };
  auto stream_store = [](char* p, V v) { _mm512_stream_si512(reinterpret_cast<V*>(p), v); };
#else
  using V = __m256i;
  constexpr int64_t kV = 32;
  auto load = [](const char* p) { return _mm256_loadu_si256(reinterpret_cast<const V*>(p)); };
  auto stream_store = [](char* p, V v) { _mm256_stream_si256(reinterpret_cast<V*>(p), v); };
#endif
  if (!stream) {
    std::memcpy(dst, src, n);
    return;
  }
  {  // streaming stores need aligned addresses: plain moves up to the first boundary
    const int64_t head = std::min<int64_t>(n, (kV - static_cast<int64_t>(reinterpret_cast<uintptr_t>(dst) % kV)) % kV);
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= kV; n -= kV, dst += kV, src += kV) stream_store(dst, load(src));
  }
  if (n > 0) std::memcpy(dst, src, n);
#else
  (void)stream;
  std::memcpy(dst, src, n);
#endif
}

// Orders a task's streaming stores before the parallel region ends (they are weakly ordered).
inline void stream_fence(bool stream) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if (stream) _mm_sfence();
#else
  (void)stream;
#endif
}

// Copy `count` consecutive token rows. dst/src point at the first row; *_step are the byte strides
// between consecutive rows.
inline void copy_rows(char* dst, int64_t dst_step, const RowLayout& dl, const char* src, int64_t src_step,
                      const RowLayout& sl, int64_t count, bool stream) {
  if (count <= 0 || dl.row_bytes == 0) return;
  if (dl.row_contiguous && sl.row_contiguous) {
    if (dst_step == dl.row_bytes && src_step == sl.row_bytes) {
      copy_bytes(dst, src, count * dl.row_bytes, stream);  // one run: rows back to back on both sides
      return;
    }
    for (int64_t i = 0; i < count; ++i) copy_bytes(dst + i * dst_step, src + i * src_step, dl.row_bytes, stream);
    return;
  }
  const int64_t el = dl.elem;
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t h = 0; h < dl.heads; ++h) {
      copy_strided_elems(dst + i * dst_step + h * dl.s_h * el, dl.s_d, src + i * src_step + h * sl.s_h * el, sl.s_d,
                         dl.dim, el);
    }
  }
}

// Grain (in work items) so that one parallel task moves at least ~256 KiB: below that, waking the
// other threads costs more than it saves.
inline int64_t grain_for(int64_t bytes_per_item) {
  return std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, bytes_per_item));
}

// gather_pa_kv_cache's work (the functional twin's too: its value errors name the in-place op, as the
// reference's functional twin, which calls the in-place op on its clones, does).
void gather_rows(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_tables,
                 const at::Tensor& seq_lens, const at::Tensor& key, const at::Tensor& value,
                 const std::optional<at::Tensor>& seq_offset, bool is_seq_lens_cumsum) {
  constexpr std::string_view op = "gather_pa_kv_cache";
  const int64_t NB = key_cache.size(0), bs = key_cache.size(1);
  const at::Tensor tables = block_tables.contiguous(), lens_t = seq_lens.contiguous();
  const int64_t Q = tables.size(0), columns = tables.size(1);
  const IndexView table(tables), lens_v(lens_t);
  std::optional<at::Tensor> offs_t;
  if (seq_offset.has_value()) offs_t = seq_offset->contiguous();

  // Validate everything first, in the order of the Python check_gather_values.
  std::vector<int64_t> starts(Q), lens(Q), first_col(Q, 0), first_block(Q + 1, 0);
  if (is_seq_lens_cumsum) {
    TORCH_CHECK_VALUE(lens_t.numel() == 0 || lens_v[0] == 0, prefix(op),
                      "cumulative seq_lens must start at 0, got seq_lens[0] = ", lens_v[0],
                      "; prepend a 0 or pass per-sequence lengths with is_seq_lens_cumsum=False");
    for (int64_t q = 0; q < Q; ++q) {
      TORCH_CHECK_VALUE(lens_v[q + 1] >= lens_v[q], prefix(op), "cumulative seq_lens must never decrease, but seq_lens[",
                        q + 1, "] = ", lens_v[q + 1], " < seq_lens[", q, "] = ", lens_v[q]);
    }
    // from 0 and non-decreasing: every entry is >= 0, so the differences cannot overflow
    for (int64_t q = 0; q < Q; ++q) {
      starts[q] = lens_v[q];
      lens[q] = lens_v[q + 1] - lens_v[q];
    }
  } else {
    for (int64_t q = 0; q < Q; ++q) {
      lens[q] = lens_v[q];
      TORCH_CHECK_VALUE(lens[q] >= 0, prefix(op), "seq_lens[", q, "] = ", lens[q], " is negative; lengths must be >= 0");
    }
  }
  if (offs_t.has_value()) {
    const IndexView offs(*offs_t);
    for (int64_t q = 0; q < Q; ++q) {
      TORCH_CHECK_VALUE(offs[q] >= 0, prefix(op), "seq_offset[", q, "] = ", offs[q],
                        " is negative; offsets must be >= 0");
    }
    for (int64_t q = 0; q < Q; ++q) {
      TORCH_CHECK_VALUE(offs[q] % bs == 0, prefix(op), "seq_offset[", q, "] = ", offs[q],
                        " is not a multiple of block_size ", bs, "; offsets select whole block-table columns");
      first_col[q] = offs[q] / bs;
    }
    for (int64_t q = 0; q < Q; ++q) {
      TORCH_CHECK_VALUE(first_col[q] <= columns, prefix(op), "seq_offset[", q, "] = ", offs[q],
                        " starts at block-table column ", first_col[q], " but block_tables has only ", columns,
                        " columns; offsets count tokens into a sequence's own table row (at most ", columns,
                        " x block_size ", bs, ")");
    }
  }
  __int128 total = 0;
  for (int64_t q = 0; q < Q; ++q) {
    // ceil(len / bs) without len + bs - 1 (which overflows for a length near 2**63)
    const int64_t blocks = lens[q] / bs + (lens[q] % bs != 0);
    if (blocks > columns - first_col[q]) {
      const __int128 room = static_cast<__int128>(columns - first_col[q]) * bs;
      TORCH_CHECK_VALUE(false, prefix(op), "sequence ", q, " needs block-table columns ", first_col[q], "..",
                        py_int(static_cast<__int128>(first_col[q]) + blocks - 1), " (", lens[q],
                        " tokens from seq_offset ", offs_t.has_value() ? IndexView(*offs_t)[q] : 0,
                        ") but block_tables has only ", columns, " columns; seq_lens may hold at most ", py_int(room),
                        " tokens for it");
    }
    if (!is_seq_lens_cumsum) starts[q] = static_cast<int64_t>(std::min<__int128>(total, INT64_MAX));
    total += lens[q];
  }
  TORCH_CHECK_VALUE(total <= key.size(0), prefix(op), "the sequences hold ", py_int(total),
                    " tokens but key/value have only ", key.size(0), " rows; allocate outputs of at least ",
                    py_int(total), " rows (mla_ops.gather_pa_kv_cache does this)");
  for (int64_t q = 0; q < Q; ++q) {
    const int64_t blocks = lens[q] / bs + (lens[q] % bs != 0);
    for (int64_t j = first_col[q]; j < first_col[q] + blocks; ++j) {
      const int64_t id = table[q * columns + j];
      TORCH_CHECK_VALUE(id >= 0 && id < NB, prefix(op), "block_tables[", q, ", ", j, "] = ", id,
                        " is used by sequence ", q, " but is not a block id in [0, ", NB, ")");
    }
    first_block[q + 1] = first_block[q] + blocks;
  }
  const int64_t num_blocks_used = first_block[Q];
  if (total == 0) return;

  const RowLayout kc = row_layout(key_cache, 2), vc = row_layout(value_cache, 2);
  const RowLayout ko = row_layout(key, 1), vo = row_layout(value, 1);
  const int64_t kc_s0 = key_cache.stride(0) * kc.elem, kc_s1 = key_cache.stride(1) * kc.elem;
  const int64_t vc_s0 = value_cache.stride(0) * vc.elem, vc_s1 = value_cache.stride(1) * vc.elem;
  const int64_t ko_s0 = key.stride(0) * ko.elem, vo_s0 = value.stride(0) * vo.elem;
  const int64_t grain = grain_for(bs * (kc.row_bytes + vc.row_bytes));
  const bool stream = total * (kc.row_bytes + vc.row_bytes) >= kStreamBytes;
  // Token rows that are single runs on both sides but not back to back (a split pool) are copied
  // token by token, key then value; whole dense blocks keep the one-run copies of copy_rows.
  const bool interleave = kc.row_contiguous && vc.row_contiguous && ko.row_contiguous && vo.row_contiguous &&
                          !(kc_s1 == kc.row_bytes && ko_s0 == ko.row_bytes);
  at::parallel_for(0, num_blocks_used, grain, [&](int64_t begin, int64_t end) {
    // The sequence owning block `begin`; later blocks advance it.
    int64_t q = std::upper_bound(first_block.begin(), first_block.end(), begin) - first_block.begin() - 1;
    for (int64_t i = begin; i < end; ++i) {
      while (i >= first_block[q + 1]) ++q;
      const int64_t j = i - first_block[q];
      const int64_t id = table[q * columns + first_col[q] + j];
      const int64_t count = std::min(bs, lens[q] - j * bs);
      const int64_t row = starts[q] + j * bs;
      if (i + 1 < end) {  // the next block is elsewhere in the pool: start fetching its first lines
        int64_t qn = q;
        while (i + 1 >= first_block[qn + 1]) ++qn;
        const int64_t next = table[qn * columns + first_col[qn] + (i + 1 - first_block[qn])];
        __builtin_prefetch(kc.base + next * kc_s0);
        __builtin_prefetch(vc.base + next * vc_s0);
      }
      if (interleave) {
        // key and value rows of one token are neighbours in the pool (split views of one
        // [NB, bs, L+R] cache): copy them together so the block is read once, in address order
        for (int64_t t = 0; t < count; ++t) {
          copy_bytes(ko.base + (row + t) * ko_s0, kc.base + id * kc_s0 + t * kc_s1, kc.row_bytes, stream);
          copy_bytes(vo.base + (row + t) * vo_s0, vc.base + id * vc_s0 + t * vc_s1, vc.row_bytes, stream);
        }
      } else {
        copy_rows(ko.base + row * ko_s0, ko_s0, ko, kc.base + id * kc_s0, kc_s1, kc, count, stream);
        copy_rows(vo.base + row * vo_s0, vo_s0, vo, vc.base + id * vc_s0, vc_s1, vc, count, stream);
      }
    }
    stream_fence(stream);
  });
}


// Rows of key (and of value, when present: a cache pair) into their caches at slot_mapping's slots:
// scatter_pa_kv_cache and its one-pool twin scatter_pa_cache (`op` names the op in the messages).
void scatter_rows(std::string_view op, const at::Tensor& key, const at::Tensor* value, const at::Tensor& key_cache,
                  const at::Tensor* value_cache, const at::Tensor& slot_mapping) {
  const int64_t NB = key_cache.size(0), bs = key_cache.size(1);
  // the caches are writable (no stride-0 dim), so their slot count fits in memory, hence in int64
  const int64_t num_slots = NB * bs;
  const at::Tensor slots_t = slot_mapping.contiguous();
  const IndexView slots(slots_t);
  const int64_t T = key.size(0);
  for (int64_t i = 0; i < T; ++i) {  // negative = padding, skipped
    TORCH_CHECK_VALUE(slots[i] < num_slots, prefix(op), "slot_mapping[", i, "] = ", slots[i],
                      " is outside the cache (num_blocks * block_size = ", num_slots,
                      " slots); use a negative slot for padding");
  }
  if (T == 0) return;

  const bool pair = value != nullptr;
  const RowLayout kc = row_layout(key_cache, 2), ki = row_layout(key, 1);
  const int64_t kc_s0 = key_cache.stride(0) * kc.elem, kc_s1 = key_cache.stride(1) * kc.elem;
  const int64_t ki_s0 = key.stride(0) * ki.elem;
  // the value side of a pair (unused for one pool)
  const RowLayout vc = row_layout(pair ? *value_cache : key_cache, 2), vi = row_layout(pair ? *value : key, 1);
  const int64_t vc_s0 = pair ? value_cache->stride(0) * vc.elem : 0, vc_s1 = pair ? value_cache->stride(1) * vc.elem : 0;
  const int64_t vi_s0 = pair ? value->stride(0) * vi.elem : 0;
  const int64_t token_bytes = kc.row_bytes + (pair ? vc.row_bytes : 0);
  const int64_t grain = grain_for(token_bytes);
  const bool stream = T * token_bytes >= kStreamBytes;
  const bool interleave = pair && kc.row_contiguous && vc.row_contiguous && ki.row_contiguous && vi.row_contiguous &&
                          !(kc_s1 == kc.row_bytes && ki_s0 == ki.row_bytes);
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end;) {
      const int64_t s = slots[i];
      if (s < 0) {
        ++i;
        continue;
      }
      // Extend a run of consecutive slots inside one block (a prefill's usual mapping).
      const int64_t blk = s / bs, off = s % bs;
      int64_t n = 1;
      while (i + n < end && off + n < bs && slots[i + n] == s + n) ++n;
      char* kd = kc.base + blk * kc_s0 + off * kc_s1;
      char* vd = vc.base + blk * vc_s0 + off * vc_s1;
      if (interleave) {  // neighbouring key / value rows of a split pool: written together, in order
        for (int64_t t = 0; t < n; ++t) {
          copy_bytes(kd + t * kc_s1, ki.base + (i + t) * ki_s0, kc.row_bytes, stream);
          copy_bytes(vd + t * vc_s1, vi.base + (i + t) * vi_s0, vc.row_bytes, stream);
        }
      } else {
        copy_rows(kd, kc_s1, kc, ki.base + i * ki_s0, ki_s0, ki, n, stream);
        if (pair) copy_rows(vd, vc_s1, vc, vi.base + i * vi_s0, vi_s0, vi, n, stream);
      }
      i += n;
    }
    stream_fence(stream);
  });
}

}  // namespace

// Rows that are a view of memory a cache covers are read in full before anything is written (copied first),
// so what a row holds never depends on which rows were written before it: the contract of every backend.
at::Tensor read_before_writing(const at::Tensor& rows, std::initializer_list<const at::Tensor*> caches) {
  for (const at::Tensor* cache : caches) {
    if (overlaps_memory(rows, *cache)) return rows.clone();
  }
  return rows;
}

void gather_pa_kv_cache(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, const at::Tensor& key, const at::Tensor& value,
                        const std::optional<at::Tensor>& seq_offset, bool is_seq_lens_cumsum) {
  gather_rows(key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset, is_seq_lens_cumsum);
}

namespace {
// t.clone(): a tensor with row-major strides by one memcpy into a tensor from the CPU allocator (clone's
// copy_ is a TensorIterator pass and two dispatcher trips, most of a small gather's cost); any other
// layout (size-1 dims with other strides included: clone keeps them) by clone.
at::Tensor clone_strided(const at::Tensor& t) {
  if (!t.is_contiguous()) return t.clone();
  at::Tensor out = new_cpu_tensor(t.sizes(), t.scalar_type());
  if (out.strides() != t.strides()) return t.clone();
  if (t.numel() > 0) std::memcpy(out.data_ptr(), t.const_data_ptr(), t.nbytes());
  return out;
}
}  // namespace

std::tuple<at::Tensor, at::Tensor> gather_pa_kv_cache_functional(const at::Tensor& key_cache,
                                                                  const at::Tensor& value_cache,
                                                                  const at::Tensor& block_tables,
                                                                  const at::Tensor& seq_lens, const at::Tensor& key,
                                                                  const at::Tensor& value,
                                                                  const std::optional<at::Tensor>& seq_offset,
                                                                  bool is_seq_lens_cumsum) {
  // clones keep key's / value's strides (the fake kernel promises empty_like's layout)
  at::Tensor key_out = clone_strided(key), value_out = clone_strided(value);
  gather_rows(key_cache, value_cache, block_tables, seq_lens, key_out, value_out, seq_offset, is_seq_lens_cumsum);
  return {key_out, value_out};
}

void scatter_pa_kv_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const at::Tensor key_rows = read_before_writing(key, {&key_cache, &value_cache});
  const at::Tensor value_rows = read_before_writing(value, {&key_cache, &value_cache});
  scatter_rows("scatter_pa_kv_cache", key_rows, &value_rows, key_cache, &value_cache, slot_mapping);
}

void scatter_pa_cache(const at::Tensor& key, const at::Tensor& cache, const at::Tensor& slot_mapping) {
  scatter_rows("scatter_pa_cache", read_before_writing(key, {&cache}), nullptr, cache, nullptr, slot_mapping);
}

}  // namespace CPU_CAPABILITY
}  // namespace mla_native

MLA_REGISTER_ISA_KERNEL(gather_pa_kv_cache)
MLA_REGISTER_ISA_KERNEL(gather_pa_kv_cache_functional)
MLA_REGISTER_ISA_KERNEL(scatter_pa_kv_cache)
MLA_REGISTER_ISA_KERNEL(scatter_pa_cache)
