// The key -> row index of the CPU table's shards (table.cc) and of the GPU
// table (device_table.cu): int64 keys -> uint32 row ids.
//
// Open addressing with linear probing over the low bits of the key's hash
// (the CPU table picks a shard by the top bits). Capacity is a power of two,
// load at most 3/4; erasing shifts later entries back (no tombstones). A
// slot is 12 bytes, so a probe usually touches one cache line.
//
// Callers pass `hash`, which must be KeyHash(key), so that a batch hashes
// each key once. Not synchronized: the owner serializes calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "initializer.h"
#include "memory.h"

namespace elastic_emb {

// The row id of no row: an absent key, an empty slot.
constexpr uint32_t kNoRow = 0xFFFFFFFFu;

inline uint64_t KeyHash(int64_t key) { return Mix64(static_cast<uint64_t>(key)); }

class KeyIndex {
 public:
  KeyIndex() : slots_(kInitialSlots, Slot{0, kNoRow}) {}

  int64_t size() const { return size_; }
  // Bytes of the slot array.
  int64_t MemoryBytes() const { return static_cast<int64_t>(slots_.capacity() * sizeof(Slot)); }

  // Starts loading the home slot of `hash` into the cache.
  void Prefetch(uint64_t hash) const { __builtin_prefetch(&slots_[hash & mask()]); }

  // The row of `key`, or kNoRow.
  uint32_t Find(int64_t key, uint64_t hash) const {
    const uint64_t mask = this->mask();
    for (uint64_t pos = hash & mask;; pos = (pos + 1) & mask) {
      const Slot& slot = slots_[pos];
      if (slot.row == kNoRow) return kNoRow;
      if (slot.key == key) return slot.row;
    }
  }

  // The row of `key`. An absent key is inserted with the row new_row()
  // returns; new_row runs after any growth, and if it throws, nothing is
  // inserted.
  template <typename NewRow>
  uint32_t FindOrInsert(int64_t key, uint64_t hash, NewRow&& new_row) {
    uint64_t mask = this->mask();
    uint64_t pos = hash & mask;
    for (;; pos = (pos + 1) & mask) {
      const Slot& slot = slots_[pos];
      if (slot.row == kNoRow) break;
      if (slot.key == key) return slot.row;
    }
    if ((size_ + 1) * 4 > static_cast<int64_t>(slots_.size()) * 3) {
      Grow();
      mask = this->mask();
      for (pos = hash & mask; slots_[pos].row != kNoRow;) pos = (pos + 1) & mask;
    }
    const uint32_t row = new_row();
    slots_[pos] = Slot{key, row};
    ++size_;
    return row;
  }

  // Removes `key`; returns the row it had, or kNoRow if absent.
  uint32_t Erase(int64_t key, uint64_t hash) {
    const uint64_t mask = this->mask();
    uint64_t i = hash & mask;
    while (slots_[i].row != kNoRow && slots_[i].key != key) i = (i + 1) & mask;
    const uint32_t row = slots_[i].row;
    if (row == kNoRow) return kNoRow;
    slots_[i].row = kNoRow;
    --size_;
    // Backward-shift deletion keeps every remaining key reachable: move a
    // later slot of the probe run into the hole unless its home position
    // lies cyclically in (hole, slot].
    for (uint64_t j = (i + 1) & mask; slots_[j].row != kNoRow; j = (j + 1) & mask) {
      const uint64_t home = KeyHash(slots_[j].key) & mask;
      const bool stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
      if (stays) continue;
      slots_[i] = slots_[j];
      slots_[j].row = kNoRow;
      i = j;
    }
    return row;
  }

  // Calls fn(key, row) for every entry, in slot order.
  template <typename Fn>
  void ForEach(Fn&& fn) const {
    for (const Slot& slot : slots_) {
      if (slot.row != kNoRow) fn(slot.key, slot.row);
    }
  }

  // Doubles the capacity; rows keep their ids.
  void Grow() {
    std::vector<Slot, LargeAllocator<Slot>> slots(slots_.size() * 2, Slot{0, kNoRow});
    const uint64_t mask = slots.size() - 1;
    for (const Slot& slot : slots_) {
      if (slot.row == kNoRow) continue;
      uint64_t pos = KeyHash(slot.key) & mask;
      while (slots[pos].row != kNoRow) pos = (pos + 1) & mask;
      slots[pos] = slot;
    }
    slots_.swap(slots);
  }

 private:
  static constexpr size_t kInitialSlots = 16;

#pragma pack(push, 4)
  struct Slot {
    int64_t key;
    uint32_t row;  // kNoRow: a free slot
  };
#pragma pack(pop)
  static_assert(sizeof(Slot) == 12, "an index slot is 12 bytes");

  uint64_t mask() const { return slots_.size() - 1; }

  std::vector<Slot, LargeAllocator<Slot>> slots_;
  int64_t size_ = 0;
};

}  // namespace elastic_emb
