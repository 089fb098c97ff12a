// The bf16 GEMM of gemm.cpp on AMX tiles, where the CPU has them (Sapphire Rapids and later):
// one TDPBF16PS multiplies 16 rows x 32 k by 32 k x 16 columns, 16x the work of a vdpbf16ps.
// It reads the same packed weight: a 16-column block's 16 k pairs are 16 rows of 64 bytes, a
// stride apart, which is a B tile as it lies. At 32 rows on a Xeon with AMX it ran SmolLM2's
// GEMMs 2-3x faster than vdpbf16ps, which is compute-bound there (one per cycle per core).
//
// A register block is 2 row tiles x 2 column blocks (4 C tiles, 2 A, 2 B: all 8 tile
// registers) or, for 16 rows or fewer, 1 row tile x 4 column blocks (a whole packed tile).

#pragma once

#include "amx.h"
#include "column_shares.h"

#ifdef PARASHIFT_AMX

#include <tuple>
#include <utility>

namespace {

// 16 bf16 values (the first `mask` lanes, zeros after) in fp32 lanes.
inline __m512 load_bf16_lanes(__mmask16 mask, const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

// C tile -> bf16 rows of out (x scale, + bias), `cols` of its 16 columns.
inline void store_tile_rows(const float* c, int rows, uint16_t* out, int64_t out_stride,
                            const uint16_t* bias, int64_t cols, const uint16_t* scale = nullptr) {
  const __mmask16 mask = first_lanes(cols);
  const __m512 add = bias ? load_bf16_lanes(mask, bias) : _mm512_setzero_ps();
  const __m512 mul = scale ? load_bf16_lanes(mask, scale) : _mm512_set1_ps(1.f);
  for (int i = 0; i < rows; ++i) {
    const __m512 v = _mm512_fmadd_ps(_mm512_load_ps(c + 16 * i), mul, add);
    const __m256bh y = _mm512_cvtneps_pbh(v);
    _mm256_mask_storeu_epi16(out + i * out_stride, mask, (__m256i)y);
  }
}

// A packed weight (gemm.cpp's layout) and its shape.
struct PackedWeight {
  const uint16_t* w;
  int64_t n, k;
  int64_t blocks() const { return (n + 15) / 16; }
};

// A register block's weight: its first 16-column block's first k pair, the bytes between k
// pairs, the blocks it takes (up to `most`, within one packed tile and before `last`).
struct BlockWeight {
  const char* b = nullptr;
  int64_t stride = 0, chunks = 0;
  int nb = 0;
};

BlockWeight block_at(const PackedWeight& p, int64_t blk, int64_t last, int64_t most) {
  const int64_t tile = blk / kTile, j = blk % kTile;
  const int64_t width = std::min(kTile, p.blocks() - tile * kTile);
  return {reinterpret_cast<const char*>(p.w + tile_offset(tile, p.k / 2) + j * 32), width * 64,
          p.k / 32, static_cast<int>(std::min({width - j, last - blk, most}))};
}

// The weight bytes a thread reads, fetched into L2 a fixed distance ahead of use: its blocks
// are whole packed tiles in a row (but at its ends), one range of memory, then the range the
// caller's next GEMM will read first. A block's own loads stride over the tile's rows and
// leave half of each for the next block: a linear stream keeps the memory busy throughout.
struct Stream {
  const char *at = nullptr, *end = nullptr, *then_at = nullptr, *then_end = nullptr;
  void fetch(int64_t lines) {
    for (int64_t i = 0; i < lines; ++i) {
      if (at >= end) {
        if (then_at == nullptr) return;
        at = then_at, end = then_end, then_at = nullptr;
      }
      __builtin_prefetch(at, 0, 2);
      at += 64;
    }
  }
};

// [first, last) blocks' bytes of a packed weight: from their first tile's start to their last
// tile's end.
std::pair<const char*, const char*> block_range(const PackedWeight& p, int64_t first,
                                                int64_t last) {
  const char* base = reinterpret_cast<const char*>(p.w);
  const int64_t k2 = p.k / 2, last_tile = (last - 1) / kTile;
  const int64_t end_width = std::min(kTile, p.blocks() - last_tile * kTile);
  return {base + tile_offset(first / kTile, k2) * 2,
          base + (tile_offset(last_tile, k2) + k2 * end_width * 32) * 2};
}

// One chunk of 32 k of a register block into C tiles 0-3: rows a0 (and a1 with rt == 2) of x
// times the chunk's B tiles at b, its k pairs b_stride bytes apart, the blocks 64 bytes apart.
// The branches are the same every chunk: predicted, and a TDPBF16PS takes 16 cycles.
inline void multiply_chunk(const uint16_t* a0, const uint16_t* a1, int64_t xs, int rt,
                           const char* b, int64_t b_stride, int nb) {
  _tile_loadd(4, a0, xs);
  _tile_loadd(6, b, b_stride);
  if (rt == 2) _tile_loadd(5, a1, xs);
  _tile_dpbf16ps(0, 4, 6);
  if (rt == 2) _tile_dpbf16ps(2, 5, 6);
  if (nb > 1) {
    _tile_loadd(7, b + 64, b_stride);
    _tile_dpbf16ps(1, 4, 7);
    if (rt == 2) _tile_dpbf16ps(3, 5, 7);
  }
  if (nb > 2) {
    _tile_loadd(6, b + 128, b_stride);
    _tile_dpbf16ps(2, 4, 6);
  }
  if (nb > 3) {
    _tile_loadd(7, b + 192, b_stride);
    _tile_dpbf16ps(3, 4, 7);
  }
}

inline void zero_c_tiles() { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }

inline void store_c_tiles(float* c) {
  _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64);
  _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64);
}

// One register block: `rt` row tiles (1 or 2) x bw.nb 16-column blocks (up to 4 with one row
// tile, 2 with two), k in chunks of 32 -> fp32 C tiles into c (tile r * 2 + j with two row
// tiles, j with one). stream (null on later passes over the same weight): advanced by as many
// lines per chunk as the block brings in.
void amx_block(const uint16_t* x, int64_t x_stride, int rt, const BlockWeight& bw, float* c,
               Stream* stream) {
  zero_c_tiles();
  const int64_t xs = x_stride * 2, step = 16 * bw.stride;
  const uint16_t* x1 = x + 16 * x_stride;
  for (int64_t ch = 0; ch < bw.chunks; ++ch) {
    if (stream) stream->fetch(16 * bw.nb);
    multiply_chunk(x + 32 * ch, x1 + 32 * ch, xs, rt, bw.b + ch * step, bw.stride, bw.nb);
  }
  store_c_tiles(c);
}

// gemm.cpp's product on AMX (k a multiple of 32). Threads take the 16-column blocks in chunks
// (column_shares.h: a thread's own share from its front, then the back of the share with the
// most left, so no thread waits for a slower one at the end); rows go in panels (x's panel
// stays in L2 while the columns pass over it), each chunk's column groups over all the panel's
// row blocks (their weight stays in L1/L2 between them).
// `next` (w may be null): the weight the caller multiplies by next, where this thread's stream
// runs on, so the next GEMM does not start from memory (a decode layer's GEMMs are 0.7-3.5 MB
// each, a few register blocks per thread).
void gemm_amx(uint16_t* y, int64_t out_stride, const uint16_t* x, int64_t x_stride,
              const PackedWeight& weight, const uint16_t* bias, int64_t m, int threads,
              const PackedWeight& next) {
  const int64_t n = weight.n, blocks = weight.blocks();
  constexpr int64_t kAmxPanel = 256;
  // bytes the stream runs ahead: 16 KiB read the step's 121 GEMMs at 15.8 GB/s, 32-64 at 17.5,
  // 128 at 18-19.5, 512 at 14.3 (on a Xeon whose memory streams 23.5 GB/s to two threads)
  constexpr int64_t kStreamAhead = 128 << 10;
  ColumnShares shares(blocks, (m + kAmxPanel - 1) / kAmxPanel, kTile, threads);
#pragma omp parallel num_threads(threads)
  {
    const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t first = blocks * tid / nth, last = blocks * (tid + 1) / nth;
    alignas(64) float c[4 * 256];
    int configured = -1;  // rows of the row block the tiles are configured for
    Stream stream;  // over its own share's weight, which it takes first
    if (first < last) {
      std::tie(stream.at, stream.end) = block_range(weight, first, last);
      const int64_t next_first = next.blocks() * tid / nth;
      const int64_t next_last = next.blocks() * (tid + 1) / nth;
      if (next.w && next_first < next_last)
        std::tie(stream.then_at, stream.then_end) = block_range(next, next_first, next_last);
      stream.fetch(kStreamAhead / 64);
    }
    ColumnChunk chunk;
    while (shares.next(tid, chunk)) {
      const int64_t row0 = chunk.panel * kAmxPanel, panel_end = std::min(m, row0 + kAmxPanel);
      const int64_t most = panel_end - row0 > 16 ? 2 : 4;  // blocks per register block
      const bool own = first <= chunk.block && chunk.block < last;
      const int64_t chunk_end = chunk.block + chunk.blocks;
      for (int64_t blk = chunk.block; blk < chunk_end;) {
        const BlockWeight bw = block_at(weight, blk, chunk_end, most);
        for (int64_t r = row0; r < panel_end; r += 32) {
          const int rows = static_cast<int>(std::min<int64_t>(32, panel_end - r));
          if (rows != configured) {
            configure_tiles(std::min(rows, 16), std::max(rows - 16, 0));
            configured = rows;
          }
          const int rt = rows > 16 ? 2 : 1;  // then bw.nb <= 2: `most` saw the panel's rows
          // later row blocks find the weight in L2
          amx_block(x + r * x_stride, x_stride, rt, bw, c,
                    own && r == row0 && row0 == 0 ? &stream : nullptr);
          for (int jb = 0; jb < bw.nb; ++jb) {
            const int64_t col = (blk + jb) * 16;
            const uint16_t* bias_j = bias ? bias + col : nullptr;
            uint16_t* out = y + r * out_stride + col;
            if (rt == 2) {
              store_tile_rows(c + 256 * jb, 16, out, out_stride, bias_j, n - col);
              store_tile_rows(c + 256 * (2 + jb), rows - 16, out + 16 * out_stride,
                              out_stride, bias_j, n - col);
            } else {
              store_tile_rows(c + 256 * jb, rows, out, out_stride, bias_j, n - col);
            }
          }
        }
        blk += bw.nb;
      }
    }
  }
}

}  // namespace
#endif
