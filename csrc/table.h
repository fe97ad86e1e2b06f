// An embedding table: int64 keys -> rows of `dim` float32 values plus the
// optimizer's slots, stored in memory.
//
// Layout: the table is split into 2^shard_bits internal shards by the top
// bits of a key's hash, each with its own mutex, open-addressing index
// (linear probing over the low hash bits) and row arena. Arena chunks hold a
// fixed number of rows and are never moved or freed while the table lives, so
// a row's address is stable; a row holds [value (dim) | slots (num_slots *
// dim) | pulled_at (u32, with eviction only) | last_step (u32) | update_count
// (u32)] side by side, values and slots in float32 or, with a 16-bit
// row_dtype, packed two to a 32-bit word.
//
// Thread safety: every public method may be called from any number of threads
// at once. Batch methods block, split their keys by shard and run the shards
// on the process thread pool.
//
// Change tracking (incremental checkpoints): every row carries two bits,
// "changed" (inserted, pushed or imported) and "added" (inserted), and each
// shard logs the keys erased whose rows were present at the last
// ExportChanges (their "added" bit clear). ExportChanges copies the changed
// rows and the erased keys and clears all of it at once, so the rows of a
// table are always: its rows at the last ExportChanges, minus the erased
// keys, with the changed rows replaced or added. The erased log holds at most
// the number of rows present at the last ExportChanges (none before the first).
//
// Usage:
//   TableOptions o; o.dim = 16; o.optimizer.kind = OptimizerKind::kAdagrad;
//   Table t(o);
//   t.Pull(n, keys, out, /*train=*/true);          // out: (n, 16)
//   t.Push(n, keys, grads, /*lr=*/0.05f, /*step=*/1);
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "count_sketch.h"
#include "initializer.h"
#include "key_index.h"
#include "memory.h"
#include "optimizer.h"

namespace elastic_emb {

// Frequency admission (elastic_emb.admission.Frequency): with min_count > 1,
// an absent key gets a row only at the push that brings its estimated count
// of training steps to min_count; earlier pushes of it are dropped, and pulls
// never insert. Counted once per push, in a count-min sketch of
// `sketch_bytes` 8-bit counters (`sketch_depth` rows), split evenly over the
// internal shards.
struct AdmissionOptions {
  int min_count = 0;  // 0 or 1: no admission (every key gets a row on first use)
  int64_t sketch_bytes = int64_t{1} << 22;
  int sketch_depth = 4;

  bool enabled() const { return min_count > 1; }
};

enum class EvictionKind { kNone, kTtl, kLru, kLfu };

// Eviction (elastic_emb.eviction), after each push of step t:
//   TTL: every max(1, ttl_steps / 4) steps, rows last updated before
//        t - ttl_steps are erased;
//   LRU, LFU: when the table holds more than max_rows rows, the least
//        valuable are erased down to max_rows - max_rows / 16: LRU by (last
//        step, key), LFU by (update count, last step, key), smallest first.
// Rows used at step t - protect_steps + 1 or later are never erased: pushed
// then, or pulled for training after the push of the step before (a pull
// counts for the next push's step; not saved in checkpoints).
struct EvictionOptions {
  EvictionKind kind = EvictionKind::kNone;
  int64_t ttl_steps = 0;
  int64_t max_rows = 0;
  int64_t protect_steps = 1;
  // Erased rows are kept, whole, for TakeEvicted (a disk tier demotes them).
  bool keep_evicted = false;
};

// How a row's values are stored (elastic_emb Table(row_dtype=...)). With a
// 16-bit type, updates still compute in float32: a push decodes the row,
// applies the optimizer, and rounds the result to nearest even. The
// optimizer's slots are then stored as bfloat16 (float32's range), except
// FTRL's, which stay float32.
enum class RowDtype { kFloat32, kFloat16, kBfloat16 };

struct TableOptions {
  int dim = 8;
  InitializerOptions initializer;
  OptimizerOptions optimizer;
  RowDtype row_dtype = RowDtype::kFloat32;
  AdmissionOptions admission;
  EvictionOptions eviction;
  int shard_bits = 6;  // 64 internal shards

  void Validate() const;
};

// What the table's policies did so far (admission, eviction).
struct PolicyCounts {
  int64_t evicted_rows = 0;
  int64_t evicted_bytes = 0;     // index slots and arena rows freed by eviction
  int64_t admitted_keys = 0;     // absent keys that got a row at a push
  int64_t rejected_updates = 0;  // (push, absent key) pairs dropped by admission
};

// An allocator that leaves new elements uninitialized: exported arrays are
// written in full right after resize(), so zero-filling them first would only
// touch every page twice (and fault them in on one thread).
template <typename T>
struct UninitializedAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = UninitializedAllocator<U>;
  };
  UninitializedAllocator() = default;
  template <typename U>
  UninitializedAllocator(const UninitializedAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
template <typename T>
using ExportVector = std::vector<T, UninitializedAllocator<T>>;

// Rows copied out of a table; row i of each array belongs to keys[i].
struct ExportedRows {
  ExportVector<int64_t> keys;           // (m,)
  ExportVector<float> values;           // (m, dim)
  ExportVector<float> slots;            // (m, num_slots * dim)
  ExportVector<uint32_t> last_step;     // (m,)
  ExportVector<uint32_t> update_count;  // (m,)
};

// What ExportChanges returns: one change set of a table.
struct ExportedChanges {
  ExportedRows rows;            // the rows changed in the set (every row with `all`)
  std::vector<int64_t> erased;  // (e,): keys present when the set opened, erased since
  // The set's number: how many ExportChanges calls came before this one. The
  // set numbered s holds the changes since call s (s = 0: since the table
  // was built, i.e. every row).
  uint64_t change_set = 0;
};

// A key's virtual slot, as elastic_emb.tables.sharding.slot_of computes it
// (MurmurHash3's 64-bit finalizer, modulo num_slots).
inline int64_t VirtualSlot(int64_t key, int64_t num_slots) {
  uint64_t h = static_cast<uint64_t>(key);
  h ^= h >> 33;
  h *= 0xFF51AFD7ED558CCDULL;
  h ^= h >> 33;
  h *= 0xC4CEB9FE1A85EC53ULL;
  h ^= h >> 33;
  return static_cast<int64_t>(h % static_cast<uint64_t>(num_slots));
}

// The order of a table's optimizer steps (elastic_emb.tables.local.LocalTable): a push
// takes `mu`, counts itself in `iterations` and runs as that step, so every caller's
// pushes, Python's and the data plane's, are numbered in one sequence.
struct StepState {
  std::mutex mu;
  int64_t iterations = 0;        // guarded by mu
  int64_t nonfinite_pushes = 0;  // pushes skipped for gradients not finite; guarded by mu
};

class Table {
 public:
  explicit Table(const TableOptions& options);
  ~Table();
  Table(const Table&) = delete;
  Table& operator=(const Table&) = delete;

  const TableOptions& options() const { return options_; }
  int dim() const { return options_.dim; }
  int num_slots() const { return num_slots_; }

  // Gathers the rows of `keys`. With train, unseen keys are inserted with
  // their initial value (unless admission is on) and rows count as used;
  // without, they are not inserted and get their initial value in `out`.
  // keys: (n,), out: (n, dim), host memory.
  void Pull(int64_t n, const int64_t* keys, float* out, bool train);

  // Sums the gradients of equal keys, then applies the optimizer once per
  // distinct key (inserting unseen keys first, as admission allows) and
  // records `step` in the row; then runs eviction.
  // keys: (n,), grads: (n, dim), host memory. step >= 1.
  void Push(int64_t n, const int64_t* keys, const float* grads, float learning_rate, int64_t step);

  // Sets rows, inserting keys as needed; the last of equal keys wins.
  // values: (n, dim); slots: (n, num_slots * dim) or null to reset them to
  // their initial values; last_step, update_count: (n,) or null for zeros.
  void Import(int64_t n, const int64_t* keys, const float* values, const float* slots,
              const uint32_t* last_step, const uint32_t* update_count);

  // A consistent copy of every row (all shards locked while copying); without
  // `with_state`, keys and values only (slots and metadata left empty).
  ExportedRows Export(bool with_state = true) const;

  // Slot ranges (elastic_emb.tables.sharding: a key's virtual slot is
  // VirtualSlot(key, num_slots)). A consistent copy of the rows whose slot
  // is in [begin, end); and their removal, which returns how many went.
  ExportedRows ExportSlots(int64_t num_slots, int64_t begin, int64_t end) const;
  int64_t EraseSlots(int64_t num_slots, int64_t begin, int64_t end);

  // Closes the current change set and opens the next one: copies the rows
  // inserted, pushed or imported since the previous call (every row with
  // `all`) and the keys that were present at the previous call and have been
  // erased since (none with `all`), then clears the tracking. All shards are
  // locked at once, so the copy is a consistent snapshot and every change
  // made concurrently lands in exactly one change set. Blocks pulls and
  // pushes while it copies.
  ExportedChanges ExportChanges(bool all);

  // Removes keys; returns how many were present.
  int64_t Erase(int64_t n, const int64_t* keys);

  // Row metadata of keys; absent keys get -1 in both outputs.
  // keys, last_step, update_count: (n,), host memory.
  void Metadata(int64_t n, const int64_t* keys, int64_t* last_step, int64_t* update_count) const;

  // The admission sketch's counters (internal shard by internal shard), and
  // their replacement (or saturating sum, with `add`); empty without admission.
  std::vector<uint8_t> ExportCounts() const;
  void ImportCounts(int64_t n, const uint8_t* counts, bool add);
  int64_t NumCounts() const;

  // The rows eviction erased since the last call (with keep_evicted), and
  // an eviction pass now, as after a push that used no row.
  ExportedRows TakeEvicted();
  void EvictNow();

  // Sets the step that pulls count as using rows at minus one (eviction):
  // the step of the table's last push, after a restore.
  void SetClock(int64_t step);
  PolicyCounts Counts() const;

  int64_t Size() const;
  // Bytes held by indexes and arenas.
  int64_t MemoryBytes() const;
  // MemoryBytes less the rows freed for reuse (erased, evicted, moved away): what the
  // live rows take. The arena never shrinks; new rows fill the freed ones first.
  int64_t MemoryInUse() const;

  StepState& step_state() { return step_state_; }

 private:
  struct Shard;

  // The keys of one call that belong to one shard, in input order:
  // keys[k] == input_keys[pos[k]], hashes[k] its hash, for k < count.
  struct ShardBatch {
    const int64_t* pos;
    const int64_t* keys;
    const uint64_t* hashes;
    int64_t count;
  };

  // Calls fn(shard, batch) with the shard's mutex held for every shard that
  // owns some of `keys`; shards run on the thread pool for large calls.
  template <typename Fn>
  void ForEachShard(int64_t n, const int64_t* keys, Fn fn) const;

  // The row of `key`, inserted with its initial value if absent.
  uint32_t FindOrInsert(Shard& s, int64_t key, uint64_t hash);
  // Row ids of the batch's keys -> rows (count,), with prefetching; kNoRow
  // for absent keys unless insert.
  const uint32_t* LookupRows(Shard& s, const ShardBatch& b, bool insert,
                             std::vector<uint32_t>& rows);
  float* Row(const Shard& s, uint32_t row) const;
  // Marks a row as changed since the last ExportChanges.
  static void MarkChanged(Shard& s, uint32_t row);
  // Copies row `row` of key `key` into row i of `out` (sized by ResizeRows;
  // its values only where ResizeRows was told no state).
  void CopyRow(const Shard& s, int64_t key, uint32_t row, ExportedRows& out, int64_t i) const;
  void ResizeRows(ExportedRows& out, int64_t m, bool with_state = true) const;
  void InitRow(int64_t key, float* row) const;
  // A row's value and slots as float32, and back (rounded to their storage).
  void ReadValue(const float* row, float* value) const;
  void WriteValue(float* row, const float* value) const;
  void ReadSlots(const float* row, float* slots) const;
  void WriteSlots(float* row, const float* slots) const;
  // Removes a present key's row (with change tracking); false if absent.
  bool EraseKey(Shard& s, int64_t key, uint64_t hash);
  // Admission at a push: gives the batch's absent keys (rows[k] == kNoRow)
  // that reach min_count a row.
  void Admit(Shard& s, const ShardBatch& b, uint32_t* rows);
  // Eviction after the push of `step`.
  void Evict(int64_t step);
  // The step a row was last pulled for training at (eviction's protection).
  uint32_t PulledAt(const float* row) const;
  void SetPulledAt(float* row, uint32_t step) const;

  TableOptions options_;
  int num_slots_;
  int row_floats_;                         // floats per arena row, metadata words included
  bool tracks_use_;                        // rows hold a pulled_at word (eviction)
  RowDtype slot_dtype_;                    // how slots are stored (see RowDtype)
  bool compact_;                           // values or slots in 16 bits
  int value_words_, slot_words_;           // 32-bit words of a row's value and slots
  std::unique_ptr<ChunkAllocator> arena_;  // before shards_: outlives them
  std::vector<std::unique_ptr<Shard>> shards_;
  uint64_t change_sets_ = 0;       // ExportChanges calls so far; guarded by every shard's mutex
  std::atomic<int64_t> clock_{0};  // the step of the last push (eviction)
  std::mutex evict_mu_;            // one eviction pass at a time
  std::mutex evicted_mu_;          // guards evicted_
  ExportedRows evicted_;           // rows erased by eviction, kept (keep_evicted)
  std::atomic<int64_t> evicted_rows_{0}, admitted_keys_{0}, rejected_updates_{0};
  StepState step_state_;
};

}  // namespace elastic_emb
