// The plain GEMM kernel of linear_kernels.h (cuBLASLt runs every product it has an algorithm for).
#include "backend/cuda/elementwise_kernels.h"
#include "backend/cuda/linear_kernels.h"

namespace dstrain::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void gemm_fallback_kernel(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* a, Elem ea,
                                     const void* b, Elem eb, void* c, Elem ec, bool accumulate) {
  const int64_t total = m * n;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx / n, j = idx % n;
    float s = 0.0f;
    for (int64_t p = 0; p < k; ++p) {
      const float av = ld(a, ea, ta ? p * m + i : i * k + p);
      const float bv = ld(b, eb, tb ? j * k + p : p * n + j);
      s += av * bv;
    }
    st(c, ec, idx, accumulate ? s + ld(c, ec, idx) : s);
  }
}

}  // namespace

void launch_gemm_fallback(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* a, Elem ea, const void* b,
                          Elem eb, void* c, Elem ec, bool accumulate) {
  if (m <= 0 || n <= 0) return;
  gemm_fallback_kernel<<<grid_for(m * n, kThreads), kThreads, 0, stream()>>>(ta, tb, m, n, k, a, ea, b, eb, c, ec,
                                                                            accumulate);
  DS_CUDA_LAUNCHED("gemm_fallback_kernel");
}

}  // namespace dstrain::cuda
