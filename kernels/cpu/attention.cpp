// Decode attention straight from the paged KV cache (prefill tokens take it too on
// AVX512-BF16: see cpu_backend.py).

#include "common.h"

namespace {

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
  for (int64_t j = 0; j < std::min(n, kFar); ++j) prefetch_row<2>(key_cache + slot(j), row);
  for (int64_t j0 = 0; j0 < n; j0 += kTile) {
    const int64_t tile = std::min(kTile, n - j0);
    for (int64_t t = 0; t < tile; ++t) {
      rows[t] = key_cache + slot(j0 + t);
      if (j0 + t + kTile < n) prefetch_row(key_cache + slot(j0 + t + kTile), row);
      if (j0 + t + kFar < n) prefetch_row<2>(key_cache + slot(j0 + t + kFar), row);
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
        if (h == 0 && j + kFar < n)  // the whole row, every kv head's part
          prefetch_row<2>(value_cache + slot(j + kFar), kv_heads * head_dim);
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

// Decode attention straight from the paged cache: one query token per sequence. A sequence is
// a work item: its cached rows (every kv head side by side) are read once each, in order, a
// block of block_size rows at a time, so the hardware prefetcher streams them; the next row of
// a new block, elsewhere in memory, is prefetched ahead. Exact softmax (two passes over the
// scores, in float32), the output rounded to T once.
// query [seqs, heads, head_dim] with a token stride; out [seqs, heads, head_dim] contiguous;
// caches [blocks, block_size, kv_heads, head_dim]; block_tables [seqs, table_width] int32.
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
        if (j + kFar < n) prefetch_row<2>(key_cache + slot(lo + j + kFar), row);
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
        if (j + kFar < n) prefetch_row<2>(value_cache + slot(lo + j + kFar), row);
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

extern "C" {

// 1 where bf16 attention with head_dim 64 or 128 takes the AVX512-BF16 path.
int parashift_cpu_bf16_dot() {
#ifdef PARASHIFT_BF16_DOT
  return 1;
#else
  return 0;
#endif
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
