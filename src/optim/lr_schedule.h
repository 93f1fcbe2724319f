// Learning-rate schedules with DeepSpeed's names and formulas (WarmupLR, WarmupDecayLR,
// WarmupCosineLR), plus a constant rate. The rate of optimizer step s (s = 0, 1, ...) is
// DeepSpeed's formula at last_batch_iteration = s.
#pragma once

#include <cstdint>
#include <string>

#include "core/json_reader.h"

namespace dstrain {

struct LrSchedule {
  enum class Type { Constant, WarmupLR, WarmupDecayLR, WarmupCosineLR };
  Type type = Type::Constant;
  std::string warmup_type = "log";  // "log" or "linear", DeepSpeed's default is log
  int64_t warmup_num_steps = 1000;
  int64_t total_num_steps = 0;
  // WarmupLR / WarmupDecayLR: absolute rates. warmup_max_lr defaults to the optimizer's lr.
  double warmup_min_lr = 0.0, warmup_max_lr = -1.0;
  // WarmupCosineLR: ratios of the optimizer's lr.
  double warmup_min_ratio = 0.0, cos_min_ratio = 1e-4;

  double lr_at(int64_t step, double base_lr) const;

  // Reads DeepSpeed's "scheduler" object {type, params}; absent means constant.
  static LrSchedule from_json(const JsonReader& scheduler);
  json to_json() const;
};

}  // namespace dstrain
