// The finite-difference derivative every gradient check in the unit tests compares against.
#pragma once

#include <cstdint>
#include <functional>

namespace dstrain {

// d loss / d w[i] from central differences at steps h and h/2 combined by Richardson
// extrapolation, so that the O(h^2) truncation error of a single difference (large next to
// fp32 rounding where the loss curves sharply, as in attention) drops to O(h^4). Divides by
// the steps fp32 really took. w[i] is restored.
inline double richardson_fd(float* w, int64_t i, double h, const std::function<double()>& loss) {
  const float orig = w[i];
  auto central = [&](double step) {
    const float up = float(orig + step), down = float(orig - step);
    w[i] = up;
    const double lp = loss();
    w[i] = down;
    const double lm = loss();
    w[i] = orig;
    return (lp - lm) / (double(up) - double(down));
  };
  const double coarse = central(h), fine = central(h / 2);
  return (4 * fine - coarse) / 3;
}

}  // namespace dstrain
