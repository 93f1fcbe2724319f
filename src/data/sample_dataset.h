// A source of fixed-length training samples. Sample i is seq_len + 1 consecutive tokens: the
// model's inputs are the first seq_len and its targets the last seq_len. Sample indices run
// across epochs (epoch = i / samples_per_epoch()); the order within an epoch, shuffled or
// not, depends only on the dataset's seed and the epoch, so every rank computes the same
// order with no shared cache file, and a global sample position says everything a resume
// needs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dstrain {

class SampleDataset {
 public:
  virtual ~SampleDataset() = default;
  virtual int64_t samples_per_epoch() const = 0;
  virtual int64_t seq_len() const = 0;
  // Reads sample `index` (>= 0) into out[0 .. seq_len] (seq_len + 1 ids). Token ids are
  // checked against the vocabulary: an id out of range is an error naming the file and offset.
  // Safe to call from several threads at once.
  virtual void read_sample(int64_t index, int32_t* out) const = 0;
  // Tokens one epoch covers.
  virtual int64_t num_tokens() const = 0;
  // The files this dataset reads (for the cross-rank checksum check at start).
  virtual std::vector<std::string> files() const = 0;
  // One line for logs: format, files, documents, samples.
  virtual std::string describe() const = 0;
};

}  // namespace dstrain
