#include "batch_keys.h"

#include <algorithm>
#include <tuple>

#include "key_index.h"
#include "table.h"

namespace elastic_emb {

void UniqueKeys(int64_t n, const int64_t* keys, std::vector<int64_t>& unique, int64_t* index) {
  // Open addressing, load at most 1/2: slot -> position in `unique` (-1: empty).
  uint64_t capacity = 16;
  while (capacity < static_cast<uint64_t>(n) * 2) capacity <<= 1;
  const uint64_t mask = capacity - 1;
  std::vector<int64_t> slots(capacity, -1);
  unique.clear();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t key = keys[i];
    uint64_t pos = KeyHash(key) & mask;
    while (slots[pos] >= 0 && unique[slots[pos]] != key) pos = (pos + 1) & mask;
    if (slots[pos] < 0) {
      slots[pos] = static_cast<int64_t>(unique.size());
      unique.push_back(key);
    }
    index[i] = slots[pos];
  }
}

void SumByKey(int64_t n, const int64_t* keys, const float* grads, int dim,
              std::vector<int64_t>& unique, std::vector<float>& sums) {
  std::vector<int64_t> index(n);
  UniqueKeys(n, keys, unique, index.data());
  sums.assign(unique.size() * dim, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    float* out = sums.data() + index[i] * dim;
    const float* g = grads + i * dim;
    for (int j = 0; j < dim; ++j) out[j] += g[j];
  }
}

void SplitBySlotRange(int64_t n, const int64_t* keys, int64_t num_ranges, const int64_t* starts,
                      int64_t num_slots, int64_t* order, int64_t* bounds) {
  struct Entry {
    int64_t range;
    uint64_t key;
    int64_t pos;
  };
  std::vector<Entry> entries(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = VirtualSlot(keys[i], num_slots);
    const int64_t range = std::upper_bound(starts, starts + num_ranges, slot) - starts - 1;
    entries[i] = {range, static_cast<uint64_t>(keys[i]), i};
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.range, a.key, a.pos) < std::tie(b.range, b.key, b.pos);
  });
  int64_t r = 0;
  for (int64_t i = 0; i < n; ++i) {
    order[i] = entries[i].pos;
    while (r <= entries[i].range) bounds[r++] = i;
  }
  while (r <= num_ranges) bounds[r++] = n;
}

void CountBySlot(int64_t n, const int64_t* keys, int64_t num_slots, int64_t* counts) {
  for (int64_t i = 0; i < n; ++i) ++counts[VirtualSlot(keys[i], num_slots)];
}

}  // namespace elastic_emb
