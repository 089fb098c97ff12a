// One token per row of logits: temperature, min-p, top-k, top-p, then one draw by the inverse
// CDF with the row's one uniform number. The filters are thresholds on the row's scaled logits
// z = (x - max) / temperature, so a row costs passes over its logits and work on the tokens that
// survive, never a sort of the vocabulary:
//   min-p keeps z >= log(min_p) (a probability at least min_p times the largest);
//   top-k keeps z at or above the k-th largest (ties at the k-th value all kept, as vLLM does),
//     found by a k-entry heap that the vector loop rarely has to touch;
//   top-p keeps the most likely tokens until the mass before a token reaches top_p of what the
//     filters above kept (ties at the boundary all kept), found by a weighted quickselect on the
//     tokens within e^-9 of the largest, or on every token when those cannot hold the mass.
// Penalized logits come as overrides (a row's token ids and their new values): the row is copied
// into a per-thread buffer, in cache, and the overrides written there; the caller never copies
// the [rows, vocab] logits.
// The draw walks the kept tokens in vocabulary order: the sum of weights up to the chosen token
// is the first to exceed uniform * total, which is exactly a sample of the kept distribution.
// layers/sampler.py's torch path computes the same thresholds and draw (the reference on GPU).

#include "bf16_lanes.h"
#include "common.h"
#include "entry_points.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PARASHIFT_SAMPLING_AVX512 1
#endif

namespace {

constexpr int64_t kChunk = 256;         // the dense draw's partial sums, per chunk of tokens
constexpr float kZeroBelow = -87.0f;    // a weight exp(z) below this is 0, not fast_exp's 1e-38
constexpr float kCandidate = -9.2103f;  // top-p's first candidates: weight >= 1e-4 of the max
constexpr int64_t kHeapMax = 1024;      // larger top-k: a radix select instead
constexpr int kLanes = 16;              // the scans go 16 tokens at a time

inline float weight(float z) { return z < kZeroBelow ? 0.f : fast_exp(z); }

struct Scratch {
  std::vector<float> row;       // a row with its overrides
  std::vector<float> weights;   // dense: every token's weight
  std::vector<double> chunks;   // dense: the weights' sum per chunk
  std::vector<int32_t> ids;     // sparse: kept token ids, in vocabulary order
  std::vector<float> kept;      // sparse: their weights
  int64_t count = 0;            // sparse: how many (ids and kept only grow)

  void clear_kept(int64_t n) {
    if (static_cast<int64_t>(ids.size()) < n + kLanes) {
      ids.resize(n + kLanes);
      kept.resize(n + kLanes);
    }
    count = 0;
  }
  void keep(int64_t i, float w) {
    ids[count] = static_cast<int32_t>(i);
    kept[count++] = w;
  }
  std::vector<float> work;      // top-k's heap or copy, top-p's quickselect
};

// The scans: AVX-512 where the CPU has it, otherwise a fixed-size array of lanes that GCC
// vectorizes as it can.

#ifdef PARASHIFT_SAMPLING_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) { return load_bf16(p, 0xFFFF); }
#endif

template <class T>
float row_max(const T* x, int64_t n) {
  int64_t i = 0;
  float m = -INFINITY;
#ifdef PARASHIFT_SAMPLING_AVX512
  __m512 lanes = _mm512_set1_ps(-INFINITY);
  for (; i + kLanes <= n; i += kLanes) lanes = _mm512_max_ps(lanes, load16(x + i));
  m = _mm512_reduce_max_ps(lanes);
#else
  float lanes[kLanes];
  for (int j = 0; j < kLanes; ++j) lanes[j] = -INFINITY;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) {
      const float v = to_f(x[i + j]);
      lanes[j] = v > lanes[j] ? v : lanes[j];
    }
  for (int j = 0; j < kLanes; ++j) m = lanes[j] > m ? lanes[j] : m;
#endif
  for (; i < n; ++i) m = to_f(x[i]) > m ? to_f(x[i]) : m;
  return m;
}

// Whether any of the 16 values at x is above `floor`.
template <class T>
inline bool any_above(const T* x, float floor) {
#ifdef PARASHIFT_SAMPLING_AVX512
  return _mm512_cmp_ps_mask(load16(x), _mm512_set1_ps(floor), _CMP_GT_OQ) != 0;
#else
  bool any = false;
  for (int j = 0; j < kLanes; ++j) any |= to_f(x[j]) > floor;
  return any;
#endif
}

// Whether any of the 16 values at x scales to z = (x - m) * scale >= floor.
template <class T>
inline bool any_scaled_at_least(const T* x, float m, float scale, float floor) {
#ifdef PARASHIFT_SAMPLING_AVX512
  const __m512 z = _mm512_mul_ps(_mm512_sub_ps(load16(x), _mm512_set1_ps(m)),
                                 _mm512_set1_ps(scale));
  return _mm512_cmp_ps_mask(z, _mm512_set1_ps(floor), _CMP_GE_OQ) != 0;
#else
  bool any = false;
  for (int j = 0; j < kLanes; ++j) any |= (to_f(x[j]) - m) * scale >= floor;
  return any;
#endif
}

template <class T>
int64_t first_index_of(const T* x, int64_t n, float value) {
  int64_t i = 0;
#ifdef PARASHIFT_SAMPLING_AVX512
  for (; i + kLanes <= n; i += kLanes) {
    const __mmask16 hit = _mm512_cmp_ps_mask(load16(x + i), _mm512_set1_ps(value), _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i)
    if (to_f(x[i]) == value) return i;
  return 0;  // a row of NaN
}

// The k-th largest logit (counting equal values separately, as torch.topk does).
template <class T>
float kth_largest(const T* x, int64_t n, int64_t k, std::vector<float>& work) {
  if (k > kHeapMax) {  // radix select: the top 11 bits of an ordered key, then that bin
    auto key = [](float v) {
      uint32_t b;
      std::memcpy(&b, &v, 4);
      return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    };
    std::vector<int64_t> bins(1 << 11, 0);
    for (int64_t i = 0; i < n; ++i) ++bins[key(to_f(x[i])) >> 21];
    int64_t bin = (1 << 11) - 1, above = 0;
    for (; bin > 0 && above + bins[bin] < k; --bin) above += bins[bin];
    work.clear();
    for (int64_t i = 0; i < n; ++i)
      if (static_cast<int64_t>(key(to_f(x[i])) >> 21) == bin) work.push_back(to_f(x[i]));
    const int64_t rank = k - above - 1;
    std::nth_element(work.begin(), work.begin() + rank, work.end(), std::greater<float>());
    return work[rank];
  }
  work.resize(k);
  for (int64_t i = 0; i < k; ++i) work[i] = to_f(x[i]);
  std::make_heap(work.begin(), work.end(), std::greater<float>());  // the smallest in front
  float floor = work.front();
  int64_t i = k;
  for (; i + kLanes <= n; i += kLanes) {
    if (!any_above(x + i, floor)) continue;
    for (int j = 0; j < kLanes; ++j) {
      const float v = to_f(x[i + j]);
      if (v <= floor) continue;
      std::pop_heap(work.begin(), work.end(), std::greater<float>());
      work.back() = v;
      std::push_heap(work.begin(), work.end(), std::greater<float>());
      floor = work.front();
    }
  }
  for (; i < n; ++i) {
    const float v = to_f(x[i]);
    if (v <= floor) continue;
    std::pop_heap(work.begin(), work.end(), std::greater<float>());
    work.back() = v;
    std::push_heap(work.begin(), work.end(), std::greater<float>());
    floor = work.front();
  }
  return floor;
}

// Every token's weight exp(z) and each chunk's sum; returns the total.
template <class T>
double dense_weights(const T* x, int64_t n, float m, float scale, Scratch& s) {
  s.weights.resize(n);
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  s.chunks.resize(chunks);
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t end = std::min(n, (c + 1) * kChunk);
    float sum = 0.f;
    for (int64_t i = c * kChunk; i < end; ++i) {
      const float w = weight((to_f(x[i]) - m) * scale);
      s.weights[i] = w;
      sum += w;
    }
    s.chunks[c] = sum;
    total += sum;
  }
  return total;
}

// Zeroes the dense weights below `floor` and sums the chunks again; returns the new total.
double floor_weights(Scratch& s, int64_t n, float floor) {
  double total = 0.0;
  for (int64_t c = 0; c < static_cast<int64_t>(s.chunks.size()); ++c) {
    const int64_t end = std::min(n, (c + 1) * kChunk);
    float sum = 0.f;
    for (int64_t i = c * kChunk; i < end; ++i) {
      const float w = s.weights[i] >= floor ? s.weights[i] : 0.f;
      s.weights[i] = w;
      sum += w;
    }
    s.chunks[c] = sum;
    total += sum;
  }
  return total;
}

int64_t draw_dense(const Scratch& s, int64_t n, double total, double u) {
  const double target = u * total;
  double before = 0.0;
  int64_t last = 0;
  for (int64_t c = 0; c < static_cast<int64_t>(s.chunks.size()); ++c) {
    if (s.chunks[c] <= 0.0) continue;
    const int64_t end = std::min(n, (c + 1) * kChunk);
    if (before + s.chunks[c] > target) {
      double acc = before;
      for (int64_t i = c * kChunk; i < end; ++i) {
        if (s.weights[i] <= 0.f) continue;
        acc += s.weights[i];
        last = i;
        if (acc > target) return i;
      }
      return last;  // the chunk's sum rounded above its running total
    }
    before += s.chunks[c];
    for (int64_t i = end - 1; i >= c * kChunk; --i)
      if (s.weights[i] > 0.f) { last = i; break; }
  }
  return last;  // u * total rounded up to the total
}

// The tokens with z >= z_floor, in vocabulary order, and their weights; 16 tokens at a time,
// skipped whole when none qualifies (the usual case for top-k's and min-p's thresholds).
template <class T>
void gather_kept(const T* x, int64_t n, float m, float scale, float z_floor, Scratch& s) {
  s.clear_kept(n);
  auto take = [&](int64_t i) {
    const float z = (to_f(x[i]) - m) * scale;
    if (z >= z_floor) s.keep(i, weight(z));
  };
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    if (!any_scaled_at_least(x + i, m, scale, z_floor)) continue;
    for (int j = 0; j < kLanes; ++j) take(i + j);
  }
  for (; i < n; ++i) take(i);
}

// The dense weights at or above `floor` (> 0), as a sparse list.
void gather_weights(int64_t n, float floor, Scratch& s) {
  s.clear_kept(n);
  const float* w = s.weights.data();
  const float above = std::max(floor, 0.f);
  auto take = [&](int64_t i) {
    if (w[i] >= floor && w[i] > 0.f) s.keep(i, w[i]);
  };
  int64_t i = 0;
#ifdef PARASHIFT_SAMPLING_AVX512
  const __m512 floor_v = _mm512_set1_ps(floor), zero = _mm512_setzero_ps();
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 v = _mm512_loadu_ps(w + i);
    const __mmask16 hit = _mm512_cmp_ps_mask(v, floor_v, _CMP_GE_OQ) &
                          _mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ);
    if (!hit) continue;
    // Compress in registers, then a full store (a masked compress to memory is microcoded,
    // ~20x slower on Zen 4); the vectors have 16 spare lanes for it.
    _mm512_storeu_ps(s.kept.data() + s.count, _mm512_maskz_compress_ps(hit, v));
    _mm512_storeu_si512(s.ids.data() + s.count, _mm512_maskz_compress_epi32(
        hit, _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(i)))));
    s.count += __builtin_popcount(hit);
  }
#endif
  for (; i + kLanes <= n; i += kLanes) {
    if (!any_above(w + i, std::nextafter(above, -INFINITY))) continue;
    for (int j = 0; j < kLanes; ++j) take(i + j);
  }
  for (; i < n; ++i) take(i);
}

// Top-p's smallest kept weight: in descending order a token is kept while the mass before it
// is below `need`; every token equal to the last kept one is kept too.
float nucleus_floor(std::vector<float>& a, double need) {
  double above = 0.0;  // the mass of tokens known to lie above [lo, hi)
  int64_t lo = 0, hi = static_cast<int64_t>(a.size());
  float last_pivot = a.empty() ? 0.f : a[0];
  while (hi - lo > 32) {
    const float x0 = a[lo], x1 = a[lo + (hi - lo) / 2], x2 = a[hi - 1];
    const float pivot = std::max(std::min(x0, x1), std::min(std::max(x0, x1), x2));
    // Three-way partition: [lo, gt) > pivot, [gt, lt) == pivot, [lt, hi) < pivot.
    int64_t gt = lo, i = lo, lt = hi;
    while (i < lt) {
      if (a[i] > pivot) std::swap(a[i++], a[gt++]);
      else if (a[i] < pivot) std::swap(a[i], a[--lt]);
      else ++i;
    }
    double mass_gt = 0.0;
    for (int64_t j = lo; j < gt; ++j) mass_gt += a[j];
    const double mass_eq = static_cast<double>(pivot) * (lt - gt);
    if (above + mass_gt >= need) {
      hi = gt;  // the boundary lies among the larger ones
    } else if (above + mass_gt + mass_eq >= need) {
      return pivot;
    } else {
      above += mass_gt + mass_eq;
      lo = lt;
      last_pivot = pivot;
    }
  }
  std::sort(a.begin() + lo, a.begin() + hi, std::greater<float>());
  float floor = last_pivot;
  for (int64_t j = lo; j < hi && above < need; ++j) {
    floor = a[j];
    above += a[j];
  }
  return floor;
}

int64_t draw_sparse(const Scratch& s, float floor, double u) {
  double total = 0.0;
  for (int64_t j = 0; j < s.count; ++j)
    if (s.kept[j] >= floor) total += s.kept[j];
  const double target = u * total;
  double acc = 0.0;
  int64_t last = s.count ? s.ids[0] : 0;
  for (int64_t j = 0; j < s.count; ++j) {
    if (s.kept[j] < floor || s.kept[j] <= 0.f) continue;
    acc += s.kept[j];
    last = s.ids[j];
    if (acc > target) return last;
  }
  return last;
}

double kept_mass(const Scratch& s) {
  double total = 0.0;
  for (int64_t j = 0; j < s.count; ++j) total += s.kept[j];
  return total;
}

template <class T>
int64_t sample_row(const T* x, int64_t n, float temperature, int64_t top_k, float top_p,
                   float min_p, double u, Scratch& s) {
  const float m = row_max(x, n);
  const float scale = 1.f / temperature;
  if (!(temperature > 0.f) || !std::isfinite(scale) || !std::isfinite(m))
    return first_index_of(x, n, m);  // greedy (also a row masked to -inf everywhere)
  float z_floor = -INFINITY;
  if (min_p > 0.f) z_floor = std::log(min_p);
  if (top_k > 0 && top_k < n)
    z_floor = std::max(z_floor, (kth_largest(x, n, top_k, s.work) - m) * scale);
  const bool use_top_p = top_p < 1.f;
  if (z_floor == -INFINITY) {
    const double total = dense_weights(x, n, m, scale, s);
    if (!use_top_p) return draw_dense(s, n, total, u);
    const double need = top_p * total;
    gather_weights(n, std::exp(kCandidate), s);
    if (kept_mass(s) < need) {  // a flat row: the nucleus among every token
      s.work.assign(s.weights.begin(), s.weights.begin() + n);
      return draw_dense(s, n, floor_weights(s, n, nucleus_floor(s.work, need)), u);
    }
    s.work.assign(s.kept.begin(), s.kept.begin() + s.count);
    return draw_sparse(s, nucleus_floor(s.work, need), u);
  }
  gather_kept(x, n, m, scale, z_floor, s);
  if (!use_top_p) return draw_sparse(s, 0.f, u);
  s.work.assign(s.kept.begin(), s.kept.begin() + s.count);
  return draw_sparse(s, nucleus_floor(s.work, top_p * kept_mass(s)), u);
}

template <class T>
void sample_rows(int64_t* out, const T* logits, int64_t row_stride, int64_t rows, int64_t vocab,
                 const float* temperature, const int64_t* top_k, const float* top_p,
                 const float* min_p, const double* uniforms, const int64_t* override_starts,
                 const int64_t* override_ids, const float* override_values, int num_threads) {
  const int threads = static_cast<int>(std::min<int64_t>(rows, num_threads));
#pragma omp parallel for schedule(dynamic, 1) num_threads(std::max(threads, 1))
  for (int64_t r = 0; r < rows; ++r) {
    static thread_local Scratch scratch;  // kept by the pool's threads: no allocation a step
    const T* x = logits + r * row_stride;
    const float t = temperature[r];
    const int64_t k = top_k ? top_k[r] : 0;
    const float p = top_p ? top_p[r] : 1.f, mp = min_p ? min_p[r] : 0.f;
    const double u = uniforms ? uniforms[r] : 0.0;  // null: every row greedy
    const int64_t first = override_starts ? override_starts[r] : 0;
    const int64_t end = override_starts ? override_starts[r + 1] : 0;
    if (first == end) {
      out[r] = sample_row(x, vocab, t, k, p, mp, u, scratch);
      continue;
    }
    scratch.row.resize(vocab);
    for (int64_t i = 0; i < vocab; ++i) scratch.row[i] = to_f(x[i]);
    for (int64_t j = first; j < end; ++j) scratch.row[override_ids[j]] = override_values[j];
    out[r] = sample_row(scratch.row.data(), vocab, t, k, p, mp, u, scratch);
  }
}

}  // namespace

extern "C" {

void parashift_sample_rows(int dtype, int64_t* out, const void* logits, int64_t row_stride,
                           int64_t rows, int64_t vocab, const float* temperature,
                           const int64_t* top_k, const float* top_p, const float* min_p,
                           const double* uniforms, const int64_t* override_starts,
                           const int64_t* override_ids, const float* override_values,
                           int num_threads) {
  if (dtype == 0)
    sample_rows<float>(out, P(const float, logits), row_stride, rows, vocab, temperature, top_k,
                       top_p, min_p, uniforms, override_starts, override_ids, override_values,
                       num_threads);
  else
    sample_rows<bf16>(out, P(const bf16, logits), row_stride, rows, vocab, temperature, top_k,
                      top_p, min_p, uniforms, override_starts, override_ids, override_values,
                      num_threads);
}

}  // extern "C"
