#include "backend/cuda/cuda_ops.h"

namespace dstrain::cuda {

void fill_linear(ops::OpTable&) {}

}  // namespace dstrain::cuda
