// gemm.cpp's bf16 GEMM on CPUs without AVX512-BF16 (AVX2 with FMA, or AVX-512F): the same
// packed weight, each k pair of 16 columns widened to fp32 in registers (a shift for the even
// k, a mask for the odd: exact), then fp32 FMAs. The rows are widened once per call into a
// float buffer, so each row's value is one broadcast load. The weight stays bf16 in memory:
// half the bytes of the fp32 copy the other paths widen it to, with the same products, since
// widening bf16 is exact (only the order of the sums differs).
//
// Register blocks: AVX-512, 4 rows x up to 4 blocks of 16 columns (each block's pair widened,
// then every row's two broadcasts against it); AVX2, 6 rows x one 8-column half of a block at a
// time (16 ymm registers hold no more). Measured on a Xeon (Sapphire Rapids) with torch's
// libraries held to the same instructions, at 32 rows and SmolLM2's shapes, weights streamed:
// on AVX-512 1.55x MKL's packed fp32 GEMM over the widened weight (the fastest of torch's
// paths there), on AVX2 1.1-1.2x it on one thread.

#pragma once

#if !defined(PARASHIFT_BF16_DOT) && defined(__AVX2__) && defined(__FMA__)
#define PARASHIFT_FMA_GEMM 1
#include <immintrin.h>

#include "bf16_lanes.h"

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// Rows per register block: 6 measured no faster than 4 (gcc then keeps the broadcasts and
// spills accumulators).
constexpr int kFmaRows = 4;

// A 16-column block's k pair -> the even k's and the odd k's 16 fp32 values.
inline void widen_pair(const uint16_t* b, __m512& even, __m512& odd) {
  const __m512i w = _mm512_loadu_si512(b);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(int(0xFFFF0000u))));
}

template <int MB, int NB>
void micro(uint16_t* out, int64_t out_stride, const float* x, int64_t x_stride,
           const uint16_t* b, int64_t b_stride, int64_t k2, const uint16_t* bias,
           int64_t cols, const char* ahead, int64_t ahead_lines, const uint16_t* scale) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t per_kp = (ahead_lines + k2 - 1) / k2;
  for (int64_t kp = 0; kp < k2; ++kp) {
    for (int64_t q = kp * per_kp; q < std::min(ahead_lines, (kp + 1) * per_kp); ++q)
      __builtin_prefetch(ahead + q * 64, 0, 2);
    for (int j = 0; j < NB; ++j) {  // a block's pair widened, then every row's broadcasts
      __m512 even, odd;
      widen_pair(b + kp * b_stride + j * 32, even, odd);
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i)
        acc[i][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * x_stride + 2 * kp + 1]), odd,
                                    _mm512_fmadd_ps(_mm512_set1_ps(x[i * x_stride + 2 * kp]),
                                                    even, acc[i][j]));
    }
  }
  for (int j = 0; j < NB; ++j) {
    const __mmask16 mask = first_lanes(cols - 16 * j);
    const __m512 add = bias ? load_bf16(reinterpret_cast<const bf16*>(bias + 16 * j), mask)
                            : _mm512_setzero_ps();
    const __m512 mul = scale ? load_bf16(reinterpret_cast<const bf16*>(scale + 16 * j), mask)
                             : _mm512_set1_ps(1.f);
    for (int i = 0; i < MB; ++i)
      store_bf16(reinterpret_cast<bf16*>(out + i * out_stride + 16 * j), mask,
                 _mm512_fmadd_ps(acc[i][j], mul, add));
  }
}

#else  // AVX2
constexpr int kFmaRows = 6;  // 6 rows x 2 accumulators, 2 widened pairs, a broadcast, zero

// The widening here is an unpack with zeros (the shuffle port on Intel, beside the FMAs; a
// shift and a mask took the FMA ports and held the kernel to ~50% of peak on a Xeon): 8 columns'
// pairs become [c0 even, c0 odd, c1 even, c1 odd | c4 .. c5] and [c2 .. c3 | c6 .. c7], each row's
// k pair is one 8-byte broadcast against them, and a horizontal add at the end puts each
// column's even and odd sums together, in column order. One 8-column half of a block at a
// time, over all k (with both halves gcc shares the broadcasts between them and runs out of
// registers).
template <int MB>
void half_avx2(uint16_t* out, int64_t out_stride, const float* x, int64_t x_stride,
               const uint16_t* b, int64_t b_stride, int64_t k2, const float* mul,
               const float* add, int64_t cols, const char* ahead, int64_t ahead_lines) {
  __m256 acc[MB][2];  // per row: columns 0-1|4-5 and 2-3|6-7, each as even and odd sums
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const int64_t per_kp = (ahead_lines + k2 - 1) / k2;
  for (int64_t kp = 0; kp < k2; ++kp) {
    for (int64_t q = kp * per_kp; q < std::min(ahead_lines, (kp + 1) * per_kp); ++q)
      __builtin_prefetch(ahead + q * 64, 0, 2);
    __m256 wa, wb;
    widen16_unpacked(b + kp * b_stride, wa, wb);
    // unrolled before gcc's scalar replacement, or the accumulators live on the stack
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m256 xp = _mm256_castpd_ps(_mm256_broadcast_sd(
          reinterpret_cast<const double*>(x + i * x_stride + 2 * kp)));
      acc[i][0] = _mm256_fmadd_ps(xp, wa, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xp, wb, acc[i][1]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
    store_bf16_8(out + i * out_stride,
                 _mm256_fmadd_ps(_mm256_hadd_ps(acc[i][0], acc[i][1]), _mm256_load_ps(mul),
                                 _mm256_load_ps(add)),
                 std::min<int64_t>(8, cols));
}

template <int MB>
void block_avx2(uint16_t* out, int64_t out_stride, const float* x, int64_t x_stride,
                const uint16_t* b, int64_t b_stride, int64_t k2, const uint16_t* bias,
                int64_t cols, const char* ahead, int64_t ahead_lines, const uint16_t* scale) {
  alignas(32) float add[16] = {};  // the bias of the block's columns
  alignas(32) float mul[16] = {1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f,
                               1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f};  // int8's scales
  for (int64_t c = 0; c < std::min<int64_t>(16, cols); ++c) {
    if (bias) add[c] = to_f(bf16{bias[c]});
    if (scale) mul[c] = to_f(bf16{scale[c]});
  }
  half_avx2<MB>(out, out_stride, x, x_stride, b, b_stride, k2, mul, add, cols, ahead,
                ahead_lines);
  if (cols > 8)
    half_avx2<MB>(out + 8, out_stride, x, x_stride, b + 16, b_stride, k2, mul + 8, add + 8,
                  cols - 8, nullptr, 0);
}

// NB blocks one after another (the packed tile's blocks sit 32 values apart per k pair); the
// next chunk's prefetch goes with the first.
template <int MB, int NB>
void micro(uint16_t* out, int64_t out_stride, const float* x, int64_t x_stride,
           const uint16_t* b, int64_t b_stride, int64_t k2, const uint16_t* bias,
           int64_t cols, const char* ahead, int64_t ahead_lines, const uint16_t* scale) {
  for (int j = 0; j < NB; ++j)
    block_avx2<MB>(out + 16 * j, out_stride, x, x_stride, b + 32 * j, b_stride, k2,
                   bias ? bias + 16 * j : nullptr, cols - 16 * j, j == 0 ? ahead : nullptr,
                   j == 0 ? ahead_lines : 0, scale ? scale + 16 * j : nullptr);
}
#endif

}  // namespace
#endif
