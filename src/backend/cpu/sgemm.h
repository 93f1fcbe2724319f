// The fp32 matrix product of the CPU backend: every linear layer's forward, input gradient and
// weight gradient, the attention kernels' per-block products, and the fp32 products of the 16-bit
// GEMMs' widening path go through sgemm().
//
// Two libraries can serve it, both Debian packages, chosen once per process:
// - oneDNN's sgemm (libdnnl, the default): JIT AVX2 / AVX-512 kernels. It splits each product
//   statically over dstrain's OpenMP threads and writes a beta = 0 result directly; inside a
//   parallel region (the attention's tasks) it runs on the calling thread.
// - OpenBLAS's cblas_sgemm: its level-3 threading makes the threads wait on each other's packed
//   panels (sched_yield), and with beta = 0 it first clears C in a separate pass.
// On the d=256 benchmark model (validation/bench_vs_torch.py) with 2 threads, oneDNN trained
// about 6% faster in the linear layers and 6% more in the attention; validation/gemm_ceiling
// prints both libraries per shape. DSTRAIN_CPU_SGEMM=openblas (or onednn) in the environment
// overrides the choice.
//
// Both are deterministic for a given thread count: the same inputs give the same bits.
#pragma once

#include <cstdint>
#include <string>

namespace dstrain::cpu {

// Row-major C (m,n) = alpha · op(A) (m,k) · op(B) (k,n) + beta · C, where op(A) = A^T when ta
// (A stored (k,m), leading dimension lda), likewise B. beta = 0 never reads C (NaN there is
// overwritten); k = 0 scales C by beta.
void sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

enum class SgemmLibrary { kOneDnn, kOpenBlas };
// The library a DSTRAIN_CPU_SGEMM value names: null, "" or "onednn" is oneDNN, "openblas"
// OpenBLAS; anything else is an error that names the variable and the values it takes.
SgemmLibrary parse_sgemm_library(const char* value);
// The library in use: DSTRAIN_CPU_SGEMM's, read at the first call.
SgemmLibrary sgemm_library();
// Forces a library (tests and validation); the environment is not consulted after it.
void set_sgemm_library(SgemmLibrary library);
// "oneDNN 2.6.3 sgemm" or "OpenBLAS 0.3.21 sgemm": for the log and the benchmarks.
std::string sgemm_library_name();

}  // namespace dstrain::cpu
