// Schedules: the order in which a pipeline stage runs the forwards and backwards of a step's
// micro-batches. The trainer asks the schedule what to run and runs it; a pipeline schedule
// replaces the inner loop, not the trainer (Megatron-Core's forward_backward_func, DualPipe's
// schedule tables). Backward may be split into its input-gradient part (which the previous
// stage waits for) and its weight-gradient part (which can fill a bubble), as zero-bubble
// schedules and DualPipe do.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace dstrain {

struct ScheduleAction {
  enum class Kind {
    Forward,         // the stage's forward of one micro-batch
    Backward,        // its whole backward (input and weight gradients)
    BackwardInput,   // only the input gradients; the weight gradients are queued
    BackwardWeight,  // the queued weight gradients of that micro-batch
  };
  Kind kind = Kind::Forward;
  int micro_batch = 0;
  bool operator==(const ScheduleAction&) const = default;
};
std::string to_string(const ScheduleAction& a);  // "F3", "B3", "BI3", "BW3"

class Schedule {
 public:
  virtual ~Schedule() = default;
  virtual std::string name() const = 0;
  // What stage `stage` of `n_stages` runs for one step of n_micro micro-batches, in order.
  virtual std::vector<ScheduleAction> actions(int stage, int n_stages, int n_micro) const = 0;
};

// One stage: each micro-batch's forward then its backward, F0 B0 F1 B1 ... (gradient
// accumulation; one micro-batch's activations in flight).
class GradAccumulationSchedule final : public Schedule {
 public:
  std::string name() const override { return "grad_accumulation"; }
  std::vector<ScheduleAction> actions(int stage, int n_stages, int n_micro) const override;
};

// GPipe: every forward, then every backward in the same order (all micro-batches in flight).
class AllForwardAllBackwardSchedule final : public Schedule {
 public:
  std::string name() const override { return "all_forward_all_backward"; }
  std::vector<ScheduleAction> actions(int stage, int n_stages, int n_micro) const override;
};

// PipeDream-Flush / Megatron-Core's non-interleaved 1F1B: stage s runs min(n_stages - s - 1,
// n_micro) warm-up forwards, then alternates one forward and one backward, then the remaining
// backwards; at most n_stages - s micro-batches in flight.
class OneFOneBSchedule final : public Schedule {
 public:
  std::string name() const override { return "1f1b"; }
  std::vector<ScheduleAction> actions(int stage, int n_stages, int n_micro) const override;
};

// "grad_accumulation", "all_forward_all_backward" or "1f1b"; an unknown name is an error that
// lists these.
std::unique_ptr<Schedule> make_schedule(const std::string& name);

// Checks the actions of every stage of one step: each stage runs each micro-batch's forward
// once and its backward once (whole, or input then weight), a backward after its forward; and,
// simulating stages that wait for their neighbours (forward of stage s after forward of s-1,
// backward input of s after that of s+1), the step completes. Returns an empty string or what
// is wrong.
std::string validate_schedule(const std::vector<std::vector<ScheduleAction>>& per_stage, int n_micro);
// Most micro-batches whose forward ran and whose backward (input part) has not, over the list.
int peak_in_flight(const std::vector<ScheduleAction>& actions);

}  // namespace dstrain
