// Counter-based random numbers (Philox4x32-10): value i of a stream depends only on
// (seed, stream, i), so any rank can generate any slice of a tensor's initial values and
// the result does not depend on the layout, the thread count or the order of calls.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "core/tensor.h"

namespace dstrain {

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);
uint64_t stream_id(std::string_view name);  // FNV-1a of a name, e.g. a parameter's HF name

// Standard normal number i of stream `stream` under `seed`.
double philox_normal(uint64_t seed, uint64_t stream, uint64_t i);
// Uniform in [0, 1) with 53 random bits.
double philox_uniform(uint64_t seed, uint64_t stream, uint64_t i);

// Fills x (fp32) with normal(0, std) numbers first_index, first_index+1, ... of the stream.
void fill_normal(Tensor x, double std, uint64_t seed, uint64_t stream, uint64_t first_index = 0);

}  // namespace dstrain
