#include "string_keys.h"

#include <cstring>
#include <utility>

namespace elastic_emb {
namespace {

// The mixing constants of FarmHash (a published specification).
constexpr uint64_t kMul0 = 0xc3a5c85c97cb3127ULL;
constexpr uint64_t kMul1 = 0xb492b66fbe98f273ULL;
constexpr uint64_t kMul2 = 0x9ae16a3b2f90404fULL;

// Little-endian loads (every target this builds for is little-endian).
uint64_t Load64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

uint32_t Load32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

uint64_t RotateRight(uint64_t v, int bits) {
  return bits == 0 ? v : (v >> bits) | (v << (64 - bits));
}

uint64_t FoldHigh(uint64_t v) { return v ^ (v >> 47); }

// Two words folded into one with multiplier `mul`.
uint64_t Combine(uint64_t u, uint64_t v, uint64_t mul) {
  uint64_t a = FoldHigh((u ^ v) * mul);
  uint64_t b = FoldHigh((v ^ a) * mul);
  return b * mul;
}

uint64_t Short(const char* s, size_t len) {  // len <= 16
  if (len >= 8) {
    const uint64_t mul = kMul2 + len * 2;
    const uint64_t a = Load64(s) + kMul2;
    const uint64_t b = Load64(s + len - 8);
    return Combine(RotateRight(b, 37) * mul + a, (RotateRight(a, 25) + b) * mul, mul);
  }
  if (len >= 4) {
    const uint64_t mul = kMul2 + len * 2;
    const uint64_t first = Load32(s);
    return Combine(len + (first << 3), Load32(s + len - 4), mul);
  }
  if (len > 0) {
    const auto first = static_cast<uint8_t>(s[0]);
    const auto middle = static_cast<uint8_t>(s[len >> 1]);
    const auto last = static_cast<uint8_t>(s[len - 1]);
    const uint32_t y = first + (static_cast<uint32_t>(middle) << 8);
    const uint32_t z = static_cast<uint32_t>(len) + (static_cast<uint32_t>(last) << 2);
    return FoldHigh(y * kMul2 ^ z * kMul0) * kMul2;
  }
  return kMul2;
}

uint64_t Medium(const char* s, size_t len) {  // 17 <= len <= 32
  const uint64_t mul = kMul2 + len * 2;
  const uint64_t a = Load64(s) * kMul1;
  const uint64_t b = Load64(s + 8);
  const uint64_t c = Load64(s + len - 8) * mul;
  const uint64_t d = Load64(s + len - 16) * kMul2;
  return Combine(RotateRight(a + b, 43) + RotateRight(c, 30) + d,
                 a + RotateRight(b + kMul2, 18) + c, mul);
}

uint64_t Long(const char* s, size_t len) {  // 33 <= len <= 64
  const uint64_t mul = kMul2 + len * 2;
  const uint64_t a = Load64(s) * kMul2;
  const uint64_t b = Load64(s + 8);
  const uint64_t c = Load64(s + len - 8) * mul;
  const uint64_t d = Load64(s + len - 16) * kMul2;
  const uint64_t y = RotateRight(a + b, 43) + RotateRight(c, 30) + d;
  const uint64_t z = Combine(y, a + RotateRight(b + kMul2, 18) + c, mul);
  const uint64_t e = Load64(s + 16) * mul;
  const uint64_t f = Load64(s + 24);
  const uint64_t g = (y + Load64(s + len - 32)) * mul;
  const uint64_t h = (z + Load64(s + len - 24)) * mul;
  return Combine(RotateRight(e + f, 43) + RotateRight(g, 30) + h, e + RotateRight(f + a, 18) + g,
                 mul);
}

// 32 bytes at s mixed into the pair (a, b).
std::pair<uint64_t, uint64_t> Mix32(const char* s, uint64_t a, uint64_t b) {
  const uint64_t w = Load64(s), x = Load64(s + 8), y = Load64(s + 16), z = Load64(s + 24);
  a += w;
  b = RotateRight(b + a + z, 21);
  const uint64_t c = a;
  a += x + y;
  b += RotateRight(a, 44);
  return {a + z, b + c};
}

// Over 64 bytes: 64-byte blocks through a 56-byte state, then the last 64.
uint64_t Blocks(const char* s, size_t len) {
  constexpr uint64_t kSeed = 81;
  uint64_t x = kSeed * kMul2 + Load64(s);
  uint64_t y = kSeed * kMul1 + 113;
  uint64_t z = FoldHigh(y * kMul2 + 113) * kMul2;
  std::pair<uint64_t, uint64_t> v{0, 0}, w{0, 0};
  const char* end = s + ((len - 1) / 64) * 64;
  const char* last = end + ((len - 1) & 63) - 63;
  auto round = [&](const char* p, uint64_t mul, uint64_t weight) {
    x = RotateRight(x + y + v.first + Load64(p + 8), 37) * mul;
    y = RotateRight(y + v.second + Load64(p + 48), 42) * mul;
    x ^= w.second * weight;
    y += v.first * weight + Load64(p + 40);
    z = RotateRight(z + w.first, 33) * mul;
    v = Mix32(p, v.second * mul, x + w.first);
    w = Mix32(p + 32, z + w.second, y + Load64(p + 16));
    std::swap(z, x);
  };
  for (; s != end; s += 64) round(s, kMul1, 1);
  const uint64_t mul = kMul1 + ((z & 0xff) << 1);
  w.first += (len - 1) & 63;
  v.first += w.first;
  w.first += v.first;
  round(last, mul, 9);
  return Combine(Combine(v.first, w.first, mul) + FoldHigh(y) * kMul0 + z,
                 Combine(v.second, w.second, mul) + x, mul);
}

}  // namespace

uint64_t StringFingerprint(const char* s, size_t len) {
  if (len <= 16) return Short(s, len);
  if (len <= 32) return Medium(s, len);
  if (len <= 64) return Long(s, len);
  return Blocks(s, len);
}

}  // namespace elastic_emb
