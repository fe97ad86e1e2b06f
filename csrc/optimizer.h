// Sparse optimizers applied to one embedding row at a time. The formulas and
// defaults are those of Keras 3 (keras.optimizers.*), applied only to the
// rows a push touches ("lazy" semantics for momentum and Adam).
#pragma once

#include <cstdint>

namespace elastic_emb {

enum class OptimizerKind { kSgd, kAdagrad, kAdam, kFtrl, kRmsprop };

// Hyperparameters are doubles, as the Python floats Keras holds them in, so
// that values derived from them (1 - beta_1, ...) round to float32 like Keras.
struct OptimizerOptions {
  OptimizerKind kind = OptimizerKind::kSgd;
  // SGD and RMSprop.
  double momentum = 0.0;
  bool nesterov = false;
  // RMSprop.
  double rho = 0.9;
  bool centered = false;
  // Adam.
  double beta_1 = 0.9;
  double beta_2 = 0.999;
  // Adagrad, Adam and RMSprop.
  double epsilon = 1e-7;
  // Adagrad and Ftrl.
  double initial_accumulator_value = 0.1;
  // Ftrl.
  double learning_rate_power = -0.5;
  double l1_regularization_strength = 0.0;
  double l2_regularization_strength = 0.0;
  double l2_shrinkage_regularization_strength = 0.0;
  double beta = 0.0;

  void Validate() const;
  // Number of slot vectors (each `dim` floats) stored beside a row's value.
  int NumSlots() const;
  // Writes the initial slot values. slots: (NumSlots() * dim,) host memory.
  void InitSlots(int dim, float* slots) const;
};

// Per-push scalars shared by every row of one push.
struct StepScalars {
  float learning_rate;
  int64_t step;  // 1-based optimizer iteration this push belongs to
  // Adam: lr * sqrt(1 - beta_2^step) / (1 - beta_1^step).
  float adam_alpha = 0.0f;
};

// Throws InvalidArgument unless step is in [1, 2^32) (rows keep it as uint32).
void CheckStep(int64_t step);

// Checks step (CheckStep).
StepScalars MakeStepScalars(const OptimizerOptions& opts, float learning_rate, int64_t step);

struct UpdateRule;

// Applies one update (the rule from MakeUpdateRule, update_rules.h).
// value: (dim,), slots: (NumSlots() * dim,), grad: (dim,), all host memory,
// not overlapping. Not synchronized: the caller owns the row.
void ApplyUpdate(const UpdateRule& rule, int dim, const float* __restrict grad,
                 float* __restrict value, float* __restrict slots);

}  // namespace elastic_emb
