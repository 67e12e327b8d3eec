// The float32 product of a few tokens with a weight read from memory, y [T, N] = x [T, K] · W
// [K, N], for decode steps on a CPU (cpu.py: `dense_matmul`). XLA's product of a skinny x packs
// W's panels (a second pass over the weight) and reads 8-row products at ~14 GB/s on a machine
// that streams 1-row ones at ~23 (bench/RESULTS.md, "skinny products"). Here W is read once, in
// blocks of 32 rows: a block's rows are walked left to right in 48-column panels (3 cache lines
// a row), each panel's 32 rows multiplied into [8, 48] accumulators held in registers for 8
// tokens at a time (then 4, 2, 1; the panel's next tokens read it again from L1) and added to
// y between blocks. So memory is read as 32 streams running along the rows, and while the
// first tile walks a panel it asks for the same panel of the next block's rows into L2, so
// loads overlap FMAs. (The walk this replaced went down each 48-column panel, one row a page
// apart: on an Intel Xeon it read 11-13 GB/s at 8 tokens where this reads 16-20, and 8-token
// tiles spilled no registers here; bench/RESULTS.md, "The float32 kernel's walk".)
//
// One token (a batch-1 decode step) reads W in slices of consecutive rows instead, each slice
// one stream front to back into its own partial outputs, the partials added at the end
// (`slice_avx512`).
//
// The tied head multiplies by a weight stored [N, K] (the embedding table): y = x · W^T. Its rows
// are walked in order, 4 rows at a time with the next 4 requested ahead, each row's dot products
// with 4 tokens summed in [4, 4] vector accumulators over K, then across their 16 lanes.
//
// Three builds of each walk, picked for the running CPU: AVX-512 (above), AVX2 + FMA (8-float
// vectors and 16 registers, below: x · W in tiles of 192 columns by 16 rows, the row walk at
// half the width)
// and a plain C++ one (the `portable` specification, and CPUs with neither).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "avx512.h"
#include "dense.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Rows of W per block (measured at 16 and 32, 8 tokens: within the noise; 64 and more is
// slower, its streams more than an L2 prefetcher follows).
constexpr int64_t kBlockRows = 32;
// Columns per panel: 3 vectors of 16 floats. The loops over tokens and vectors are unrolled by
// GCC unroll pragmas (measured in one build without them: 12.4-14.1 GB/s at 8 tokens, with
// them 17.4-20.6; from memory, 2 threads).
constexpr int kVectors = 3;
constexpr int64_t kPanel = 16 * kVectors;

#if defined(__x86_64__)
#define ZOO_DENSE __attribute__((target("avx512f,fma")))

// Tokens [0, TB) of x (rows `k` floats apart) times rows [i0, i1) of columns [n0, n0 + 48) of W
// (masked past n), added to y (set, for the first block): each output still summed in k order,
// one FMA a term. `ahead`: also request the same columns of the next block's rows into L2.
template <int TB>
ZOO_DENSE void panel(const float* x, const float* w, float* y, int64_t k, int64_t n, int64_t n0,
                     int64_t i0, int64_t i1, bool ahead) {
  __mmask16 mask[kVectors];
  _Pragma("GCC unroll 4")
  for (int v = 0; v < kVectors; ++v) mask[v] = zoo_cpu::first_lanes(n - (n0 + 16 * v));
  __m512 acc[TB][kVectors];
  _Pragma("GCC unroll 8")
  for (int t = 0; t < TB; ++t)
      _Pragma("GCC unroll 4")
      for (int v = 0; v < kVectors; ++v)
        acc[t][v] = i0 == 0 ? _mm512_setzero_ps()
                            : _mm512_maskz_loadu_ps(mask[v], y + t * n + n0 + 16 * v);
  const float* row = w + i0 * n + n0;
  for (int64_t i = i0; i < i1; ++i, row += n) {
    if (ahead && i + kBlockRows < k)
          _Pragma("GCC unroll 4")
          for (int v = 0; v < kVectors; ++v)
        if (mask[v]) _mm_prefetch(reinterpret_cast<const char*>(row + kBlockRows * n + 16 * v), _MM_HINT_T1);
    __m512 wv[kVectors];
      _Pragma("GCC unroll 4")
      for (int v = 0; v < kVectors; ++v) wv[v] = _mm512_maskz_loadu_ps(mask[v], row + 16 * v);
      _Pragma("GCC unroll 8")
      for (int t = 0; t < TB; ++t) {
      const __m512 xb = _mm512_set1_ps(x[t * k + i]);
          _Pragma("GCC unroll 4")
          for (int v = 0; v < kVectors; ++v) acc[t][v] = _mm512_fmadd_ps(xb, wv[v], acc[t][v]);
    }
  }
  _Pragma("GCC unroll 8")
  for (int t = 0; t < TB; ++t)
      _Pragma("GCC unroll 4")
      for (int v = 0; v < kVectors; ++v) _mm512_mask_storeu_ps(y + t * n + n0 + 16 * v, mask[v], acc[t][v]);
}

// Columns [c0, c1) for every token, block by block: 8 tokens at a time (24 accumulators, 3
// weight vectors and a broadcast: 28 of the 32 vector registers), then 4, 2, 1.
ZOO_DENSE void columns_avx512(const float* x, const float* w, float* y, int64_t tokens, int64_t k,
                              int64_t n, int64_t c0, int64_t c1) {
  for (int64_t i0 = 0; i0 < k; i0 += kBlockRows) {
    const int64_t i1 = std::min(k, i0 + kBlockRows);
    for (int64_t n0 = c0; n0 < c1; n0 += kPanel) {
      int64_t t = 0;
      for (; t + 8 <= tokens; t += 8) panel<8>(x + t * k, w, y + t * n, k, n, n0, i0, i1, t == 0);
      if (t + 4 <= tokens) panel<4>(x + t * k, w, y + t * n, k, n, n0, i0, i1, t == 0), t += 4;
      if (t + 2 <= tokens) panel<2>(x + t * k, w, y + t * n, k, n, n0, i0, i1, t == 0), t += 2;
      if (t < tokens) panel<1>(x + t * k, w, y + t * n, k, n, n0, i0, i1, t == 0);
    }
  }
}

// Rows of W requested ahead of the ones being multiplied (into L2, as the column walk's): the
// next group's. Measured at 8 tokens on the heads of SmolLM2 and GPT-2, 2 threads: without it
// 15.5-15.9 GB/s; 4 rows ahead 26.9-29.0, 8 rows 21.5-23.0, 16 rows 23.4-25.1.
constexpr int64_t kRowsAhead = 4;

// Rows [r0, r0 + R) of W ([N, K], rows `k` floats apart) dotted with tokens [0, TB) of x:
// y[t, r] for each, the K sum run in 16 lanes (the tail masked), then across them.
template <int TB, int R>
ZOO_DENSE void rows(const float* x, const float* w, float* y, int64_t k, int64_t n, int64_t r0) {
  __m512 acc[TB][R];
  _Pragma("GCC unroll 4")
  for (int t = 0; t < TB; ++t)
      _Pragma("GCC unroll 4")
      for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 mask = zoo_cpu::first_lanes(k - i);
    __m512 wv[R];
      _Pragma("GCC unroll 4")
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (r0 + r + kRowsAhead) * k + i), _MM_HINT_T1);
        wv[r] = _mm512_maskz_loadu_ps(mask, w + (r0 + r) * k + i);
      }
      _Pragma("GCC unroll 4")
      for (int t = 0; t < TB; ++t) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + t * k + i);
          _Pragma("GCC unroll 4")
          for (int r = 0; r < R; ++r) acc[t][r] = _mm512_fmadd_ps(xv, wv[r], acc[t][r]);
    }
  }
  _Pragma("GCC unroll 4")
  for (int t = 0; t < TB; ++t)
      _Pragma("GCC unroll 4")
      for (int r = 0; r < R; ++r) y[t * n + r0 + r] = _mm512_reduce_add_ps(acc[t][r]);
}

// Rows [r0, r1) of W for every token: 4 rows at a time (1 at the end), each group of rows dotted
// with 4 tokens, then the next 4 (the group's 4 rows, 4 x 4 K bytes, still in L1/L2), then 2, 1.
template <int R>
ZOO_DENSE void row_group(const float* x, const float* w, float* y, int64_t tokens, int64_t k,
                         int64_t n, int64_t r0) {
  int64_t t = 0;
  for (; t + 4 <= tokens; t += 4) rows<4, R>(x + t * k, w, y + t * n, k, n, r0);
  if (t + 2 <= tokens) rows<2, R>(x + t * k, w, y + t * n, k, n, r0), t += 2;
  if (t < tokens) rows<1, R>(x + t * k, w, y + t * n, k, n, r0);
}

ZOO_DENSE void rows_avx512(const float* x, const float* w, float* y, int64_t tokens, int64_t k,
                           int64_t n, int64_t c0, int64_t c1) {
  int64_t r = c0;
  for (; r + 4 <= c1; r += 4) row_group<4>(x, w, y, tokens, k, n, r);
  for (; r < c1; ++r) row_group<1>(x, w, y, tokens, k, n, r);
}

// One token's x · W (a batch-1 decode step's products; `DenseMatmul` cuts W's rows into
// kSlices slices): rows [i0, i1) of W, a contiguous stretch of memory read front to back, times
// x added into the slice's partial outputs p (n floats, in L1 or L2; zeros on entry), 4 rows a
// pass with one FMA a term in k order, the next 4 rows requested into L2 ahead. One stream per
// thread: the column walk above, at 1 token, reads many short runs of each row
// (bench/RESULTS.md, "One token's x · W in slices of rows").
ZOO_DENSE void slice_avx512(const float* x, const float* w, float* p, int64_t n, int64_t i0,
                            int64_t i1) {
  int64_t i = i0;
  for (; i + 4 <= i1; i += 4) {
    const float* r = w + i * n;
    const bool ahead = i + 8 <= i1;
    __m512 xb[4];
    _Pragma("GCC unroll 4")
    for (int q = 0; q < 4; ++q) xb[q] = _mm512_set1_ps(x[i + q]);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = zoo_cpu::first_lanes(n - j);
      if (ahead)
        _Pragma("GCC unroll 4")
        for (int q = 4; q < 8; ++q)
          _mm_prefetch(reinterpret_cast<const char*>(r + q * n + j), _MM_HINT_T1);
      __m512 acc = _mm512_maskz_loadu_ps(m, p + j);
      _Pragma("GCC unroll 4")
      for (int q = 0; q < 4; ++q)
        acc = _mm512_fmadd_ps(xb[q], _mm512_maskz_loadu_ps(m, r + q * n + j), acc);
      _mm512_mask_storeu_ps(p + j, m, acc);
    }
  }
  for (; i < i1; ++i) {
    const __m512 xb = _mm512_set1_ps(x[i]);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = zoo_cpu::first_lanes(n - j);
      const __m512 acc = _mm512_maskz_loadu_ps(m, p + j);
      _mm512_mask_storeu_ps(
          p + j, m, _mm512_fmadd_ps(xb, _mm512_maskz_loadu_ps(m, w + i * n + j), acc));
    }
  }
}

// The walks with AVX2 and FMA (CPUs without AVX-512), 8-float vectors and 16 registers.
//
// x · W walks tiles of 192 columns by 16 rows. Each tile's 24-column panels keep 4 tokens'
// outputs in registers over the tile's 16 rows (12 accumulators, 3 weight vectors and a
// broadcast: AVX2's 16 registers), so an output is loaded and stored once per 16 FMAs. Within a
// tile of columns the row blocks follow in order, and each block requests the next block's row
// segments (768 bytes each, one after another) into L1 while its panels run. Each output still
// takes one FMA a term in k order, so it sums exactly as the AVX-512 panel does. The AVX-512
// walk's order at 24 columns (32-row blocks across the item's whole width) read W at 11 GB/s at
// 8 tokens on an AMD Zen 2 that streams 26 (bench/RESULTS.md, "x · W read in order on AVX2"),
// and the walk before this one (4 rows at a time through 512-column tiles, an output load and
// store per 4 FMAs) 14 GB/s on a Zen 3, where this reads 17 ("x · W in registers on AVX2").
// Columns past the last whole panel take 8-float vectors, 4 rows at a time.
//
// x · W^T dots 2 rows with 4 tokens (8 accumulators), summed in 8 lanes, then across them.
#define ZOO_AVX2 __attribute__((target("avx2,fma")))
// W rows per pass of the columns past the panels (8 rows a pass measured slower).
constexpr int kStreamRows = 4;
// A tile of x · W: 192 columns (8 panels of 24) by 16 rows (bench/RESULTS.md, "x · W in
// registers on AVX2": 384 or 768 columns and 32 rows were slower, 8 rows and 96 columns level).
constexpr int64_t kTileColumns = 192;
constexpr int64_t kTileRows = 16;

using zoo_cpu::first_lanes8;
using zoo_cpu::sum_lanes8;

// Rows [i, i + R) of W's columns [j0, j1) times tokens [0, TB) of x, added into y. At TB = 4,
// R = 4 the 16 broadcasts and 4 weight vectors are more than AVX2's 16 registers, so some
// broadcasts live in L1; still faster than 2 tokens a pass (15.5 against 16.6 ms at 8 tokens).
template <int TB, int R>
ZOO_AVX2 void stream8(const float* x, const float* w, float* y, int64_t k, int64_t n, int64_t i,
                      int64_t j0, int64_t j1) {
  __m256 xb[TB][R];
  _Pragma("GCC unroll 4")
  for (int t = 0; t < TB; ++t)
      _Pragma("GCC unroll 4")
      for (int r = 0; r < R; ++r) xb[t][r] = _mm256_broadcast_ss(x + t * k + i + r);
  int64_t j = j0;
  for (; j + 8 <= j1; j += 8) {
    __m256 wv[R];
      _Pragma("GCC unroll 4")
      for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_ps(w + (i + r) * n + j);
      _Pragma("GCC unroll 4")
      for (int t = 0; t < TB; ++t) {
      __m256 acc = _mm256_loadu_ps(y + t * n + j);
          _Pragma("GCC unroll 4")
          for (int r = 0; r < R; ++r) acc = _mm256_fmadd_ps(xb[t][r], wv[r], acc);
      _mm256_storeu_ps(y + t * n + j, acc);
    }
  }
  if (j == j1) return;
  const __m256i mask = first_lanes8(j1 - j);
  __m256 wv[R];
  _Pragma("GCC unroll 4")
  for (int r = 0; r < R; ++r) wv[r] = _mm256_maskload_ps(w + (i + r) * n + j, mask);
  _Pragma("GCC unroll 4")
  for (int t = 0; t < TB; ++t) {
    __m256 acc = _mm256_maskload_ps(y + t * n + j, mask);
      _Pragma("GCC unroll 4")
      for (int r = 0; r < R; ++r) acc = _mm256_fmadd_ps(xb[t][r], wv[r], acc);
    _mm256_maskstore_ps(y + t * n + j, mask, acc);
  }
}

// Rows [i, i + R) of columns [j0, j1) (a tile's columns past its last whole panel) for every
// token: 4 at a time, then 2, 1 (the next tokens read the rows from L1).
template <int R>
ZOO_AVX2 void stream_tokens8(const float* x, const float* w, float* y, int64_t tokens, int64_t k,
                             int64_t n, int64_t i, int64_t j0, int64_t j1) {
  int64_t t = 0;
  for (; t + 4 <= tokens; t += 4) stream8<4, R>(x + t * k, w, y + t * n, k, n, i, j0, j1);
  if (t + 2 <= tokens) stream8<2, R>(x + t * k, w, y + t * n, k, n, i, j0, j1), t += 2;
  if (t < tokens) stream8<1, R>(x + t * k, w, y + t * n, k, n, i, j0, j1);
}

// Tokens [0, TB) times rows [i0, i1) of columns [j, j + 24) of W, added into y: TB x 3
// accumulators held in registers over the block's rows (4 tokens: 12, with 3 weight vectors and
// a broadcast, AVX2's 16), each output summed in k order, one FMA a term.
template <int TB>
ZOO_AVX2 void panel24(const float* x, const float* w, float* y, int64_t k, int64_t n, int64_t j,
                      int64_t i0, int64_t i1) {
  __m256 acc[TB][3];
  _Pragma("GCC unroll 4")
  for (int t = 0; t < TB; ++t)
      _Pragma("GCC unroll 3")
      for (int v = 0; v < 3; ++v) acc[t][v] = _mm256_loadu_ps(y + t * n + j + 8 * v);
  const float* row = w + i0 * n + j;
  for (int64_t i = i0; i < i1; ++i, row += n) {
    const __m256 w0 = _mm256_loadu_ps(row), w1 = _mm256_loadu_ps(row + 8),
                 w2 = _mm256_loadu_ps(row + 16);
    _Pragma("GCC unroll 4")
    for (int t = 0; t < TB; ++t) {
      const __m256 xb = _mm256_broadcast_ss(x + t * k + i);
      acc[t][0] = _mm256_fmadd_ps(xb, w0, acc[t][0]);
      acc[t][1] = _mm256_fmadd_ps(xb, w1, acc[t][1]);
      acc[t][2] = _mm256_fmadd_ps(xb, w2, acc[t][2]);
    }
  }
  _Pragma("GCC unroll 4")
  for (int t = 0; t < TB; ++t)
      _Pragma("GCC unroll 3")
      for (int v = 0; v < 3; ++v) _mm256_storeu_ps(y + t * n + j + 8 * v, acc[t][v]);
}

ZOO_AVX2 void columns_avx2(const float* x, const float* w, float* y, int64_t tokens, int64_t k,
                           int64_t n, int64_t c0, int64_t c1) {
  for (int64_t j0 = c0; j0 < c1; j0 += kTileColumns) {
    const int64_t j1 = std::min(c1, j0 + kTileColumns);
    const int64_t jp = j0 + (j1 - j0) / 24 * 24;  // whole 24-column panels, then the rest
    for (int64_t t = 0; t < tokens; ++t) std::fill(y + t * n + j0, y + t * n + j1, 0.0f);
    const int64_t panels = (jp - j0) / 24;
    for (int64_t i0 = 0; i0 < k; i0 += kTileRows) {
      const int64_t i1 = std::min(k, i0 + kTileRows);
      // The next block's rows, each row's segment in order, spread over this block's panels.
      const int64_t next = std::min(k, i1 + kTileRows) - i1;
      const int64_t per_panel = panels ? (next + panels - 1) / panels : 0;
      for (int64_t p = 0; p < panels; ++p) {
        const int64_t j = j0 + 24 * p;
        for (int64_t r = p * per_panel; r < std::min(next, (p + 1) * per_panel); ++r)
          for (int64_t c = j0; c < j1; c += 16)
            _mm_prefetch(reinterpret_cast<const char*>(w + (i1 + r) * n + c), _MM_HINT_T0);
        int64_t t = 0;
        for (; t + 4 <= tokens; t += 4) panel24<4>(x + t * k, w, y + t * n, k, n, j, i0, i1);
        if (t + 2 <= tokens) panel24<2>(x + t * k, w, y + t * n, k, n, j, i0, i1), t += 2;
        if (t < tokens) panel24<1>(x + t * k, w, y + t * n, k, n, j, i0, i1);
      }
      if (jp == j1) continue;
      int64_t i = i0;
      for (; i + kStreamRows <= i1; i += kStreamRows)
        stream_tokens8<kStreamRows>(x, w, y, tokens, k, n, i, jp, j1);
      for (; i < i1; ++i) stream_tokens8<1>(x, w, y, tokens, k, n, i, jp, j1);
    }
  }
}

// `rows` with 8-float vectors: rows [r0, r0 + R) of W dotted with tokens [0, TB) of x.
template <int TB, int R>
ZOO_AVX2 void rows8(const float* x, const float* w, float* y, int64_t k, int64_t n, int64_t r0) {
  __m256 acc[TB][R];
  _Pragma("GCC unroll 4")
  for (int t = 0; t < TB; ++t)
      _Pragma("GCC unroll 4")
      for (int r = 0; r < R; ++r) acc[t][r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) {
    const __m256i mask = first_lanes8(k - i);
    __m256 wv[R];
      _Pragma("GCC unroll 4")
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (r0 + r + kRowsAhead) * k + i), _MM_HINT_T1);
        wv[r] = _mm256_maskload_ps(w + (r0 + r) * k + i, mask);
      }
      _Pragma("GCC unroll 4")
      for (int t = 0; t < TB; ++t) {
      const __m256 xv = _mm256_maskload_ps(x + t * k + i, mask);
          _Pragma("GCC unroll 4")
          for (int r = 0; r < R; ++r) acc[t][r] = _mm256_fmadd_ps(xv, wv[r], acc[t][r]);
    }
  }
  _Pragma("GCC unroll 4")
  for (int t = 0; t < TB; ++t)
      _Pragma("GCC unroll 4")
      for (int r = 0; r < R; ++r) y[t * n + r0 + r] = sum_lanes8(acc[t][r]);
}

template <int R>
ZOO_AVX2 void row_group8(const float* x, const float* w, float* y, int64_t tokens, int64_t k,
                         int64_t n, int64_t r0) {
  int64_t t = 0;
  for (; t + 4 <= tokens; t += 4) rows8<4, R>(x + t * k, w, y + t * n, k, n, r0);
  if (t + 2 <= tokens) rows8<2, R>(x + t * k, w, y + t * n, k, n, r0), t += 2;
  if (t < tokens) rows8<1, R>(x + t * k, w, y + t * n, k, n, r0);
}

ZOO_AVX2 void rows_avx2(const float* x, const float* w, float* y, int64_t tokens, int64_t k,
                        int64_t n, int64_t c0, int64_t c1) {
  int64_t r = c0;
  for (; r + 2 <= c1; r += 2) row_group8<2>(x, w, y, tokens, k, n, r);
  for (; r < c1; ++r) row_group8<1>(x, w, y, tokens, k, n, r);
}

// `slice_avx512` with 8-float vectors.
ZOO_AVX2 void slice_avx2(const float* x, const float* w, float* p, int64_t n, int64_t i0,
                         int64_t i1) {
  int64_t i = i0;
  for (; i + 4 <= i1; i += 4) {
    const float* r = w + i * n;
    const bool ahead = i + 8 <= i1;
    __m256 xb[4];
    _Pragma("GCC unroll 4")
    for (int q = 0; q < 4; ++q) xb[q] = _mm256_set1_ps(x[i + q]);
    for (int64_t j = 0; j < n; j += 8) {
      const __m256i m = first_lanes8(n - j);
      if (ahead && j % 16 == 0)  // one request a cache line
        _Pragma("GCC unroll 4")
        for (int q = 4; q < 8; ++q)
          _mm_prefetch(reinterpret_cast<const char*>(r + q * n + j), _MM_HINT_T1);
      __m256 acc = _mm256_maskload_ps(p + j, m);
      _Pragma("GCC unroll 4")
      for (int q = 0; q < 4; ++q)
        acc = _mm256_fmadd_ps(xb[q], _mm256_maskload_ps(r + q * n + j, m), acc);
      _mm256_maskstore_ps(p + j, m, acc);
    }
  }
  for (; i < i1; ++i) {
    const __m256 xb = _mm256_set1_ps(x[i]);
    for (int64_t j = 0; j < n; j += 8) {
      const __m256i m = first_lanes8(n - j);
      const __m256 acc = _mm256_maskload_ps(p + j, m);
      _mm256_maskstore_ps(p + j, m, _mm256_fmadd_ps(xb, _mm256_maskload_ps(w + i * n + j, m), acc));
    }
  }
}
#else
void slice_avx512(const float*, const float*, float*, int64_t, int64_t, int64_t) {}
void slice_avx2(const float*, const float*, float*, int64_t, int64_t, int64_t) {}
void columns_avx512(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t,
                    int64_t) {}
void rows_avx512(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t,
                 int64_t) {}
void columns_avx2(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t,
                  int64_t) {}
void rows_avx2(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t,
               int64_t) {}
#endif

// The plain paths (`portable`, and CPUs with neither AVX-512 nor AVX2), in plain C++ that the
// compiler vectorizes (ZOO_CLONES: 8-float vectors with AVX2) without reordering a sum: one
// multiply and one add a term where the vector walks take one FMA, so they agree to float32
// rounding.
//
// x · W: W's rows in blocks of kBlockRows, within tiles of kPortableColumns columns (a block's
// tile, 128 KiB, stays in L2 while each token's outputs of the tile, 4 KiB, stay in L1): each
// row's tile scaled by the token's input and added to the token's outputs, so each output is
// summed in k order as the AVX-512 walk sums it.
constexpr int64_t kPortableColumns = 1024;

ZOO_CLONES void portable_columns(const float* __restrict x, const float* __restrict w,
                                 float* __restrict y, int64_t tokens, int64_t k, int64_t n,
                                 int64_t c0, int64_t c1) {
  for (int64_t j0 = c0; j0 < c1; j0 += kPortableColumns) {
    const int64_t j1 = std::min(c1, j0 + kPortableColumns);
    for (int64_t t = 0; t < tokens; ++t) std::fill(y + t * n + j0, y + t * n + j1, 0.0f);
    for (int64_t i0 = 0; i0 < k; i0 += kBlockRows) {
      const int64_t i1 = std::min(k, i0 + kBlockRows);
      for (int64_t t = 0; t < tokens; ++t) {
        float* __restrict out = y + t * n;
        for (int64_t i = i0; i < i1; ++i) {
          const float xi = x[t * k + i];
          const float* __restrict row = w + i * n;
          for (int64_t j = j0; j < j1; ++j) out[j] += xi * row[j];
        }
      }
    }
  }
}

// One token's slice of x · W added into p (zeros on entry), each output summed over the slice in
// k order (slice_avx512's order, a multiply and an add a term).
ZOO_CLONES void portable_slice(const float* __restrict x, const float* __restrict w,
                               float* __restrict p, int64_t n, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    const float xi = x[i];
    const float* __restrict row = w + i * n;
    for (int64_t j = 0; j < n; ++j) p[j] += xi * row[j];
  }
}

// x · W^T: row `row` of W (k floats) dotted with tokens [0, TB) of x in 16 lanes (the K tail
// in the first lanes), then across them, as the AVX-512 walk's rows.
template <int TB>
inline __attribute__((always_inline)) void portable_dots(const float* __restrict x,
                                                         const float* __restrict row,
                                                         float* __restrict y, int64_t k,
                                                         int64_t n) {
  float acc[TB][16] = {};
  int64_t i = 0;
  for (; i + 16 <= k; i += 16)
    for (int t = 0; t < TB; ++t)
      for (int l = 0; l < 16; ++l) acc[t][l] += x[t * k + i + l] * row[i + l];
  for (int t = 0; t < TB; ++t)
    for (int64_t l = 0; i + l < k; ++l) acc[t][l] += x[t * k + i + l] * row[i + l];
  for (int t = 0; t < TB; ++t) {
    float sum = 0.0f;
    for (int l = 0; l < 16; ++l) sum += acc[t][l];
    y[t * n] = sum;
  }
}

// Rows [r0, r1) of W ([N, K]) for every token, 4 tokens at a time (then 2, 1): a row, 4 K bytes,
// is read from memory once and from L1 by the next tokens.
ZOO_CLONES void portable_rows(const float* x, const float* w, float* y, int64_t tokens, int64_t k,
                              int64_t n, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = w + r * k;
    int64_t t = 0;
    for (; t + 4 <= tokens; t += 4) portable_dots<4>(x + t * k, row, y + t * n + r, k, n);
    if (t + 2 <= tokens) portable_dots<2>(x + t * k, row, y + t * n + r, k, n), t += 2;
    if (t < tokens) portable_dots<1>(x + t * k, row, y + t * n + r, k, n);
  }
}

// Below this many multiply-adds one thread does it all (handing work to the pool costs more).
constexpr int64_t kThreadedWork = 1 << 21;
// One token's x · W: W's rows in this many slices (2 and 4 measured level on 2 threads), split
// over threads from a weight of this many floats (256 KiB; every weight of GPT-2 124M is larger).
constexpr int64_t kSlices = 4;
constexpr int64_t kThreadedSlices = 1 << 16;

ffi::Error DenseMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> xb, ffi::Buffer<ffi::F32> wb,
                       ffi::Buffer<ffi::S32> layer_b, ffi::ResultBuffer<ffi::F32> out,
                       bool transposed, int32_t walk) {
  // W is [k, n] ([n, k] transposed), or a stack of them [layers, k, n] read at `layer` in place
  // (a stacked model's layer loop: no copy of the layer's slice).
  const auto dims = wb.dimensions();
  const int64_t stacked = dims.size() == 3 ? 1 : 0;
  if (dims.size() != 2 + stacked)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "dense matmul: W must be 2-D or 3-D");
  const int64_t tokens = xb.dimensions()[0], k = xb.dimensions()[1];
  const int64_t n = dims[stacked + (transposed ? 0 : 1)];
  if (dims[stacked + (transposed ? 1 : 0)] != k || out->dimensions()[0] != tokens ||
      out->dimensions()[1] != n)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "dense matmul: shapes do not agree");
  const int64_t layer = layer_b.typed_data()[0], layers = stacked ? dims[0] : 1;
  if (layer < 0 || layer >= layers)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "dense matmul: layer out of range");
  const float* x = xb.typed_data();
  const float* w = wb.typed_data() + layer * k * n;
  float* y = out->typed_data();
  // `walk` (dense.py's WALKS): 0 the CPU's fastest, 1 the AVX2 walk, 2 the plain C++ one.
  if (walk < 0 || walk > 2)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "dense matmul: walk must be 0 (fastest), 1 (avx2) or 2 (portable)");
  if (walk == 1 && !zoo_cpu::has_avx2_fma())
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "dense matmul: the avx2 walk needs a CPU with AVX2 and FMA");
  const bool fast = walk == 0 && zoo_cpu::has_avx512f();
  const bool avx2 = walk != 2 && !fast && zoo_cpu::has_avx2_fma();
  if (tokens == 1 && !transposed) {
    // The slices' partial outputs (zeroed here), added in slice order: the same sums on any
    // thread count.
    const int64_t slices = std::min(kSlices, k);
    std::vector<float> partial(slices * n);
    std::vector<int64_t> items(slices);
    for (int64_t s = 0; s < slices; ++s) items[s] = s;
    auto run = [&](const int64_t& s) {
      const int64_t i0 = s * k / slices, i1 = (s + 1) * k / slices;
      float* p = partial.data() + s * n;
      if (fast) slice_avx512(x, w, p, n, i0, i1);
      else if (avx2) slice_avx2(x, w, p, n, i0, i1);
      else portable_slice(x, w, p, n, i0, i1);
    };
    zoo_cpu::parallel(pool, k * n < kThreadedSlices ? 1 : pool.num_threads(), items, run);
    for (int64_t j = 0; j < n; ++j) {
      float sum = partial[j];
      for (int64_t s = 1; s < slices; ++s) sum += partial[s * n + j];
      y[j] = sum;
    }
    return ffi::Error::Success();
  }
  const int64_t threads =
      tokens * k * n < kThreadedWork ? 1 : std::max<int64_t>(pool.num_threads(), 1);
  // Whole panels (48 columns of W, or 48 rows of W^T) per item, about 4 items per thread for
  // W^T and 2 for W (longer runs along its rows), claimed as threads free up.
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t per_item = std::max<int64_t>(1, panels / ((transposed ? 4 : 2) * threads));
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t p = 0; p < panels; p += per_item)
    items.emplace_back(p * kPanel, std::min(n, (p + per_item) * kPanel));
  auto run = [&](const std::pair<int64_t, int64_t>& item) {
    if (fast && transposed) rows_avx512(x, w, y, tokens, k, n, item.first, item.second);
    else if (fast) columns_avx512(x, w, y, tokens, k, n, item.first, item.second);
    else if (avx2 && transposed) rows_avx2(x, w, y, tokens, k, n, item.first, item.second);
    else if (avx2) columns_avx2(x, w, y, tokens, k, n, item.first, item.second);
    else if (transposed) portable_rows(x, w, y, tokens, k, n, item.first, item.second);
    else portable_columns(x, w, y, tokens, k, n, item.first, item.second);
  };
  zoo_cpu::parallel(pool, threads, items, run);
  return ffi::Error::Success();
}

}  // namespace

void zoo_cpu::dense_rows_transposed(const float* x, const float* w, float* y, int64_t tokens,
                                    int64_t k, int64_t n, int64_t r0, int64_t r1, bool portable) {
  if (!portable && zoo_cpu::has_avx512f()) rows_avx512(x, w, y + r0, tokens, k, n, 0, r1 - r0);
  else if (!portable && zoo_cpu::has_avx2_fma()) rows_avx2(x, w, y + r0, tokens, k, n, 0, r1 - r0);
  else portable_rows(x, w, y + r0, tokens, k, n, 0, r1 - r0);
}

// The build `walk` 0 (the fastest) runs on this CPU: dense.py's token ranges depend on it.
extern "C" const char* ZooDenseFastestWalk() {
  return zoo_cpu::has_avx512f() ? "avx512" : zoo_cpu::has_avx2_fma() ? "avx2" : "portable";
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZooDenseMatmul, DenseMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transposed")
                                  .Attr<int32_t>("walk"));
