#include "optimizer.h"

#include <algorithm>
#include <cmath>

#include "check.h"
#include "update_rules.h"

namespace elastic_emb {

void OptimizerOptions::Validate() const {
  EE_CHECK(momentum >= 0.0 && momentum <= 1.0, "momentum must be in [0, 1], got " << momentum);
  EE_CHECK(beta_1 >= 0.0 && beta_1 < 1.0, "beta_1 must be in [0, 1), got " << beta_1);
  EE_CHECK(beta_2 >= 0.0 && beta_2 < 1.0, "beta_2 must be in [0, 1), got " << beta_2);
  EE_CHECK(epsilon >= 0.0, "epsilon must be >= 0, got " << epsilon);
  EE_CHECK(rho >= 0.0 && rho <= 1.0, "rho must be in [0, 1], got " << rho);
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
    case OptimizerKind::kRmsprop:  // velocity, then momentum, then the average gradient
      return 1 + (momentum != 0.0 ? 1 : 0) + (centered ? 1 : 0);
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

void CheckStep(int64_t step) {
  EE_CHECK(step >= 1 && step <= 0xFFFFFFFFll, "step must be in [1, 2^32), got " << step);
}

StepScalars MakeStepScalars(const OptimizerOptions& opts, float learning_rate, int64_t step) {
  CheckStep(step);
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

UpdateRule MakeUpdateRule(const OptimizerOptions& opts, const StepScalars& s) {
  // Python-float expressions are evaluated in double and rounded once to
  // float32, as happens when Keras combines them with float32 tensors.
  UpdateRule r;
  r.kind = opts.kind;
  r.num_slots = opts.NumSlots();
  r.momentum = opts.momentum != 0.0;
  r.nesterov = opts.nesterov;
  r.lr = s.learning_rate;
  r.mu = static_cast<float>(opts.momentum);
  r.eps = static_cast<float>(opts.epsilon);
  r.one_minus_b1 = static_cast<float>(1.0 - opts.beta_1);
  r.one_minus_b2 = static_cast<float>(1.0 - opts.beta_2);
  r.rho = static_cast<float>(opts.rho);
  r.one_minus_rho = static_cast<float>(1.0 - opts.rho);
  r.centered = opts.centered;
  r.adam_alpha = s.adam_alpha;
  r.power = static_cast<float>(-opts.learning_rate_power);
  r.l1 = static_cast<float>(opts.l1_regularization_strength);
  r.l2 = static_cast<float>(opts.l2_regularization_strength) +
         static_cast<float>(opts.beta) / (2.0f * r.lr);
  r.shrink = static_cast<float>(2.0 * opts.l2_shrinkage_regularization_strength);
  return r;
}

void ApplyUpdate(const UpdateRule& r, int dim, const float* __restrict grad,
                 float* __restrict value, float* __restrict slots) {
  for (int j = 0; j < dim; ++j) UpdateElement(r, dim, j, grad[j], value, slots);
}

}  // namespace elastic_emb
