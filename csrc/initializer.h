// Deterministic row initialization: a row's initial value is a pure function
// of (seed, key), so every process, shard and replica agrees without talking.
#pragma once

#include <cstdint>

namespace elastic_emb {

enum class InitKind { kZeros, kOnes, kConstant, kUniform, kNormal, kTruncatedNormal };

// Distribution parameters follow Keras: uniform(a=minval, b=maxval),
// normal/truncated_normal(a=mean, b=stddev), constant(a=value).
struct InitializerOptions {
  InitKind kind = InitKind::kUniform;
  float a = -0.05f;
  float b = 0.05f;
  uint64_t seed = 0;

  void Validate() const;
};

// 64-bit finalizer of splitmix64: a bijective, well-mixed hash.
inline uint64_t Mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Writes the initial value of `key`.
// out: (dim,) host memory. Thread-safe (pure function).
void InitialValue(const InitializerOptions& opts, int64_t key, int dim, float* out);

}  // namespace elastic_emb
