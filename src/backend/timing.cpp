#include "backend/timing.h"

#include "backend/backend.h"
#include "core/error.h"

namespace dstrain {

int HostMarkClock::mark() {
  marks_.push_back(Clock::now());
  return int(marks_.size()) - 1;
}

double HostMarkClock::seconds(int from, int to) {
  DS_CHECK(0 <= from && from <= to && size_t(to) < marks_.size(), "timing marks {} to {} of a round of {}", from, to,
           marks_.size());
  return std::chrono::duration<double>(marks_[size_t(to)] - marks_[size_t(from)]).count();
}

std::unique_ptr<MarkClock> make_mark_clock(Device device) {
  const Backend* b = find_backend(device.type);
  if (b && b->make_mark_clock) return b->make_mark_clock(device);
  return std::make_unique<HostMarkClock>();
}

}  // namespace dstrain
