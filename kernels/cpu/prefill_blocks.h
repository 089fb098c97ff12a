// What the two forms of the tiled prefill attention share (prefill_attention.cpp): the keys and
// values of one (sequence, kv head) packed as B operands, a block of query tokens, the softmax
// of a block's scores and the last step, O / sum -> bf16.

#pragma once

#include "amx.h"

#if defined(PARASHIFT_AMX) || defined(PARASHIFT_BF16_DOT)
#define PARASHIFT_TILED_PREFILL 1
namespace {

constexpr int64_t kDim = 64;  // head_dim this kernel takes

struct SequenceKeys {
  std::vector<uint32_t> keys_t;  // [n / 16][2 halves][16 dim pairs][16 keys]
  std::vector<uint32_t> values;  // [n / 32][4 dim blocks][16 key pairs][16 dims]
};

// Packs one kv head's n keys and values (rows at key_cache + offsets[j] + head * kDim).
void pack_keys(SequenceKeys& p, const uint16_t* key_cache, const uint16_t* value_cache,
               const std::vector<int64_t>& offsets, int64_t n, int64_t head) {
  const int64_t padded = (n + 31) / 32 * 32;  // keys, rounded up to 32
  p.keys_t.assign(padded * kDim / 2, 0);
  p.values.assign(padded * kDim / 2, 0);
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t* k = reinterpret_cast<const uint32_t*>(key_cache + offsets[j] + head * kDim);
    uint32_t* dst = p.keys_t.data() + (j / 16) * 512 + (j % 16);
    for (int64_t r = 0; r < kDim / 2; ++r) dst[(r / 16) * 256 + (r % 16) * 16] = k[r];
  }
  for (int64_t j = 0; j < n; j += 2) {
    const __m512i zero = _mm512_setzero_si512();
    const uint16_t* v0 = value_cache + offsets[j] + head * kDim;
    const uint16_t* v1 = j + 1 < n ? value_cache + offsets[j + 1] + head * kDim : nullptr;
    uint32_t* dst = p.values.data() + (j / 32) * 1024 + ((j % 32) / 2) * 16;
    for (int64_t c = 0; c < 4; ++c) {
      const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(v0 + 16 * c)));
      const __m512i b = v1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(v1 + 16 * c))) : zero;
      _mm512_storeu_si512(dst + c * 256, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
    }
  }
}

// One block of `rows` tokens (query rows q, stride q_stride elements) of one query head; the
// block's first token sees `first_keys` keys and each next one a key more. out rows: out_stride.
struct Block {
  uint16_t* out;
  int64_t out_stride;
  const uint16_t* q;
  int64_t q_stride;
  int rows;
  int64_t first_keys;
};

// The block's score and weight buffers, for the keys its last row sees rounded up to 32 (the
// weights zeroed: P V reads whole groups of 32 keys); returns that count.
int64_t start_block(const Block& b, std::vector<float>& scores, std::vector<uint16_t>& weights) {
  const int64_t padded = (b.first_keys + b.rows - 1 + 31) / 32 * 32;
  scores.resize(16 * padded);
  weights.assign(16 * padded, 0);
  return padded;
}

// The block's scores [rows][padded] (raw dots; row i sees first_keys + i keys) -> its softmax
// weights [rows][padded] bf16 (zero past each row's keys) and each row's sum of them.
void softmax_rows(float* scores, uint16_t* weights, int64_t padded, int rows,
                  int64_t first_keys, float scale, float* sums) {
  for (int i = 0; i < rows; ++i) {
    const int64_t n = first_keys + i;
    float* s = scores + i * padded;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = first_lanes(n - j);
      top = _mm512_mask_max_ps(top, m, top, _mm512_maskz_loadu_ps(m, s + j));
    }
    const float t = _mm512_reduce_max_ps(top) * scale;
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      s[j] = fast_exp(s[j] * scale - t);
      sum += s[j];
    }
    sums[i] = sum;
    uint16_t* w = weights + i * padded;
    for (int64_t j = 0; j < n; ++j) w[j] = from_f<bf16>(s[j]).bits;
  }
}

// o [rows][kDim] fp32 sums of weighted values / the rows' sums -> out rows (out_stride) bf16.
void finish_rows(uint16_t* out, int64_t out_stride, const float* o, const float* sums,
                 int rows) {
  for (int i = 0; i < rows; ++i) {
    const __m512 inv = _mm512_set1_ps(sums[i] > 0.f ? 1.f / sums[i] : 0.f);
    for (int c = 0; c < 4; ++c) {
      const __m512 sums_c = _mm512_loadu_ps(o + i * kDim + 16 * c);
      const __m256bh y = _mm512_cvtneps_pbh(_mm512_mul_ps(sums_c, inv));
      std::memcpy(out + i * out_stride + 16 * c, &y, 32);
    }
  }
}

}  // namespace
#endif
