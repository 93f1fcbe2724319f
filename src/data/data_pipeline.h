// The training data path: the configured datasets (llm.c shards or Megatron indexed
// datasets), blended by weight, checked for identical contents on every rank at start, and
// read ahead on a background thread so that a step waits for data as little as possible.
//
// The global batch of step s is the same samples whatever the number of ranks: every rank
// assigns the whole batch (dataset and index of each of its G samples) and reads the slice
// micro-step m, rank r, row i = position m*(dp*mb) + r*mb + i.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm.h"
#include "data/blend.h"
#include "data/sample_dataset.h"
#include "data/window_dataset.h"

namespace dstrain {

// One configured dataset: a format and its files (llm.c patterns, or one Megatron prefix).
struct DataSource {
  std::string name;
  std::string format = "llmc";  // "llmc" | "megatron"
  std::vector<std::string> paths;
  double weight = 1.0;
  json to_json() const;
};

struct DataConfig {
  std::vector<DataSource> train, val;
  std::vector<double> split;          // e.g. {98, 2}: train and validation documents of Megatron sources
  std::vector<BlendPhase> schedule;   // weights per phase; phase 0 comes from the sources' weights
  int64_t seq_len = 0;
  bool shuffle = true;
  std::string tokenizer = "byte";
  std::string validate = "full";      // cross-rank checksum of the files: "full", "sample" or "off"
  int64_t prefetch = 2;               // steps read ahead (0: read in the training thread)

  static DataConfig from_json(const JsonReader& r);
  json to_json() const;
};

// The datasets of a list of sources (validation sets never shuffle).
std::vector<std::shared_ptr<SampleDataset>> open_datasets(const std::vector<DataSource>& sources,
                                                          const DataConfig& config, int64_t vocab_size, uint64_t seed,
                                                          bool validation);

// xxHash64 of every file of the datasets on every rank, compared across ranks: a mismatch is
// an error on every rank naming the files and ranks. "sample" hashes the size and 64 spread
// blocks of each file instead of all of it.
void check_same_files_everywhere(const std::vector<std::string>& files, const std::string& mode, Communicator& world);

// What one optimizer step consumes on this rank.
struct StepData {
  int64_t step = 0;
  std::vector<Batch> micro;  // (grad_accum) micro-batches of (micro_batch, seq_len)
  json blend_before;         // the blender's state before this step (to read it again differently)
  json blend_after;          // the blender's state after this step (for checkpoints)
  std::vector<int64_t> drawn_after;
};

class DataPipeline {
 public:
  DataPipeline(const DataConfig& config, int64_t vocab_size, uint64_t seed, int64_t micro_batch, int64_t grad_accum,
               Communicator& dp, Communicator& world);
  ~DataPipeline();

  // Positions the stream at optimizer step `first_step` (with the blender state a checkpoint
  // recorded, or null for a new run) and starts reading ahead.
  void start(int64_t first_step, const json& blend_state);
  // The next step's batches; the time spent waiting for them is added to waited_seconds().
  StepData next();
  double take_wait_seconds();  // since the last call
  // Reads step `step` (and on) again with another micro-batch split of the same global batch,
  // from the blender state the step began with.
  void reconfigure(int64_t micro_batch, int64_t grad_accum, int64_t step, const json& blend_before);

  const std::vector<std::shared_ptr<SampleDataset>>& train_sets() const { return train_; }
  const std::vector<DataSource>& train_sources() const { return config_.train; }
  // The realised mix after the last consumed step, e.g. "web 70.1% (target 70.0%), code 29.9% (30.0%)".
  std::string mix_report() const;
  const std::vector<int64_t>& drawn() const { return consumed_drawn_; }
  const json& blend_state() const { return consumed_blend_; }
  int64_t samples_per_step() const { return G_; }

 private:
  StepData produce(int64_t step);
  void producer_loop();
  void stop();

  DataConfig config_;
  std::vector<std::shared_ptr<SampleDataset>> train_;
  int64_t mb_, accum_, dp_size_, dp_rank_, G_;
  Blender blender_;
  json consumed_blend_;
  std::vector<int64_t> consumed_drawn_;
  int64_t next_step_ = 0;

  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<StepData> queue_;
  std::exception_ptr error_;
  bool stopping_ = false;
  double waited_ = 0;
};

}  // namespace dstrain
