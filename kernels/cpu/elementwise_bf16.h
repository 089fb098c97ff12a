// bf16 RMSNorm, rotary and SiLU-and-mul in AVX-512 lanes, 16 at a time: the same arithmetic
// and roundings as elementwise.cpp's templates (fast_exp's polynomial, torch's round-to-nearest
// -even with NaN kept), which gcc vectorized poorly: the bf16 <-> float conversions and the NaN
// select stayed narrow. SiLU-and-mul of a 1,408-token prefill step took 1.1 ms on a Xeon.

#pragma once

#include "bf16_lanes.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)

namespace {

template <>
void silu_and_mul<bf16>(bf16* out, const bf16* x, int64_t x_stride, int64_t tokens, int64_t d,
                        int num_threads) {
#pragma omp parallel for num_threads(threads_for(tokens * d, num_threads))
  for (int64_t t = 0; t < tokens; ++t) {
    const bf16* gate = x + t * x_stride;
    const bf16* up = gate + d;
    bf16* o = out + t * d;
    for (int64_t i = 0; i < d; i += 16) {
      const __mmask16 m = first_lanes(d - i);
      const __m512 g = load_bf16(gate + i, m);
      const __m512 e = exp_lanes(_mm512_sub_ps(_mm512_setzero_ps(), g));
      // g / (1 + e) by a reciprocal estimate and a Newton step (within an ulp of the quotient):
      // a 512-bit division holds its port for 16 cycles, half of this loop's time
      const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), e);
      __m512 inv = _mm512_rcp14_ps(den);
      inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.f)));
      const __m512 silu = round_bf16(_mm512_mul_ps(g, inv));
      store_bf16(o + i, m, _mm512_mul_ps(silu, load_bf16(up + i, m)));
    }
  }
}

template <>
void rms_norm<bf16>(bf16* out, bf16* residual_out, const bf16* x, int64_t x_stride,
                    const bf16* residual, int64_t residual_stride, const bf16* weight,
                    int64_t rows, int64_t hidden, float eps, int num_threads) {
#pragma omp parallel num_threads(threads_for(rows * hidden, num_threads))
  {
    std::vector<float> row(hidden + 16);
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
      const bf16* xr = x + r * x_stride;
      __m512 squares = _mm512_setzero_ps();
      for (int64_t i = 0; i < hidden; i += 16) {
        const __mmask16 m = first_lanes(hidden - i);
        __m512 v = load_bf16(xr + i, m);
        if (residual != nullptr) {
          const __m512 res = load_bf16(residual + r * residual_stride + i, m);
          const __m256i sum = to_bf16(_mm512_add_ps(v, res));
          _mm256_mask_storeu_epi16(residual_out + r * hidden + i, m, sum);
          v = widen(sum);
        }
        _mm512_storeu_ps(row.data() + i, v);
        squares = _mm512_fmadd_ps(v, v, squares);
      }
      const float mean = _mm512_reduce_add_ps(squares) / static_cast<float>(hidden);
      const float inv = 1.f / std::sqrt(mean + eps);
      bf16* o = out + r * hidden;
      for (int64_t i = 0; i < hidden; i += 16) {
        const __mmask16 m = first_lanes(hidden - i);
        const __m512 normed =
            round_bf16(_mm512_mul_ps(_mm512_loadu_ps(row.data() + i), _mm512_set1_ps(inv)));
        store_bf16(o + i, m, _mm512_mul_ps(load_bf16(weight + i, m), normed));
      }
    }
  }
}

template <>
void rotary<bf16>(bf16* x, int64_t token_stride, const bf16* cos, const bf16* sin,
                  int64_t tokens, int64_t heads, int64_t head_dim, int num_threads) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(threads_for(tokens * heads * head_dim, num_threads))
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < half; i += 16) {
      const __mmask16 m = first_lanes(half - i);
      const __m512 c = load_bf16(cos + t * half + i, m), s = load_bf16(sin + t * half + i, m);
      for (int64_t h = 0; h < heads; ++h) {
        bf16* x1 = x + t * token_stride + h * head_dim + i;
        bf16* x2 = x1 + half;
        const __m512 a = load_bf16(x1, m), b = load_bf16(x2, m);
        store_bf16(x1, m, _mm512_sub_ps(round_bf16(_mm512_mul_ps(a, c)),
                                        round_bf16(_mm512_mul_ps(b, s))));
        store_bf16(x2, m, _mm512_add_ps(round_bf16(_mm512_mul_ps(b, c)),
                                        round_bf16(_mm512_mul_ps(a, s))));
      }
    }
  }
}

}  // namespace
#endif
