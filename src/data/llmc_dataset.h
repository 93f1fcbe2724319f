// llm.c token shards as a SampleDataset: sample i of an epoch is window perm(i) of the
// shards (windows never cross a shard); the epoch's order is identity or a permutation that
// depends only on (seed, epoch).
#pragma once

#include <memory>
#include <mutex>

#include "data/sample_dataset.h"
#include "data/window_dataset.h"

namespace dstrain {

class LlmcDataset final : public SampleDataset {
 public:
  LlmcDataset(const std::vector<std::string>& patterns, int64_t seq_len, int64_t vocab_size, bool shuffle,
              uint64_t seed);

  int64_t samples_per_epoch() const override { return windows_.num_windows(); }
  int64_t seq_len() const override { return windows_.T(); }
  void read_sample(int64_t index, int32_t* out) const override;
  int64_t num_tokens() const override { return windows_.num_tokens(); }
  std::vector<std::string> files() const override;
  std::string describe() const override;

 private:
  WindowDataset windows_;
  mutable std::mutex mutex_;  // the sampler caches the current epoch's order
  WindowSampler sampler_;
  std::vector<std::string> patterns_;
};

}  // namespace dstrain
