// What a run shows while it runs: per-step metrics (loss, learning rate, gradient norm,
// tokens/s, model FLOP/s and MFU, the step's time split, memory by category, skipped steps),
// the spread over ranks with the slowest named, warnings when the run leaves its normal
// range, and the outputs users already read: a progress line (a live bar on a terminal),
// metrics.jsonl, TensorBoard event files, a Prometheus text endpoint served by rank 0, and an
// end-of-run summary with a bottleneck table.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/json_reader.h"
#include "model/model_config.h"
#include "train/timeline.h"

namespace dstrain {

struct MetricsConfig {
  std::string progress = "auto";   // "auto" (a live bar when stdout is a terminal), "bar", "lines"
  int64_t prometheus_port = 0;     // 0: no endpoint
  std::string prometheus_bind = "127.0.0.1";  // the address it listens on (0.0.0.0: every interface)
  double peak_tflops = 0;          // per rank; 0 (key absent): measured at start with sgemm
  double memory_budget_gb = 0;     // per rank; 0: the node's memory over its ranks
  // What the memory model assumes of expert parallelism's loads: the most rows one expert rank
  // receives over the mean, in any MoE layer (a run reports it per layer as
  // moe.<layer>.received_max_over_mean). 1: balanced; the rank the model runs takes the hot share
  // in every MoE layer.
  double expert_imbalance = 1;
  TimelineSteps timeline_steps;    // the steps whose schedule is recorded (train/timeline.h); off
  // Rank 0 writes TensorBoard events there (train/tensorboard.h); "": none. Relative to the
  // working directory, like output.dir. The trainer claims it for the run first.
  std::string tensorboard_dir;
  static MetricsConfig from_json(const JsonReader& r);
  json to_json() const;
};

// The time of one optimizer step, split by phase (seconds).
struct StepTimes {
  double total = 0, data_wait = 0, forward = 0, backward = 0, exposed_comm = 0, optimizer = 0, checkpoint = 0;
  double other() const { return std::max(0.0, total - data_wait - forward - backward - exposed_comm - optimizer - checkpoint); }
};

// Everything one step reports (filled by the trainer; rank-indexed vectors cover the world).
struct StepMetrics {
  int64_t step = 0, max_steps = 0;
  double loss = 0, lr = 0, grad_norm = 0;
  double tokens_per_s = 0;
  int64_t tokens = 0;           // consumed so far (global)
  double elapsed_s = 0;         // since this run started
  int64_t steps_this_run = 0;   // for the ETA after a resume
  StepTimes time;
  double comm_s = 0;            // all-reduce time, overlapped or not
  bool skipped = false;
  int64_t skipped_total = 0;
  // fp16 loss scaling (loss_scaling false: bf16 or fp32, none of these are reported): the scale
  // of the step, whether its gradients overflowed (the step skipped, not counted in
  // skipped_total) and the steps skipped so in the run.
  bool loss_scaling = false;
  double loss_scale = 1;
  bool overflow = false;
  int64_t overflow_skipped_total = 0;
  std::vector<double> rank_step_s, rank_compute_s, rank_peak_rss_bytes;
  json extra = json::object();  // e.g. data mix, routing health
};

// Model FLOP/s per rank and the fraction of peak it is (MFU).
struct Utilisation {
  double model_flops_per_s = 0;  // per rank
  double mfu = 0;
};
Utilisation utilisation(double global_tokens_per_s, double flops_per_token, int world_size, double peak_flops);

// The per-rank peak MFU is measured against, and where it came from.
struct Peak {
  double flops = 0;    // FLOP/s per rank
  std::string source;  // "measured: best of 5 trials of sgemm 1024x1024x1024 on 2 threads", ...
};
// GEMM FLOP/s on this rank's threads: the best of up to `trials` trials of at least
// `trial_seconds` each (at least 3 trials; no new one after half a second). The best, not the
// median: another process on the cores can only slow a trial down. The fp32 sgemm, or with a
// BF16 compute dtype on a CPU with hardware bf16 the bf16 GEMM its layers run on.
Peak measure_peak_flops(int trials = 5, double trial_seconds = 0.05, DType compute = DType::F32);
// What Metrics calls to measure the peak (tests inject their own values).
using PeakMeasure = std::function<Peak()>;
// Physical memory of this node (MemTotal of /proc/meminfo); 0 when unknown.
double node_memory_bytes();
// This process's resident memory now (VmRSS of /proc/self/status); 0 when unknown.
double current_rss_bytes();

class Metrics {
 public:
  // Rank 0 writes and serves; every rank constructs it (the peak is measured on each, with
  // `measure`, measure_peak_flops when empty, unless metrics.peak_tflops gives it). When a
  // step's model FLOP/s exceed a measured peak, rank 0 measures again and keeps the higher;
  // an MFU still above 100% is reported as a wrong peak, never as a reading.
  Metrics(const MetricsConfig& config, const ModelConfig& model, int64_t seq_len, int rank, int world_size,
          int local_size, const std::string& output_dir, int64_t steps_per_print, PeakMeasure measure = {});
  ~Metrics();

  double peak_flops() const { return peak_flops_; }
  const std::string& peak_source() const { return peak_source_; }
  double flops_per_token() const { return flops_per_token_; }
  double memory_budget_bytes() const { return budget_bytes_; }

  // The head of metrics.jsonl: the job's environment and the peak (rank 0).
  void on_run_start(const json& environment);
  void on_step(const StepMetrics& m);
  // An evaluation: mean token loss, token accuracy (targets ranked first) and the tokens, over
  // every evaluation dataset together and per dataset ({name: {loss, accuracy, tokens}}).
  void on_eval(int64_t step, double loss, double accuracy, int64_t tokens, const json& per_dataset);
  void on_checkpoint(int64_t step, double stall_s, bool async);
  void on_run_end();  // the summary (rank 0)
  // Adds a step to the summary and the endpoint's state (on_step does, on rank 0); `record` is its
  // metrics.jsonl record. `dstrain status` replays a run's records through it, on any rank.
  void add_step(const StepMetrics& m, const json& record);

  // The Prometheus text exposition of the latest state (what the endpoint serves).
  std::string prometheus_text() const;
  // The bottleneck table of the run so far.
  std::string summary_table() const;
  // The JSON record written for a step (metrics.jsonl schema).
  json step_record(const StepMetrics& m) const;

 private:
  void write(const json& record);
  void print_progress(const StepMetrics& m);
  void warn_if_abnormal(const StepMetrics& m);
  void check_peak(const StepMetrics& m);

  MetricsConfig config_;
  int rank_, world_;
  double peak_flops_ = 0, flops_per_token_ = 0, budget_bytes_ = 0;
  std::string peak_source_;
  int64_t steps_per_print_;
  PeakMeasure measure_;
  int remeasured_ = 0;
  int64_t last_remeasure_step_ = 0;
  bool bar_ = false;
  std::string jsonl_path_;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dstrain
