// Wall-clock timing for the step-time breakdowns: a monotonic clock and seconds since a point.
#pragma once

#include <chrono>

namespace dstrain {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace dstrain
