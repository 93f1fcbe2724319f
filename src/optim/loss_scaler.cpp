#include "optim/loss_scaler.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/log.h"

namespace dstrain {

LossScaler::LossScaler(const LossScalerConfig& config, bool enabled) : config_(config), enabled_(enabled) {
  if (!enabled_) return;
  DS_CHECK(config_.hysteresis >= 1 && config_.loss_scale_window >= 1 && config_.min_loss_scale > 0,
           "fp16 loss scaler: hysteresis {} and loss_scale_window {} must be >= 1, min_loss_scale {} positive",
           config_.hysteresis, config_.loss_scale_window, config_.min_loss_scale);
  scale_ = config_.dynamic() ? std::ldexp(1.0, int(config_.initial_scale_power)) : config_.loss_scale;
  cur_hysteresis_ = config_.hysteresis;
}

// DeepSpeed's DynamicLossScaler.update_scale, step for step: the scale drops when an overflow
// finds the hysteresis at 1; otherwise the overflow uses one unit of it. A clean step whose
// distance to the last overflow is a positive multiple of the window doubles the scale and
// refills the hysteresis (or every clean step refills it, with consecutive_hysteresis).
LossScaler::Change LossScaler::update(bool overflow, int64_t step) {
  if (!enabled_) return Change::None;
  Change change = Change::None;
  if (overflow) {
    ++overflows_;
    if (config_.dynamic()) {
      if (config_.hysteresis == 1 || cur_hysteresis_ == 1) {
        if (scale_ == config_.min_loss_scale) {
          throw Error(fmt::format(
              "step {}: the fp16 gradients overflowed (NaN or Inf) with the loss scale already at "
              "train.fp16.min_loss_scale = {} and no hysteresis left: the scale cannot go lower, and training would "
              "skip every step from here. The values overflow in the forward pass or the model has diverged: resume "
              "from the last checkpoint with a lower learning rate or stronger gradient clipping, lower "
              "train.fp16.min_loss_scale, or train in bf16 (train.bf16.enabled) whose range is fp32's",
              step, config_.min_loss_scale));
        }
        scale_ = std::max(scale_ / 2.0, config_.min_loss_scale);
        change = Change::Lowered;
      } else {
        --cur_hysteresis_;
        change = Change::HysteresisUsed;
      }
      last_overflow_iter_ = cur_iter_;
    }
  } else if (config_.dynamic()) {
    if (config_.consecutive_hysteresis) cur_hysteresis_ = config_.hysteresis;
    const int64_t stable = cur_iter_ - last_overflow_iter_ - 1;
    if (stable > 0 && stable % config_.loss_scale_window == 0) {
      if (!config_.consecutive_hysteresis) cur_hysteresis_ = config_.hysteresis;
      scale_ *= 2.0;
      change = Change::Raised;
    }
  }
  ++cur_iter_;
  return change;
}

json LossScaler::state() const {
  return {{"enabled", enabled_},
          {"dynamic", dynamic()},
          {"scale", scale_},
          {"cur_iter", cur_iter_},
          {"last_overflow_iter", last_overflow_iter_},
          {"cur_hysteresis", cur_hysteresis_},
          {"overflows", overflows_}};
}

void LossScaler::load_state(const json& s, const std::string& source) {
  auto need = [&](const char* key) -> const json& {
    DS_CHECK(s.is_object() && s.contains(key) && s.at(key).is_number(),
             "{}: the loss scaler state has no number '{}': the file is damaged; resume from another checkpoint",
             source, key);
    return s.at(key);
  };
  const double scale = need("scale").get<double>();
  const int64_t cur_iter = need("cur_iter").get<int64_t>(), last = need("last_overflow_iter").get<int64_t>();
  const int64_t hyst = need("cur_hysteresis").get<int64_t>(), overflows = need("overflows").get<int64_t>();
  DS_CHECK(std::isfinite(scale) && scale > 0 && cur_iter >= 0 && last >= -1 && last < cur_iter &&
               hyst >= 1 && overflows >= 0 && overflows <= cur_iter,
           "{}: the loss scaler state {} is inconsistent (scale > 0, -1 <= last_overflow_iter < cur_iter, "
           "cur_hysteresis >= 1, overflows <= cur_iter); resume from another checkpoint",
           source, s.dump());
  overflows_ = overflows;
  cur_iter_ = cur_iter;
  if (!dynamic()) return;  // a static scale is the configuration's
  scale_ = std::max(scale, config_.min_loss_scale);
  last_overflow_iter_ = last;
  // The configured hysteresis may have been lowered since.
  cur_hysteresis_ = std::min(hyst, config_.hysteresis);
}

}  // namespace dstrain
