// Loads and stores of the CUDA kernels' floating-point tensors, for .cu files only: element i
// of an F32, BF16 or F16 array as fp32, and the other way, rounded once to nearest even (the
// 16-bit slots' semantics, backend/ops.def). The branch is uniform across a launch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "core/cuda/runtime.h"

namespace dstrain::cuda {

__device__ __forceinline__ float ld(const void* p, Elem e, int64_t i) {
  switch (e) {
    case Elem::BF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case Elem::F16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ void st(void* p, Elem e, int64_t i, float v) {
  switch (e) {
    case Elem::BF16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); return;
    case Elem::F16: static_cast<__half*>(p)[i] = __float2half_rn(v); return;
    default: static_cast<float*>(p)[i] = v; return;
  }
}

}  // namespace dstrain::cuda
