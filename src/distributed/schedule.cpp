#include "distributed/schedule.h"

#include <algorithm>
#include <set>

#include <fmt/format.h>

#include "core/error.h"

namespace dstrain {
namespace {

using Kind = ScheduleAction::Kind;

ScheduleAction F(int mb) { return {Kind::Forward, mb}; }
ScheduleAction B(int mb) { return {Kind::Backward, mb}; }

void check_args(int stage, int n_stages, int n_micro) {
  DS_CHECK(n_stages >= 1 && stage >= 0 && stage < n_stages && n_micro >= 1,
           "schedule: stage {} of {} with {} micro-batches is not a valid step", stage, n_stages, n_micro);
}

bool is_backward_input(Kind k) { return k == Kind::Backward || k == Kind::BackwardInput; }
bool is_backward_weight(Kind k) { return k == Kind::Backward || k == Kind::BackwardWeight; }

}  // namespace

std::string to_string(const ScheduleAction& a) {
  const char* k = a.kind == Kind::Forward ? "F" : a.kind == Kind::Backward ? "B" : a.kind == Kind::BackwardInput ? "BI" : "BW";
  return fmt::format("{}{}", k, a.micro_batch);
}

std::vector<ScheduleAction> GradAccumulationSchedule::actions(int stage, int n_stages, int n_micro) const {
  check_args(stage, n_stages, n_micro);
  DS_CHECK(n_stages == 1, "the gradient-accumulation schedule runs one stage; with {} pipeline stages use 1f1b",
           n_stages);
  std::vector<ScheduleAction> out;
  for (int m = 0; m < n_micro; ++m) {
    out.push_back(F(m));
    out.push_back(B(m));
  }
  return out;
}

std::vector<ScheduleAction> AllForwardAllBackwardSchedule::actions(int stage, int n_stages, int n_micro) const {
  check_args(stage, n_stages, n_micro);
  std::vector<ScheduleAction> out;
  for (int m = 0; m < n_micro; ++m) out.push_back(F(m));
  for (int m = 0; m < n_micro; ++m) out.push_back(B(m));
  return out;
}

std::vector<ScheduleAction> OneFOneBSchedule::actions(int stage, int n_stages, int n_micro) const {
  check_args(stage, n_stages, n_micro);
  const int warmup = std::min(n_stages - stage - 1, n_micro);
  std::vector<ScheduleAction> out;
  int f = 0, b = 0;
  for (; f < warmup; ++f) out.push_back(F(f));
  while (f < n_micro) {
    out.push_back(F(f++));
    out.push_back(B(b++));
  }
  while (b < n_micro) out.push_back(B(b++));
  return out;
}

std::unique_ptr<Schedule> make_schedule(const std::string& name) {
  if (name == "grad_accumulation") return std::make_unique<GradAccumulationSchedule>();
  if (name == "all_forward_all_backward") return std::make_unique<AllForwardAllBackwardSchedule>();
  if (name == "1f1b") return std::make_unique<OneFOneBSchedule>();
  DS_FAIL("unknown pipeline schedule '{}': use grad_accumulation, all_forward_all_backward or 1f1b", name);
}

int peak_in_flight(const std::vector<ScheduleAction>& actions) {
  std::set<int> live;
  size_t peak = 0;
  for (const ScheduleAction& a : actions) {
    if (a.kind == Kind::Forward) live.insert(a.micro_batch);
    if (is_backward_input(a.kind)) live.erase(a.micro_batch);
    peak = std::max(peak, live.size());
  }
  return int(peak);
}

std::string validate_schedule(const std::vector<std::vector<ScheduleAction>>& per_stage, int n_micro) {
  const int S = int(per_stage.size());
  if (S == 0) return "no stages";
  // Per stage: each micro-batch forwarded once, then its input and weight gradients once each.
  for (int s = 0; s < S; ++s) {
    std::vector<int> fwd(size_t(n_micro), 0), bin(size_t(n_micro), 0), bw(size_t(n_micro), 0);
    for (const ScheduleAction& a : per_stage[size_t(s)]) {
      const int m = a.micro_batch;
      if (m < 0 || m >= n_micro) return fmt::format("stage {}: {} is outside the {} micro-batches", s, to_string(a), n_micro);
      if (a.kind == Kind::Forward) {
        if (fwd[size_t(m)]++) return fmt::format("stage {}: {} runs twice", s, to_string(a));
        continue;
      }
      if (!fwd[size_t(m)]) return fmt::format("stage {}: {} before its forward", s, to_string(a));
      if (is_backward_input(a.kind) && bin[size_t(m)]++) return fmt::format("stage {}: {} repeats an input gradient", s, to_string(a));
      if (a.kind == Kind::BackwardWeight && !bin[size_t(m)])
        return fmt::format("stage {}: {} before the input-gradient part", s, to_string(a));
      if (is_backward_weight(a.kind) && bw[size_t(m)]++) return fmt::format("stage {}: {} repeats a weight gradient", s, to_string(a));
    }
    for (int m = 0; m < n_micro; ++m) {
      if (!fwd[size_t(m)] || !bin[size_t(m)] || !bw[size_t(m)])
        return fmt::format("stage {}: micro-batch {} does not run its forward and whole backward", s, m);
    }
  }
  // Simulate: a forward waits for the previous stage's forward of that micro-batch, an input
  // gradient for the next stage's input gradient. Round-robin until nothing can move.
  std::vector<size_t> pc(size_t(S), 0);
  std::vector<std::set<int>> fwd_done{size_t(S)}, bin_done{size_t(S)};
  bool moved = true;
  while (moved) {
    moved = false;
    for (int s = 0; s < S; ++s) {
      while (pc[size_t(s)] < per_stage[size_t(s)].size()) {
        const ScheduleAction& a = per_stage[size_t(s)][pc[size_t(s)]];
        if (a.kind == Kind::Forward && s > 0 && !fwd_done[size_t(s - 1)].count(a.micro_batch)) break;
        if (is_backward_input(a.kind) && s + 1 < S && !bin_done[size_t(s + 1)].count(a.micro_batch)) break;
        if (a.kind == Kind::Forward) fwd_done[size_t(s)].insert(a.micro_batch);
        if (is_backward_input(a.kind)) bin_done[size_t(s)].insert(a.micro_batch);
        ++pc[size_t(s)];
        moved = true;
      }
    }
  }
  for (int s = 0; s < S; ++s) {
    if (pc[size_t(s)] < per_stage[size_t(s)].size())
      return fmt::format("deadlock: stage {} waits at {} (action {} of {})", s,
                         to_string(per_stage[size_t(s)][pc[size_t(s)]]), pc[size_t(s)] + 1, per_stage[size_t(s)].size());
  }
  return "";
}

}  // namespace dstrain
