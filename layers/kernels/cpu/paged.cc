// Paged attention on a CPU (paged.py: `cpu_paged_decode`): each query token of a row (one in a
// decode step, a prompt chunk's in a prefill step) attends over the keys its page table holds
// that it sees, read in place from the pool. The XLA path
// (layers/kernels/paged/blocked.py) gathers each block of pages into a copy and transposes it
// for XLA:CPU's batched products; here each (row, K/V head) is one item of XLA's thread pool,
// reading its pages in place, once for the whole group of query heads that share them (GQA),
// for one query token at a time: a token's output depends on its position, its row's pages and
// the pool alone, never on the other tokens of the call (a prompt chunk's token gets the bits
// it would get decoding at that position), with an online softmax (running max, denominator and unnormalised output per head, rescaled
// once per page; Milakov & Gimelshein 2018).
//
// With AVX-512 a page's scores are computed 16 keys at a time and its exponentials in 16 lanes
// (`row_head_avx512`), with AVX2 8 at a time in 8 lanes (`row_head_avx2`); other CPUs, and
// `portable`, take one key at a time (`row_head`). They sum in different orders: they agree to
// float32 rounding, not bit for bit.
//
// Visibility is `pages.visible`: the key at position j is seen by the query at position i iff
// j <= i, j < length (clamped to the row's table) and (no window or i - j < window); a query
// that sees no key (a negative position, an idle row) outputs 0. Scores are q · k / sqrt(d),
// then softcap * tanh(s / softcap) when softcap > 0 (Gemma 2).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "avx512.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The portable path's 16-lane sums are written lane by lane so that the compiler vectorizes them
// without reordering a sum it was not given (the library is built with -ffp-contract=off); its
// clones (avx512.h's ZOO_CLONES) give AVX-512 CPUs 16-float vectors, AVX2 ones 8 and the rest
// the baseline's 4.
constexpr int kLanes = 16;

inline float dot(const float* a, const float* b, int64_t d) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[i + l] * b[i + l];
  float sum = 0.0f;
  for (; i < d; ++i) sum += a[i] * b[i];
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

// out[0, d) += weight * v.
inline void add_scaled(float* out, float weight, const float* v, int64_t d) {
  for (int64_t i = 0; i < d; ++i) out[i] += weight * v[i];
}

struct Shapes {
  int64_t heads, kv_heads, head_dim, pages, page_size, row_pages;
};

// The keys row `b` sees with its query at `q_pos`: [lo, hi) (empty: it sees none).
inline std::pair<int64_t, int64_t> visible(int64_t length, int64_t q_pos, int64_t window,
                                           const Shapes& s) {
  const int64_t hi = std::min({q_pos + 1, length, s.row_pages * s.page_size});
  const int64_t lo = window > 0 ? std::max<int64_t>(0, q_pos - window + 1) : 0;
  return q_pos < 0 ? std::pair<int64_t, int64_t>{0, 0} : std::pair{lo, hi};
}

// An id outside the pool (undefined under jit, as for the XLA path) is clamped into it, as XLA's
// gather clamps, never read past the buffer.
inline int64_t page_at(const int32_t* table, int64_t first, const Shapes& s) {
  return std::clamp<int64_t>(table[first / s.page_size], 0, s.pages - 1);
}

// A query token of row `b`, K/V head `kv`: the group's outputs o[b, i, kv * group + g, :], one key at a time (the
// portable path).
ZOO_CLONES void row_head(const float* q, const float* k_pool, const float* v_pool,
                         const int32_t* table, int64_t length, int64_t q_pos, int64_t window,
                         float softcap, const Shapes& s, float* o) {
  const int64_t group = s.heads / s.kv_heads, d = s.head_dim, ps = s.page_size;
  std::fill(o, o + group * d, 0.0f);
  const auto [lo, hi] = visible(length, q_pos, window, s);
  if (lo >= hi) return;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> qs(group * d), scores(ps);
  for (int64_t i = 0; i < group * d; ++i) qs[i] = q[i] * scale;
  std::vector<float> top(group, -std::numeric_limits<float>::infinity()), denom(group, 0.0f);
  for (int64_t first = lo / ps * ps; first < hi; first += ps) {
    const int64_t page = page_at(table, first, s);
    const int64_t j0 = std::max(lo, first), j1 = std::min(hi, first + ps);
    const float* keys = k_pool + page * ps * d;
    const float* values = v_pool + page * ps * d;
    for (int64_t g = 0; g < group; ++g) {
      float* sc = scores.data();
      float page_top = top[g];
      for (int64_t j = j0; j < j1; ++j) {
        float x = dot(qs.data() + g * d, keys + (j - first) * d, d);
        if (softcap > 0.0f) x = softcap * std::tanh(x / softcap);
        sc[j - j0] = x;
        page_top = std::max(page_top, x);
      }
      const float rescale = std::exp(top[g] - page_top);
      float* out = o + g * d;
      for (int64_t i = 0; i < d; ++i) out[i] *= rescale;
      float sum = 0.0f;
      for (int64_t j = j0; j < j1; ++j) {
        const float weight = std::exp(sc[j - j0] - page_top);
        sum += weight;
        add_scaled(out, weight, values + (j - first) * d, d);
      }
      denom[g] = denom[g] * rescale + sum;
      top[g] = page_top;
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < d; ++i) o[g * d + i] /= denom[g];
}

#if defined(__x86_64__) && defined(__GNUC__)
using zoo_cpu::first_lanes;
#define ZOO_AVX512 __attribute__((target("avx512f")))

// e^x in 16 lanes for x <= 0 (Cephes' expf: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by its
// degree-6 polynomial, times 2^n by scalef; x below -87.3, where e^x leaves the normal floats, is
// taken as -87.3). Measured against the double-precision e^x at 4 x 10^6 points of [-87.3, 0]:
// at most 1.25 ulp, a relative error under float32's epsilon, as one more rounding per weight.
ZOO_AVX512 inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3365447f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// Lane t of the result: the sum of a[t]'s 16 lanes (a transpose by shuffles, adding as it goes:
// 15 adds for 16 sums where 16 horizontal sums take 64).
ZOO_AVX512 inline __m512 sums16(const __m512 a[16]) {
  __m512 b[8], c[4];
  // b[t]: a[t]'s 16 lanes added to 8 (in the low 256 bits), a[t + 8]'s (in the high).
  for (int t = 0; t < 8; ++t)
    b[t] = _mm512_add_ps(_mm512_shuffle_f32x4(a[t], a[t + 8], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[t], a[t + 8], _MM_SHUFFLE(3, 2, 3, 2)));
  // c[t]: 4 partial sums of a[t], a[t + 8], a[t + 4], a[t + 12], one per 128-bit lane.
  for (int t = 0; t < 4; ++t)
    c[t] = _mm512_add_ps(_mm512_shuffle_f32x4(b[t], b[t + 4], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[t], b[t + 4], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 d0 = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
  const __m512 d1 = _mm512_add_ps(_mm512_unpacklo_ps(c[2], c[3]), _mm512_unpackhi_ps(c[2], c[3]));
  // The sums of keys 0-3, 8-11, 4-7 and 12-15 by 128-bit lane, put in order.
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d0, d1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(d0, d1, _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_shuffle_f32x4(e, e, _MM_SHUFFLE(3, 1, 2, 0));
}

// Pages requested into L2 ahead of the one being read.
constexpr int64_t kPagesAhead = 1;

// Request the keys and values of the page `kPagesAhead` after the one at `first` into L2, if
// the row sees it: pages lie anywhere in the pool, so no hardware prefetcher guesses the next.
// Inlined by force: GCC takes a called function that only reads and prefetches for one without
// effects and drops the call (it did, until this attribute).
inline __attribute__((always_inline)) void prefetch_page_ahead(
    const float* k_pool, const float* v_pool, const int32_t* table, int64_t first, int64_t hi,
    const Shapes& s) {
  const int64_t ps = s.page_size, d = s.head_dim;
  if (first + kPagesAhead * ps >= hi) return;
  const int64_t next = page_at(table, first + kPagesAhead * ps, s) * ps * d;
  for (int64_t i = 0; i < ps * d; i += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(k_pool + next + i), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(v_pool + next + i), _MM_HINT_T1);
  }
}
// Query heads whose outputs take a page's values together, 4 vectors (64 floats) of each at a
// time: 16 accumulators and 4 value vectors in registers.
constexpr int64_t kHeadsAtOnce = 4;
constexpr int kVectorsAtOnce = 4;

// `row_head` in 16-float vectors: a page's scores 16 keys at a time (each key's dot product
// with the query head in a vector, 16 of them summed by `sums16`), their exponentials in 16
// lanes, and the values added into the output 64 floats (4 vectors) at a time.
ZOO_AVX512 void row_head_avx512(const float* q, const float* k_pool, const float* v_pool,
                                const int32_t* table, int64_t length, int64_t q_pos,
                                int64_t window, float softcap, const Shapes& s, float* o) {
  const int64_t group = s.heads / s.kv_heads, d = s.head_dim, ps = s.page_size;
  std::fill(o, o + group * d, 0.0f);
  const auto [lo, hi] = visible(length, q_pos, window, s);
  if (lo >= hi) return;
  const int64_t vectors = (d + 15) / 16;  // vector v holds lanes first_lanes(d - 16 * v)
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t stride = (ps + 15) / 16 * 16;  // a head's scores, 16 lanes a store
  std::vector<float> qs(group * d), scores(group * stride);
  for (int64_t i = 0; i < group * d; ++i) qs[i] = q[i] * scale;
  std::vector<float> top(group, -std::numeric_limits<float>::infinity()), denom(group, 0.0f),
      rescale(group);
  for (int64_t first = lo / ps * ps; first < hi; first += ps) {
    const int64_t page = page_at(table, first, s);
    const int64_t j0 = std::max(lo, first), n = std::min(hi, first + ps) - j0;
    const float* keys = k_pool + (page * ps + j0 - first) * d;
    const float* values = v_pool + (page * ps + j0 - first) * d;
    prefetch_page_ahead(k_pool, v_pool, table, first, hi, s);
    // Every head's scores, then its weights (the page's exponentials), then the values added
    // for up to 4 heads at once: the heads' chains interleave, and each value vector is loaded
    // once for them.
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qs.data() + g * d;
      float* sc = scores.data() + g * stride;
      __m512 most = _mm512_set1_ps(top[g]);
      for (int64_t jb = 0; jb < n; jb += 16) {
        const int64_t nk = std::min<int64_t>(16, n - jb);
        __m512 acc[16];
        for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
        for (int64_t v = 0; v < vectors; ++v) {
          const __mmask16 m = first_lanes(d - 16 * v);
          const __m512 qv = _mm512_maskz_loadu_ps(m, qg + 16 * v);
          const float* k = keys + jb * d + 16 * v;
          _Pragma("GCC unroll 16")
          for (int t = 0; t < 16; ++t)
            if (t < nk) acc[t] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, k + t * d), acc[t]);
        }
        _mm512_storeu_ps(sc + jb, sums16(acc));
        if (softcap > 0.0f)
          for (int64_t t = 0; t < nk; ++t) sc[jb + t] = softcap * std::tanh(sc[jb + t] / softcap);
        most = _mm512_mask_max_ps(most, first_lanes(nk), most, _mm512_loadu_ps(sc + jb));
      }
      const float page_top = _mm512_reduce_max_ps(most);
      rescale[g] = std::exp(top[g] - page_top);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t jb = 0; jb < n; jb += 16) {
        const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(sc + jb), _mm512_set1_ps(page_top));
        const __m512 w = _mm512_maskz_mov_ps(first_lanes(n - jb), exp_nonpositive(x));
        sum = _mm512_add_ps(sum, w);
        _mm512_storeu_ps(sc + jb, w);
      }
      denom[g] = denom[g] * rescale[g] + _mm512_reduce_add_ps(sum);
      top[g] = page_top;
    }
    for (int64_t g0 = 0; g0 < group; g0 += kHeadsAtOnce) {
      const int64_t heads = std::min(kHeadsAtOnce, group - g0);
      for (int64_t v0 = 0; v0 < vectors; v0 += kVectorsAtOnce) {
        __m512 acc[kHeadsAtOnce][kVectorsAtOnce];
        __mmask16 m[kVectorsAtOnce];
        for (int u = 0; u < kVectorsAtOnce; ++u) m[u] = first_lanes(d - 16 * (v0 + u));
        for (int h = 0; h < kHeadsAtOnce; ++h)
          for (int u = 0; u < kVectorsAtOnce; ++u)
            if (h < heads)
              acc[h][u] = _mm512_mul_ps(_mm512_maskz_loadu_ps(m[u], o + (g0 + h) * d + 16 * (v0 + u)),
                                        _mm512_set1_ps(rescale[g0 + h]));
        for (int64_t t = 0; t < n; ++t) {
          __m512 value[kVectorsAtOnce];
          for (int u = 0; u < kVectorsAtOnce; ++u)
            value[u] = _mm512_maskz_loadu_ps(m[u], values + t * d + 16 * (v0 + u));
          _Pragma("GCC unroll 4")
          for (int h = 0; h < kHeadsAtOnce; ++h)
            if (h < heads) {
              const __m512 w = _mm512_set1_ps(scores[(g0 + h) * stride + t]);
              for (int u = 0; u < kVectorsAtOnce; ++u)
                acc[h][u] = _mm512_fmadd_ps(w, value[u], acc[h][u]);
            }
        }
        for (int h = 0; h < kHeadsAtOnce; ++h)
          for (int u = 0; u < kVectorsAtOnce; ++u)
            if (h < heads)
              _mm512_mask_storeu_ps(o + (g0 + h) * d + 16 * (v0 + u), m[u], acc[h][u]);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < d; ++i) o[g * d + i] /= denom[g];
}

#define ZOO_AVX2 __attribute__((target("avx2,fma")))
using zoo_cpu::first_lanes8;
using zoo_cpu::sum_lanes8;

// `exp_nonpositive` in 8 lanes: the same polynomial, and 2^n written into the exponent bits
// (n >= -126 here, a normal float) where AVX-512 scales by it: both are p * 2^n rounded once,
// so the two give the same weights.
ZOO_AVX2 inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365447f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(exponent, 23)));
}

// Lane t of the result: the sum of a[t]'s 8 lanes (horizontal adds of pairs, then the halves).
ZOO_AVX2 inline __m256 sums8(const __m256 a[8]) {
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // low: a[0..3]'s lanes 0-3 summed, then their lanes 4-7; high: a[4..7]'s.
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                       _mm256_permute2f128_ps(low, high, 0x31));
}

// p[0, n) as a vector (lanes past n zero, not read).
ZOO_AVX2 inline __m256 load8(const float* p, int64_t n) {
  return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, first_lanes8(n));
}

ZOO_AVX2 inline void store8(float* p, int64_t n, __m256 v) {
  if (n >= 8) _mm256_storeu_ps(p, v);
  else _mm256_maskstore_ps(p, first_lanes8(n), v);
}

ZOO_AVX2 inline float max_lanes8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// AVX2's 16 registers: 2 heads by 4 vectors of outputs, 4 value vectors and a weight.
constexpr int64_t kHeadsAtOnce8 = 2;
constexpr int kVectorsAtOnce8 = 4;

// `row_head_avx512` in 8-float vectors: a page's scores 8 keys at a time (`sums8`), their
// exponentials in 8 lanes, and the values added into 2 heads' outputs 32 floats at a time.
ZOO_AVX2 void row_head_avx2(const float* q, const float* k_pool, const float* v_pool,
                            const int32_t* table, int64_t length, int64_t q_pos, int64_t window,
                            float softcap, const Shapes& s, float* o) {
  const int64_t group = s.heads / s.kv_heads, d = s.head_dim, ps = s.page_size;
  std::fill(o, o + group * d, 0.0f);
  const auto [lo, hi] = visible(length, q_pos, window, s);
  if (lo >= hi) return;
  const int64_t vectors = (d + 7) / 8;  // vector v holds d - 8 v of its lanes (at most 8)
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t stride = (ps + 7) / 8 * 8;  // a head's scores, 8 lanes a store
  std::vector<float> qs(group * d), scores(group * stride);
  for (int64_t i = 0; i < group * d; ++i) qs[i] = q[i] * scale;
  std::vector<float> top(group, -std::numeric_limits<float>::infinity()), denom(group, 0.0f),
      rescale(group);
  const __m256 minus_infinity = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t first = lo / ps * ps; first < hi; first += ps) {
    const int64_t page = page_at(table, first, s);
    const int64_t j0 = std::max(lo, first), n = std::min(hi, first + ps) - j0;
    const float* keys = k_pool + (page * ps + j0 - first) * d;
    const float* values = v_pool + (page * ps + j0 - first) * d;
    prefetch_page_ahead(k_pool, v_pool, table, first, hi, s);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qs.data() + g * d;
      float* sc = scores.data() + g * stride;
      __m256 most = _mm256_set1_ps(top[g]);
      for (int64_t jb = 0; jb < n; jb += 8) {
        const int64_t nk = std::min<int64_t>(8, n - jb);
        __m256 acc[8];
        for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
        for (int64_t v = 0; v < vectors; ++v) {
          const __m256 qv = load8(qg + 8 * v, d - 8 * v);
          const float* k = keys + jb * d + 8 * v;
          _Pragma("GCC unroll 8")
          for (int t = 0; t < 8; ++t)
            if (t < nk) acc[t] = _mm256_fmadd_ps(qv, load8(k + t * d, d - 8 * v), acc[t]);
        }
        _mm256_storeu_ps(sc + jb, sums8(acc));
        if (softcap > 0.0f)
          for (int64_t t = 0; t < nk; ++t) sc[jb + t] = softcap * std::tanh(sc[jb + t] / softcap);
        const __m256 seen = _mm256_castsi256_ps(first_lanes8(nk));
        most = _mm256_max_ps(most, _mm256_blendv_ps(minus_infinity, _mm256_loadu_ps(sc + jb), seen));
      }
      const float page_top = max_lanes8(most);
      rescale[g] = std::exp(top[g] - page_top);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t jb = 0; jb < n; jb += 8) {
        const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(sc + jb), _mm256_set1_ps(page_top));
        // Lanes past the page's keys hold stale scores: their weights are zeroed, never used.
        const __m256 w = _mm256_and_ps(exp_nonpositive8(x),
                                       _mm256_castsi256_ps(first_lanes8(n - jb)));
        sum = _mm256_add_ps(sum, w);
        _mm256_storeu_ps(sc + jb, w);
      }
      denom[g] = denom[g] * rescale[g] + sum_lanes8(sum);
      top[g] = page_top;
    }
    for (int64_t g0 = 0; g0 < group; g0 += kHeadsAtOnce8) {
      const int64_t heads = std::min(kHeadsAtOnce8, group - g0);
      for (int64_t v0 = 0; v0 < vectors; v0 += kVectorsAtOnce8) {
        __m256 acc[kHeadsAtOnce8][kVectorsAtOnce8];
        int64_t lanes[kVectorsAtOnce8];
        for (int u = 0; u < kVectorsAtOnce8; ++u) lanes[u] = d - 8 * (v0 + u);
        for (int h = 0; h < kHeadsAtOnce8; ++h)
          for (int u = 0; u < kVectorsAtOnce8; ++u)
            if (h < heads)
              acc[h][u] = _mm256_mul_ps(load8(o + (g0 + h) * d + 8 * (v0 + u), lanes[u]),
                                        _mm256_set1_ps(rescale[g0 + h]));
        for (int64_t t = 0; t < n; ++t) {
          __m256 value[kVectorsAtOnce8];
          for (int u = 0; u < kVectorsAtOnce8; ++u)
            value[u] = load8(values + t * d + 8 * (v0 + u), lanes[u]);
          for (int h = 0; h < kHeadsAtOnce8; ++h)
            if (h < heads) {
              const __m256 w = _mm256_set1_ps(scores[(g0 + h) * stride + t]);
              for (int u = 0; u < kVectorsAtOnce8; ++u)
                acc[h][u] = _mm256_fmadd_ps(w, value[u], acc[h][u]);
            }
        }
        for (int h = 0; h < kHeadsAtOnce8; ++h)
          for (int u = 0; u < kVectorsAtOnce8; ++u)
            if (h < heads) store8(o + (g0 + h) * d + 8 * (v0 + u), lanes[u], acc[h][u]);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < d; ++i) o[g * d + i] /= denom[g];
}
#else
void row_head_avx512(const float*, const float*, const float*, const int32_t*, int64_t, int64_t,
                     int64_t, float, const Shapes&, float*) {}
void row_head_avx2(const float*, const float*, const float*, const int32_t*, int64_t, int64_t,
                   int64_t, float, const Shapes&, float*) {}
#endif

ffi::Error PagedDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                       ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> page_table,
                       ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> q_positions,
                       ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> window,
                       ffi::ResultBuffer<ffi::F32> out, float softcap, int32_t walk) {
  const auto qd = q.dimensions(), pd = k_pages.dimensions();
  const int64_t rank = static_cast<int64_t>(pd.size());
  if (qd.size() != 4 || (rank != 4 && rank != 5))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "paged decode: q must be [batch, seq, heads, head_dim] and the pools "
                      "[(layers,) kv_heads, pages, page_size, head_dim]");
  const Shapes s{qd[2], pd[rank - 4], qd[3], pd[rank - 3], pd[rank - 2],
                 page_table.dimensions()[1]};
  const int64_t batch = qd[0], seq = qd[1], layers = rank == 5 ? pd[0] : 1;
  const int64_t at = rank == 5 ? layer.typed_data()[0] : 0;
  if (at < 0 || at >= layers)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "paged decode: layer index out of range");
  const int64_t pool_size = s.kv_heads * s.pages * s.page_size * s.head_dim;
  const int64_t head_size = s.pages * s.page_size * s.head_dim;
  const float* k_base = k_pages.typed_data() + at * pool_size;
  const float* v_base = v_pages.typed_data() + at * pool_size;
  const int64_t win = window.typed_data()[0];
  const int64_t group = s.heads / s.kv_heads;
  // `walk` (paged.py's WALKS): 0 the CPU's fastest, 1 the AVX2 path, 2 the plain C++ one.
  if (walk < 0 || walk > 2)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "paged decode: walk must be 0 (fastest), 1 (avx2) or 2 (portable)");
  if (walk == 1 && !zoo_cpu::has_avx2_fma())
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "paged decode: the avx2 walk needs a CPU with AVX2 and FMA");
  const bool fast = walk == 0 && zoo_cpu::has_avx512f();
  const bool avx2 = walk != 2 && !fast && zoo_cpu::has_avx2_fma();
  // Items: (query token, K/V head), the token b * seq + i of row b.
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t t = 0; t < batch * seq; ++t)
    for (int64_t kv = 0; kv < s.kv_heads; ++kv) items.emplace_back(t, kv);
  auto run = [&](const std::pair<int64_t, int64_t>& item) {
    const auto [t, kv] = item;
    const int64_t b = t / seq, offset = (t * s.heads + kv * group) * s.head_dim;
    (fast ? row_head_avx512 : avx2 ? row_head_avx2 : row_head)(
        q.typed_data() + offset, k_base + kv * head_size, v_base + kv * head_size,
        page_table.typed_data() + b * s.row_pages, lengths.typed_data()[b],
        q_positions.typed_data()[t], win, softcap, s, out->typed_data() + offset);
  };
  zoo_cpu::parallel(pool, std::max<int64_t>(pool.num_threads(), 1), items, run);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZooPagedDecode, PagedDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("softcap")
                                  .Attr<int32_t>("walk"));
