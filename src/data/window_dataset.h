// Training windows over token shards, the order they are visited in, and the batches they
// fill. Window i of a shard covers its tokens [i*T, i*T + T]: inputs are the first T of
// those T+1 tokens, targets the last T.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/token_shard.h"

namespace dstrain {

// Expands each pattern with glob(3); each pattern's matches are sorted, patterns keep their
// order. A pattern that matches nothing is an error naming it.
std::vector<std::string> expand_globs(const std::vector<std::string>& patterns);

class WindowDataset {
 public:
  // paths may be glob patterns ("data/fineweb_train_*.bin"). Windows never cross a shard
  // boundary and are numbered across shards in file order; zero windows in all is an error.
  WindowDataset(const std::vector<std::string>& paths, int64_t T, int64_t vocab_size);

  int64_t num_windows() const { return window_begin_.back(); }
  int64_t num_tokens() const { return num_tokens_; }  // all tokens of all shards
  int64_t T() const { return T_; }
  int64_t vocab_size() const { return vocab_size_; }
  const std::vector<TokenShard>& shards() const { return shards_; }

  // Window i into inputs (T) and targets (T). Every id is checked against vocab_size; a bad
  // one is an error naming the shard file and the token's offset in it.
  void read_window(int64_t i, int32_t* inputs, int32_t* targets) const;

 private:
  std::vector<TokenShard> shards_;
  std::vector<int64_t> window_begin_;  // (num_shards + 1): first global window of each shard, then the total
  int64_t num_tokens_ = 0;
  int64_t T_ = 0;
  int64_t vocab_size_ = 0;
};

// Maps global sample positions (0, 1, 2, ... across epochs) to windows. Shuffled orders are a
// pure function of (seed, epoch), so a resumed run or another rank sees the same order.
// Not safe to call from several threads at once: window_at caches the current epoch's order.
class WindowSampler {
 public:
  WindowSampler(int64_t num_windows, bool shuffle, uint64_t seed);

  int64_t window_at(int64_t position) const;
  int64_t epoch_of(int64_t position) const;
  int64_t num_windows() const { return num_windows_; }
  bool shuffle() const { return shuffle_; }
  uint64_t seed() const { return seed_; }

 private:
  int64_t num_windows_;
  bool shuffle_;
  uint64_t seed_;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> perm_;  // (num_windows) the order of cached_epoch_
};

// One batch of token ids.
struct Batch {
  int64_t B = 0, T = 0;
  std::vector<int32_t> inputs;   // (B, T)
  std::vector<int32_t> targets;  // (B, T) inputs shifted left by one token
};

// Row b of out is the window at sample position first_position + b; out is resized to (B, T).
void fill_batch(const WindowDataset& data, const WindowSampler& sampler, int64_t first_position, int64_t B, Batch& out);

}  // namespace dstrain
