// AdamW over the parameter registry's flat buffers: the moments mirror the parameter
// layout, so a shard of the optimizer state is a contiguous range of the same offsets.
#pragma once

#include <set>

#include "backend/ops.h"
#include "core/buffer.h"
#include "state/params.h"

namespace dstrain {

struct AdamWConfig {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  std::set<ParamKind> no_decay{ParamKind::Norm, ParamKind::Embedding};

  // The weight decay of parameter p: none for the kinds in no_decay.
  double weight_decay_of(const ParamInfo& p) const { return no_decay.count(p.kind) ? 0.0 : weight_decay; }
  // The update's hyper-parameters for 1-based step `step` (weight decay set per parameter);
  // AdamW and ZeRO's sharded optimizer both step with them.
  ops::AdamWStep step_params(int64_t step, double lr, double grad_scale) const;
};

class AdamW {
 public:
  AdamW(const AdamWConfig& config, ParamRegistry& params);

  // One update with learning rate `lr` from the gradients in the registry, each multiplied by
  // `grad_scale` as it is read (the clipping coefficient over the fp16 loss scale: the
  // gradients themselves are left as they are). The registry's compute copy of the weights,
  // when it has one, receives the updated weights in the same pass.
  void step(double lr, double grad_scale = 1.0);
  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t s) { step_ = s; }
  double weight_decay_of(const ParamInfo& p) const { return config_.weight_decay_of(p); }

  Buffer& exp_avg() { return exp_avg_; }
  Buffer& exp_avg_sq() { return exp_avg_sq_; }
  const AdamWConfig& config() const { return config_; }

 private:
  AdamWConfig config_;
  ParamRegistry& params_;
  Buffer exp_avg_, exp_avg_sq_;
  int64_t step_ = 0;
};

// One AdamW update of every trainable parameter's whole weights in `params` from its gradients,
// with moments in the registry's layout, hyper-parameters `s` (step_params) and each
// parameter's weight decay from `config`; the compute copy, when there is one, is written in
// the same pass. AdamW::step and the distributed optimizer's stage 0 both run it.
void adamw_update_whole(ParamRegistry& params, Buffer& exp_avg, Buffer& exp_avg_sq, ops::AdamWStep s,
                        const AdamWConfig& config);

// Global L2 norm of all gradients (in a fixed summation order).
double grad_norm(const ParamRegistry& params);
// torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6) when that is below 1, else 1.
// The trainer hands it to AdamW::step as (part of) grad_scale.
double clip_coefficient(double max_norm, double norm);
// Scales the gradients in place by clip_coefficient (a pass of its own; the trainer fuses the
// factor into AdamW instead). Returns the factor applied (1 when nothing was clipped).
double clip_grad_norm(ParamRegistry& params, double max_norm, double norm);

}  // namespace dstrain
