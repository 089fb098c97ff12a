// The threads' shares of a GEMM's 16-column blocks, handed out chunk by chunk: each thread
// takes its own share from the front and, once that is done, takes chunks from the back of
// the share with the most left. A static split made a step wait for its slowest thread:
// on these shared 2-vCPU machines a thread loses its core to the API server, to the other
// tenants, to a page fault, and the other one spun in the barrier (10% of a decode step's
// samples). Which thread computes a chunk changes nothing in its numbers.
//
// The units of a share are (row panel, block) pairs, panel-major; a chunk never crosses a
// panel or a tile of kTile blocks, so every chunk is one run of the micro-kernels.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace {

struct ColumnChunk {
  int64_t panel, block;  // the chunk's row panel and first block
  int blocks;            // 1..kTile
  int64_t next_block;    // the block after it in the same panel and share (-1: none)
};

class ColumnShares {
 public:
  ColumnShares(int64_t blocks, int64_t panels, int64_t tile, int threads)
      : blocks_(blocks), tile_(tile), nth_(threads), shares_(threads) {
    for (int t = 0; t < threads; ++t)
      shares_[t].left.store(pack(0, panels * (last(t) - first(t))), std::memory_order_relaxed);
  }

  // The next chunk for thread tid: its own front first, then another share's back; false
  // when every share is taken.
  bool next(int tid, ColumnChunk& chunk) {
    if (take(tid, false, chunk)) return true;
    for (;;) {
      int victim = -1;
      int64_t most = 0;
      for (int t = 0; t < nth_; ++t) {
        const uint64_t v = shares_[t].left.load(std::memory_order_relaxed);
        if (back(v) - front(v) > most) most = back(v) - front(v), victim = t;
      }
      if (victim < 0) return false;
      if (take(victim, true, chunk)) return true;
    }
  }

 private:
  struct alignas(64) Share {
    std::atomic<uint64_t> left;  // units [front, back) not yet taken
  };
  static uint64_t pack(int64_t f, int64_t b) {
    return static_cast<uint64_t>(f) | static_cast<uint64_t>(b) << 32;
  }
  static int64_t front(uint64_t v) { return static_cast<int64_t>(v & 0xffffffffu); }
  static int64_t back(uint64_t v) { return static_cast<int64_t>(v >> 32); }
  int64_t first(int t) const { return blocks_ * t / nth_; }
  int64_t last(int t) const { return blocks_ * (t + 1) / nth_; }

  // The chunk of share t that starts at unit u and holds n units.
  ColumnChunk chunk_at(int t, int64_t u, int64_t n, int64_t end) const {
    const int64_t own = last(t) - first(t), blk = first(t) + u % own;
    const bool more = u + n < end && (u + n) % own != 0;
    return {u / own, blk, static_cast<int>(n), more ? blk + n : -1};
  }

  // A chunk of share t: from its front (its owner) or from its back (another thread).
  bool take(int t, bool from_back, ColumnChunk& chunk) {
    Share& s = shares_[t];
    const int64_t own = last(t) - first(t);
    uint64_t v = s.left.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t f = front(v), b = back(v);
      if (f >= b) return false;
      int64_t u, n;  // the chunk's first unit and its length
      if (from_back) {
        const int64_t blk = first(t) + (b - 1) % own;
        n = blk + 1 - std::max({blk / tile_ * tile_, first(t), blk - (b - 1 - f)});
        u = b - n;
      } else {
        const int64_t blk = first(t) + f % own;
        n = std::min({(blk / tile_ + 1) * tile_, last(t), blk + b - f}) - blk;
        u = f;
      }
      const uint64_t rest = from_back ? pack(f, u) : pack(f + n, b);
      if (s.left.compare_exchange_weak(v, rest, std::memory_order_acq_rel)) {
        chunk = chunk_at(t, u, n, from_back ? u : b);  // a stolen chunk prefetches nothing
        return true;
      }
    }
  }

  int64_t blocks_, tile_;
  int nth_;
  std::vector<Share> shares_;
};

}  // namespace
