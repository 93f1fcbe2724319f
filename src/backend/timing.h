// Timing marks: points in a device's queue of work, for timings that read the device's own time
// rather than the host's time to issue the work (the training step's forward / backward /
// optimizer split, model/ctx.h's PhaseTimer). On the host, and on devices whose ops run as they
// are called (the tests' emulated device), a mark is the host clock when it is taken; a GPU
// backend records an event on its stream instead (Backend::make_mark_clock), and reads the time
// between two events once the device has passed them, without a synchronisation per mark.
#pragma once

#include <memory>
#include <vector>

#include "core/clock.h"
#include "core/device.h"

namespace dstrain {

// A pool of marks used in rounds (a training step is one): mark() takes the round's next mark,
// seconds() reads the time between two of them, restart() starts a new round that reuses the
// pool, so a run holds as many marks as its busiest round needed.
class MarkClock {
 public:
  virtual ~MarkClock() = default;
  // Takes a mark where the device's queue of work is now; returns its number in the round (0, 1, ...).
  virtual int mark() = 0;
  // Seconds from mark `from` to mark `to` of this round (to taken after from). The first call
  // after a mark may wait until the device has reached the round's last mark: one wait per
  // round when every mark is taken before the first read.
  virtual double seconds(int from, int to) = 0;
  // A new round: the marks taken so far are given back to the pool.
  virtual void restart() = 0;
};

// The host clock's marks: times read when the mark is taken; seconds() never waits.
class HostMarkClock final : public MarkClock {
 public:
  int mark() override;
  double seconds(int from, int to) override;
  void restart() override { marks_.clear(); }

 private:
  std::vector<Clock::time_point> marks_;
};

// The mark clock of a device: its backend's (Backend::make_mark_clock), else the host clock.
std::unique_ptr<MarkClock> make_mark_clock(Device device);

}  // namespace dstrain
