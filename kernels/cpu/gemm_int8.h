// Weight-only int8 GEMM (`--quantization int8`) on AMX tiles: y = (x Q^T) * scale + bias, x and
// y bf16, Q int8 with one bf16 scale per output column. Q is packed like gemm.cpp's bf16 weight,
// a byte an element, so it streams from memory at half the bytes. Each register block's
// columns are widened to bf16 (exact: |q| <= 127 needs 7 bits of bf16's 8) into a small buffer
// laid out as a packed tile of their width, and gemm_amx.h's block multiplies from there; the
// scale multiplies the fp32 sums as the tiles are stored. So the sums are those of x against
// the dequantized weight, in another order, with no rounding of the weight.
//
// Why not torch's `_weight_int8pack_mm`: at 32 rows it ran 2.5-5x slower than our bf16 GEMM on
// a Xeon with AMX, so int8 weights lost speed in batched decode where they should gain it (a
// decode step streams every weight once and is bound by memory there).

#pragma once

#include "gemm_amx.h"

#ifdef PARASHIFT_AMX

namespace {

// A packed int8 weight's thread range, as block_range's for bf16 (one byte an element).
std::pair<const char*, const char*> int8_range(const int8_t* w, int64_t n, int64_t k,
                                               int64_t first, int64_t last) {
  const int64_t k2 = k / 2, blocks = (n + 15) / 16, last_tile = (last - 1) / kTile;
  const int64_t end_width = std::min(kTile, blocks - last_tile * kTile);
  const char* base = reinterpret_cast<const char*>(w);
  return {base + tile_offset(first / kTile, k2),
          base + tile_offset(last_tile, k2) + k2 * end_width * 32};
}

// k pairs [kp0, kp1) of nb blocks' int8 columns (k pairs `src_stride` bytes apart, each nb x
// 16 columns x 2 k side by side) -> bf16 at `wide`, a packed tile nb blocks wide; 32 at a time
// (one 256-bit load, widened in two halves).
inline void widen_int8(const int8_t* src, int64_t src_stride, int64_t kp0, int64_t kp1, int nb,
                  uint16_t* wide) {
  const int64_t row = nb * 32;  // bytes of a k pair
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    const int8_t* s = src + kp * src_stride;
    uint16_t* d = wide + (kp - kp0) * row;
    for (int64_t i = 0; i < row; i += 32) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
      _mm512_storeu_si512(d + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// A register block of at most 32 rows (a decode batch): each chunk of 32 k widened into one of
// two small buffers just before its tiles multiply, so the widening of the next chunk runs
// beside the tile unit's work on this one.
void amx_block_int8(const uint16_t* x, int64_t x_stride, int rt, const int8_t* src,
                    int64_t src_stride, int64_t chunks, int nb, uint16_t* buf, float* c,
                    Stream& stream) {
  zero_c_tiles();
  const int64_t xs = x_stride * 2, half = 16 * nb * 32;
  const uint16_t* x1 = x + 16 * x_stride;
  for (int64_t ch = 0; ch < chunks; ++ch) {
    stream.fetch(8 * nb);
    uint16_t* b = buf + (ch & 1) * half;
    widen_int8(src, src_stride, 16 * ch, 16 * ch + 16, nb, b);
    multiply_chunk(x + 32 * ch, x1 + 32 * ch, xs, rt, reinterpret_cast<const char*>(b),
                   nb * 64, nb);
  }
  store_c_tiles(c);
}

// gemm_amx's split: threads take runs of 16-column blocks; within a row panel each register
// block's columns are widened once and multiplied by every row block of the panel.
// `next` (may be null; next_n x next_k): the int8 weight the caller multiplies by next, where
// each thread's stream runs on, as in gemm_amx.
void gemm_int8_amx(uint16_t* y, int64_t out_stride, const uint16_t* x, int64_t x_stride,
                   const int8_t* w, const uint16_t* scale, const uint16_t* bias, int64_t m,
                   int64_t n, int64_t k, int threads, const int8_t* next, int64_t next_n,
                   int64_t next_k) {
  const int64_t k2 = k / 2, blocks = (n + 15) / 16;
  constexpr int64_t kAmxPanel = 256;
  constexpr int64_t kStreamAhead = 64 << 10;  // int8 bytes: the bf16 kernel's 128 KiB of bf16
#pragma omp parallel num_threads(threads)
  {
    const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t first = blocks * tid / nth, last = blocks * (tid + 1) / nth;
    alignas(64) float c[4 * 256];
    thread_local std::vector<uint16_t> wide;
    wide.resize(k2 * 4 * 32);
    int configured = -1;
    Stream stream;
    if (first < last) {
      std::tie(stream.at, stream.end) = int8_range(w, n, k, first, last);
      const int64_t next_blocks = (next_n + 15) / 16;
      const int64_t next_first = next_blocks * tid / nth;
      const int64_t next_last = next_blocks * (tid + 1) / nth;
      if (next && next_first < next_last)
        std::tie(stream.then_at, stream.then_end) =
            int8_range(next, next_n, next_k, next_first, next_last);
      stream.fetch(kStreamAhead / 64);
    }
    for (int64_t row0 = 0; row0 < m; row0 += kAmxPanel) {
      const int64_t panel_end = std::min(m, row0 + kAmxPanel);
      const int64_t most = panel_end - row0 > 16 ? 2 : 4;
      for (int64_t blk = first; blk < last;) {
        const int64_t tile = blk / kTile, j0 = blk % kTile;
        const int64_t width = std::min(kTile, blocks - tile * kTile);
        const int nb = static_cast<int>(std::min({width - j0, last - blk, most}));
        const int8_t* src = w + tile_offset(tile, k2) + j0 * 32;
        const BlockWeight bw{reinterpret_cast<const char*>(wide.data()), nb * 64, k / 32, nb};
        const bool decode = panel_end - row0 <= 32;
        if (!decode) {  // widened once, multiplied by every row block of the panel
          for (int64_t kp = 0; kp < k2; kp += 16) {
            stream.fetch(8 * nb);
            widen_int8(src, width * 32, kp, kp + 16, nb, wide.data() + kp * nb * 32);
          }
        }
        for (int64_t r = row0; r < panel_end; r += 32) {
          const int rows = static_cast<int>(std::min<int64_t>(32, panel_end - r));
          if (rows != configured) {
            configure_tiles(std::min(rows, 16), std::max(rows - 16, 0));
            configured = rows;
          }
          const int rt = rows > 16 ? 2 : 1;
          if (decode)
            amx_block_int8(x + r * x_stride, x_stride, rt, src, width * 32, k / 32, nb,
                           wide.data(), c, stream);
          else
            amx_block(x + r * x_stride, x_stride, rt, bw, c, nullptr);
          for (int jb = 0; jb < nb; ++jb) {
            const int64_t col = (blk + jb) * 16;
            const uint16_t* bias_j = bias ? bias + col : nullptr;
            uint16_t* out = y + r * out_stride + col;
            if (rt == 2) {
              store_tile_rows(c + 256 * jb, 16, out, out_stride, bias_j, n - col, scale + col);
              store_tile_rows(c + 256 * (2 + jb), rows - 16, out + 16 * out_stride, out_stride,
                              bias_j, n - col, scale + col);
            } else {
              store_tile_rows(c + 256 * jb, rows, out, out_stride, bias_j, n - col,
                              scale + col);
            }
          }
        }
        blk += nb;
      }
    }
  }
}

}  // namespace
#endif
