// backend/cuda_device.h in a CPU-only build (the default): no GPU, and why.
#include "backend/cuda_device.h"

#include "core/error.h"

namespace dstrain::cuda {

bool built() { return false; }
int device_count() { return 0; }
std::string unavailable_reason() {
  return "this build has no CUDA backend (configure with -DDSTRAIN_CUDA=ON and the CUDA toolkit at /usr/local/cuda)";
}
Device use_device(int index) { DS_FAIL("cannot use GPU {}: {}", index, unavailable_reason()); }
std::string describe(int) { return "no GPU: " + unavailable_reason(); }
void synchronize() {}
std::string pci_bus_id(int) { return ""; }
double bf16_peak_flops(int, std::string* source) {
  if (source) *source = "no GPU: " + unavailable_reason();
  return 0;
}

}  // namespace dstrain::cuda
