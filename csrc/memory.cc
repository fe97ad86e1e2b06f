#include "memory.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>

namespace elastic_emb {

namespace {

constexpr size_t kPageBytes = 4096;
constexpr size_t kMapBytes = size_t{256} << 10;  // smaller blocks come from malloc

// Mappings are whole pages; a partial last huge page is backed by small pages.
size_t RoundUp(size_t bytes) { return (bytes + kPageBytes - 1) / kPageBytes * kPageBytes; }

}  // namespace

void* AllocateLarge(size_t bytes) {
  if (bytes < kMapBytes) {
    void* p = std::malloc(bytes == 0 ? 1 : bytes);
    if (p == nullptr) throw std::bad_alloc();
    return p;
  }
  // Mapped directly rather than through malloc, so that freed memory (e.g. a
  // hash index replaced by a bigger one) goes back to the system at once.
  const size_t rounded = RoundUp(bytes);
  const size_t align = bytes >= kHugePageBytes ? kHugePageBytes : kPageBytes;
  void* raw =
      mmap(nullptr, rounded + align, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) throw std::bad_alloc();
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + align - 1) / align * align;
  if (aligned > start) munmap(raw, aligned - start);
  const uintptr_t tail = start + rounded + align - (aligned + rounded);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + rounded), tail);
  void* p = reinterpret_cast<void*>(aligned);
#ifdef MADV_HUGEPAGE
  if (align == kHugePageBytes) madvise(p, rounded, MADV_HUGEPAGE);  // a hint only
#endif
  return p;
}

void FreeLarge(void* p, size_t bytes) {
  if (bytes < kMapBytes) {
    std::free(p);
  } else if (p != nullptr) {
    munmap(p, RoundUp(bytes));
  }
}

ChunkAllocator::ChunkAllocator(size_t chunk_bytes) : chunk_bytes_(chunk_bytes) {}

ChunkAllocator::~ChunkAllocator() {
  for (float* c : heap_chunks_) delete[] c;
  for (char* s : slabs_) FreeLarge(s, kSlabBytes);
}

float* ChunkAllocator::NewChunk() {
  std::lock_guard<std::mutex> lock(mu_);
  if (chunk_bytes_ > kSlabBytes || (heap_chunks_.size() + 1) * chunk_bytes_ <= kHeapBytes) {
    heap_chunks_.push_back(new float[chunk_bytes_ / sizeof(float)]);
    return heap_chunks_.back();
  }
  if (slab_used_ + chunk_bytes_ > kSlabBytes) {
    slabs_.push_back(static_cast<char*>(AllocateLarge(kSlabBytes)));
    slab_used_ = 0;
  }
  float* chunk = reinterpret_cast<float*>(slabs_.back() + slab_used_);
  slab_used_ += chunk_bytes_;
  return chunk;
}

size_t ChunkAllocator::ReservedBytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return heap_chunks_.size() * chunk_bytes_ + slabs_.size() * kSlabBytes;
}

}  // namespace elastic_emb
