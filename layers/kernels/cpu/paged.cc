// Paged attention for decode on a CPU (paged.py: `cpu_paged_decode`): one query token per row
// attends over the keys its page table holds, read in place from the pool. The XLA path
// (layers/kernels/paged/blocked.py) gathers each block of pages into a copy and transposes it
// for XLA:CPU's batched products; here each (row, K/V head) is one item of XLA's thread pool,
// reading its pages in place, once for the whole group of query heads that share them (GQA),
// with an online softmax (running max, denominator and unnormalised output per head, rescaled
// once per page; Milakov & Gimelshein 2018).
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

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The 16-lane sums below are written lane by lane so that the compiler vectorizes them without
// reordering a sum it was not given (the library is built with -ffp-contract=off); the clones
// give AVX-512 CPUs 16-float vectors and the rest the baseline's.
constexpr int kLanes = 16;

#if defined(__x86_64__) && defined(__GNUC__)
#define ZOO_CLONES __attribute__((target_clones("avx512f", "default")))
#else
#define ZOO_CLONES
#endif

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

// Row `b`, K/V head `kv`: the group's outputs o[b, 0, kv * group + g, :].
ZOO_CLONES void row_head(const float* q, const float* k_pool, const float* v_pool,
                         const int32_t* table, int64_t length, int64_t q_pos, int64_t window,
                         float softcap, const Shapes& s, float* o) {
  const int64_t group = s.heads / s.kv_heads, d = s.head_dim, ps = s.page_size;
  std::fill(o, o + group * d, 0.0f);
  const int64_t hi = std::min({q_pos + 1, length, s.row_pages * ps});
  const int64_t lo = window > 0 ? std::max<int64_t>(0, q_pos - window + 1) : 0;
  if (q_pos < 0 || lo >= hi) return;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> qs(group * d), scores(ps);
  for (int64_t i = 0; i < group * d; ++i) qs[i] = q[i] * scale;
  std::vector<float> top(group, -std::numeric_limits<float>::infinity()), denom(group, 0.0f);
  for (int64_t first = lo / ps * ps; first < hi; first += ps) {
    // An id outside the pool (undefined under jit, as for the XLA path) is clamped into it, as
    // XLA's gather clamps, never read past the buffer.
    const int64_t page = std::clamp<int64_t>(table[first / ps], 0, s.pages - 1);
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

ffi::Error PagedDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                       ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> page_table,
                       ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> q_positions,
                       ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> window,
                       ffi::ResultBuffer<ffi::F32> out, float softcap) {
  const auto qd = q.dimensions(), pd = k_pages.dimensions();
  const int64_t rank = static_cast<int64_t>(pd.size());
  if (qd.size() != 4 || qd[1] != 1 || (rank != 4 && rank != 5))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "paged decode: q must be [batch, 1, heads, head_dim] and the pools "
                      "[(layers,) kv_heads, pages, page_size, head_dim]");
  const Shapes s{qd[2], pd[rank - 4], qd[3], pd[rank - 3], pd[rank - 2],
                 page_table.dimensions()[1]};
  const int64_t batch = qd[0], layers = rank == 5 ? pd[0] : 1;
  const int64_t at = rank == 5 ? layer.typed_data()[0] : 0;
  if (at < 0 || at >= layers)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "paged decode: layer index out of range");
  const int64_t pool_size = s.kv_heads * s.pages * s.page_size * s.head_dim;
  const int64_t head_size = s.pages * s.page_size * s.head_dim;
  const float* k_base = k_pages.typed_data() + at * pool_size;
  const float* v_base = v_pages.typed_data() + at * pool_size;
  const int64_t win = window.typed_data()[0];
  const int64_t group = s.heads / s.kv_heads;
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t kv = 0; kv < s.kv_heads; ++kv) items.emplace_back(b, kv);
  auto run = [&](const std::pair<int64_t, int64_t>& item) {
    const auto [b, kv] = item;
    const int64_t offset = (b * s.heads + kv * group) * s.head_dim;
    row_head(q.typed_data() + offset, k_base + kv * head_size, v_base + kv * head_size,
             page_table.typed_data() + b * s.row_pages, lengths.typed_data()[b],
             q_positions.typed_data()[b], win, softcap, s, out->typed_data() + offset);
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
                                  .Attr<float>("softcap"));
