// bfloat16 GEMM for few rows (decode batches) on AVX512-BF16: y = x W^T (+ bias), x [M, K]
// and y [M, N] bf16, W pre-packed once into the operand layout of vdpbf16ps.
//
// Why not oneDNN: at 32 rows its bf16 GEMMs ran at 240-490 GFLOP/s of this CPU's ~930 and read
// the weight at 7-15 GB/s, half the memory's speed; a decode step is that GEMM 121 times. Here
// a register block of 6 rows x 64 columns (24 fp32 accumulators) takes each weight pair from
// one sequential stream per tile, the rows' pairs by embedded broadcast, and the threads split
// the columns (in chunks, column_shares.h), so each weight byte leaves memory once per call.

#include "bf16_lanes.h"
#include "column_shares.h"
#include "common.h"
#include "entry_points.h"

namespace {

constexpr int64_t kTile = 4;  // 16-column blocks per tile of the packed weight

// The packed weight: tiles of kTile blocks of 16 columns (the last tile may be narrower); for
// each k pair a tile stores its blocks' 16 columns x 2 k side by side, so one tile is one
// sequential stream. Element (n, k) of W sits at
//   tile_offset(n / 64) + ((k / 2) * width + (n % 64) / 16) * 32 + (n % 16) * 2 + k % 2.
inline int64_t tile_offset(int64_t tile, int64_t k2) { return tile * k2 * kTile * 32; }

// W [n, k] (row stride w_stride, k even) -> the packed layout, zeros in the last block's
// missing columns.
template <class E>
void pack(E* dst, const E* w, int64_t w_stride, int64_t n, int64_t k, int num_threads) {
  const int64_t k2 = k / 2, blocks = (n + 15) / 16;
#pragma omp parallel for num_threads(num_threads)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t tile = blk / kTile, j = blk % kTile;
    const int64_t width = std::min(kTile, blocks - tile * kTile);
    E* base = dst + tile_offset(tile, k2) + j * 32;
    for (int64_t kp = 0; kp < k2; ++kp)
      for (int64_t c = 0; c < 16; ++c) {
        const int64_t row = blk * 16 + c;
        for (int64_t h = 0; h < 2; ++h)
          base[kp * width * 32 + c * 2 + h] = row < n ? w[row * w_stride + 2 * kp + h] : E{0};
      }
  }
}

}  // namespace

#include "gemm_amx.h"
#include "gemm_fma.h"
#include "gemm_int8.h"

#ifdef PARASHIFT_BF16_DOT
namespace {

constexpr int kRows = 6;  // rows per register block
using Operand = uint16_t;  // vdpbf16ps multiplies the rows' bf16 pairs as they are

template <int MB, int NB>
void micro(uint16_t* out, int64_t out_stride, const uint16_t* x, int64_t x_stride,
           const uint16_t* b, int64_t b_stride, int64_t k2, const uint16_t* bias,
           int64_t cols, const char* ahead, int64_t ahead_lines, const uint16_t* scale) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int32_t* rows[MB];
  for (int i = 0; i < MB; ++i) rows[i] = reinterpret_cast<const int32_t*>(x + i * x_stride);
  const int64_t per_kp = (ahead_lines + k2 - 1) / k2;
  for (int64_t kp = 0; kp < k2; ++kp) {
    for (int64_t q = kp * per_kp; q < std::min(ahead_lines, (kp + 1) * per_kp); ++q)
      __builtin_prefetch(ahead + q * 64, 0, 2);
    if (kp % 16 == 0)  // the rows' pairs two lines ahead: x may sit in the other core's cache
      for (int i = 0; i < MB; ++i) __builtin_prefetch(rows[i] + kp + 32);
    __m512bh w[NB];
    for (int j = 0; j < NB; ++j)
      w[j] = (__m512bh)_mm512_loadu_si512(b + kp * b_stride + j * 32);
    for (int i = 0; i < MB; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(rows[i][kp]);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, w[j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t left = cols - 16 * j;  // the last block of W may be partial
    const __mmask16 mask = first_lanes(left);
    const __m512 add = bias ? load_bf16(reinterpret_cast<const bf16*>(bias + 16 * j), mask)
                            : _mm512_setzero_ps();
    const __m512 mul = scale ? load_bf16(reinterpret_cast<const bf16*>(scale + 16 * j), mask)
                             : _mm512_set1_ps(1.f);
    for (int i = 0; i < MB; ++i) {
      const __m256bh y = _mm512_cvtneps_pbh(_mm512_fmadd_ps(acc[i][j], mul, add));
      _mm256_mask_storeu_epi16(out + i * out_stride + 16 * j, mask, (__m256i)y);
    }
  }
}

}  // namespace
#elif defined(PARASHIFT_FMA_GEMM)
namespace {
constexpr int kRows = kFmaRows;
using Operand = float;  // the rows widened once (gemm_fma.h)
}  // namespace
#endif

#if defined(PARASHIFT_BF16_DOT) || defined(PARASHIFT_FMA_GEMM)
#define PARASHIFT_OWN_GEMM 1
namespace {

constexpr int64_t kPanel = 384;  // rows whose x stays in L2 while a thread's columns pass

// ..., scale: int8 weights' scales of the block's columns (null: bf16 weights)
using Micro = void (*)(uint16_t*, int64_t, const Operand*, int64_t, const uint16_t*, int64_t,
                       int64_t, const uint16_t*, int64_t, const char*, int64_t,
                       const uint16_t*);

template <int MB>
constexpr Micro pick(int nb) {
  return nb == 1 ? micro<MB, 1> : nb == 2 ? micro<MB, 2> : nb == 3 ? micro<MB, 3> : micro<MB, 4>;
}

Micro kernel(int mb, int nb) {
  static const Micro table[6][kTile] = {  // rows 1..kRows taken
      {pick<1>(1), pick<1>(2), pick<1>(3), pick<1>(4)},
      {pick<2>(1), pick<2>(2), pick<2>(3), pick<2>(4)},
      {pick<3>(1), pick<3>(2), pick<3>(3), pick<3>(4)},
      {pick<4>(1), pick<4>(2), pick<4>(3), pick<4>(4)},
      {pick<5>(1), pick<5>(2), pick<5>(3), pick<5>(4)},
      {pick<6>(1), pick<6>(2), pick<6>(3), pick<6>(4)}};
  return table[mb - 1][nb - 1];
}

// The rows as the micro-kernels read them: as they are for vdpbf16ps, widened to fp32 (into a
// buffer of the calling thread's, reused) for the FMA kernels.
const Operand* operands(const uint16_t* x, int64_t x_stride, int64_t m, int64_t k,
                        int threads, int64_t& stride) {
#ifdef PARASHIFT_FMA_GEMM
  thread_local std::vector<float> widened;
  widened.resize(m * k);
  float* dst = widened.data();
#pragma omp parallel for num_threads(threads) if (m * k >= (1 << 16))
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < k; ++c) dst[r * k + c] = to_f(bf16{x[r * x_stride + c]});
  stride = k;
  return dst;
#else
  stride = x_stride;
  return x;
#endif
}

}  // namespace
#endif

extern "C" {

// Our bf16 GEMM's instructions here: 0 none, 1 fp32 FMA (AVX2 or AVX-512F), 2 vdpbf16ps,
// 3 AMX tiles (where k % 32 == 0; vdpbf16ps otherwise).
int parashift_cpu_bf16_gemm() {
#if defined(PARASHIFT_AMX)
  if (amx_permitted()) return 3;
#endif
#if defined(PARASHIFT_BF16_DOT)
  return 2;
#elif defined(PARASHIFT_FMA_GEMM)
  return 1;
#else
  return 0;
#endif
}

// packed [ceil(n / 16) * 16 * k] <- W [n, k] bf16, k even (row stride w_stride), zero-padded to whole 16-column blocks.
void parashift_pack_bf16(void* packed, const void* weight, int64_t w_stride, int64_t n,
                         int64_t k, int num_threads) {
  pack(static_cast<uint16_t*>(packed), static_cast<const uint16_t*>(weight), w_stride, n, k,
       num_threads);
}

// The same layout for an int8 weight (gemm_int8.h), a byte an element.
void parashift_pack_int8(void* packed, const void* weight, int64_t w_stride, int64_t n,
                         int64_t k, int num_threads) {
  pack(static_cast<int8_t*>(packed), static_cast<const int8_t*>(weight), w_stride, n, k,
       num_threads);
}

// out [m, n] bf16 (row stride out_stride) <- (x [m, k] bf16 (row stride x_stride) Q^T) * scale
// + bias: Q packed by parashift_pack_int8, scale [n] and bias [n] (or null) bf16, k even;
// next_packed [next_n, next_k] (or null): the int8 weight the caller's next GEMM takes, fetched
// as this one ends (on AMX). On AMX tiles where k % 32 == 0 (gemm_int8.h), else on the bf16
// GEMM's kernels over widened columns. Needs parashift_cpu_bf16_gemm() > 0.
void parashift_gemm_int8(void* out, int64_t out_stride, const void* x, int64_t x_stride,
                         const void* packed, const void* scale, const void* bias, int64_t m,
                         int64_t n, int64_t k, const void* next_packed, int64_t next_n,
                         int64_t next_k, int num_threads) {
#ifdef PARASHIFT_OWN_GEMM
  const int64_t k2 = k / 2, blocks = (n + 15) / 16;
  uint16_t* y = static_cast<uint16_t*>(out);
  const uint16_t* xs = static_cast<const uint16_t*>(x);
  const int8_t* w = static_cast<const int8_t*>(packed);
  const uint16_t* ss = static_cast<const uint16_t*>(scale);
  const uint16_t* bs = static_cast<const uint16_t*>(bias);
  const int threads = static_cast<int>(std::min<int64_t>(
      blocks, threads_for(m * n * k / 64, num_threads)));
#ifdef PARASHIFT_AMX
  if (k % 32 == 0 && amx_permitted()) {
    gemm_int8_amx(y, out_stride, xs, x_stride, w, ss, bs, m, n, k, threads,
                  static_cast<const int8_t*>(next_packed), next_n, next_k);
    return;
  }
#endif
  // The bf16 kernels' split and register blocks: each thread's block of columns widened once
  // into a buffer laid out as a packed tile of its width, then multiplied by every row.
  int64_t a_stride;
  const Operand* a = operands(xs, x_stride, m, k, threads, a_stride);
  ColumnShares shares(blocks, 1, kTile, threads);
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num();
    thread_local std::vector<uint16_t> wide;
    wide.resize(k2 * kTile * 32);
    ColumnChunk c;
    while (shares.next(tid, c)) {
      const int64_t blk = c.block, tile = blk / kTile, j = blk % kTile;
      const int64_t width = std::min(kTile, blocks - tile * kTile);
      const int nb = c.blocks;
      const int8_t* src = w + tile_offset(tile, k2) + j * 32;
      const int64_t row = nb * 32;  // values of a k pair
      for (int64_t kp = 0; kp < k2; ++kp)  // exact: |q| <= 127 fits bf16's 8 bits
        for (int64_t i = 0; i < row; ++i) {
          const float f = src[kp * width * 32 + i];
          uint32_t u;
          std::memcpy(&u, &f, 4);
          wide[kp * row + i] = static_cast<uint16_t>(u >> 16);
        }
      const int64_t col = blk * 16;
      for (int64_t r = 0; r < m; r += kRows) {
        const int mb = static_cast<int>(std::min<int64_t>(kRows, m - r));
        kernel(mb, nb)(y + r * out_stride + col, out_stride, a + r * a_stride, a_stride,
                       wide.data(), row, k2, bs ? bs + col : nullptr, n - col, nullptr, 0,
                       ss + col);
      }
    }
  }
#endif
}

// out [m, n] (row stride out_stride) <- x [m, k] (row stride x_stride) W^T + bias (bias [n] or
// null), all bf16, W packed by parashift_pack_bf16. Needs parashift_cpu_bf16_gemm() > 0.
void parashift_gemm_bf16(void* out, int64_t out_stride, const void* x, int64_t x_stride,
                         const void* packed, const void* bias, int64_t m, int64_t n, int64_t k,
                         int num_threads) {
  parashift_gemm_bf16_then(out, out_stride, x, x_stride, packed, bias, m, n, k, nullptr, 0, 0,
                           num_threads);
}

// The same, where the caller's next GEMM is by next_packed [next_n, next_k] (null: none): on
// AMX its first weight comes into cache while this one ends.
void parashift_gemm_bf16_then(void* out, int64_t out_stride, const void* x, int64_t x_stride,
                              const void* packed, const void* bias, int64_t m, int64_t n,
                              int64_t k, const void* next_packed, int64_t next_n,
                              int64_t next_k, int num_threads) {
#ifdef PARASHIFT_OWN_GEMM
  const int64_t k2 = k / 2, blocks = (n + 15) / 16;
  uint16_t* y = static_cast<uint16_t*>(out);
  const uint16_t* xs = static_cast<const uint16_t*>(x);
  const uint16_t* w = static_cast<const uint16_t*>(packed);
  const uint16_t* bs = static_cast<const uint16_t*>(bias);
  const int threads = static_cast<int>(std::min<int64_t>(
      blocks, threads_for(m * n * k / 64, num_threads)));
#ifdef PARASHIFT_AMX
  if (k % 32 == 0 && amx_permitted()) {
    gemm_amx(y, out_stride, xs, x_stride, {w, n, k}, bs, m, threads,
             {static_cast<const uint16_t*>(next_packed), next_n, next_k});
    return;
  }
#endif
  int64_t a_stride;
  const Operand* a = operands(xs, x_stride, m, k, threads, a_stride);
  ColumnShares shares(blocks, (m + kPanel - 1) / kPanel, kTile, threads);
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num();
    ColumnChunk c;
    while (shares.next(tid, c)) {
      const int64_t row0 = c.panel * kPanel, rows = std::min(kPanel, m - row0);
      const int64_t passes = (rows + kRows - 1) / kRows;
      const int64_t tile = c.block / kTile, j = c.block % kTile;
      const int64_t width = std::min(kTile, blocks - tile * kTile);
      const uint16_t* b = w + tile_offset(tile, k2) + j * 32;
      const int64_t col = c.block * 16, cols = n - col;
      // The next chunk's weight, into L2 while this one computes (its first row block reads
      // from memory otherwise, at the speed of a single stream): spread over the row blocks.
      int64_t next_lines = 0;
      const char* next_b = nullptr;
      if (c.next_block >= 0) {
        const int64_t next_tile = c.next_block / kTile;
        next_b = reinterpret_cast<const char*>(w + tile_offset(next_tile, k2));
        next_lines = k2 * std::min(kTile, blocks - next_tile * kTile);  // 64-byte lines
      }
      const int64_t lines_per_pass = (next_lines + passes - 1) / passes;
      for (int64_t r = row0, pass = 0; r < row0 + rows; r += kRows, ++pass) {
        const int mb = static_cast<int>(std::min<int64_t>(kRows, row0 + rows - r));
        const int64_t from = std::min(next_lines, pass * lines_per_pass);
        const int64_t count = std::min(next_lines, from + lines_per_pass) - from;
        kernel(mb, c.blocks)(y + r * out_stride + col, out_stride, a + r * a_stride, a_stride,
                             b, width * 32, k2, bs ? bs + col : nullptr, cols,
                             next_b ? next_b + from * 64 : nullptr, count, nullptr);
      }
    }
  }
#endif
}

}  // extern "C"
