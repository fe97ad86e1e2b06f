// Sparse optimizers applied to one embedding row at a time. The formulas and
// defaults are those of Keras 3 (keras.optimizers.*), applied only to the
// rows a push touches ("lazy" semantics for momentum and Adam).
#pragma once

#include <cstdint>
#include <string>

namespace elastic_emb {

enum class OptimizerKind { kSgd, kAdagrad, kAdam, kFtrl };

struct OptimizerOptions {
  OptimizerKind kind = OptimizerKind::kSgd;
  // SGD.
  float momentum = 0.0f;
  bool nesterov = false;
  // Adam.
  float beta_1 = 0.9f;
  float beta_2 = 0.999f;
  // Adagrad and Adam.
  float epsilon = 1e-7f;
  // Adagrad and Ftrl.
  float initial_accumulator_value = 0.1f;
  // Ftrl.
  float learning_rate_power = -0.5f;
  float l1_regularization_strength = 0.0f;
  float l2_regularization_strength = 0.0f;
  float l2_shrinkage_regularization_strength = 0.0f;
  float beta = 0.0f;

  void Validate() const;
  // Number of slot vectors (each `dim` floats) stored beside a row's value.
  int NumSlots() const;
  // Writes the initial slot values. slots: (NumSlots() * dim,) host memory.
  void InitSlots(int dim, float* slots) const;
};

OptimizerKind ParseOptimizerKind(const std::string& name);

// Per-push scalars shared by every row of one push.
struct StepScalars {
  float learning_rate;
  int64_t step;  // 1-based optimizer iteration this push belongs to
  // Adam: lr * sqrt(1 - beta_2^step) / (1 - beta_1^step).
  float adam_alpha = 0.0f;
};

StepScalars MakeStepScalars(const OptimizerOptions& opts, float learning_rate, int64_t step);

// Applies one update. value: (dim,), slots: (NumSlots() * dim,), grad: (dim,),
// all host memory. Not synchronized: the caller owns the row.
void ApplyUpdate(const OptimizerOptions& opts, const StepScalars& s, int dim, const float* grad,
                 float* value, float* slots);

}  // namespace elastic_emb
