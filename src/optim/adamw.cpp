#include "optim/adamw.h"

#include <cmath>

#include "backend/ops.h"

namespace dstrain {

AdamW::AdamW(const AdamWConfig& config, ParamRegistry& params)
    : config_(config),
      params_(params),
      exp_avg_("optimizer.exp_avg", MemCategory::OptimizerState, DType::F32, params.values().numel(), params.device()),
      exp_avg_sq_("optimizer.exp_avg_sq", MemCategory::OptimizerState, DType::F32, params.values().numel(),
                  params.device()) {}

ops::AdamWStep AdamWConfig::step_params(int64_t step, double lr, double grad_scale) const {
  ops::AdamWStep s;
  s.lr = float(lr);
  s.beta1 = float(beta1);
  s.beta2 = float(beta2);
  s.eps = float(eps);
  s.step = step;
  s.grad_scale = float(grad_scale);
  return s;
}

void AdamW::step(double lr, double grad_scale) {
  adamw_update_whole(params_, exp_avg_, exp_avg_sq_, config_.step_params(++step_, lr, grad_scale), config_);
}

void adamw_update_whole(ParamRegistry& params, Buffer& exp_avg, Buffer& exp_avg_sq, ops::AdamWStep s,
                        const AdamWConfig& config) {
  for (const ParamInfo& p : params.all()) {
    if (!p.trainable) continue;  // updated by its own rule (routing biases)
    s.weight_decay = float(config.weight_decay_of(p));
    ops::adamw_update(params.values().tensor(p.offset, p.shape), params.grads().tensor(p.offset, p.shape),
                      exp_avg.tensor(p.offset, p.shape), exp_avg_sq.tensor(p.offset, p.shape),
                      params.has_compute_copy() ? params.compute_values().tensor(p.offset, p.shape) : Tensor(), s);
  }
}

double grad_norm(const ParamRegistry& params) { return std::sqrt(ops::read_sum_squares(params.grads().tensor())); }

double clip_coefficient(double max_norm, double norm) {
  const double coef = max_norm / (norm + 1e-6);
  return coef >= 1.0 ? 1.0 : coef;
}

double clip_grad_norm(ParamRegistry& params, double max_norm, double norm) {
  const double coef = clip_coefficient(max_norm, norm);
  if (coef >= 1.0) return 1.0;
  ops::scale_inplace(params.grads().tensor(), float(coef));
  return coef;
}

}  // namespace dstrain
