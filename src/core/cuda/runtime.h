// The CUDA runtime as dstrain's CUDA code sees it (CUDA builds only: -DDSTRAIN_CUDA=ON). A plain
// header: nvcc-compiled kernels (.cu) include it as well as the g++-compiled op wrappers, so it
// names nothing of dstrain beyond plain C++ types.
//
// Every kernel and transfer of a process runs on one compute stream (stream()), in issue order,
// as the ops of the CPU backend run in call order; the NCCL communicators order their own
// stream after it with events. Errors become dstrain errors naming the call, file and line.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dstrain::cuda {

// The stream every op of this process runs on (created on first use, on the current device).
cudaStream_t stream();

// Throws a dstrain error: "<what> failed at <file>:<line>: <CUDA's name and message>".
[[noreturn]] void fail(cudaError_t e, const char* what, const char* file, int line);

// Whether a CUDA error means "there is no GPU to use" (no driver, no device, driver too old).
bool means_no_device(cudaError_t e);

// Grid size for n elements with `threads` per block, capped at what a launch allows.
inline unsigned blocks_for(int64_t n, int threads) {
  int64_t b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  if (b > 2147483647) b = 2147483647;
  return unsigned(b);
}

// The element types of CUDA kernels (the kernel dtypes of backend/ops.def).
enum class Elem : int { F32 = 0, BF16 = 1, F16 = 2 };

}  // namespace dstrain::cuda

#define DS_CUDA_CHECK(call)                                                     \
  do {                                                                          \
    const cudaError_t ds_cuda_err_ = (call);                                    \
    if (ds_cuda_err_ != cudaSuccess) ::dstrain::cuda::fail(ds_cuda_err_, #call, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: reports a bad launch configuration at once (asynchronous faults
// surface at the next synchronising call).
#define DS_CUDA_LAUNCHED(what) DS_CUDA_CHECK(cudaGetLastError())
