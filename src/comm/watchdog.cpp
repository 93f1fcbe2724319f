#include "comm/watchdog.h"

#include <mpi.h>

#include <cstdio>

#include "core/log.h"

namespace dstrain {

Watchdog& Watchdog::instance() {
  static Watchdog w;  // no work in its destructor: stop() is called explicitly
  return w;
}

void Watchdog::set_on_timeout(std::function<void(const std::string&)> f) {
  std::lock_guard lock(mutex_);
  on_timeout_ = std::move(f);
}

void Watchdog::start(double deadline_seconds) {
  stop();
  {
    std::lock_guard lock(mutex_);
    deadline_ = deadline_seconds;
    stopping_ = false;
  }
  thread_ = std::thread([this] { loop(); });
}

void Watchdog::stop() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

uint64_t Watchdog::begin(const std::string& comm, const std::string& op, uint64_t seq, double deadline_seconds,
                         std::function<std::string()> explain) {
  std::lock_guard lock(mutex_);
  const uint64_t t = next_++;
  inflight_[t] = Entry{comm, op, seq, std::chrono::steady_clock::now(), deadline_seconds, std::move(explain)};
  return t;
}

void Watchdog::end(uint64_t token) {
  std::lock_guard lock(mutex_);
  inflight_.erase(token);
}

void Watchdog::loop() {
  std::unique_lock lock(mutex_);
  const double period_s = std::min(5.0, std::max(0.05, deadline_ / 20));
  const auto period = std::chrono::duration<double>(period_s);
  while (!stopping_) {
    cv_.wait_for(lock, period, [&] { return stopping_; });
    if (stopping_) return;
    const auto now = std::chrono::steady_clock::now();
    for (const auto& [token, e] : inflight_) {
      const double elapsed = std::chrono::duration<double>(now - e.started).count();
      const double deadline = e.deadline > 0 ? e.deadline : deadline_;
      if (elapsed <= deadline) continue;
      const Entry late = e;
      lock.unlock();
      std::string msg = fmt::format(
          "watchdog: {} #{} on communicator '{}' has run for {:.1f} s, past its deadline of {:.0f} s. Another rank is "
          "not taking part (it crashed, hung or runs something else); ending the job (exit status {}). Raise "
          "resilience.collective_timeout_s if this operation is legitimately slow.",
          late.op, late.seq, late.comm, elapsed, deadline, kExitWatchdog);
      const std::string why = late.explain ? late.explain() : std::string();
      if (!why.empty()) msg = why + "\n" + msg;
      std::function<void(const std::string&)> handler;
      {
        std::lock_guard relock(mutex_);
        handler = on_timeout_;
      }
      if (handler) {
        handler(msg);
      } else {
        log::error_line(msg);
        // The other ranks in the same operation reach its deadline within a period or two:
        // they get to report too before the abort ends them.
        std::this_thread::sleep_for(std::chrono::duration<double>(std::min(10.0, 2 * period_s + 0.5)));
        MPI_Abort(MPI_COMM_WORLD, kExitWatchdog);
      }
      return;
    }
  }
}

}  // namespace dstrain
