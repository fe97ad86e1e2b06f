#include "optimizer.h"

#include <algorithm>
#include <cmath>

#include "check.h"

namespace elastic_emb {

void OptimizerOptions::Validate() const {
  EE_CHECK(momentum >= 0.0 && momentum <= 1.0, "momentum must be in [0, 1], got " << momentum);
  EE_CHECK(beta_1 >= 0.0 && beta_1 < 1.0, "beta_1 must be in [0, 1), got " << beta_1);
  EE_CHECK(beta_2 >= 0.0 && beta_2 < 1.0, "beta_2 must be in [0, 1), got " << beta_2);
  EE_CHECK(epsilon >= 0.0, "epsilon must be >= 0, got " << epsilon);
  EE_CHECK(initial_accumulator_value >= 0.0,
           "initial_accumulator_value must be >= 0, got " << initial_accumulator_value);
  EE_CHECK(learning_rate_power <= 0.0,
           "learning_rate_power must be <= 0, got " << learning_rate_power);
  EE_CHECK(l1_regularization_strength >= 0.0 && l2_regularization_strength >= 0.0 &&
               l2_shrinkage_regularization_strength >= 0.0 && beta >= 0.0,
           "Ftrl regularization strengths and beta must be >= 0");
}

int OptimizerOptions::NumSlots() const {
  switch (kind) {
    case OptimizerKind::kSgd:
      return momentum != 0.0 ? 1 : 0;
    case OptimizerKind::kAdagrad:
      return 1;
    case OptimizerKind::kAdam:
    case OptimizerKind::kFtrl:
      return 2;
  }
  return 0;
}

void OptimizerOptions::InitSlots(int dim, float* slots) const {
  const int n = NumSlots() * dim;
  std::fill(slots, slots + n, 0.0f);
  if (kind == OptimizerKind::kAdagrad || kind == OptimizerKind::kFtrl) {
    // Adagrad: accumulator; Ftrl: accumulator then linear (zeros).
    std::fill(slots, slots + dim, static_cast<float>(initial_accumulator_value));
  }
}

OptimizerKind ParseOptimizerKind(const std::string& name) {
  if (name == "sgd") return OptimizerKind::kSgd;
  if (name == "adagrad") return OptimizerKind::kAdagrad;
  if (name == "adam") return OptimizerKind::kAdam;
  if (name == "ftrl") return OptimizerKind::kFtrl;
  EE_CHECK(false, "unknown optimizer kind '" << name << "'");
}

StepScalars MakeStepScalars(const OptimizerOptions& opts, float learning_rate, int64_t step) {
  EE_CHECK(step >= 1, "step must be >= 1, got " << step);
  StepScalars s{learning_rate, step};
  if (opts.kind == OptimizerKind::kAdam) {
    // Same float32 arithmetic as keras.optimizers.Adam.
    const float t = static_cast<float>(step);
    const float beta_1_power = std::pow(static_cast<float>(opts.beta_1), t);
    const float beta_2_power = std::pow(static_cast<float>(opts.beta_2), t);
    s.adam_alpha = learning_rate * std::sqrt(1.0f - beta_2_power) / (1.0f - beta_1_power);
  }
  return s;
}

void ApplyUpdate(const OptimizerOptions& opts, const StepScalars& s, int dim,
                 const float* __restrict grad, float* __restrict value, float* __restrict slots) {
  // Python-float expressions are evaluated in double and rounded once to
  // float32, as happens when Keras combines them with float32 tensors.
  const float lr = s.learning_rate;
  switch (opts.kind) {
    case OptimizerKind::kSgd: {
      if (opts.momentum == 0.0) {
        for (int j = 0; j < dim; ++j) value[j] -= grad[j] * lr;
        break;
      }
      float* m = slots;
      const float mu = static_cast<float>(opts.momentum);
      for (int j = 0; j < dim; ++j) {
        m[j] = m[j] * mu - grad[j] * lr;
        value[j] += opts.nesterov ? m[j] * mu - grad[j] * lr : m[j];
      }
      break;
    }
    case OptimizerKind::kAdagrad: {
      float* acc = slots;
      const float eps = static_cast<float>(opts.epsilon);
      for (int j = 0; j < dim; ++j) {
        acc[j] += grad[j] * grad[j];
        value[j] -= (lr * grad[j]) / std::sqrt(acc[j] + eps);
      }
      break;
    }
    case OptimizerKind::kAdam: {
      float* m = slots;
      float* v = slots + dim;
      const float one_minus_b1 = static_cast<float>(1.0 - opts.beta_1);
      const float one_minus_b2 = static_cast<float>(1.0 - opts.beta_2);
      const float eps = static_cast<float>(opts.epsilon);
      for (int j = 0; j < dim; ++j) {
        m[j] += (grad[j] - m[j]) * one_minus_b1;
        v[j] += (grad[j] * grad[j] - v[j]) * one_minus_b2;
        value[j] -= (m[j] * s.adam_alpha) / (std::sqrt(v[j]) + eps);
      }
      break;
    }
    case OptimizerKind::kFtrl: {
      float* accum = slots;
      float* linear = slots + dim;
      const float p = static_cast<float>(-opts.learning_rate_power);
      const float l1 = static_cast<float>(opts.l1_regularization_strength);
      const float l2 = static_cast<float>(opts.l2_regularization_strength) +
                       static_cast<float>(opts.beta) / (2.0f * lr);
      const float shrink = static_cast<float>(2.0 * opts.l2_shrinkage_regularization_strength);
      for (int j = 0; j < dim; ++j) {
        const float g = grad[j];
        const float grad_to_use = g + shrink * value[j];
        const float new_accum = accum[j] + g * g;
        const float new_pow = std::pow(new_accum, p);
        linear[j] += grad_to_use - (new_pow - std::pow(accum[j], p)) / lr * value[j];
        const float quadratic = new_pow / lr + 2.0f * l2;
        const float clipped = std::min(std::max(linear[j], -l1), l1);
        value[j] = (clipped - linear[j]) / quadratic;
        accum[j] = new_accum;
      }
      break;
    }
  }
}

}  // namespace elastic_emb
