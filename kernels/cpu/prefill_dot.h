// The tiled prefill attention's block on AVX512-BF16 dot products, for CPUs without AMX and
// for --deterministic (prefill_attention.cpp), in the decode kernel's reduction order: a prompt
// token gets the bits a decode step over the same keys would give it, however its prompt was
// cut into chunks. S in blocks of 4 rows x 16 keys, each query's dim pair broadcast against 16
// keys' pairs, each key vector loaded once for the 4 rows; O in blocks of 4 rows x 64 dims,
// each weight's key pair broadcast against 16 dims' pairs of two keys.

#pragma once

#include "attention_bf16.h"
#include "prefill_blocks.h"

#ifdef PARASHIFT_BF16_DOT
namespace {

// o [R][kDim] <- R rows of weights [padded] bf16 times the packed values (padded / 32 groups).
template <int R>
void dot_values(float* o, const uint16_t* weights, int64_t padded, const uint32_t* values) {
  const int32_t* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = reinterpret_cast<const int32_t*>(weights + i * padded);
  __m512 acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < padded / 2; ++kp) {  // key pairs; 16 per group of 32 keys
    const uint32_t* v = values + (kp / 16) * 1024 + (kp % 16) * 16;
    __m512bh vv[4];
    for (int c = 0; c < 4; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(v + 256 * c);
    for (int i = 0; i < R; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(rows[i][kp]);
      for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], a, vv[c]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + i * kDim + 16 * c, acc[i][c]);
}

// scores rows [R][padded] <- scale * (R query rows . the first `blocks16` blocks of 16 packed
// keys), each dot in the decode kernel's order (key_scores_bf16): lane l of a key's partial
// sums takes dim pairs l and then l + 16, and fold16 adds the 16 lanes pairwise at strides 8,
// 4, 2, 1. Here a vector holds 16 keys' lane l, so that tree is 15 vector adds per row and
// block, and the result is the same bits.
template <int R>
void ordered_scores(float* scores, int64_t padded, const uint16_t* q, int64_t q_stride,
                    const uint32_t* keys_t, int64_t blocks16, float scale) {
  const int32_t* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = reinterpret_cast<const int32_t*>(q + i * q_stride);
  const __m512 scales = _mm512_set1_ps(scale);
  for (int64_t b = 0; b < blocks16; ++b) {
    const uint32_t* kt = keys_t + b * 512;  // dim pair r of 16 keys at (r / 16) * 256 + r % 16 * 16
    __m512 quarter[R][4];  // per row, lanes m, m + 4, m + 8, m + 12 summed as fold16 does
    for (int m = 0; m < 4; ++m) {
      __m512bh k[4][2];  // lanes m + 4j: dim pairs m + 4j and m + 4j + 16, shared by the rows
      for (int j = 0; j < 4; ++j) {
        k[j][0] = (__m512bh)_mm512_loadu_si512(kt + 16 * (m + 4 * j));
        k[j][1] = (__m512bh)_mm512_loadu_si512(kt + 256 + 16 * (m + 4 * j));
      }
      for (int i = 0; i < R; ++i) {
        auto lane = [&](int j) {
          const int l = m + 4 * j;
          return _mm512_dpbf16_ps(
              _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_set1_epi32(rows[i][l]),
                               k[j][0]),
              (__m512bh)_mm512_set1_epi32(rows[i][16 + l]), k[j][1]);
        };
        quarter[i][m] = add_kept(add_kept(lane(0), lane(2)), add_kept(lane(1), lane(3)));
      }
    }
    for (int i = 0; i < R; ++i) {
      const __m512 dots = add_kept(add_kept(quarter[i][0], quarter[i][2]),
                                   add_kept(quarter[i][1], quarter[i][3]));
      _mm512_storeu_ps(scores + i * padded + 16 * b, _mm512_mul_ps(dots, scales));
    }
  }
}

// One block with the decode kernel's arithmetic throughout: its scores (ordered_scores), its
// softmax (softmax_weights: the max, exp, lane sums and bf16 weights), and its value sums,
// which dot_values matches (each dim's sum over key pairs in order; a weight of zero past a
// row's keys adds exactly nothing). head_dim 64 only.
void attend_block_dot(const Block& b, const SequenceKeys& p, float scale,
                          std::vector<float>& scores, std::vector<uint16_t>& weights) {
  const int64_t padded = start_block(b, scores, weights);
  const int64_t blocks16 = (b.first_keys + b.rows - 1 + 15) / 16;
  float* s = scores.data();
  int i = 0;
  for (; i + 4 <= b.rows; i += 4)
    ordered_scores<4>(s + i * padded, padded, b.q + i * b.q_stride, b.q_stride,
                      p.keys_t.data(), blocks16, scale);
  for (; i < b.rows; ++i)
    ordered_scores<1>(s + i * padded, padded, b.q + i * b.q_stride, b.q_stride,
                      p.keys_t.data(), blocks16, scale);
  float sums[16];
  for (i = 0; i < b.rows; ++i) {
    const float sum = softmax_weights(s + i * padded, b.first_keys + i,
                                      reinterpret_cast<uint32_t*>(weights.data() + i * padded));
    sums[i] = sum;  // finish_rows takes 1 / sum where sum > 0, as decode_one_bf16 does
  }
  alignas(64) float o[16 * kDim];
  const uint16_t* w = weights.data();
  i = 0;
  for (; i + 4 <= b.rows; i += 4)
    dot_values<4>(o + i * kDim, w + i * padded, padded, p.values.data());
  for (; i < b.rows; ++i) dot_values<1>(o + i * kDim, w + i * padded, padded, p.values.data());
  finish_rows(b.out, b.out_stride, o, sums, b.rows);
}

}  // namespace
#endif
