// bf16 in vector lanes: loads widened to fp32, and torch's rounding back (round to nearest
// even, a NaN kept quiet); 16 at a time in AVX-512, 8 in AVX2. Shared by the element-wise
// kernels (elementwise_bf16.h), the FMA GEMM (gemm_fma.h) and decode attention on AVX2
// (attention_bf16.h).

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

#if defined(__AVX2__)
#include <immintrin.h>

namespace {

// 16 bf16 values -> two fp32 vectors by unpacking with zeros: lo = values [0-3 | 8-11], hi =
// [4-7 | 12-15] (one shuffle each, no shift); in_order puts such a pair back as [0-7], [8-15].
inline void widen16_unpacked(const void* p, __m256& lo, __m256& hi) {
  const __m256i w = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, w));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, w));
}
inline void in_order(__m256& lo, __m256& hi) {
  const __m256 first = _mm256_permute2f128_ps(lo, hi, 0x20);
  hi = _mm256_permute2f128_ps(lo, hi, 0x31);
  lo = first;
}

// Round 8 floats to bf16 as torch does and store `count` (<= 8; none if <= 0) of them.
inline void store_bf16_8(uint16_t* out, __m256 f, int64_t count) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  // |u| > infinity's bits, signed compare is safe: both sides are below 2^31
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i bits = _mm256_blendv_epi8(rounded, quiet, nan);
  // 8 x 32 -> 8 x 16 bits: pack within each 128-bit lane, then bring the lanes' halves together
  const __m128i packed = _mm256_castsi256_si128(_mm256_permute4x64_epi64(
      _mm256_packus_epi32(bits, bits), 0x08));
  if (count >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), packed);
  } else if (count > 0) {
    alignas(16) uint16_t lanes[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(lanes), packed);
    std::memcpy(out, lanes, count * sizeof(uint16_t));
  }
}

}  // namespace

#endif
