// Launch function of linear.cu: the plain GEMM that stands in where cuBLASLt offers no algorithm
// for a product (a plain header for nvcc and linear.cpp).
#pragma once

#include <cstdint>

#include "core/cuda/runtime.h"

namespace dstrain::cuda {

// Row-major C (m,n) = op(A) (m,k) · op(B) (k,n), or C += when accumulate, in fp32 with each
// element rounded once to ec; op(A) = A^T when ta (A stored (k,m)), likewise B (stored (n,k)
// when tb). One thread per element of C: correct for every shape, type and alignment, not fast.
void launch_gemm_fallback(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* a, Elem ea, const void* b,
                          Elem eb, void* c, Elem ec, bool accumulate);

}  // namespace dstrain::cuda
