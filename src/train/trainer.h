// The training loop. For each step: for each micro-batch, next batch, forward, backward
// (gradients accumulate; on the last micro-batch they are all-reduced bucket by bucket over
// the data-parallel ranks while the backward runs); then finish the reduction, clip,
// schedule, AdamW; then metrics, evaluation, samples.
#pragma once

#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "data/window_dataset.h"
#include "model/transformer.h"
#include "optim/adamw.h"
#include "parallel/grad_reducer.h"
#include "parallel/grid.h"
#include "train/checkpointing.h"
#include "train/run_config.h"

namespace dstrain {

struct StepRecord {
  int64_t step = 0;  // 1-based number of the optimizer step
  double loss = 0;   // mean token loss over the global batch
  double lr = 0;
  double grad_norm = 0;  // before clipping
  double step_seconds = 0;
  double tokens_per_s = 0;       // global
  double comm_seconds = 0;       // gradient all-reduce time (overlapped or not)
  double exposed_comm_seconds = 0;  // part of the step spent waiting for communication
  // Per rank of the world (index = rank): step time and compute time (step minus exposed
  // communication), for load balance.
  std::vector<double> rank_step_seconds, rank_compute_seconds;
};

class Trainer {
 public:
  // The grid's data axis gives the data-parallel ranks; the trainer keeps a reference.
  Trainer(RunConfig config, ProcessGrid& grid, Device device = Device::cpu());

  // Initial weights: from a Hugging Face directory, a safetensors file or a dstrain
  // checkpoint (its model tensors) when given, otherwise Hugging Face's initialisation from
  // train.seed.
  void init_weights(const std::string& init_from);
  // Continues a run: "auto" takes the newest valid checkpoint of checkpoint.dir (an invalid
  // one is reported and the next older one tried); otherwise `spec` is a checkpoint file.
  // Weights, optimizer state, step, schedule and data position are restored. Returns false
  // when "auto" found no checkpoint at all.
  bool resume(const std::string& spec);
  // Writes a checkpoint of the current state (in the background when checkpoint.async);
  // returns the seconds training was held up.
  double save_checkpoint();
  CheckpointManager& checkpoints() { return *ckpt_; }
  // Trains until train.max_steps optimizer steps have been taken.
  void train();
  // Mean token loss over the first `batches` micro-batches of windows of the evaluation
  // data, in order (no shuffle); the windows are shared out over the data-parallel ranks.
  LossSums evaluate(int64_t batches);
  // A sample continuation of the configured prompt (the same on every rank).
  std::string sample(const std::string& prompt);
  // Writes Hugging Face weights (rank 0; every rank returns after the files exist).
  void save_hf(const std::string& dir);

  Transformer& model() { return *model_; }
  AdamW& optimizer() { return *optimizer_; }
  const RunConfig& config() const { return config_; }
  const std::vector<StepRecord>& history() const { return history_; }
  int64_t step() const { return step_; }
  // Called after every optimizer step (tests check cross-rank agreement here).
  std::function<void(const StepRecord&)> on_step;

 private:
  StepRecord train_step();
  void print_progress(const StepRecord& r, double elapsed, int64_t steps_this_run) const;
  void write_metrics(const json& record);
  WindowDataset& eval_dataset();
  WindowDataset& train_dataset();
  Tokenizer& tokenizer();
  TrainState state();
  bool checkpoint_due(int64_t step);

  RunConfig config_;
  ProcessGrid& grid_;
  Communicator& dp_;
  std::ofstream metrics_;  // output.dir/metrics.jsonl (rank 0): one JSON object per step and evaluation
  std::unique_ptr<Transformer> model_;
  std::unique_ptr<AdamW> optimizer_;
  std::unique_ptr<GradReducer> reducer_;
  std::unique_ptr<CheckpointManager> ckpt_;
  int64_t last_saved_step_ = -1;
  std::chrono::steady_clock::time_point last_save_time_ = std::chrono::steady_clock::now();
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<WindowDataset> train_data_, eval_data_;
  std::unique_ptr<WindowSampler> sampler_;
  std::vector<Batch> micro_batches_;
  int64_t step_ = 0;              // optimizer steps taken
  int64_t consumed_samples_ = 0;  // windows consumed by those steps (global)
  std::vector<StepRecord> history_;
};

}  // namespace dstrain
