#include "data/llmc_dataset.h"

#include <fmt/format.h>

namespace dstrain {

LlmcDataset::LlmcDataset(const std::vector<std::string>& patterns, int64_t seq_len, int64_t vocab_size, bool shuffle,
                         uint64_t seed)
    : windows_(patterns, seq_len, vocab_size), sampler_(windows_.num_windows(), shuffle, seed), patterns_(patterns) {}

void LlmcDataset::read_sample(int64_t index, int32_t* out) const {
  int64_t window = 0;
  {
    std::lock_guard lock(mutex_);
    window = sampler_.window_at(index);
  }
  const int64_t T = windows_.T();
  // Window w covers T + 1 tokens: inputs [0, T) and targets [1, T + 1).
  std::vector<int32_t> targets(static_cast<size_t>(T));
  windows_.read_window(window, out, targets.data());
  out[T] = targets[size_t(T - 1)];
}

std::vector<std::string> LlmcDataset::files() const {
  std::vector<std::string> f;
  for (const TokenShard& s : windows_.shards()) f.push_back(s.path());
  return f;
}

std::string LlmcDataset::describe() const {
  std::string pats;
  for (const auto& p : patterns_) pats += (pats.empty() ? "" : ", ") + p;
  return fmt::format("llm.c shards {} ({} files, {} tokens): {} windows of {}{}", pats, windows_.shards().size(),
                     windows_.num_tokens(), windows_.num_windows(), windows_.T() + 1,
                     sampler_.shuffle() ? ", shuffled per epoch" : ", in order");
}

}  // namespace dstrain
