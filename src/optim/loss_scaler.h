// fp16 loss scaling with DeepSpeed's semantics (deepspeed/runtime/fp16/loss_scaler.py,
// DynamicLossScaler.update_scale, itself from Megatron-LM's fp16/loss_scaler.py).
//
// The loss is multiplied by scale() before the backward, so that small gradients survive
// fp16; the optimizer divides it out again. After each step the trainer reports whether any
// rank's gradients overflowed (a NaN or Inf): an overflowing step is skipped, and once
// `hysteresis` overflows have used up the tolerance the scale halves (never below
// min_loss_scale; overflowing again at the minimum is an error). Every `loss_scale_window`
// steps since the last overflow the scale doubles (and the tolerance is refilled). A static
// scale (fp16.loss_scale > 0) never changes; a disabled scaler (bf16, fp32) is 1.
#pragma once

#include <cstdint>
#include <string>

#include "core/json_reader.h"

namespace dstrain {

// DeepSpeed's "fp16" block, with its names and defaults.
struct LossScalerConfig {
  double loss_scale = 0;              // 0: dynamic; > 0: this static scale
  int64_t initial_scale_power = 16;   // dynamic: the first scale is 2^power
  int64_t loss_scale_window = 1000;   // clean steps after an overflow before the scale doubles
  int64_t hysteresis = 2;             // overflows it takes to halve the scale (DeepSpeed's delayed_shift)
  bool consecutive_hysteresis = false;  // refill the hysteresis at every clean step
  double min_loss_scale = 1;
  bool dynamic() const { return loss_scale == 0; }
};

class LossScaler {
 public:
  // `enabled` false (bf16, fp32): scale 1, no overflow ever changes it.
  LossScaler(const LossScalerConfig& config, bool enabled);

  bool enabled() const { return enabled_; }
  bool dynamic() const { return enabled_ && config_.dynamic(); }
  double scale() const { return scale_; }
  // Steps whose gradients overflowed (each one skipped), over the run.
  int64_t overflows() const { return overflows_; }
  int64_t hysteresis_left() const { return cur_hysteresis_; }

  // What update() did, for the log.
  enum class Change { None, Lowered, HysteresisUsed, Raised };
  // Records the outcome of one step (every step, skipped or not). An overflow at
  // min_loss_scale with no hysteresis left throws an Error that says what to do; `step`
  // names the step in it.
  Change update(bool overflow, int64_t step = 0);

  // The scaler's whole state (checkpoints); load_state checks it against the configuration.
  json state() const;
  void load_state(const json& state, const std::string& source);

 private:
  LossScalerConfig config_;
  bool enabled_;
  double scale_ = 1;
  int64_t cur_iter_ = 0;             // steps seen
  int64_t last_overflow_iter_ = -1;  // cur_iter_ of the last overflow
  int64_t cur_hysteresis_ = 1;
  int64_t overflows_ = 0;
};

}  // namespace dstrain
