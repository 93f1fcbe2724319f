#include "optim/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"

namespace dstrain {
namespace {
const char* type_name(LrSchedule::Type t) {
  switch (t) {
    case LrSchedule::Type::Constant: return "constant";
    case LrSchedule::Type::WarmupLR: return "WarmupLR";
    case LrSchedule::Type::WarmupDecayLR: return "WarmupDecayLR";
    case LrSchedule::Type::WarmupCosineLR: return "WarmupCosineLR";
  }
  return "?";
}
}  // namespace

double LrSchedule::lr_at(int64_t step, double base_lr) const {
  if (type == Type::Constant) return base_lr;
  const double s = double(step);
  const double W = double(std::max<int64_t>(2, warmup_num_steps));
  const bool warming = s < W;
  const double warm = warmup_type == "log" ? std::log(s + 1) / std::log(W) : s / W;  // 0 -> 1 over warmup
  if (type == Type::WarmupCosineLR) {
    double ratio;
    if (warming) {
      ratio = warmup_min_ratio + warm * (1.0 - warmup_min_ratio);
    } else {
      const double progress = (s - W + 1) / (double(total_num_steps) - W);
      ratio = std::max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * (1 + std::cos(std::numbers::pi * progress)) / 2);
    }
    return base_lr * ratio;
  }
  const double max_lr = warmup_max_lr >= 0 ? warmup_max_lr : base_lr;
  double gamma = 1.0;
  if (warming) {
    gamma = warm;
  } else if (type == Type::WarmupDecayLR) {
    gamma = std::max(0.0, (double(total_num_steps) - s) / std::max(1.0, double(total_num_steps) - W));
  }
  return warmup_min_lr + (max_lr - warmup_min_lr) * gamma;
}

LrSchedule LrSchedule::from_json(const JsonReader& r) {
  LrSchedule s;
  const std::string type = r.get<std::string>("type");
  if (type == "WarmupLR") {
    s.type = Type::WarmupLR;
  } else if (type == "WarmupDecayLR") {
    s.type = Type::WarmupDecayLR;
  } else if (type == "WarmupCosineLR") {
    s.type = Type::WarmupCosineLR;
  } else if (type == "constant" || type == "Constant") {
    s.type = Type::Constant;
  } else {
    r.error("type", fmt::format("is \"{}\"; supported: WarmupLR, WarmupDecayLR, WarmupCosineLR, constant", type));
  }
  if (r.has("params")) {
    JsonReader p = r.child("params");
    if (s.type == Type::Constant) {
      p.done();
    } else {
      s.warmup_num_steps = p.get<int64_t>("warmup_num_steps", s.warmup_num_steps);
      s.warmup_type = p.get<std::string>("warmup_type", s.warmup_type);
      if (s.warmup_type != "log" && s.warmup_type != "linear") p.error("warmup_type", "must be \"log\" or \"linear\"");
      if (s.warmup_num_steps < 0) p.error("warmup_num_steps", "must be >= 0");
      if (s.type == Type::WarmupCosineLR) {
        s.total_num_steps = p.get<int64_t>("total_num_steps");
        s.warmup_min_ratio = p.get<double>("warmup_min_ratio", s.warmup_min_ratio);
        s.cos_min_ratio = p.get<double>("cos_min_ratio", s.cos_min_ratio);
      } else {
        s.warmup_min_lr = p.get<double>("warmup_min_lr", s.warmup_min_lr);
        s.warmup_max_lr = p.get<double>("warmup_max_lr", s.warmup_max_lr);
        if (s.type == Type::WarmupDecayLR) s.total_num_steps = p.get<int64_t>("total_num_steps");
      }
      if (s.type != Type::WarmupLR && s.total_num_steps <= std::max<int64_t>(2, s.warmup_num_steps)) {
        p.error("total_num_steps", fmt::format("must exceed the warmup ({} steps), got {}",
                                               std::max<int64_t>(2, s.warmup_num_steps), s.total_num_steps));
      }
      p.done();
    }
  } else if (s.type == Type::WarmupDecayLR || s.type == Type::WarmupCosineLR) {
    r.error("params", "is required: set at least total_num_steps");
  }
  r.done();
  return s;
}

json LrSchedule::to_json() const {
  json j;
  j["type"] = type_name(type);
  if (type == Type::Constant) return j;
  json p;
  p["warmup_num_steps"] = warmup_num_steps;
  p["warmup_type"] = warmup_type;
  if (type == Type::WarmupCosineLR) {
    p["total_num_steps"] = total_num_steps;
    p["warmup_min_ratio"] = warmup_min_ratio;
    p["cos_min_ratio"] = cos_min_ratio;
  } else {
    p["warmup_min_lr"] = warmup_min_lr;
    if (warmup_max_lr >= 0) p["warmup_max_lr"] = warmup_max_lr;
    if (type == Type::WarmupDecayLR) p["total_num_steps"] = total_num_steps;
  }
  j["params"] = p;
  return j;
}

}  // namespace dstrain
