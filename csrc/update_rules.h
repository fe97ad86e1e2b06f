// The per-element update formulas of the sparse optimizers, shared by the
// CPU core (optimizer.cc) and the CUDA kernels (device_kernels.cu), so both
// compute the same float32 arithmetic by construction.
#pragma once

#include <cmath>
#include <cstdint>

#include "optimizer.h"

#ifdef __CUDACC__
#define EE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define EE_HOST_DEVICE inline
#endif

namespace elastic_emb {

// The float32 constants of one push: everything an element update needs.
struct UpdateRule {
  OptimizerKind kind = OptimizerKind::kSgd;
  int num_slots = 0;  // slot vectors per row (OptimizerOptions::NumSlots)
  bool momentum = false;
  bool nesterov = false;
  float lr = 0.0f;
  float mu = 0.0f;             // SGD, RMSprop momentum
  float eps = 0.0f;            // Adagrad, Adam, RMSprop
  float one_minus_b1 = 0.0f;   // Adam
  float one_minus_b2 = 0.0f;   // Adam
  float adam_alpha = 0.0f;     // Adam: lr * sqrt(1 - beta_2^t) / (1 - beta_1^t)
  float power = 0.0f;          // Ftrl: -learning_rate_power
  float l1 = 0.0f;             // Ftrl
  float l2 = 0.0f;             // Ftrl: l2 + beta / (2 lr)
  float shrink = 0.0f;         // Ftrl: 2 * l2_shrinkage
  float rho = 0.0f;            // RMSprop
  float one_minus_rho = 0.0f;  // RMSprop
  bool centered = false;       // RMSprop
};

// Host only: the rule of a push with these options and scalars.
UpdateRule MakeUpdateRule(const OptimizerOptions& opts, const StepScalars& s);

// Updates element j of a row. value: the row's value (dim,); slots: the
// row's slots (NumSlots() * dim,), slot k of element j at slots[k * dim + j].
EE_HOST_DEVICE void UpdateElement(const UpdateRule& r, int dim, int j, float g, float* value,
                                  float* slots) {
  switch (r.kind) {
    case OptimizerKind::kSgd: {
      if (!r.momentum) {
        value[j] -= g * r.lr;
        return;
      }
      float& m = slots[j];
      m = m * r.mu - g * r.lr;
      value[j] += r.nesterov ? m * r.mu - g * r.lr : m;
      return;
    }
    case OptimizerKind::kAdagrad: {
      float& acc = slots[j];
      acc += g * g;
      value[j] -= (r.lr * g) / sqrtf(acc + r.eps);
      return;
    }
    case OptimizerKind::kAdam: {
      float& m = slots[j];
      float& v = slots[dim + j];
      m += (g - m) * r.one_minus_b1;
      v += (g * g - v) * r.one_minus_b2;
      value[j] -= (m * r.adam_alpha) / (sqrtf(v) + r.eps);
      return;
    }
    case OptimizerKind::kFtrl: {
      float& accum = slots[j];
      float& linear = slots[dim + j];
      const float grad_to_use = g + r.shrink * value[j];
      const float new_accum = accum + g * g;
      const float new_pow = powf(new_accum, r.power);
      linear += grad_to_use - (new_pow - powf(accum, r.power)) / r.lr * value[j];
      const float quadratic = new_pow / r.lr + 2.0f * r.l2;
      const float clipped = fminf(fmaxf(linear, -r.l1), r.l1);
      value[j] = (clipped - linear) / quadratic;
      accum = new_accum;
      return;
    }
    case OptimizerKind::kRmsprop: {
      float& velocity = slots[j];
      velocity = r.rho * velocity + r.one_minus_rho * (g * g);
      float denominator = velocity + r.eps;
      if (r.centered) {
        float& average = slots[(r.momentum ? 2 : 1) * dim + j];
        average = r.rho * average + r.one_minus_rho * g;
        denominator = velocity - average * average + r.eps;
      }
      const float increment = (r.lr * g) / sqrtf(denominator);
      if (!r.momentum) {
        value[j] -= increment;
        return;
      }
      float& m = slots[dim + j];
      m = r.mu * m + increment;
      value[j] -= m;
      return;
    }
  }
}

}  // namespace elastic_emb
