// Schedules: the order in which a pipeline stage runs the forwards and backwards of a step's
// micro-batches. The trainer asks the schedule what to run and runs it; a pipeline schedule
// replaces the inner loop, not the trainer (Megatron-Core's forward_backward_func, DualPipe's
// schedule tables). Backward may be split into its input-gradient part (which the previous
// stage waits for) and its weight-gradient part (which can fill a bubble), as zero-bubble
// schedules and DualPipe do.
#pragma once

#include <functional>
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
  int chunk = 0;  // which of this rank's model chunks runs it (0 with one chunk per rank)
  bool operator==(const ScheduleAction&) const = default;
};
// "F3", "B3", "BI3", "BW3" for chunk 0; "F3.1" for micro-batch 3 on chunk 1.
std::string to_string(const ScheduleAction& a);

class Schedule {
 public:
  virtual ~Schedule() = default;
  virtual std::string name() const = 0;
  // What rank `stage` of `n_stages` runs for one step of n_micro micro-batches, in order.
  virtual std::vector<ScheduleAction> actions(int stage, int n_stages, int n_micro) const = 0;
  // Model chunks per rank (virtual stages): the model is cut into n_ranks * chunks() stages.
  virtual int chunks() const { return 1; }
  // The global model stage that chunk `chunk` of rank `rank` holds.
  virtual int model_stage(int rank, int /*chunk*/, int /*n_ranks*/) const { return rank; }
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

// Megatron-Core's interleaved 1F1B (forward_backward_pipelining_with_interleaving): rank r holds
// model stages r, r+P, ..., r+(V-1)P. Micro-batches go in groups of P per chunk; rank r runs
// (P - r - 1) * 2 + (V - 1) * P warm-up forwards (all V*m when m == P), then one forward and one
// backward at a time, then the remaining backwards. n_micro must be a multiple of P. The
// pipeline bubble shrinks by V against 1F1B, for V times the point-to-point messages.
class InterleavedOneFOneBSchedule final : public Schedule {
 public:
  explicit InterleavedOneFOneBSchedule(int virtual_stages);
  std::string name() const override { return "interleaved"; }
  std::vector<ScheduleAction> actions(int stage, int n_stages, int n_micro) const override;
  int chunks() const override { return v_; }
  int model_stage(int rank, int chunk, int n_ranks) const override { return chunk * n_ranks + rank; }

 private:
  int v_;
};

// DeepSeek's DualPipeV (DualPipe cut in half, V-shaped): rank r holds model stages r (chunk 0,
// going down the ranks) and 2P-1-r (chunk 1, coming back up; rank 0 holds the last stage and
// computes the loss). Forward and backward chunks of the two directions are paired in the
// steady state (so one's communication can hide behind the other's compute), and backward is
// split into input and weight gradients with the weight parts filling the bubbles. The step
// structure follows deepseek-ai/DualPipe's dualpipev.py: warm-up forwards of chunk 0, forwards
// of both chunks, B1-W-F1, the F0 B1 F1 B0 steady state, then backwards with the weight parts
// deferred into the cool-down. n_micro must be at least 2P.
class DualPipeVSchedule final : public Schedule {
 public:
  std::string name() const override { return "dualpipev"; }
  std::vector<ScheduleAction> actions(int stage, int n_stages, int n_micro) const override;
  int chunks() const override { return 2; }
  int model_stage(int rank, int chunk, int n_ranks) const override {
    return chunk == 0 ? rank : 2 * n_ranks - 1 - rank;
  }
};

// "grad_accumulation", "all_forward_all_backward", "1f1b", "interleaved" (needs
// virtual_stages >= 2) or "dualpipev"; an unknown name is an error that lists these.
std::unique_ptr<Schedule> make_schedule(const std::string& name, int virtual_stages);
// The same with virtual_stages = 1 (so "interleaved" is an error that asks for them).
std::unique_ptr<Schedule> make_schedule(const std::string& name);

// [rank][chunk] -> the global model stage that chunk of that rank holds.
std::vector<std::vector<int>> stage_map(const Schedule& s, int n_ranks);
// The actions of every rank for one step.
std::vector<std::vector<ScheduleAction>> schedule_table(const Schedule& s, int n_ranks, int n_micro);

// Checks the actions of every rank of one step, with stage_of[rank][chunk] the model stage of
// each chunk (a permutation of 0..S-1): each rank runs each (chunk, micro-batch)'s forward once
// and its backward once (whole, or input then weight), a backward after its forward; and,
// simulating ranks that run their lists in order and wait for their dependencies (forward of
// model stage k after the forward of stage k-1 of that micro-batch, backward input of k after
// that of k+1, on whichever ranks hold them), the step completes. Returns an empty string or
// what is wrong.
std::string validate_schedule(const std::vector<std::vector<ScheduleAction>>& per_rank, int n_micro,
                              const std::vector<std::vector<int>>& stage_of);
// One chunk per rank: rank s holds model stage s.
std::string validate_schedule(const std::vector<std::vector<ScheduleAction>>& per_stage, int n_micro);

// Time units per action for bubble_fraction (communication is free).
struct ActionCosts {
  double forward = 1;
  double backward_input = 1;
  double backward_weight = 1;
  double backward = 2;  // whole backward: input and weight
};
// Simulates the step with these costs (each action starts when its rank is free and its
// dependency has finished) and returns the idle fraction: sum over ranks of (makespan - busy),
// over n_ranks * makespan. 1F1B with F=1, B=2 gives (P-1)/(m+P-1). The schedule must be valid.
double bubble_fraction(const std::vector<std::vector<ScheduleAction>>& per_rank,
                       const std::vector<std::vector<int>>& stage_of, const ActionCosts& costs = {});

// Simulates the step with each action's own seconds (seconds(rank, index in its list)) and
// `transfer` seconds between an action and the one it waits for on another rank (the
// point-to-point message), and returns when each rank finishes its list. The performance
// model's pipeline (plan/perf_model.h).
std::vector<double> simulate_step(const std::vector<std::vector<ScheduleAction>>& per_rank,
                                  const std::vector<std::vector<int>>& stage_of,
                                  const std::function<double(int rank, size_t index)>& seconds, double transfer);

// Most (chunk, micro-batch) pairs whose forward ran and whose backward (input part) has not,
// over the list.
int peak_in_flight(const std::vector<ScheduleAction>& actions);

}  // namespace dstrain
