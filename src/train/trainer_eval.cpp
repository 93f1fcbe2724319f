// Evaluation and samples of the model being trained.
#include "train/trainer.h"

#include "core/log.h"
#include "train/generate.h"

namespace dstrain {
const std::vector<std::shared_ptr<SampleDataset>>& Trainer::eval_datasets() {
  if (eval_sets_.empty()) {
    const DataConfig& dc = config_.data;
    std::vector<DataSource> sources = dc.val;
    if (sources.empty()) {
      sources = dc.train;  // with data.split: their validation documents; otherwise the training data itself
      if (dc.split.empty()) log::info("no data.val configured: evaluating on the first samples of data.train");
    }
    eval_sets_ = open_datasets(sources, dc, config_.model.vocab_size, config_.train.seed, /*validation=*/true);
    for (const DataSource& s : sources) eval_names_.push_back(s.name);
  }
  return eval_sets_;
}

std::vector<LossSums> Trainer::evaluate_each(int64_t batches) {
  const auto& sets = eval_datasets();
  const int64_t mb = config_.train.micro_batch, T = config_.data.seq_len;
  // Per dataset, then over all of them: loss sum, target count, targets ranked first.
  std::vector<double> sums(3 * sets.size() + 3, 0.0);
  std::vector<int32_t> sample(static_cast<size_t>(T + 1)), inputs, targets;
  for (size_t d = 0; d < sets.size(); ++d) {
    const int64_t n = std::min(batches * mb, sets[d]->samples_per_epoch());
    // Micro-batch k of each dataset goes to data-parallel rank k % dp. Every rank runs as many
    // forward passes as the busiest: the layers' collectives over data ranks (the expert
    // all-to-all, ZeRO-3's weight gathers) need all of them, so a rank past the end runs the
    // first micro-batch again and does not count it (fewer batches than data ranks would
    // otherwise leave the others waiting for it).
    const int64_t micro_batches = (n + mb - 1) / mb, rounds = (micro_batches + dp_.size() - 1) / dp_.size();
    for (int64_t k = 0; k < rounds; ++k) {
      const int64_t mine = (k * dp_.size() + dp_.rank()) * mb;
      const bool counted = mine < n;
      const int64_t first = counted ? mine : 0, rows = std::min(mb, n - first);
      inputs.resize(size_t(rows * T));
      targets.resize(size_t(rows * T));
      for (int64_t i = 0; i < rows; ++i) {
        sets[d]->read_sample(first + i, sample.data());
        std::copy_n(sample.begin(), T, inputs.begin() + i * T);
        std::copy_n(sample.begin() + 1, T, targets.begin() + i * T);
      }
      const Tensor x = tokens_tensor(inputs, rows, T), y = tokens_tensor(targets, rows, T);
      LossSums s = runner_ ? runner_->forward_loss(x, y) : model_->forward_loss(x, y);
      if (!counted) continue;
      sums[3 * d] += s.sum;
      sums[3 * d + 1] += double(s.count);
      sums[3 * d + 2] += double(s.correct);
    }
    for (size_t k = 0; k < 3; ++k) sums[3 * sets.size() + k] += sums[3 * d + k];
  }
  dp_.all_reduce(Tensor(sums.data(), DType::F64, Shape{int64_t(sums.size())}));
  std::vector<LossSums> out;
  for (size_t d = 0; d <= sets.size(); ++d) {
    LossSums ls;
    ls.sum = sums[3 * d];
    ls.count = int64_t(sums[3 * d + 1]);
    ls.correct = int64_t(sums[3 * d + 2]);
    out.push_back(ls);
  }
  return out;
}

std::string Trainer::eval_report(const std::vector<LossSums>& e) const {
  std::string s = fmt::format("val loss {:.4f}, accuracy {:.2f}% over {} tokens", e.back().mean(),
                              100 * e.back().accuracy(), e.back().count);
  if (e.size() > 2) {
    for (size_t d = 0; d + 1 < e.size(); ++d) {
      s += fmt::format("{} {} {:.4f} ({:.2f}%)", d ? "," : " |", eval_names_[d], e[d].mean(), 100 * e[d].accuracy());
    }
  }
  return s;
}

std::string Trainer::sample(const std::string& prompt) {
  // Documents follow an end-of-document token in the training stream, so a prompt does too.
  Tokenizer& tok = tokenizer();
  std::vector<int32_t> ids = tok.encode(prompt);
  ids.insert(ids.begin(), tok.eos_id());
  std::vector<int64_t> stops = {tok.eos_id()};
  // Through the pipeline's stages (the logits reach every rank) or this rank's whole model.
  const LastLogitsFn last_logits = [&](Tensor t, Tensor logits) {
    runner_ ? runner_->last_logits(t, logits) : model_->last_logits(t, logits);
  };
  std::vector<int32_t> out = generate_tokens(config_.model, last_logits, ids, config_.generate, config_.data.seq_len,
                                             tok.vocab_size(), stops);
  return tok.decode(out);
}

}  // namespace dstrain
