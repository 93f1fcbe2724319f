// Launch function of the AdamW kernel (optim.cu): a plain header for nvcc and the g++-compiled
// op wrapper (optim.cpp).
#pragma once

#include <cstdint>

#include "core/cuda/runtime.h"

namespace dstrain::cuda {

// The per-step constants of torch.optim.AdamW, computed on the host as the CPU kernel does.
struct AdamWConstants {
  float decay;      // 1 - lr * weight_decay
  float step_size;  // lr / (1 - beta1^step)
  float bc2_sqrt;   // sqrt(1 - beta2^step)
  float beta1, beta2, eps, grad_scale;
};

// One AdamW update of elements [0, n) of a flat range: param, grad, exp_avg, exp_avg_sq of the
// given Elem (fp32 master state normally); param_copy (null: none) receives the updated param
// rounded to ec. One launch, a grid-stride loop: one call over a whole flat buffer is one kernel.
void launch_adamw(void* param, Elem ep, const void* grad, Elem eg, void* exp_avg, Elem em, void* exp_avg_sq, Elem ev,
                  void* param_copy, Elem ec, int64_t n, const AdamWConstants& k);

}  // namespace dstrain::cuda
