// Memory for large tables: 2 MiB-aligned allocations that the kernel may back
// with transparent huge pages (madvise), so random row accesses over
// gigabytes of rows miss the TLB far less often.
#pragma once

#include <cstddef>
#include <mutex>
#include <new>
#include <vector>

namespace elastic_emb {

constexpr size_t kHugePageBytes = size_t{2} << 20;

// Allocates `bytes`: from malloc below 256 KiB, else mapped (and from 2 MiB
// on, huge-page aligned and advised). Throws std::bad_alloc. FreeLarge needs
// the same `bytes`.
void* AllocateLarge(size_t bytes);
void FreeLarge(void* p, size_t bytes);

// std::allocator replacement for big vectors (e.g. hash indexes).
template <typename T>
struct LargeAllocator {
  using value_type = T;
  LargeAllocator() = default;
  template <typename U>
  LargeAllocator(const LargeAllocator<U>&) {}  // NOLINT(runtime/explicit)
  T* allocate(size_t n) { return static_cast<T*>(AllocateLarge(n * sizeof(T))); }
  void deallocate(T* p, size_t n) { FreeLarge(p, n * sizeof(T)); }
  template <typename U>
  bool operator==(const LargeAllocator<U>&) const {
    return true;
  }
  template <typename U>
  bool operator!=(const LargeAllocator<U>&) const {
    return false;
  }
};

// Hands out fixed-size chunks, never freed before the allocator. The first
// chunks come from the heap (small tables stay small); later ones are carved
// out of 8 MiB huge-page slabs. Thread-safe.
class ChunkAllocator {
 public:
  explicit ChunkAllocator(size_t chunk_bytes);
  ~ChunkAllocator();
  ChunkAllocator(const ChunkAllocator&) = delete;
  ChunkAllocator& operator=(const ChunkAllocator&) = delete;

  float* NewChunk();
  // Bytes reserved from the system.
  size_t ReservedBytes() const;

 private:
  static constexpr size_t kSlabBytes = size_t{8} << 20;
  static constexpr size_t kHeapBytes = size_t{16} << 20;  // before slabs start

  const size_t chunk_bytes_;
  mutable std::mutex mu_;
  std::vector<float*> heap_chunks_;
  std::vector<char*> slabs_;
  size_t slab_used_ = kSlabBytes;  // of slabs_.back()
};

}  // namespace elastic_emb
