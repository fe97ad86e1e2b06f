// 16-bit floats for compact rows: IEEE binary16 ("float16") and bfloat16,
// converted from float32 with round-to-nearest-even, as NumPy and ml_dtypes
// convert. NaN stays NaN (quiet); float16 overflows to ±Inf from 65520 on.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace elastic_emb {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t FloatToBfloat16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7FFFu + ((u >> 16) & 1u);  // to nearest, ties to the even upper half
  return static_cast<uint16_t>(u >> 16);
}

inline float Bfloat16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

inline uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const auto sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t x = u & 0x7FFFFFFFu;
  if (x > 0x7F800000u) return sign | 0x7E00u;   // NaN
  if (x >= 0x477FF000u) return sign | 0x7C00u;  // rounds to 65536 or more: Inf
  if (x < 0x38800000u) {
    // Below 2^-14: a subnormal half, a multiple of 2^-24. |f| * 2^24 is
    // exact in float32 and below 1024; rint rounds it to nearest even.
    const auto m = static_cast<uint16_t>(std::nearbyint(BitsFloat(x) * 16777216.0f));
    return sign | m;
  }
  // Normal: drop 13 mantissa bits to nearest even (a carry may raise the
  // exponent, correctly), then rebias the exponent from 127 to 15.
  const uint32_t rounded = x + 0xFFFu + ((x >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact
    return BitsFloat(sign | FloatBits(static_cast<float>(mantissa) * 5.9604644775390625e-8f));
  }
  if (exponent == 31) return BitsFloat(sign | 0x7F800000u | (mantissa << 13));
  return BitsFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

}  // namespace elastic_emb
