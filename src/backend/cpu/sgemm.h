// The fp32 matrix product of the CPU backend: every linear layer's forward, input gradient and
// weight gradient, the attention kernels' per-block products, and the fp32 products of the 16-bit
// GEMMs' widening path go through sgemm().
//
// Three paths, over two Debian libraries, chosen once per process:
// - split (the default): dstrain splits C into one block of rows (of columns, when it has fewer
//   rows than columns) per OpenMP thread, and each thread multiplies its block alone: weight
//   gradients (A^T·B) with OpenBLAS's kernel, the other layouts with oneDNN's JIT kernel, each
//   the faster on one thread for its layout. The shared operand is packed once per thread,
//   which for the layers' shapes (2048 token rows, 256 to 1408 columns) costs well under 1% of
//   the product, and no thread waits on another until the end.
// - onednn: oneDNN's sgemm with its own threading (it writes beta = 0 results directly).
// - openblas: OpenBLAS's cblas_sgemm with its own threading: the threads wait on each other's
//   packed panels (sched_yield), and with beta = 0 it first clears C in a separate pass.
// On the d=256 benchmark model (validation/bench_vs_torch.py) with 2 threads, in alternating
// runs: onednn trains 8% faster than openblas, split 3-5% faster than onednn. Small products, and
// products called inside a parallel region (the attention's tasks, experts spread over threads),
// are not split: they run whole, with their layout's library (on the calling thread when inside).
// validation/gemm_ceiling prints the libraries per shape. DSTRAIN_CPU_SGEMM=split|onednn|openblas
// in the environment chooses.
//
// Every path is deterministic for a given thread count: the same inputs give the same bits.
// Across thread counts the bits may differ (each path blocks the product by thread).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace dstrain::cpu {

// Row-major C (m,n) = alpha · op(A) (m,k) · op(B) (k,n) + beta · C, where op(A) = A^T when ta
// (A stored (k,m), leading dimension lda), likewise B. beta = 0 never reads C (NaN there is
// overwritten); k = 0 scales C by beta.
void sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// How the split path (and the 16-bit GEMMs on bf16 hardware, gemm16.cpp) share a product C (m,n)
// of depth k among the OpenMP threads: block(lo, hi, by_rows) computes rows [lo, hi) of C, or
// its columns [lo, hi) when by_rows is false (C has fewer rows than columns), on the calling
// thread alone. One contiguous block per thread; a small product (m·n·k under 2^18, or under 32
// rows or columns a thread), and one called inside a parallel region, is one block [0, extent)
// on the calling thread. An exception thrown by a block is rethrown on the calling thread.
void split_product(int64_t m, int64_t n, int64_t k, const std::function<void(int64_t lo, int64_t hi, bool by_rows)>& block);

enum class SgemmPath { kSplit, kOneDnn, kOpenBlas };
// The path a DSTRAIN_CPU_SGEMM value names: null, "" or "split" is the split, "onednn" and
// "openblas" the libraries' own threading; anything else is an error that names the variable and
// the values it takes.
SgemmPath parse_sgemm_path(const char* value);
// The path in use: DSTRAIN_CPU_SGEMM's, read at the first call.
SgemmPath sgemm_path();
// Forces a path (tests and validation); the environment is not consulted after it.
void set_sgemm_path(SgemmPath path);
// For the log and the benchmarks: "dstrain's thread split over oneDNN 2.6.3 and OpenBLAS 0.3.21
// sgemm", "oneDNN 2.6.3 sgemm" or "OpenBLAS 0.3.21 sgemm".
std::string sgemm_path_name();

}  // namespace dstrain::cpu
