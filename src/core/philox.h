// Counter-based random numbers (Philox4x32-10): value i of a stream depends only on
// (seed, stream, i), so any rank can generate any slice of a tensor's initial values, or of a
// data order, and the result does not depend on the layout, the thread count or the order of
// calls. Shared by model initialisation, data shuffling and sampling.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace dstrain {

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);
uint64_t stream_id(std::string_view name);  // FNV-1a of a name, e.g. a parameter's HF name

// Standard normal number i of stream `stream` under `seed`.
double philox_normal(uint64_t seed, uint64_t stream, uint64_t i);
// Uniform in [0, 1) with 53 random bits.
double philox_uniform(uint64_t seed, uint64_t stream, uint64_t i);

}  // namespace dstrain
