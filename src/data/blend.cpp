#include "data/blend.h"

#include <numeric>

#include "core/error.h"

namespace dstrain {

Blender::Blender(int num_datasets, std::vector<BlendPhase> phases)
    : n_(num_datasets), phases_(std::move(phases)), drawn_(size_t(num_datasets), 0), phase_start_(size_t(num_datasets), 0) {
  DS_CHECK(n_ >= 1, "blending needs at least one dataset");
  if (phases_.empty()) phases_.push_back({0, std::vector<double>(size_t(n_), 1.0)});
  DS_CHECK(phases_[0].from_step == 0, "the first blend phase must start at step 0, not {}", phases_[0].from_step);
  for (size_t p = 0; p < phases_.size(); ++p) {
    auto& w = phases_[p].weights;
    DS_CHECK(int(w.size()) == n_, "blend phase from step {} has {} weights for {} datasets", phases_[p].from_step,
             w.size(), n_);
    DS_CHECK(p == 0 || phases_[p].from_step > phases_[p - 1].from_step, "blend phases must be in increasing steps");
    double sum = 0;
    for (double x : w) {
      DS_CHECK(x >= 0, "blend weights must be >= 0, got {}", x);
      sum += x;
    }
    DS_CHECK(sum > 0, "blend phase from step {} has only zero weights", phases_[p].from_step);
    for (double& x : w) x /= sum;
  }
}

const std::vector<double>& Blender::weights_at(int64_t step) const {
  size_t p = 0;
  while (p + 1 < phases_.size() && phases_[p + 1].from_step <= step) ++p;
  return phases_[p].weights;
}

std::vector<Blender::Assignment> Blender::next_batch(int64_t step, int64_t G) {
  DS_CHECK(step == steps_done_, "blending: step {} requested after {} steps", step, steps_done_);
  while (phase_ + 1 < int(phases_.size()) && phases_[size_t(phase_) + 1].from_step <= step) {
    ++phase_;
    phase_start_ = drawn_;
  }
  const std::vector<double>& w = phases_[size_t(phase_)].weights;
  int64_t in_phase = 0;
  for (int d = 0; d < n_; ++d) in_phase += drawn_[size_t(d)] - phase_start_[size_t(d)];
  std::vector<Assignment> out(static_cast<size_t>(G));
  for (int64_t i = 0; i < G; ++i) {
    // The dataset furthest below its share of the phase so far (ties: the lower index).
    int best = 0;
    double best_err = -1e300;
    for (int d = 0; d < n_; ++d) {
      const double err = w[size_t(d)] * double(in_phase + 1) - double(drawn_[size_t(d)] - phase_start_[size_t(d)]);
      if (err > best_err) {
        best_err = err;
        best = d;
      }
    }
    out[size_t(i)] = {best, drawn_[size_t(best)]++};
    ++in_phase;
  }
  ++steps_done_;
  return out;
}

json Blender::state() const {
  return {{"steps_done", steps_done_}, {"phase", phase_}, {"drawn", drawn_}, {"phase_start", phase_start_}};
}

void Blender::restore(const json& s) {
  const auto drawn = s.at("drawn").get<std::vector<int64_t>>();
  DS_CHECK(int(drawn.size()) == n_, "the checkpoint blended {} datasets, this run has {}", drawn.size(), n_);
  steps_done_ = s.at("steps_done").get<int64_t>();
  phase_ = s.at("phase").get<int>();
  DS_CHECK(phase_ >= 0 && phase_ < int(phases_.size()), "the checkpoint's blend phase {} does not exist here",
           phase_);
  drawn_ = drawn;
  phase_start_ = s.at("phase_start").get<std::vector<int64_t>>();
}

}  // namespace dstrain
