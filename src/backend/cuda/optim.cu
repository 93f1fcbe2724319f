// torch.optim.AdamW on the GPU: the CPU kernel's update (backend/cpu/elementwise.cpp, adamw_loop)
// element by element, with the same order of operations, in fp32.
#include "backend/cuda/elementwise_kernels.h"
#include "backend/cuda/optim_kernels.h"

namespace dstrain::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void adamw_kernel(void* param, Elem ep, const void* grad, Elem eg, void* exp_avg, Elem em,
                             void* exp_avg_sq, Elem ev, void* param_copy, Elem ec, int64_t n, AdamWConstants k) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float gi = ld(grad, eg, i) * k.grad_scale;
    float p = ld(param, ep, i) * k.decay;
    const float m = ld(exp_avg, em, i) * k.beta1 + gi * (1.0f - k.beta1);
    const float v = ld(exp_avg_sq, ev, i) * k.beta2 + gi * gi * (1.0f - k.beta2);
    const float denom = sqrtf(v) / k.bc2_sqrt + k.eps;
    p -= k.step_size * (m / denom);
    st(exp_avg, em, i, m);
    st(exp_avg_sq, ev, i, v);
    st(param, ep, i, p);
    if (param_copy) st(param_copy, ec, i, p);
  }
}

}  // namespace

void launch_adamw(void* param, Elem ep, const void* grad, Elem eg, void* exp_avg, Elem em, void* exp_avg_sq, Elem ev,
                  void* param_copy, Elem ec, int64_t n, const AdamWConstants& k) {
  if (n <= 0) return;
  adamw_kernel<<<grid_for(n, kThreads), kThreads, 0, stream()>>>(param, ep, grad, eg, exp_avg, em, exp_avg_sq, ev,
                                                                  param_copy, ec, n, k);
  DS_CUDA_LAUNCHED("adamw_kernel");
}

}  // namespace dstrain::cuda
