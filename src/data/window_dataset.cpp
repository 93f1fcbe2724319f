// Training windows over token shards, the shuffled visiting order, and batch filling.
#include "data/window_dataset.h"

#include <glob.h>

#include <algorithm>
#include <numeric>

#include "core/error.h"
#include "core/philox.h"

namespace dstrain {

std::vector<std::string> expand_globs(const std::vector<std::string>& patterns) {
  std::vector<std::string> files;
  for (const std::string& pattern : patterns) {
    glob_t g{};
    const int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
    std::vector<std::string> matches;
    if (rc == 0) matches.assign(g.gl_pathv, g.gl_pathv + g.gl_pathc);
    ::globfree(&g);
    DS_CHECK(rc != GLOB_NOMATCH, "no file matches \"{}\"; check the path, or run dstrain-prep to create the shards",
             pattern);
    DS_CHECK(rc == 0, "expanding \"{}\" failed ({}); check that its directories are readable", pattern,
             rc == GLOB_NOSPACE ? "out of memory" : "read error");
    // glob(3) sorts by the locale's collation; byte order keeps shard order the same everywhere.
    std::sort(matches.begin(), matches.end());
    files.insert(files.end(), matches.begin(), matches.end());
  }
  return files;
}

WindowDataset::WindowDataset(const std::vector<std::string>& paths, int64_t T, int64_t vocab_size)
    : T_(T), vocab_size_(vocab_size) {
  DS_CHECK(T > 0, "the sequence length T must be positive, got {}", T);
  DS_CHECK(vocab_size > 0, "the vocabulary size must be positive, got {}", vocab_size);
  const std::vector<std::string> files = expand_globs(paths);
  DS_CHECK(!files.empty(), "no token shards given; pass shard files or glob patterns");
  window_begin_.push_back(0);
  for (const std::string& f : files) {
    TokenShard& shard = shards_.emplace_back(f);
    // A window needs T+1 tokens; its last token is the first of the next window.
    const int64_t windows = shard.size() > 0 ? (shard.size() - 1) / T : 0;
    window_begin_.push_back(window_begin_.back() + windows);
    num_tokens_ += shard.size();
  }
  if (num_windows() == 0) {
    std::string names;
    for (const TokenShard& shard : shards_) names += fmt::format("\n  {} ({} tokens)", shard.path(), shard.size());
    DS_FAIL("no training windows: every shard has fewer than T+1 = {} tokens:{}\nuse a shorter sequence length "
            "or more data",
            T + 1, names);
  }
}

void WindowDataset::read_window(int64_t i, int32_t* inputs, int32_t* targets) const {
  DS_CHECK(i >= 0 && i < num_windows(), "window {} is outside the dataset ({} windows)", i, num_windows());
  // The shard s with window_begin_[s] <= i < window_begin_[s+1]; shards without windows are skipped.
  const auto it = std::upper_bound(window_begin_.begin(), window_begin_.end(), i);
  const size_t s = size_t(it - window_begin_.begin()) - 1;
  const TokenShard& shard = shards_[s];
  const int64_t first = (i - window_begin_[s]) * T_;

  shard.read(first, T_, inputs);
  std::copy(inputs + 1, inputs + T_, targets);
  shard.read(first + T_, 1, targets + T_ - 1);

  // Reads gave ids in [0, 2^31); one compare per token, the reporting path only on failure.
  const auto bad = [&](int32_t id) { return id >= vocab_size_; };
  int64_t bad_offset = -1;
  if (std::any_of(inputs, inputs + T_, bad) || bad(targets[T_ - 1])) {
    for (int64_t j = 0; j <= T_; ++j) {
      if (bad(j < T_ ? inputs[j] : targets[T_ - 1])) {
        bad_offset = first + j;
        break;
      }
    }
    DS_FAIL("token shard {}: token {} (byte offset {}) has id {}, outside the model's vocabulary of {}; check that "
            "the data was tokenized for this model's vocabulary",
            shard.path(), bad_offset, kShardHeaderBytes + bad_offset * shard.bytes_per_token(), shard.at(bad_offset),
            vocab_size_);
  }
}

WindowSampler::WindowSampler(int64_t num_windows, bool shuffle, uint64_t seed)
    : num_windows_(num_windows), shuffle_(shuffle), seed_(seed) {
  DS_CHECK(num_windows > 0, "a sampler needs at least one window, got {}", num_windows);
}

int64_t WindowSampler::epoch_of(int64_t position) const {
  DS_CHECK(position >= 0, "sample position {} is negative", position);
  return position / num_windows_;
}

int64_t WindowSampler::window_at(int64_t position) const {
  const int64_t epoch = epoch_of(position);
  const int64_t k = position % num_windows_;
  if (!shuffle_) return k;
  if (epoch != cached_epoch_) {
    // Fisher-Yates, swap choice j of step i drawn from number i of the epoch's stream.
    const uint64_t stream = stream_id("dstrain.shuffle") + uint64_t(epoch);
    perm_.resize(size_t(num_windows_));
    std::iota(perm_.begin(), perm_.end(), int64_t(0));
    for (int64_t i = num_windows_ - 1; i > 0; --i) {
      const double u = philox_uniform(seed_, stream, uint64_t(i));
      // u < 1, but u * (i+1) may round up to i+1 for huge i.
      const int64_t j = std::min(int64_t(u * double(i + 1)), i);
      std::swap(perm_[size_t(i)], perm_[size_t(j)]);
    }
    cached_epoch_ = epoch;
  }
  return perm_[size_t(k)];
}

void fill_batch(const WindowDataset& data, const WindowSampler& sampler, int64_t first_position, int64_t B, Batch& out) {
  DS_CHECK(B > 0, "the batch size must be positive, got {}", B);
  DS_CHECK(sampler.num_windows() == data.num_windows(),
           "the sampler was made for {} windows but the dataset has {}; build it from data.num_windows()",
           sampler.num_windows(), data.num_windows());
  const int64_t T = data.T();
  out.B = B;
  out.T = T;
  out.inputs.resize(size_t(B * T));
  out.targets.resize(size_t(B * T));
  for (int64_t b = 0; b < B; ++b) {
    data.read_window(sampler.window_at(first_position + b), out.inputs.data() + b * T, out.targets.data() + b * T);
  }
}

}  // namespace dstrain
