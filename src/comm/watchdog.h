// A deadline for every collective. Operations register while they run; a monitor thread
// ends the whole job when one has run past the deadline, naming the rank, the operation, its
// communicator and sequence number, and the time elapsed, instead of hanging forever (a
// crashed, hung or diverged rank leaves the others waiting in a collective).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

namespace dstrain {

// The exit status of a job the watchdog ended.
inline constexpr int kExitWatchdog = 76;

class Watchdog {
 public:
  // The process's watchdog. It does nothing until start() and must be stopped before MPI is
  // finalised (app mains do both explicitly).
  static Watchdog& instance();

  void start(double deadline_seconds);
  void stop();
  bool running() const { return thread_.joinable(); }
  double deadline() const { return deadline_; }

  // What happens at a missed deadline (default: the message on stderr, then MPI_Abort).
  void set_on_timeout(std::function<void(const std::string&)> f);

  // An operation that may take longer than a collective (checkpoint I/O) gives its own
  // deadline (0: the watchdog's); `explain`, called at a missed deadline, says what is
  // likely wrong (e.g. a full disk) in the terms of the operation.
  uint64_t begin(const std::string& comm, const std::string& op, uint64_t seq, double deadline_seconds = 0,
                 std::function<std::string()> explain = nullptr);
  void end(uint64_t token);

 private:
  Watchdog() = default;
  void loop();
  struct Entry {
    std::string comm, op;
    uint64_t seq;
    std::chrono::steady_clock::time_point started;
    double deadline;  // seconds; 0: the watchdog's
    std::function<std::string()> explain;
  };
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<uint64_t, Entry> inflight_;
  uint64_t next_ = 1;
  double deadline_ = 600;
  bool stopping_ = false;
  std::function<void(const std::string&)> on_timeout_;
  std::thread thread_;
};

// Registers an operation for the lifetime of the scope.
class WatchScope {
 public:
  WatchScope(const std::string& comm, const std::string& op, uint64_t seq, double deadline_seconds = 0,
             std::function<std::string()> explain = nullptr)
      : token_(Watchdog::instance().begin(comm, op, seq, deadline_seconds, std::move(explain))) {}
  ~WatchScope() { Watchdog::instance().end(token_); }
  WatchScope(const WatchScope&) = delete;
  WatchScope& operator=(const WatchScope&) = delete;

 private:
  uint64_t token_;
};

}  // namespace dstrain
