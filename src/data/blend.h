// Blending several datasets by weight, in a deterministic order that realises the weights as
// closely as possible at every prefix (Megatron's greedy rule: the next sample comes from the
// dataset furthest below its share). Weights may change at configured steps; each phase
// realises its own weights. The state (samples drawn per dataset) is all a resume needs, and
// it does not depend on the number of ranks: every rank assigns the whole global batch.
#pragma once

#include <cstdint>
#include <vector>

#include "core/json_reader.h"

namespace dstrain {

struct BlendPhase {
  int64_t from_step = 0;  // first optimizer step (0-based) of this phase
  std::vector<double> weights;
};

class Blender {
 public:
  // phases: sorted by from_step, the first from step 0; weights are normalised per phase.
  Blender(int num_datasets, std::vector<BlendPhase> phases);

  struct Assignment {
    int dataset = 0;
    int64_t index = 0;  // sample index within that dataset
  };
  // The datasets and indices of the global batch of optimizer step `step` (G samples), in
  // order. Steps must come in sequence (step == steps_done()).
  std::vector<Assignment> next_batch(int64_t step, int64_t G);

  int64_t steps_done() const { return steps_done_; }
  const std::vector<int64_t>& drawn() const { return drawn_; }  // samples drawn per dataset so far
  const std::vector<double>& weights_at(int64_t step) const;
  json state() const;
  void restore(const json& state);

 private:
  int n_;
  std::vector<BlendPhase> phases_;
  int64_t steps_done_ = 0;
  int phase_ = 0;
  std::vector<int64_t> drawn_;        // per dataset, all phases
  std::vector<int64_t> phase_start_;  // drawn_ when the current phase began
};

}  // namespace dstrain
