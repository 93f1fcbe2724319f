#include "comm/comm.h"

#include <algorithm>

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

std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine) {
  const int n = comm.size();
  int64_t len = int64_t(mine.size());
  std::vector<int64_t> lens(static_cast<size_t>(n));
  comm.all_gather(Tensor(lens.data(), DType::I64, Shape{n}), Tensor(&len, DType::I64, Shape{1}));
  const int64_t width = std::max<int64_t>(1, *std::max_element(lens.begin(), lens.end()));
  std::vector<uint8_t> padded(static_cast<size_t>(width), 0), all(static_cast<size_t>(width * n));
  std::copy(mine.begin(), mine.end(), padded.begin());
  comm.all_gather(Tensor(all.data(), DType::U8, Shape{width * n}), Tensor(padded.data(), DType::U8, Shape{width}));
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r) {
    const auto* p = reinterpret_cast<const char*>(all.data() + r * width);
    out.emplace_back(p, size_t(lens[size_t(r)]));
  }
  return out;
}

}  // namespace dstrain
