#include "model/init.h"

namespace dstrain {

void fill_normal(Tensor x, double std, uint64_t seed, uint64_t stream, uint64_t first_index) {
  float* p = x.data<float>();
  const int64_t n = x.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) p[i] = float(std * philox_normal(seed, stream, first_index + uint64_t(i)));
}

}  // namespace dstrain
