#include "train/resilience.h"

#include <pthread.h>

#include <cmath>
#include <csignal>
#include <mutex>
#include <thread>

#include "core/error.h"

namespace dstrain {
namespace {
std::atomic<int> g_stop_signal{0};
std::atomic<StopSignalMode> g_mode{StopSignalMode::kTerminate};

// The fallback handler, for threads started before the signals were blocked.
extern "C" void on_stop_signal(int sig) { g_stop_signal.store(sig); }

sigset_t stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGUSR1);
  sigaddset(&set, SIGTERM);
  return set;
}

// The listening thread: created once, ended by stop_listening_for_stop_signals().
struct Listener {
  std::mutex mutex;
  std::thread thread;
  std::atomic<bool> stopping{false};
};
Listener& listener() {
  static Listener* l = new Listener;  // never destroyed: a detached exit must not join it
  return *l;
}

void listen_loop() {
  const sigset_t set = stop_signals();
  while (true) {
    int sig = 0;
    if (sigwait(&set, &sig) != 0) continue;
    if (listener().stopping.load()) return;
    if (g_mode.load() == StopSignalMode::kRequestStop) {
      g_stop_signal.store(sig);
      continue;
    }
    // What the signal would have done without dstrain: end the process, with the signal.
    std::signal(sig, SIG_DFL);
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, sig);
    pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
    pthread_kill(pthread_self(), sig);
  }
}
}  // namespace

void block_stop_signals() {
  const sigset_t set = stop_signals();
  DS_CHECK(pthread_sigmask(SIG_BLOCK, &set, nullptr) == 0, "cannot block SIGUSR1 and SIGTERM");
}

void listen_for_stop_signals(StopSignalMode mode) {
  g_mode.store(mode);
  struct sigaction sa {};
  sa.sa_handler = mode == StopSignalMode::kRequestStop ? on_stop_signal : SIG_DFL;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGUSR1, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  block_stop_signals();
  Listener& l = listener();
  std::lock_guard lock(l.mutex);
  if (!l.thread.joinable()) {
    l.stopping.store(false);
    l.thread = std::thread(listen_loop);
  }
}

void stop_listening_for_stop_signals() {
  Listener& l = listener();
  std::lock_guard lock(l.mutex);
  if (!l.thread.joinable()) return;
  l.stopping.store(true);
  // Wakes its sigwait; the signal is taken there and means nothing else.
  pthread_kill(l.thread.native_handle(), SIGUSR1);
  l.thread.join();
}

int stop_signal_received() { return g_stop_signal.load(); }
void clear_stop_signal() { g_stop_signal.store(0); }

ResilienceConfig ResilienceConfig::from_json(const JsonReader& r) {
  ResilienceConfig c;
  c.collective_timeout_s = r.get<double>("collective_timeout_s", c.collective_timeout_s);
  c.max_skipped_steps = r.get<int64_t>("max_skipped_steps", c.max_skipped_steps);
  c.spike_window = r.get<int64_t>("spike_window", c.spike_window);
  c.spike_zscore = r.get<double>("spike_zscore", c.spike_zscore);
  c.activation_budget_mb = r.get<double>("activation_budget_mb", c.activation_budget_mb);
  c.oom_fallback = r.get<bool>("oom_fallback", c.oom_fallback);
  c.oom_recompute = r.get<bool>("oom_recompute", c.oom_recompute);
  if (c.collective_timeout_s <= 0) r.error("collective_timeout_s", "must be positive (seconds)");
  if (c.max_skipped_steps < 1) r.error("max_skipped_steps", "must be >= 1");
  if (c.spike_window < 0 || c.spike_window == 1) r.error("spike_window", "must be 0 (off) or at least 2");
  if (c.spike_zscore <= 0) r.error("spike_zscore", "must be positive");
  if (c.activation_budget_mb < 0) r.error("activation_budget_mb", "must be >= 0 (0: no budget)");
  if (r.has("fault")) {
    JsonReader f = r.child("fault");
    c.fault.rank = f.get<int64_t>("rank", -1);
    c.fault.kill_at_step = f.get<int64_t>("kill_at_step", -1);
    c.fault.hang_at_step = f.get<int64_t>("hang_at_step", -1);
    c.fault.nan_at_step = f.get<int64_t>("nan_at_step", -1);
    c.fault.oom_at_step = f.get<int64_t>("oom_at_step", -1);
    f.done();
  }
  r.done();
  return c;
}

json ResilienceConfig::to_json() const {
  json j = {{"collective_timeout_s", collective_timeout_s}, {"max_skipped_steps", max_skipped_steps},
            {"spike_window", spike_window},                 {"spike_zscore", spike_zscore},
            {"activation_budget_mb", activation_budget_mb}, {"oom_fallback", oom_fallback},
            {"oom_recompute", oom_recompute}};
  if (fault.any()) {
    j["fault"] = {{"rank", fault.rank},
                  {"kill_at_step", fault.kill_at_step},
                  {"hang_at_step", fault.hang_at_step},
                  {"nan_at_step", fault.nan_at_step},
                  {"oom_at_step", fault.oom_at_step}};
  }
  return j;
}

bool SpikeDetector::is_spike(double loss) const {
  if (window_ < 2 || int64_t(losses_.size()) < window_) return false;
  double mean = 0, var = 0;
  for (double l : losses_) mean += l;
  mean /= double(losses_.size());
  for (double l : losses_) var += (l - mean) * (l - mean);
  const double sd = std::sqrt(var / double(losses_.size() - 1));
  return sd > 0 && (loss - mean) / sd > z_;
}

void SpikeDetector::accept(double loss) {
  if (window_ < 2) return;
  losses_.push_back(loss);
  if (int64_t(losses_.size()) > window_) losses_.pop_front();
}

}  // namespace dstrain
