// The tiled prefill attention's block on AMX tiles (prefill_attention.cpp): S = Q K^T tile by
// tile of 16 keys, P V accumulated in 4 C tiles of 16 dims.

#pragma once

#include "prefill_blocks.h"

#ifdef PARASHIFT_AMX
namespace {

void attend_block_amx(const Block& b, const SequenceKeys& p, float scale,
                      std::vector<float>& scores, std::vector<uint16_t>& weights) {
  const int64_t padded = start_block(b, scores, weights);
  const int64_t blocks16 = (b.first_keys + b.rows - 1 + 15) / 16;  // of the keys it sees
  _tile_loadd(4, b.q, b.q_stride * 2);
  _tile_loadd(5, b.q + 32, b.q_stride * 2);
  for (int64_t jb = 0; jb < blocks16; ++jb) {
    const uint32_t* kt = p.keys_t.data() + jb * 512;
    _tile_zero(0);
    _tile_loadd(6, kt, 64);
    _tile_loadd(7, kt + 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(0, 5, 7);
    _tile_stored(0, scores.data() + jb * 16, padded * 4);
  }
  float sums[16];
  softmax_rows(scores.data(), weights.data(), padded, b.rows, b.first_keys, scale, sums);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t kb = 0; kb < padded / 32; ++kb) {
    const uint32_t* v = p.values.data() + kb * 1024;
    _tile_loadd(4, weights.data() + kb * 32, padded * 2);
    _tile_loadd(6, v, 64);
    _tile_loadd(7, v + 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(6, v + 512, 64);
    _tile_loadd(7, v + 768, 64);
    _tile_dpbf16ps(2, 4, 6);
    _tile_dpbf16ps(3, 4, 7);
  }
  alignas(64) float o[16 * kDim];
  _tile_stored(0, o, kDim * 4); _tile_stored(1, o + 16, kDim * 4);
  _tile_stored(2, o + 32, kDim * 4); _tile_stored(3, o + 48, kDim * 4);
  finish_rows(b.out, b.out_stride, o, sums, b.rows);
}

}  // namespace
#endif
