#include "backend/cuda/cuda_ops.h"

namespace dstrain::cuda {

void fill_layers(ops::OpTable&) {}

}  // namespace dstrain::cuda
