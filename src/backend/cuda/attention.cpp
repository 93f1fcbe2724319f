#include "backend/cuda/cuda_ops.h"

namespace dstrain::cuda {

void fill_attention(ops::OpTable&) {}

}  // namespace dstrain::cuda
