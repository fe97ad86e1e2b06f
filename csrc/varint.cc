#include "varint.h"

namespace elastic_emb {

void EncodeDeltaVarint(int64_t n, const int64_t* keys, std::string& out) {
  out.reserve(out.size() + static_cast<size_t>(n) * 3);
  uint64_t previous = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t key = static_cast<uint64_t>(keys[i]);
    uint64_t delta = key - previous;  // modulo 2^64
    previous = key;
    while (delta >= 0x80) {
      out.push_back(static_cast<char>((delta & 0x7F) | 0x80));
      delta >>= 7;
    }
    out.push_back(static_cast<char>(delta));
  }
}

bool DecodeDeltaVarint(const uint8_t* bytes, size_t size, std::vector<int64_t>& keys,
                       std::string& error) {
  keys.clear();
  if (size > 0 && (bytes[size - 1] & 0x80) != 0) {
    error = "ends inside a varint (truncated)";
    return false;
  }
  uint64_t key = 0;
  size_t i = 0;
  while (i < size) {
    uint64_t delta = 0;
    for (int shift = 0;; shift += 7) {
      const uint8_t b = bytes[i++];
      // The tenth byte holds bit 63 only.
      if (shift == 63 && (b & 0x7F) > 1) {
        error = "holds a varint beyond 64 bits";
        return false;
      }
      delta |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) break;
      if (shift == 63) {
        error = "holds a varint beyond 64 bits";
        return false;
      }
    }
    key += delta;  // modulo 2^64
    keys.push_back(static_cast<int64_t>(key));
  }
  return true;
}

}  // namespace elastic_emb
