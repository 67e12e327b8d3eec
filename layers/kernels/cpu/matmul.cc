// y = x · W^T for a weight W [N, K] held in packed blocks, dequantized in registers: the CPU
// kernel of layers/kernels/quantized (called through jax.ffi; built by build.py). A second
// target, ZooQuantizedDequantize, writes W out as float32, equal bit for bit to
// PackedWeight.dequantize: for many tokens (prefill) one XLA dot on it is faster than this
// kernel, and XLA:CPU compiles one call in far less time than a fusion of bit operations per
// weight.
//
// XLA:CPU does not fuse an int8 -> float convert into a matrix-vector product (bench/
// quantized_kernels.py measures it ~10x slower than float32), so decode with quantized weights
// needs this: each 32-weight chunk of a row is loaded as its codes, turned into floats in
// registers and multiplied into every token's accumulator; no float copy of W is written.
// Decode reads each weight once per step, so 1/2 to 1 byte per weight instead of 4 is the gain.
//
// Formats (a row holds K weights along the input, K % 32 == 0; a group of G consecutive weights
// shares a scale and, where present, a minimum; G == 16 or G % 32 == 0; the arrays are
// layers/quantized/formats.py's):
//   "i8":  codes int8 [N, K]; scales f32|f16 [N, K/G].             w = code * scale
//   "u4":  codes u8 [N, K/2], 16 bytes per 32 weights (byte j: weight j in the low nibble,
//          j + 16 in the high one); scales f32|f16 [N, K/G]; mins f32|f16 [N, K/G] (optional);
//          table f32 [16], the level of each code.                   w = table[code] * scale
//          (+ min); `linear`: table[c] == c + offset, computed instead of looked up
//   "q4k": codes as "u4"; sub-scales and sub-mins u8 [N, K/32]; d and dmin f16 [N, K/256]
//          (llama.cpp's Q4_K).                                        w = d sc code - dmin m
//   "q6k": low 4 bits as "u4" [N, K/2]; high 2 bits u8 [N, K/4], 4 bytes per 16 weights (byte b
//          holds weights b, b + 4, b + 8, b + 12 in bit pairs 0, 2, 4, 6); sub-scales int8
//          [N, K/16]; d f16 [N, K/256] (llama.cpp's Q6_K).            w = d sc (code - 32)
// An expert-stacked weight [E, N, ...] with `group_sizes` [E] runs each expert on its own rows
// of x (sorted by expert, as jax.lax.ragged_dot takes them); experts with no rows are not read.
//
// The sum is reordered: y = sum_g s_g (sum_{i in g} code_i x_i) + sum_g (min_g + offset s_g)
// sum_{i in g} x_i, so a group's scale multiplies once per token and the minimums meet the
// per-group sums of x (computed once per call) sixteen groups at a time.
//
// Activations (`int8` true): x is first rounded per 32 inputs to int8 codes and a float32 step
// (llama.cpp's Q8_0 activations: d = max|x| / 127, q = round(x / d) computed as x * (1 / d)),
// and every path computes x̂ · W^T with x̂ = q d. Where the CPU has AVX-512 VNNI the products of
// codes then run in integers (vpdpbusd: 64 byte products a instruction, int32 sums, exact) and
// each 32-input chunk's sum is scaled once by its weight scale times its d: the 4-bit codes are
// split into bytes by two instructions and never become floats, which is what made the float
// path compute-bound. x's codes are laid out once per call in the order the weights' bytes come
// in (4-bit: per 4 chunks, the 64 low nibbles' inputs then the 64 high nibbles'), so no weight
// is ever moved. `int8` false: x as given, through the float path.
//
// Code paths: AVX-512 VNNI integer products (int8 activations; i8, linear u4, q4k, q6k with
// group 16, 32, 64 or a multiple of 128 or a single group per row), AVX-512 float (NF4's table,
// other groups, float activations; groups of 32 a few rows at a time, `rows_g32_avx512`; from
// kBlockTokens tokens, 32 for groups of 32, a block of rows dequantized into an L2 buffer and
// multiplied by every token with dense.cc's walk), and on other CPUs the same at every token
// count: the block dequantized with AVX2 where the CPU has it (but a 4-bit table's),
// else in plain C++ the compiler vectorizes (avx512.h's ZOO_CLONES), then dense.cc's plain walk;
// no float copy of W either. Each is chosen at run time by what the CPU has; `portable` takes
// the plain C++ of both (a test of it).
//
// Threads: rows are split into work items taken from an atomic counter by the calling thread
// and by tasks on XLA's intra-op thread pool; a task that starts after the work is gone returns
// at once (its state is shared-owned, so it never touches a finished call).

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string_view>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "avx512.h"
#include "dense.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

enum class Kind { kInt8, kInt4, kInt4K, kInt6K };
enum class Type { kF32, kF16, kU8, kI8 };

// One expert's weight: pointers to row 0 of each array and the format's constants.
struct Weight {
  Kind kind;
  int64_t k, group;
  const uint8_t* codes;  // int8 / packed 4-bit / Q6_K's low nibbles
  const uint8_t* high;   // Q6_K: the high 2-bit planes
  const void* scales;    // [N, K/G]; k-quants: the sub-scales
  const void* mins;      // [N, K/G] or null; Q4_K: the sub-mins
  const uint16_t* super_scales;  // k-quants: d [N, K/256]
  const uint16_t* super_mins;    // Q4_K: dmin [N, K/256]
  Type scale_type, min_type;
  const float* table;  // 4-bit levels (16)
  bool linear;         // table[c] == c + offset
  float offset;        // added to every code: Q4_0's -8, Q6_K's -32 (through the scale)
  int64_t codes_row() const { return kind == Kind::kInt8 ? k : k / 2; }
  int64_t groups() const { return k / group; }
};

inline float half(uint16_t h) {
  _Float16 f;
  std::memcpy(&f, &h, 2);
  return static_cast<float>(f);
}

inline float element(const void* p, Type t, int64_t i) {
  switch (t) {
    case Type::kF32: return static_cast<const float*>(p)[i];
    case Type::kF16: return half(static_cast<const uint16_t*>(p)[i]);
    case Type::kU8: return static_cast<const uint8_t*>(p)[i];
    case Type::kI8: return static_cast<const int8_t*>(p)[i];
  }
  return 0.0f;
}

// Scale and minimum (offset included) of group g of row n.
inline float scale_of(const Weight& w, int64_t n, int64_t g) {
  float s = element(w.scales, w.scale_type, n * w.groups() + g);
  if (w.super_scales) s *= half(w.super_scales[n * (w.k / 256) + g * w.group / 256]);
  return s;
}

inline float min_of(const Weight& w, int64_t n, int64_t g) {
  if (!w.mins) return 0.0f;
  float m = element(w.mins, w.min_type, n * w.groups() + g);
  if (w.super_mins) m = -m * half(w.super_mins[n * (w.k / 256) + g * w.group / 256]);
  return m;
}

// --- int8 activations ------------------------------------------------------------------------

// One 32-input chunk of x rounded to int8: d = max|x| / 127, q = round-half-even(x * (1 / d))
// in [-127, 127] (0 where d == 0). Adding and subtracting 1.5 * 2^23 rounds a float of
// magnitude < 2^22 to the nearest integer, ties to even (the default rounding mode), in
// plain arithmetic the compiler vectorizes. ops.py's `quantize_activations` is the same
// computation in JAX (the specification the tests hold the kernel to).
float round_chunk(const float* x, int8_t* q) {
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.0f;
  const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  for (int i = 0; i < 32; ++i) {
    const float r = (x[i] * inverse + kMagic) - kMagic;
    q[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
  }
  return d;
}

// --- portable path: rows dequantized in plain C++ that the compiler vectorizes --------------

// The codes of chunk c (weights 32c .. 32c + 31) of a row, before table, offset and scale: int8
// codes as they are; 4-bit ones from byte j's low nibble (weight j) and high one (j + 16); Q6_K's
// with the 2 high bits of weight j of each 16 from bit pair (j / 4) of its planes' byte j % 4.
template <Kind kKind>
inline __attribute__((always_inline)) void chunk_codes(const uint8_t* codes, const uint8_t* high,
                                                       int64_t c, int32_t* out) {
  if constexpr (kKind == Kind::kInt8) {
    const int8_t* chunk = reinterpret_cast<const int8_t*>(codes) + 32 * c;
    for (int i = 0; i < 32; ++i) out[i] = chunk[i];
  } else {
    const uint8_t* bytes = codes + 16 * c;
    for (int i = 0; i < 16; ++i) out[i] = bytes[i] & 15;
    for (int i = 0; i < 16; ++i) out[16 + i] = bytes[i] >> 4;
    if constexpr (kKind == Kind::kInt6K) {  // 8 bytes of 2-bit planes per chunk
      const uint8_t* planes = high + 8 * c;
      for (int i = 0; i < 32; ++i)
        out[i] |= ((planes[(i / 16) * 4 + i % 4] >> (2 * ((i % 16) / 4))) & 3) << 4;
    }
  }
}

// Rows [n0, n1) of W as floats (dequantize_avx512's contract, bit for bit: level * scale, then
// + minimum where the format has one), a chunk of 32 codes at a time.
template <Kind kKind, bool kTable>
inline __attribute__((always_inline)) void dequantize_rows(const Weight& w, float* out, int64_t n0,
                                                           int64_t n1, int64_t first) {
  // Locals, not w's fields: a store to `out` could alias them and have them read again.
  const int64_t k = w.k;
  const float offset = w.offset;
  float table[16];
  if (kTable) std::memcpy(table, w.table, sizeof table);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* codes = w.codes + n * w.codes_row();
    const uint8_t* high = w.high ? w.high + n * (k / 4) : nullptr;
    float* __restrict row = out + (n - first) * k;
    for (int64_t c = 0; c < k / 32; ++c) {
      int32_t code[32];
      chunk_codes<kKind>(codes, high, c, code);
      float level[32];
      for (int i = 0; i < 32; ++i)
        level[i] = kTable ? table[code[i]] : code[i] + offset;  // equal where `linear`
      for (int half = 0; half < 2; ++half) {  // a chunk's halves are two groups when G == 16
        const int64_t g = (32 * c + 16 * half) / w.group;
        const float s = scale_of(w, n, g), m = min_of(w, n, g);
        float* __restrict o = row + 32 * c + 16 * half;
        const float* l = level + 16 * half;
        if (w.mins) {
          for (int i = 0; i < 16; ++i) o[i] = l[i] * s + m;
        } else {
          for (int i = 0; i < 16; ++i) o[i] = l[i] * s;
        }
      }
    }
  }
}

ZOO_CLONES void dequantize_portable(const Weight& w, float* out, int64_t n0, int64_t n1,
                                    int64_t first) {
  switch (w.kind) {
    case Kind::kInt8: return dequantize_rows<Kind::kInt8, false>(w, out, n0, n1, first);
    case Kind::kInt4:
      if (w.linear) return dequantize_rows<Kind::kInt4, false>(w, out, n0, n1, first);
      return dequantize_rows<Kind::kInt4, true>(w, out, n0, n1, first);
    case Kind::kInt4K: return dequantize_rows<Kind::kInt4K, false>(w, out, n0, n1, first);
    case Kind::kInt6K: return dequantize_rows<Kind::kInt6K, false>(w, out, n0, n1, first);
  }
}

// x rounded to int8 per 32-input chunk, laid out for the VNNI path: `ordered` [tokens, blocks
// * 128] bytes, a block being 4 chunks; 4-bit formats: a block's 16 inputs 0..15 of each chunk
// (what the low nibbles multiply) then its inputs 16..31 (the high nibbles'); int8 weights:
// natural order, q + 128 (the unsigned side of vpdpbusd). `lanes` [tokens, blocks, 16 or 32]:
// the step d of the chunk each int32 lane of a product sums.
struct Ordered {
  int64_t blocks, lanes_per_block;
  const uint8_t* codes;  // token 0 of the rows this call runs
  const float* lanes;
};

// x̂ for the sixteen-rows path (rows_by_lanes): codes in natural order [tokens, K], and per
// token and chunk its step d, its sum of x̂ (what the minimum multiplies) and, for int8
// weights, -128 times its sum of codes.
struct LaneInput {
  const int8_t* q;
  const float* d;
  const float* xsum;
  const int32_t* bias;  // int8 weights are stored + 128 (unsigned): -128 sum(q) restores them
  int64_t k, chunks;
};

// --- AVX-512 path ---------------------------------------------------------------------------

#if defined(__x86_64__)
#define ZOO_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

ZOO_AVX512 inline __m512 load_groups(const void* p, Type t, int64_t count) {
  const __mmask16 mask = zoo_cpu::first_lanes(count);
  switch (t) {
    case Type::kF32: return _mm512_maskz_loadu_ps(mask, p);
    case Type::kF16: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
    case Type::kU8: return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, p)));
    case Type::kI8: return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, p)));
  }
  return _mm512_setzero_ps();
}

inline const uint8_t* element_at(const void* p, Type t, int64_t i) {
  const int64_t size = (t == Type::kF32) ? 4 : (t == Type::kF16) ? 2 : 1;
  return static_cast<const uint8_t*>(p) + i * size;
}

// The 16 (or `count`) scales and minimums of groups g0 .. g0 + 15 of row n (g0 % 16 == 0).
ZOO_AVX512 inline void group_constants(const Weight& w, int64_t n, int64_t g0, int64_t count,
                                       __m512& s, __m512& m) {
  const int64_t at = n * w.groups() + g0;
  s = load_groups(element_at(w.scales, w.scale_type, at), w.scale_type, count);
  m = _mm512_setzero_ps();
  if (w.mins) m = load_groups(element_at(w.mins, w.min_type, at), w.min_type, count);
  if (w.super_scales) {  // groups per super-block (8 or 16) divides 16: lane j's is j / ratio
    const int64_t ratio = 256 / w.group, first = n * (w.k / 256) + g0 / ratio;
    const int64_t supers = (count + ratio - 1) / ratio;
    const __m512i index = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), ratio == 8 ? 3 : 4);
    const __m512 d = _mm512_permutexvar_ps(index, load_groups(w.super_scales + first, Type::kF16, supers));
    s = _mm512_mul_ps(s, d);
    if (w.super_mins) {
      const __m512 dmin = _mm512_permutexvar_ps(index, load_groups(w.super_mins + first, Type::kF16, supers));
      m = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(m, dmin));
    }
  }
  if (w.offset != 0.0f) m = _mm512_fmadd_ps(s, _mm512_set1_ps(w.offset), m);
}

// Chunk c (weights 32c .. 32c + 31) of a row's codes as floats: `lo` the first 16, `hi` the rest.
template <Kind kKind, bool kTable>
ZOO_AVX512 inline void chunk(const Weight& w, const uint8_t* codes, const uint8_t* high,
                             __m512 table, int64_t c, __m512& lo, __m512& hi) {
  if constexpr (kKind == Kind::kInt8) {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 32 * c))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 32 * c + 16))));
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * c));
    const __m128i nibble = _mm_set1_epi8(15);
    __m512i l = _mm512_cvtepu8_epi32(_mm_and_si128(bytes, nibble));
    __m512i h = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
    if constexpr (kKind == Kind::kInt6K) {
      const __m512i shift = _mm512_set_epi32(30, 22, 14, 6, 28, 20, 12, 4, 26, 18, 10, 2, 24, 16, 8, 0);
      const __m512i three = _mm512_set1_epi32(3);
      uint32_t four[2];
      std::memcpy(four, high + 8 * c, 8);
      l = _mm512_or_si512(l, _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(four[0]), shift), three), 4));
      h = _mm512_or_si512(h, _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(four[1]), shift), three), 4));
    }
    if constexpr (kTable) {
      lo = _mm512_permutexvar_ps(l, table);
      hi = _mm512_permutexvar_ps(h, table);
    } else {
      lo = _mm512_cvtepi32_ps(l);
      hi = _mm512_cvtepi32_ps(h);
    }
  }
}

// Rows of W requested ahead of the ones being multiplied, into L1. A decode step's products
// read their weights once, from memory, in short calls; without the requests a row's loads
// waited on memory and its arithmetic on them, one after the other, and SmolLM2's Q4_1 layers
// at one token took about the time of reading their bytes plus that of the arithmetic
// (bench/RESULTS.md, "Packed weights requested ahead").
constexpr int64_t kPrefetchRows = 8;

// Every cache line of [begin, end) requested into L1. Inlined by force: GCC takes a called
// function that only prefetches for one without effects and drops the call.
ZOO_AVX512 inline __attribute__((always_inline)) void prefetch_lines(const void* begin, const void* end) {
  const uintptr_t last = reinterpret_cast<uintptr_t>(end);
  for (uintptr_t a = reinterpret_cast<uintptr_t>(begin) & ~uintptr_t{63}; a < last; a += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(a), _MM_HINT_T0);
  }
}

// Every cache line of [begin, end) requested into L2.
ZOO_AVX512 inline __attribute__((always_inline)) void prefetch_lines_l2(const void* begin, const void* end) {
  const uintptr_t last = reinterpret_cast<uintptr_t>(end);
  for (uintptr_t a = reinterpret_cast<uintptr_t>(begin) & ~uintptr_t{63}; a < last; a += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(a), _MM_HINT_T1);
  }
}

// Every array of rows [n0, n1) of W (clamped to its `rows`).
ZOO_AVX512 inline __attribute__((always_inline)) void prefetch_rows(const Weight& w, int64_t n0, int64_t n1, int64_t rows) {
  n1 = std::min(n1, rows);
  if (n1 <= n0) return;
  const int64_t groups = w.groups(), supers = w.k / 256;
  prefetch_lines(w.codes + n0 * w.codes_row(), w.codes + n1 * w.codes_row());
  if (w.high) prefetch_lines(w.high + n0 * (w.k / 4), w.high + n1 * (w.k / 4));
  prefetch_lines(element_at(w.scales, w.scale_type, n0 * groups), element_at(w.scales, w.scale_type, n1 * groups));
  if (w.mins) prefetch_lines(element_at(w.mins, w.min_type, n0 * groups), element_at(w.mins, w.min_type, n1 * groups));
  if (w.super_scales) prefetch_lines(w.super_scales + n0 * supers, w.super_scales + n1 * supers);
  if (w.super_mins) prefetch_lines(w.super_mins + n0 * supers, w.super_mins + n1 * supers);
}

// Row n's scales and minimums (and k-quants' super-block constants).
ZOO_AVX512 inline __attribute__((always_inline)) void prefetch_constants(const Weight& w, int64_t n) {
  const int64_t groups = w.groups(), supers = w.k / 256;
  prefetch_lines(element_at(w.scales, w.scale_type, n * groups), element_at(w.scales, w.scale_type, (n + 1) * groups));
  if (w.mins) prefetch_lines(element_at(w.mins, w.min_type, n * groups), element_at(w.mins, w.min_type, (n + 1) * groups));
  if (w.super_scales) prefetch_lines(w.super_scales + n * supers, w.super_scales + (n + 1) * supers);
  if (w.super_mins) prefetch_lines(w.super_mins + n * supers, w.super_mins + (n + 1) * supers);
}

// Rows [n0, n1) of y for tokens [t0, t0 + TB), groups of 16 or of 64 and more (groups of 32:
// rows_g32_avx512): per group, the codes' dot with x (two FMA chains per token), then the
// group's scale; the minimums meet xsum sixteen groups at a time.
template <int TB, Kind kKind, bool kTable>
ZOO_AVX512 void rows_avx512(const Weight& w, const float* x, int64_t stride, const float* xsum, float* y,
                            int64_t n_out, int64_t t0, int64_t n0, int64_t n1) {
  const int64_t k = w.k, groups = w.groups(), chunks_per_group = std::max<int64_t>(w.group / 32, 1);
  const __m512 table = w.table ? _mm512_loadu_ps(w.table) : _mm512_setzero_ps();
  const float* xt = x + t0 * stride;
  const float* st = xsum + t0 * groups;
  for (int64_t n = n0; n < n1; ++n) {
    prefetch_rows(w, n + kPrefetchRows, n + kPrefetchRows + 1, n_out);
    const uint8_t* codes = w.codes + n * w.codes_row();
    const uint8_t* high = w.high ? w.high + n * (k / 4) : nullptr;
    __m512 acc[TB];
    for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
      const int64_t count = std::min<int64_t>(16, groups - g0);
      __m512 s, m;
      group_constants(w, n, g0, count, s, m);
      const __mmask16 mask = zoo_cpu::first_lanes(count);
      for (int t = 0; t < TB; ++t) {
        acc[t] = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps(mask, st + t * groups + g0), acc[t]);
      }
      if (w.group == 16) {  // Q6_K: the chunk's halves are two groups
        for (int64_t j = 0; j < count; j += 2) {
          const int64_t c = (g0 + j) / 2;
          __m512 lo, hi;
          chunk<kKind, kTable>(w, codes, high, table, c, lo, hi);
          const __m512 s_lo = _mm512_permutexvar_ps(_mm512_set1_epi32(j), s);
          const __m512 s_hi = _mm512_permutexvar_ps(_mm512_set1_epi32(j + 1), s);
          for (int t = 0; t < TB; ++t) {
            const float* xc = xt + t * stride + 32 * c;
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(lo, _mm512_loadu_ps(xc)), s_lo, acc[t]);
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(hi, _mm512_loadu_ps(xc + 16)), s_hi, acc[t]);
          }
        }
        continue;
      }
      for (int64_t j = 0; j < count; ++j) {
        __m512 d0[TB], d1[TB];
        for (int t = 0; t < TB; ++t) d0[t] = d1[t] = _mm512_setzero_ps();
        for (int64_t c = (g0 + j) * chunks_per_group; c < (g0 + j + 1) * chunks_per_group; ++c) {
          __m512 lo, hi;
          chunk<kKind, kTable>(w, codes, high, table, c, lo, hi);
          for (int t = 0; t < TB; ++t) {
            const float* xc = xt + t * stride + 32 * c;
            d0[t] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xc), d0[t]);
            d1[t] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xc + 16), d1[t]);
          }
        }
        const __m512 sj = _mm512_permutexvar_ps(_mm512_set1_epi32(j), s);
        for (int t = 0; t < TB; ++t) acc[t] = _mm512_fmadd_ps(_mm512_add_ps(d0[t], d1[t]), sj, acc[t]);
      }
    }
    for (int t = 0; t < TB; ++t) y[(t0 + t) * n_out + n] = _mm512_reduce_add_ps(acc[t]);
  }
}

// Rows [n0, n1) of y for one token t, four rows at a time: rows_avx512<1>'s sums in its order
// (the same results, bit for bit), with each chunk of x loaded once for four rows and four
// independent FMA chains. One row at a time, a decode step's short rows (SmolLM2: 18 groups)
// left the core waiting on each row's group constants and its one chain.
template <Kind kKind, bool kTable>
ZOO_AVX512 void rows4_avx512(const Weight& w, const float* x, int64_t stride, const float* xsum, float* y,
                             int64_t n_out, int64_t t, int64_t n0, int64_t n1) {
  constexpr int R = 4;
  const int64_t groups = w.groups(), chunks_per_group = std::max<int64_t>(w.group / 32, 1);
  const __m512 table = w.table ? _mm512_loadu_ps(w.table) : _mm512_setzero_ps();
  const float* xt = x + t * stride;
  const float* st = xsum + t * groups;
  int64_t n = n0;  // groups of 64 or more (rows_avx512_all sends 16 to the one-row path)
  for (; n + R <= n1; n += R) {
    prefetch_rows(w, n + kPrefetchRows, n + kPrefetchRows + R, n_out);
    const uint8_t* codes[R];
    __m512 acc[R];
    for (int r = 0; r < R; ++r) {
      codes[r] = w.codes + (n + r) * w.codes_row();
      acc[r] = _mm512_setzero_ps();
    }
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
      const int64_t count = std::min<int64_t>(16, groups - g0);
      const __m512 sums = _mm512_maskz_loadu_ps(zoo_cpu::first_lanes(count), st + g0);
      __m512 s[R];
      for (int r = 0; r < R; ++r) {
        __m512 m;
        group_constants(w, n + r, g0, count, s[r], m);
        acc[r] = _mm512_fmadd_ps(m, sums, acc[r]);
      }
      for (int64_t j = 0; j < count; ++j) {
        __m512 d0[R], d1[R];
        for (int r = 0; r < R; ++r) d0[r] = d1[r] = _mm512_setzero_ps();
        for (int64_t c = (g0 + j) * chunks_per_group; c < (g0 + j + 1) * chunks_per_group; ++c) {
          const __m512 x0 = _mm512_loadu_ps(xt + 32 * c), x1 = _mm512_loadu_ps(xt + 32 * c + 16);
          for (int r = 0; r < R; ++r) {
            __m512 lo, hi;
            chunk<kKind, kTable>(w, codes[r], nullptr, table, c, lo, hi);
            d0[r] = _mm512_fmadd_ps(lo, x0, d0[r]);
            d1[r] = _mm512_fmadd_ps(hi, x1, d1[r]);
          }
        }
        const __m512i lane = _mm512_set1_epi32(static_cast<int>(j));
        for (int r = 0; r < R; ++r) {
          acc[r] = _mm512_fmadd_ps(_mm512_add_ps(d0[r], d1[r]), _mm512_permutexvar_ps(lane, s[r]), acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) y[t * n_out + n + r] = _mm512_reduce_add_ps(acc[r]);
  }
  if (n < n1) rows_avx512<1, kKind, kTable>(w, x, stride, xsum, y, n_out, t, n, n1);
}

// Rows [n0, n1) of y for tokens [t0, t0 + TB), R rows at a time, where a group is one chunk of
// 32 weights (GGUF's Q4_0, Q4_1, Q8_0, Q4_K; int4 and int8 of group 32): a chunk's codes become
// floats times their scale once for every token, and each token's chunk of x, loaded once, meets
// R rows. One row at a time, every FMA loaded its x again, and those loads, not the arithmetic,
// set the time of 2-8 tokens. Each (row, token) sums in one order whatever TB and R are (its
// minimums' term for 16 groups, then each chunk's low and high halves), so a token's outputs are
// the same bits alone or in a block.
template <int TB, int R, Kind kKind, bool kTable>
ZOO_AVX512 void rows_g32_avx512(const Weight& w, const float* x, int64_t stride, const float* xsum, float* y,
                                int64_t n_out, int64_t t0, int64_t n0, int64_t n1) {
  const int64_t groups = w.groups();
  const __m512 table = w.table ? _mm512_loadu_ps(w.table) : _mm512_setzero_ps();
  const float* xt = x + t0 * stride;
  const float* st = xsum + t0 * groups;
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    prefetch_rows(w, n + kPrefetchRows, n + kPrefetchRows + R, n_out);
    const uint8_t* codes[R];
    __m512 acc[R][TB];
    for (int r = 0; r < R; ++r) {
      codes[r] = w.codes + (n + r) * w.codes_row();
      for (int t = 0; t < TB; ++t) acc[r][t] = _mm512_setzero_ps();
    }
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
      const int64_t count = std::min<int64_t>(16, groups - g0);
      const __mmask16 mask = zoo_cpu::first_lanes(count);
      __m512 s[R], m[R];
      for (int r = 0; r < R; ++r) group_constants(w, n + r, g0, count, s[r], m[r]);
      for (int t = 0; t < TB; ++t) {
        const __m512 sums = _mm512_maskz_loadu_ps(mask, st + t * groups + g0);
        for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(m[r], sums, acc[r][t]);
      }
      for (int64_t j = 0; j < count; ++j) {
        const int64_t c = g0 + j;
        const __m512i lane = _mm512_set1_epi32(static_cast<int>(j));
        __m512 lo[R], hi[R];
        for (int r = 0; r < R; ++r) {
          chunk<kKind, kTable>(w, codes[r], nullptr, table, c, lo[r], hi[r]);
          const __m512 scale = _mm512_permutexvar_ps(lane, s[r]);
          lo[r] = _mm512_mul_ps(lo[r], scale);
          hi[r] = _mm512_mul_ps(hi[r], scale);
        }
        for (int t = 0; t < TB; ++t) {
          const float* xc = xt + t * stride + 32 * c;
          __m512 x0 = _mm512_loadu_ps(xc), x1 = _mm512_loadu_ps(xc + 16);
          // Held in registers: GCC otherwise folds the load into each row's FMA, R loads again.
          asm("" : "+v"(x0), "+v"(x1));
          for (int r = 0; r < R; ++r) {
            acc[r][t] = _mm512_fmadd_ps(lo[r], x0, acc[r][t]);
            acc[r][t] = _mm512_fmadd_ps(hi[r], x1, acc[r][t]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int t = 0; t < TB; ++t) y[(t0 + t) * n_out + n + r] = _mm512_reduce_add_ps(acc[r][t]);
    }
  }
  if constexpr (R > 1) {
    if (n < n1) rows_g32_avx512<TB, 1, kKind, kTable>(w, x, stride, xsum, y, n_out, t0, n, n1);
  }
}

template <Kind kKind, bool kTable>
ZOO_AVX512 void rows_avx512_all(const Weight& w, const float* x, int64_t stride, const float* xsum, float* y,
                                int64_t tokens, int64_t n_out, int64_t n0, int64_t n1) {
  int64_t t = 0;
  if (w.group == 32) {  // 8 tokens x 2 rows and 4 x 4 hold 16 accumulators; a lone token 4 rows
    for (; t + 8 <= tokens; t += 8) rows_g32_avx512<8, 2, kKind, kTable>(w, x, stride, xsum, y, n_out, t, n0, n1);
    for (; t + 4 <= tokens; t += 4) rows_g32_avx512<4, 4, kKind, kTable>(w, x, stride, xsum, y, n_out, t, n0, n1);
    for (; t + 2 <= tokens; t += 2) rows_g32_avx512<2, 4, kKind, kTable>(w, x, stride, xsum, y, n_out, t, n0, n1);
    for (; t < tokens; ++t) rows_g32_avx512<1, 4, kKind, kTable>(w, x, stride, xsum, y, n_out, t, n0, n1);
    return;
  }
  for (; t + 4 <= tokens; t += 4) rows_avx512<4, kKind, kTable>(w, x, stride, xsum, y, n_out, t, n0, n1);
  for (; t + 2 <= tokens; t += 2) rows_avx512<2, kKind, kTable>(w, x, stride, xsum, y, n_out, t, n0, n1);
  for (; t < tokens; ++t) {
    // Groups of 16 (Q6_K, NF4's smallest) take a chunk as two groups: the one-row path.
    if (w.group != 16) rows4_avx512<kKind, kTable>(w, x, stride, xsum, y, n_out, t, n0, n1);
    else rows_avx512<1, kKind, kTable>(w, x, stride, xsum, y, n_out, t, n0, n1);
  }
}

ZOO_AVX512 void rows_fast(const Weight& w, const float* x, int64_t stride, const float* xsum, float* y,
                          int64_t tokens, int64_t n_out, int64_t n0, int64_t n1) {
  switch (w.kind) {
    case Kind::kInt8: return rows_avx512_all<Kind::kInt8, false>(w, x, stride, xsum, y, tokens, n_out, n0, n1);
    case Kind::kInt4:
      if (w.linear) return rows_avx512_all<Kind::kInt4, false>(w, x, stride, xsum, y, tokens, n_out, n0, n1);
      return rows_avx512_all<Kind::kInt4, true>(w, x, stride, xsum, y, tokens, n_out, n0, n1);
    case Kind::kInt4K: return rows_avx512_all<Kind::kInt4K, false>(w, x, stride, xsum, y, tokens, n_out, n0, n1);
    case Kind::kInt6K: return rows_avx512_all<Kind::kInt6K, false>(w, x, stride, xsum, y, tokens, n_out, n0, n1);
  }
}

// Rows [n0, n1) of W written out as floats (row n at `out` row n - first), each value computed as
// Weight::dequantize does in float32: level * scale, then + minimum where the format has one
// (never + 0, which would turn a -0 into +0), so the result equals it bit for bit.
template <Kind kKind>
ZOO_AVX512 void dequantize_avx512(const Weight& w, float* out, int64_t n0, int64_t n1,
                                  int64_t first) {
  const __m512 table = w.table ? _mm512_loadu_ps(w.table) : _mm512_setzero_ps();
  const __m512 offset = _mm512_set1_ps(kKind == Kind::kInt6K ? w.offset : 0.0f);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* codes = w.codes + n * w.codes_row();
    const uint8_t* high = w.high ? w.high + n * (w.k / 4) : nullptr;
    float* row = out + (n - first) * w.k;
    for (int64_t c = 0; c < w.k / 32; ++c) {
      __m512 lo, hi;
      chunk<kKind, kKind == Kind::kInt4>(w, codes, high, table, c, lo, hi);
      if constexpr (kKind == Kind::kInt6K) {  // code - 32: exact in float
        lo = _mm512_add_ps(lo, offset);
        hi = _mm512_add_ps(hi, offset);
      }
      const int64_t g_lo = 32 * c / w.group, g_hi = (32 * c + 16) / w.group;
      lo = _mm512_mul_ps(lo, _mm512_set1_ps(scale_of(w, n, g_lo)));
      hi = _mm512_mul_ps(hi, _mm512_set1_ps(scale_of(w, n, g_hi)));
      if (w.mins) {
        lo = _mm512_add_ps(lo, _mm512_set1_ps(min_of(w, n, g_lo)));
        hi = _mm512_add_ps(hi, _mm512_set1_ps(min_of(w, n, g_hi)));
      }
      _mm512_storeu_ps(row + 32 * c, lo);
      _mm512_storeu_ps(row + 32 * c + 16, hi);
    }
  }
}

ZOO_AVX512 void dequantize_fast(const Weight& w, float* out, int64_t n0, int64_t n1,
                                int64_t first) {
  switch (w.kind) {
    case Kind::kInt8: return dequantize_avx512<Kind::kInt8>(w, out, n0, n1, first);
    case Kind::kInt4: return dequantize_avx512<Kind::kInt4>(w, out, n0, n1, first);
    case Kind::kInt4K: return dequantize_avx512<Kind::kInt4K>(w, out, n0, n1, first);
    case Kind::kInt6K: return dequantize_avx512<Kind::kInt6K>(w, out, n0, n1, first);
  }
}

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return yes;
}

// --- AVX2 path: the dequantize of CPUs without AVX-512 -------------------------------------

#define ZOO_AVX2 __attribute__((target("avx2,fma,f16c")))

// Chunk c (weights 32c .. 32c + 31) of a row's codes plus `offset`, as four 8-float vectors:
// dequantize_avx512's `chunk` at half the width (no table: those formats take the plain loop).
template <Kind kKind>
ZOO_AVX2 inline void chunk_avx2(const uint8_t* codes, const uint8_t* high, int64_t c, float offset,
                                __m256 out[4]) {
  __m256i v[4];
  if constexpr (kKind == Kind::kInt8) {
    for (int q = 0; q < 4; ++q)
      v[q] = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 32 * c + 8 * q)));
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * c));
    const __m128i nibble = _mm_set1_epi8(15);
    const __m128i low = _mm_and_si128(bytes, nibble), top = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    v[0] = _mm256_cvtepu8_epi32(low);
    v[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(low, 8));
    v[2] = _mm256_cvtepu8_epi32(top);
    v[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(top, 8));
    if constexpr (kKind == Kind::kInt6K) {  // weight i of each 16: bit pair i / 4 of byte i % 4
      const __m256i first = _mm256_setr_epi32(0, 8, 16, 24, 2, 10, 18, 26);
      const __m256i second = _mm256_setr_epi32(4, 12, 20, 28, 6, 14, 22, 30);
      const __m256i three = _mm256_set1_epi32(3);
      uint32_t four[2];
      std::memcpy(four, high + 8 * c, 8);
      for (int q = 0; q < 4; ++q) {
        const __m256i planes = _mm256_set1_epi32(static_cast<int>(four[q / 2]));
        const __m256i bits = _mm256_and_si256(_mm256_srlv_epi32(planes, q % 2 ? second : first), three);
        v[q] = _mm256_or_si256(v[q], _mm256_slli_epi32(bits, 4));
      }
    }
  }
  for (int q = 0; q < 4; ++q) out[q] = _mm256_add_ps(_mm256_cvtepi32_ps(v[q]), _mm256_set1_ps(offset));
}

// Chunk c's 32 floats: levels times the scale of each half (`s_lo`, `s_hi`: the same group's
// unless G == 16), then plus its minimum where the format has one.
ZOO_AVX2 inline void store_chunk(__m256 v[4], float s_lo, float s_hi, const float* m, float* out) {
  const float scale[2] = {s_lo, s_hi};
  for (int q = 0; q < 4; ++q) {
    v[q] = _mm256_mul_ps(v[q], _mm256_set1_ps(scale[q / 2]));
    if (m) v[q] = _mm256_add_ps(v[q], _mm256_set1_ps(m[q / 2]));
    _mm256_storeu_ps(out + 8 * q, v[q]);
  }
}

// Rows [n0, n1) of W as floats, dequantize_avx512's contract (bit for bit), for formats
// without a table. A row's group scales and minimums are computed first, one pass each: taken
// per chunk (a division for its group, a type switch and a float16 conversion) they cost more
// than the chunk (measured with perf on an AMD EPYC).
template <Kind kKind>
ZOO_AVX2 void dequantize_avx2(const Weight& w, float* out, int64_t n0, int64_t n1, int64_t first) {
  const int64_t groups = w.groups(), chunks_per_group = std::max<int64_t>(w.group / 32, 1);
  std::vector<float> scales(groups), mins(groups);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* codes = w.codes + n * w.codes_row();
    const uint8_t* high = w.high ? w.high + n * (w.k / 4) : nullptr;
    float* row = out + (n - first) * w.k;
    for (int64_t g = 0; g < groups; ++g) scales[g] = scale_of(w, n, g);
    if (w.mins)
      for (int64_t g = 0; g < groups; ++g) mins[g] = min_of(w, n, g);
    if (w.group == 16) {  // a chunk's halves are groups 2c and 2c + 1
      for (int64_t c = 0; c < w.k / 32; ++c) {
        __m256 v[4];
        chunk_avx2<kKind>(codes, high, c, w.offset, v);
        store_chunk(v, scales[2 * c], scales[2 * c + 1], w.mins ? &mins[2 * c] : nullptr, row + 32 * c);
      }
      continue;
    }
    for (int64_t g = 0, c = 0; g < groups; ++g) {
      const float m[2] = {mins[g], mins[g]};
      for (int64_t end = c + chunks_per_group; c < end; ++c) {
        __m256 v[4];
        chunk_avx2<kKind>(codes, high, c, w.offset, v);
        store_chunk(v, scales[g], scales[g], w.mins ? m : nullptr, row + 32 * c);
      }
    }
  }
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return yes;
}

// Whether the AVX2 dequantize takes the weight (every format but a 4-bit table's), and does it.
bool dequantize_avx2_takes(const Weight& w, float* out, int64_t n0, int64_t n1, int64_t first) {
  if (!has_avx2() || (w.kind == Kind::kInt4 && !w.linear)) return false;
  switch (w.kind) {
    case Kind::kInt8: dequantize_avx2<Kind::kInt8>(w, out, n0, n1, first); break;
    case Kind::kInt4: dequantize_avx2<Kind::kInt4>(w, out, n0, n1, first); break;
    case Kind::kInt4K: dequantize_avx2<Kind::kInt4K>(w, out, n0, n1, first); break;
    case Kind::kInt6K: dequantize_avx2<Kind::kInt6K>(w, out, n0, n1, first); break;
  }
  return true;
}

// --- AVX-512 VNNI path: integer products of codes (int8 activations) ------------------------

#define ZOO_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,fma,f16c")))

// `count` (<= 4) scales of type t as the low lanes of a vector.
ZOO_VNNI inline __m128 load4(const void* p, Type t, int64_t count) {
  return _mm512_castps512_ps128(load_groups(p, t, count));
}


// Whether the VNNI path takes this weight: integer levels, and (but Q6_K's 16) a group of 32 or
// 64, a multiple of 128, or one group per row, so that 4 chunks' scales load as one vector.
bool vnni_takes(const Weight& w) {
  if (w.kind == Kind::kInt4 && !w.linear) return false;
  if (w.kind == Kind::kInt6K) return w.group == 16;
  const int64_t r = w.group / 32;
  return w.group % 32 == 0 && (w.groups() == 1 || r == 1 || r == 2 || r % 4 == 0);
}

// The weight scales of chunks c0 .. c0 + 3 of row n (c0 % 4 == 0; `valid` of them exist) for
// the int8, 4-bit and Q4_K formats.
ZOO_VNNI inline __m128 chunk_scales(const Weight& w, int64_t n, int64_t c0, int64_t valid) {
  if (w.kind == Kind::kInt4K) {  // sub-scale times the super-block's d (4 chunks share one)
    const __m128 sub = load4(static_cast<const uint8_t*>(w.scales) + n * (w.k / 32) + c0, Type::kU8, valid);
    return _mm_mul_ps(sub, _mm_set1_ps(half(w.super_scales[n * (w.k / 256) + c0 / 8])));
  }
  const int64_t groups = w.groups(), r = w.group / 32;
  if (groups == 1 || r % 4 == 0) {
    return _mm_set1_ps(element(w.scales, w.scale_type, n * groups + c0 / r));
  }
  if (r == 1) return load4(element_at(w.scales, w.scale_type, n * groups + c0), w.scale_type, valid);
  const __m128 two = load4(element_at(w.scales, w.scale_type, n * groups + c0 / 2), w.scale_type, (valid + 1) / 2);
  return _mm_permute_ps(two, _MM_SHUFFLE(1, 1, 0, 0));
}

// vpmultishiftqb's control for Q6_K's high bits: in a 64-byte vector of one chunk's codes per
// 16 bytes, byte i is code p = i % 16 of its 16-weight group, whose bit pair is bits 2 (p / 4)
// of that group's byte p % 4 (bytes 0-3 of the chunk's quadword for the low nibbles' group,
// 4-7 for the high's); taken from 4 bits lower, so the pair lands on bits 4-5.
struct Q6KControl {
  alignas(64) uint8_t bytes[2][64];
};
constexpr Q6KControl make_q6k_control() {
  Q6KControl c{};
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 64; ++i) {
      const int p = i % 16;
      c.bytes[h][i] = static_cast<uint8_t>((8 * (4 * h + p % 4) + 2 * (p / 4) - 4) & 63);
    }
  }
  return c;
}
constexpr Q6KControl kQ6KControl = make_q6k_control();

ZOO_VNNI inline __m512 spread(__m128 four, __m512i index) {
  return _mm512_permutexvar_ps(index, _mm512_castps128_ps512(four));
}

ZOO_VNNI inline __mmask64 first_bytes(int64_t n) {
  return n >= 64 ? ~__mmask64{0} : n <= 0 ? __mmask64{0} : ((__mmask64{1} << n) - 1);
}

// One row n of y for tokens [t0, t0 + TB): per block of 4 chunks, the codes' integer products
// with each token's codes (exact int32), scaled per lane by weight scale times the chunk's d;
// then the minimums and offsets times x̂'s per-group sums.
template <int TB, Kind kKind>
ZOO_VNNI void row_vnni(const Weight& w, const Ordered& o, const float* xsum, float* y, int64_t n_out,
                       int64_t t0, int64_t n) {
  const int64_t chunks = w.k / 32, groups = w.groups();
  const int64_t row_bytes = o.blocks * 128, lane_row = o.blocks * o.lanes_per_block;
  const __m512i quarter = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i eighth = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i eighth_high = _mm512_add_epi32(eighth, _mm512_set1_epi32(2));
  const __m512i nibble = _mm512_set1_epi8(15);
  const uint8_t* codes = w.codes + n * w.codes_row();
  __m512 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < o.blocks; ++b) {
    const int64_t valid = std::min<int64_t>(4, chunks - 4 * b);
    if constexpr (kKind == Kind::kInt8) {
      const __m512i w0 = _mm512_maskz_loadu_epi8(first_bytes(32 * valid), codes + 128 * b);
      const __m512i w1 = _mm512_maskz_loadu_epi8(first_bytes(32 * valid - 64), codes + 128 * b + 64);
      // x's codes come as q + 128: subtract 128 times each lane's sum of weights.
      const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
      const __m512i neg0 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, w0));
      const __m512i neg1 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, w1));
      const __m128 s = chunk_scales(w, n, 4 * b, valid);
      const __m512 s0 = spread(s, eighth), s1 = spread(s, eighth_high);
      for (int t = 0; t < TB; ++t) {
        const uint8_t* xq = o.codes + (t0 + t) * row_bytes + 128 * b;
        const float* d = o.lanes + (t0 + t) * lane_row + 32 * b;
        const __m512i i0 = _mm512_dpbusd_epi32(neg0, _mm512_loadu_si512(xq), w0);
        const __m512i i1 = _mm512_dpbusd_epi32(neg1, _mm512_loadu_si512(xq + 64), w1);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(s0, _mm512_loadu_ps(d)), acc[t]);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(s1, _mm512_loadu_ps(d + 16)), acc[t]);
      }
    } else {
      const __m512i z = _mm512_maskz_loadu_epi8(first_bytes(16 * valid), codes + 64 * b);
      __m512i lo = _mm512_and_si512(z, nibble);
      __m512i hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), nibble);
      if constexpr (kKind == Kind::kInt6K) {
        // The high 2 bits: chunk j's 8 bytes (4 per 16-weight group) copied to the two
        // quadwords its 32 codes fill, then each code's bit pair shifted to bits 4-5
        // (vpmultishiftqb: any 8 bits of the quadword per byte).
        const __m512i h = _mm512_maskz_loadu_epi8(first_bytes(8 * valid), w.high + n * (w.k / 4) + 32 * b);
        const __m512i hq = _mm512_permutexvar_epi64(_mm512_set_epi64(3, 3, 2, 2, 1, 1, 0, 0), h);
        const __m512i pair = _mm512_set1_epi8(0x30);
        lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_load_si512(kQ6KControl.bytes[0]), hq), pair));
        hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_load_si512(kQ6KControl.bytes[1]), hq), pair));
        // Sub-scales: 2 per chunk (groups 2j for the low nibbles' lanes, 2j + 1 the high's).
        const __m256 sub = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_maskz_loadu_epi8(
            static_cast<__mmask16>((1u << (2 * valid)) - 1), static_cast<const int8_t*>(w.scales) + n * (w.k / 16) + 8 * b)));
        const __m512 sub16 = _mm512_castps256_ps512(_mm256_mul_ps(sub, _mm256_set1_ps(half(w.super_scales[n * (w.k / 256) + b / 2]))));
        const __m512i even = _mm512_slli_epi32(quarter, 1);
        const __m512 s_lo = _mm512_permutexvar_ps(even, sub16);
        const __m512 s_hi = _mm512_permutexvar_ps(_mm512_add_epi32(even, _mm512_set1_epi32(1)), sub16);
        for (int t = 0; t < TB; ++t) {
          const uint8_t* xq = o.codes + (t0 + t) * row_bytes + 128 * b;
          const __m512 d = _mm512_loadu_ps(o.lanes + (t0 + t) * lane_row + 16 * b);
          const __m512i i_lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xq));
          const __m512i i_hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, _mm512_loadu_si512(xq + 64));
          acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i_lo), _mm512_mul_ps(s_lo, d), acc[t]);
          acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i_hi), _mm512_mul_ps(s_hi, d), acc[t]);
        }
      } else {
        const __m512 s = spread(chunk_scales(w, n, 4 * b, valid), quarter);
        for (int t = 0; t < TB; ++t) {
          const uint8_t* xq = o.codes + (t0 + t) * row_bytes + 128 * b;
          const __m512 d = _mm512_loadu_ps(o.lanes + (t0 + t) * lane_row + 16 * b);
          __m512i i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xq));
          i = _mm512_dpbusd_epi32(i, hi, _mm512_loadu_si512(xq + 64));
          acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(s, d), acc[t]);
        }
      }
    }
  }
  if (w.mins || w.offset != 0.0f) {
    const float* st = xsum + t0 * groups;
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
      const int64_t count = std::min<int64_t>(16, groups - g0);
      __m512 s, m;
      group_constants(w, n, g0, count, s, m);
      const __mmask16 mask = zoo_cpu::first_lanes(count);
      for (int t = 0; t < TB; ++t) {
        acc[t] = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps(mask, st + t * groups + g0), acc[t]);
      }
    }
  }
  for (int t = 0; t < TB; ++t) y[(t0 + t) * n_out + n] = _mm512_reduce_add_ps(acc[t]);
}

template <Kind kKind>
ZOO_VNNI void rows_vnni(const Weight& w, const Ordered& o, const float* xsum, float* y, int64_t tokens,
                        int64_t n_out, int64_t n0, int64_t n1) {
  // Row outside, tokens inside: a row's codes are read from memory once per call.
  for (int64_t n = n0; n < n1; ++n) {
    prefetch_rows(w, n + kPrefetchRows, n + kPrefetchRows + 1, n_out);
    int64_t t = 0;
    for (; t + 8 <= tokens; t += 8) row_vnni<8, kKind>(w, o, xsum, y, n_out, t, n);
    for (; t + 4 <= tokens; t += 4) row_vnni<4, kKind>(w, o, xsum, y, n_out, t, n);
    for (; t + 2 <= tokens; t += 2) row_vnni<2, kKind>(w, o, xsum, y, n_out, t, n);
    for (; t < tokens; ++t) row_vnni<1, kKind>(w, o, xsum, y, n_out, t, n);
  }
}

ZOO_VNNI void rows_integer(const Weight& w, const Ordered& o, const float* xsum, float* y, int64_t tokens,
                           int64_t n_out, int64_t n0, int64_t n1) {
  switch (w.kind) {
    case Kind::kInt8: return rows_vnni<Kind::kInt8>(w, o, xsum, y, tokens, n_out, n0, n1);
    case Kind::kInt4: return rows_vnni<Kind::kInt4>(w, o, xsum, y, tokens, n_out, n0, n1);
    case Kind::kInt4K: return rows_vnni<Kind::kInt4K>(w, o, xsum, y, tokens, n_out, n0, n1);
    case Kind::kInt6K: return rows_vnni<Kind::kInt6K>(w, o, xsum, y, tokens, n_out, n0, n1);
  }
}

// --- AVX-512 VNNI, sixteen rows a vector: groups of 32 (Q4_0, Q4_1, Q4_K, Q8_0) ---------------
//
// row_vnni's lanes are one row's chunks, so each chunk's int32 sums are scaled into floats one
// vpdpbusd after another (five instructions a 128-byte product per token). Here a vector's 16
// lanes are 16 rows: a chunk's 32 products per row sum in eight vpdpbusd into one int32 lane
// (x's 4 codes broadcast from memory), then one convert and two FMAs (scale times the chunk's
// d; minimum times the chunk's sum of x̂) per 16 rows. The rows' codes are transposed once per
// call (16 x 16 dwords: 4 chunks of 4-bit codes, 2 of int8) into a buffer every token reads.
// Each (row, token) sums its chunks in order, so a token's outputs are the same bits alone or
// in a block, on any row.

// Whether this path takes the weight: integer levels in groups of 32 (linear 4-bit, Q4_K, int8).
bool lanes_take(const Weight& w) {
  if (w.group != 32) return false;
  return w.kind == Kind::kInt8 || w.kind == Kind::kInt4K || (w.kind == Kind::kInt4 && w.linear);
}

// v[j] lane i <- v[i] lane j, for 16 vectors of 16 dwords.
ZOO_VNNI inline __attribute__((always_inline)) void transpose16(__m512i v[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // rows g .. g + 3: u[g + e] lane L holds their dword 4L + e
    v[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    v[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    v[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    v[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int e = 0; e < 4; ++e) {  // 128-bit lane L of the four row groups' v[4G + e]
    const __m512i a = _mm512_shuffle_i32x4(v[e], v[4 + e], 0x44);
    const __m512i b = _mm512_shuffle_i32x4(v[e], v[4 + e], 0xEE);
    const __m512i c = _mm512_shuffle_i32x4(v[8 + e], v[12 + e], 0x44);
    const __m512i d = _mm512_shuffle_i32x4(v[8 + e], v[12 + e], 0xEE);
    t[e] = _mm512_shuffle_i32x4(a, c, 0x88);
    t[4 + e] = _mm512_shuffle_i32x4(a, c, 0xDD);
    t[8 + e] = _mm512_shuffle_i32x4(b, d, 0x88);
    t[12 + e] = _mm512_shuffle_i32x4(b, d, 0xDD);
  }
  for (int i = 0; i < 16; ++i) v[i] = t[i];
}

// One vector of the transposed rows' buffer.
struct alignas(64) Vector {
  uint8_t bytes[64];
};

// A float32 or float16 array of per-group constants [rows, groups] of rows n .. n + 15 with
// rows as lanes: out[g] lane r = row r's constant of group g (row indices past `last` read row
// `last`), as float32. Each row's 64 bytes (16 or 32 groups) are one dword row of a transpose;
// float16 pairs are split after it. The next 16 rows' constants are requested ahead.
ZOO_VNNI void transpose_constants(const void* p, Type t, int64_t groups, int64_t n, int64_t next,
                                  int64_t last, Vector* out) {
  const int64_t size = t == Type::kF16 ? 2 : 4, per = 64 / size;
  const uint8_t* bytes = static_cast<const uint8_t*>(p);
  if (next <= last) {
    prefetch_lines_l2(bytes + next * groups * size, bytes + (std::min(next + 16, last + 1)) * groups * size);
  }
  __m512i v[16];
  for (int64_t g0 = 0; g0 < groups; g0 += per) {
    const int64_t count = std::min(per, groups - g0);
    const __mmask64 mask = first_bytes(count * size);
    for (int r = 0; r < 16; ++r) {
      v[r] = _mm512_maskz_loadu_epi8(mask, bytes + (std::min(n + r, last) * groups + g0) * size);
    }
    transpose16(v);
    if (t == Type::kF32) {
      for (int64_t g = 0; g < count; ++g) _mm512_store_si512(out + g0 + g, v[g]);
      continue;
    }
    for (int64_t j = 0; 2 * j < count; ++j) {  // dword j: groups 2j (low half) and 2j + 1
      _mm512_store_ps(out + g0 + 2 * j, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v[j])));
      if (2 * j + 1 < count) {
        _mm512_store_ps(out + g0 + 2 * j + 1, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v[j], 16))));
      }
    }
  }
}

// Rows n .. n + 15 (row indices past `last` read row `last`) as vpdpbusd's unsigned operands:
// codes[8 c + j] lane r multiplies x's dword j of chunk c (4-bit: low nibbles of the row's
// dword j for j < 4, high nibbles of dword j - 4 after; int8: dword j, + 128); and per chunk
// the 16 rows' scales and minimums (offset included). The 16 rows from `next` are requested
// into L2 in order, a share beside each block: into L1, or all at once, the requests filled
// the core's miss buffers and a decode step's head (49152 rows) stalled on them.
template <Kind kKind>
ZOO_VNNI void transpose_rows(const Weight& w, int64_t n, int64_t next, int64_t last, Vector* codes,
                             Vector* scales, Vector* mins) {
  const int64_t chunks = w.k / 32, per_load = kKind == Kind::kInt8 ? 2 : 4;
  const int64_t row_bytes = w.codes_row();
  const __m512i nibble = _mm512_set1_epi8(15), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i v[16];
  for (int64_t c0 = 0; c0 < chunks; c0 += per_load) {
    const int64_t valid = std::min(per_load, chunks - c0);
    const __mmask64 mask = first_bytes(valid * 64 / per_load);
    // The next rows' bytes in order, a share per block (one stream, as they lie in memory).
    const int64_t share = (16 * row_bytes * per_load + chunks - 1) / chunks;
    const int64_t from = std::min(next, last + 1) * row_bytes + c0 * share / per_load;
    const int64_t to = std::min(std::min(next + 16, last + 1) * row_bytes, from + share);
    if (from < to) prefetch_lines_l2(w.codes + from, w.codes + to);
    for (int r = 0; r < 16; ++r) {
      const uint8_t* row = w.codes + std::min(n + r, last) * row_bytes + c0 * 64 / per_load;
      v[r] = _mm512_maskz_loadu_epi8(mask, row);
    }
    transpose16(v);
    for (int64_t c = 0; c < valid; ++c) {
      Vector* out = codes + 8 * (c0 + c);
      if constexpr (kKind == Kind::kInt8) {
        for (int j = 0; j < 8; ++j) _mm512_store_si512(out + j, _mm512_xor_si512(v[8 * c + j], flip));
      } else {
        for (int j = 0; j < 4; ++j) {
          _mm512_store_si512(out + j, _mm512_and_si512(v[4 * c + j], nibble));
          _mm512_store_si512(out + 4 + j, _mm512_and_si512(_mm512_srli_epi16(v[4 * c + j], 4), nibble));
        }
      }
    }
  }
  const int64_t groups = chunks;
  if (!w.super_scales && w.scale_type != Type::kU8 && w.scale_type != Type::kI8 &&
      (!w.mins || (w.min_type != Type::kU8 && w.min_type != Type::kI8))) {
    transpose_constants(w.scales, w.scale_type, groups, n, next, last, scales);
    if (w.mins) transpose_constants(w.mins, w.min_type, groups, n, next, last, mins);
    if (w.offset != 0.0f) {  // as group_constants: minimum + offset times the scale
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512 m = w.mins ? _mm512_load_ps(mins + c) : _mm512_setzero_ps();
        _mm512_store_ps(mins + c, _mm512_fmadd_ps(_mm512_load_ps(scales + c), _mm512_set1_ps(w.offset), m));
      }
    }
    return;
  }
  __m512i s[16], m[16];  // k-quants: each row's constants as group_constants makes them
  for (int64_t c0 = 0; c0 < chunks; c0 += 16) {
    const int64_t count = std::min<int64_t>(16, chunks - c0);
    for (int r = 0; r < 16; ++r) {
      __m512 sr, mr;
      prefetch_constants(w, std::min(next + r, last));
      group_constants(w, std::min(n + r, last), c0, count, sr, mr);
      s[r] = _mm512_castps_si512(sr);
      m[r] = _mm512_castps_si512(mr);
    }
    transpose16(s);
    transpose16(m);
    for (int64_t c = 0; c < count; ++c) {
      _mm512_store_si512(scales + c0 + c, s[c]);
      _mm512_store_si512(mins + c0 + c, m[c]);
    }
  }
}

// y for tokens [t0, t0 + TB) and the 16 rows from n (`store` masks rows past the weight's);
// `kMins`: the weight has minimums or an offset.
template <int TB, Kind kKind, bool kMins>
ZOO_VNNI void lanes_tokens(const Vector* codes, const Vector* scales, const Vector* mins,
                           const LaneInput& x, float* y, int64_t n_out, int64_t t0, int64_t n,
                           __mmask16 store) {
  __m512 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < x.chunks; ++c) {
    __m512i wv[8];
    for (int j = 0; j < 8; ++j) wv[j] = _mm512_load_si512(codes + 8 * c + j);
    const __m512 scale = _mm512_load_ps(scales + c);
    for (int t = 0; t < TB; ++t) {
      const int64_t at = (t0 + t) * x.chunks + c;
      int32_t xd[8];
      std::memcpy(xd, x.q + (t0 + t) * x.k + 32 * c, 32);
      __m512i sum = kKind == Kind::kInt8 ? _mm512_set1_epi32(x.bias[at]) : _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) sum = _mm512_dpbusd_epi32(sum, wv[j], _mm512_set1_epi32(xd[j]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale, _mm512_set1_ps(x.d[at])), acc[t]);
      if constexpr (kMins) acc[t] = _mm512_fmadd_ps(_mm512_load_ps(mins + c), _mm512_set1_ps(x.xsum[at]), acc[t]);
    }
  }
  for (int t = 0; t < TB; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * n_out + n, store, acc[t]);
}

// Every token, in blocks of 8, then 4, 2 and 1.
template <Kind kKind, bool kMins>
ZOO_VNNI void lanes_blocks(const Vector* codes, const Vector* scales, const Vector* mins, const LaneInput& x,
                           float* y, int64_t tokens, int64_t n_out, int64_t n, __mmask16 store) {
  int64_t t = 0;
  for (; t + 8 <= tokens; t += 8) lanes_tokens<8, kKind, kMins>(codes, scales, mins, x, y, n_out, t, n, store);
  for (; t + 4 <= tokens; t += 4) lanes_tokens<4, kKind, kMins>(codes, scales, mins, x, y, n_out, t, n, store);
  for (; t + 2 <= tokens; t += 2) lanes_tokens<2, kKind, kMins>(codes, scales, mins, x, y, n_out, t, n, store);
  for (; t < tokens; ++t) lanes_tokens<1, kKind, kMins>(codes, scales, mins, x, y, n_out, t, n, store);
}

template <Kind kKind>
ZOO_VNNI void rows_lanes(const Weight& w, const LaneInput& x, float* y, int64_t tokens, int64_t n_out,
                         int64_t n0, int64_t n1) {
  // The transposed rows, per thread (a call's are reused by every call on its thread).
  thread_local std::vector<Vector> buffer;
  buffer.resize(10 * x.chunks);
  Vector* codes = buffer.data();
  Vector* scales = codes + 8 * x.chunks;
  Vector* mins = scales + x.chunks;
  for (int64_t n = n0; n < n1; n += 16) {
    transpose_rows<kKind>(w, n, n + 16, n1 - 1, codes, scales, mins);
    const __mmask16 store = zoo_cpu::first_lanes(n1 - n);
    if (w.mins || w.offset != 0.0f) lanes_blocks<kKind, true>(codes, scales, mins, x, y, tokens, n_out, n, store);
    else lanes_blocks<kKind, false>(codes, scales, mins, x, y, tokens, n_out, n, store);
  }
}

ZOO_VNNI void rows_by_lanes(const Weight& w, const LaneInput& x, float* y, int64_t tokens, int64_t n_out,
                            int64_t n0, int64_t n1) {
  switch (w.kind) {
    case Kind::kInt8: return rows_lanes<Kind::kInt8>(w, x, y, tokens, n_out, n0, n1);
    case Kind::kInt4: return rows_lanes<Kind::kInt4>(w, x, y, tokens, n_out, n0, n1);
    case Kind::kInt4K: return rows_lanes<Kind::kInt4K>(w, x, y, tokens, n_out, n0, n1);
    case Kind::kInt6K: return;
  }
}

bool has_vnni() {
  static const bool yes = has_avx512() && __builtin_cpu_supports("avx512vnni") &&
                          __builtin_cpu_supports("avx512vbmi");
  return yes;
}
#else
bool has_avx512() { return false; }
void dequantize_fast(const Weight&, float*, int64_t, int64_t, int64_t) {}
void rows_fast(const Weight&, const float*, int64_t, const float*, float*, int64_t, int64_t, int64_t, int64_t) {}
bool vnni_takes(const Weight&) { return false; }
bool lanes_take(const Weight&) { return false; }
bool has_vnni() { return false; }
bool dequantize_avx2_takes(const Weight&, float*, int64_t, int64_t, int64_t) { return false; }
void rows_integer(const Weight&, const Ordered&, const float*, float*, int64_t, int64_t, int64_t, int64_t) {}
void rows_by_lanes(const Weight&, const LaneInput&, float*, int64_t, int64_t, int64_t, int64_t) {}
#endif

// --- work split over threads ----------------------------------------------------------------

struct Item {
  int64_t expert, n0, n1;
};

using zoo_cpu::parallel;

// --- the FFI handler ------------------------------------------------------------------------

ffi::Error invalid(const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "quantized matmul: " + message);
}

Type type_of(const ffi::AnyBuffer& b) {
  switch (b.element_type()) {
    case ffi::DataType::F16: return Type::kF16;
    case ffi::DataType::U8: return Type::kU8;
    case ffi::DataType::S8: return Type::kI8;
    default: return Type::kF32;
  }
}

const uint8_t* at(const ffi::AnyBuffer& b, int64_t expert, int64_t experts) {
  return static_cast<const uint8_t*>(b.untyped_data()) + expert * (b.size_bytes() / experts);
}

// The format's constants (`base`, no arrays yet) from the handler's attributes and arrays
// (the format's arrays, table last for "u4"); false for an unknown format or arity.
bool parse_format(std::string_view format, const std::vector<ffi::AnyBuffer>& a, int64_t k,
                  int64_t group, bool linear, float offset, Weight& base) {
  base.k = k;
  base.group = group;
  base.offset = offset;
  base.linear = linear;
  if (format == "i8" && a.size() == 2) {
    base.kind = Kind::kInt8;
  } else if (format == "u4" && (a.size() == 3 || a.size() == 4)) {
    base.kind = Kind::kInt4;
    base.table = static_cast<const float*>(a.back().untyped_data());
  } else if (format == "q4k" && a.size() == 5 && group == 32) {
    base.kind = Kind::kInt4K;
  } else if (format == "q6k" && a.size() == 4 && group == 16) {
    base.kind = Kind::kInt6K;
  } else {
    return false;
  }
  return true;
}

// Expert e of `stack` (1 for a plain weight): `base` pointed at its part of each array.
Weight expert_weight(const Weight& base, const std::vector<ffi::AnyBuffer>& a, int64_t e, int64_t stack) {
  Weight w = base;
  w.codes = at(a[0], e, stack);
  if (w.kind == Kind::kInt6K) {
    w.high = at(a[1], e, stack);
    w.scales = at(a[2], e, stack);
    w.scale_type = Type::kI8;
    w.super_scales = reinterpret_cast<const uint16_t*>(at(a[3], e, stack));
    return w;
  }
  w.scales = at(a[1], e, stack);
  w.scale_type = type_of(a[1]);
  if (w.kind == Kind::kInt4K) {
    w.mins = at(a[2], e, stack);
    w.min_type = Type::kU8;
    w.super_scales = reinterpret_cast<const uint16_t*>(at(a[3], e, stack));
    w.super_mins = reinterpret_cast<const uint16_t*>(at(a[4], e, stack));
  } else if (w.kind == Kind::kInt4 && a.size() == 4) {
    w.mins = at(a[2], e, stack);
    w.min_type = type_of(a[2]);
  }
  return w;
}

// The many-token path (float activations, AVX-512): from this many tokens, blocks of W's rows
// are dequantized into a buffer of this many floats (128 KiB, in L2) and every token multiplied
// by each block with dense.cc's x · W^T walk. Dequantizing in registers per token is what makes
// the float path compute-bound (~4.5 ms a token for SmolLM2's layers here); a block dequantized
// once serves all tokens (~2 ms a token after ~34 ms for the blocks; bench/RESULTS.md, "Prompt
// chunks with packed weights"). The portable path takes it at every token count.
constexpr int64_t kBlockTokens = 16;
// Groups of 32 take 8 tokens two rows at a time (rows_g32_avx512), which stays ahead of the
// blocks to 24 tokens and level with them to 64 (bench/RESULTS.md, "Packed products of a few
// tokens, rows two or four at a time"): blocks from 32.
constexpr int64_t kBlockTokensGroup32 = 32;
// Below this many weight-tokens a product runs on the calling thread alone. A decode step's
// products stream their weights from memory, which one core does slower than two: SmolLM2's
// Q4_1 decode step on a 2-core AMD Zen 3 (AVX2, blocks dequantized first) took 33 ms alone and
// 22-23 ms threaded from 64K-256K, on a Zen 5 (AVX-512) 14 ms alone and 11-13 ms threaded from
// 128K (bench/RESULTS.md, "Packed products threaded from fewer weights without AVX-512" and
// "Packed decode products four rows at a time").
constexpr int64_t kAloneBelow = int64_t{1} << 17;
constexpr int64_t kBlockFloats = 1 << 15;

// Rows [n0, n1) of y for `tokens` rows of x (K floats apart): W's rows dequantized a block at a
// time into the buffer, each block multiplied by every token. `avx512`: that path's dequantize
// and walk; else the AVX2 dequantize and walk where the CPU has them, unless `plain` (the
// kernel's `portable`: the plain C++ of both, a test of it).
void blocked_rows(const Weight& w, const float* x, float* y, int64_t tokens, int64_t n,
                  int64_t n0, int64_t n1, bool avx512, bool plain) {
  const int64_t k = w.k, block = std::max<int64_t>(4, (kBlockFloats / k) / 4 * 4);
  std::vector<float> buffer(block * k);
  for (int64_t r0 = n0; r0 < n1; r0 += block) {
    const int64_t r1 = std::min(n1, r0 + block);
    if (avx512) dequantize_fast(w, buffer.data(), r0, r1, r0);
    else if (plain || !dequantize_avx2_takes(w, buffer.data(), r0, r1, r0))
      dequantize_portable(w, buffer.data(), r0, r1, r0);
    zoo_cpu::dense_rows_transposed(x, buffer.data(), y, tokens, k, n, r0, r1, plain);
  }
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> out,
                  std::string_view format, int64_t group, int64_t experts, int64_t layers,
                  bool linear, float offset, bool int8, bool portable) {
  // Arguments: x [T, K] f32, the format's arrays (table last for "u4"), then group_sizes [E]
  // int32 when experts > 0, or, when layers > 0, the arrays stacked [layers, ...] and the layer
  // to read (int32 []): a stacked model's layer loop reads its layer in place, no copy.
  const int64_t n_args = static_cast<int64_t>(args.size());
  if (experts > 0 && layers > 0) return invalid("a weight is stacked by experts or by layers");
  const int64_t trailing = experts > 0 || layers > 0 ? 1 : 0;
  auto x_arg = args.get<ffi::AnyBuffer>(0);
  if (!x_arg.has_value() || x_arg->element_type() != ffi::DataType::F32 ||
      x_arg->dimensions().size() != 2) {
    return invalid("x must be float32 [tokens, K]");
  }
  const int64_t tokens = x_arg->dimensions()[0], k = x_arg->dimensions()[1];
  const int64_t n = out->dimensions()[1];
  if (k % 32 || k % group || (group % 32 && group != 16)) {
    return invalid("K must be a multiple of 32 and the group 16 or a multiple of 32 dividing K");
  }
  std::vector<ffi::AnyBuffer> a;
  for (int64_t i = 1; i < n_args - trailing; ++i) a.push_back(*args.get<ffi::AnyBuffer>(i));
  const int64_t stack = std::max<int64_t>(experts, 1);
  const int32_t* group_sizes = nullptr;
  if (experts > 0) {
    group_sizes = static_cast<const int32_t*>(args.get<ffi::AnyBuffer>(n_args - 1)->untyped_data());
  }
  std::vector<int64_t> first(stack + 1, 0);
  for (int64_t e = 0; e < stack; ++e) first[e + 1] = first[e] + (group_sizes ? group_sizes[e] : tokens);
  if (first[stack] > tokens) return invalid("group_sizes add up to more rows than x has");

  Weight base{};
  if (!parse_format(format, a, k, group, linear, offset, base)) {
    return invalid("unknown format or wrong number of arrays for it");
  }
  if (layers > 0) {
    const int32_t layer =
        *static_cast<const int32_t*>(args.get<ffi::AnyBuffer>(n_args - 1)->untyped_data());
    if (layer < 0 || layer >= layers) return invalid("layer out of range");
    base = expert_weight(base, a, layer, layers);
  }
  auto weight = [&](int64_t e) { return layers > 0 ? base : expert_weight(base, a, e, stack); };

  const float* x = static_cast<const float*>(x_arg->untyped_data());
  float* y = static_cast<float*>(out->untyped_data());
  const int64_t used = first[stack];  // rows of x that belong to an expert (all, without)
  // Rows of x past sum(group_sizes) belong to no expert: zeros, as ragged_dot gives.
  std::fill(y + used * n, y + tokens * n, 0.0f);
  const bool fast = has_avx512() && !portable;
  // Whether expert e's rows take the blocked path with x as it is (float activations: on the
  // portable path always, with AVX-512 from kBlockTokens rows, or kBlockTokensGroup32); if every
  // expert with rows does, the per-token paths' copies and sums of x below are not made.
  const int64_t block_tokens = group == 32 ? kBlockTokensGroup32 : kBlockTokens;
  auto blocked = [&](int64_t e) {
    return !int8 && (!fast || first[e + 1] - first[e] >= block_tokens);
  };
  bool per_token = false;
  for (int64_t e = 0; e < stack; ++e) per_token |= first[e + 1] > first[e] && !blocked(e);
  const int64_t prepared = per_token ? used : 0;
  // x (or x̂, with int8 activations) copied at a row stride of K + 16 floats for the AVX-512
  // paths: rows exactly 4 KiB apart (K = 1024) would share L1 sets, and a token block reads them
  // side by side. The portable path's walk takes x̂ at K floats.
  const int64_t stride = fast ? k + 16 : k, chunks = k / 32;
  std::vector<float> padded(prepared * stride);
  std::vector<int8_t> q(int8 ? prepared * k : 0);
  std::vector<float> steps(int8 ? prepared * chunks : 0);
  for (int64_t t = 0; t < prepared; ++t) {
    float* row = &padded[t * stride];
    if (!int8) {
      std::copy(x + t * k, x + (t + 1) * k, row);
      continue;
    }
    for (int64_t c = 0; c < chunks; ++c) {
      int8_t* qc = &q[t * k + 32 * c];
      const float d = steps[t * chunks + c] = round_chunk(x + t * k + 32 * c, qc);
      for (int i = 0; i < 32; ++i) row[32 * c + i] = qc[i] * d;
    }
  }
  // Sums of x (x̂) over each group, per token (what the minimums and offsets multiply).
  const int64_t groups = k / group;
  std::vector<float> xsum(prepared * groups);
  for (int64_t t = 0; t < prepared; ++t) {
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int64_t i = g * group; i < (g + 1) * group; ++i) s += padded[t * stride + i];
      xsum[t * groups + g] = s;
    }
  }
  // The sixteen-rows path reads x̂'s codes as they are; its int8 weights, stored + 128, need
  // -128 times each chunk's sum of codes.
  const bool by_lanes = int8 && !portable && has_vnni() && lanes_take(base);
  std::vector<int32_t> bias(by_lanes && base.kind == Kind::kInt8 ? used * chunks : 0);
  for (int64_t t = 0; t < static_cast<int64_t>(bias.size()) / std::max<int64_t>(chunks, 1); ++t) {
    for (int64_t c = 0; c < chunks; ++c) {
      int32_t sum = 0;
      for (int i = 0; i < 32; ++i) sum += q[t * k + 32 * c + i];
      bias[t * chunks + c] = -128 * sum;
    }
  }
  // The integer path's view of x: its codes in the weights' byte order and the lanes' steps.
  const bool integer = int8 && !portable && has_vnni() && vnni_takes(base) && !by_lanes;
  const int64_t blocks = (chunks + 3) / 4, lanes_per_block = base.kind == Kind::kInt8 ? 32 : 16;
  std::vector<uint8_t> ordered(integer ? used * blocks * 128 : 0, 0);
  std::vector<float> lanes(integer ? used * blocks * lanes_per_block : 0, 0.0f);
  for (int64_t t = 0; integer && t < used; ++t) {
    for (int64_t c = 0; c < chunks; ++c) {
      const int8_t* qc = &q[t * k + 32 * c];
      const int64_t b = c / 4, j = c % 4;
      uint8_t* block = &ordered[(t * blocks + b) * 128];
      float* lane = &lanes[(t * blocks + b) * lanes_per_block];
      if (base.kind == Kind::kInt8) {  // natural order, q + 128; lanes 8j .. 8j + 7
        for (int i = 0; i < 32; ++i) block[32 * j + i] = static_cast<uint8_t>(qc[i] + 128);
        std::fill(lane + 8 * j, lane + 8 * j + 8, steps[t * chunks + c]);
      } else {  // inputs 0..15 at 16 j, 16..31 at 64 + 16 j; lanes 4j .. 4j + 3
        std::memcpy(block + 16 * j, qc, 16);
        std::memcpy(block + 64 + 16 * j, qc + 16, 16);
        std::fill(lane + 4 * j, lane + 4 * j + 4, steps[t * chunks + c]);
      }
    }
  }
  // Work items of >= 16 rows, about 4 per thread per expert (late threads still find work).
  // A small product runs on the calling thread alone (`kAloneBelow`).
  const int64_t work = n * k * used;
  const int64_t threads = work < kAloneBelow ? 1 : std::max<int64_t>(pool.num_threads(), 1);
  int64_t step = std::max<int64_t>(16, (n + 4 * threads - 1) / (4 * threads));
  if (by_lanes) step = (step + 15) / 16 * 16;  // whole vectors of rows
  std::vector<Item> items;
  for (int64_t e = 0; e < stack; ++e) {
    if (first[e + 1] == first[e]) continue;
    for (int64_t n0 = 0; n0 < n; n0 += step) items.push_back({e, n0, std::min(n, n0 + step)});
  }
  parallel(pool, threads, items, [&](const Item& it) {
    const Weight w = weight(it.expert);
    const int64_t rows = first[it.expert + 1] - first[it.expert];
    float* ye = y + first[it.expert] * n;
    if (blocked(it.expert)) {
      blocked_rows(w, x + first[it.expert] * k, ye, rows, n, it.n0, it.n1, fast, portable);
      return;
    }
    const float* xe = padded.data() + first[it.expert] * stride;
    const float* se = xsum.data() + first[it.expert] * groups;
    if (by_lanes) {
      const int64_t at = first[it.expert];
      const LaneInput lanes_x{q.data() + at * k, steps.data() + at * chunks, se,
                              bias.empty() ? nullptr : bias.data() + at * chunks, k, chunks};
      rows_by_lanes(w, lanes_x, ye, rows, n, it.n0, it.n1);
    } else if (integer) {
      const Ordered o{blocks, lanes_per_block, ordered.data() + first[it.expert] * blocks * 128,
                      lanes.data() + first[it.expert] * blocks * lanes_per_block};
      rows_integer(w, o, se, ye, rows, n, it.n0, it.n1);
    } else if (fast) {
      rows_fast(w, xe, stride, se, ye, rows, n, it.n0, it.n1);
    } else {
      blocked_rows(w, xe, ye, rows, n, it.n0, it.n1, false, portable);
    }
  });
  return ffi::Error::Success();
}


// W [..., N, K] as float32: the format's arrays with any leading dims (stacked layers, experts)
// taken as more rows, each row as dequantize_avx512 computes it, rows split over the threads.
ffi::Error Dequantize(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> out,
                      std::string_view format, int64_t group, bool linear, float offset,
                      bool portable) {
  const auto dims = out->dimensions();
  if (out->element_type() != ffi::DataType::F32 || dims.size() < 2) {
    return invalid("dequantize: the result must be float32 [..., N, K]");
  }
  const int64_t k = dims.back(), n = out->element_count() / std::max<int64_t>(k, 1);
  if (k % 32 || k % group || (group % 32 && group != 16)) {
    return invalid("K must be a multiple of 32 and the group 16 or a multiple of 32 dividing K");
  }
  std::vector<ffi::AnyBuffer> a;
  for (size_t i = 0; i < args.size(); ++i) a.push_back(*args.get<ffi::AnyBuffer>(i));
  Weight w{};
  if (!parse_format(format, a, k, group, linear, offset, w)) {
    return invalid("unknown format or wrong number of arrays for it");
  }
  w = expert_weight(w, a, 0, 1);
  float* y = static_cast<float*>(out->untyped_data());
  // Writing the floats is the cost (4 bytes a weight): every thread, items of >= 64 rows.
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t step = std::max<int64_t>(64, (n + 4 * threads - 1) / (4 * threads));
  std::vector<Item> items;
  for (int64_t n0 = 0; n0 < n; n0 += step) items.push_back({0, n0, std::min(n, n0 + step)});
  const bool fast = has_avx512() && !portable;
  parallel(pool, threads, items, [&](const Item& it) {
    if (fast) {
      dequantize_fast(w, y, it.n0, it.n1, 0);
    } else if (portable || !dequantize_avx2_takes(w, y, it.n0, it.n1, 0)) {
      dequantize_portable(w, y, it.n0, it.n1, 0);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

// Whether this CPU multiplies codes in integers with int8 activations (AVX-512 VNNI): what
// `layers.kernels.cpu.integer_products` reports, and so the activations a GGUF model loads with.
extern "C" bool ZooQuantizedIntegerProducts() { return has_vnni(); }

// What both targets take first: the pool, the arrays, the result, the format and its group.
static auto packed_weight_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .RemainingArgs()
      .Ret<ffi::AnyBuffer>()
      .Attr<std::string_view>("format")
      .Attr<int64_t>("group");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZooQuantizedMatmul, Matmul,
                              packed_weight_binding()
                                  .Attr<int64_t>("experts")
                                  .Attr<int64_t>("layers")
                                  .Attr<bool>("linear")
                                  .Attr<float>("offset")
                                  .Attr<bool>("int8")
                                  .Attr<bool>("portable"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZooQuantizedDequantize, Dequantize,
                              packed_weight_binding()
                                  .Attr<bool>("linear")
                                  .Attr<float>("offset")
                                  .Attr<bool>("portable"));
