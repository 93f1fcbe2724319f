// GPT-style training samples over a document range of a Megatron indexed dataset: documents
// are concatenated per epoch in a seeded order and cut into samples of T+1 tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "data/indexed_dataset.h"
#include "data/sample_dataset.h"

namespace dstrain {

// Contiguous document range [first, last) of split `which` for splits weighted by `weights`
// (e.g. {0.98, 0.02}: the first 98% of documents train, the rest validate). Megatron's
// arithmetic (get_split_indices): weights are normalised, boundaries are cumulative sums of
// round-half-to-even(weight * num_documents), then shifted so the last boundary is
// num_documents. Unlike Megatron, boundaries are clamped into [previous, num_documents], so a
// zero weight gives an empty range rather than a negative one.
std::pair<int64_t, int64_t> split_range(int64_t num_documents, const std::vector<double>& weights, int which);

// Sample k of an epoch covers tokens [k*T, k*T + T] of that epoch's stream: documents
// [doc_begin, doc_end) concatenated in the epoch's order (identity without shuffle, else a
// Philox Fisher-Yates permutation of stream "dstrain.gpt.documents" + epoch). Consecutive
// samples share one token; samples may span documents but never epochs. With shuffle, the
// samples of an epoch are visited in a second permutation (stream "dstrain.gpt.samples" +
// epoch). Everything is a pure function of (data, range, T, seed, epoch): no cache file.
class GPTDataset final : public SampleDataset {
 public:
  GPTDataset(std::shared_ptr<const IndexedDataset> data, int64_t doc_begin, int64_t doc_end, int64_t seq_len,
             int64_t vocab_size, bool shuffle, uint64_t seed);

  int64_t samples_per_epoch() const override { return samples_per_epoch_; }  // (tokens - 1) / T
  int64_t seq_len() const override { return seq_len_; }
  // out: (seq_len + 1) ids. Thread-safe.
  void read_sample(int64_t index, int32_t* out) const override;
  int64_t num_tokens() const override { return num_tokens_; }  // tokens in the document range
  std::vector<std::string> files() const override;             // {PREFIX.idx, PREFIX.bin}
  std::string describe() const override;

  const IndexedDataset& data() const { return *data_; }
  int64_t doc_begin() const { return doc_begin_; }
  int64_t doc_end() const { return doc_end_; }
  bool shuffle() const { return shuffle_; }
  uint64_t seed() const { return seed_; }
  // (doc_end - doc_begin) dataset document numbers in the order epoch `epoch` concatenates them.
  std::vector<int64_t> document_order(int64_t epoch) const;
  // (samples_per_epoch) the sample of the epoch's stream visited at each position of the epoch.
  std::vector<int64_t> sample_order(int64_t epoch) const;

 private:
  // One epoch's order and where each of its documents starts in the epoch's stream.
  struct Epoch {
    int64_t epoch = -1;
    std::vector<int64_t> documents;  // (n_docs) dataset document numbers in stream order
    std::vector<int64_t> starts;     // (n_docs + 1) stream offset of each document, then the total
    std::vector<int64_t> samples;    // (samples_per_epoch) visiting order; empty without shuffle
  };
  std::shared_ptr<const Epoch> epoch_arrays(int64_t epoch) const;
  std::shared_ptr<const Epoch> build_epoch(int64_t epoch) const;

  std::shared_ptr<const IndexedDataset> data_;
  int64_t doc_begin_, doc_end_;
  int64_t seq_len_;
  int64_t vocab_size_;
  bool shuffle_;
  uint64_t seed_;
  int64_t first_token_ = 0;  // flat token index of doc_begin's first token
  int64_t num_tokens_ = 0;
  int64_t samples_per_epoch_ = 0;

  // The two most recently used epochs: the prefetch thread may run one epoch ahead of the
  // main thread at an epoch boundary.
  mutable std::mutex mutex_;
  mutable std::shared_ptr<const Epoch> recent_[2];
};

}  // namespace dstrain
