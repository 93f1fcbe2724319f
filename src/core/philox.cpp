#include "core/philox.h"

#include <cmath>
#include <numbers>

namespace dstrain {

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
  constexpr uint64_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = kM0 * c[0], p1 = kM1 * c[2];
    c = {uint32_t(p1 >> 32) ^ c[1] ^ k[0], uint32_t(p1), uint32_t(p0 >> 32) ^ c[3] ^ k[1], uint32_t(p0)};
    k[0] += kW0;
    k[1] += kW1;
  }
  return c;
}

uint64_t stream_id(std::string_view name) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : name) {
    h ^= ch;
    h *= 1099511628211ull;
  }
  return h;
}

namespace {
std::array<uint32_t, 4> block(uint64_t seed, uint64_t stream, uint64_t n) {
  return philox4x32({uint32_t(n), uint32_t(n >> 32), uint32_t(stream), uint32_t(stream >> 32)},
                    {uint32_t(seed), uint32_t(seed >> 32)});
}
double to_unit(uint32_t hi, uint32_t lo) {
  return double(((uint64_t(hi) << 32) | lo) >> 11) * 0x1.0p-53;
}
}  // namespace

double philox_uniform(uint64_t seed, uint64_t stream, uint64_t i) {
  auto r = block(seed, stream, i / 2);
  return i % 2 == 0 ? to_unit(r[0], r[1]) : to_unit(r[2], r[3]);
}

double philox_normal(uint64_t seed, uint64_t stream, uint64_t i) {
  // Box-Muller on one Philox block gives the pair (2n, 2n+1).
  auto r = block(seed, stream, i / 2);
  const double u1 = 1.0 - to_unit(r[0], r[1]);  // (0, 1]
  const double u2 = to_unit(r[2], r[3]);
  const double radius = std::sqrt(-2.0 * std::log(u1));
  const double angle = 2.0 * std::numbers::pi * u2;
  return i % 2 == 0 ? radius * std::cos(angle) : radius * std::sin(angle);
}

}  // namespace dstrain
