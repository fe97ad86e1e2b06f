// Frequency admission's counter: a count-min sketch with conservative update
// and saturating 8-bit counters (elastic_emb.admission.Frequency).
//
// `depth` rows of `width` counters; a key increments, in each row, the
// counter its hash picks, but only the counters holding the row minimum
// (conservative update), and its estimated count is that minimum. The
// estimate never undercounts; collisions can only raise it. Counters stop at
// 255, so admission thresholds above 255 are refused by the options.
//
// Not synchronized: the CPU table keeps one sketch per internal shard, under
// that shard's mutex.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "initializer.h"

namespace elastic_emb {

class CountSketch {
 public:
  CountSketch() = default;
  CountSketch(int depth, int64_t width)
      : depth_(depth), width_(width), counters_(static_cast<size_t>(depth) * width, 0) {}

  int64_t size() const { return static_cast<int64_t>(counters_.size()); }
  uint8_t* data() { return counters_.data(); }
  const uint8_t* data() const { return counters_.data(); }

  // Counts one occurrence of the key of `hash` (KeyHash); returns its
  // estimated count, this occurrence included.
  int Add(uint64_t hash) {
    uint8_t* cells[kMaxDepth];
    uint8_t least = 255;
    for (int d = 0; d < depth_; ++d) {
      cells[d] = &counters_[static_cast<size_t>(d) * width_ + Column(hash, d)];
      least = std::min(least, *cells[d]);
    }
    if (least == 255) return 255;
    for (int d = 0; d < depth_; ++d) {
      if (*cells[d] == least) *cells[d] = least + 1;
    }
    return least + 1;
  }

  static constexpr int kMaxDepth = 8;

 private:
  // Row d's counter for the key: an independent hash per row, mapped onto
  // [0, width) by a multiply-shift (no modulo bias worth counting).
  int64_t Column(uint64_t hash, int d) const {
    const uint64_t h = Mix64(hash + 0x632BE59BD9B4E019ull * static_cast<uint64_t>(d + 1));
    return static_cast<int64_t>((static_cast<unsigned __int128>(h) * width_) >> 64);
  }

  int depth_ = 0;
  int64_t width_ = 0;
  std::vector<uint8_t> counters_;
};

}  // namespace elastic_emb
