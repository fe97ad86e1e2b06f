// The wire's compact key encoding (elastic_emb.ps.wire.protocol, KEYS_DELTA_VARINT):
// each int64 key minus the previous one, modulo 2^64, as an LEB128 varint
// (7 bits a byte, low bits first, the high bit set on all but the last byte).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace elastic_emb {

// Appends the encoding of keys[0..n) to `out`.
void EncodeDeltaVarint(int64_t n, const int64_t* keys, std::string& out);

// Decodes `size` bytes into `keys`. On malformed input (a truncated last
// varint, a varint beyond 64 bits) returns false and says why in `error`.
bool DecodeDeltaVarint(const uint8_t* bytes, size_t size, std::vector<int64_t>& keys,
                       std::string& error);

}  // namespace elastic_emb
