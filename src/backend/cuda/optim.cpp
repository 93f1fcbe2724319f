#include "backend/cuda/cuda_ops.h"

namespace dstrain::cuda {

void fill_optim(ops::OpTable&) {}

}  // namespace dstrain::cuda
