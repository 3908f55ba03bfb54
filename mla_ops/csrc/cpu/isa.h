// The instruction sets the native kernels are compiled for, and how a call reaches the right build.
//
// setup.py compiles every source of kernels/ once per ISA of the platform (x86-64: DEFAULT, AVX2 and
// AVX512; elsewhere DEFAULT, which is NEON on aarch64) with -DCPU_CAPABILITY=<ISA>, and links them
// all into the one extension, `mla_ops._C`; ATen's vec headers and our kernels put their code in the
// inline namespace CPU_CAPABILITY, so the builds never share a symbol. The sources outside kernels/
// (argument checks, reasons, registration) are compiled once. This is ATen's own scheme
// (aten/src/ATen/native/DispatchStub.h in pytorch/pytorch): each kernel file fills its slot of every
// kernel it defines by constant initialisation — an address the loader writes, no code run at load,
// so nothing compiled for AVX-512 runs on a CPU without it — and the once-compiled caller picks the
// slot of the ISA chosen at run time (`kernel_isa`, isa.cpp).
//
// A kernel is declared once, in kernels/kernels.h: MLA_ISA_KERNEL(name, signature); its file defines
// `name` inside `namespace mla_native { inline namespace CPU_CAPABILITY { ... } }` and ends with
// MLA_REGISTER_ISA_KERNEL(name).
#pragma once

#include <array>
#include <string_view>

#if defined(__x86_64__) || defined(_M_X64)
#define MLA_NATIVE_X86 1
#else
#define MLA_NATIVE_X86 0
#endif

#ifndef CPU_CAPABILITY
#error "compile with -DCPU_CAPABILITY=<AVX512|AVX2|DEFAULT> (setup.py does)"
#endif

namespace mla_native {

enum class Isa : int { kDefault = 0, kAvx2 = 1, kAvx512 = 2 };
constexpr int kNumIsas = 3;
constexpr std::array<std::string_view, kNumIsas> kIsaNames = {"default", "avx2", "avx512"};

// The ISA of the translation unit being compiled.
#if defined(CPU_CAPABILITY_AVX512)
constexpr Isa kCompiledIsa = Isa::kAvx512;
#elif defined(CPU_CAPABILITY_AVX2)
constexpr Isa kCompiledIsa = Isa::kAvx2;
#else
constexpr Isa kCompiledIsa = Isa::kDefault;
#endif

// The ISA whose kernels serve calls: chosen at the first call from the CPU (the level of ATen's own
// kernels, so ATEN_CPU_CAPABILITY lowers both); `set_kernel_isa` changes it (tests and benchmarks,
// through torch.ops.mla_native.set_isa). A relaxed atomic load per call.
Isa kernel_isa();
// Whether this CPU can run `isa`'s build (and it is built into this extension).
bool isa_runs_here(Isa isa);
// Throws (naming the ISAs this CPU runs) unless isa_runs_here(isa).
void set_kernel_isa(Isa isa);

// Slot `isa` of a kernel: its entry point compiled for that ISA (defined by MLA_REGISTER_ISA_KERNEL in
// the kernel's file; only declared here, as DispatchStub declares its DEFAULT / AVX2 / AVX512 members).
template <typename Kernel, Isa isa>
struct IsaSlot {
  static typename Kernel::Fn* const fn;
};

template <typename Kernel>
typename Kernel::Fn* isa_kernel(Isa isa) {
  switch (isa) {
#if MLA_NATIVE_X86
    case Isa::kAvx512:
      return IsaSlot<Kernel, Isa::kAvx512>::fn;
    case Isa::kAvx2:
      return IsaSlot<Kernel, Isa::kAvx2>::fn;
#endif
    default:
      return IsaSlot<Kernel, Isa::kDefault>::fn;
  }
}

}  // namespace mla_native

// Declares kernel `name` with function type `signature` (for an op: its schema's C++ signature): the
// tag type `name##_kernel` the dispatch side uses, and the function each ISA build defines.
#define MLA_ISA_KERNEL(name, ...)                    \
  struct name##_kernel {                              \
    using Fn = __VA_ARGS__;                           \
    static constexpr const char* kName = #name;       \
  };                                                  \
  inline namespace CPU_CAPABILITY {                   \
  name##_kernel::Fn name;                             \
  }

// At the end of a kernel file, outside any namespace: this ISA's slot of kernel `name`.
#define MLA_REGISTER_ISA_KERNEL(name)                                                          \
  namespace mla_native {                                                                       \
  template <>                                                                                  \
  name##_kernel::Fn* const IsaSlot<name##_kernel, kCompiledIsa>::fn = &CPU_CAPABILITY::name; \
  }
