#include "model/init.h"

#include "backend/ops.h"

namespace dstrain {

void fill_normal(Tensor x, double std, uint64_t seed, uint64_t stream, uint64_t first_index) {
  ops::fill_normal(x, std, seed, stream, first_index);
}

}  // namespace dstrain
