// The training loop. For each step: for each micro-batch, next batch, forward, backward
// (gradients accumulate); then clip, schedule, AdamW; then metrics, evaluation, samples.
#pragma once

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "data/window_dataset.h"
#include "model/transformer.h"
#include "optim/adamw.h"
#include "train/run_config.h"

namespace dstrain {

struct StepRecord {
  int64_t step = 0;  // 1-based number of the optimizer step
  double loss = 0;   // mean token loss over the global batch
  double lr = 0;
  double grad_norm = 0;  // before clipping
  double step_seconds = 0;
  double tokens_per_s = 0;
};

class Trainer {
 public:
  explicit Trainer(RunConfig config, Device device = Device::cpu());

  // Initial weights: from a Hugging Face directory or safetensors file when given,
  // otherwise Hugging Face's initialisation from train.seed.
  void init_weights(const std::string& init_from);
  // Trains until train.max_steps optimizer steps have been taken.
  void train();
  // Mean token loss over the first `batches` micro-batches of windows of the evaluation
  // data, in order (no shuffle).
  LossSums evaluate(int64_t batches);
  // A sample continuation of the configured prompt.
  std::string sample(const std::string& prompt);

  Transformer& model() { return *model_; }
  AdamW& optimizer() { return *optimizer_; }
  const RunConfig& config() const { return config_; }
  const std::vector<StepRecord>& history() const { return history_; }
  int64_t step() const { return step_; }

 private:
  StepRecord train_step();
  void print_progress(const StepRecord& r, double elapsed) const;
  WindowDataset& eval_dataset();
  Tokenizer& tokenizer();

  RunConfig config_;
  std::ofstream metrics_;  // output.dir/metrics.jsonl: one JSON object per step and evaluation
  std::unique_ptr<Transformer> model_;
  std::unique_ptr<AdamW> optimizer_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<WindowDataset> train_data_, eval_data_;
  std::unique_ptr<WindowSampler> sampler_;
  std::vector<Batch> micro_batches_;
  int64_t step_ = 0;              // optimizer steps taken
  int64_t consumed_samples_ = 0;  // windows consumed by those steps (global)
  std::vector<StepRecord> history_;
};

}  // namespace dstrain
