#include "table.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "check.h"
#include "half.h"
#include "memory.h"
#include "thread_pool.h"
#include "update_rules.h"

namespace elastic_emb {
namespace {

constexpr int kChunkRowsLog2 = 6;  // 64 rows per arena chunk
constexpr uint32_t kChunkRows = 1u << kChunkRowsLog2;
// Batches smaller than this run on the calling thread.
constexpr int64_t kParallelThreshold = 4096;
// How many keys ahead of use the index slot or row is prefetched.
constexpr int64_t kPrefetchDistance = 16;

// Per-thread scratch vectors keep their memory between calls up to this
// size each (a 65,536-key pull of dim 64 fits); a larger call frees it after.
constexpr size_t kKeptScratchBytes = size_t{16} << 20;

template <typename... V>
void TrimScratch(V&... vectors) {
  ((vectors.capacity() * sizeof(typename V::value_type) > kKeptScratchBytes
        ? std::vector<typename V::value_type>().swap(vectors)
        : void()),
   ...);
}

inline uint32_t GetWord(const float* p) {
  uint32_t w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}

inline void SetWord(float* p, uint32_t w) { std::memcpy(p, &w, sizeof(w)); }

// Row storage of n numbers in `dtype`: float32, or 16-bit numbers packed two
// to a word.
int StorageWords(RowDtype dtype, int n) { return dtype == RowDtype::kFloat32 ? n : (n + 1) / 2; }

void Encode(RowDtype dtype, int n, const float* in, float* storage) {
  if (dtype == RowDtype::kFloat32) {
    if (n > 0) std::memcpy(storage, in, sizeof(float) * n);  // (n 0: `in` maybe null)
    return;
  }
  auto* out = reinterpret_cast<unsigned char*>(storage);
  for (int j = 0; j < n; ++j) {
    const uint16_t h = dtype == RowDtype::kFloat16 ? FloatToHalf(in[j]) : FloatToBfloat16(in[j]);
    std::memcpy(out + 2 * j, &h, sizeof(h));
  }
}

// Rounds n floats in place to the nearest numbers of `dtype`.
void Round(RowDtype dtype, int n, float* values) {
  for (int j = 0; j < n; ++j) {
    if (dtype == RowDtype::kFloat16) values[j] = HalfToFloat(FloatToHalf(values[j]));
    if (dtype == RowDtype::kBfloat16) values[j] = Bfloat16ToFloat(FloatToBfloat16(values[j]));
  }
}

void Decode(RowDtype dtype, int n, const float* storage, float* out) {
  if (dtype == RowDtype::kFloat32) {
    // (n is 0 for the slots of an optimizer without any, `out` then maybe null: no memcpy)
    if (n > 0) std::memcpy(out, storage, sizeof(float) * n);
    return;
  }
  const auto* in = reinterpret_cast<const unsigned char*>(storage);
  for (int j = 0; j < n; ++j) {
    uint16_t h;
    std::memcpy(&h, in + 2 * j, sizeof(h));
    out[j] = dtype == RowDtype::kFloat16 ? HalfToFloat(h) : Bfloat16ToFloat(h);
  }
}

// Row bit sets of the change tracking: one word per arena chunk.
static_assert(kChunkRows == 64, "one 64-bit word of a row bit set per arena chunk");

inline bool TestBit(const std::vector<uint64_t>& bits, uint32_t row) {
  return (bits[row >> kChunkRowsLog2] >> (row & (kChunkRows - 1))) & 1u;
}

inline void SetBit(std::vector<uint64_t>& bits, uint32_t row) {
  bits[row >> kChunkRowsLog2] |= uint64_t{1} << (row & (kChunkRows - 1));
}

inline void ClearBit(std::vector<uint64_t>& bits, uint32_t row) {
  bits[row >> kChunkRowsLog2] &= ~(uint64_t{1} << (row & (kChunkRows - 1)));
}

}  // namespace

struct Table::Shard {
  mutable std::mutex mu;
  KeyIndex index;  // probes with the low hash bits; the shard is chosen by the top bits
  // Arena: fixed-size chunks (owned by the table's ChunkAllocator), never
  // moved; freed rows are reused.
  std::vector<float*> chunks;
  uint32_t next_row = 0;
  std::vector<uint32_t> free_rows;
  // Change tracking (see table.h), one bit per row, one word per chunk:
  std::vector<uint64_t> changed;  // row inserted, pushed or imported since the last ExportChanges
  std::vector<uint64_t> added;    // row inserted since the last ExportChanges
  std::vector<int64_t> erased;    // keys present at the last ExportChanges, erased since
  CountSketch sketch;             // admission: this shard's keys' counts
};

void TableOptions::Validate() const {
  EE_CHECK(dim > 0, "dim must be positive, got " << dim);
  EE_CHECK(shard_bits >= 0 && shard_bits <= 12,
           "shard_bits must be in [0, 12], got " << shard_bits);
  initializer.Validate();
  optimizer.Validate();
  if (admission.enabled()) {
    EE_CHECK(admission.min_count <= 255,
             "admission min_count must be at most 255, got " << admission.min_count);
    EE_CHECK(admission.sketch_depth >= 1 && admission.sketch_depth <= CountSketch::kMaxDepth,
             "admission sketch_depth must be in [1, " << CountSketch::kMaxDepth << "], got "
                                                      << admission.sketch_depth);
    const int64_t least = int64_t{64} * admission.sketch_depth << shard_bits;
    EE_CHECK(admission.sketch_bytes >= least,
             "admission sketch_bytes must be at least "
                 << least << " (64 counters per row of " << admission.sketch_depth << " in each of "
                 << (1 << shard_bits) << " internal shards), got " << admission.sketch_bytes);
  }
  switch (eviction.kind) {
    case EvictionKind::kNone:
      break;
    case EvictionKind::kTtl:
      EE_CHECK(eviction.ttl_steps >= 1,
               "eviction ttl_steps must be positive, got " << eviction.ttl_steps);
      break;
    case EvictionKind::kLru:
    case EvictionKind::kLfu:
      EE_CHECK(eviction.max_rows >= 1,
               "eviction max_rows must be positive, got " << eviction.max_rows);
      break;
  }
  EE_CHECK(eviction.protect_steps >= 1,
           "eviction protect_steps must be positive, got " << eviction.protect_steps);
}

Table::Table(const TableOptions& options) : options_(options) {
  options_.Validate();
  num_slots_ = options_.optimizer.NumSlots();
  tracks_use_ = options_.eviction.kind != EvictionKind::kNone;
  const RowDtype values = options_.row_dtype;
  const bool ftrl = options_.optimizer.kind == OptimizerKind::kFtrl;
  slot_dtype_ = values == RowDtype::kFloat32 || ftrl ? RowDtype::kFloat32 : RowDtype::kBfloat16;
  compact_ = values != RowDtype::kFloat32;
  value_words_ = StorageWords(values, options_.dim);
  slot_words_ = StorageWords(slot_dtype_, options_.dim * num_slots_);
  row_floats_ = value_words_ + slot_words_ + 2 + (tracks_use_ ? 1 : 0);
  arena_ = std::make_unique<ChunkAllocator>(sizeof(float) * kChunkRows * row_floats_);
  const int shards = 1 << options_.shard_bits;
  shards_.reserve(shards);
  for (int i = 0; i < shards; ++i) shards_.push_back(std::make_unique<Shard>());
  if (options_.admission.enabled()) {
    const int depth = options_.admission.sketch_depth;
    const int64_t width = options_.admission.sketch_bytes / depth / shards;
    for (auto& s : shards_) s->sketch = CountSketch(depth, width);
  }
}

Table::~Table() = default;

template <typename Fn>
void Table::ForEachShard(int64_t n, const int64_t* keys, Fn fn) const {
  const int bits = options_.shard_bits;
  const int64_t num_shards = static_cast<int64_t>(shards_.size());
  auto shard_of = [bits](uint64_t hash) { return bits == 0 ? 0 : hash >> (64 - bits); };
  // Scratch reused across calls of this thread (no allocation, no page faults).
  thread_local std::vector<uint64_t> hashes, sorted_hashes;
  thread_local std::vector<int64_t> pos, sorted_keys, start, fill;
  if (static_cast<int64_t>(hashes.size()) < n) {
    hashes.resize(n);
    sorted_hashes.resize(n);
    pos.resize(n);
    sorted_keys.resize(n);
  }
  // Counting sort by shard; stable, so equal keys keep their input order.
  start.assign(num_shards + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    hashes[i] = KeyHash(keys[i]);
    ++start[shard_of(hashes[i]) + 1];
  }
  for (int64_t s = 0; s < num_shards; ++s) start[s + 1] += start[s];
  fill.assign(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t j = fill[shard_of(hashes[i])]++;
    pos[j] = i;
    sorted_keys[j] = keys[i];
    sorted_hashes[j] = hashes[i];
  }
  const int64_t* st = start.data();
  const ShardBatch all{pos.data(), sorted_keys.data(), sorted_hashes.data(), n};
  auto run = [&, st, all](int64_t s) {
    const int64_t begin = st[s], end = st[s + 1];
    if (begin == end) return;
    Shard& shard = *shards_[s];
    std::lock_guard<std::mutex> lock(shard.mu);
    fn(shard, ShardBatch{all.pos + begin, all.keys + begin, all.hashes + begin, end - begin});
  };
  if (n < kParallelThreshold) {
    for (int64_t s = 0; s < num_shards; ++s) run(s);
  } else {
    ParallelFor(num_shards, run);
  }
  TrimScratch(hashes, sorted_hashes, pos, sorted_keys);
}

float* Table::Row(const Shard& s, uint32_t row) const {
  return s.chunks[row >> kChunkRowsLog2] +
         static_cast<size_t>(row & (kChunkRows - 1)) * row_floats_;
}

void Table::MarkChanged(Shard& s, uint32_t row) { SetBit(s.changed, row); }

uint32_t Table::PulledAt(const float* row) const { return GetWord(row + row_floats_ - 3); }

void Table::SetPulledAt(float* row, uint32_t step) const {
  if (tracks_use_) SetWord(row + row_floats_ - 3, step);
}

void Table::ReadValue(const float* row, float* value) const {
  Decode(options_.row_dtype, options_.dim, row, value);
}

void Table::WriteValue(float* row, const float* value) const {
  Encode(options_.row_dtype, options_.dim, value, row);
}

void Table::ReadSlots(const float* row, float* slots) const {
  Decode(slot_dtype_, num_slots_ * options_.dim, row + value_words_, slots);
}

void Table::WriteSlots(float* row, const float* slots) const {
  Encode(slot_dtype_, num_slots_ * options_.dim, slots, row + value_words_);
}

void Table::CopyRow(const Shard& s, int64_t key, uint32_t row, ExportedRows& out, int64_t i) const {
  const int dim = options_.dim;
  const float* r = Row(s, row);
  out.keys[i] = key;
  ReadValue(r, &out.values[i * dim]);
  if (out.slots.empty() && out.last_step.empty()) return;  // values only
  ReadSlots(r, out.slots.data() + i * num_slots_ * dim);
  out.last_step[i] = GetWord(r + row_floats_ - 2);
  out.update_count[i] = GetWord(r + row_floats_ - 1);
}

void Table::ResizeRows(ExportedRows& out, int64_t m, bool with_state) const {
  out.keys.resize(m);
  out.values.resize(m * options_.dim);
  if (!with_state) return;
  out.slots.resize(m * num_slots_ * options_.dim);
  out.last_step.resize(m);
  out.update_count.resize(m);
}

void Table::InitRow(int64_t key, float* row) const {
  const int dim = options_.dim;
  if (compact_) {
    thread_local std::vector<float> value, slots;
    value.resize(dim);
    slots.resize(static_cast<size_t>(num_slots_) * dim);
    InitialValue(options_.initializer, key, dim, value.data());
    options_.optimizer.InitSlots(dim, slots.data());
    WriteValue(row, value.data());
    WriteSlots(row, slots.data());
  } else {
    InitialValue(options_.initializer, key, dim, row);
    options_.optimizer.InitSlots(dim, row + dim);
  }
  SetPulledAt(row, 0);
  SetWord(row + row_floats_ - 2, 0);
  SetWord(row + row_floats_ - 1, 0);
}

uint32_t Table::FindOrInsert(Shard& s, int64_t key, uint64_t hash) {
  return s.index.FindOrInsert(key, hash, [&] {
    uint32_t row;
    if (!s.free_rows.empty()) {
      row = s.free_rows.back();
      s.free_rows.pop_back();
    } else {
      EE_CHECK(s.next_row < kNoRow - 1, "internal shard is full (2^32 rows)");
      row = s.next_row++;
      if ((row >> kChunkRowsLog2) >= s.chunks.size()) {
        s.chunks.push_back(arena_->NewChunk());
        s.changed.push_back(0);
        s.added.push_back(0);
      }
    }
    InitRow(key, Row(s, row));
    SetBit(s.changed, row);
    SetBit(s.added, row);
    return row;
  });
}

const uint32_t* Table::LookupRows(Shard& s, const ShardBatch& b, bool insert,
                                  std::vector<uint32_t>& rows) {
  rows.resize(b.count);
  for (int64_t k = 0; k < b.count; ++k) {
    if (k + kPrefetchDistance < b.count) s.index.Prefetch(b.hashes[k + kPrefetchDistance]);
    const int64_t key = b.keys[k];
    const uint64_t hash = b.hashes[k];
    rows[k] = insert ? FindOrInsert(s, key, hash) : s.index.Find(key, hash);
  }
  return rows.data();
}

void Table::Pull(int64_t n, const int64_t* keys, float* out, bool train) {
  const int dim = options_.dim;
  const bool insert = train && !options_.admission.enabled();
  // Rows pulled for training are protected as used by the next push's step.
  const auto use = static_cast<uint32_t>(clock_.load(std::memory_order_relaxed) + 1);
  const bool mark_use = train && tracks_use_;
  ForEachShard(n, keys, [&](Shard& s, const ShardBatch& b) {
    thread_local std::vector<uint32_t> scratch;
    const uint32_t* rows = LookupRows(s, b, insert, scratch);
    for (int64_t k = 0; k < b.count; ++k) {
      if (k + kPrefetchDistance < b.count && rows[k + kPrefetchDistance] != kNoRow) {
        __builtin_prefetch(Row(s, rows[k + kPrefetchDistance]));
        // Output rows are written in shard order, i.e. scattered: fetch
        // their cache lines ahead too.
        __builtin_prefetch(out + b.pos[k + kPrefetchDistance] * dim, /*rw=*/1);
      }
      float* dst = out + b.pos[k] * dim;
      if (rows[k] == kNoRow) {
        // The value an insert would store (rounded to the row's storage).
        InitialValue(options_.initializer, b.keys[k], dim, dst);
        if (compact_) Round(options_.row_dtype, dim, dst);
      } else if (compact_) {
        ReadValue(Row(s, rows[k]), dst);
        if (mark_use) SetPulledAt(Row(s, rows[k]), use);
      } else {
        std::memcpy(dst, Row(s, rows[k]), sizeof(float) * dim);
        if (mark_use) SetPulledAt(Row(s, rows[k]), use);
      }
    }
  });
}

void Table::Push(int64_t n, const int64_t* keys, const float* grads, float learning_rate,
                 int64_t step) {
  const UpdateRule rule =
      MakeUpdateRule(options_.optimizer, MakeStepScalars(options_.optimizer, learning_rate, step));
  const int dim = options_.dim;
  const bool admission = options_.admission.enabled();
  clock_.store(step, std::memory_order_relaxed);
  ForEachShard(n, keys, [&](Shard& s, const ShardBatch& b) {
    thread_local std::vector<uint32_t> scratch;
    thread_local std::vector<uint64_t> by_row;
    thread_local std::vector<float> sum, value, slots;
    LookupRows(s, b, /*insert=*/!admission, scratch);
    uint32_t* rows = scratch.data();
    if (admission) Admit(s, b, rows);
    // Sort (row, k) so equal keys are adjacent; among equal keys the input
    // order is kept, so the float sums are reproducible.
    by_row.resize(b.count);
    for (int64_t k = 0; k < b.count; ++k) {
      by_row[k] = (static_cast<uint64_t>(rows[k]) << 32) | static_cast<uint64_t>(k);
    }
    std::sort(by_row.begin(), by_row.end());
    sum.resize(dim);
    for (int64_t a = 0; a < b.count;) {
      const uint32_t row = static_cast<uint32_t>(by_row[a] >> 32);
      if (row == kNoRow) break;  // keys admission turned away sort last
      int64_t e = a + 1;
      while (e < b.count && static_cast<uint32_t>(by_row[e] >> 32) == row) ++e;
      if (e + kPrefetchDistance < b.count) {
        const auto ahead = static_cast<uint32_t>(by_row[e + kPrefetchDistance] >> 32);
        if (ahead != kNoRow) __builtin_prefetch(Row(s, ahead));
      }
      const float* grad = grads + b.pos[by_row[a] & 0xFFFFFFFFu] * dim;
      if (e - a > 1) {
        std::copy(grad, grad + dim, sum.begin());
        for (int64_t c = a + 1; c < e; ++c) {
          const float* g = grads + b.pos[by_row[c] & 0xFFFFFFFFu] * dim;
          for (int j = 0; j < dim; ++j) sum[j] += g[j];
        }
        grad = sum.data();
      }
      float* r = Row(s, row);
      if (compact_) {  // in float32, then rounded back
        value.resize(dim);
        slots.resize(static_cast<size_t>(num_slots_) * dim);
        ReadValue(r, value.data());
        ReadSlots(r, slots.data());
        ApplyUpdate(rule, dim, grad, value.data(), slots.data());
        WriteValue(r, value.data());
        WriteSlots(r, slots.data());
      } else {
        ApplyUpdate(rule, dim, grad, r, r + dim);
      }
      SetWord(r + row_floats_ - 2, static_cast<uint32_t>(step));
      SetWord(r + row_floats_ - 1, GetWord(r + row_floats_ - 1) + 1);
      MarkChanged(s, row);
      a = e;
    }
    TrimScratch(scratch, by_row);
  });
  Evict(step);
}

void Table::Admit(Shard& s, const ShardBatch& b, uint32_t* rows) {
  // The absent keys, grouped by key (input order within a key): each is
  // counted once for this push, however often it occurs in it.
  thread_local std::vector<std::pair<int64_t, int64_t>> absent;  // (key, k)
  absent.clear();
  for (int64_t k = 0; k < b.count; ++k) {
    if (rows[k] == kNoRow) absent.emplace_back(b.keys[k], k);
  }
  if (absent.empty()) return;
  std::sort(absent.begin(), absent.end());
  int64_t admitted = 0, rejected = 0;
  for (size_t a = 0; a < absent.size();) {
    size_t e = a + 1;
    while (e < absent.size() && absent[e].first == absent[a].first) ++e;
    const int64_t k = absent[a].second;
    if (s.sketch.Add(b.hashes[k]) >= options_.admission.min_count) {
      const uint32_t row = FindOrInsert(s, b.keys[k], b.hashes[k]);
      for (size_t c = a; c < e; ++c) rows[absent[c].second] = row;
      ++admitted;
    } else {
      ++rejected;
    }
    a = e;
  }
  admitted_keys_.fetch_add(admitted, std::memory_order_relaxed);
  rejected_updates_.fetch_add(rejected, std::memory_order_relaxed);
}

void Table::Evict(int64_t step) {
  const EvictionOptions& ev = options_.eviction;
  if (ev.kind == EvictionKind::kNone) return;
  if (ev.kind == EvictionKind::kTtl && step % std::max<int64_t>(1, ev.ttl_steps / 4) != 0) return;
  std::unique_lock<std::mutex> pass(evict_mu_, std::try_to_lock);
  if (!pass.owns_lock()) return;  // another push's pass is running
  // Rows used at or after `protected_from` stay.
  const int64_t protected_from = step - ev.protect_steps + 1;
  const auto last_step = [&](const float* r) { return GetWord(r + row_floats_ - 2); };
  const auto evictable = [&](const float* r) {
    return std::max<int64_t>(PulledAt(r), last_step(r)) < protected_from;
  };
  int64_t evicted = 0;
  ExportedRows kept;  // with keep_evicted: the erased rows, whole
  const auto erase = [&](Shard& s, int64_t key, uint64_t hash, uint32_t row) {
    if (ev.keep_evicted) {
      const auto i = static_cast<int64_t>(kept.keys.size());
      ResizeRows(kept, i + 1);
      CopyRow(s, key, row, kept, i);
    }
    evicted += EraseKey(s, key, hash);
  };
  if (ev.kind == EvictionKind::kTtl) {
    const int64_t expired_before = step - ev.ttl_steps;
    for (auto& s : shards_) {
      std::lock_guard<std::mutex> lock(s->mu);
      std::vector<std::pair<int64_t, uint32_t>> expired;
      s->index.ForEach([&](int64_t key, uint32_t row) {
        const float* r = Row(*s, row);
        if (last_step(r) < expired_before && evictable(r)) expired.emplace_back(key, row);
      });
      for (const auto& [key, row] : expired) erase(*s, key, KeyHash(key), row);
    }
  } else {
    const int64_t size = Size();
    if (size <= ev.max_rows) return;
    // Candidates ranked by (primary, secondary, key), the least valuable first.
    struct Candidate {
      uint64_t primary, secondary;
      int64_t key;
      bool operator<(const Candidate& o) const {
        if (primary != o.primary) return primary < o.primary;
        if (secondary != o.secondary) return secondary < o.secondary;
        return key < o.key;
      }
    };
    const bool lfu = ev.kind == EvictionKind::kLfu;
    std::vector<Candidate> candidates;
    for (auto& s : shards_) {
      std::lock_guard<std::mutex> lock(s->mu);
      s->index.ForEach([&](int64_t key, uint32_t row) {
        const float* r = Row(*s, row);
        if (!evictable(r)) return;
        const uint64_t updated = last_step(r);
        candidates.push_back(lfu ? Candidate{GetWord(r + row_floats_ - 1), updated, key}
                                 : Candidate{updated, 0, key});
      });
    }
    const auto excess = static_cast<size_t>(size - (ev.max_rows - ev.max_rows / 16));
    if (excess < candidates.size()) {
      std::nth_element(candidates.begin(), candidates.begin() + excess, candidates.end());
      candidates.resize(excess);
    }
    // Erased shard by shard; a row used since it was ranked stays.
    std::vector<std::vector<int64_t>> by_shard(shards_.size());
    const int bits = options_.shard_bits;
    for (const Candidate& c : candidates) {
      by_shard[bits == 0 ? 0 : KeyHash(c.key) >> (64 - bits)].push_back(c.key);
    }
    for (size_t i = 0; i < shards_.size(); ++i) {
      Shard& s = *shards_[i];
      std::lock_guard<std::mutex> lock(s.mu);
      for (const int64_t key : by_shard[i]) {
        const uint64_t hash = KeyHash(key);
        const uint32_t row = s.index.Find(key, hash);
        if (row != kNoRow && evictable(Row(s, row))) erase(s, key, hash, row);
      }
    }
  }
  evicted_rows_.fetch_add(evicted, std::memory_order_relaxed);
  if (!kept.keys.empty()) {
    std::lock_guard<std::mutex> lock(evicted_mu_);
    if (evicted_.keys.empty()) {
      evicted_ = std::move(kept);
    } else {
      const auto n = static_cast<int64_t>(evicted_.keys.size());
      ResizeRows(evicted_, n + static_cast<int64_t>(kept.keys.size()));
      std::copy(kept.keys.begin(), kept.keys.end(), evicted_.keys.begin() + n);
      std::copy(kept.values.begin(), kept.values.end(), evicted_.values.begin() + n * options_.dim);
      std::copy(kept.slots.begin(), kept.slots.end(),
                evicted_.slots.begin() + n * num_slots_ * options_.dim);
      std::copy(kept.last_step.begin(), kept.last_step.end(), evicted_.last_step.begin() + n);
      std::copy(kept.update_count.begin(), kept.update_count.end(),
                evicted_.update_count.begin() + n);
    }
  }
}

ExportedRows Table::TakeEvicted() {
  std::lock_guard<std::mutex> lock(evicted_mu_);
  ExportedRows out;
  std::swap(out, evicted_);
  return out;
}

void Table::EvictNow() { Evict(clock_.load(std::memory_order_relaxed) + 1); }

void Table::Import(int64_t n, const int64_t* keys, const float* values, const float* slots,
                   const uint32_t* last_step, const uint32_t* update_count) {
  const int dim = options_.dim;
  const int slot_floats = num_slots_ * dim;
  ForEachShard(n, keys, [&](Shard& s, const ShardBatch& b) {
    thread_local std::vector<float> initial;
    for (int64_t k = 0; k < b.count; ++k) {
      const int64_t i = b.pos[k];
      const uint32_t row = FindOrInsert(s, b.keys[k], b.hashes[k]);
      MarkChanged(s, row);
      float* r = Row(s, row);
      WriteValue(r, values + i * dim);
      if (slots != nullptr) {
        WriteSlots(r, slots + i * slot_floats);
      } else {
        initial.resize(slot_floats);
        options_.optimizer.InitSlots(dim, initial.data());
        WriteSlots(r, initial.data());
      }
      SetPulledAt(r, 0);
      SetWord(r + row_floats_ - 2, last_step != nullptr ? last_step[i] : 0);
      SetWord(r + row_floats_ - 1, update_count != nullptr ? update_count[i] : 0);
    }
  });
}

ExportedRows Table::Export(bool with_state) const {
  std::vector<std::unique_lock<std::mutex>> locks;
  locks.reserve(shards_.size());
  std::vector<int64_t> start(shards_.size() + 1, 0);  // each shard's first output row
  for (size_t s = 0; s < shards_.size(); ++s) {
    locks.emplace_back(shards_[s]->mu);
    start[s + 1] = start[s] + static_cast<int64_t>(shards_[s]->index.size());
  }
  ExportedRows out;
  ResizeRows(out, start.back(), with_state);
  auto copy = [&](int64_t s) {
    int64_t i = start[s];
    const Shard& shard = *shards_[s];
    shard.index.ForEach([&](int64_t key, uint32_t row) { CopyRow(shard, key, row, out, i++); });
  };
  const auto num_shards = static_cast<int64_t>(shards_.size());
  if (start.back() < kParallelThreshold) {
    for (int64_t s = 0; s < num_shards; ++s) copy(s);
  } else {
    ParallelFor(num_shards, copy);
  }
  return out;
}

ExportedRows Table::ExportSlots(int64_t num_slots, int64_t begin, int64_t end) const {
  const auto inside = [&](int64_t key) {
    const int64_t slot = VirtualSlot(key, num_slots);
    return slot >= begin && slot < end;
  };
  std::vector<std::unique_lock<std::mutex>> locks;
  locks.reserve(shards_.size());
  int64_t total = 0;
  for (const auto& s : shards_) {
    locks.emplace_back(s->mu);
    s->index.ForEach([&](int64_t key, uint32_t) { total += inside(key); });
  }
  ExportedRows out;
  ResizeRows(out, total);
  int64_t i = 0;
  for (const auto& s : shards_) {
    s->index.ForEach([&](int64_t key, uint32_t row) {
      if (inside(key)) CopyRow(*s, key, row, out, i++);
    });
  }
  return out;
}

int64_t Table::EraseSlots(int64_t num_slots, int64_t begin, int64_t end) {
  std::vector<int64_t> keys;
  for (const auto& s : shards_) {
    std::lock_guard<std::mutex> lock(s->mu);
    s->index.ForEach([&](int64_t key, uint32_t) {
      const int64_t slot = VirtualSlot(key, num_slots);
      if (slot >= begin && slot < end) keys.push_back(key);
    });
  }
  return Erase(static_cast<int64_t>(keys.size()), keys.data());
}

ExportedChanges Table::ExportChanges(bool all) {
  std::vector<std::unique_lock<std::mutex>> locks;
  locks.reserve(shards_.size());
  int64_t total = 0, erased = 0;
  for (const auto& s : shards_) {
    locks.emplace_back(s->mu);
    if (all) {
      total += s->index.size();
    } else {
      // Erased and free rows have both bits clear: this counts live rows.
      for (const uint64_t word : s->changed) total += __builtin_popcountll(word);
      erased += static_cast<int64_t>(s->erased.size());
    }
  }
  ExportedChanges out;
  ResizeRows(out.rows, total);
  out.erased.reserve(erased);
  int64_t i = 0;
  for (const auto& s : shards_) {
    s->index.ForEach([&](int64_t key, uint32_t row) {
      if (all || TestBit(s->changed, row)) CopyRow(*s, key, row, out.rows, i++);
    });
    if (!all) out.erased.insert(out.erased.end(), s->erased.begin(), s->erased.end());
    // The next change set starts empty: every live row counts as present.
    std::fill(s->changed.begin(), s->changed.end(), 0);
    std::fill(s->added.begin(), s->added.end(), 0);
    std::vector<int64_t>().swap(s->erased);
  }
  out.change_set = change_sets_++;
  return out;
}

bool Table::EraseKey(Shard& s, int64_t key, uint64_t hash) {
  const uint32_t row = s.index.Erase(key, hash);
  if (row == kNoRow) return false;
  // Every deletion comes through here: a key that the last change set saw
  // present is logged for the next one.
  if (!TestBit(s.added, row)) s.erased.push_back(key);
  ClearBit(s.changed, row);
  ClearBit(s.added, row);
  s.free_rows.push_back(row);
  return true;
}

int64_t Table::Erase(int64_t n, const int64_t* keys) {
  std::atomic<int64_t> erased{0};
  ForEachShard(n, keys, [&](Shard& s, const ShardBatch& b) {
    int64_t count = 0;
    for (int64_t k = 0; k < b.count; ++k) count += EraseKey(s, b.keys[k], b.hashes[k]);
    erased.fetch_add(count, std::memory_order_relaxed);
  });
  return erased.load();
}

std::vector<uint8_t> Table::ExportCounts() const {
  std::vector<uint8_t> out;
  out.reserve(NumCounts());
  for (const auto& s : shards_) {
    std::lock_guard<std::mutex> lock(s->mu);
    out.insert(out.end(), s->sketch.data(), s->sketch.data() + s->sketch.size());
  }
  return out;
}

void Table::ImportCounts(int64_t n, const uint8_t* counts, bool add) {
  EE_CHECK(n == NumCounts(),
           "admission counts: expected " << NumCounts() << " counters, got " << n);
  for (const auto& s : shards_) {
    std::lock_guard<std::mutex> lock(s->mu);
    uint8_t* c = s->sketch.data();
    for (int64_t i = 0; i < s->sketch.size(); ++i) {
      c[i] = add ? static_cast<uint8_t>(std::min(255, c[i] + counts[i])) : counts[i];
    }
    counts += s->sketch.size();
  }
}

int64_t Table::NumCounts() const {
  int64_t total = 0;
  for (const auto& s : shards_) total += s->sketch.size();
  return total;
}

void Table::SetClock(int64_t step) { clock_.store(step, std::memory_order_relaxed); }

PolicyCounts Table::Counts() const {
  PolicyCounts c;
  c.evicted_rows = evicted_rows_.load();
  c.evicted_bytes = c.evicted_rows * (static_cast<int64_t>(sizeof(float)) * row_floats_ + 12);
  c.admitted_keys = admitted_keys_.load();
  c.rejected_updates = rejected_updates_.load();
  return c;
}

void Table::Metadata(int64_t n, const int64_t* keys, int64_t* last_step,
                     int64_t* update_count) const {
  ForEachShard(n, keys, [&](Shard& s, const ShardBatch& b) {
    for (int64_t k = 0; k < b.count; ++k) {
      const int64_t i = b.pos[k];
      const uint32_t row = s.index.Find(b.keys[k], b.hashes[k]);
      if (row == kNoRow) {
        last_step[i] = update_count[i] = -1;
      } else {
        const float* r = Row(s, row);
        last_step[i] = GetWord(r + row_floats_ - 2);
        update_count[i] = GetWord(r + row_floats_ - 1);
      }
    }
  });
}

int64_t Table::Size() const {
  int64_t total = 0;
  for (const auto& s : shards_) {
    std::lock_guard<std::mutex> lock(s->mu);
    total += s->index.size();
  }
  return total;
}

int64_t Table::MemoryBytes() const {
  int64_t bytes = 0;
  for (const auto& s : shards_) {
    std::lock_guard<std::mutex> lock(s->mu);
    bytes += s->index.MemoryBytes();
    bytes += static_cast<int64_t>(s->free_rows.capacity() * sizeof(uint32_t));
    bytes += static_cast<int64_t>((s->changed.capacity() + s->added.capacity()) * sizeof(uint64_t));
    bytes += static_cast<int64_t>(s->erased.capacity() * sizeof(int64_t));
    bytes += s->sketch.size();
  }
  return bytes + static_cast<int64_t>(arena_->ReservedBytes());
}

int64_t Table::MemoryInUse() const {
  int64_t free_rows = 0;
  for (const auto& s : shards_) {
    std::lock_guard<std::mutex> lock(s->mu);
    free_rows += static_cast<int64_t>(s->free_rows.size());
  }
  return MemoryBytes() - free_rows * static_cast<int64_t>(row_floats_ * sizeof(float));
}

}  // namespace elastic_emb
