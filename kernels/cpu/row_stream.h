// The paged-cache rows one thread of decode attention reads, in the order it reads them (each
// of its sequences' key rows, then that sequence's value rows, then the next sequence's), and
// their fetch into L2 well ahead of the reads.
//
// The lead is long (up to kLead rows, most of a sequence) because the reads come in bursts:
// the value pass reads its rows several times faster than the key pass computes its scores.
// With a lead of 64 rows, the value loads waited on memory (a third of the kernel's cycles) and
// a layer's attention read its cache at 14 GB/s on a 2-core Zen 4, against 45 GB/s for a plain
// stream; the next sequence's rows now arrive while this one is computed.

#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"

namespace {

template <class T>
class RowStream {
 public:
  // row: elements per cache slot
  RowStream(const T* key_cache, const T* value_cache, int64_t row)
      : keys_(key_cache), values_(value_cache), row_(row) {}

  void reserve(int64_t sequences, int64_t rows) {
    starts_.reserve(sequences);
    offsets_.reserve(rows);
  }
  // The offsets (in elements) of the next sequence's rows, to be filled by the caller.
  int64_t* add_sequence(int64_t n) {
    starts_.push_back(static_cast<int64_t>(offsets_.size()));
    offsets_.resize(offsets_.size() + n);
    return offsets_.data() + starts_.back();
  }
  // The i-th sequence's row offsets and count (once every sequence is added).
  const int64_t* offsets(size_t i) const { return offsets_.data() + starts_[i]; }
  int64_t rows(size_t i) const {
    return (i + 1 < starts_.size() ? starts_[i + 1] : static_cast<int64_t>(offsets_.size())) -
           starts_[i];
  }

  // Before the first read: the first kStart rows.
  void start() {
    total_ = 2 * static_cast<int64_t>(offsets_.size());
    fetch_to(std::min(total_, kStart));
  }
  // `count` more rows read: the fetches run on to keep kLead rows ahead, at most kCatchUp rows
  // per row read (a layer's first rows are not one long stall while the lead builds).
  void read(int64_t count) {
    read_ += count;
    fetch_to(std::min({total_, read_ + kLead, fetched_ + kCatchUp * count}));
  }

 private:
  static constexpr int64_t kStart = 64, kLead = 384, kCatchUp = 4;

  void fetch_to(int64_t end) {
    for (; fetched_ < end; ++fetched_) {
      // stream position -> (sequence, key or value, row): the sequences are visited in order
      while (fetched_ >= seq_end_) {
        seq_begin_ = seq_end_;
        seq_end_ += 2 * rows(seq_++);
      }
      const int64_t local = fetched_ - seq_begin_, n = (seq_end_ - seq_begin_) / 2;
      const T* base = local < n ? keys_ : values_;
      prefetch_row<2>(base + offsets_[starts_[seq_ - 1] + (local < n ? local : local - n)], row_);
    }
  }

  const T* keys_;
  const T* values_;
  int64_t row_;
  std::vector<int64_t> offsets_, starts_;
  int64_t total_ = 0, read_ = 0, fetched_ = 0;
  size_t seq_ = 0;                        // sequences the fetches have entered
  int64_t seq_begin_ = 0, seq_end_ = 0;   // the stream positions of sequence seq_ - 1
};

// A key pass's next tile: rows[t] <- key row j0 + t (t < tile), the same rows one tile of
// `width` further prefetched into L1, and the stream told that the tile is read.
template <class T, class Slot>
inline void gather_key_tile(const T** rows, const T* key_cache, Slot slot, int64_t j0,
                            int64_t tile, int64_t width, int64_t n, int64_t row,
                            RowStream<T>& stream) {
  for (int64_t t = 0; t < tile; ++t) {
    rows[t] = key_cache + slot(j0 + t);
    if (j0 + t + width < n) prefetch_row(key_cache + slot(j0 + t + width), row);
  }
  stream.read(tile);
}

}  // namespace
