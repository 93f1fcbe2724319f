#include "comm/comm.h"

namespace dstrain {

void Work::wait() {
  if (!state_) return;
  if (state_->wait_fn) {
    state_->wait_fn();  // idempotent
    return;
  }
  std::unique_lock lock(state_->mutex);
  state_->cv.wait(lock, [&] { return state_->done; });
  if (state_->error) std::rethrow_exception(state_->error);
}

bool Work::test() {
  if (!state_) return true;
  if (state_->test_fn) return state_->test_fn();
  std::lock_guard lock(state_->mutex);
  if (state_->done && state_->error) std::rethrow_exception(state_->error);
  return state_->done;
}

}  // namespace dstrain
