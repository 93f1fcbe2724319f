// Seeded initial values of parameters, from the Philox streams of core/philox.h: value i of a
// tensor depends only on (seed, stream, i), whatever the layout or thread count.
#pragma once

#include <cstdint>

#include "core/philox.h"
#include "core/tensor.h"

namespace dstrain {

// Fills x (fp32) with normal(0, std) numbers first_index, first_index+1, ... of the stream.
void fill_normal(Tensor x, double std, uint64_t seed, uint64_t stream, uint64_t first_index = 0);

}  // namespace dstrain
