// AMX basics shared by the kernels that use its tiles (gemm_amx.h, prefill_attention.cpp):
// the OS permission and the tile configuration.

#pragma once

#include "common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PARASHIFT_AMX 1

namespace {

// Linux hands out AMX's 8 KiB of tile state only to processes that ask (arch_prctl), once.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
  }();
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (fp32, 16 columns); 4, 5: A (rows x 32 k); 6, 7: B (16 k pairs x 16 columns).
// rows0 / rows1: rows of the first and second row tile (0: none).
void configure_tiles(int rows0, int rows1) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(t < 2 || rows1 == 0 ? rows0 : rows1);
    cfg.colsb[t] = 64;
  }
  cfg.rows[4] = static_cast<uint8_t>(rows0);
  cfg.rows[5] = static_cast<uint8_t>(rows1 ? rows1 : rows0);
  cfg.colsb[4] = cfg.colsb[5] = 64;
  cfg.rows[6] = cfg.rows[7] = 16;
  cfg.colsb[6] = cfg.colsb[7] = 64;
  _tile_loadconfig(&cfg);
}

}  // namespace
#endif
