// What dstrain does when things go wrong during a run: signals (stop at the next step
// boundary after a checkpoint), collective deadlines, non-finite or spiking losses, and
// micro-batches that do not fit memory. Also fault injection, so that all of it is tested.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <string>

#include "core/json_reader.h"

namespace dstrain {

// Exit statuses of dstrain train, for batch scripts.
inline constexpr int kExitStoppedForRequeue = 75;  // stopped on SIGUSR1/SIGTERM after a checkpoint

struct FaultInjection {
  int64_t rank = -1;         // the rank that misbehaves (-1: none)
  int64_t kill_at_step = -1;  // SIGKILL itself when this step begins
  int64_t hang_at_step = -1;  // stop taking part in collectives at this step
  int64_t nan_at_step = -1;   // this step's gradients become NaN
  int64_t oom_at_step = -1;   // this step's first micro-batch fails to allocate
  // Faults fire in a run that started from scratch only, so a restarted job gets through.
  bool any() const { return rank >= 0; }
};

struct ResilienceConfig {
  double collective_timeout_s = 600;  // deadline of every collective (the watchdog)
  int64_t max_skipped_steps = 5;      // consecutive skipped steps before the run stops with an error
  int64_t spike_window = 0;           // losses in the spike detector's window (0: off)
  double spike_zscore = 6.0;          // a loss this many standard deviations above the window is skipped
  double activation_budget_mb = 0;    // per rank; 0: no budget
  bool oom_fallback = true;           // halve the micro-batch (doubling accumulation) when it does not fit
  FaultInjection fault;

  static ResilienceConfig from_json(const JsonReader& r);
  json to_json() const;
};

// SIGUSR1 and SIGTERM set a flag the trainer polls at step boundaries.
void install_stop_signal_handlers();
int stop_signal_received();  // the signal number, or 0
void clear_stop_signal();

// Rolling z-score of accepted losses.
class SpikeDetector {
 public:
  SpikeDetector(int64_t window, double zscore) : window_(window), z_(zscore) {}
  // True when `loss` is a spike against the full window; accepted losses join the window.
  bool is_spike(double loss) const;
  void accept(double loss);

 private:
  int64_t window_;
  double z_;
  std::deque<double> losses_;
};

}  // namespace dstrain
