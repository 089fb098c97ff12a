// Shared by the CPU kernels (elementwise.cpp, attention.cpp), compiled together into one
// library on the machine that runs them (-march=native) and called through ctypes with raw
// pointers: no torch headers, so a build takes seconds. Threads come from the OpenMP runtime
// torch itself loaded (same soname, one pool).
//
// Element types: float32 (T = float) and bfloat16 (T = bf16, the raw 16 bits). Every
// element-wise result is rounded to T where torch's own op would round it, so the kernels
// give torch's bf16 numbers, not a more precise variant that parity tests would have to excuse.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
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
  float n = __builtin_rintf(x * 1.44269504088896341f);  // rint: a vector instruction
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

// Softmax weights of n scores in place, exp(s - max s), unnormalized; returns their sum.
inline float exp_weights(float* s, int64_t n) {
  float top = -INFINITY;
  for (int64_t j = 0; j < n; ++j) top = s[j] > top ? s[j] : top;
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = fast_exp(s[j] - top);
    sum += s[j];
  }
  return sum;
}

// Small ops run on one thread below this many elements: a fork/join costs more than the work.
// torch's pool spins between regions, so the join is cheap: at 32 decode rows RMSNorm took
// 12.1 -> 9.8 us and rotary 20.8 -> 15.3 on two threads once 4,096 elements were enough
// (the limit was 32,768).
constexpr int64_t kParallelMin = 1 << 12;
inline int threads_for(int64_t elements, int num_threads) {
  return elements < kParallelMin ? 1 : num_threads;
}

#ifdef __AVX512F__
// The mask of a 16-lane vector's first `count` lanes (a row's tail; none for count <= 0).
inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? 0xFFFF : count <= 0 ? 0 : static_cast<__mmask16>((1u << count) - 1);
}

// a + b as written: gcc may regroup plain vector adds (-fassociative-math, build.py), each
// inlined copy in its own way, and a sum that --deterministic needs in one order (the decode
// kernel's scores and weights, and the prefill kernel that matches them) must not move.
inline __m512 add_kept(__m512 a, __m512 b) {
  return _mm512_add_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// The sum of v's 16 lanes, pairwise at strides 8, 4, 2, 1, in that order.
inline float lane_sum_kept(__m512 v) {
  v = add_kept(v, _mm512_shuffle_f32x4(v, v, 0x4E));
  v = add_kept(v, _mm512_shuffle_f32x4(v, v, 0xB1));
  v = add_kept(v, _mm512_permute_ps(v, 0x4E));
  v = add_kept(v, _mm512_permute_ps(v, 0xB1));
  return _mm512_cvtss_f32(v);
}

// fast_exp in lanes: the same arithmetic for every element, whatever its alignment (a loop
// of fast_exp that gcc vectorizes takes its first and last elements on the scalar path).
inline __m512 exp_lanes(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.3981999507e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif


// A row's cache lines, ahead of use: into L1 (Locality 3, the default) for the next rows, into
// L2 only (Locality 2) for rows far ahead (row_stream.h), without taking L1's fill buffers.
template <int Locality = 3, class T>
inline void prefetch_row(const T* p, int64_t elements) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < elements * static_cast<int64_t>(sizeof(T)); b += 64)
    __builtin_prefetch(bytes + b, 0, Locality);
}

}  // namespace

// The C entry points take `dtype` 0 = float32, 1 = bfloat16.
#define P(T, p) static_cast<T*>(p)
