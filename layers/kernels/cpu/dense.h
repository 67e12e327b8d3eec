// dense.cc's x · W^T walk for the other kernels of this library: matmul.cc dequantizes a block of
// a packed weight's rows into a buffer and multiplies every token by it (its many-token path
// with AVX-512, every token count on other CPUs).
#pragma once

#include <cstdint>

namespace zoo_cpu {

// y[t, r] = x[t, :] · W[r - r0, :] for tokens [0, T) and rows [r0, r1): `w` holds rows r0 .. r1
// of a float32 [N, K] weight, `k` floats apart, as do x's rows; y's rows are `n` floats apart.
// Each dot runs in 16 lanes (8 with AVX2; the K tail masked), then across them; one thread.
// AVX-512 where the CPU has it, else AVX2 with FMA, unless `portable`; else the plain C++ walk.
void dense_rows_transposed(const float* x, const float* w, float* y, int64_t tokens, int64_t k,
                           int64_t n, int64_t r0, int64_t r1, bool portable);

}  // namespace zoo_cpu
