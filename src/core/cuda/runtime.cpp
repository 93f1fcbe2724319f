#include "core/cuda/runtime.h"

#include <mutex>

#include "core/error.h"

namespace dstrain::cuda {

cudaStream_t stream() {
  // One per device this process uses (normally one: a rank per GPU).
  static std::mutex mutex;
  static cudaStream_t streams[64] = {};
  int dev = 0;
  DS_CUDA_CHECK(cudaGetDevice(&dev));
  DS_CHECK(dev >= 0 && dev < 64, "CUDA device index {} out of range", dev);
  std::lock_guard lock(mutex);
  if (!streams[dev]) DS_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[dev], cudaStreamNonBlocking));
  return streams[dev];
}

bool means_no_device(cudaError_t e) {
  return e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver || e == cudaErrorInitializationError ||
         e == cudaErrorStubLibrary || e == cudaErrorSystemDriverMismatch || e == cudaErrorCompatNotSupportedOnDevice;
}

void fail(cudaError_t e, const char* what, const char* file, int line) {
  throw Error(fmt::format("{} failed at {}:{}: {} ({})", what, file, line, cudaGetErrorName(e),
                          cudaGetErrorString(e)));
}

}  // namespace dstrain::cuda
