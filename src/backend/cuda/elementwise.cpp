#include "backend/cuda/cuda_ops.h"

namespace dstrain::cuda {

void fill_elementwise(ops::OpTable&) {}

}  // namespace dstrain::cuda
