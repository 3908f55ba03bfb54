"""Compute and memory floors of this CPU for the absorbed MLA decode kernel.

Measures, on `--threads` cores (OpenMP, one thread per core):
  * fp32 FMA peak: independent chains of vfmadd231ps (512-bit where the CPU has AVX-512, and 256-bit), GFLOP/s;
  * bf16 dot peak: independent chains of vdpbf16ps (512-bit; only where the CPU has AVX512-BF16);
  * bf16 GEMM throughput of torch.matmul (oneDNN; on AMX tiles where the CPU has them): the practical
    AMX peak, where the CPU has AMX;
  * read bandwidth (512-bit loads where the CPU has AVX-512, else 256-bit): every thread sums its
    share of a buffer, once for a DRAM-sized buffer and once for one that fits the last-level cache
    (the B=1 cache of 4.7 MB stays there between decode steps);
and prints, for each decode case (bf16, N=16, L=512, R=64), the work (2 flops per multiply-add:
N*(L+R) for the scores plus N*L for P . latent per cached token), the bytes of the cache read, and
the time floors they imply: compute at each peak, memory at the matching bandwidth.

    python benchmarks/cpu_floors.py [--threads 2] [--json floors.json]

The micro-kernels are compiled with torch.utils.cpp_extension.load_inline (-O2 -march=native), so
the numbers are those of the machine it runs on.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from torch.utils.cpp_extension import load_inline

N, L, R = 16, 512, 64

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <vector>

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// `chains` independent accumulators hide the instruction latency; the result is summed so nothing
// is optimised away. Returns flops per second over all threads.
template <int CHAINS, typename Vec, typename Step>
static double peak(int threads, int64_t iters, double flops_per_step, Step step, Vec zero) {
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const double t0 = now();
    float sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
      Vec acc[CHAINS];
      for (int i = 0; i < CHAINS; ++i) acc[i] = zero;
      Vec x = zero;
      for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 16
        for (int i = 0; i < CHAINS; ++i) acc[i] = step(acc[i], x);
        asm volatile("" : "+x"(x));
      }
      for (int i = 0; i < CHAINS; ++i) sink += ((float*)&acc[i])[0];
    }
    const double dt = now() - t0;
    if (sink == 12345.f) best += 1e-30;
    best = std::max(best, flops_per_step * CHAINS * iters * threads / dt);
  }
  return best;
}

// The AVX-512 kernels exist where -march=native enables AVX-512 (an OpenMP region is outlined into a
// function of its own, so a target attribute on the caller would not reach its loop); elsewhere they
// return -1 and the script reports n/a.
#ifdef __AVX512F__
double fma512(int threads, int64_t iters) {
  return peak<16, __m512>(threads, iters, 32.0,
                          [](__m512 a, __m512 x) { return _mm512_fmadd_ps(x, x, a); }, _mm512_set1_ps(1e-7f));
}
#else
double fma512(int, int64_t) { return -1; }
#endif

double fma256(int threads, int64_t iters) {
  return peak<12, __m256>(threads, iters, 16.0,
                          [](__m256 a, __m256 x) { return _mm256_fmadd_ps(x, x, a); }, _mm256_set1_ps(1e-7f));
}

#ifdef __AVX512BF16__
double dpbf16(int threads, int64_t iters) {
  return peak<16, __m512>(threads, iters, 64.0,
                          [](__m512 a, __m512 x) { return _mm512_dpbf16_ps(a, (__m512bh)x, (__m512bh)x); },
                          _mm512_set1_ps(1e-7f));
}
#else
double dpbf16(int, int64_t) { return -1; }
#endif

// Bytes per second reading `bytes` (split over the threads) `passes` times inside one parallel
// region (a small buffer is read many times, so the region's start-up cost does not count); best
// of 5 after one warm-up. `Vec` is the load width (512-bit where the CPU has AVX-512, else 256-bit),
// `add` an integer add of two of them.
template <typename Vec, typename Add>
static double read_bandwidth(int threads, int64_t bytes, int passes, Add add) {
  constexpr int64_t width = sizeof(Vec);
  const int64_t n = bytes / width / (4 * threads) * (4 * threads);
  std::vector<Vec> buf(n);  // C++17: aligned to the vector type
  int32_t* words = reinterpret_cast<int32_t*>(buf.data());
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n * width / 4; ++i) words[i] = (int32_t)i;
  const Vec* v = buf.data();
  double best = 0;
  for (int rep = 0; rep <= 5; ++rep) {
    long long sink = 0;
    double t0 = 0, t1 = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
      const int tid = omp_get_thread_num();
      const int64_t lo = n / threads * tid, hi = lo + n / threads;
      Vec a0 = v[lo], a1 = a0, a2 = a0, a3 = a0;
#pragma omp barrier
#pragma omp master
      t0 = now();
      for (int p = 0; p < passes; ++p) {
        for (int64_t i = lo; i < hi; i += 4) {
          a0 = add(a0, v[i]);
          a1 = add(a1, v[i + 1]);
          a2 = add(a2, v[i + 2]);
          a3 = add(a3, v[i + 3]);
        }
        asm volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3));
      }
#pragma omp barrier
#pragma omp master
      t1 = now();
      Vec s = add(add(a0, a1), add(a2, a3));
      sink += reinterpret_cast<const int32_t*>(&s)[0];
    }
    if (sink == 42) best += 1e-30;
    if (rep > 0) best = std::max(best, (double)(n * width) * passes / (t1 - t0));
  }
  return best;
}

#ifdef __AVX512F__
double read_bw512(int threads, int64_t bytes, int passes) {
  return read_bandwidth<__m512i>(threads, bytes, passes, [](__m512i a, __m512i b) { return _mm512_add_epi32(a, b); });
}
#else
double read_bw512(int, int64_t, int) { return -1; }
#endif

double read_bw256(int threads, int64_t bytes, int passes) {
  return read_bandwidth<__m256i>(threads, bytes, passes, [](__m256i a, __m256i b) { return _mm256_add_epi32(a, b); });
}
"""

FUNCTIONS = ["fma512", "fma256", "dpbf16", "read_bw512", "read_bw256"]


def decode_case(batch: int, ctx: int) -> dict:
    tokens = batch * ctx
    flops = 2 * tokens * N * (L + R + L)
    cache_bytes = tokens * (L + R) * 2  # bf16 latent + k_pe rows, each read once
    return {"B": batch, "ctx": ctx, "gflop": flops / 1e9, "cache_mb": cache_bytes / 1e6}


def bf16_gemm_gflops(threads: int, n: int = 2048) -> float:
    """Best of five n x n x n bf16 torch.matmul (fp32 accumulation in oneDNN) on `threads` threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n).bfloat16(), torch.randn(n, n).bfloat16()
        torch.matmul(a, b)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            torch.matmul(a, b)
            best = min(best, time.perf_counter() - t0)
        return 2 * n**3 / best / 1e9
    finally:
        torch.set_num_threads(previous)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()
    ext = load_inline(
        "mla_cpu_floors", cpp_sources=SOURCE, functions=FUNCTIONS, extra_cflags=["-O2", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"], verbose=False,
    )
    t = args.threads
    iters = 20_000_000
    flags = set(open("/proc/cpuinfo").read().split())
    has_avx512, has_bf16 = "avx512f" in flags, "avx512_bf16" in flags
    read_bw = ext.read_bw512 if has_avx512 else ext.read_bw256
    peaks = {
        "fp32_fma_512_gflops": ext.fma512(t, iters) / 1e9 if has_avx512 else None,
        "fp32_fma_256_gflops": ext.fma256(t, iters) / 1e9,
        "bf16_dot_512_gflops": ext.dpbf16(t, iters) / 1e9 if has_bf16 else None,
        "bf16_gemm_gflops": bf16_gemm_gflops(t),
        "read_dram_gbs": read_bw(t, 1 << 30, 1) / 1e9,
        "read_llc_4p7mb_gbs": read_bw(t, 4_718_592, 100) / 1e9,
    }
    fp32_peak = max(v for v in (peaks["fp32_fma_512_gflops"], peaks["fp32_fma_256_gflops"]) if v is not None)
    cases = []
    for batch, ctx in ((1, 4096), (8, 4096), (1, 16384), (8, 16384)):
        c = decode_case(batch, ctx)
        fits_llc = c["cache_mb"] < 16  # well inside a 32 MB L3: stays there between steps
        bw = peaks["read_llc_4p7mb_gbs"] if fits_llc else peaks["read_dram_gbs"]
        c["memory_floor_ms"] = c["cache_mb"] / 1e3 / bw * 1e3
        c["memory_level"] = "LLC" if fits_llc else "DRAM"
        c["fp32_floor_ms"] = c["gflop"] / fp32_peak * 1e3
        if peaks["bf16_dot_512_gflops"]:
            c["bf16_floor_ms"] = c["gflop"] / peaks["bf16_dot_512_gflops"] * 1e3
        c["bf16_gemm_floor_ms"] = c["gflop"] / peaks["bf16_gemm_gflops"] * 1e3
        cases.append(c)
    print(f"threads: {t}")
    for k, v in peaks.items():
        print(f"  {k}: {v:.1f}" if v is not None else f"  {k}: n/a")
    print(f"{'case':>12} {'GFLOP':>7} {'cache MB':>9} {'fp32 ms':>8} {'bf16 ms':>8} {'GEMM ms':>8} {'mem ms':>7} level")
    for c in cases:
        label = f"B={c['B']} ctx={c['ctx']}"
        print(f"{label:>12} {c['gflop']:7.3f} {c['cache_mb']:9.1f} {c['fp32_floor_ms']:8.3f} "
              f"{c.get('bf16_floor_ms', float('nan')):8.3f} {c['bf16_gemm_floor_ms']:8.3f} "
              f"{c['memory_floor_ms']:7.3f} {c['memory_level']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": t, "peaks": peaks, "cases": cases, "torch": torch.__version__,
                       "time": time.strftime("%Y-%m-%d %H:%M:%S")}, f, indent=1)


if __name__ == "__main__":
    main()
