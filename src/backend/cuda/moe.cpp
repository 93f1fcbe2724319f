#include "backend/cuda/cuda_ops.h"

namespace dstrain::cuda {

void fill_moe(ops::OpTable&) {}

}  // namespace dstrain::cuda
