// Decode attention's bfloat16 path on AVX512-BF16 (included by attention.cpp, whose driver
// calls decode_one_bf16 per sequence; attention_avx2.h holds the path for AVX2 without it).

#pragma once

#include "bf16_lanes.h"
#include "common.h"
#include "row_stream.h"

namespace {

#ifdef PARASHIFT_BF16_DOT
// bfloat16 with AVX512-BF16: query-key dots straight on the cache's bf16 pairs (vdpbf16ps, no
// widening), sixteen keys' partial sums folded into one vector of scores by a transpose-and-add
// tree (no horizontal sum per key), and the value sums of a few query heads kept in registers.

constexpr int64_t kTile = 16;  // keys whose scores are folded together

// Folds part[0..15] (16 lanes each) into one vector: lane t = the lane sum of part[t], pairwise
// at strides 8, 4, 2, 1 (ordered_scores in prefill_dot.h takes the same order).
inline __m512 fold16(__m512* part) {
  for (int i = 0; i < 8; ++i)
    part[i] = add_kept(_mm512_shuffle_f32x4(part[2 * i], part[2 * i + 1], 0x44),
                       _mm512_shuffle_f32x4(part[2 * i], part[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    part[i] = add_kept(_mm512_shuffle_f32x4(part[2 * i], part[2 * i + 1], 0x88),
                       _mm512_shuffle_f32x4(part[2 * i], part[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    part[i] = add_kept(_mm512_shuffle_ps(part[2 * i], part[2 * i + 1], 0x44),
                       _mm512_shuffle_ps(part[2 * i], part[2 * i + 1], 0xEE));
  __m512 v = add_kept(_mm512_shuffle_ps(part[0], part[1], 0x88),
                      _mm512_shuffle_ps(part[0], part[1], 0xDD));
  // lane 4k + m holds key k + 4m
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, v);
}

// scores[hq * n + j] = scale * q[hq] . k[j], NV32 = head_dim / 32.
template <int NV32, class Slot>
void key_scores_bf16(float* scores, const bf16* query, const bf16* key_cache, Slot slot,
                     int64_t n, int64_t heads, int64_t group, float scale, int64_t row,
                     RowStream<bf16>& stream) {
  constexpr int64_t head_dim = 32 * NV32;
  const bf16* rows[kTile];
  __m512 part[kTile];
  for (int64_t j0 = 0; j0 < n; j0 += kTile) {
    const int64_t tile = std::min(kTile, n - j0);
    gather_key_tile(rows, key_cache, slot, j0, tile, kTile, n, row, stream);
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
      // a masked store: memcpy of a variable size became `rep movs`, 7% of the kernel's time
      _mm512_mask_storeu_ps(scores + hq * n + j0, first_lanes(tile),
                            _mm512_mul_ps(fold16(part), _mm512_set1_ps(scale)));
    }
  }
}

// out[hq] = bf16(inv_sum[hq] * sum_j p[hq][j] v[j]), NV32 = head_dim / 32: up to GC query
// heads of one kv head at a time, their sums in 2 * NV32 * GC registers. Two keys per
// vdpbf16ps: their value rows interleaved (unpacklo/hi: lane i of a register holds one dim of
// both keys) against the pair of their weights, rounded to bf16 as torch's bf16 attention
// rounds them (`pairs`: per query head, keys 2i and 2i + 1 in one dword). Half the FMAs of
// widening each row to fp32, and no widening.
template <int NV32, int GC, class Slot>
void value_sums_bf16(bf16* out, const uint32_t* pairs, int64_t half, const float* inv_sum,
                     const bf16* value_cache, Slot slot, int64_t n, int64_t kv_heads,
                     int64_t group, RowStream<bf16>& stream) {
  constexpr int64_t head_dim = 32 * NV32;
  // unpacklo/hi leave dims in 4-lane groups: lo = dims {0-3, 8-11, 16-19, 24-27} of a 32-dim
  // chunk, hi = {4-7, 12-15, 20-23, 28-31}; these put them back in order.
  const __m512i first16 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i last16 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                           30, 31);
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t g0 = 0; g0 < group; g0 += GC) {
      const int64_t count = std::min<int64_t>(GC, group - g0), first = h * group + g0;
      __m512 acc[GC][2 * NV32];
      for (int g = 0; g < GC; ++g)
        for (int c = 0; c < 2 * NV32; ++c) acc[g][c] = _mm512_setzero_ps();
      for (int64_t jp = 0; jp < half; ++jp) {
        const int64_t j = 2 * jp;
        for (int64_t t = j; t < std::min(j + 2, n); ++t)
          if (t + kTile < n) prefetch_row(value_cache + slot(t + kTile) + h * head_dim, head_dim);
        if (h == 0 && g0 == 0) stream.read(std::min<int64_t>(2, n - j));
        const bf16* v0 = value_cache + slot(j) + h * head_dim;
        const bf16* v1 = j + 1 < n ? value_cache + slot(j + 1) + h * head_dim : nullptr;
        __m512i w[2 * NV32];
        for (int c = 0; c < NV32; ++c) {
          const __m512i a = _mm512_loadu_si512(v0 + 32 * c);
          const __m512i b = v1 ? _mm512_loadu_si512(v1 + 32 * c) : _mm512_setzero_si512();
          w[2 * c] = _mm512_unpacklo_epi16(a, b);
          w[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
        }
        for (int g = 0; g < GC; ++g) {
          if (g >= count) break;
          const __m512bh p = (__m512bh)_mm512_set1_epi32(pairs[(first + g) * half + jp]);
          for (int c = 0; c < 2 * NV32; ++c)
            acc[g][c] = _mm512_dpbf16_ps(acc[g][c], p, (__m512bh)w[c]);
        }
      }
      for (int64_t g = 0; g < count; ++g) {
        const __m512 inv = _mm512_set1_ps(inv_sum[first + g]);
        bf16* o = out + (first + g) * head_dim;
        for (int c = 0; c < NV32; ++c) {
          const __m512 lo = _mm512_mul_ps(acc[g][2 * c], inv);
          const __m512 hi = _mm512_mul_ps(acc[g][2 * c + 1], inv);
          __m256bh y0 = _mm512_cvtneps_pbh(_mm512_permutex2var_ps(lo, first16, hi));
          __m256bh y1 = _mm512_cvtneps_pbh(_mm512_permutex2var_ps(lo, last16, hi));
          std::memcpy(o + 32 * c, &y0, 32);
          std::memcpy(o + 32 * c + 16, &y1, 32);
        }
      }
    }
  }
}

// One query head's key weights: p = exp(s - max s) in place; returns their sum, and writes
// their bf16 pairs (keys 2i and 2i + 1 in dword i, a zero after an odd last key). The max and
// the sum in vector lanes: written as plain loops, gcc kept both scalar (a tenth of the
// kernel's time at 136 keys).
inline float softmax_weights(float* s, int64_t n, uint32_t* pairs) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = first_lanes(n - j);
    top = _mm512_mask_max_ps(top, m, top, _mm512_maskz_loadu_ps(m, s + j));
  }
  const __m512 t = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  for (int64_t j = 0; j < n; j += 16) {  // in lanes: the same bits at any offset of s
    const __mmask16 m = first_lanes(n - j);
    _mm512_mask_storeu_ps(s + j, m, exp_lanes(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), t)));
  }
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 32) {
    const __m512 a = _mm512_maskz_loadu_ps(first_lanes(n - j), s + j);
    const __m512 b = _mm512_maskz_loadu_ps(first_lanes(n - j - 16), s + j + 16);
    sum = add_kept(sum, add_kept(a, b));
    const int64_t words = std::min<int64_t>(32, (n - j + 1) & ~int64_t{1});  // whole pairs
    const __mmask32 m = words >= 32 ? ~__mmask32{0} : (__mmask32{1} << words) - 1;
    _mm512_mask_storeu_epi16(pairs + j / 2, m, (__m512i)_mm512_cvtne2ps_pbh(b, a));
  }
  return lane_sum_kept(sum);
}

// The bf16 path for head_dim 64 and 128; false: not taken, the generic loops run.
template <class Slot>
bool decode_one_bf16(bf16* out, const bf16* query, const bf16* key_cache,
                     const bf16* value_cache, Slot slot, int64_t n, int64_t heads,
                     int64_t kv_heads, int64_t head_dim, float scale, std::vector<float>& scores,
                     std::vector<uint32_t>& pairs, std::vector<float>& inv_sum,
                     RowStream<bf16>& stream) {
  if (head_dim != 64 && head_dim != 128) return false;
  const int64_t group = heads / kv_heads, row = kv_heads * head_dim;
  scores.resize(heads * n);
  if (head_dim == 64)
    key_scores_bf16<2>(scores.data(), query, key_cache, slot, n, heads, group, scale, row, stream);
  else
    key_scores_bf16<4>(scores.data(), query, key_cache, slot, n, heads, group, scale, row, stream);
  const int64_t half = (n + 1) / 2;
  pairs.resize(heads * half);
  for (int64_t hq = 0; hq < heads; ++hq) {
    const float sum = softmax_weights(scores.data() + hq * n, n, pairs.data() + hq * half);
    inv_sum[hq] = sum > 0.f ? 1.f / sum : 0.f;
  }
  if (head_dim == 64)
    value_sums_bf16<2, 4>(out, pairs.data(), half, inv_sum.data(), value_cache, slot, n,
                          kv_heads, group, stream);
  else
    value_sums_bf16<4, 2>(out, pairs.data(), half, inv_sum.data(), value_cache, slot, n,
                          kv_heads, group, stream);
  return true;
}
#endif

}  // namespace
