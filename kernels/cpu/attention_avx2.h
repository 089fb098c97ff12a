// Decode attention's bfloat16 path on AVX2 without AVX512-BF16 (included by attention.cpp,
// whose driver calls decode_one_bf16 per sequence; attention_bf16.h holds the AVX512-BF16 one).

#pragma once

#include "bf16_lanes.h"
#include "common.h"
#include "row_stream.h"

#if !defined(PARASHIFT_BF16_DOT) && defined(__AVX2__) && defined(__FMA__)
#define PARASHIFT_BF16_ATTENTION_AVX2 1

namespace {

// bfloat16 on AVX2 (the generic loops widened every row into a buffer and summed each dot
// horizontally: 1.7 ms a layer at batch 32, context 256, built for Haswell on a Xeon). Each
// 16-dim chunk of a key or value row is widened in registers by unpacking with zeros, which
// leaves the dims as [0-3 | 8-11] and [4-7 | 12-15]; the query is widened the same way, so the
// dots are the same sums, and the value sums go back in order at the end. The scores of 8
// keys fold into one vector by a horizontal-add tree; the value sums of up to 3 query heads
// stay in registers. The key weights stay fp32, as in the generic loops.

constexpr int64_t kKeys = 8;  // keys whose scores are folded together
constexpr int kHeads = 3;     // query heads of a kv head taken together

// Lane t of the result: the lane sum of part[t].
inline __m256 fold8(const __m256* part) {
  const __m256 t0 = _mm256_hadd_ps(part[0], part[1]), t1 = _mm256_hadd_ps(part[2], part[3]);
  const __m256 t2 = _mm256_hadd_ps(part[4], part[5]), t3 = _mm256_hadd_ps(part[6], part[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

// scores[hq * n + j] = q[hq] . k[j] (q already scaled and widened as the keys are), NC =
// head_dim / 16.
template <int NC, class Slot>
void key_scores_avx2(float* scores, const float* q, const bf16* key_cache, Slot slot, int64_t n,
                     int64_t kv_heads, int64_t group, int64_t row, RowStream<bf16>& stream) {
  constexpr int64_t head_dim = 16 * NC;
  const bf16* rows[kKeys];
  alignas(32) __m256 part[kHeads][kKeys];
  for (int64_t j0 = 0; j0 < n; j0 += kKeys) {
    const int64_t tile = std::min(kKeys, n - j0);
    gather_key_tile(rows, key_cache, slot, j0, tile, kKeys, n, row, stream);
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t g0 = 0; g0 < group; g0 += kHeads) {
        const int count = static_cast<int>(std::min<int64_t>(kHeads, group - g0));
        const float* qh = q + (h * group + g0) * head_dim;
        for (int64_t t = 0; t < kKeys; ++t) {
          __m256 acc[kHeads] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
          if (t < tile)
            for (int c = 0; c < NC; ++c) {
              __m256 lo, hi;
              widen16_unpacked(rows[t] + h * head_dim + 16 * c, lo, hi);
              for (int g = 0; g < kHeads; ++g) {
                if (g >= count) break;
                const float* qc = qh + g * head_dim + 16 * c;
                acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qc + 8), hi,
                                         _mm256_fmadd_ps(_mm256_loadu_ps(qc), lo, acc[g]));
              }
            }
          for (int g = 0; g < count; ++g) part[g][t] = acc[g];
        }
        const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(tile)),
                                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        for (int g = 0; g < count; ++g)
          _mm256_maskstore_ps(scores + (h * group + g0 + g) * n + j0, lanes, fold8(part[g]));
      }
    }
  }
}

// out[hq] = bf16(inv_sum[hq] * sum_j p[hq][j] v[j]): per kv head, up to kHeads query heads and
// 32 dims at a time (12 accumulators, a widened chunk and a weight: 15 registers).
template <int NC, class Slot>
void value_sums_avx2(bf16* out, const float* p, const float* inv_sum, const bf16* value_cache,
                     Slot slot, int64_t n, int64_t kv_heads, int64_t group,
                     RowStream<bf16>& stream) {
  constexpr int64_t head_dim = 16 * NC;
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t g0 = 0; g0 < group; g0 += kHeads) {
      const int count = static_cast<int>(std::min<int64_t>(kHeads, group - g0));
      const int64_t first = h * group + g0;
      for (int c0 = 0; c0 < NC; c0 += 2) {  // 32 dims: chunks c0 and c0 + 1
        __m256 acc[kHeads][4];
        for (int g = 0; g < kHeads; ++g)
          for (int i = 0; i < 4; ++i) acc[g][i] = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; ++j) {
          if (c0 == 0) {
            if (j + kKeys < n) prefetch_row(value_cache + slot(j + kKeys) + h * head_dim, head_dim);
            if (h == 0 && g0 == 0) stream.read(1);
          }
          const bf16* v = value_cache + slot(j) + h * head_dim + 16 * c0;
          __m256 w[4];
          widen16_unpacked(v, w[0], w[1]);
          widen16_unpacked(v + 16, w[2], w[3]);
          for (int g = 0; g < kHeads; ++g) {
            if (g >= count) break;
            const __m256 pg = _mm256_broadcast_ss(p + (first + g) * n + j);
            for (int i = 0; i < 4; ++i) acc[g][i] = _mm256_fmadd_ps(pg, w[i], acc[g][i]);
          }
        }
        for (int g = 0; g < count; ++g) {
          const __m256 inv = _mm256_set1_ps(inv_sum[first + g]);
          uint16_t* o = reinterpret_cast<uint16_t*>(out + (first + g) * head_dim + 16 * c0);
          for (int i = 0; i < 4; i += 2) {
            __m256 lo = acc[g][i], hi = acc[g][i + 1];
            in_order(lo, hi);
            store_bf16_8(o + 8 * i, _mm256_mul_ps(lo, inv), 8);
            store_bf16_8(o + 8 * i + 8, _mm256_mul_ps(hi, inv), 8);
          }
        }
      }
    }
  }
}

// The AVX2 path for head_dim 64 and 128 (any group); false: not taken, the generic loops run.
template <class Slot>
bool decode_one_bf16(bf16* out, const bf16* query, const bf16* key_cache,
                     const bf16* value_cache, Slot slot, int64_t n, int64_t heads,
                     int64_t kv_heads, int64_t head_dim, float scale, std::vector<float>& scores,
                     std::vector<uint32_t>&, std::vector<float>& inv_sum,
                     RowStream<bf16>& stream) {
  if (head_dim != 64 && head_dim != 128) return false;
  const int64_t group = heads / kv_heads, row = kv_heads * head_dim;
  thread_local std::vector<float> q;  // scaled, widened as the keys are
  q.resize(heads * head_dim);
  const __m256 s = _mm256_set1_ps(scale);
  for (int64_t c = 0; c < heads * head_dim / 16; ++c) {
    __m256 lo, hi;
    widen16_unpacked(query + 16 * c, lo, hi);
    _mm256_storeu_ps(q.data() + 16 * c, _mm256_mul_ps(lo, s));
    _mm256_storeu_ps(q.data() + 16 * c + 8, _mm256_mul_ps(hi, s));
  }
  scores.resize(heads * n);
  if (head_dim == 64)
    key_scores_avx2<4>(scores.data(), q.data(), key_cache, slot, n, kv_heads, group, row, stream);
  else
    key_scores_avx2<8>(scores.data(), q.data(), key_cache, slot, n, kv_heads, group, row, stream);
  for (int64_t hq = 0; hq < heads; ++hq) {  // fp32 weights, as the generic loops
    const float sum = exp_weights(scores.data() + hq * n, n);
    inv_sum[hq] = sum > 0.f ? 1.f / sum : 0.f;
  }
  if (head_dim == 64)
    value_sums_avx2<4>(out, scores.data(), inv_sum.data(), value_cache, slot, n, kv_heads, group,
                       stream);
  else
    value_sums_avx2<8>(out, scores.data(), inv_sum.data(), value_cache, slot, n, kv_heads, group,
                       stream);
  return true;
}

}  // namespace
#endif
