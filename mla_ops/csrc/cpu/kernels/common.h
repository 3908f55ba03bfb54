// Shared helpers of the kernel files (compiled once per ISA, isa.h): ATen's vec headers pick their
// implementation from the CPU_CAPABILITY macros and put it in the inline namespace `CPU_CAPABILITY`; the
// helpers here live there too, so each ISA build of a kernel gets its own copy.
#pragma once

#include "../isa.h"

// Narrow ATen headers (not ATen/ATen.h): the kernel files are compiled once per ISA, and the full
// header set roughly doubles the build time.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <cstring>
#include <tuple>

namespace mla_native {
inline namespace CPU_CAPABILITY {

using fVec = at::vec::Vectorized<float>;

// Keep a loaded vector in a register. Without this GCC folds the same load into every FMA that uses
// it (a memory operand per FMA): in the score kernel that is 10 loads per 8 FMAs instead of 6, and
// Zen-class cores issue one 512-bit (two 256-bit) loads per cycle, so the loop becomes load-bound.
#if defined(__GNUC__) && defined(CPU_CAPABILITY_AVX512)
inline void pin(fVec& v) {
  __m512 r = v;
  asm("" : "+v"(r));
  v = fVec(r);
}
#elif defined(__GNUC__) && defined(CPU_CAPABILITY_AVX2)
inline void pin(fVec& v) {
  __m256 r = v;
  asm("" : "+x"(r));
  v = fVec(r);
}
#else
inline void pin(fVec&) {}
#endif

// A new contiguous CPU tensor from ATen's CPU allocator directly: what at::empty returns on CPU, without
// its trip through the dispatcher (≈ 1.5k instructions an allocation by callgrind, against ≈ 8k for the
// whole of a one-token decode kernel's own work). The kernels here write every element of what they
// allocate this way.
inline at::Tensor new_cpu_tensor(at::IntArrayRef sizes, at::ScalarType dtype) {
  return at::Tensor(at::detail::empty_cpu(sizes, dtype));
}

// A tensor over `base`'s memory with other sizes and strides (offset in elements of base's dtype): what
// `view` / `t` / `as_strided` give, built here without their trips through the dispatcher (≈ 2k
// instructions each by callgrind, more than a one-token GEMM's own setup). Not an autograd view: for
// operands of ATen calls inside a kernel only.
inline at::Tensor alias_with_geometry(const at::Tensor& base, at::IntArrayRef sizes, at::IntArrayRef strides,
                                      int64_t storage_offset) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(), base.dtype());
  impl->set_sizes_and_strides(sizes, strides, storage_offset);
  return at::Tensor(std::move(impl));
}

// One contiguous tensor of a kernel's scratch (`scratch_tensors`).
struct ScratchPart {
  c10::SmallVector<int64_t, 4> sizes;
  at::ScalarType dtype;
};

// Contiguous tensors of the given shapes and dtypes carved out of one CPU allocation, each part 64-byte
// aligned: a kernel's intermediates for the cost of one allocation. The parts share one storage, so
// none of them may be an op's output (outputs must not alias).
inline c10::SmallVector<at::Tensor, 6> scratch_tensors(std::initializer_list<ScratchPart> parts) {
  constexpr int64_t kAlign = 64;
  c10::SmallVector<int64_t, 6> offsets;
  int64_t bytes = 0;
  for (const auto& part : parts) {
    offsets.push_back(bytes);
    // overflow-checked: the sizes come from the op's inputs, and a wrapped product would allocate too little
    int64_t part_bytes = static_cast<int64_t>(c10::elementSize(part.dtype));
    bool overflow = false;
    for (int64_t size : part.sizes) overflow |= __builtin_mul_overflow(part_bytes, size, &part_bytes);
    overflow |= __builtin_add_overflow(part_bytes, kAlign - 1, &part_bytes);
    overflow |= __builtin_add_overflow(bytes, part_bytes / kAlign * kAlign, &bytes);
    TORCH_CHECK(!overflow, "mla native kernels: a scratch tensor of ", part.sizes, " elements does not fit in memory");
  }
  const at::Tensor buffer = new_cpu_tensor({bytes}, at::kByte);
  c10::SmallVector<at::Tensor, 6> tensors;
  size_t i = 0;
  for (const auto& part : parts) {
    auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(buffer.storage()), buffer.key_set(),
                                                     c10::scalarTypeToTypeMeta(part.dtype));
    impl->set_sizes_contiguous(part.sizes);
    impl->set_storage_offset(offsets[i++] / static_cast<int64_t>(c10::elementSize(part.dtype)));
    tensors.emplace_back(std::move(impl));
  }
  return tensors;
}

// Load fVec::size() consecutive elements of T as fp32 (exact widening for bf16/fp16).
template <typename T>
inline fVec load_f32(const T* p) {
  fVec out;
  at::vec::load_to_float<T>(p, out);
  return out;
}
template <>
inline fVec load_f32<float>(const float* p) {
  return fVec::loadu(p);
}

// Store fVec::size() fp32 values as T, rounding to nearest even like c10's scalar conversion.
template <typename T>
inline void store_from_f32(T* p, const fVec& v) {
  at::vec::convert_from_float<T>(v, v).store(p, fVec::size());
}
template <>
inline void store_from_f32<float>(float* p, const fVec& v) {
  v.store(p);
}

// Scalar conversions (tails): exactly what ATen's scalar paths do.
template <typename T>
inline float to_f32(T v) {
  return static_cast<float>(v);
}
template <typename T>
inline T from_f32(float v) {
  return static_cast<T>(v);
}

// One element of an int32/int64 index tensor (the Python side accepts both); default-constructed: no
// tensor (an absent optional one), never read.
struct IndexView {
  const int32_t* p32 = nullptr;
  const int64_t* p64 = nullptr;
  IndexView() = default;
  explicit IndexView(const at::Tensor& t) {
    if (t.scalar_type() == at::kInt) {
      p32 = t.data_ptr<int32_t>();
    } else {
      p64 = t.data_ptr<int64_t>();
    }
  }
  inline int64_t operator[](int64_t i) const { return p32 ? static_cast<int64_t>(p32[i]) : p64[i]; }
};

// Copy `count` elements of `elem` bytes from a strided source to a strided destination
// (strides in elements). Used only when a row is not one contiguous run.
inline void copy_strided_elems(char* dst, int64_t dst_stride, const char* src, int64_t src_stride,
                               int64_t count, int64_t elem) {
  for (int64_t i = 0; i < count; ++i) {
    std::memcpy(dst + i * dst_stride * elem, src + i * src_stride * elem, elem);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace mla_native
