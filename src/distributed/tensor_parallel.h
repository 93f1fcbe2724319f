// What tensor parallelism adds to a step outside the model: the gradients that are partial sums
// over the tensor group, summed once per step before the data-parallel reduction, and the
// gradient norm of a model whose pieces are spread over the group.
//
// Partial gradients (Megatron-Core's "sequence-parallel" and duplicated parameters) come in two
// kinds:
//   - replicated parameters marked ParamInfo::tp_partial_grad (MLA's down-projections and latent
//     norms; with sequence parallelism every replicated parameter): all-reduced over the group;
//   - key/value pieces replicated on several ranks (fewer key/value heads than tensor ranks):
//     summed over the ranks holding the same piece.
// With gradient accumulation the sum happens at the last micro-step only: the accumulated
// partial sums add up to the step's gradient. Gradients reported ready before that micro-step's
// backward (in a forward) are summed by finish().
#pragma once

#include <algorithm>

#include "comm/comm.h"
#include "model/ctx.h"
#include "state/params.h"

namespace dstrain {

class TensorParallelGradSync final : public ParamHooks {
 public:
  // tp null or of one rank: nothing to do (needed() is false).
  TensorParallelGradSync(ParamRegistry& params, Communicator* tp);
  bool needed() const { return !partial_.empty(); }
  // Call before each micro-step's backward; `communicates` is true for the last one.
  void begin_micro_step(bool communicates) {
    if (every_micro_step_) {
      std::fill(summed_.begin(), summed_.end(), 0);
      return;
    }
    communicates_ = communicates;
  }
  // ZeRO stages 2 and 3 reduce-scatter every micro-step's gradients and hand the whole ones
  // back: the partial sums must be summed over the tensor group in every micro-step too, as
  // each is reported (in the forward or the backward), before the data-parallel hooks see it.
  void sum_every_micro_step() {
    every_micro_step_ = true;
    communicates_ = true;
  }
  // At the communicating micro-step: sums the partial gradients among first..last over the group
  // (blocking), before the hooks after this one (the data-parallel buckets) see them.
  void grad_ready(int first, int last) override;
  // After the step's backward: sums what the last micro-step did not report (gradients made
  // final in a forward, as the multi-token-prediction modules' are), in id order.
  void finish();
  // Seconds spent in these sums since the last call.
  double take_seconds();
  // Parameters whose gradients this sums (ids).
  const std::vector<int>& partial() const { return partial_; }

 private:
  void sum(int id);
  ParamRegistry& params_;
  Communicator* tp_;
  std::vector<int> partial_;
  std::vector<char> is_partial_;
  std::vector<char> summed_;  // this step's sums done (at the communicating micro-step)
  Buffer staging_;  // a replicated key/value piece among the zeros of its whole tensor
  bool communicates_ = false;
  bool every_micro_step_ = false;
  double seconds_ = 0;
};

// Whether this rank is the one that counts a parameter held by several tensor ranks (the
// lowest tensor rank holding that piece): for norms and for writing it once.
bool counts_piece(const ParamInfo& p, int tp_rank, int tp_size);

}  // namespace dstrain
