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
  // Before halving the micro-batch, turn on full activation recomputation (when it is off): the
  // results stay bitwise the same, at about a third more compute.
  bool oom_recompute = true;
  FaultInjection fault;

  static ResilienceConfig from_json(const JsonReader& r);
  json to_json() const;
};

// Stop signals: SIGUSR1 and SIGTERM (Slurm's warning before the time limit, scancel) ask a run
// to stop at the next step boundary after a checkpoint.
//
// A signal handler runs on whichever thread the kernel picks, on that thread's stack, in the
// middle of whatever it computes. oneDNN 2.6's JIT sgemm does not survive being interrupted
// (wrong products, then a corrupted heap: tests/unit/test_stop_signals.cpp), so the stop
// signals are blocked in every thread and taken by one thread of their own (sigwait), which
// interrupts nothing.
//
// block_stop_signals() blocks them in the calling thread, and so in every thread it starts
// afterwards: main() calls it first, before MPI, OpenMP or any library starts a thread.
void block_stop_signals();
// Starts the thread that takes the stop signals (once per process; later calls change the
// mode). kRequestStop: a signal sets the flag below, which the trainer polls. kTerminate: a
// signal ends the process as it would without dstrain (eval, generate). Threads that existed
// before block_stop_signals() (a test's MPI threads) get a handler that does the same.
enum class StopSignalMode { kTerminate, kRequestStop };
void listen_for_stop_signals(StopSignalMode mode);
// Ends that thread (before exit; a no-op when it never started).
void stop_listening_for_stop_signals();
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
