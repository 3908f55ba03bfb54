// Which ISA build of the kernels serves calls (isa.h).
#include "isa.h"

#include <ATen/Version.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <string>

namespace mla_native {
namespace {

constexpr int kUnset = -1;
std::atomic<int> g_isa{kUnset};

// What ATen's own kernels run at (ATEN_CPU_CAPABILITY can lower it), as one of our builds.
Isa aten_isa() {
  const std::string capability = at::get_cpu_capability();
  if (capability.rfind("AVX512", 0) == 0) return Isa::kAvx512;
  if (capability == "AVX2") return Isa::kAvx2;
  return Isa::kDefault;
}

Isa initial_isa() {
  int isa = static_cast<int>(aten_isa());
  while (isa > 0 && !isa_runs_here(static_cast<Isa>(isa))) --isa;
  return static_cast<Isa>(isa);
}

}  // namespace

bool isa_runs_here(Isa isa) {
#if MLA_NATIVE_X86 && defined(__GNUC__)
  // the features the -m flags of each build (setup.py) let the compiler use
  switch (isa) {
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && isa_runs_here(Isa::kAvx2);
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Isa::kDefault:
      return true;
  }
  return false;
#else
  return isa == Isa::kDefault;  // the only build on other platforms
#endif
}

Isa kernel_isa() {
  int isa = g_isa.load(std::memory_order_relaxed);
  if (isa == kUnset) {
    isa = static_cast<int>(initial_isa());
    int expected = kUnset;
    if (!g_isa.compare_exchange_strong(expected, isa)) isa = expected;
  }
  return static_cast<Isa>(isa);
}

void set_kernel_isa(Isa isa) {
  if (!isa_runs_here(isa)) {
    std::string runnable;
    for (int i = 0; i < kNumIsas; ++i) {
      if (isa_runs_here(static_cast<Isa>(i))) runnable += (runnable.empty() ? "'" : ", '") + std::string(kIsaNames[i]) + "'";
    }
    TORCH_CHECK(false, "mla_native.set_isa: this CPU cannot run the ", kIsaNames[static_cast<int>(isa)],
                " build of the native kernels; it runs ", runnable);
  }
  g_isa.store(static_cast<int>(isa), std::memory_order_relaxed);
}

}  // namespace mla_native
