// CPU-feature helpers shared by the kernels of this library: the lane mask of a vector's first n
// floats, and whether the running CPU has AVX-512F or AVX2 (each with FMA), checked before a
// vector path is taken (each path is compiled for its own ISA alone, so a library built anywhere
// runs anywhere); and ZOO_CLONES, which gives a plain C++ function (the portable paths) one clone
// per vector width, picked by the loader for the running CPU: without it they run the x86-64
// baseline's 4-float vectors on a CPU with AVX2's 8 (measured on an AMD EPYC without AVX-512,
// where the portable paths were the ones taken: bench/RESULTS.md, "CPUs without AVX-512").
#pragma once

#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__)
#define ZOO_CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#else
#define ZOO_CLONES
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

namespace zoo_cpu {

// Lanes [0, n) of 16 set: none for n <= 0, all for n >= 16.
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF)
                 : n <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << n) - 1);
}

inline bool has_avx512f() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  return yes;
}

// AVX2 with FMA (x86-64-v3: every x86 server CPU of the last decade): 8-float vectors, 16 of them.
inline bool has_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

}  // namespace zoo_cpu
#else
namespace zoo_cpu {
inline bool has_avx512f() { return false; }
inline bool has_avx2_fma() { return false; }
}  // namespace zoo_cpu
#endif
