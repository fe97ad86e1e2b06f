#include "memory.h"

#include <sys/mman.h>

#include <cstdlib>

namespace elastic_emb {

void* AllocateLarge(size_t bytes) {
  if (bytes < kHugePageBytes) {
    void* p = std::malloc(bytes == 0 ? 1 : bytes);
    if (p == nullptr) throw std::bad_alloc();
    return p;
  }
  const size_t rounded = (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  void* p = std::aligned_alloc(kHugePageBytes, rounded);
  if (p == nullptr) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  madvise(p, rounded, MADV_HUGEPAGE);  // a hint: failure is harmless
#endif
  return p;
}

void FreeLarge(void* p, size_t /*bytes*/) { std::free(p); }

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
