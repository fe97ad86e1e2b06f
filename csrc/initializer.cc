#include "initializer.h"

#include <cmath>

#include "check.h"

namespace elastic_emb {
namespace {

// Uniform in [0, 1) from the top 24 bits: exactly representable in float32.
inline float Uniform01(uint64_t bits) {
  return static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);
}

// Standard normal draw number `counter` of the stream `base` (Box-Muller).
inline float StandardNormal(uint64_t base, uint64_t counter) {
  const uint64_t h1 = Mix64(base ^ Mix64(2 * counter));
  const uint64_t h2 = Mix64(base ^ Mix64(2 * counter + 1));
  // u1 in (0, 1] so that log(u1) is finite.
  const double u1 = (static_cast<double>(h1 >> 11) + 1.0) * (1.0 / 9007199254740992.0);
  const double u2 = static_cast<double>(h2 >> 11) * (1.0 / 9007199254740992.0);
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

}  // namespace

void InitializerOptions::Validate() const {
  switch (kind) {
    case InitKind::kUniform:
      EE_CHECK(a < b,
               "uniform initializer needs minval < maxval, got minval=" << a << " maxval=" << b);
      break;
    case InitKind::kNormal:
    case InitKind::kTruncatedNormal:
      EE_CHECK(b > 0, "normal initializers need stddev > 0, got stddev=" << b);
      break;
    default:
      break;
  }
}

void InitialValue(const InitializerOptions& opts, int64_t key, int dim, float* out) {
  const uint64_t base = Mix64(opts.seed ^ Mix64(static_cast<uint64_t>(key)));
  switch (opts.kind) {
    case InitKind::kZeros:
    case InitKind::kOnes:
    case InitKind::kConstant: {
      const float v = opts.kind == InitKind::kZeros  ? 0.0f
                      : opts.kind == InitKind::kOnes ? 1.0f
                                                     : opts.a;
      for (int j = 0; j < dim; ++j) out[j] = v;
      break;
    }
    case InitKind::kUniform:
      for (int j = 0; j < dim; ++j) {
        out[j] = opts.a + (opts.b - opts.a) * Uniform01(Mix64(base + static_cast<uint64_t>(j)));
      }
      break;
    case InitKind::kNormal:
      for (int j = 0; j < dim; ++j) out[j] = opts.a + opts.b * StandardNormal(base, j);
      break;
    case InitKind::kTruncatedNormal:
      // Keras truncates at two standard deviations and redraws; the redraws
      // come from counters beyond `dim`, so the result stays a pure function.
      for (int j = 0; j < dim; ++j) {
        uint64_t counter = static_cast<uint64_t>(j);
        float z = StandardNormal(base, counter);
        while (std::fabs(z) > 2.0f) {
          counter += static_cast<uint64_t>(dim);
          z = StandardNormal(base, counter);
        }
        out[j] = opts.a + opts.b * z;
      }
      break;
  }
}

}  // namespace elastic_emb
