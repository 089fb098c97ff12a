// CPU kernels of the decode path, compiled on the machine that runs them (-march=native) and
// called through ctypes with raw pointers: no torch headers, so a build takes seconds.
// Threads come from the OpenMP runtime torch itself loaded (same soname, one pool).
//
// Element types: float32 (T = float) and bfloat16 (T = bf16, the raw 16 bits). Every
// element-wise result is rounded to T where torch's own op would round it, so the kernels
// give torch's bf16 numbers, not a more precise variant that parity tests would have to excuse.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PARASHIFT_BF16_DOT 1
#endif

namespace {

struct bf16 {
  uint16_t bits;
};

inline float to_f(float x) { return x; }
inline float to_f(bf16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <class T> inline T from_f(float f);
template <> inline float from_f<float>(float f) { return f; }
template <> inline bf16 from_f<bf16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  // Round to nearest even, as torch does; a NaN stays a (quiet) NaN. Branch-free: it vectorizes.
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = (u >> 16) | 0x40u;
  return bf16{static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded)};
}

// exp(x) for the vector lanes (libm's expf does not vectorize without -ffast-math): 2^n * e^r,
// r in [-ln2/2, ln2/2], a degree-6 polynomial (Cephes' expf). x is clamped to [-87.3, 88.3],
// where 2^n stays a normal float: below, the result is ~1e-38 instead of 0 (a softmax weight
// or a SiLU denominator that rounds the same).
inline float fast_exp(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  float n = __builtin_roundf(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, 4);
  return p * scale;
}
template <class T> inline float round_to(float f) { return to_f(from_f<T>(f)); }

// Small ops run on one thread below this many elements: a fork/join costs more than the work.
constexpr int64_t kParallelMin = 1 << 15;
inline int threads_for(int64_t elements, int num_threads) {
  return elements < kParallelMin ? 1 : num_threads;
}

// out = w * T(x * rsqrt(mean(x^2) + eps)), x = T(hidden + residual) when residual is given
// (then also written to residual_out): RMSNorm's reference, in one pass over each row.
template <class T>
void rms_norm(T* out, T* residual_out, const T* x, int64_t x_stride, const T* residual,
              int64_t residual_stride, const T* weight, int64_t rows, int64_t hidden, float eps,
              int num_threads) {
#pragma omp parallel num_threads(threads_for(rows * hidden, num_threads))
  {
  std::vector<float> row(hidden);
#pragma omp for
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    T* o = out + r * hidden;
    if (residual != nullptr) {
      const T* rr = residual + r * residual_stride;
      T* ro = residual_out + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) {
        T sum = from_f<T>(to_f(xr[i]) + to_f(rr[i]));
        ro[i] = sum;
        row[i] = to_f(sum);
      }
    } else {
      for (int64_t i = 0; i < hidden; ++i) row[i] = to_f(xr[i]);
    }
    float squares = 0.f;
    for (int64_t i = 0; i < hidden; ++i) squares += row[i] * row[i];
    float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
    for (int64_t i = 0; i < hidden; ++i)
      o[i] = from_f<T>(to_f(weight[i]) * round_to<T>(row[i] * inv));
  }
  }
}

// Neox rotary in place on x [tokens, heads, head_dim] (token stride given, heads contiguous):
// (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), cos/sin [tokens, head_dim / 2] in T.
template <class T>
void rotary(T* x, int64_t token_stride, const T* cos, const T* sin, int64_t tokens,
            int64_t heads, int64_t head_dim, int num_threads) {
  const int64_t half = head_dim / 2;
#pragma omp parallel num_threads(threads_for(tokens * heads * head_dim, num_threads))
  {
    std::vector<float> c(half), s(half), a(half), b(half);
#pragma omp for
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t i = 0; i < half; ++i) c[i] = to_f(cos[t * half + i]);
      for (int64_t i = 0; i < half; ++i) s[i] = to_f(sin[t * half + i]);
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = x + t * token_stride + h * head_dim;
        T* x2 = x1 + half;
        for (int64_t i = 0; i < half; ++i) a[i] = to_f(x1[i]);
        for (int64_t i = 0; i < half; ++i) b[i] = to_f(x2[i]);
        for (int64_t i = 0; i < half; ++i)
          x1[i] = from_f<T>(round_to<T>(a[i] * c[i]) - round_to<T>(b[i] * s[i]));
        for (int64_t i = 0; i < half; ++i)
          x2[i] = from_f<T>(round_to<T>(b[i] * c[i]) + round_to<T>(a[i] * s[i]));
      }
    }
  }
}

// out [tokens, d] = T(silu(gate)) * up, x [tokens, 2d] = (gate | up) with a row stride.
template <class T>
void silu_and_mul(T* out, const T* x, int64_t x_stride, int64_t tokens, int64_t d,
                  int num_threads) {
#pragma omp parallel for num_threads(threads_for(tokens * d, num_threads))
  for (int64_t t = 0; t < tokens; ++t) {
    const T* gate = x + t * x_stride;
    const T* up = gate + d;
    T* o = out + t * d;
    for (int64_t i = 0; i < d; ++i) {
      float g = to_f(gate[i]);
      o[i] = from_f<T>(round_to<T>(g / (1.f + fast_exp(-g))) * to_f(up[i]));
    }
  }
}

// A float's bits as an int32 that orders like the float (-0 equal to +0; a NaN past both
// infinities): max reductions on it vectorize, where a float max with NaN semantics does not.
inline int32_t order_key(float f) {
  int32_t i;
  std::memcpy(&i, &f, 4);
  return i >= 0 ? i : -(i & 0x7fffffff);
}
inline int32_t order_key(bf16 x) { return order_key(to_f(x)); }
inline bool is_nan_key(int32_t key) { return key > 0x7f800000 || key < -0x7f800000; }

// The index of each row's largest value (the first of equals; a NaN wins, as in torch): chunk
// maxima in one vectorized pass, then a scan of the first chunk that holds the maximum.
template <class T>
void argmax_rows(int64_t* out, const T* x, int64_t rows, int64_t cols, int num_threads) {
  constexpr int64_t kChunk = 256;
  const int64_t chunks = (cols + kChunk - 1) / kChunk;
#pragma omp parallel num_threads(threads_for(rows * cols, num_threads))
  {
    std::vector<int32_t> chunk_max(chunks);
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = x + r * cols;
      int nans = 0;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t end = std::min(cols, (c + 1) * kChunk);
        int32_t top = INT32_MIN;
        for (int64_t i = c * kChunk; i < end; ++i) {
          const int32_t key = order_key(row[i]);
          top = key > top ? key : top;
          nans += is_nan_key(key);
        }
        chunk_max[c] = top;
      }
      int64_t best = 0;
      if (nans) {
        while (!is_nan_key(order_key(row[best]))) ++best;
      } else {
        int64_t c = 0;
        for (int64_t k = 1; k < chunks; ++k)
          if (chunk_max[k] > chunk_max[c]) c = k;
        for (best = c * kChunk; order_key(row[best]) != chunk_max[c]; ++best) {}
      }
      out[r] = best;
    }
  }
}

// The new tokens' K and V into their cache slots; a slot of -1 is skipped (padding).
// key/value [tokens, kv_heads, head_dim] with a token stride; caches [slots, kv_heads, head_dim].
template <class T>
void write_kv(T* key_cache, T* value_cache, const T* key, const T* value, int64_t key_stride,
              int64_t value_stride, const int64_t* slot_mapping, int64_t tokens,
              int64_t row_elements) {
  for (int64_t t = 0; t < tokens; ++t) {
    int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    std::memcpy(key_cache + slot * row_elements, key + t * key_stride, row_elements * sizeof(T));
    std::memcpy(value_cache + slot * row_elements, value + t * value_stride,
                row_elements * sizeof(T));
  }
}

// Decode attention straight from the paged cache: one query token per sequence. A sequence is
// a work item: its cached rows (every kv head side by side) are read once each, in order, a
// block of block_size rows at a time, so the hardware prefetcher streams them; the next row of
// a new block, elsewhere in memory, is prefetched ahead. Exact softmax (two passes over the
// scores, in float32), the output rounded to T once.
// query [seqs, heads, head_dim] with a token stride; out [seqs, heads, head_dim] contiguous;
// caches [blocks, block_size, kv_heads, head_dim]; block_tables [seqs, table_width] int32.
template <class T>
inline void prefetch_row(const T* p, int64_t elements) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < elements * static_cast<int64_t>(sizeof(T)); b += 64)
    __builtin_prefetch(bytes + b);
}

#ifdef PARASHIFT_BF16_DOT
// bfloat16 with AVX512-BF16: query-key dots straight on the cache's bf16 pairs (vdpbf16ps, no
// widening), sixteen keys' partial sums folded into one vector of scores by a transpose-and-add
// tree (no horizontal sum per key), and the value sums of a few query heads kept in registers.

constexpr int64_t kTile = 16;  // keys whose scores are folded together

// Folds part[0..15] (16 lanes each) into one vector: lane t = the lane sum of part[t].
inline __m512 fold16(__m512* part) {
  for (int i = 0; i < 8; ++i)
    part[i] = _mm512_add_ps(_mm512_shuffle_f32x4(part[2 * i], part[2 * i + 1], 0x44),
                            _mm512_shuffle_f32x4(part[2 * i], part[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    part[i] = _mm512_add_ps(_mm512_shuffle_f32x4(part[2 * i], part[2 * i + 1], 0x88),
                            _mm512_shuffle_f32x4(part[2 * i], part[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    part[i] = _mm512_add_ps(_mm512_shuffle_ps(part[2 * i], part[2 * i + 1], 0x44),
                            _mm512_shuffle_ps(part[2 * i], part[2 * i + 1], 0xEE));
  __m512 v = _mm512_add_ps(_mm512_shuffle_ps(part[0], part[1], 0x88),
                           _mm512_shuffle_ps(part[0], part[1], 0xDD));
  // lane 4k + m holds key k + 4m
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, v);
}

inline __m512 widen_bf16(__m256i half) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// scores[hq * n + j] = scale * q[hq] . k[j], NV32 = head_dim / 32.
template <int NV32, class Slot>
void key_scores_bf16(float* scores, const bf16* query, const bf16* key_cache, Slot slot,
                     int64_t n, int64_t heads, int64_t group, float scale, int64_t row) {
  constexpr int64_t head_dim = 32 * NV32;
  const bf16* rows[kTile];
  __m512 part[kTile];
  for (int64_t j0 = 0; j0 < n; j0 += kTile) {
    const int64_t tile = std::min(kTile, n - j0);
    for (int64_t t = 0; t < tile; ++t) {
      rows[t] = key_cache + slot(j0 + t);
      if (j0 + t + kTile < n) prefetch_row(key_cache + slot(j0 + t + kTile), row);
    }
    for (int64_t hq = 0; hq < heads; ++hq) {
      const int64_t offset = (hq / group) * head_dim;
      __m512i qv[NV32];  // the query head's bf16 pairs
      for (int c = 0; c < NV32; ++c) qv[c] = _mm512_loadu_si512(query + hq * head_dim + 32 * c);
      for (int64_t t = 0; t < kTile; ++t) {
        __m512 acc = _mm512_setzero_ps();
        if (t < tile)
          for (int c = 0; c < NV32; ++c)
            acc = _mm512_dpbf16_ps(
                acc, (__m512bh)qv[c],
                (__m512bh)_mm512_loadu_si512(rows[t] + offset + 32 * c));
        part[t] = acc;
      }
      __m512 v = _mm512_mul_ps(fold16(part), _mm512_set1_ps(scale));
      float folded[kTile];
      _mm512_storeu_ps(folded, v);
      std::memcpy(scores + hq * n + j0, folded, tile * sizeof(float));
    }
  }
}

// out[hq] = bf16(inv_sum[hq] * sum_j p[hq][j] v[j]), NV16 = head_dim / 16: up to GC query
// heads of one kv head at a time, their sums in NV16 * GC registers.
template <int NV16, int GC, class Slot>
void value_sums_bf16(bf16* out, const float* scores, const float* inv_sum,
                     const bf16* value_cache, Slot slot, int64_t n, int64_t kv_heads,
                     int64_t group) {
  constexpr int64_t head_dim = 16 * NV16;
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t g0 = 0; g0 < group; g0 += GC) {
      const int64_t count = std::min<int64_t>(GC, group - g0), first = h * group + g0;
      __m512 acc[GC][NV16];
      for (int g = 0; g < GC; ++g)
        for (int c = 0; c < NV16; ++c) acc[g][c] = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; ++j) {
        if (j + kTile < n) prefetch_row(value_cache + slot(j + kTile) + h * head_dim, head_dim);
        const bf16* v = value_cache + slot(j) + h * head_dim;
        __m512 vf[NV16];
        for (int c = 0; c < NV16; ++c)
          vf[c] = widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16 * c)));
        for (int g = 0; g < GC; ++g) {
          if (g >= count) break;
          const __m512 p = _mm512_set1_ps(scores[(first + g) * n + j]);
          for (int c = 0; c < NV16; ++c) acc[g][c] = _mm512_fmadd_ps(p, vf[c], acc[g][c]);
        }
      }
      for (int64_t g = 0; g < count; ++g) {
        const __m512 inv = _mm512_set1_ps(inv_sum[first + g]);
        for (int c = 0; c < NV16; ++c) {
          __m256bh o = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][c], inv));
          std::memcpy(out + (first + g) * head_dim + 16 * c, &o, 32);
        }
      }
    }
  }
}

// The bf16 path for head_dim 64 and 128; false: not taken, the generic loops run.
template <class Slot>
bool decode_one_bf16(bf16* out, const bf16* query, const bf16* key_cache,
                     const bf16* value_cache, Slot slot, int64_t n, int64_t heads,
                     int64_t kv_heads, int64_t head_dim, float scale, std::vector<float>& scores,
                     std::vector<float>& inv_sum) {
  if (head_dim != 64 && head_dim != 128) return false;
  const int64_t group = heads / kv_heads, row = kv_heads * head_dim;
  scores.resize(heads * n);
  if (head_dim == 64)
    key_scores_bf16<2>(scores.data(), query, key_cache, slot, n, heads, group, scale, row);
  else
    key_scores_bf16<4>(scores.data(), query, key_cache, slot, n, heads, group, scale, row);
  for (int64_t hq = 0; hq < heads; ++hq) {
    float* sh = scores.data() + hq * n;
    float top = -INFINITY, sum = 0.f;
    for (int64_t j = 0; j < n; ++j) top = sh[j] > top ? sh[j] : top;
    for (int64_t j = 0; j < n; ++j) {
      sh[j] = fast_exp(sh[j] - top);
      sum += sh[j];
    }
    inv_sum[hq] = sum > 0.f ? 1.f / sum : 0.f;
  }
  if (head_dim == 64)
    value_sums_bf16<4, 4>(out, scores.data(), inv_sum.data(), value_cache, slot, n, kv_heads,
                          group);
  else
    value_sums_bf16<8, 2>(out, scores.data(), inv_sum.data(), value_cache, slot, n, kv_heads,
                          group);
  return true;
}
#endif

template <class T>
void paged_decode_attention(T* out, const T* query, int64_t query_stride, const T* key_cache,
                            const T* value_cache, const int32_t* block_tables,
                            int64_t table_width, const int32_t* seq_lens, int64_t seqs,
                            int64_t heads, int64_t kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t window, float scale, int num_threads) {
  const int64_t group = heads / kv_heads;
  const int64_t row = kv_heads * head_dim;  // elements per cache slot
  constexpr int64_t kAhead = 8;  // rows prefetched ahead
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> q(heads * head_dim), acc(heads * head_dim), row_f(row), scores, sums(heads);
#pragma omp for schedule(dynamic, 1)
    for (int64_t s = 0; s < seqs; ++s) {
      const int64_t len = seq_lens[s];
      const int64_t lo = window > 0 && len > window ? len - window : 0;
      const int64_t n = len - lo;
      const int32_t* table = block_tables + s * table_width;
      auto slot = [&](int64_t pos) {
        return (static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size) *
               row;
      };
#ifdef PARASHIFT_BF16_DOT
      if constexpr (std::is_same_v<T, bf16>) {
        auto from_lo = [&](int64_t j) { return slot(lo + j); };
        if (decode_one_bf16(out + s * heads * head_dim, query + s * query_stride, key_cache,
                            value_cache, from_lo, n, heads, kv_heads, head_dim, scale, scores,
                            sums))
          continue;
      }
#endif
      for (int64_t i = 0; i < heads * head_dim; ++i)
        q[i] = to_f(query[s * query_stride + i]) * scale;
      scores.resize(heads * n);
      for (int64_t j = 0; j < n; ++j) {  // scores[head][j] = q[head] . k[j][head's kv head]
        if (j + kAhead < n) prefetch_row(key_cache + slot(lo + j + kAhead), row);
        const T* k = key_cache + slot(lo + j);
        for (int64_t i = 0; i < row; ++i) row_f[i] = to_f(k[i]);
        for (int64_t hq = 0; hq < heads; ++hq) {
          const float* qh = q.data() + hq * head_dim;
          const float* kh = row_f.data() + (hq / group) * head_dim;
          float dot = 0.f;
          for (int64_t i = 0; i < head_dim; ++i) dot += qh[i] * kh[i];
          scores[hq * n + j] = dot;
        }
      }
      for (int64_t hq = 0; hq < heads; ++hq) {
        float* sh = scores.data() + hq * n;
        float top = -INFINITY;
        for (int64_t j = 0; j < n; ++j) top = sh[j] > top ? sh[j] : top;
        float sum = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          sh[j] = fast_exp(sh[j] - top);
          sum += sh[j];
        }
        sums[hq] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n; ++j) {  // acc[head] += p[head][j] * v[j][head's kv head]
        if (j + kAhead < n) prefetch_row(value_cache + slot(lo + j + kAhead), row);
        const T* v = value_cache + slot(lo + j);
        for (int64_t i = 0; i < row; ++i) row_f[i] = to_f(v[i]);
        for (int64_t hq = 0; hq < heads; ++hq) {
          const float p = scores[hq * n + j];
          const float* vh = row_f.data() + (hq / group) * head_dim;
          float* a = acc.data() + hq * head_dim;
          for (int64_t i = 0; i < head_dim; ++i) a[i] += p * vh[i];
        }
      }
      for (int64_t hq = 0; hq < heads; ++hq) {
        T* o = out + (s * heads + hq) * head_dim;
        const float inv = sums[hq] > 0.f ? 1.f / sums[hq] : 0.f;
        for (int64_t i = 0; i < head_dim; ++i) o[i] = from_f<T>(acc[hq * head_dim + i] * inv);
      }
    }
  }
}

}  // namespace

// The C entry points: `dtype` 0 = float32, 1 = bfloat16.
#define P(T, p) static_cast<T*>(p)

extern "C" {

// 1 where bf16 attention with head_dim 64 or 128 takes the AVX512-BF16 path.
int parashift_cpu_bf16_dot() {
#ifdef PARASHIFT_BF16_DOT
  return 1;
#else
  return 0;
#endif
}

void parashift_rms_norm(int dtype, void* out, void* residual_out, const void* x,
                        int64_t x_stride, const void* residual, int64_t residual_stride,
                        const void* weight, int64_t rows, int64_t hidden, float eps,
                        int num_threads) {
  if (dtype == 0)
    rms_norm<float>(P(float, out), P(float, residual_out), P(const float, x), x_stride,
                    P(const float, residual), residual_stride, P(const float, weight), rows,
                    hidden, eps, num_threads);
  else
    rms_norm<bf16>(P(bf16, out), P(bf16, residual_out), P(const bf16, x), x_stride,
                   P(const bf16, residual), residual_stride, P(const bf16, weight), rows, hidden,
                   eps, num_threads);
}

void parashift_rotary(int dtype, void* x, int64_t token_stride, const void* cos, const void* sin,
                      int64_t tokens, int64_t heads, int64_t head_dim, int num_threads) {
  if (dtype == 0)
    rotary<float>(P(float, x), token_stride, P(const float, cos), P(const float, sin), tokens,
                  heads, head_dim, num_threads);
  else
    rotary<bf16>(P(bf16, x), token_stride, P(const bf16, cos), P(const bf16, sin), tokens, heads,
                 head_dim, num_threads);
}

void parashift_silu_and_mul(int dtype, void* out, const void* x, int64_t x_stride,
                            int64_t tokens, int64_t d, int num_threads) {
  if (dtype == 0)
    silu_and_mul<float>(P(float, out), P(const float, x), x_stride, tokens, d, num_threads);
  else
    silu_and_mul<bf16>(P(bf16, out), P(const bf16, x), x_stride, tokens, d, num_threads);
}

void parashift_argmax_rows(int dtype, int64_t* out, const void* x, int64_t rows, int64_t cols,
                           int num_threads) {
  if (dtype == 0)
    argmax_rows<float>(out, P(const float, x), rows, cols, num_threads);
  else
    argmax_rows<bf16>(out, P(const bf16, x), rows, cols, num_threads);
}

void parashift_write_kv(int dtype, void* key_cache, void* value_cache, const void* key,
                        const void* value, int64_t key_stride, int64_t value_stride,
                        const int64_t* slot_mapping, int64_t tokens, int64_t row_elements) {
  if (dtype == 0)
    write_kv<float>(P(float, key_cache), P(float, value_cache), P(const float, key),
                    P(const float, value), key_stride, value_stride, slot_mapping, tokens,
                    row_elements);
  else
    write_kv<bf16>(P(bf16, key_cache), P(bf16, value_cache), P(const bf16, key),
                   P(const bf16, value), key_stride, value_stride, slot_mapping, tokens,
                   row_elements);
}

void parashift_paged_decode_attention(int dtype, void* out, const void* query,
                                      int64_t query_stride, const void* key_cache,
                                      const void* value_cache, const int32_t* block_tables,
                                      int64_t table_width, const int32_t* seq_lens, int64_t seqs,
                                      int64_t heads, int64_t kv_heads, int64_t head_dim,
                                      int64_t block_size, int64_t window, float scale,
                                      int num_threads) {
  if (dtype == 0)
    paged_decode_attention<float>(P(float, out), P(const float, query), query_stride,
                                  P(const float, key_cache), P(const float, value_cache),
                                  block_tables, table_width, seq_lens, seqs, heads, kv_heads,
                                  head_dim, block_size, window, scale, num_threads);
  else
    paged_decode_attention<bf16>(P(bf16, out), P(const bf16, query), query_stride,
                                 P(const bf16, key_cache), P(const bf16, value_cache),
                                 block_tables, table_width, seq_lens, seqs, heads, kv_heads,
                                 head_dim, block_size, window, scale, num_threads);
}

}  // extern "C"
