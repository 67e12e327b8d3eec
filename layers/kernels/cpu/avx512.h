// CPU-feature helpers shared by the kernels of this library: the lane mask of a vector's first n
// floats (16, or AVX2's 8), the sum of AVX2's 8 lanes, and whether the running CPU has AVX-512F or
// AVX2 (each with FMA), checked before a vector path is taken (each path is compiled for its own
// ISA alone, so a library built anywhere runs anywhere); and ZOO_CLONES, which gives a plain C++
// function (the portable paths) one clone per vector width, picked by the loader for the running
// CPU: without it they run the x86-64 baseline's 4-float vectors on a CPU with AVX2's 8 (measured
// on an AMD EPYC without AVX-512, where the portable paths were the ones taken: bench/RESULTS.md,
// "CPUs without AVX-512").
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

// Lanes [0, n) of 8 set, as a mask for AVX2's masked loads and stores.
__attribute__((target("avx2,fma"))) inline __m256i first_lanes8(int64_t n) {
  const int32_t lanes = static_cast<int32_t>(n < 0 ? 0 : n > 8 ? 8 : n);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The sum of v's 8 lanes.
__attribute__((target("avx2,fma"))) inline float sum_lanes8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

}  // namespace zoo_cpu
#else
namespace zoo_cpu {
inline bool has_avx512f() { return false; }
inline bool has_avx2_fma() { return false; }
}  // namespace zoo_cpu
#endif
