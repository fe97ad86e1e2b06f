// A batch's duplicate keys, handled in C++ instead of per-layer TensorFlow ops:
// the layers' lookup path (elastic_emb.layers) pulls rows straight in input
// order, and sums each key's gradients before a push.
#pragma once

#include <cstdint>
#include <vector>

namespace elastic_emb {

// The distinct keys of keys[0..n) in order of first occurrence, and in
// index[i] the position of keys[i] among them: tf.unique's contract.
void UniqueKeys(int64_t n, const int64_t* keys, std::vector<int64_t>& unique, int64_t* index);

// For each distinct key (order of first occurrence), the sum of its rows of
// grads (n, dim), added in input order onto +0.0f: the float result of
// tf.unique followed by tf.math.unsorted_segment_sum, bit for bit.
void SumByKey(int64_t n, const int64_t* keys, const float* grads, int dim,
              std::vector<int64_t>& unique, std::vector<float>& sums);

// Orders keys[0..n) by the slot range that owns each (range r: virtual slots
// [starts[r], starts[r + 1]), the last up to num_slots; starts[0] == 0), and
// within a range by key as uint64 (compact on the wire), equal keys in input
// order: order[bounds[r]..bounds[r + 1]) are the positions of range r's keys.
void SplitBySlotRange(int64_t n, const int64_t* keys, int64_t num_ranges, const int64_t* starts,
                      int64_t num_slots, int64_t* order, int64_t* bounds);

// counts[s] += the number of keys[0..n) in virtual slot s, for s in [0, num_slots).
void CountBySlot(int64_t n, const int64_t* keys, int64_t num_slots, int64_t* counts);

}  // namespace elastic_emb
