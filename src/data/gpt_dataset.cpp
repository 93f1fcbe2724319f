// GPT samples over Megatron indexed datasets: split ranges, per-epoch document and sample
// orders from counter-based Philox streams, and sample reads that may span documents.
#include "data/gpt_dataset.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "core/philox.h"

namespace dstrain {

namespace {

// Fisher-Yates over 0..n-1: the swap partner of step i is drawn from number i of the stream,
// so the permutation depends only on (seed, stream, n).
std::vector<int64_t> philox_permutation(int64_t n, uint64_t seed, uint64_t stream) {
  std::vector<int64_t> perm(static_cast<size_t>(n));
  std::iota(perm.begin(), perm.end(), int64_t(0));
  for (int64_t i = n - 1; i > 0; --i) {
    const double u = philox_uniform(seed, stream, uint64_t(i));
    // u < 1, but u * (i+1) may round up to i+1 for huge i.
    const int64_t j = std::min(int64_t(u * double(i + 1)), i);
    std::swap(perm[size_t(i)], perm[size_t(j)]);
  }
  return perm;
}

}  // namespace

std::pair<int64_t, int64_t> split_range(int64_t num_documents, const std::vector<double>& weights, int which) {
  DS_CHECK(num_documents >= 0, "cannot split {} documents", num_documents);
  DS_CHECK(!weights.empty(), "split weights are empty; give one weight per split, e.g. [0.98, 0.02]");
  DS_CHECK(which >= 0 && size_t(which) < weights.size(), "split {} does not exist: there are {} split weights", which,
           weights.size());
  double sum = 0;
  for (double w : weights) {
    DS_CHECK(std::isfinite(w) && w >= 0, "split weight {} is not a finite non-negative number; use weights such as "
             "[0.98, 0.02]", w);
    sum += w;
  }
  DS_CHECK(sum > 0, "split weights sum to 0; at least one must be positive");
  // Megatron: index[k+1] = index[k] + round(w_k / sum * n); then every index after the first
  // moves by the rounding surplus so that the last is n. Python's round() is half-to-even, as
  // is nearbyint in the default rounding mode.
  std::vector<int64_t> index{0};
  for (double w : weights) index.push_back(index.back() + int64_t(std::nearbyint(w / sum * double(num_documents))));
  const int64_t surplus = index.back() - num_documents;
  for (size_t k = 1; k < index.size(); ++k) {
    index[k] = std::clamp(index[k] - surplus, index[k - 1], num_documents);
  }
  return {index[size_t(which)], index[size_t(which) + 1]};
}

GPTDataset::GPTDataset(std::shared_ptr<const IndexedDataset> data, int64_t doc_begin, int64_t doc_end, int64_t seq_len,
                       int64_t vocab_size, bool shuffle, uint64_t seed)
    : data_(std::move(data)),
      doc_begin_(doc_begin),
      doc_end_(doc_end),
      seq_len_(seq_len),
      vocab_size_(vocab_size),
      shuffle_(shuffle),
      seed_(seed) {
  DS_CHECK(data_ != nullptr, "GPTDataset needs an IndexedDataset, got none");
  // The upper bound keeps T+1 and k*T far from overflow; no real sequence comes near it.
  DS_CHECK(seq_len > 0 && seq_len <= (int64_t(1) << 40), "the sequence length T must be in [1, 2^40], got {}", seq_len);
  DS_CHECK(vocab_size > 0, "the vocabulary size must be positive, got {}", vocab_size);
  DS_CHECK(doc_begin >= 0 && doc_begin <= doc_end && doc_end <= data_->num_documents(),
           "document range [{}, {}) is outside Megatron dataset {} ({} documents)", doc_begin, doc_end,
           data_->prefix(), data_->num_documents());
  // Documents tile the .bin, so a range of them is one run of the flat token array.
  if (doc_begin < doc_end) {
    first_token_ = data_->document_tokens(doc_begin).first;
    num_tokens_ = data_->document_tokens(doc_end - 1).second - first_token_;
  }
  DS_CHECK(num_tokens_ >= seq_len + 1,
           "Megatron dataset {}: documents [{}, {}) hold {} tokens, fewer than the T+1 = {} one sample needs; use a "
           "shorter sequence length, a larger split or more data",
           data_->prefix(), doc_begin, doc_end, num_tokens_, seq_len + 1);
  samples_per_epoch_ = (num_tokens_ - 1) / seq_len;
}

std::vector<std::string> GPTDataset::files() const { return {data_->idx_path(), data_->bin_path()}; }

std::string GPTDataset::describe() const {
  return fmt::format("megatron {}: documents [{}, {}) of {}, {} tokens ({}), {} samples of T+1 = {} tokens per epoch, "
                     "shuffle {}",
                     data_->prefix(), doc_begin_, doc_end_, data_->num_documents(), num_tokens_,
                     indexed_dtype_name(uint8_t(data_->dtype())), samples_per_epoch_, seq_len_ + 1,
                     shuffle_ ? fmt::format("on (seed {})", seed_) : std::string("off"));
}

std::vector<int64_t> GPTDataset::document_order(int64_t epoch) const {
  DS_CHECK(epoch >= 0, "epoch {} is negative", epoch);
  const int64_t n = doc_end_ - doc_begin_;
  std::vector<int64_t> order =
      shuffle_ ? philox_permutation(n, seed_, stream_id("dstrain.gpt.documents") + uint64_t(epoch))
               : std::vector<int64_t>(static_cast<size_t>(n));
  if (!shuffle_) std::iota(order.begin(), order.end(), int64_t(0));
  for (int64_t& d : order) d += doc_begin_;
  return order;
}

std::vector<int64_t> GPTDataset::sample_order(int64_t epoch) const {
  DS_CHECK(epoch >= 0, "epoch {} is negative", epoch);
  if (shuffle_) {
    return philox_permutation(samples_per_epoch_, seed_, stream_id("dstrain.gpt.samples") + uint64_t(epoch));
  }
  std::vector<int64_t> order(static_cast<size_t>(samples_per_epoch_));
  std::iota(order.begin(), order.end(), int64_t(0));
  return order;
}

std::shared_ptr<const GPTDataset::Epoch> GPTDataset::build_epoch(int64_t epoch) const {
  auto e = std::make_shared<Epoch>();
  e->epoch = epoch;
  e->documents = document_order(epoch);
  e->starts.resize(e->documents.size() + 1);
  e->starts[0] = 0;
  for (size_t k = 0; k < e->documents.size(); ++k) {
    const auto [first, last] = data_->document_tokens(e->documents[k]);
    e->starts[k + 1] = e->starts[k] + (last - first);
  }
  e->samples = sample_order(epoch);
  return e;
}

std::shared_ptr<const GPTDataset::Epoch> GPTDataset::epoch_arrays(int64_t epoch) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (recent_[0] && recent_[0]->epoch == epoch) return recent_[0];
  if (recent_[1] && recent_[1]->epoch == epoch) {
    std::swap(recent_[0], recent_[1]);
    return recent_[0];
  }
  // Built under the lock: threads that want the same new epoch wait for one build instead of
  // each making their own; an epoch changes once per pass over the data.
  recent_[1] = std::move(recent_[0]);
  recent_[0] = build_epoch(epoch);
  return recent_[0];
}

void GPTDataset::read_sample(int64_t index, int32_t* out) const {
  DS_CHECK(index >= 0, "sample index {} is negative", index);
  const int64_t epoch = index / samples_per_epoch_;
  const int64_t k = index % samples_per_epoch_;
  const int64_t count = seq_len_ + 1;

  // The sample as runs of the flat token array: (first flat token, tokens) for each document
  // it touches, in stream order. Without shuffle the stream is the flat array itself.
  std::shared_ptr<const Epoch> e;
  if (shuffle_) e = epoch_arrays(epoch);
  const auto for_each_run = [&](auto&& fn) {
    if (!e) {
      fn(int64_t(0), first_token_ + k * seq_len_, count);
      return;
    }
    const int64_t start = e->samples[size_t(k)] * seq_len_;
    // The document whose stream range [starts[p], starts[p+1]) holds `start`; empty documents
    // share their start with the next one and upper_bound skips past them.
    size_t p = size_t(std::upper_bound(e->starts.begin(), e->starts.end(), start) - e->starts.begin()) - 1;
    int64_t skip = start - e->starts[p];
    int64_t done = 0;
    while (done < count) {
      const int64_t first = data_->document_tokens(e->documents[p]).first;
      const int64_t take = std::min(count - done, e->starts[p + 1] - e->starts[p] - skip);
      if (take > 0) fn(done, first + skip, take);
      done += std::max<int64_t>(take, 0);
      skip = 0;
      ++p;
    }
  };
  for_each_run([&](int64_t at, int64_t first, int64_t n) { data_->read_flat(first, n, out + at); });

  // read_flat gave ids in [0, 2^31); one compare per token, the reporting path only on failure.
  if (std::any_of(out, out + count, [&](int32_t id) { return id >= vocab_size_; })) [[unlikely]] {
    for_each_run([&](int64_t at, int64_t first, int64_t n) {
      for (int64_t j = 0; j < n; ++j) {
        DS_CHECK(out[at + j] < vocab_size_,
                 "{}: token {} (byte offset {}) has id {}, outside the model's vocabulary of {} (sample {}); check "
                 "that the data was tokenized with this model's tokenizer and vocabulary",
                 data_->bin_path(), first + j, (first + j) * data_->itemsize(), out[at + j], vocab_size_, index);
      }
    });
  }
}

}  // namespace dstrain
