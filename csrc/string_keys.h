// Keys of string features, computed on the host: the 64-bit FarmHash
// fingerprint (the "na" variant) that TensorFlow's tf.fingerprint gives, so a
// string maps to the same int64 key on every backend and in every process.
#pragma once

#include <cstddef>
#include <cstdint>

namespace elastic_emb {

// Fingerprint64 of the bytes s[0..len), as tf.fingerprint(..., "farmhash64").
uint64_t StringFingerprint(const char* s, size_t len);

}  // namespace elastic_emb
