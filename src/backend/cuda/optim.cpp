// The optimizer op of the CUDA backend: adamw_update's per-step constants as the CPU kernel has
// them (backend/cpu/elementwise.cpp), then one launch of optim.cu (arguments checked by the ops::
// wrapper, backend/checks.cpp).
#include <cmath>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/optim_kernels.h"
#include "core/error.h"

namespace dstrain::cuda {
namespace {

// Serves every kernel slot: param, grad and the moments are normally fp32 (master state), the
// copy F32, BF16 or F16; 16-bit state is read as fp32 and rounded once when stored, as the CPU's
// widening kernel does.
void adamw_update(Tensor param, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq, Tensor param_copy,
                  const ops::AdamWStep& s) {
  const int64_t n = param.numel();
  AdamWConstants k;
  k.decay = 1.0f - s.lr * s.weight_decay;
  const double bc1 = 1.0 - std::pow(double(s.beta1), double(s.step));
  const double bc2 = 1.0 - std::pow(double(s.beta2), double(s.step));
  k.step_size = float(double(s.lr) / bc1);
  k.bc2_sqrt = float(std::sqrt(bc2));
  k.beta1 = s.beta1;
  k.beta2 = s.beta2;
  k.eps = s.eps;
  k.grad_scale = s.grad_scale;
  const bool copy = param_copy.defined();
  launch_adamw(param.raw(), elem_of(param, "adamw_update: param"), grad.raw(), elem_of(grad, "adamw_update: grad"),
               exp_avg.raw(), elem_of(exp_avg, "adamw_update: exp_avg"), exp_avg_sq.raw(),
               elem_of(exp_avg_sq, "adamw_update: exp_avg_sq"), copy ? param_copy.raw() : nullptr,
               copy ? elem_of(param_copy, "adamw_update: param_copy") : Elem::F32, n, k);
}

}  // namespace

void fill_optim(ops::OpTable& t) {
  for (KernelDType k : {KernelDType::F32, KernelDType::BF16, KernelDType::F16}) t.adamw_update[size_t(k)] = &adamw_update;
}

}  // namespace dstrain::cuda
