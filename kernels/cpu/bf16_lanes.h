// bf16 in AVX-512 lanes, 16 at a time: loads widened to fp32, and torch's rounding back
// (round to nearest even, a NaN kept quiet). Shared by the element-wise kernels
// (elementwise_bf16.h) and the FMA GEMM (gemm_fma.h).

#pragma once

#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)

namespace {

inline __m512 load_bf16(const bf16* p, __mmask16 m) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// from_f<bf16> in lanes: round to nearest even; a NaN stays a quiet NaN. With AVX512-BF16 one
// instruction, which reads a float denormal (below 1.2e-38) as zero: no bf16 input of these
// kernels makes one where torch would not give zero or a bf16 denormal.
inline __m256i to_bf16(__m512 f) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(f);
#else
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
#endif
}

inline __m512 widen(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 round_bf16(__m512 f) { return widen(to_bf16(f)); }
inline void store_bf16(bf16* p, __mmask16 m, __m512 f) {
  _mm256_mask_storeu_epi16(p, m, to_bf16(f));
}

}  // namespace

#endif
